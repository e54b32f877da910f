// The driver's decisions as a state machine (DESIGN §3, §6). Events go in (a worker exited, a
// report, a round formed, a discovery result, a signal, the clock moved); actions come out
// (propose or withdraw a round, fence or abort, launch or signal a slot, write an event, log a
// line). The policy reads time only from its Clock and performs nothing itself: the Driver
// (driver.cc) polls processes and sockets, feeds the events and carries out the actions, and
// the unit tests feed events on a FakeClock and check the actions.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/status.h"
#include "discovery/discovery.h"
#include "driver/driver.h"
#include "driver/event_log.h"
#include "driver/plan.h"
#include "rendezvous/types.h"

namespace elastic::driver {

struct Action {
  enum Kind {
    kProposeRound,   // round, assignments, removed
    kWithdrawRound,  // round: the pending proposal goes; its Joins keep waiting
    kRestartWait,    // slots: the rendezvous wait for them starts again
    kPublish,        // slot, event (fence, abort)
    kLaunch,         // slot (spare: as a warm spare): start its worker; the result comes back
                     // as OnLaunched/OnLaunchFailed
    kSignal,         // slot, signal: to the worker's process group (SIGKILL: stop reading it)
    kDumpStacks,     // slot, signal: print the worker's stacks into its log (signal: the one
                     // that makes it print its own, e.g. Python's faulthandler; 0: none)
    kWriteEvent,     // name, fields: one event-log line
    kLog,            // level, message: one driver log line
  };
  enum Level { kDebug, kInfo, kWarn, kError };

  Kind kind = kLog;
  int64_t round = -1;
  std::map<std::string, rendezvous::Assignment> assignments;
  std::vector<std::string> removed;
  std::vector<std::string> slots;
  std::string slot;
  rendezvous::Event event;
  int signal = 0;
  bool spare = false;
  std::string name;
  JsonFields fields;
  Level level = kInfo;
  std::string message;
};

struct PolicyOptions {
  DriverOptions driver;
  Clock* clock = RealClock();
  uint64_t seed = 0;  // blacklist cooldown jitter
  // Whether a host is this machine (its workers are started directly, not through ssh).
  std::function<bool(const std::string&)> is_local = [](const std::string&) { return true; };
};

// What the job looks like now, for `elastic-run status`, metrics and progress lines.
struct MemberView {
  int rank = -1;
  std::string slot, host;
  int64_t pid = 0, step = -1, epoch = -1, cursor = -1, samples = -1, epoch_size = -1;
  double since_commit = -1;  // seconds since its newest commit report; -1: none yet
  double steps_per_second = 0;
};
struct JobView {
  std::string phase;  // starting, training, changing, waiting, finishing, stopping
  int64_t round = -1, formed_round = -1;
  int min_np = 0, max_np = 0;           // max 0: no cap
  std::vector<MemberView> members;      // of the formed round, in rank order
  std::vector<std::pair<std::string, double>> blacklisted;  // host, seconds left (-1: for good)
  std::vector<std::pair<std::string, int64_t>> spares;      // warm spares: slot, pid (--spares)
  int resets = 0, failures = 0;
  double since_recovery = -1;  // seconds since the last recovery began; -1: none
  // --checkpoint-dir: the newest checkpoint written (version -1: none yet), how long its write
  // took, failed writes, and the last failure's message ("" once one succeeds again).
  bool checkpoints = false;
  int64_t checkpoint_version = -1, checkpoint_step = -1;
  double checkpoint_seconds = 0;
  std::string checkpoint_path, checkpoint_error;
  int64_t checkpoint_failures = 0;
};

class Policy {
 public:
  explicit Policy(PolicyOptions options);

  // --- events ---
  // The first host set (static hosts or the first discovery run): proposes round 0.
  void Start(const std::vector<discovery::HostSlots>& hosts);
  void OnLaunched(const std::string& slot, int64_t pid);
  void OnLaunchFailed(const std::string& slot, const Status& why);
  // The slot's process exited with `code` (128+N for signal N); `how` describes it.
  void OnExit(const std::string& slot, int code, const std::string& how);
  void OnReport(const rendezvous::Report& report);
  void OnRoundFormed(const rendezvous::FormedRound& formed);
  void OnStateLost(const rendezvous::FormedRound& formed);
  void OnJoinTimeout(int64_t round, const std::vector<std::string>& missing);
  void OnMemberLeft(int64_t round, const std::string& slot);
  void OnWatch(const std::string& slot, bool open);
  void OnDiscovery(const StatusOr<std::vector<discovery::HostSlots>>& hosts,
                   const std::vector<std::string>& warnings);
  void OnSignal(int signal, const std::string& name);
  // The clock moved: deadlines that are due fire.
  void OnTimer();
  // Ends the job (SIGTERM to every worker, SIGKILL after the grace period).
  void Terminate(int code, const std::string& message);

  // --- results ---
  std::vector<Action> TakeActions();
  JobView View() const;
  TimePoint NextDeadline() const;
  bool shutting_down() const { return shutting_down_; }
  int exit_code() const { return exit_code_; }
  const std::string& final_message() const { return final_message_; }
  // The label of the slot's output lines: its rank in the round it is in (the formed round it
  // is a member of, or the round it was launched for), or the slot itself.
  std::string Label(const std::string& slot) const;
  int64_t proposed_round() const { return round_; }
  int64_t formed_round() const { return formed_; }
  // Of the newest proposed round, in rank order.
  const std::vector<std::string>& members() const { return members_; }

 private:
  struct Worker {
    std::string slot, host;
    bool local = true;
    bool running = false;   // a process is started and has not exited
    bool dropped = false;   // the driver gave up on it (failed, lost, removed): exit is expected
    bool removed = false;   // scaled away
    bool finished = false;  // reported FINISHED
    bool leaving = false;   // reported LEAVING: no longer a member, whatever its exit
    bool spare = false;     // a warm spare (--spares): started, waiting in Join for a place
    bool rescued = false;   // removed, then kept as a member for the state it holds
    TimePoint lost_at = TimePoint::max();  // Watch broke; lost unless it exits by then
    int watches = 0;       // Watch streams open from the slot's process
    int stale_closes = 0;  // closes still to come from the streams of an earlier process
    int64_t round = -1;     // the round it is in (formed member, or launched for)
    int rank = -1;          // its rank there (planned until that round forms)
    int64_t pid = 0;
    int64_t step = -1;  // of its newest commit
    int64_t version = 0;  // of the state it says it holds (its newest commit report)
    TimePoint commit_at{};      // when its newest commit report came
    int64_t logged_round = -1;  // the round of its last `committed` event
    // From its newest report of any kind (a heartbeat comes every second).
    TimePoint heard_at{};
    TimePoint launched_at{};  // when its current process was started
    TimePoint moved_at{};  // when its count of collectives last changed
    int64_t heard_round = -1;
    int64_t collectives = 0;
    bool in_collective = false;
    int stack_signal = 0;
    int64_t epoch = -1, cursor = -1, samples = -1, epoch_size = -1;
    double rate = 0;  // steps per second, between its last two commit reports
    // Its program reported a failure of its own (an exception in user code) in this round,
    // with this message (-1: none since it started).
    int64_t failed_round = -1;
    std::string failure;
    bool exit_hung = false;  // killed for not exiting after its peers finished
  };
  // The job is finishing and members still run a hang timeout after the first finished: each
  // is named, its stacks dumped, and it is killed. One that had reported FINISHED trained to
  // the end (a hang in teardown: the job still succeeds); one that had not fails the job.
  void CheckExitHang();
  // The members whose exits finish the job: those of the formed round that are still members.
  std::vector<std::string> FinishingMembers() const;
  // Slots of the formed round whose process there was lost and relaunched for a later round.
  std::vector<std::string> LostFormedMembers() const;
  // The worker_hung event for `w`, with `why`.
  void HungEvent(const Worker& w, const std::string& why);
  // When every member of the formed round has reported a failure of its own there (the same
  // error in user code on every rank), the job ends with exit 1 and the first one's message
  // instead of waiting for hosts: relaunching would fail the same way. Not when the user gave
  // --max-failures or --reset-limit: those budgets allow retries. True when it ended the job.
  bool EndIfEveryMemberFailed();
  void Progress();

  void Replan(const std::string& reason);
  // A member failed, hung or was lost: its peers are aborted, its host charged, and the job
  // re-forms without it.
  void LoseWorker(Worker& w, const std::string& what);
  // Names a hung or silent worker, dumps its stacks, kills it and loses it.
  void DeclareHung(Worker& w, const std::string& why);
  // The formed round made no progress for the hang timeout: finds who holds it up.
  void CheckHang();
  Duration HangTimeout() const;
  // Starts the slot's worker for rank `rank` of the newest proposed round, or as a warm spare.
  void Launch(Worker& w, int rank, bool spare = false);
  // Starts warm spares on free slots (not in `plan`, no process) until --spares run, and stops
  // spares whose host is no longer listed.
  void TopUpSpares(const std::vector<std::string>& plan);
  Worker& WorkerFor(const std::string& slot);
  void SignalSlot(const std::string& slot, int signal);
  // Asks for the worker's stacks in its log (with the signal it registered for its own dump).
  void DumpStacks(const Worker& w);
  void CheckFinished();
  void HandleLeaving(Worker& w, const std::string& why);
  // If `gone` is a member of the formed round: ABORT to the others (AbortRound).
  void AbortFormedRound(const std::string& gone, const std::string& why);
  // ABORT to every member of the formed round but `skip` ("": none).
  void AbortRound(const std::string& skip, const std::string& why);
  // Counts a failure of `w`'s host, once per incident: every failure of the host's workers in
  // one round is one incident.
  void RecordHostFailure(const Worker& w, const std::string& what);
  // Whether `need` workers could ever run again without a new host being listed.
  bool CanEverReach(size_t need) const;
  // Workers whose host is no longer listed but who alone hold the newest state any live
  // worker reports: they stay members until a listed member reports a commit as new.
  std::set<std::string> StateKeepers() const;
  // The planner's view of the hosts (`available` of them) and of the workers.
  PlanInput MakePlanInput(std::vector<discovery::HostSlots> available) const;
  // The formed round's progress: its last commit or collective started (or its forming), and
  // how long it may go without (the hang timeout, doubled before its first commit).
  struct RoundProgress {
    TimePoint at{};
    bool committed = false;
    Duration limit{};
  };
  RoundProgress CurrentProgress() const;
  // A member with no report for this long is silent (heartbeats come every second).
  static constexpr Duration kSilence = std::chrono::seconds(2);
  // A spare not connected this long after its start is taken to be stopped or hung (one that
  // is still starting is as good as a new process, or better).
  static constexpr Duration kSpareStart = std::chrono::seconds(10);
  bool IsMember(const std::string& slot) const;
  void Log(Action::Level level, std::string message);
  void Event(std::string name, JsonFields fields);
  void Emit(Action a) { actions_.push_back(std::move(a)); }
  TimePoint Now() const { return opts_.clock->Now(); }

  PolicyOptions opts_;
  const DriverOptions& d_;
  discovery::HostTable hosts_;
  std::vector<Action> actions_;
  std::map<std::string, Worker> workers_;  // by slot
  std::vector<std::string> members_;       // newest proposed round, rank order
  int64_t round_ = -1;                     // newest proposed round
  int64_t formed_ = -1;                    // newest formed round
  std::vector<std::string> formed_members_;
  std::vector<std::string> failure_order_;  // slots, in the order their failure reports came
  std::set<std::string> kept_;  // StateKeepers() at the newest re-plan
  int64_t aborted_ = -1;    // newest formed round whose members got ABORT
  int64_t withdrawn_ = -1;  // newest proposed round withdrawn
  std::map<std::string, int64_t> incident_round_;  // host -> round of its last counted failure
  int resets_ = 0, failures_ = 0;
  int spare_failures_ = 0;  // spares that exited before taking a place
  TimePoint formed_at_{};           // when the newest formed round formed
  TimePoint next_progress_{};       // next progress line (after the first round forms)
  int64_t progress_samples_ = -1;   // samples at the last progress line
  int64_t progress_step_ = -1;
  TimePoint progress_at_{};
  Duration longest_interval_{0};    // between two commits of a worker, per step
  bool finishing_ = false;
  std::string finisher_;  // the first member that finished
  TimePoint finishing_at_{};  // when it did: the others must exit within the hang timeout
  bool shutting_down_ = false;
  int exit_code_ = 0;
  std::string final_message_;
  TimePoint kill_at_ = TimePoint::max();
  TimePoint wait_until_ = TimePoint::max();
  TimePoint recovery_start_{};
  bool recovering_ = false;
  bool round_broken_ = false;
  bool first_commit_logged_ = true;
  bool started_ = false;  // some round formed
  // A round formed without any commit after commits were made (state lost), with
  // --checkpoint-dir: its rank 0 restores a checkpoint; what was committed before.
  int64_t restore_round_ = -1, lost_committed_ = 0;
  int64_t checkpoint_version_ = -1, checkpoint_step_ = -1, checkpoint_failures_ = 0;
  double checkpoint_seconds_ = 0;
  std::string checkpoint_path_, checkpoint_error_;
  void OnCheckpointReport(const Worker& w, const rendezvous::Report& r);
  std::vector<discovery::HostSlots> last_listed_;
  std::vector<std::string> last_listed_order_;
};

}  // namespace elastic::driver
