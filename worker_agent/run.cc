// elastic::Run: the recovery loop (docs/architecture.md, "Recovery").
#include <spdlog/spdlog.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>

#include "common/mutex.h"
#include "state/checkpoint.h"
#include "worker_agent/worker_agent.h"

namespace elastic {
namespace {

// Checkpoints of the committed state (--checkpoint-dir): rank 0 writes one, off the training
// thread, at the first commit after each interval; rank 0 of a round in which nobody holds a
// commit (a new job, or every holder gone) loads the newest valid one before the sync that
// gives it to the others.
class Checkpoints {
 public:
  Checkpoints(worker_agent::AgentImpl& agent, Checkpointer::Options options)
      : agent_(agent),
        writer_(std::move(options), [this](const Status& s, const CheckpointInfo& info,
                                           double secs) { Written(s, info, secs); }) {}

  // After a commit.
  void MaybeWrite(State& state) {
    const rendezvous::Assignment& a = agent_.assignment();
    if (a.rank != 0 || !writer_.Due()) return;
    // The folder's lock is the driver's: once it is gone, a driver started again on the same
    // folder may already be writing a new run's checkpoints there. None is begun during an
    // outage (a write already running finishes).
    if (agent_.driver_lost()) {
      if (!paused_) spdlog::info("no checkpoint is written while the driver is unreachable");
      paused_ = true;
      return;
    }
    paused_ = false;
    Submit(state);
  }

  // When training returned on rank 0 (a clean finish): the final state, the newest commit, is
  // the newest checkpoint before the process reports that it finished, so that the folder
  // holds the trained model and the same command started again resumes from the end (it has
  // nothing left to train). The write in progress, if any, finishes first.
  void WriteFinal(State& state) {
    const rendezvous::Assignment& a = agent_.assignment();
    if (a.rank != 0 || state.version() == 0) return;
    auto t0 = std::chrono::steady_clock::now();
    Finish();
    {
      MutexLock g(mu_);
      if (written_version_ >= state.version()) return;  // the newest commit is written already
    }
    if (agent_.driver_lost()) {
      spdlog::warn("the final state (version {}) is not checkpointed: the driver is unreachable, "
                   "and the folder may already be another run's",
                   state.version());
      return;
    }
    if (!Submit(state)) return;
    Finish();
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    MutexLock g(mu_);
    if (written_version_ == state.version()) {
      spdlog::info("final checkpoint: version {} (step {}) written in {:.3f} s to {}",
                   state.version(), state.progress().step, secs, written_path_);
    }
  }

  // After the program returned: a job whose first round restored a checkpoint and made no
  // commit since was complete already (its arguments asked for nothing more).
  void SayIfAlreadyComplete(const State& state) {
    if (restored_version_ > 0 && state.version() == restored_version_) {
      spdlog::info("the job was already complete: checkpoint version {} holds its final state, "
                   "and the program returned without training (give it arguments that ask for "
                   "more, e.g. more epochs, to go on from there)",
                   restored_version_);
    }
  }

 private:
  // Hands the newest commit's snapshot to the writer; false when there is nothing to write.
  bool Submit(State& state) {
    const rendezvous::Assignment& a = agent_.assignment();
    std::vector<CheckpointFile> files = state.CheckpointFiles();
    if (files.empty()) {
      if (!warned_unsupported_) {
        warned_unsupported_ = true;
        spdlog::warn("--checkpoint-dir is set, but this program's state writes no checkpoint "
                     "files (an elastic::State subclass without CheckpointFiles())");
      }
      return false;
    }
    Progress p = state.progress();
    CheckpointInfo meta;
    meta.version = state.version();
    meta.step = p.step;
    meta.epoch = p.epoch;
    meta.cursor = p.cursor;
    meta.samples = p.samples;
    meta.world_size = a.size;
    meta.time = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
                    .count();
    {
      MutexLock g(mu_);
      pending_ = p;
    }
    return writer_.Submit(std::move(meta), std::move(files));
  }

 public:

  // Before the sync of a round whose rank 0 (this worker) holds no commit.
  void Restore(State& state) {
    std::vector<std::string> skipped;
    auto restored = RestoreNewestCheckpoint(state, writer_.options().dir, &skipped);
    for (const auto& why : skipped) spdlog::warn("checkpoint skipped: {}", why);
    if (!restored.ok()) {
      agent_.ReportCheckpoint(rendezvous::ReportKind::kRestored, Progress{},
                              restored.status().message());
      return;
    }
    spdlog::info("restored checkpoint version {} (step {}, epoch {}) from {}", restored->version,
                 restored->step, restored->epoch, restored->path);
    restored_version_ = restored->version;
    agent_.ReportCheckpoint(rendezvous::ReportKind::kRestored, state.progress(), restored->path);
  }

  // When training returned: the write in progress finishes (bounded) before the process ends.
  void Finish() {
    if (!writer_.Wait(std::chrono::seconds(60))) {
      spdlog::warn("a checkpoint write is still running after 60 s; exiting without it");
    }
  }

 private:
  void Written(const Status& s, const CheckpointInfo& info, double secs) {
    Progress p;
    {
      MutexLock g(mu_);
      p = pending_;
    }
    if (s.ok()) {
      failing_ = "";
      {
        MutexLock g(mu_);
        written_version_ = std::max(written_version_, info.version);
        written_path_ = info.path;
      }
      agent_.ReportCheckpoint(rendezvous::ReportKind::kCheckpointed, p, info.path, secs);
      return;
    }
    // Said once per cause (the text after the last ": "; the paths before it change with the
    // version), not every interval; training goes on.
    size_t colon = s.message().rfind(": ");
    std::string cause = colon == std::string::npos ? s.message() : s.message().substr(colon + 2);
    if (cause != failing_) {
      failing_ = cause;
      spdlog::warn("checkpoint of version {} failed: {}; training goes on", info.version,
                   s.message());
    }
    agent_.ReportCheckpoint(rendezvous::ReportKind::kCheckpointFailed, p, s.message(), secs);
  }

  worker_agent::AgentImpl& agent_;
  Mutex mu_;
  Progress pending_ ELASTIC_GUARDED_BY(mu_);  // what the write in progress holds
  int64_t written_version_ ELASTIC_GUARDED_BY(mu_) = 0;  // the newest written by this process
  std::string written_path_ ELASTIC_GUARDED_BY(mu_);
  int64_t restored_version_ = 0;  // the checkpoint this rank 0 restored (training thread only)
  std::string failing_;  // the writer thread's only
  bool warned_unsupported_ = false;
  bool paused_ = false;  // the driver is unreachable: said once
  Checkpointer writer_;  // last: its thread stops before the members above go
};

}  // namespace

void Run(State& state, const std::function<void(State&)>& train) {
  try {
    worker_agent::RunLoop(state, train);
  } catch (const worker_agent::WorkerEnd& end) {
    worker_agent::EndProcess(end);
  }
}

namespace worker_agent {

void RunLoop(State& state, const std::function<void(State&)>& train) {
  AgentImpl& agent = InitAgent();
  // The first commit of each round is reported (synchronously: the driver learns that a
  // commit exists before any rank moves past it) with the worker-side recovery phases; the
  // driver's event log times recovery by it.
  int64_t reported_round = -1;
  Duration sync_time{0};
  std::unique_ptr<Checkpoints> checkpoints;
  if (const WorkerOptions& w = agent.env(); !w.checkpoint_dir.empty()) {
    Checkpointer::Options o;
    o.dir = w.checkpoint_dir;
    if (w.checkpoint_interval) o.interval = *w.checkpoint_interval;
    if (w.checkpoint_keep) o.keep = *w.checkpoint_keep;
    checkpoints = std::make_unique<Checkpoints>(agent, o);
    state.PrepareCheckpoints();  // on every rank: any of them can be rank 0 later
  }
  state.SetCommitHook([&agent, &state, &reported_round, &sync_time, &checkpoints] {
    agent.ThrowIfEnded();  // the driver is gone for good: the commit ends the worker
    if (reported_round != agent.assignment().round) {
      reported_round = agent.assignment().round;
      agent.ReportCommitted(state.progress(), agent.last_rebuild(), sync_time);
    } else {
      agent.NoteCommit(state.progress());
    }
    if (checkpoints) checkpoints->MaybeWrite(state);
    agent.CheckHostUpdates();
  });
  state.Reset(agent.assignment().rank, agent.assignment().size);
  while (true) {
    try {
      sync_time = Duration::zero();
      if (agent.assignment().sync_required) {
        TimePoint t0 = SteadyClock::now();
        if (checkpoints && agent.assignment().rank == 0 && state.version() == 0) {
          checkpoints->Restore(state);
        }
        state.Sync(agent.comm(), 0);
        sync_time = SteadyClock::now() - t0;
      }
      train(state);
      agent.ThrowIfEnded();  // no final checkpoint from a worker that was refused or given up
      if (checkpoints) {
        checkpoints->WriteFinal(state);
        checkpoints->Finish();
        checkpoints->SayIfAlreadyComplete(state);
      }
      agent.ReportFinished(state.version());
      return;
    } catch (const WorkerLostError& e) {
      agent.ThrowIfEnded();  // the collective was aborted because the agent ended
      if (state.TakeCommitInterrupted()) {
        // Lost in the commit's own agreement, after its save: the values are that version
        // already (no program code ran since), so nothing is copied back.
        spdlog::warn(
            "rank {}: {}; rolling back to the last commit (version {}, which the "
            "interrupted commit had saved: the values are unchanged since)",
            agent.assignment().rank, e.what(), state.version());
      } else {
        spdlog::warn("rank {}: {}; rolling back to the last commit (version {})",
                     agent.assignment().rank, e.what(), state.version());
        state.Restore();
      }
    } catch (const HostsUpdated& e) {
      state.TakeCommitInterrupted();  // thrown by the commit's hook: the commit is whole
      spdlog::info("rank {}: {}; re-forming at this commit", agent.assignment().rank, e.what());
    } catch (const WorkerEnd&) {
      throw;  // not the program's failure: the process ends as told
    } catch (const std::exception& e) {
      // The agent's end as the program raised it on (Python's SystemExit): not a failure.
      if (agent.ended()) throw;
      // A failure of the program's own: the driver hears it (synchronously, before this
      // process ends) so that it can tell one rank's crash from every rank's same error.
      agent.ReportFailed(e.what());
      throw;
    } catch (...) {
      if (agent.ended()) throw;
      agent.ReportFailed("an exception that is not a std::exception");
      throw;
    }
    // Join with the version this worker holds; a round whose communicator could not connect
    // (aborted, or a peer died meanwhile) is left for the next one.
    auto joined = agent.JoinNextRound(state.version());
    while (!joined.ok() && joined.status().code() == Code::kAborted && !agent.ended()) {
      spdlog::warn("{}; joining the next round", joined.status().message());
      joined = agent.JoinNextRound(state.version());
    }
    if (!joined.ok()) {
      agent.ThrowIfEnded();
      throw WorkerEnd(1, "elastic: " + joined.status().ToString());
    }
    if (!*joined) throw WorkerEnd(0, "this worker was scaled away; exiting 0");
    state.Reset(agent.assignment().rank, agent.assignment().size);
  }
}

}  // namespace worker_agent
}  // namespace elastic
