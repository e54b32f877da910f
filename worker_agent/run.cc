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
  int64_t reported_round = -1;
  int64_t commits = 0;
  state.SetCommitHook([&agent, &reported_round, &commits] {
    ++commits;
    if (reported_round != agent.assignment().round) {
      reported_round = agent.assignment().round;
      agent.ReportCommitted(commits, 0, 0);
    }
    agent.CheckHostUpdates();
  });
  state.Reset(agent.assignment().rank, agent.assignment().size);
  while (true) {
    try {
      if (agent.assignment().sync_required) state.Sync(agent.comm(), 0);
      train(state);
      agent.ReportFinished();
      return;
    } catch (const WorkerLostError& e) {
      spdlog::warn("rank {}: {}; rolling back to the last commit", agent.assignment().rank, e.what());
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
