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
  // The first commit of each round is reported (synchronously: the driver learns that a
  // commit exists before any rank moves past it) with the worker-side recovery phases; the
  // driver's event log times recovery by it.
  int64_t reported_round = -1;
  Duration sync_time{0};
  state.SetCommitHook([&agent, &state, &reported_round, &sync_time] {
    if (reported_round != agent.assignment().round) {
      reported_round = agent.assignment().round;
      agent.ReportCommitted(state.progress(), agent.last_rebuild(), sync_time);
    } else {
      agent.NoteCommit(state.progress());
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
      agent.ReportFinished(state.version());
      return;
    } catch (const WorkerLostError& e) {
      spdlog::warn("rank {}: {}; rolling back to the last commit (version {})",
                   agent.assignment().rank, e.what(), state.version());
      state.Restore();
    } catch (const HostsUpdated& e) {
      spdlog::info("rank {}: {}; re-forming at this commit", agent.assignment().rank, e.what());
    } catch (const std::exception& e) {
      // A failure of the program's own: the driver hears it (synchronously, before this
      // process ends) so that it can tell one rank's crash from every rank's same error.
      agent.ReportFailed(e.what());
      throw;
    } catch (...) {
      agent.ReportFailed("an exception that is not a std::exception");
      throw;
    }
    // Join with the version this worker holds; a round whose communicator could not connect
    // (aborted, or a peer died meanwhile) is left for the next one.
    auto joined = agent.JoinNextRound(state.version());
    while (!joined.ok() && joined.status().code() == Code::kAborted) {
      spdlog::warn("{}; joining the next round", joined.status().message());
      joined = agent.JoinNextRound(state.version());
    }
    if (!joined.ok()) {
      std::fprintf(stderr, "elastic: %s\n", joined.status().ToString().c_str());
      std::exit(1);
    }
    if (!*joined) ExitRemoved();
    state.Reset(agent.assignment().rank, agent.assignment().size);
  }
}

}  // namespace elastic
