// The driver's membership decisions (docs/architecture.md, "Policy and driver";
// docs/recovery.md). This file: the policy's state and actions, planning the next round
// (Replan), launching workers and spares, finishing, and resuming after a driver restart. The
// rest of Policy, by concept: policy_failures.cc (exits, failure budgets, the blacklist),
// policy_reports.cc (reports: commits, failures, stragglers, checkpoints), policy_rounds.cc
// (rounds formed, join timeouts, members leaving, discovery, signals, the end of the job),
// policy_hang.cc (hang detection, the job's view and progress, the timer).
#include "driver/events.h"
#include "driver/policy.h"

#include <signal.h>
#include <spdlog/fmt/fmt.h>
#include <spdlog/fmt/ranges.h>

#include <algorithm>

#include "driver/plan.h"
#include "driver/spares.h"
#include "driver/stragglers.h"

namespace elastic::driver {

using rendezvous::Assignment;
using rendezvous::EventKind;

Policy::Policy(PolicyOptions options)
    : opts_(std::move(options)),
      d_(opts_.driver),
      hosts_(discovery::HostTableOptions{opts_.clock, d_.host_failure_limit, d_.cooldown_min,
                                         d_.cooldown_max, opts_.seed}) {}

StatusOr<std::unique_ptr<Policy>> Policy::Restore(PolicyOptions options, PolicyState state) {
  std::unique_ptr<Policy> p(new Policy(std::move(options)));
  Status s = p->hosts_.Restore(state.hosts);
  if (!s.ok()) return s.WithContext("the driver's saved state");
  state.hosts = {};
  p->s_ = std::move(state);
  return p;
}

PolicyState Policy::state() const {
  PolicyState s = s_;
  s.hosts = hosts_.state();
  return s;
}

std::vector<Action> Policy::TakeActions() {
  std::vector<Action> out;
  out.swap(actions_);
  return out;
}

void Policy::Log(Action::Level level, std::string message) {
  Action a;
  a.kind = Action::kLog;
  a.level = level;
  a.message = std::move(message);
  Emit(std::move(a));
}

void Policy::Event(std::string name, JsonFields fields) {
  Action a;
  a.kind = Action::kWriteEvent;
  a.name = std::move(name);
  a.fields = std::move(fields);
  Emit(std::move(a));
}

std::string Policy::Label(const std::string& slot) const {
  auto it = s_.workers.find(slot);
  return it != s_.workers.end() && it->second.rank >= 0 ? std::to_string(it->second.rank) : slot;
}

bool Policy::IsMember(const std::string& slot) const {
  return std::find(s_.members.begin(), s_.members.end(), slot) != s_.members.end();
}

TimePoint Policy::NextDeadline() const {
  TimePoint next = std::min({s_.kill_at, s_.wait_until, s_.gather_until});
  for (const auto& [slot, w] : s_.workers) {
    if (w.running) next = std::min(next, w.lost_at);
    if (Starting(w) && !s_.shutting_down) {
      next = std::min(next, w.launched_at + d_.rendezvous_timeout);
    }
  }
  if (!s_.shutting_down) next = std::min(next, hosts_.NextCooldownEnd());
  if (!s_.shutting_down && s_.finishing) {
    TimePoint t = s_.finishing_at + HangTimeout();
    if (t > Now()) next = std::min(next, t);
  }
  // Hang checks: when the round's progress runs out, and when a member would count as silent
  // (future times only: one that passed was checked already).
  if (!s_.shutting_down && !s_.finishing && s_.started && s_.round == s_.formed) {
    TimePoint now = Now();
    auto consider = [&](TimePoint t) {
      if (t > now) next = std::min(next, t);
    };
    for (const auto& slot : s_.formed_members) {
      consider(s_.workers.at(slot).heard_at + kSilence + std::chrono::milliseconds(1));
    }
    RoundProgress p = CurrentProgress();
    consider(p.at + p.limit);
  }
  return next;
}

void Policy::Start(const std::vector<discovery::HostSlots>& hosts) {
  hosts_.Update(hosts);
  s_.last_listed = hosts;
  for (const auto& h : hosts) s_.last_listed_order.push_back(h.host);
  std::vector<std::string> names;
  for (const auto& h : hosts) names.push_back(h.host + ":" + std::to_string(h.slots));
  Event(events::kDiscovery, {{"hosts", names}, {"ok", true}});
  Replan("start");
}

PlanInput Policy::MakePlanInput(std::vector<discovery::HostSlots> available) const {
  PlanInput in;
  in.listed = s_.last_listed;
  in.available = std::move(available);
  in.host_order = s_.last_listed_order;
  in.max_np = d_.max_np > 0 ? static_cast<size_t>(d_.max_np) : 0;
  in.keep = StateKeepers();
  for (const auto& [slot, w] : s_.workers) {
    if (!w.running) continue;
    if (in.keep.count(slot) && !w.dropped) {
      in.alive.insert(slot);  // a removed worker that alone holds the state stays a member
    } else if (w.spare && !w.dropped && !w.removed) {
      // A newcomer still starting is planned for no one: its peers must not wait for it.
      (w.joiner && !w.ready ? in.busy : in.spares).insert(slot);
    } else if (!w.dropped && !w.removed && !w.leaving) {
      in.alive.insert(slot);
    } else {
      in.busy.insert(slot);
    }
  }
  // A replaced or dropped straggler's slot: planned for no one (its worker leaves) and no new
  // process, until its eviction ends.
  for (const auto& [slot, w] : s_.workers) {
    if (w.evicted_until > Now()) in.evicted.insert(slot);
  }
  in.reserve = d_.spares > 0 ? static_cast<size_t>(d_.spares) : 0;
  in.need = static_cast<size_t>(d_.np);  // spares use only slots beyond -np
  // What the workers say they hold (their commit reports), not what the driver assumes.
  int64_t newest = 0;
  for (const auto& slot : in.alive) newest = std::max(newest, s_.workers.at(slot).version);
  if (newest > 0) {
    for (const auto& slot : in.alive) {
      if (s_.workers.at(slot).version == newest) in.holders.insert(slot);
    }
  }
  for (const auto& slot : in.alive) {
    const Worker& w = s_.workers.at(slot);
    if (w.heard_at != TimePoint{} && Now() - w.heard_at > kSilence) in.silent.insert(slot);
  }
  for (const auto& slot : in.spares) {
    const Worker& w = s_.workers.at(slot);
    bool silent = w.watches > 0
                      ? w.heard_at != TimePoint{} && Now() - w.heard_at > kSilence
                      : Now() - w.launched_at > kSpareStart;  // never connected
    if (silent) in.silent.insert(slot);
  }
  return in;
}

std::set<std::string> Policy::StateKeepers() const {
  // Removing a host (or scaling a host down) must not take the only copy of the state with
  // it: its workers are still alive when discovery stops listing them, and a worker told to go
  // is alive until it reaches its next Join. One holder stays for a round, hands the state
  // over in that round's sync, and goes once a listed member has committed as new a version.
  int64_t newest = 0, listed_newest = 0;
  std::vector<const Worker*> unlisted;
  for (const auto& [slot, w] : s_.workers) {
    if (!w.running || w.dropped || w.leaving || w.spare || w.finished) continue;
    newest = std::max(newest, w.version);
    if (SlotListed(s_.last_listed, slot) && !w.removed) {
      listed_newest = std::max(listed_newest, w.version);
    } else {
      unlisted.push_back(&w);
    }
  }
  if (newest <= 0 || listed_newest >= newest) return {};
  // One not told to go yet before one that was (the removal may have reached it already: it
  // exits at its next join, whatever a later round wants), then the one kept before.
  const Worker* pick = nullptr;
  auto rank = [&](const Worker* w) {
    return std::make_pair(w->removed ? 1 : 0, s_.kept.count(w->slot) ? 0 : 1);
  };
  for (const Worker* w : unlisted) {
    if (w->version != newest) continue;
    if (!pick || rank(w) < rank(pick)) pick = w;
  }
  if (!pick) return {};
  return {pick->slot};
}

bool Policy::CanEverReach(size_t need) const {
  if (!d_.discovery_script.empty()) return true;  // a host may be listed later
  // Static hosts: every slot of a host that is not blacklisted for good, whether its cooldown
  // ends later or its old process is still going away.
  PlanInput in = MakePlanInput(hosts_.AvailableEventually());
  in.busy.clear();
  return PlanMembers(in).size() >= need;
}

void Policy::Replan(const std::string& reason) {
  if (s_.shutting_down || s_.finishing) return;
  PlanInput in = MakePlanInput(hosts_.Available());
  const size_t need = static_cast<size_t>(s_.started ? d_.min_np : d_.np);
  std::vector<std::string> plan = PlanWithStarting(in, need);
  WarnKeptHolders(in);
  if (plan.size() < need) {
    WaitForHosts(plan.size(), need, reason);
    return;
  }
  s_.wait_until = TimePoint::max();
  std::vector<std::string> newcomers = SplitOffNewcomers(in, need, &plan);
  const bool changes = !(plan == s_.members && s_.round >= 0 && !s_.round_broken);
  // New places that this one change brought (slots discovery added) are one cohort: they join
  // together and their arrival counts one reset.
  const int64_t cohort = !changes && !newcomers.empty() ? ++s_.cohorts : 0;
  for (const auto& slot : newcomers) {
    Worker& w = WorkerFor(slot);
    Launch(w, -1, /*spare=*/true);
    w.joiner = true;
    // Its place is the one a lost member left (this change counts as the job's reset), or a
    // new one (the arrival of its cohort's first will).
    w.paid = changes;
    w.cohort = cohort;
    Log(Action::kInfo, fmt::format("starting a new worker in slot {}; the job goes on without "
                                   "it and re-forms with it once it is ready",
                                   slot));
    Event(events::kNewcomerStarted, {{"slot", slot}, {"reason", reason}});
  }
  if (!changes) {  // nothing to change
    TopUpSpares(plan);
    return;
  }
  const bool only_paid = OnlyPaidArrivals(plan);
  for (const auto& slot : plan) {
    auto it = s_.workers.find(slot);
    if (it == s_.workers.end() || !it->second.removed) continue;
    Worker& w = it->second;
    // Told to go in an earlier proposal and kept now: if the removal reached it first, it
    // exits 0 at its next Join; that exit is then a departure, not the end of training.
    w.removed = false;
    w.rescued = true;
  }
  s_.round_broken = false;
  if (s_.round >= 0 && !only_paid) {
    if (d_.reset_limit >= 0 && s_.resets >= d_.reset_limit) {
      Terminate(1, "reset limit reached (" + std::to_string(d_.reset_limit) +
                       " resets; raise --reset-limit to allow more)");
      return;
    }
    ++s_.resets;
    PayCohortsOf(plan);
  }
  s_.gather_until = TimePoint::max();
  ProposeAndFence(plan, in, reason);
  TopUpSpares(plan);
}

std::vector<std::string> Policy::PlanWithStarting(PlanInput& in, size_t need) const {
  std::vector<std::string> plan = PlanMembers(in);
  if (plan.size() >= need) return plan;
  // Too few without the newcomers still starting: the round waits for them, as for any new
  // process (they are members from now on).
  bool starting = false;
  for (const auto& [slot, w] : s_.workers) {
    if (Starting(w) && in.busy.count(slot)) {
      in.busy.erase(slot);
      in.spares.insert(slot);
      starting = true;
    }
  }
  return starting ? PlanMembers(in) : plan;
}

void Policy::WarnKeptHolders(const PlanInput& in) {
  for (const auto& slot : in.keep) {
    if (s_.kept.count(slot)) continue;
    const Worker& w = s_.workers.at(slot);
    Log(Action::kWarn,
        fmt::format("slot {} is to go (host {} no longer lists it, or the job scales down), "
                    "but its worker alone holds the newest state (version {}): it stays a "
                    "member until the state is handed over",
                    slot, w.host, w.version));
    Event(events::kHolderKept, {{"slot", slot}, {"version", w.version}});
  }
  s_.kept = in.keep;
}

void Policy::WaitForHosts(size_t available, size_t need, const std::string& reason) {
  std::string needed =
      s_.started ? "--min-np " + std::to_string(d_.min_np) : "-np " + std::to_string(d_.np);
  if (!CanEverReach(need)) {
    Terminate(1, "no hosts left: " + std::to_string(available) + " worker(s) can run, " + needed +
                     " needed, and no host can come back (every listed host is " +
                     "running, gone or blacklisted for good; " + reason + ")");
    return;
  }
  // A proposed round that lost a member cannot form: it is withdrawn, so that no one waits
  // for it (its members' Joins wait for the next round).
  if (s_.round > s_.formed && s_.round_broken && s_.withdrawn < s_.round) {
    s_.withdrawn = s_.round;
    Action a;
    a.kind = Action::kWithdrawRound;
    a.round = s_.round;
    Emit(std::move(a));
    Event(events::kRoundWithdrawn, {{"round", s_.round}, {"reason", reason}});
    Log(Action::kWarn, fmt::format("round {} withdrawn ({})", s_.round, reason));
  }
  if (s_.wait_until == TimePoint::max()) {
    Duration limit = s_.started ? d_.elastic_timeout : d_.start_timeout;
    s_.wait_until = Now() + limit;
    Log(Action::kWarn,
        fmt::format("{} slot(s) available, {} needed ({}); waiting up to {:.0f} s for hosts",
                    available, need, reason, Secs(limit)));
    Event(events::kWaitingForHosts, {{"available", int64_t(available)}, {"needed", int64_t(need)}});
  }
}

std::vector<std::string> Policy::SplitOffNewcomers(const PlanInput& in, size_t need,
                                                   std::vector<std::string>* plan) const {
  // Survivors never wait for a process to start (an import of torch takes seconds): once a
  // round has formed, the slots that need a new process (a lost member's, one discovery added)
  // get a newcomer that the next round does not include, as long as the others are enough. It
  // starts, initialises and waits in Join like a warm spare; once it is there
  // (OnWaitingForPlace) the job re-forms with it at the members' next commit.
  if (!d_.elastic || !s_.started) return {};
  std::vector<std::string> rest, newcomers;
  for (const auto& slot : *plan) {
    (in.alive.count(slot) || in.spares.count(slot) ? rest : newcomers).push_back(slot);
  }
  if (newcomers.empty() || rest.size() < std::max<size_t>(need, 1)) return {};
  *plan = std::move(rest);
  return newcomers;
}

void Policy::PayCohortsOf(const std::vector<std::string>& plan) {
  // One change from outside is one reset however many processes it brings (as Horovod
  // counts): the reset just counted for a newcomer's arrival pays for the rest of its cohort,
  // which may get ready later.
  std::set<int64_t> arriving;
  for (const auto& slot : plan) {
    auto it = s_.workers.find(slot);
    if (it != s_.workers.end() && it->second.joiner && it->second.cohort != 0) {
      arriving.insert(it->second.cohort);
    }
  }
  for (auto& [slot, w] : s_.workers) {
    if (w.joiner && arriving.count(w.cohort)) w.paid = true;
  }
}

bool Policy::Gathering(const Worker& ready) {
  // A ready newcomer whose cohort has others still starting waits for them, up to
  // --newcomer-window from the first one's readiness, so that the job re-forms once with the
  // whole cohort (OnTimer re-plans at the window's end).
  if (ready.cohort == 0 || d_.newcomer_window <= Duration::zero()) return false;
  int starting = 0;
  for (const auto& [slot, w] : s_.workers) {
    if (w.cohort == ready.cohort && Starting(w)) ++starting;
  }
  if (starting == 0) return false;
  if (s_.gather_until == TimePoint::max()) {
    s_.gather_until = Now() + d_.newcomer_window;
    Log(Action::kInfo,
        fmt::format("waiting up to {:.1f} s (--newcomer-window) for the {} other new worker(s) "
                    "started with slot {}, to re-form once with all of them",
                    Secs(d_.newcomer_window), starting, ready.slot));
  }
  return Now() < s_.gather_until;
}

bool Policy::OnlyPaidArrivals(const std::vector<std::string>& plan) const {
  // The arrival of newcomers for places whose loss was counted already is not another reset.
  if (s_.round_broken || s_.round < 0) return false;
  for (const auto& slot : s_.members) {
    if (std::find(plan.begin(), plan.end(), slot) == plan.end()) return false;
  }
  for (const auto& slot : plan) {
    if (std::find(s_.members.begin(), s_.members.end(), slot) != s_.members.end()) continue;
    auto it = s_.workers.find(slot);
    if (it == s_.workers.end() || !it->second.joiner || !it->second.paid) return false;
  }
  return true;
}

void Policy::ProposeAndFence(const std::vector<std::string>& plan, const PlanInput& in,
                             const std::string& reason) {
  auto alive = [&](const std::string& slot) { return in.alive.count(slot) > 0; };
  std::vector<std::string> old = s_.members;
  int64_t old_round = s_.round;
  s_.members = plan;
  ++s_.round;
  // Planned ranks; rank 0 and whether a sync is needed are settled when the round forms, from
  // the versions the members say they hold.
  Action propose;
  propose.kind = Action::kProposeRound;
  propose.round = s_.round;
  propose.assignments = AssignRanks(plan, false);
  for (auto& [slot, w] : s_.workers) {
    if (alive(slot) && !IsMember(slot)) {
      propose.removed.push_back(slot);
      w.removed = true;
    }
  }
  Log(Action::kInfo, fmt::format("round {}: {} worker(s) [{}] ({})", s_.round, plan.size(),
                                 fmt::join(plan, " "), reason));
  Event(events::kRoundProposed,
        {{"round", s_.round}, {"members", plan}, {"removed", propose.removed}, {"reason", reason}});
  Emit(std::move(propose));
  // Fence the old round: survivors stop at their next commit. Members of a formed round that
  // were told to abort it have stopped already: the fence would be a second message to each,
  // sent by a driver that then has the next round to serve (at 128 workers the two loops of
  // publishes took 0.15-0.25 s of its time).
  const bool all_aborted = old_round >= 0 && old_round == s_.formed && s_.aborted == s_.formed;
  for (const auto& slot : old) {
    if (alive(slot) && !all_aborted) {
      Action a;
      a.kind = Action::kPublish;
      a.slot = slot;
      a.event = rendezvous::Event{EventKind::kMembershipChanging, old_round, reason};
      Emit(std::move(a));
    }
  }
  if (old_round >= 0) Event(events::kFence, {{"round", old_round}, {"reason", reason}});
  PlaceMembers(plan, in);
}

void Policy::PlaceMembers(const std::vector<std::string>& plan, const PlanInput& in) {
  for (size_t rank = 0; rank < plan.size(); ++rank) {
    const std::string& slot = plan[rank];
    Worker& w = WorkerFor(slot);
    if (in.spares.count(slot)) {
      // A warm spare (or a newcomer) takes the place: its Join is waiting already, no process
      // starts.
      w.spare = false;
      w.round = s_.round;
      w.rank = static_cast<int>(rank);
      if (w.joiner) {
        w.joiner = w.ready = w.paid = false;
        Log(Action::kInfo,
            fmt::format("round {}: the new worker in slot {} takes its place", s_.round, slot));
        Event(events::kNewcomerPlaced, {{"slot", slot}, {"round", s_.round}});
        continue;
      }
      Log(Action::kInfo,
          fmt::format("round {}: the spare in slot {} takes a place", s_.round, slot));
      Event(events::kSparePromoted, {{"slot", slot}, {"round", s_.round}});
    } else if (!in.alive.count(slot)) {
      Launch(w, static_cast<int>(rank));
    }
  }
}

void Policy::SignalSlot(const std::string& slot, int signal) {
  Action a;
  a.kind = Action::kSignal;
  a.slot = slot;
  a.signal = signal;
  Emit(std::move(a));
}

Policy::Worker& Policy::WorkerFor(const std::string& slot) {
  Worker& w = s_.workers[slot];
  if (w.slot.empty()) {
    w.slot = slot;
    w.host = rendezvous::Slot::Parse(slot).host;
    w.local = opts_.is_local(w.host);
  }
  return w;
}

void Policy::TopUpSpares(const std::vector<std::string>& plan) {
  if (s_.shutting_down || s_.finishing) return;
  const SparePlan spares =
      PlanSpares(s_, s_.last_listed, hosts_.Available(), plan, d_.spares, Now());
  for (const std::string& slot : spares.stop) {  // its host (or slot) is unlisted: it goes
    s_.workers.at(slot).dropped = true;
    SignalSlot(slot, SIGTERM);
  }
  for (const std::string& slot : spares.start) {
    Launch(WorkerFor(slot), -1, /*spare=*/true);
    Log(Action::kInfo, fmt::format("starting a warm spare in slot {}", slot));
  }
}

void Policy::Launch(Worker& w, int rank, bool spare) {
  w.running = true;
  w.launched_at = Now();
  w.spare = spare;
  w.joiner = w.ready = w.paid = false;
  w.dropped = w.removed = w.finished = w.leaving = false;
  w.lost_at = TimePoint::max();
  w.stale_closes += w.watches;
  w.watches = 0;
  w.round = spare ? -1 : s_.round;  // a spare is in no round until it takes a place
  w.rank = spare ? -1 : rank;
  w.step = -1;
  w.rescued = false;
  w.version = 0;  // a new process holds nothing until it says so
  w.pid = 0;
  w.start_failed = false;
  Action a;
  a.kind = Action::kLaunch;
  a.slot = w.slot;
  a.spare = spare;
  Emit(std::move(a));
}

void Policy::OnLaunched(const std::string& slot, int64_t pid) {
  auto it = s_.workers.find(slot);
  if (it == s_.workers.end()) return;
  it->second.pid = pid;
  ResetStragglerWindow(it->second);
  it->second.straggler = false;
  Event(events::kWorkerStarted, {{"slot", slot}, {"pid", pid}, {"spare", it->second.spare}});
}

void Policy::OnLaunchFailed(const std::string& slot, const Status& why) {
  auto it = s_.workers.find(slot);
  if (it == s_.workers.end()) return;
  Worker& w = it->second;
  w.running = false;
  w.dropped = true;
  ++s_.failures;
  Log(Action::kError,
      fmt::format("cannot start the worker for slot {}: {}", slot, why.message()));
  Event(events::kWorkerStartFailed, {{"slot", slot}, {"error", why.message()}});
  if (!d_.elastic) Terminate(why.code() == Code::kNotFound ? 127 : 1, why.message());
}

std::vector<std::string> Policy::FinishingMembers() const {
  // A round proposed but not formed when the members finished never trained: its newcomers
  // (a new worker, a promoted spare, a relaunch of a lost member's slot) wait in their join
  // and are stopped with the job. Only the processes that joined the formed round count.
  if (!s_.started || s_.round == s_.formed) return s_.members;
  std::vector<std::string> out;
  for (const auto& slot : s_.members) {
    if (std::find(s_.formed_members.begin(), s_.formed_members.end(), slot) ==
        s_.formed_members.end()) {
      continue;
    }
    auto it = s_.workers.find(slot);
    if (it != s_.workers.end() && it->second.round == s_.formed) out.push_back(slot);
  }
  return out;
}

std::vector<std::string> Policy::LostFormedMembers() const {
  // Slots of the formed round whose process there is gone, its place now a newer process.
  std::vector<std::string> out;
  if (!s_.started || s_.round == s_.formed) return out;
  for (const auto& slot : s_.formed_members) {
    auto it = s_.workers.find(slot);
    // Its slot relaunched: for a member of the newer round, or for a newcomer.
    if (it != s_.workers.end() && it->second.round != s_.formed && !it->second.leaving &&
        !it->second.removed && (IsMember(slot) || (it->second.running && it->second.joiner))) {
      out.push_back(slot);
    }
  }
  return out;
}

void Policy::CheckFinished() {
  if (s_.shutting_down || !s_.finishing) return;
  std::vector<std::string> finishing = FinishingMembers();
  for (const auto& slot : finishing) {
    auto it = s_.workers.find(slot);
    if (it != s_.workers.end() && it->second.running) return;
  }
  std::string which = s_.started ? " of round " + std::to_string(s_.formed) : "";
  std::vector<std::string> lost = LostFormedMembers();
  if (!lost.empty()) {
    // Its peers are done: no round will form for the relaunched process, and whether the
    // lost one finished its own end of training (a save, its last report) is unknown.
    ++s_.failures;
    Terminate(1, fmt::format("{} worker(s){} finished, but the worker of slot(s) [{}] was lost "
                             "before it finished (its peers, done, cannot train with a new "
                             "process)",
                             finishing.size(), which, fmt::join(lost, " ")));
    return;
  }
  int64_t newest = 0;  // the version the finished members hold: the final state
  for (const auto& slot : finishing) newest = std::max(newest, s_.workers.at(slot).version);
  if (s_.resumed_version > 0 && newest == s_.resumed_version) {
    Terminate(0, fmt::format("success: the job was already complete (checkpoint version {} "
                             "holds its final state; the program trained nothing more); all {} "
                             "workers{} finished",
                             newest, finishing.size(), which));
    return;
  }
  std::string final_checkpoint;
  if (newest > 0 && s_.checkpoint_version == newest) {
    final_checkpoint = fmt::format("; the final state is checkpoint version {} ({}, written in "
                                   "{:.3f} s)",
                                   newest, s_.checkpoint_path, s_.checkpoint_seconds);
  }
  Terminate(0, "success: all " + std::to_string(finishing.size()) + " workers" + which +
                   " finished" + final_checkpoint);
}

bool Policy::sent_away(const std::string& slot) const {
  auto it = s_.workers.find(slot);
  return it != s_.workers.end() && (it->second.removed || it->second.leaving);
}

bool Policy::finished(const std::string& slot) const {
  auto it = s_.workers.find(slot);
  return it != s_.workers.end() && it->second.finished;
}

void Policy::OnResumed(const std::vector<std::string>& adopted,
                        const std::map<std::string, std::pair<int, std::string>>& ended) {
  std::set<std::string> kept(adopted.begin(), adopted.end());
  std::vector<std::string> gone;
  for (auto& [slot, w] : s_.workers) {
    // Every stream the old driver counted went with it: none will close here. Left counted,
    // a slot whose process ended meanwhile passes them to its next process as closes to
    // ignore (Launch), and that process's own close (stopped, hung) is never seen: soak seed
    // 84301731, job 4, a member stopped after the adoption held the round for 90 s.
    w.watches = 0;
    w.stale_closes = 0;
    if (!w.running) continue;
    if (kept.count(slot)) {
      // Its stream went with the old driver; it re-opens it within 200 ms of this one
      // listening, unless it is stopped, hung or cut off.
      if (!s_.shutting_down) w.lost_at = Now() + d_.rendezvous_timeout;
    } else {
      gone.push_back(slot);
    }
  }
  if (s_.round > s_.formed && !s_.shutting_down && !s_.finishing) {
    Action propose;
    propose.kind = Action::kProposeRound;
    propose.round = s_.round;
    propose.assignments = rendezvous::AssignRanks(s_.members, false);
    for (const auto& [slot, w] : s_.workers) {
      if (w.running && w.removed && !IsMember(slot)) propose.removed.push_back(slot);
    }
    Log(Action::kInfo, fmt::format("round {} was proposed but not formed when the driver "
                                   "before this one died: proposing it again",
                                   s_.round));
    Emit(std::move(propose));
  }
  for (const auto& slot : gone) {
    auto known = ended.find(slot);
    if (known != ended.end()) {
      OnExit(slot, known->second.first, "ended while no driver ran: " + known->second.second);
    } else {
      OnExit(slot, s_.workers[slot].finished ? 0 : 1,
             "ended while no driver ran (its exit status is unknown)");
    }
  }
}

}  // namespace elastic::driver
