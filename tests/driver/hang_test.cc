// Hang detection's rules (driver/hang.h) on state values alone: the timeout, the round's
// progress, and who holds a stalled round up.
#include "driver/hang.h"

#include <catch2/catch.hpp>

namespace elastic::driver {
namespace {

using namespace std::chrono_literals;

const TimePoint kT0 = TimePoint(std::chrono::hours(1));

// A formed round 4 of `n` members (slots "h:0".."h:<n-1>"), formed at kT0, every member heard
// from in round 4 at `heard`, in a collective, with `collectives` started.
PolicyState Round(int n, TimePoint heard, int64_t collectives = 10) {
  PolicyState s;
  s.started = true;
  s.round = s.formed = 4;
  s.formed_at = kT0;
  for (int i = 0; i < n; ++i) {
    std::string slot = "h:" + std::to_string(i);
    WorkerState& w = s.workers[slot];
    w.slot = slot;
    w.running = true;
    w.round = 4;
    w.rank = i;
    w.heard_at = heard;
    w.heard_round = 4;
    w.in_collective = true;
    w.collectives = collectives;
    s.formed_members.push_back(slot);
  }
  return s;
}

TEST_CASE("hang: the timeout is --hang-timeout, else 10x the slowest step, at least 60 s",
          "[unit]") {
  CHECK(HangTimeout(7s, 100s) == 7s);  // given: as given
  CHECK(HangTimeout(0s, 0s) == 300s);  // no step seen yet
  CHECK(HangTimeout(0s, 2s) == 60s);   // 20 s: the floor
  CHECK(HangTimeout(0s, 30s) == 300s);
}

TEST_CASE(
    "hang: progress is the newest commit or collective, the limit doubled before the "
    "round's first commit",
    "[unit]") {
  PolicyState s = Round(2, kT0);
  RoundProgress p = ProgressOf(s, 10s);
  CHECK(p.at == kT0);
  CHECK_FALSE(p.committed);
  CHECK(p.limit == 20s);
  s.workers["h:1"].moved_at = kT0 + 5s;
  CHECK(ProgressOf(s, 10s).at == kT0 + 5s);
  // A commit from before the round formed is not this round's.
  s.workers["h:0"].commit_at = kT0 - 1s;
  CHECK_FALSE(ProgressOf(s, 10s).committed);
  s.workers["h:0"].commit_at = kT0 + 8s;
  p = ProgressOf(s, 10s);
  CHECK(p.committed);
  CHECK(p.at == kT0 + 8s);
  CHECK(p.limit == 10s);
}

TEST_CASE("hang: nothing is judged within the limit, or outside a formed, training round",
          "[unit]") {
  PolicyState s = Round(3, kT0 + 19s);
  CHECK(FindHang(s, kT0 + 19s, 10s).kind == HangVerdict::kNone);  // 20 s before a commit
  for (auto change :
       {+[](PolicyState& x) { x.finishing = true; },
        +[](PolicyState& x) { x.shutting_down = true; }, +[](PolicyState& x) { x.started = false; },
        +[](PolicyState& x) { x.round = 5; }}) {
    PolicyState t = Round(3, kT0 + 25s);
    change(t);
    CHECK(FindHang(t, kT0 + 25s, 10s).kind == HangVerdict::kNone);
  }
}

TEST_CASE("hang: a silent member is named first", "[unit]") {
  PolicyState s = Round(3, kT0 + 25s);
  s.workers["h:1"].heard_at = kT0 + 22s;   // 3 s without a report
  s.workers["h:2"].in_collective = false;  // idle too, but not silent
  HangVerdict v = FindHang(s, kT0 + 25s, 10s);
  REQUIRE(v.kind == HangVerdict::kCulprits);
  CHECK(v.culprits == std::vector<std::string>{"h:1"});
  CHECK(v.why.find("silent") != std::string::npos);
  CHECK(v.stalled == 25s);
}

TEST_CASE("hang: a member out of the collective its peers wait in is named", "[unit]") {
  PolicyState s = Round(3, kT0 + 25s);
  s.workers["h:0"].in_collective = false;
  HangVerdict v = FindHang(s, kT0 + 25s, 10s);
  REQUIRE(v.kind == HangVerdict::kCulprits);
  CHECK(v.culprits == std::vector<std::string>{"h:0"});
  CHECK(v.why.find("not in a collective") != std::string::npos);
  // A member whose reports are of an older round counts as out of it, whatever it says.
  s = Round(3, kT0 + 25s);
  s.workers["h:2"].heard_round = 3;
  v = FindHang(s, kT0 + 25s, 10s);
  CHECK(v.culprits == std::vector<std::string>{"h:2"});
}

TEST_CASE("hang: when all are out of collectives, those that started fewer are named", "[unit]") {
  PolicyState s = Round(3, kT0 + 25s);
  for (auto& [slot, w] : s.workers) w.in_collective = false;
  s.workers["h:1"].collectives = 9;
  HangVerdict v = FindHang(s, kT0 + 25s, 10s);
  REQUIRE(v.kind == HangVerdict::kCulprits);
  CHECK(v.culprits == std::vector<std::string>{"h:1"});
  CHECK(v.why.find("fewer collectives") != std::string::npos);
}

TEST_CASE(
    "hang: nobody stands out: wait 3 s for a stopped member to go silent, then the "
    "round is hung",
    "[unit]") {
  // Past the limit (20 s before a commit), every member heard from and in the same collective.
  PolicyState s = Round(3, kT0 + 21s);
  CHECK(FindHang(s, kT0 + 21s, 10s).kind == HangVerdict::kWaiting);
  s = Round(3, kT0 + 23s);
  HangVerdict v = FindHang(s, kT0 + 23s, 10s);
  CHECK(v.kind == HangVerdict::kRoundHung);
  CHECK(v.culprits.empty());
  CHECK_FALSE(v.progress.committed);
}

}  // namespace
}  // namespace elastic::driver
