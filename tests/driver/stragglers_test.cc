// Straggler detection's rules (driver/stragglers.h) on their own: windows, verdicts, streaks.
#include "driver/stragglers.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <limits>

namespace elastic::driver {
namespace {

rendezvous::Report Commit(int64_t round, int64_t step, double compute, double wait) {
  rendezvous::Report r;
  r.kind = rendezvous::ReportKind::kCommitted;
  r.round = round;
  r.step = r.version = step;
  r.compute_seconds = compute;
  r.wait_seconds = wait;
  return r;
}

TEST_CASE("stragglers: a sub-window closes every window/4 steps with its per-step figures",
          "[unit]") {
  WorkerState w;
  CHECK_FALSE(ObserveCommit(w, Commit(3, 10, 1.0, 0.5), 20));  // the first report anchors
  CHECK(w.step_compute == -1);
  CHECK_FALSE(ObserveCommit(w, Commit(3, 14, 1.4, 0.6), 20));  // 4 steps: not yet 5
  CHECK(ObserveCommit(w, Commit(3, 15, 2.0, 1.0), 20));
  CHECK(w.step_compute == Approx(0.2));  // (2.0 - 1.0) / 5
  CHECK(w.step_wait == Approx(0.1));
  CHECK(w.window_step == 15);
  // A new round: a new communicator, whose sums start again from 0.
  CHECK_FALSE(ObserveCommit(w, Commit(4, 16, 0.01, 0.0), 20));
  CHECK(w.step_compute == -1);
  CHECK(w.window_round == 4);
  CHECK(ObserveCommit(w, Commit(4, 21, 0.51, 0.1), 20));
  CHECK(w.step_compute == Approx(0.1));
}

TEST_CASE("stragglers: reports without figures, or with figures out of range, start over",
          "[unit]") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  for (auto [compute, wait] : {std::pair{0.0, 0.0}, {nan, 1.0}, {1.0, inf}, {-1.0, 1.0},
                               {1e12, 1.0}}) {
    WorkerState w;
    REQUIRE_FALSE(ObserveCommit(w, Commit(0, 0, 1.0, 1.0), 4));
    CHECK_FALSE(ObserveCommit(w, Commit(0, 4, compute, wait), 4));
    CHECK(w.window_round == -1);
    CHECK(w.step_compute == -1);
  }
  WorkerState w;  // sums that go back (not the same communicator's): a new anchor
  REQUIRE_FALSE(ObserveCommit(w, Commit(0, 0, 5.0, 1.0), 4));
  CHECK_FALSE(ObserveCommit(w, Commit(0, 4, 1.0, 1.0), 4));
  CHECK(ObserveCommit(w, Commit(0, 5, 2.0, 1.0), 4));
  CHECK(w.step_compute == Approx(1.0));
}

TEST_CASE("stragglers: slow against the peers' median, with a floor for timer noise", "[unit]") {
  WorkerState w;
  w.step_compute = 0.030;
  w.step_wait = 0.001;
  auto v = JudgeStraggler(w, {0.010, 0.011, 0.050}, 1.5);  // the median: 0.011
  REQUIRE(v);
  CHECK(v->slow);
  CHECK_FALSE(v->fast);
  CHECK(v->median == Approx(0.011));
  CHECK(v->ratio == Approx(0.030 / 0.011));
  v = JudgeStraggler(w, {0.010, 0.030}, 1.5);  // even: the mean of the middle two
  CHECK(v->median == Approx(0.020));
  CHECK(v->slow);
  v = JudgeStraggler(w, {0.025}, 1.5);  // 1.2x: below 1.25, the half-way mark
  CHECK_FALSE(v->slow);
  CHECK(v->fast);
  v = JudgeStraggler(w, {0.022}, 1.5);  // 1.36x: neither
  CHECK_FALSE(v->slow);
  CHECK_FALSE(v->fast);
  w.step_compute = 0.0008;  // 8x, but under a millisecond more: noise
  v = JudgeStraggler(w, {0.0001}, 1.5);
  CHECK_FALSE(v->slow);
  CHECK(v->fast);
  CHECK_FALSE(JudgeStraggler(w, {}, 1.5));  // no peer measured yet
  w.step_compute = -1;
  CHECK_FALSE(JudgeStraggler(w, {0.01}, 1.5));
}

TEST_CASE("stragglers: named after four slow sub-windows in a row, cleared after four fast",
          "[unit]") {
  WorkerState w;
  StragglerVerdict slow, fast, between;
  slow.slow = true;
  fast.fast = true;
  for (int i = 0; i < 3; ++i) CHECK(ApplyVerdict(w, slow) == 0);
  CHECK(ApplyVerdict(w, between) == 0);  // a sub-window that was not slow: the streak ends
  for (int i = 0; i < 3; ++i) CHECK(ApplyVerdict(w, slow) == 0);
  CHECK(ApplyVerdict(w, slow) == 1);
  CHECK(w.straggler);
  CHECK(ApplyVerdict(w, slow) == 0);  // named once
  for (int i = 0; i < 3; ++i) CHECK(ApplyVerdict(w, fast) == 0);
  CHECK(ApplyVerdict(w, between) == 0);
  for (int i = 0; i < 3; ++i) CHECK(ApplyVerdict(w, fast) == 0);
  CHECK(ApplyVerdict(w, fast) == -1);
  CHECK_FALSE(w.straggler);
}

}  // namespace
}  // namespace elastic::driver
