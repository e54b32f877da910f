// The driver's decisions as a state machine (docs/architecture.md, "Policy and driver";
// docs/recovery.md). Events go in (a worker exited, a report, a round formed, a discovery result, a
// signal, the clock moved); actions come out (propose or withdraw a round, fence or abort, launch
// or signal a slot, write an event, log a line). The policy reads time only from its Clock and
// performs nothing itself: the Driver (driver.cc) polls processes and sockets, feeds the events and
// carries out the actions, and the unit tests feed events on a FakeClock and check the actions.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "common/clock.h"
#include "common/status.h"
#include "discovery/discovery.h"
#include "driver/driver.h"
#include "driver/event_log.h"
#include "driver/hang.h"
#include "driver/plan.h"
#include "driver/policy_state.h"
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

struct StragglerEstimate;  // driver/stragglers.h

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
  // Its compute and wait per step in its last sub-window of this round (-1: none yet), and
  // whether it is named a straggler (driver/stragglers.h).
  double step_compute = -1, step_wait = -1;
  bool straggler = false;
};
struct JobView {
  std::string phase;  // starting, training, changing, waiting, finishing, stopping
  int64_t round = -1, formed_round = -1;
  int min_np = 0, max_np = 0;           // max 0: no cap
  std::vector<MemberView> members;      // of the formed round, in rank order
  std::vector<std::pair<std::string, double>> blacklisted;  // host, seconds left (-1: for good)
  std::vector<std::pair<std::string, int64_t>> spares;      // warm spares: slot, pid (--spares)
  // Started for a place the job re-forms to give them once they are ready: slot, pid.
  std::vector<std::pair<std::string, int64_t>> newcomers;
  int resets = 0, failures = 0;
  int64_t stragglers = 0;  // named over the job
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
  // A policy that goes on from `state` (saved by state(), or loaded from the driver's journal),
  // under the same options: INVALID_ARGUMENT when the state's host table does not hold
  // together.
  static StatusOr<std::unique_ptr<Policy>> Restore(PolicyOptions options, PolicyState state);

  // --- events ---
  // The first host set (static hosts or the first discovery run): proposes round 0.
  void Start(const std::vector<discovery::HostSlots>& hosts);
  // A policy restored from the journal of a driver that died (driver/journal.h): `adopted`
  // are the slots whose processes still run, watched by this driver now; each must open its
  // Watch again within --rendezvous-timeout, or it is lost. Every other slot the state says
  // runs ended while no driver ran: an exit of unknown status (0 when it had reported
  // FINISHED). A round proposed but not formed is proposed again.
  // `ended`: of the slots that ended while no driver ran, those whose end is known (their
  // status keepers recorded it): the code and how it ended. The others end with 0 when they
  // had finished, else 1.
  void OnResumed(const std::vector<std::string>& adopted,
                 const std::map<std::string, std::pair<int, std::string>>& ended = {});
  // The slot's worker reported FINISHED (an adopted process's end says nothing of its status).
  bool finished(const std::string& slot) const;
  // The slot's worker was told to go (scaled away) or said it leaves: its end is expected.
  bool sent_away(const std::string& slot) const;
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
  // The slot's process waits in Join for a place no round gives it yet (a warm spare, or a
  // newcomer that is ready).
  void OnWaitingForPlace(const std::string& slot);
  void OnDiscovery(const StatusOr<std::vector<discovery::HostSlots>>& hosts,
                   const std::vector<std::string>& warnings);
  void OnSignal(int signal, const std::string& name);
  // The clock moved: deadlines that are due fire.
  void OnTimer();
  // Ends the job (SIGTERM to every worker, SIGKILL after the grace period).
  void Terminate(int code, const std::string& message);

  // --- results ---
  std::vector<Action> TakeActions();
  // Everything the policy knows, as a value: take it between events, after TakeActions.
  PolicyState state() const;
  JobView View() const;
  TimePoint NextDeadline() const;
  bool shutting_down() const { return s_.shutting_down; }
  int exit_code() const { return s_.exit_code; }
  const std::string& final_message() const { return s_.final_message; }
  // The label of the slot's output lines: its rank in the round it is in (the formed round it
  // is a member of, or the round it was launched for), or the slot itself.
  std::string Label(const std::string& slot) const;
  int64_t proposed_round() const { return s_.round; }
  int64_t formed_round() const { return s_.formed; }
  // Of the newest proposed round, in rank order.
  const std::vector<std::string>& members() const { return s_.members; }

 private:
  using Worker = WorkerState;
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
  // A member's commit report, for straggler detection (driver/stragglers.h): names it (a
  // `straggler` event) or clears the name (`straggler_cleared`).
  void WatchStraggler(Worker& w, const rendezvous::Report& r);
  // What --straggler-action does with a straggler just named: "replace", "drop" or "none",
  // why (a line for the log and the event), and the estimated steps per second after.
  std::tuple<std::string, std::string, double> DecideOnStraggler(
      Worker& w, const StragglerEstimate& e);
  // When every member of the formed round has reported a failure of its own there (the same
  // error in user code on every rank), the job ends with exit 1 and the first one's message
  // instead of waiting for hosts: relaunching would fail the same way. Not when the user gave
  // --max-failures or --reset-limit: those budgets allow retries. True when it ended the job.
  bool EndIfEveryMemberFailed();
  // When no round ever formed and every worker launched so far exited with a code of its own
  // before it was ever heard from (`last` the newest of them; `what` its failure), the job
  // ends with exit 1: the program fails before it connects (an import error), and waiting for
  // hosts (--elastic-timeout) would not help. Not with --max-failures or --reset-limit.
  bool EndIfNoWorkerStarted(const Worker& last, const std::string& what);
  void Progress();
  // OnExit's cases: a member killed after its peers finished; a newcomer or a spare that ended
  // before taking a place; a member kept for its state that had been told to leave; a member
  // that finished training (exit 0); a member that failed.
  void OnHungMemberExit(Worker& w, const std::string& rank, const std::string& how);
  void OnNewcomerExit(Worker& w, const std::string& how);
  void OnSpareExit(Worker& w, const std::string& how);
  void OnRescuedExit(Worker& w, const std::string& rank, const std::string& how);
  void OnMemberFinished(const Worker& w, const std::string& rank);
  void OnMemberFailed(Worker& w, const std::string& rank, int code, const std::string& how);

  // Plans the next round from the hosts and workers and, when it differs from the current one,
  // proposes it and fences the current one; else waits for hosts, or ends the job.
  void Replan(const std::string& reason);
  // Replan's steps. The plan, with the newcomers still starting counted in when the job would
  // be too small without them (they move from in.busy to in.spares).
  std::vector<std::string> PlanWithStarting(PlanInput& in, size_t need) const;
  // Warns once of each worker kept only because it alone holds the newest state.
  void WarnKeptHolders(const PlanInput& in);
  // Too few slots (`available` of `need`): ends the job when no host can come back, else
  // withdraws a broken proposal and starts the wait for hosts.
  void WaitForHosts(size_t available, size_t need, const std::string& reason);
  // Takes the slots that need a new process out of `plan` when the rest are enough (survivors
  // never wait for a start); returns them, to start as newcomers.
  std::vector<std::string> SplitOffNewcomers(const PlanInput& in, size_t need,
                                             std::vector<std::string>* plan) const;
  // Whether `plan` only adds newcomers whose places' loss was counted as a reset already.
  bool OnlyPaidArrivals(const std::vector<std::string>& plan) const;
  void PayCohortsOf(const std::vector<std::string>& plan);
  bool Gathering(const Worker& ready);
  // Proposes the next round of `plan`, fences the current one and places its members.
  void ProposeAndFence(const std::vector<std::string>& plan, const PlanInput& in,
                       const std::string& reason);
  // Gives each member of the new round its place: a waiting spare or newcomer takes it, a slot
  // with no process gets one.
  void PlaceMembers(const std::vector<std::string>& plan, const PlanInput& in);
  // A member failed, hung or was lost: its peers are aborted, its host charged, and the job
  // re-forms without it.
  void LoseWorker(Worker& w, const std::string& what);
  // Names a hung or silent worker, dumps its stacks, kills it and loses it.
  void DeclareHung(Worker& w, const std::string& why);
  // The formed round made no progress for the hang timeout: finds who holds it up
  // (FindHang, driver/hang.h), names and kills them, or re-forms a round that is stuck whole.
  void CheckHang();
  Duration HangTimeout() const;  // driver/hang.h's, with --hang-timeout
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
  // ABORT to every member of the formed round but `skip` ("": none), and a new rendezvous wait
  // for each of them (they roll back before they join).
  void AbortRound(const std::string& skip, const std::string& why);
  // Counts a failure of `w`'s host, once per incident: every failure of the host's workers in
  // one round is one incident.
  // `round`: the incident's (the one `w` is in, or the current one for a newcomer).
  void RecordHostFailure(const Worker& w, int64_t round, const std::string& what);
  // With --max-failures, ends the job (exit 1, `what`) once the failures exceed it; true then.
  bool EndIfTooManyFailures(const std::string& what);
  // A newcomer failed (exited or never got ready): counts a failure of the job and of its host
  // (the current round's incident). True when that ended the job.
  bool CountNewcomerFailure(const Worker& w, const std::string& what);
  // A newcomer still starting: not yet waiting in Join, its peers not waiting for it.
  static bool Starting(const Worker& w) { return w.running && w.joiner && !w.ready && !w.dropped; }
  // Whether `need` workers could ever run again without a new host being listed.
  bool CanEverReach(size_t need) const;
  // Workers whose host is no longer listed but who alone hold the newest state any live
  // worker reports: they stay members until a listed member reports a commit as new.
  std::set<std::string> StateKeepers() const;
  // The planner's view of the hosts (`available` of them) and of the workers.
  PlanInput MakePlanInput(std::vector<discovery::HostSlots> available) const;
  // The formed round's progress (driver/hang.h).
  RoundProgress CurrentProgress() const;
  // A spare not connected this long after its start is taken to be stopped or hung (one that
  // is still starting is as good as a new process, or better).
  static constexpr Duration kSpareStart = std::chrono::seconds(10);
  bool IsMember(const std::string& slot) const;
  void NoteStateLost(const rendezvous::FormedRound& f);
  void Log(Action::Level level, std::string message);
  void Event(std::string name, JsonFields fields);
  void Emit(Action a) { actions_.push_back(std::move(a)); }
  TimePoint Now() const { return opts_.clock->Now(); }
  static double Secs(Duration d) { return std::chrono::duration<double>(d).count(); }

  PolicyOptions opts_;
  const DriverOptions& d_;
  discovery::HostTable hosts_;
  std::vector<Action> actions_;
  // Everything the policy knows (driver/policy_state.h) but its host table, which is hosts_
  // (state() puts the two together).
  PolicyState s_;
  void OnCheckpointReport(const Worker& w, const rendezvous::Report& r);
  // A member's FAILED report (a failure of its own in this round), and its commit reports:
  // the step and cursor it holds, the recovery's last phases, stragglers, the finisher's check.
  void OnFailedReport(Worker& w, const rendezvous::Report& r);
  void OnCommitReport(Worker& w, const rendezvous::Report& r);
};

}  // namespace elastic::driver
