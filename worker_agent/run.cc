// elastic::Run: the recovery loop of DESIGN §4.
#include <spdlog/spdlog.h>

#include <cstdio>
#include <cstdlib>

#include "worker_agent/worker_agent.h"

namespace elastic {
namespace {

[[noreturn]] void ExitRemoved() {
  spdlog::info("this worker was scaled away; exiting 0");
  std::fflush(stdout);
  std::exit(0);
}

}  // namespace

void Run(State& state, const std::function<void(State&)>& train, AgentOptions options) {
  Agent& agent = Init(options);
  // The first commit of each round is reported: the driver's event log times recovery by it.
  // It carries the worker-side recovery phases: communicator rebuild and state sync.
  int64_t reported_round = -1;
  int64_t commits = 0;
  Duration sync_time{0};
  state.SetCommitHook([&agent, &reported_round, &commits, &sync_time] {
    ++commits;
    if (reported_round != agent.assignment().round) {
      reported_round = agent.assignment().round;
      agent.ReportCommitted(
          commits, 0, 0,
          "rebuild=" + std::to_string(std::chrono::duration<double>(agent.last_rebuild()).count()) +
              " sync=" + std::to_string(std::chrono::duration<double>(sync_time).count()));
    }
    agent.CheckHostUpdates();
  });
  state.Reset(agent.assignment().rank, agent.assignment().size);
  while (true) {
    try {
      sync_time = Duration::zero();
      if (agent.assignment().sync_required) {
        TimePoint t0 = SteadyClock::now();
        state.Sync(agent.comm(), 0);
        sync_time = SteadyClock::now() - t0;
      }
      train(state);
      agent.ReportFinished();
      return;
    } catch (const WorkerLostError& e) {
      spdlog::warn("rank {}: {}; rolling back to the last commit", agent.assignment().rank,
                   e.what());
      state.Restore();
    } catch (const HostsUpdated& e) {
      spdlog::info("rank {}: {}; re-forming at this commit", agent.assignment().rank, e.what());
    }
    auto joined = agent.JoinNextRound();
    if (!joined.ok()) {
      std::fprintf(stderr, "elastic: %s\n", joined.status().ToString().c_str());
      std::exit(1);
    }
    if (!*joined) ExitRemoved();
    state.Reset(agent.assignment().rank, agent.assignment().size);
  }
}

}  // namespace elastic
