// The worker agent, inside the library: AgentImpl is the elastic::Agent of worker_agent/elastic.h
// (the public header) with what Run, the Python binding and the tests use besides. It reads the
// environment the driver gives (docs/architecture.md, "Environment"), joins rounds, keeps the
// Watch stream on a background thread, and builds a Communicator for each round. Thread safety:
// methods are called from the training thread; the Watch thread only flips flags and may Abort()
// the current communicator.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>

#include "common/common.h"
#include "common/mutex.h"
#include "rendezvous/client.h"
#include "rendezvous/types.h"
#include "state/state.h"
#include "worker_agent/elastic.h"
#include "worker_agent/gloo_communicator.h"
#include "worker_agent/nccl_communicator.h"
#include "worker_agent/round_communicator.h"
#include "worker_agent/worker_options.h"

namespace elastic::worker_agent {

struct AgentOptions {
  Duration join_timeout = std::chrono::seconds(600);
  // What makes each round's host communicator. Unset: Gloo's (MakeGlooFactory) with `gloo`,
  // completed from the environment (WorkerOptions); tests give an in-process one.
  std::shared_ptr<CommunicatorFactory> comms;
  GlooOptions gloo;
  // Unset: ELASTIC_BACKEND (set by `elastic-run --backend`), else auto: NCCL when this process
  // sees a CUDA device and NCCL loads, else Gloo alone.
  std::optional<Backend> backend;
  NcclOptions nccl;
  // When a round only removes members, survivors shrink the NCCL communicator instead of a
  // fresh init (ELASTIC_NCCL_SHRINK=0 turns it off).
  bool nccl_shrink = true;
  // The NCCL to use instead of loading the library (tests give an in-memory stand-in).
  std::shared_ptr<NcclApi> nccl_api;
  // How long this worker trains on once the driver is unreachable (its Watch stream broke
  // and cannot be re-opened) before it exits by itself (docs/recovery.md, "When the driver
  // is lost"). Unset: ELASTIC_DRIVER_TIMEOUT (seconds; set by `elastic-run --driver-timeout`),
  // else 120 s. 0: exit 3 s after losing it, and a local worker keeps dying with its driver.
  std::optional<Duration> driver_timeout;
};

class AgentImpl final : public Agent {
 public:
  // Connects to the driver and starts the Watch thread; does not join yet.
  static StatusOr<std::unique_ptr<AgentImpl>> Create(WorkerOptions env, AgentOptions options = {});
  ~AgentImpl() override;

  // Destroys the current communicator, joins the next round (round 0 the first time), saying
  // that this worker holds state `version` (State::version(); 0: none), and builds the
  // communicator for it. Returns false when the driver removed this slot (the worker should
  // exit 0). Errors: DEADLINE_EXCEEDED or UNAVAILABLE from Join (driver gone: fatal);
  // ABORTED when the communicator could not connect (aborted by the driver, or a peer died):
  // roll back and join again.
  StatusOr<bool> JoinNextRound(int64_t version);

  const rendezvous::Assignment& assignment() const { return assignment_; }
  Communicator& comm() override;  // valid after a successful JoinNextRound
  int64_t round() const override { return assignment_.round; }
  const std::string& slot() const override { return env_.slot; }
  // The backend this worker resolved (kGloo or kNccl; never kAuto).
  Backend backend() const { return backend_; }
  // The NCCL communicator of the current round (device buffers), or nullptr under Gloo.
  DeviceRoundCommunicator* device_comm() override;
  const WorkerOptions& env() const { return env_; }

  // True once the driver announced that the current round is changing.
  bool change_pending() const override;
  // True while the driver is unreachable (its Watch broke and has not re-opened).
  bool driver_lost() const override { return driver_lost_.load(); }
  // Agrees across ranks (max-allreduce of change_pending) and throws HostsUpdated when any
  // rank saw the announcement, so every rank stops at the same commit. May throw
  // WorkerLostError.
  void CheckHostUpdates();

  // Stops the Watch thread (idempotent). Called at process exit for the Init() agent.
  void StopWatch();

  // True once the agent has ended: the driver refused this worker's Watch, or stayed
  // unreachable past --driver-timeout. Then the round's collectives are aborted (they throw
  // WorkerLostError), every call to the driver fails at once, and Run ends the process with
  // WorkerEnd (code 3) at its next commit, failed collective or join; if the process is still
  // there kEndGrace later, the Watch thread ends it (exit 3), the last resort. Thread-safe.
  bool ended() const { return ended_.load(); }
  // Throws WorkerEnd(3, why) once ended(); else nothing.
  void ThrowIfEnded() const;
  // How long an ended agent lets the program end by itself (its `finally` blocks and atexit
  // handlers run) before it ends the process.
  static constexpr Duration kEndGrace = std::chrono::seconds(30);

  // Best-effort reports to the driver (failures are logged, not fatal). A COMMITTED report
  // carries what the commit made (step = version, epoch, cursor, samples) and, on a round's
  // first commit, the worker-side recovery phases; it blocks until sent.
  void ReportCommitted(const Progress& progress, Duration rebuild, Duration sync);
  // A later commit: sent from a background thread, the newest only, at most every 0.5 s, so
  // training never waits for it. The driver learns from these that the worker makes progress.
  void NoteCommit(const Progress& progress);
  // Tells the driver that this worker leaves the job of its own accord: the driver forms the
  // next round without it at once, whether it then exits 0, fails or is killed. Blocks until
  // the driver has it (or the call fails: logged). The caller should then exit.
  void ReportLeaving(const std::string& why) override;
  // How long building the communicator of the current round took.
  Duration last_rebuild() const { return last_rebuild_; }
  // `version`: of the state the training function returned with (its last commit).
  void ReportFinished(int64_t version);
  void ReportFailed(const std::string& message);
  // A checkpoint written, failed or restored (kind: kCheckpointed, kCheckpointFailed,
  // kRestored): what it holds (`progress`, version 0 for none), its folder or the error.
  // Blocks until sent; safe from any thread.
  void ReportCheckpoint(rendezvous::ReportKind kind, const Progress& progress,
                        const std::string& message, double seconds = 0);

 private:
  AgentImpl(WorkerOptions env, AgentOptions options);
  void WatchLoop();
  // The Watch thread ends the agent (ended()): says why, arms the last resort (a thread that
  // ends the process kEndGrace later unless it ended), closes the driver's client and aborts
  // the round's communicators.
  void End(const std::string& why);
  // Clears this thread's parent-death signal once the worker joined (driver timeout > 0).
  void OutliveParent();
  void ReportLoop();
  void OnEvent(const rendezvous::Event& e);
  // Asks the driver for this worker's place in the next round (JoinNextRound's first half); a
  // warm spare asks again until it gets one.
  StatusOr<rendezvous::JoinResult> Join(int64_t version);
  Status SendReport(rendezvous::Report r);
  // Builds the NCCL communicator of the round just joined, beside the connected Gloo one:
  // by shrinking the previous round's when every member was in it and only members left,
  // else by a fresh init. Errors as JoinNextRound.
  Status BuildNccl(const Topology& topo);
  // Whether the survivors shrink the previous round's NCCL communicator, and how (the
  // previous ranks left out, where each rank lands): agreed over the Gloo communicator, so
  // every member decides the same. ABORTED when a peer is lost meanwhile.
  struct NcclShrinkPlan {
    bool shrink = false;
    std::vector<int> exclude;
    std::vector<int> rank_of;
  };
  StatusOr<NcclShrinkPlan> AgreeNcclShrink();

  WorkerOptions env_;
  AgentOptions options_;
  std::unique_ptr<rendezvous::Client> client_;
  // --state-store: where a worker whose driver is lost finds the one that leads the job now.
  std::unique_ptr<Etcd> store_;
  // Looks the job's leading driver up in store_ and dials it when it moved (follower_).
  void FollowLeader();
  std::thread follower_;
  // The follower's next lookup: not before the lease of the leader it last read could run out;
  // since when it has found no leader (follower_ alone touches them).
  TimePoint next_lookup_{}, no_leader_since_{};
  rendezvous::Assignment assignment_;
  std::atomic<int64_t> current_round_{-1};
  std::atomic<int64_t> changing_round_{-1};  // newest round the driver said is changing
  std::atomic<int64_t> aborted_round_{-1};   // newest round the driver aborted
  std::atomic<bool> stopping_{false};
  std::atomic<bool> driver_lost_{false};
  std::atomic<bool> ended_{false};  // End() was called; end_why_ says why
  std::thread end_watchdog_;        // End()'s last resort (set by the Watch thread)
  mutable Mutex end_mu_;
  std::string end_why_ ELASTIC_GUARDED_BY(end_mu_);
  std::atomic<bool> warned_reports_{false};  // a failed report during an outage, said once
  // When the Watch last broke (steady clock, nanoseconds): the outage's start while driver_lost_.
  std::atomic<int64_t> lost_since_ns_{0};
  bool outlives_parent_ = false;             // PR_SET_PDEATHSIG cleared (training thread only)
  std::atomic<bool> watch_opened_{false};    // the driver's stream was open once
  Mutex comm_mu_;  // guards replacing comm_ against Abort from the Watch thread
  // The round's store, kept while its communicator lives (its pairs may connect at their
  // first use); declared before comm_, so it goes after it.
  std::unique_ptr<RoundStore> round_store_;
  // The current round's communicator, installed before it connects; replaced with comm_mu_
  // held. Not ELASTIC_GUARDED_BY: the training thread, its only writer, reads it without the
  // lock.
  std::unique_ptr<RoundCommunicator> comm_;
  int64_t comm_round_ ELASTIC_GUARDED_BY(comm_mu_) = -1;  // the round comm_ belongs to
  // The round whose communicator is connecting now (-1: none). A fence of that round ends the
  // connect: no step was taken in it, so nothing is lost by leaving it.
  int64_t connecting_round_ ELASTIC_GUARDED_BY(comm_mu_) = -1;
  Backend backend_ = Backend::kGloo;
  bool spare_ = false;  // ELASTIC_SPARE=1: a warm spare, joining without a deadline
  // What makes each round's device communicator (NCCL's, MakeNcclFactory), when backend_ is
  // kNccl.
  std::shared_ptr<DeviceCommunicatorFactory> device_comms_;
  // The NCCL communicator of nccl_round_ (replaced under comm_mu_), and while the next one is
  // built, the previous one (its shrink parent).
  std::unique_ptr<DeviceRoundCommunicator> nccl_;
  std::unique_ptr<DeviceRoundCommunicator> nccl_parent_;
  int64_t nccl_round_ = -1;
  int64_t last_nccl_round_ = -1;  // the round whose NCCL communicator last connected
  std::thread watch_;
  Duration last_rebuild_{0};
  std::thread reporter_;
  Mutex report_mu_;
  std::condition_variable report_cv_;
  bool report_stop_ ELASTIC_GUARDED_BY(report_mu_) = false;
  std::optional<rendezvous::Report> pending_
      ELASTIC_GUARDED_BY(report_mu_);  // newest unsent commit
};

// Where this process must stop being a worker, thrown instead of ending the process: the
// environment is not a worker's (code 2), it could not join a round (1), or the driver scaled
// it away (0). The C++ API (elastic::Init, elastic::Run) prints what() and exits with code();
// the Python binding raises SystemExit(code) instead, which the program may catch, and whose
// finally blocks and atexit handlers run.
class WorkerEnd : public std::runtime_error {
 public:
  WorkerEnd(int code, const std::string& what) : std::runtime_error(what), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};

// The process-wide agent (elastic::Init() returns it): created and joined to round 0 on first
// call (like Python's elastic.init(), docs/python.md). Throws WorkerEnd (code 2, naming what is
// missing) when not run under elastic-run; a later call throws the same again. `options`
// count on the first call only.
AgentImpl& InitAgent(AgentOptions options = {});

// elastic::Run's recovery loop, which throws WorkerEnd where Run ends the process.
void RunLoop(State& state, const std::function<void(State&)>& train);

// The signal on which this process prints its stacks, registered by the program's runtime
// (the Python package: faulthandler on SIGUSR2, unless the program handles it): told to the
// driver in every report, before ELASTIC_STACK_SIGNAL (which a C++ program's launcher may
// set). 1..64; anything else is ignored. Thread-safe; any time, before or after InitAgent.
void SetStackSignal(int signal);

// What elastic::Init and elastic::Run do with a WorkerEnd: the message (on stderr, or logged
// when the code is 0), then exit(code).
[[noreturn]] void EndProcess(const WorkerEnd& end);

}  // namespace elastic::worker_agent
