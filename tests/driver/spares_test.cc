// Warm spares' rule (driver/spares.h) on state values alone.
#include "driver/spares.h"

#include <catch2/catch.hpp>

namespace elastic::driver {
namespace {

const TimePoint kNow = TimePoint(std::chrono::hours(1));

WorkerState& Running(PolicyState& s, const std::string& slot, bool spare) {
  WorkerState& w = s.workers[slot];
  w.slot = slot;
  w.running = true;
  w.spare = spare;
  return w;
}

TEST_CASE("spares: free slots outside the plan are topped up to --spares", "[unit]") {
  PolicyState s;
  std::vector<discovery::HostSlots> hosts{{"a", 2}, {"b", 2}};
  Running(s, "a:0", false);
  Running(s, "a:1", false);
  SparePlan p = PlanSpares(s, hosts, hosts, {"a:0", "a:1"}, 1, kNow);
  CHECK(p.stop.empty());
  CHECK(p.start == std::vector<std::string>{"b:0"});
  // b:0 is in the next round's plan: b:1 then; two wanted: b:1 only (nothing else is free).
  p = PlanSpares(s, hosts, hosts, {"a:0", "a:1", "b:0"}, 2, kNow);
  CHECK(p.start == std::vector<std::string>{"b:1"});
  // No spares wanted: none started.
  CHECK(PlanSpares(s, hosts, hosts, {"a:0"}, 0, kNow).start.empty());
}

TEST_CASE("spares: those running count, newcomers do not, evicted slots wait", "[unit]") {
  PolicyState s;
  std::vector<discovery::HostSlots> hosts{{"a", 4}};
  Running(s, "a:0", false);
  Running(s, "a:1", true);                // a spare waiting for a place
  Running(s, "a:2", true).joiner = true;  // a newcomer: waits for its own place
  s.workers["a:3"].slot = "a:3";
  s.workers["a:3"].evicted_until = kNow + std::chrono::seconds(5);  // a straggler's, replaced
  SparePlan p = PlanSpares(s, hosts, hosts, {"a:0"}, 1, kNow);
  CHECK(p.start.empty());  // a:1 is the one
  p = PlanSpares(s, hosts, hosts, {"a:0"}, 2, kNow);
  CHECK(p.start.empty());  // a:3 is evicted for 5 s more, a:2 runs
  p = PlanSpares(s, hosts, hosts, {"a:0"}, 2, kNow + std::chrono::seconds(6));
  CHECK(p.start == std::vector<std::string>{"a:3"});
}

TEST_CASE("spares: a spare whose slot is no longer listed stops, and failing spares stop coming",
          "[unit]") {
  PolicyState s;
  Running(s, "a:0", false);
  Running(s, "b:0", true);
  Running(s, "b:1", true).dropped = true;  // going already: not stopped twice
  std::vector<discovery::HostSlots> listed{{"a", 2}};
  SparePlan p = PlanSpares(s, listed, listed, {"a:0"}, 1, kNow);
  CHECK(p.stop == std::vector<std::string>{"b:0"});
  CHECK(p.start == std::vector<std::string>{"a:1"});  // b:0 goes, so it does not count
  s.spare_failures = 4;                               // more than --spares 1 + 2
  p = PlanSpares(s, listed, listed, {"a:0"}, 1, kNow);
  CHECK(p.stop == std::vector<std::string>{"b:0"});
  CHECK(p.start.empty());
}

}  // namespace
}  // namespace elastic::driver
