// The Agent over an in-process communicator (tests/worker_agent/in_process_communicator.h):
// agents as threads of this process, over a real rendezvous gRPC server; the test plays the
// driver (proposes rounds, publishes events). What is checked is the Agent's own part: each
// round's communicator comes from the factory it was given, and the driver's events reach it.
#include <catch2/catch.hpp>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "rendezvous/rendezvous.h"
#include "rendezvous/service.h"
#include "tests/worker_agent/in_process_communicator.h"
#include "worker_agent/worker_agent.h"

namespace elastic::worker_agent {
namespace {

using namespace std::chrono_literals;
using testing::InProcessCommunicator;
using testing::InProcessFactory;

struct Job {
  rendezvous::Core core{rendezvous::CoreOptions{}};
  std::unique_ptr<rendezvous::Server> server;
  std::shared_ptr<InProcessFactory> factory = std::make_shared<InProcessFactory>();
  std::map<std::string, std::unique_ptr<AgentImpl>> agents;

  Job() {
    rendezvous::ServerOptions so;
    so.address = "127.0.0.1:0";
    so.token = "t0ken";
    server = std::move(rendezvous::Server::Start(&core, so)).value();
  }
  AgentImpl& Add(const std::string& slot) {
    WorkerOptions env;
    env.driver_addr = "127.0.0.1:" + std::to_string(server->port());
    env.token = "t0ken";
    env.slot = slot;
    env.hostname = "h";
    AgentOptions o;
    o.backend = Backend::kGloo;
    o.comms = factory;
    o.join_timeout = 20s;
    auto a = AgentImpl::Create(env, o);
    REQUIRE(a.ok());
    return *(agents[slot] = std::move(a).value());
  }
  // Proposes `round` with `slots` as ranks 0, 1, ... on one host.
  void Propose(int64_t round, const std::vector<std::string>& slots) {
    std::map<std::string, rendezvous::Assignment> m;
    for (size_t i = 0; i < slots.size(); ++i) {
      auto& a = m[slots[i]];
      a.rank = a.local_rank = static_cast<int>(i);
      a.size = a.local_size = static_cast<int>(slots.size());
      a.cross_rank = 0;
      a.cross_size = 1;
    }
    REQUIRE(core.ProposeRound(round, m, {}).ok());
  }
  // Each of `slots` joins its next round and runs `then` on its agent; the results, by slot.
  std::map<std::string, std::string> Join(const std::vector<std::string>& slots,
                                          std::function<std::string(AgentImpl&)> then) {
    std::map<std::string, std::future<std::string>> fs;
    for (const auto& s : slots) {
      fs[s] = std::async(std::launch::async, [this, s, then]() -> std::string {
        AgentImpl& a = *agents.at(s);
        auto joined = a.JoinNextRound(0);
        if (!joined.ok()) return joined.status().ToString();
        if (!*joined) return "removed";
        try {
          return then(a);
        } catch (const WorkerLostError& e) {
          return std::string("lost: ") + e.what();
        }
      });
    }
    std::map<std::string, std::string> out;
    for (auto& [s, f] : fs) {
      REQUIRE(f.wait_for(60s) == std::future_status::ready);
      out[s] = f.get();
    }
    return out;
  }
};

// Sum of (rank + 1) over the round, through the agent's communicator.
std::string SumOfRanks(AgentImpl& a) {
  int64_t x = a.comm().rank() + 1;
  a.comm().Allreduce(&x, 1, DataType::kI64, ReduceOp::kSum);
  return std::to_string(x);
}

TEST_CASE("agent: each round's communicator comes from the factory it was given", "[unit]") {
  Job job;
  for (const char* s : {"h:0", "h:1", "h:2"}) job.Add(s);
  job.Propose(0, {"h:0", "h:1", "h:2"});
  auto out = job.Join({"h:0", "h:1", "h:2"}, [&](AgentImpl& a) -> std::string {
    if (!job.factory->Made(&a.comm())) return "a communicator the factory did not make";
    if (a.round() != 0 || a.slot().empty()) return "round or slot";
    return SumOfRanks(a);
  });
  for (const auto& [slot, r] : out) CHECK(r == "6");
  CHECK(job.factory->made() == 3);

  // The next round, without h:1: a new communicator each, of the new size.
  job.agents.erase("h:1");
  job.Propose(1, {"h:2", "h:0"});
  out = job.Join({"h:0", "h:2"}, [&](AgentImpl& a) -> std::string {
    if (!job.factory->Made(&a.comm())) return "a communicator the factory did not make";
    if (a.round() != 1 || a.comm().size() != 2) return "round or size";
    return SumOfRanks(a);
  });
  for (const auto& [slot, r] : out) CHECK(r == "3");
  CHECK(job.factory->made() == 5);
}

TEST_CASE("agent: the driver's abort fails a collective blocked on a silent peer", "[unit]") {
  Job job;
  job.Add("h:0");
  job.Add("h:1");
  job.Propose(0, {"h:0", "h:1"});
  std::promise<void> in_collective;
  auto waiting = in_collective.get_future();
  std::future<std::map<std::string, std::string>> out = std::async(std::launch::async, [&] {
    return job.Join({"h:0", "h:1"}, [&](AgentImpl& a) -> std::string {
      if (a.comm().rank() == 1) {
        a.comm().Barrier();  // both connected
        return "silent";     // and never joins the allreduce
      }
      a.comm().Barrier();
      in_collective.set_value();
      return SumOfRanks(a);  // blocks on rank 1
    });
  });
  REQUIRE(waiting.wait_for(30s) == std::future_status::ready);
  // The driver learned that a peer of round 0 is gone: the event reaches the agent's Watch
  // thread, which aborts the communicator, and the blocked allreduce fails at once.
  job.core.events().Publish("h:0", rendezvous::Event{rendezvous::EventKind::kAbort, 0, "h:1 lost"});
  REQUIRE(out.wait_for(30s) == std::future_status::ready);
  auto results = out.get();
  CHECK(results.at("h:1") == "silent");
  // Failed by the abort (in the exchange, or at its start when the abort came first), not at
  // the group's deadline.
  const std::string& lost = results.at("h:0");
  CHECK(lost.rfind("lost: in-process", 0) == 0);
  CHECK(lost.find("aborted") != std::string::npos);
  CHECK(lost.find("timed out") == std::string::npos);
  CHECK(job.agents.at("h:0")->change_pending());
}

TEST_CASE("agent: a round that changes while it connects is left, and the next one joins",
          "[unit]") {
  Job job;
  job.Add("h:0");
  job.Add("h:1");
  job.Propose(0, {"h:0", "h:1"});
  // Rank 1 is slow to connect: rank 0 waits in its connect until the driver says round 0
  // changes (a member left), which ends the connect: JoinNextRound says ABORTED.
  job.factory->HoldConnects(1);
  std::future<std::map<std::string, std::string>> out = std::async(std::launch::async, [&] {
    return job.Join({"h:0"}, [](AgentImpl&) -> std::string { return "connected"; });
  });
  auto slow =
      std::async(std::launch::async, [&] { return job.agents.at("h:1")->JoinNextRound(0); });
  // Both joined round 0 and have its communicator (rank 0 connecting, rank 1 held); the
  // driver fences the round's members, as it does when a member leaves.
  REQUIRE(job.factory->WaitForMade(2));
  for (const char* s : {"h:0", "h:1"}) {
    job.core.events().Publish(
        s, rendezvous::Event{rendezvous::EventKind::kMembershipChanging, 0, "a member left"});
  }
  REQUIRE(out.wait_for(30s) == std::future_status::ready);
  // Left because of the fence, not at the group's deadline.
  std::string left = out.get().at("h:0");
  CHECK(left.find("ABORTED") != std::string::npos);
  CHECK(left.find("in-process") != std::string::npos);
  CHECK(left.find("aborted") != std::string::npos);  // not "peers did not attach"
  CHECK(left.find("did not attach") == std::string::npos);
  job.factory->ReleaseConnects();
  REQUIRE(slow.wait_for(30s) == std::future_status::ready);
  (void)slow.get();  // rank 1's connect fails or succeeds alone; either way it is done

  // The next round, rank 0 alone, joins and works.
  job.agents.erase("h:1");
  job.Propose(1, {"h:0"});
  auto next = job.Join({"h:0"}, SumOfRanks);
  CHECK(next.at("h:0") == "1");
}

}  // namespace
}  // namespace elastic::worker_agent
