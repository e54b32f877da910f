// Failure accounting's rules (driver/failures.h) on state values alone.
#include "driver/failures.h"

#include <catch2/catch.hpp>

namespace elastic::driver {
namespace {

const TimePoint kT0 = TimePoint(std::chrono::hours(1));

// Round 2 formed with members h:0, h:1, h:2.
PolicyState Formed() {
  PolicyState s;
  s.started = true;
  s.round = s.formed = 2;
  for (int i = 0; i < 3; ++i) {
    std::string slot = "h:" + std::to_string(i);
    WorkerState& w = s.workers[slot];
    w.slot = slot;
    w.running = true;
    w.launched_at = kT0;
    s.formed_members.push_back(slot);
  }
  return s;
}

void Fail(PolicyState& s, const std::string& slot, int64_t round, const std::string& why) {
  s.workers[slot].failed_round = round;
  s.workers[slot].failure = why;
  s.failure_order.push_back(slot);
}

TEST_CASE("failures: every member failing in the round ends it, naming the first to report",
          "[unit]") {
  PolicyState s = Formed();
  Fail(s, "h:2", 2, "ValueError: bad shape");
  Fail(s, "h:0", 2, "ValueError: bad shape");
  CHECK(EveryMemberFailed(s) == nullptr);  // h:1 has not
  Fail(s, "h:1", 2, "ValueError: bad shape");
  const WorkerState* first = EveryMemberFailed(s);
  REQUIRE(first != nullptr);
  CHECK(first->slot == "h:2");
  // A failure in an earlier round does not count for this one.
  s = Formed();
  Fail(s, "h:0", 1, "old");
  Fail(s, "h:1", 2, "x");
  Fail(s, "h:2", 2, "x");
  CHECK(EveryMemberFailed(s) == nullptr);
  // Nor does one of a slot that is not a member (it reported first, but is not named).
  s = Formed();
  s.workers["x:0"].slot = "x:0";
  Fail(s, "x:0", 2, "not a member");
  for (const char* slot : {"h:1", "h:0", "h:2"}) Fail(s, slot, 2, "y");
  REQUIRE(EveryMemberFailed(s) != nullptr);
  CHECK(EveryMemberFailed(s)->slot == "h:1");
  // No round formed: nothing to judge.
  PolicyState none;
  CHECK(EveryMemberFailed(none) == nullptr);
}

TEST_CASE("failures: every launched worker failing before it connected, none running", "[unit]") {
  PolicyState s;
  for (const char* slot : {"h:0", "h:1", "h:2"}) {
    WorkerState& w = s.workers[slot];
    w.slot = slot;
    w.launched_at = kT0;
    w.start_failed = true;
  }
  s.workers["h:3"].slot = "h:3";  // never launched: not counted, not in the way
  CHECK(EveryStartFailed(s) == 3);
  s.workers["h:1"].running = true;  // a relaunch may still connect
  CHECK(EveryStartFailed(s) == 0);
  s.workers["h:1"].running = false;
  s.workers["h:1"].start_failed = false;  // one that was heard from before it exited
  CHECK(EveryStartFailed(s) == 0);
  s.workers["h:1"].start_failed = true;
  s.started = true;  // a round formed once: not a program that cannot start
  CHECK(EveryStartFailed(s) == 0);
}

TEST_CASE("failures: a host's failures in one round are one incident, and the failure budget",
          "[unit]") {
  PolicyState s;
  CHECK(NewIncident(s, "a", 3));
  s.incident_round["a"] = 3;
  CHECK_FALSE(NewIncident(s, "a", 3));  // a second worker of a in round 3
  CHECK_FALSE(NewIncident(s, "a", 2));  // a late exit from an earlier round
  CHECK(NewIncident(s, "a", 4));
  CHECK(NewIncident(s, "b", 3));
  CHECK_FALSE(OverFailureBudget(100, -1));  // no --max-failures
  CHECK_FALSE(OverFailureBudget(2, 2));
  CHECK(OverFailureBudget(3, 2));
  CHECK(OverFailureBudget(1, 0));
}

}  // namespace
}  // namespace elastic::driver
