#include "driver/plan.h"

#include <catch2/catch.hpp>
#include <random>

namespace elastic::driver {
namespace {

using discovery::HostSlots;

TEST_CASE("plan: host by host in first-seen order, slots in order, capped", "[unit]") {
  PlanInput in;
  in.listed = in.available = {{"b", 2}, {"a", 3}};
  in.host_order = {"b", "a"};
  CHECK(PlanMembers(in) == std::vector<std::string>{"b:0", "b:1", "a:0", "a:1", "a:2"});
  in.max_np = 3;
  CHECK(PlanMembers(in) == std::vector<std::string>{"b:0", "b:1", "a:0"});
}

TEST_CASE("plan: survivors win the cap, ranks in host order", "[unit]") {
  PlanInput in;
  in.listed = in.available = {{"new", 2}, {"old", 2}};
  in.host_order = {"new", "old"};
  in.alive = {"old:1"};
  in.max_np = 2;
  auto plan = PlanMembers(in);
  REQUIRE(plan.size() == 2);
  CHECK(plan[0] == "new:0");
  CHECK(plan[1] == "old:1");
}

TEST_CASE("plan: when the cap leaves out survivors, the holders of the newest commit stay",
          "[unit]") {
  // Found by the PyTorch soak: a host shrank, the spares' reserve capped the members, and the
  // survivor left out (the last in host order) was the only holder of the newest commit.
  PlanInput in;
  in.listed = in.available = {{"a", 3}, {"b", 2}};
  in.host_order = {"a", "b"};
  in.alive = {"a:1", "a:2", "b:0"};
  in.holders = {"b:0"};
  in.max_np = 2;
  CHECK(PlanMembers(in) == std::vector<std::string>{"a:1", "b:0"});
  in.max_np = 0;
  in.reserve = 2;  // --spares 2: 5 slots, 3 for members
  in.need = 2;
  in.alive = {"a:0", "a:1", "a:2", "b:0"};
  CHECK(PlanMembers(in) == std::vector<std::string>{"a:0", "a:1", "b:0"});
  in.holders.clear();  // no holder known: host order, as before
  CHECK(PlanMembers(in) == std::vector<std::string>{"a:0", "a:1", "a:2"});
}

TEST_CASE("plan: blacklisted hosts keep their survivors but get no new workers", "[unit]") {
  PlanInput in;
  in.listed = {{"a", 3}, {"b", 1}};
  in.available = {{"b", 1}};  // a is blacklisted
  in.host_order = {"a", "b"};
  in.alive = {"a:0", "a:2"};
  in.busy = {"a:1"};  // the failed one, still exiting
  CHECK(PlanMembers(in) == std::vector<std::string>{"a:0", "a:2", "b:0"});
}

TEST_CASE("plan: slots of hosts no longer listed, or beyond a smaller count, are dropped",
          "[unit]") {
  PlanInput in;
  in.listed = in.available = {{"a", 1}};
  in.host_order = {"a", "gone"};
  in.alive = {"a:0", "a:1", "gone:0"};
  CHECK(PlanMembers(in) == std::vector<std::string>{"a:0"});
}

TEST_CASE("plan: a kept holder stays although its host is unlisted, and wins the cap",
          "[unit]") {
  PlanInput in;
  in.listed = in.available = {{"a", 2}};
  in.host_order = {"gone", "a"};
  in.alive = {"gone:0", "gone:1", "a:0"};
  in.max_np = 2;
  CHECK(PlanMembers(in) == std::vector<std::string>{"a:0", "a:1"});
  in.keep = {"gone:1"};
  CHECK(PlanMembers(in) == std::vector<std::string>{"gone:1", "a:0"});
  in.alive.erase("gone:1");  // a kept slot whose worker is gone is not planned
  CHECK(PlanMembers(in) == std::vector<std::string>{"a:0", "a:1"});
}

TEST_CASE("plan: a slot whose worker is going away still counts against the spares' reserve",
          "[unit]") {
  // Found by the namespace soak (seed 785004327, job 6): a host shrank by one slot; the
  // re-plan left out one member for the spares' reserve, whose slot then counted as busy, so
  // the next re-plan left out another, and so on: two healthy holders were scaled away.
  PlanInput in;
  in.listed = in.available = {{"h0", 3}, {"h1", 2}, {"h2", 1}};
  in.host_order = {"h0", "h1", "h2"};
  in.alive = {"h0:0", "h0:1", "h0:2", "h1:0"};
  in.busy = {"h2:0"};  // left out by the last plan, still exiting
  in.spares = {"h1:1"};
  in.holders = in.alive;
  in.reserve = 2;
  in.need = 2;
  in.max_np = 6;
  // Six listed slots, two reserved for spares: four members, as before.
  CHECK(PlanMembers(in) == std::vector<std::string>{"h0:0", "h0:1", "h0:2", "h1:0"});
}

TEST_CASE("plan: when the cap leaves out holders, silent ones go before those that answer",
          "[unit]") {
  // The same soak job: the members that stayed were the three of a host whose link was down
  // (they answered nothing); they were lost a moment later, and the state with them.
  PlanInput in;
  in.listed = in.available = {{"h0", 3}, {"h1", 1}, {"h2", 1}};
  in.host_order = {"h0", "h1", "h2"};
  in.alive = {"h0:0", "h0:1", "h0:2", "h1:0", "h2:0"};
  in.holders = in.alive;
  in.silent = {"h0:0", "h0:1", "h0:2"};
  in.max_np = 3;
  CHECK(PlanMembers(in) == std::vector<std::string>{"h0:0", "h1:0", "h2:0"});
}

TEST_CASE("plan: a new process on a free slot goes before a spare that does not answer",
          "[unit]") {
  // Namespace PyTorch soak (seed 489384709, job 1): a spare stopped before it connected was
  // promoted; the round waited for its join until the rendezvous timeout (30 s).
  PlanInput in;
  in.listed = in.available = {{"a", 4}};
  in.host_order = {"a"};
  in.alive = {"a:0"};
  in.spares = {"a:1", "a:2"};
  in.silent = {"a:1"};
  in.max_np = 2;
  CHECK(PlanMembers(in) == std::vector<std::string>{"a:0", "a:2"});
  in.spares = {"a:1"};
  CHECK(PlanMembers(in) == std::vector<std::string>{"a:0", "a:2"});  // a:2 is free
  in.max_np = 3;
  CHECK(PlanMembers(in) == std::vector<std::string>{"a:0", "a:2", "a:3"});
  in.max_np = 4;  // and when nothing else is left, the silent spare
  CHECK(PlanMembers(in) == std::vector<std::string>{"a:0", "a:1", "a:2", "a:3"});
}

TEST_CASE("assign: local and cross ranks by host", "[unit]") {
  auto a = AssignRanks({"x:0", "y:0", "x:1", "y:1", "y:2"}, true);
  CHECK(a["x:1"].rank == 2);
  CHECK(a["x:1"].local_rank == 1);
  CHECK(a["x:1"].local_size == 2);
  CHECK(a["y:2"].local_rank == 2);
  CHECK(a["y:2"].local_size == 3);
  CHECK(a["y:0"].cross_rank == 1);
  CHECK(a["x:0"].cross_size == 2);
  CHECK(a["y:1"].size == 5);
  CHECK(a["y:1"].sync_required);
}

// Property: over random host sets, survivors and caps, the plan is a set of distinct listed
// slots within the cap, keeps every survivor the cap allows, and starts with a holder when
// any member holds the state.
TEST_CASE("plan property: random inputs", "[unit]") {
  auto seed = GENERATE(range(1, 201));
  std::mt19937 rng(seed);
  PlanInput in;
  int hosts = 1 + rng() % 5;
  for (int h = 0; h < hosts; ++h) {
    std::string name = "h" + std::to_string(h);
    in.host_order.push_back(name);
    if (rng() % 5 == 0) continue;  // not listed now
    HostSlots hs{name, 1 + static_cast<int>(rng() % 4)};
    in.listed.push_back(hs);
    if (rng() % 4 != 0) in.available.push_back(hs);
  }
  for (const auto& h : in.host_order) {
    for (int i = 0; i < 4; ++i) {
      std::string slot = h + ":" + std::to_string(i);
      int r = rng() % 6;
      if (r == 0) in.alive.insert(slot);
      if (r == 1) in.busy.insert(slot);
    }
  }
  in.max_np = rng() % 3 == 0 ? 0 : 1 + rng() % 10;
  auto plan = PlanMembers(in);
  INFO("seed " << seed);
  std::set<std::string> distinct(plan.begin(), plan.end());
  CHECK(distinct.size() == plan.size());
  if (in.max_np > 0) CHECK(plan.size() <= in.max_np);
  size_t listed_survivors = 0;
  for (const auto& slot : plan) {
    auto [host, index] = Slot::Parse(slot);
    bool listed = false;
    for (const auto& h : in.listed) listed |= h.host == host && index < h.slots;
    CHECK(listed);
    CHECK(in.busy.count(slot) == 0);
    if (!in.alive.count(slot)) {
      bool available = false;
      for (const auto& h : in.available) available |= h.host == host;
      CHECK(available);
    }
  }
  for (const auto& slot : in.alive) {
    auto [host, index] = Slot::Parse(slot);
    for (const auto& h : in.listed) listed_survivors += h.host == host && index < h.slots;
  }
  size_t cap = in.max_np ? in.max_np : SIZE_MAX;
  size_t kept = 0;
  for (const auto& s : plan) kept += in.alive.count(s);
  CHECK(kept == std::min(listed_survivors, cap));
}

}  // namespace
}  // namespace elastic::driver
