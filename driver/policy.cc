// The driver's membership decisions: who runs in the next round, and what a worker's exit, a
// report, a discovery result or a rendezvous event means for the job (docs/architecture.md, "Policy
// and driver"; docs/recovery.md).
#include "driver/policy.h"

#include <signal.h>
#include <spdlog/fmt/fmt.h>
#include <spdlog/fmt/ranges.h>

#include <algorithm>

#include "driver/plan.h"
#include "driver/stragglers.h"

namespace elastic::driver {

using rendezvous::Assignment;
using rendezvous::EventKind;

namespace {
double Secs(Duration d) { return std::chrono::duration<double>(d).count(); }
}  // namespace

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
  TimePoint next = std::min(s_.kill_at, s_.wait_until);
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
  Event("discovery", {{"hosts", names}, {"ok", true}});
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
  auto alive = [&](const std::string& slot) { return in.alive.count(slot) > 0; };
  std::vector<std::string> plan = PlanMembers(in);
  size_t need = static_cast<size_t>(s_.started ? d_.min_np : d_.np);
  if (plan.size() < need) {
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
    if (starting) plan = PlanMembers(in);
  }
  for (const auto& slot : in.keep) {
    if (s_.kept.count(slot)) continue;
    const Worker& w = s_.workers.at(slot);
    Log(Action::kWarn,
        fmt::format("slot {} is to go (host {} no longer lists it, or the job scales down), "
                    "but its worker alone holds the newest state (version {}): it stays a "
                    "member until the state is handed over",
                    slot, w.host, w.version));
    Event("holder_kept", {{"slot", slot}, {"version", w.version}});
  }
  s_.kept = in.keep;
  if (plan.size() < need) {
    std::string needed =
        s_.started ? "--min-np " + std::to_string(d_.min_np) : "-np " + std::to_string(d_.np);
    if (!CanEverReach(need)) {
      Terminate(1, "no hosts left: " + std::to_string(plan.size()) + " worker(s) can run, " +
                       needed + " needed, and no host can come back (every listed host is " +
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
      Event("round_withdrawn", {{"round", s_.round}, {"reason", reason}});
      Log(Action::kWarn, fmt::format("round {} withdrawn ({})", s_.round, reason));
    }
    if (s_.wait_until == TimePoint::max()) {
      Duration limit = s_.started ? d_.elastic_timeout : d_.start_timeout;
      s_.wait_until = Now() + limit;
      Log(Action::kWarn,
          fmt::format("{} slot(s) available, {} needed ({}); waiting up to {:.0f} s for hosts",
                      plan.size(), need, reason, Secs(limit)));
      Event("waiting_for_hosts", {{"available", int64_t(plan.size())}, {"needed", int64_t(need)}});
    }
    return;
  }
  s_.wait_until = TimePoint::max();
  // Survivors never wait for a process to start (an import of torch takes seconds): once a
  // round has formed, the slots that need a new process (a lost member's, one discovery added)
  // get a newcomer that the next round does not include, as long as the others are enough. It
  // starts, initialises and waits in Join like a warm spare; once it is there
  // (OnWaitingForPlace) the job re-forms with it at the members' next commit.
  std::vector<std::string> newcomers;
  if (d_.elastic && s_.started) {
    std::vector<std::string> rest;
    for (const auto& slot : plan) {
      (alive(slot) || in.spares.count(slot) ? rest : newcomers).push_back(slot);
    }
    if (!newcomers.empty() && rest.size() >= std::max<size_t>(need, 1)) {
      plan = std::move(rest);
    } else {
      newcomers.clear();
    }
  }
  const bool changes = !(plan == s_.members && s_.round >= 0 && !s_.round_broken);
  for (const auto& slot : newcomers) {
    Worker& w = WorkerFor(slot);
    Launch(w, -1, /*spare=*/true);
    w.joiner = true;
    // Its place is the one a lost member left (this change counts as the job's reset), or a
    // new one (its arrival will).
    w.paid = changes;
    Log(Action::kInfo, fmt::format("starting a new worker in slot {}; the job goes on without "
                                   "it and re-forms with it once it is ready",
                                   slot));
    Event("newcomer_started", {{"slot", slot}, {"reason", reason}});
  }
  if (!changes) {  // nothing to change
    TopUpSpares(plan);
    return;
  }
  // The arrival of newcomers for places whose loss was counted already is not another reset.
  bool only_paid = !s_.round_broken && s_.round >= 0;
  for (const auto& slot : s_.members) {
    if (std::find(plan.begin(), plan.end(), slot) == plan.end()) only_paid = false;
  }
  for (const auto& slot : plan) {
    if (std::find(s_.members.begin(), s_.members.end(), slot) != s_.members.end()) continue;
    auto it = s_.workers.find(slot);
    if (it == s_.workers.end() || !it->second.joiner || !it->second.paid) only_paid = false;
  }
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
  }
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
  Event("round_proposed",
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
  if (old_round >= 0) Event("fence", {{"round", old_round}, {"reason", reason}});
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
        Event("newcomer_placed", {{"slot", slot}, {"round", s_.round}});
        continue;
      }
      Log(Action::kInfo,
          fmt::format("round {}: the spare in slot {} takes a place", s_.round, slot));
      Event("spare_promoted", {{"slot", slot}, {"round", s_.round}});
    } else if (!alive(slot)) {
      Launch(w, static_cast<int>(rank));
    }
  }
  TopUpSpares(plan);
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
  int have = 0;
  for (auto& [slot, w] : s_.workers) {
    if (!w.running || !w.spare || w.dropped || w.removed) continue;
    if (!SlotListed(s_.last_listed, slot)) {  // its host (or slot) is unlisted: the spare goes
      w.dropped = true;
      SignalSlot(slot, SIGTERM);
      continue;
    }
    if (!w.joiner) ++have;  // a newcomer waits for a place of its own
  }
  if (d_.spares <= 0) return;
  if (s_.spare_failures > d_.spares + 2) return;  // they keep failing: said once, below
  for (const auto& h : hosts_.Available()) {
    for (int i = 0; i < h.slots && have < d_.spares; ++i) {
      std::string slot = Slot{h.host, i}.ToString();
      if (std::find(plan.begin(), plan.end(), slot) != plan.end()) continue;
      auto it = s_.workers.find(slot);
      if (it != s_.workers.end() && (it->second.running || it->second.evicted_until > Now())) {
        continue;
      }
      Launch(WorkerFor(slot), -1, /*spare=*/true);
      Log(Action::kInfo, fmt::format("starting a warm spare in slot {}", slot));
      ++have;
    }
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
  Event("worker_started", {{"slot", slot}, {"pid", pid}, {"spare", it->second.spare}});
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
  Event("worker_start_failed", {{"slot", slot}, {"error", why.message()}});
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
  Terminate(0, "success: all " + std::to_string(finishing.size()) + " workers" + which +
                   " finished");
}

bool Policy::sent_away(const std::string& slot) const {
  auto it = s_.workers.find(slot);
  return it != s_.workers.end() && (it->second.removed || it->second.leaving);
}

bool Policy::finished(const std::string& slot) const {
  auto it = s_.workers.find(slot);
  return it != s_.workers.end() && it->second.finished;
}

void Policy::OnResumed(const std::vector<std::string>& adopted) {
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
    OnExit(slot, s_.workers[slot].finished ? 0 : 1,
           "ended while no driver ran (its exit status is unknown)");
  }
}

void Policy::OnExit(const std::string& slot, int code, const std::string& how) {
  auto it = s_.workers.find(slot);
  if (it == s_.workers.end()) return;
  Worker& w = it->second;
  w.running = false;
  w.lost_at = TimePoint::max();
  w.start_failed = code > 0 && code < 128 && w.heard_at < w.launched_at;  // never heard
  std::string rank = Label(slot);
  Event("worker_exited", {{"slot", slot},
                          {"code", int64_t{code}},
                          {"rank", w.rank >= 0 ? JsonValue(int64_t{w.rank}) : JsonValue()},
                          {"round", w.round},
                          {"status", how}});
  if (s_.shutting_down) return;
  if (w.leaving) {
    Log(Action::kInfo, fmt::format("worker {} (slot {}) left the job: {}", rank, slot, how));
    return;
  }
  if (w.exit_hung) {
    if (!w.finished) {
      ++s_.failures;
      Terminate(1, fmt::format("worker {} (slot {}, host {}) neither finished training nor "
                               "exited after its peers finished; it was killed ({})",
                               rank, slot, w.host, how));
      return;
    }
    CheckFinished();
    return;
  }
  if (w.dropped) {  // the driver gave up on it already (failed, hung, lost, no join)
    Log(Action::kInfo, fmt::format("worker {} (slot {}) is gone: {}", rank, slot, how));
    // Its slot is free again: a job waiting for slots (the hung worker was killed after the
    // re-plan) can use it now.
    Replan("slot " + slot + " is free");
    return;
  }
  if (w.joiner) {
    // A newcomer that ends before taking its place: a failure of a new process on its host,
    // as when a relaunched member fails (its peers train on; the slot gets another).
    w.joiner = w.ready = w.paid = w.spare = false;
    std::string what = fmt::format(
        "the new worker in slot {} (host {}) exited before it took "
        "its place: {}",
        slot, w.host, how);
    Log(Action::kWarn, what);
    if (!CountNewcomerFailure(w, what)) Replan(what);
    return;
  }
  if (w.spare) {
    // A spare that ends before taking a place: nothing of the job is lost; another starts,
    // unless they keep failing.
    w.spare = false;
    ++s_.spare_failures;  // a spare never ends on its own: even exit 0 is a failure of it
    Log(Action::kWarn, fmt::format("the spare in slot {} exited: {}", slot, how));
    if (s_.spare_failures == d_.spares + 3) {
      Log(Action::kWarn, fmt::format("{} spares failed before taking a place; no more spares "
                                     "are started",
                                     s_.spare_failures));
    }
    if (EndIfNoWorkerStarted(w, "the spare in slot " + slot + " exited: " + how)) return;
    Replan("the spare in slot " + slot + " exited");
    return;
  }
  if (w.removed || !IsMember(slot)) {
    Log(Action::kInfo,
        fmt::format("worker {} (slot {}) left after scale-down: {}", rank, slot, how));
    return;
  }
  if (w.rescued && code == 0 && !w.finished) {
    // Kept for the state it held, but the earlier removal reached it first.
    w.rescued = false;
    Log(Action::kWarn, fmt::format("worker {} (slot {}) was kept for the state it holds, but "
                                   "had been told to leave already: {}",
                                   rank, slot, how));
    s_.round_broken = true;
    s_.members.erase(std::remove(s_.members.begin(), s_.members.end(), slot), s_.members.end());
    AbortFormedRound(slot, "slot " + slot + " left");
    Replan("slot " + slot + " left");
    return;
  }
  if (code == 0) {
    if (!s_.started && s_.failures > 0) {
      // Nothing was trained: the worker ended before any round formed, and others failed.
      Terminate(1, fmt::format("worker {} (slot {}) exited 0 before round {} formed, after {} "
                               "worker failure(s); no round ever formed",
                               rank, slot, s_.round, s_.failures));
      return;
    }
    if (!s_.finishing) {
      Log(Action::kInfo, fmt::format("worker {} finished; the job is finishing", rank));
      s_.finisher = slot;
      s_.finishing_at = Now();
    }
    s_.finishing = true;
    CheckFinished();
    return;
  }
  if (w.dropped) return;  // the driver already gave up on it (join timeout, lost)
  std::string what =
      "worker " + rank + " (slot " + slot + ", host " + w.host + ") failed: " + how;
  if (!w.local && code == 255 && d_.launcher_template.empty()) {
    what += " (ssh could not run the worker: the host is unreachable or refused the login; "
            "ssh's own message is in the worker's stderr above)";
  }
  if (!d_.elastic || s_.finishing) {
    ++s_.failures;
    Terminate(code, what);
    return;
  }
  if (EndIfEveryMemberFailed()) return;
  if (EndIfNoWorkerStarted(w, what)) return;
  LoseWorker(w, what);
}

bool Policy::EndIfNoWorkerStarted(const Worker& last, const std::string& what) {
  if (s_.shutting_down || !d_.elastic || s_.started || !last.start_failed) return false;
  if (d_.max_failures >= 0 || d_.reset_limit >= 0) return false;
  int failed = 0;
  for (const auto& [slot, w] : s_.workers) {
    if (w.running) return false;                 // one may still start
    if (w.launched_at == TimePoint{}) continue;  // never launched
    if (!w.start_failed) return false;
    ++failed;
  }
  Event("round_failed",
        {{"round", s_.round}, {"size", int64_t(failed)}, {"slot", last.slot}, {"message", what}});
  Terminate(1, fmt::format("every worker started so far ({}) exited before it connected to the "
                           "driver, and no round ever formed; the last: {} (its output is "
                           "above: the program fails before elastic.init(), e.g. an import "
                           "error or a bad argument; --max-failures N or --reset-limit N allow "
                           "retries)",
                           failed, what));
  return true;
}

bool Policy::EndIfEveryMemberFailed() {
  if (s_.shutting_down || !d_.elastic || s_.formed < 0 || s_.formed_members.empty()) return false;
  if (d_.max_failures >= 0 || d_.reset_limit >= 0) return false;
  for (const auto& slot : s_.formed_members) {
    auto it = s_.workers.find(slot);
    if (it == s_.workers.end() || it->second.failed_round != s_.formed) return false;
  }
  // The first of them to report, for the message.
  const Worker* first = nullptr;
  for (const auto& slot : s_.failure_order) {
    auto it = s_.workers.find(slot);
    if (it != s_.workers.end() && it->second.failed_round == s_.formed &&
        std::find(s_.formed_members.begin(), s_.formed_members.end(), slot) !=
            s_.formed_members.end()) {
      first = &it->second;
      break;
    }
  }
  if (first == nullptr) return false;
  std::string message = first->failure;
  if (message.size() > 2000) message = message.substr(0, 2000) + "...";
  Event("round_failed", {{"round", s_.formed},
                         {"size", int64_t(s_.formed_members.size())},
                         {"slot", first->slot},
                         {"message", message}});
  Terminate(1, fmt::format("every worker of round {} ({} of them) failed in its own code; the "
                           "first, worker {} (slot {}, host {}): {} (relaunching would fail "
                           "the same way; --max-failures N or --reset-limit N allow retries)",
                           s_.formed, s_.formed_members.size(), first->rank, first->slot,
                           first->host, message));
  return true;
}

void Policy::LoseWorker(Worker& w, const std::string& what) {
  const std::string slot = w.slot;
  const std::string rank = Label(slot);
  ++s_.failures;
  Log(Action::kWarn, what + "; recovering");
  w.dropped = true;
  s_.round_broken = true;
  s_.recovery_start = Now();
  s_.recovering = true;
  Event("worker_lost", {{"slot", slot}, {"rank", w.rank >= 0 ? JsonValue(int64_t{w.rank}) : JsonValue()}, {"phase", "detect"}});
  // Fail the survivors' collectives at once (a silent peer would otherwise cost a timeout):
  // the abort names the formed round the worker was in, so that its peers there fail
  // whatever they do in it (a collective, connecting) and those still joining it fail as
  // soon as they are in it. A worker that was only in a proposed round has no peers yet:
  // the members of the formed round are fenced by the new proposal, and roll nothing back.
  AbortFormedRound(slot, what);
  Event("recovery_phase", {{"phase", "fence"}, {"seconds", Secs(Now() - s_.recovery_start)}});
  RecordHostFailure(w, w.round, what);
  if (EndIfTooManyFailures(what)) return;
  Replan("worker " + rank + " failed");
}

bool Policy::EndIfTooManyFailures(const std::string& what) {
  if (d_.max_failures < 0 || s_.failures <= d_.max_failures) return false;
  Terminate(1,
            what + "; too many failures (--max-failures " + std::to_string(d_.max_failures) + ")");
  return true;
}

bool Policy::CountNewcomerFailure(const Worker& w, const std::string& what) {
  ++s_.failures;
  // The incident is the current round's: a newcomer is in none.
  RecordHostFailure(w, s_.round, what);
  return EndIfTooManyFailures(what);
}

void Policy::RecordHostFailure(const Worker& w, int64_t round, const std::string& what) {
  auto it = s_.incident_round.find(w.host);
  if (it != s_.incident_round.end() && round <= it->second) return;  // the same incident
  s_.incident_round[w.host] = round;
  if (!hosts_.RecordFailure(w.host)) return;
  bool forever = hosts_.LastCooldown() == Duration::max();
  Log(Action::kWarn, fmt::format("host {} is blacklisted{} ({})", w.host,
                                 forever ? "" : fmt::format(" for {:.1f} s",
                                                            Secs(hosts_.LastCooldown())),
                                 what));
  Event("host_blacklisted",
        {{"host", w.host},
         {"cooldown", forever ? JsonValue() : JsonValue(Secs(hosts_.LastCooldown()))}});
}

void Policy::OnReport(const rendezvous::Report& r) {
  auto it = s_.workers.find(r.slot);
  if (it == s_.workers.end()) return;
  Worker& w = it->second;
  // Collectives started count as progress too: a program that never commits but keeps
  // running collectives is not hung.
  if (r.round == w.heard_round && r.collectives != w.collectives) {
    // Dated by when the worker says it last started one, not by when the report came.
    TimePoint when = Now();
    if (r.since_collective >= 0) {
      when -= std::chrono::duration_cast<Duration>(
          std::chrono::duration<double>(std::min(r.since_collective, 1e6)));
    }
    w.moved_at = std::max(w.moved_at, when);
  }
  w.heard_at = Now();
  w.heard_round = r.round;
  w.collectives = r.collectives;
  w.in_collective = r.in_collective;
  w.stack_signal = r.stack_signal;
  switch (r.kind) {
    case rendezvous::ReportKind::kHeartbeat:
      break;
    case rendezvous::ReportKind::kFinished:
      w.finished = true;
      // Not below a commit already heard from it: after a driver outage a worker's pending
      // commit report and its FINISHED may come in either order.
      if (r.step > 0) w.step = std::max(w.step, r.step);
      break;
    case rendezvous::ReportKind::kFailed:
      Log(Action::kWarn, fmt::format("slot {} reports a failure: {}", r.slot, r.message));
      if (w.failed_round != r.round) {
        w.failed_round = r.round;
        w.failure = r.message;
        s_.failure_order.push_back(r.slot);
        if (s_.failure_order.size() > 4096) s_.failure_order.erase(s_.failure_order.begin());
      }
      EndIfEveryMemberFailed();
      break;
    case rendezvous::ReportKind::kLeaving:
      HandleLeaving(w, r.message);
      break;
    case rendezvous::ReportKind::kCheckpointed:
    case rendezvous::ReportKind::kCheckpointFailed:
    case rendezvous::ReportKind::kRestored:
      OnCheckpointReport(w, r);
      break;
    case rendezvous::ReportKind::kCommitted:
      // Within a round a worker's commits only go up, but its reports need not come in that
      // order: after a driver outage its background report of an older commit and its later
      // reports (the newest commit, FINISHED) are all sent again at once. An older one than
      // what was already heard in the same round (or after it finished) is stale: taken, it
      // would lower the step the worker holds and the finisher's check below would blame its
      // peers for steps it took itself.
      if (w.step >= 0 && r.step < w.step && (w.logged_round == r.round || w.finished)) {
        Log(Action::kDebug, fmt::format("slot {}: a stale commit report (step {}, round {}) "
                                        "after step {}; ignored",
                                        r.slot, r.step, r.round, w.step));
        break;
      }
      if (w.step >= 0 && r.step > w.step && w.commit_at > s_.formed_at && r.round == s_.formed) {
        s_.longest_interval =
            std::max(s_.longest_interval, (Now() - w.commit_at) / (r.step - w.step));
        double secs = Secs(Now() - w.commit_at);
        if (secs > 0) w.rate = static_cast<double>(r.step - w.step) / secs;
      }
      w.epoch = r.epoch;
      w.cursor = r.cursor;
      w.samples = r.samples;
      w.epoch_size = r.epoch_size;
      w.step = r.step;
      w.version = r.version;
      if (!s_.first_commit_logged && r.round == s_.formed) {
        s_.first_commit_logged = true;
        if (s_.recovering) {
          // The worker's own phases (durations) ride on its first commit report.
          Event("recovery_phase", {{"phase", "rebuild"}, {"seconds", r.rebuild_seconds}});
          Event("recovery_phase", {{"phase", "sync"}, {"seconds", r.sync_seconds}});
          Event("recovery_phase",
                {{"phase", "first_step"}, {"seconds", Secs(Now() - s_.recovery_start)}});
          s_.recovering = false;
        }
      }
      w.commit_at = Now();
      WatchStraggler(w, r);
      // One line per worker and round (its first commit there); later commits only update
      // what the driver knows of the worker.
      if (w.logged_round != r.round) {
        w.logged_round = r.round;
        auto known = [](int64_t v) { return v >= 0 ? JsonValue(v) : JsonValue(); };
        Event("committed", {{"slot", r.slot},
                            {"round", r.round},
                            {"version", r.version},
                            {"step", r.step},
                            {"epoch", known(r.epoch)},
                            {"cursor", known(r.cursor)},
                            {"samples", known(r.samples)}});
      }
      if (s_.finishing && !s_.finisher.empty()) {
        const Worker& f = s_.workers.at(s_.finisher);
        if (r.step > f.step && f.step >= 0) {
          Terminate(1, fmt::format("worker {} (slot {}) finished training after step {}, but "
                                   "slot {} went on to step {}: every rank must stop after the "
                                   "same step (see docs/recovery.md, \"Stopping\")",
                                   Label(s_.finisher), s_.finisher, f.step, r.slot, r.step));
        }
      }
      if (!s_.kept.empty() && !s_.kept.count(r.slot) && StateKeepers().empty()) {
        Log(Action::kInfo, fmt::format("slot {} committed version {}: the state is handed over; "
                                       "slot(s) [{}] of unlisted hosts can go",
                                       r.slot, r.version, fmt::join(s_.kept, " ")));
        Replan("the state was handed over");
      }
      break;
  }
}

void Policy::WatchStraggler(Worker& w, const rendezvous::Report& r) {
  if (d_.straggler_factor <= 0 || r.round != s_.formed || !IsMember(r.slot) || s_.finishing ||
      s_.shutting_down) {
    return;
  }
  if (!ObserveCommit(w, r, d_.straggler_window)) return;
  std::vector<double> peers;
  for (const auto& slot : s_.formed_members) {
    const Worker& p = s_.workers.at(slot);
    if (slot != r.slot && p.window_round == s_.formed && p.step_compute >= 0) {
      peers.push_back(p.step_compute);
    }
  }
  std::optional<StragglerVerdict> v = JudgeStraggler(w, peers, d_.straggler_factor);
  if (!v) return;
  int changed = ApplyVerdict(w, *v);
  if (changed == 0) return;
  JsonFields fields = {{"slot", r.slot},
                       {"rank", int64_t{w.rank}},
                       {"host", w.host},
                       {"compute_seconds", v->compute},
                       {"wait_seconds", v->wait},
                       {"median_seconds", v->median},
                       {"ratio", v->ratio},
                       {"window", int64_t{d_.straggler_window}}};
  if (changed > 0) {
    ++s_.stragglers;
    StragglerEstimate e = EstimateStraggler(*v, s_.formed_members.size());
    auto [decision, why, after] = DecideOnStraggler(w, e);
    fields.emplace_back("action", d_.straggler_action);
    fields.emplace_back("decision", decision);
    fields.emplace_back("reason", why);
    fields.emplace_back("steps_per_second_now", e.now);
    fields.emplace_back("steps_per_second_after", after);
    Log(Action::kWarn,
        fmt::format("worker {} (slot {}, host {}) is a straggler: it computes {:.4f} s a step "
                    "against its peers' median of {:.4f} s ({:.2f}x, throughout the last {} "
                    "steps), and its peers wait for it; --straggler-action {}: {}",
                    w.rank, r.slot, w.host, v->compute, v->median, v->ratio,
                    d_.straggler_window, d_.straggler_action, why));
    Event("straggler", std::move(fields));
    if (decision != "none") {
      // Out of the plan, and its slot gets no process, for the cooldown: the next round goes
      // without it (it leaves at its next commit, as a scaled-away member does).
      w.evicted_until = Now() + kStragglerCooldown;
      s_.evicted_at = Now();
      if (decision == "replace") RecordHostFailure(w, s_.formed, "its straggler was replaced");
      Replan("slot " + r.slot + " is a straggler (" + decision + ")");
    }
  } else {
    Log(Action::kInfo,
        fmt::format("worker {} (slot {}) is no longer a straggler: {:.4f} s of compute a step "
                    "against its peers' median of {:.4f} s ({:.2f}x)",
                    w.rank, r.slot, v->compute, v->median, v->ratio));
    Event("straggler_cleared", std::move(fields));
  }
}

std::tuple<std::string, std::string, double> Policy::DecideOnStraggler(
    Worker& w, const StragglerEstimate& e) {
  auto rate = [](double v) { return fmt::format("{:.1f}", v); };
  if (d_.straggler_action == "warn") return {"none", "named only", 0.0};
  if (s_.evicted_at != TimePoint{} && Now() - s_.evicted_at < kStragglerCooldown) {
    return {"none",
            fmt::format("named only: a straggler was {} {:.0f} s ago, and none is again "
                        "within {:.0f} s",
                        d_.straggler_action == "replace" ? "replaced" : "dropped",
                        Secs(Now() - s_.evicted_at), Secs(kStragglerCooldown)),
            0.0};
  }
  if (s_.round != s_.formed) return {"none", "named only: a membership change is under way", 0.0};
  const size_t n = s_.formed_members.size();
  if (d_.straggler_action == "replace") {
    // The plan without it: the same size when a warm spare or a free slot takes its place.
    TimePoint kept = w.evicted_until;
    w.evicted_until = Now() + kStragglerCooldown;
    size_t planned = PlanMembers(MakePlanInput(hosts_.Available())).size();
    w.evicted_until = kept;
    if (planned < n) {
      return {"none", "named only: no warm spare (--spares) or free slot to take its place",
              e.replaced};
    }
    if (!ChangePays(e.now, e.replaced)) {
      return {"none",
              fmt::format("named only: replacing it would bring {} steps/s from {}, less than "
                          "a round change costs",
                          rate(e.replaced), rate(e.now)),
              e.replaced};
    }
    return {"replace",
            fmt::format("replaced: the next round goes without it, a warm spare or a new worker "
                        "in its place (estimated {} steps/s from {})",
                        rate(e.replaced), rate(e.now)),
            e.replaced};
  }
  // drop
  const size_t floor = static_cast<size_t>(std::max(d_.min_np, 1));
  if (n <= floor) {
    return {"none", fmt::format("named only: the job is at --min-np {} already", d_.min_np),
            e.dropped};
  }
  if (!ChangePays(e.now, e.dropped)) {
    return {"none",
            fmt::format("named only: the job would not be faster without it (estimated {} "
                        "steps/s from {})",
                        rate(e.dropped), rate(e.now)),
            e.dropped};
  }
  return {"drop",
          fmt::format("dropped: the job goes on without it at {} worker(s) (estimated {} "
                      "steps/s from {})",
                      n - 1, rate(e.dropped), rate(e.now)),
          e.dropped};
}

void Policy::OnCheckpointReport(const Worker& w, const rendezvous::Report& r) {
  auto known = [](int64_t v) { return v >= 0 ? JsonValue(v) : JsonValue(); };
  if (r.kind == rendezvous::ReportKind::kCheckpointed) {
    if (r.version <= s_.checkpoint_version) return;  // an older rank 0's, late
    s_.checkpoint_version = r.version;
    s_.checkpoint_step = r.step;
    s_.checkpoint_seconds = r.seconds;
    s_.checkpoint_path = r.message;
    if (!s_.checkpoint_error.empty()) {
      Log(Action::kInfo, "checkpoints are written again");
      s_.checkpoint_error.clear();
    }
    Log(Action::kDebug, fmt::format("checkpoint of version {} written to {} in {:.3f} s",
                                    r.version, r.message, r.seconds));
    Event("checkpoint_written", {{"slot", r.slot},
                                 {"version", r.version},
                                 {"step", r.step},
                                 {"epoch", known(r.epoch)},
                                 {"path", r.message},
                                 {"seconds", r.seconds}});
    return;
  }
  if (r.kind == rendezvous::ReportKind::kCheckpointFailed) {
    ++s_.checkpoint_failures;
    Event("checkpoint_failed", {{"slot", r.slot}, {"version", r.version}, {"message", r.message}});
    // Said once per cause (the text after the last ": ", e.g. "No space left on device"; the
    // paths before it differ from version to version), not every interval.
    auto cause = [](const std::string& m) {
      size_t colon = m.rfind(": ");
      return colon == std::string::npos ? m : m.substr(colon + 2);
    };
    bool said = !s_.checkpoint_error.empty() && cause(s_.checkpoint_error) == cause(r.message);
    s_.checkpoint_error = r.message;
    if (!said) {
      Log(Action::kWarn, fmt::format("checkpoint of version {} failed on slot {} ({}): {}; "
                                     "training goes on",
                                     r.version, r.slot, w.host, r.message));
    }
    return;
  }
  // kRestored: rank 0 of a round without a commit looked for a checkpoint.
  bool lost = s_.restore_round == r.round;
  if (r.version > 0) {
    int64_t steps_lost = lost ? std::max<int64_t>(0, s_.lost_committed - r.version) : 0;
    Log(lost ? Action::kWarn : Action::kInfo,
        fmt::format("{} checkpoint version {} (step {}{}) from {}{}",
                    lost ? "state restored from" : "resuming from", r.version, r.step,
                    r.epoch >= 0 ? ", epoch " + std::to_string(r.epoch) : "", r.message,
                    lost ? fmt::format("; {} committed step(s) since it are lost", steps_lost)
                         : ""));
    Event("state_restored", {{"round", r.round},
                             {"slot", r.slot},
                             {"version", r.version},
                             {"step", r.step},
                             {"epoch", known(r.epoch)},
                             {"cursor", known(r.cursor)},
                             {"path", r.message},
                             {"state_lost", lost},
                             {"steps_lost", steps_lost},
                             {"lost_in_round", lost ? s_.lost_round : int64_t{-1}}});
    if (lost) s_.restore_round = -1;
    return;
  }
  if (!lost) {
    Log(Action::kInfo, fmt::format("{}; starting from the initial state", r.message));
    return;
  }
  s_.restore_round = -1;
  if (d_.start_over_if_state_lost) {
    Log(Action::kWarn, fmt::format("{}; starting over from the initial state "
                                   "(--start-over-if-state-lost)", r.message));
    return;
  }
  Terminate(1, "state lost: commits up to version " + std::to_string(s_.lost_committed) +
                   " were made, but no worker of round " + std::to_string(r.round) +
                   " holds any (every holder is gone), and " + r.message +
                   "; pass --start-over-if-state-lost to train again from the start");
}

// A round formed although no member holds a commit (the core starts over: it forgets the
// versions it knew). Said even when the policy has already moved past the round: a newcomer or
// a failure can fence it before the driver's loop hears it formed (test_faults.py's
// every-holder-gone test, in CI: both workers killed at commit 3, the relaunch's round formed
// over the lost one with versions counted from 0 again, and the restart went unsaid). The
// next round with no commit then restores for it (OnRoundFormed hands restore_round on).
void Policy::NoteStateLost(const rendezvous::FormedRound& f) {
  if (!d_.checkpoint_dir.empty()) {
    s_.restore_round = f.round;
    s_.lost_round = f.round;
    s_.lost_committed = f.newest_committed;
    Log(Action::kWarn,
        fmt::format("state lost: no worker of round {} holds a commit (the newest was version "
                    "{}); rank 0 restores the newest checkpoint from {}",
                    f.round, f.newest_committed, d_.checkpoint_dir));
  } else {
    Log(Action::kWarn,
        fmt::format("state lost: no worker of round {} holds a commit (the newest was version "
                    "{}); starting over from the initial state (--start-over-if-state-lost)",
                    f.round, f.newest_committed));
  }
  JsonFields fields{{"round", f.round},
                     {"newest_committed", f.newest_committed},
                     {"members", f.members},
                     {"start_over", d_.checkpoint_dir.empty()}};
  if (!d_.checkpoint_dir.empty()) fields.emplace_back("from_checkpoint", true);
  Event("state_lost", std::move(fields));
}

void Policy::OnRoundFormed(const rendezvous::FormedRound& f) {
  if (f.state_lost) NoteStateLost(f);
  if (f.round != s_.round) return;
  s_.formed = f.round;
  s_.formed_at = Now();
  s_.started = true;
  s_.members = f.members;  // rank order as formed: rank 0 holds the newest version
  s_.formed_members = f.members;
  s_.first_commit_logged = false;
  for (size_t i = 0; i < f.members.size(); ++i) {
    Worker& w = s_.workers[f.members[i]];
    w.round = f.round;
    w.rank = static_cast<int>(i);
    // What the worker said it holds in its join: newer than its last report when the reports
    // lag (the state's holders are chosen by it, e.g. StateKeepers).
    if (i < f.versions.size()) w.version = std::max(w.version, f.versions[i]);
    w.rescued = false;  // it joined: no removal can reach it now
  }
  std::vector<std::string> behind;
  for (size_t i = 0; i < f.members.size(); ++i) {
    if (f.versions[i] != f.version) behind.push_back(f.members[i]);
  }
  if (!f.state_lost && f.version == 0 && s_.restore_round >= 0) {
    // The state-lost round was superseded (a newcomer, a failure) before its rank 0 restored,
    // and this one holds no commit either; the core started versions over with the loss, so
    // only the policy still knows: this round's rank 0 restores, and it is the loss's restore.
    Log(Action::kWarn,
        fmt::format("round {} supersedes round {} before its checkpoint was restored; no member "
                    "holds a commit, so rank 0 of round {} restores it",
                    f.round, s_.restore_round, f.round));
    s_.restore_round = f.round;
  }
  if (!f.state_lost && f.version > 0 && f.version < f.newest_committed) {
    Log(Action::kWarn,
        fmt::format("round {}: the newest version any member holds is {} (version {} was "
                    "committed by workers that are gone); training goes on from version {}",
                    f.round, f.version, f.newest_committed, f.version));
  }
  Log(Action::kInfo,
      fmt::format("round {} formed with {} worker(s); rank 0 is {} (version {}){}", f.round,
                  f.members.size(), f.members.empty() ? "-" : f.members[0], f.version,
                  f.sync_required
                      ? fmt::format(", state synced from rank 0 to [{}]",
                                    fmt::join(behind.empty() ? f.members : behind, " "))
                      : ""));
  Event("round_formed", {{"round", f.round},
                         {"members", f.members},
                         {"versions", f.versions},
                         {"version", f.version},
                         {"sync_required", f.sync_required}});
  if (s_.recovering) {
    Event("recovery_phase",
          {{"phase", "rendezvous"}, {"seconds", Secs(Now() - s_.recovery_start)}});
  }
}

void Policy::OnStateLost(const rendezvous::FormedRound& f) {
  if (f.round != s_.round || s_.shutting_down) return;
  Event("state_lost", {{"round", f.round},
                       {"newest_committed", f.newest_committed},
                       {"members", f.members},
                       {"start_over", false}});
  Terminate(1, "state lost: commits up to version " + std::to_string(f.newest_committed) +
                   " were made, but no worker of round " + std::to_string(f.round) +
                   " holds any (every holder is gone); pass --start-over-if-state-lost to "
                   "train again from the start");
}

void Policy::OnJoinTimeout(int64_t round, const std::vector<std::string>& missing_in) {
  if (round != s_.round || s_.shutting_down) return;
  // Members of the formed round that never came from it: fenced, they had to reach a commit
  // first, and none came. Killing them could take the only copy of the state with them, so
  // their round is aborted first (they roll back to their last commit and join), with their
  // stacks dumped to show where they were; they are dropped only if they miss the next wait.
  std::vector<std::string> stuck, missing;
  for (const auto& slot : missing_in) {
    auto it = s_.workers.find(slot);
    bool in_formed = s_.formed >= 0 && s_.formed < round && s_.aborted < s_.formed &&
                     std::find(s_.formed_members.begin(), s_.formed_members.end(), slot) !=
                         s_.formed_members.end() &&
                     it != s_.workers.end() && it->second.running && !it->second.dropped;
    (in_formed ? stuck : missing).push_back(slot);
  }
  if (!stuck.empty()) {
    std::string why = fmt::format(
        "slot(s) [{}] did not leave round {} for round {} within {:.0f} s (no commit since the "
        "fence)",
        fmt::join(stuck, " "), s_.formed, round, Secs(d_.rendezvous_timeout));
    Log(Action::kWarn, why + "; dumping their stacks and aborting round " +
                           std::to_string(s_.formed) +
                           ": they roll back to their last commit and get another wait");
    Event("round_hung", {{"round", s_.formed}, {"seconds", Secs(Now() - s_.formed_at)}});
    for (const auto& slot : stuck) DumpStacks(s_.workers.at(slot));
    AbortRound("", why);
    Action again;
    again.kind = Action::kRestartWait;
    again.slots = stuck;
    Emit(std::move(again));
  }
  if (missing.empty()) return;
  Log(Action::kWarn,
      fmt::format("round {}: slot(s) [{}] did not join within {:.0f} s; dropping them", round,
                  fmt::join(missing, " "), Secs(d_.rendezvous_timeout)));
  for (const auto& slot : missing) {
    auto it = s_.workers.find(slot);
    if (it == s_.workers.end()) continue;
    Worker& w = it->second;
    if (w.running) {
      SignalSlot(slot, SIGKILL);
    }
    w.dropped = true;
    ++s_.failures;
    RecordHostFailure(w, w.round, "slot " + slot + " did not join round " + std::to_string(round));
  }
  s_.round_broken = true;
  s_.members.erase(std::remove_if(s_.members.begin(), s_.members.end(),
                                  [&](const std::string& s) {
                                    return std::find(missing.begin(), missing.end(), s) !=
                                           missing.end();
                                  }),
                   s_.members.end());
  Replan("slots did not join");
}

void Policy::AbortFormedRound(const std::string& gone, const std::string& why) {
  if (std::find(s_.formed_members.begin(), s_.formed_members.end(), gone) ==
      s_.formed_members.end()) {
    return;
  }
  AbortRound(gone, why);
}

void Policy::AbortRound(const std::string& skip, const std::string& why) {
  s_.aborted = s_.formed;
  for (const auto& slot : s_.formed_members) {
    if (slot == skip) continue;
    Action a;
    a.kind = Action::kPublish;
    a.slot = slot;
    a.event = rendezvous::Event{EventKind::kAbort, s_.formed, why};
    Emit(std::move(a));
  }
}

void Policy::OnMemberLeft(int64_t round, const std::string& slot) {
  if (s_.shutting_down) return;
  if (s_.finishing && round == s_.formed) {
    // A member joins again while another has finished: it went on training without it.
    auto it = s_.workers.find(s_.finisher);
    int64_t step = it == s_.workers.end() ? -1 : it->second.step;
    Terminate(1, fmt::format("worker {} (slot {}) finished training{}, but slot {} went on "
                             "training and lost its peer: every rank must stop after the same "
                             "step (see docs/recovery.md, \"Stopping\")",
                             Label(s_.finisher), s_.finisher,
                             step >= 0 ? " after step " + std::to_string(step) : "", slot));
    return;
  }
  // A member that joins again has left its round. Fenced members do that at a commit (no
  // collective is in flight then; the abort costs nothing); one whose mesh failed to connect
  // leaves peers that may wait for it to connect: they are told now, and when no new round is
  // pending, the same members re-form.
  if (round != s_.formed || s_.aborted >= round || s_.finishing) return;
  std::string why = "slot " + slot + " left round " + std::to_string(round);
  AbortFormedRound(slot, why);
  if (s_.round == s_.formed) {
    Log(Action::kWarn, why + " on its own; re-forming");
    Event("member_left", {{"slot", slot}, {"round", round}});
    s_.round_broken = true;
    Replan(why);
  }
}

void Policy::HandleLeaving(Worker& w, const std::string& why) {
  if (w.leaving || s_.shutting_down) return;
  w.leaving = true;
  std::string rank = Label(w.slot);
  Log(Action::kInfo, fmt::format("worker {} (slot {}) is leaving{}{}; re-forming without it", rank,
                                 w.slot, why.empty() ? "" : ": ", why));
  Event("worker_leaving", {{"slot", w.slot}, {"rank", w.rank >= 0 ? JsonValue(int64_t{w.rank}) : JsonValue()}, {"reason", why}});
  if (IsMember(w.slot)) {
    s_.round_broken = true;
    Replan("worker " + rank + " is leaving");
  }
}

void Policy::OnWaitingForPlace(const std::string& slot) {
  auto it = s_.workers.find(slot);
  if (it == s_.workers.end() || s_.shutting_down) return;
  Worker& w = it->second;
  if (!w.running || !w.joiner || w.ready || w.dropped) return;
  w.ready = true;
  Log(Action::kInfo, fmt::format("the new worker in slot {} is ready ({:.1f} s after its start); "
                                 "the job re-forms with it at the next commit",
                                 slot, Secs(Now() - w.launched_at)));
  Event("newcomer_ready", {{"slot", slot}, {"seconds", Secs(Now() - w.launched_at)}});
  Replan("the new worker in slot " + slot + " is ready");
}

void Policy::OnWatch(const std::string& slot, bool open) {
  auto it = s_.workers.find(slot);
  if (it == s_.workers.end()) return;
  Worker& w = it->second;
  if (open) {
    ++w.watches;
    w.lost_at = TimePoint::max();
    return;
  }
  // The stream of the slot's previous process may close after the new one started (its
  // close comes through gRPC, its exit through the pidfd): that close says nothing of the new
  // process, which may not have opened its stream yet (a worker that imports torch takes
  // seconds).
  if (w.stale_closes > 0) {
    --w.stale_closes;
    return;
  }
  w.watches = std::max(0, w.watches - 1);
  if (w.watches > 0) return;
  // A worker whose stream breaks while its process runs may be lost (stopped, hung, its host
  // gone): unless it exits (or the stream re-opens) within the grace, it is.
  if (!w.finished && !w.leaving && w.running && !s_.shutting_down) {
    w.lost_at = Now() + d_.liveness_timeout / 3;
  }
}

void Policy::OnDiscovery(const StatusOr<std::vector<discovery::HostSlots>>& result,
                         const std::vector<std::string>& warnings) {
  for (const auto& w : warnings) Log(Action::kWarn, "discovery: " + w);
  if (!result.ok()) {
    Log(Action::kWarn, "discovery failed; keeping the last good host set: " +
                           result.status().message());
    Event("discovery", {{"ok", false}, {"error", result.status().message()}});
    return;
  }
  const auto& listed = result.value();
  auto change = hosts_.Update(listed);
  s_.last_listed = listed;
  for (const auto& h : listed) {
    if (std::find(s_.last_listed_order.begin(), s_.last_listed_order.end(), h.host) ==
        s_.last_listed_order.end()) {
      s_.last_listed_order.push_back(h.host);
    }
  }
  if (change.empty()) return;
  std::vector<std::string> names;
  for (const auto& h : listed) names.push_back(h.host + ":" + std::to_string(h.slots));
  Event("discovery", {{"hosts", names}, {"ok", true}});
  for (const auto& h : change.added) Event("host_added", {{"host", h}});
  for (const auto& h : change.removed) Event("host_removed", {{"host", h}});
  for (const auto& h : change.changed) {
    for (const auto& l : listed) {
      if (l.host == h) Event("host_changed", {{"host", h}, {"slots", int64_t{l.slots}}});
    }
  }
  Log(Action::kInfo, fmt::format("hosts changed: +[{}] -[{}] ~[{}]", fmt::join(change.added, " "),
                                 fmt::join(change.removed, " "), fmt::join(change.changed, " ")));
  Replan("hosts changed");
}

void Policy::OnSignal(int signal, const std::string& name) {
  if (s_.shutting_down) {
    s_.kill_at = Now();  // a second signal: no more grace
    OnTimer();
    return;
  }
  Log(Action::kWarn, "received " + name + "; stopping the job");
  Terminate(128 + signal, "stopped by " + name);
}

void Policy::Terminate(int code, const std::string& message) {
  if (s_.shutting_down) return;
  s_.shutting_down = true;
  s_.exit_code = code;
  s_.final_message = message;
  s_.wait_until = TimePoint::max();
  Event("job_ending", {{"code", int64_t{code}}, {"message", message}});
  bool any = false;
  for (auto& [slot, w] : s_.workers) {
    w.lost_at = TimePoint::max();
    if (!w.running) continue;
    w.dropped = true;
    SignalSlot(slot, SIGTERM);
    any = true;
  }
  if (any) {
    Log(Action::kInfo,
        fmt::format("stopping workers (SIGTERM; SIGKILL after {:.1f} s)", Secs(d_.grace)));
    s_.kill_at = Now() + d_.grace;
  }
}

Policy::RoundProgress Policy::CurrentProgress() const {
  RoundProgress p;
  p.at = s_.formed_at;
  for (const auto& slot : s_.formed_members) {
    const Worker& w = s_.workers.at(slot);
    if (w.commit_at >= s_.formed_at && w.commit_at != TimePoint{}) p.committed = true;
    p.at = std::max({p.at, w.commit_at, w.moved_at});
  }
  p.limit = HangTimeout() * (p.committed ? 1 : 2);
  return p;
}

Duration Policy::HangTimeout() const {
  if (d_.hang_timeout > Duration::zero()) return d_.hang_timeout;
  if (s_.longest_interval == Duration::zero()) return std::chrono::seconds(300);
  return std::max<Duration>(std::chrono::seconds(60), 10 * s_.longest_interval);
}

void Policy::CheckHang() {
  if (s_.shutting_down || s_.finishing || !s_.started || s_.round != s_.formed) return;
  TimePoint now = Now();
  const RoundProgress p = CurrentProgress();
  const TimePoint progress = p.at;
  const bool committed = p.committed;
  const Duration limit = p.limit;
  if (now - progress < limit) return;
  // Who holds the round up: a member that has gone silent; else one that is not in a
  // collective while others wait in one; else those that started fewer collectives.
  std::vector<Worker*> silent, idle, behind, all;
  int64_t most = 0;
  for (const auto& slot : s_.formed_members) {
    Worker& w = s_.workers.at(slot);
    bool current = w.heard_round == s_.formed;
    all.push_back(&w);
    if (now - w.heard_at > kSilence) {
      silent.push_back(&w);
    } else if (!current || !w.in_collective) {
      idle.push_back(&w);
    }
    most = std::max(most, current ? w.collectives : 0);
  }
  for (Worker* w : all) {
    if ((w->heard_round == s_.formed ? w->collectives : 0) < most) behind.push_back(w);
  }
  std::vector<Worker*> culprits;
  std::string why;
  if (!silent.empty()) {
    culprits = silent;
    why = "is silent (no report for over 2 s)";
  } else if (!idle.empty() && idle.size() < all.size()) {
    culprits = idle;
    why = "is not in a collective while its peers wait in one";
  } else if (!behind.empty()) {
    culprits = behind;
    why = "started fewer collectives than its peers";
  }
  std::string span =
      fmt::format("round {} made no progress for {:.1f} s (--hang-timeout {:.0f} s{})", s_.formed,
                  Secs(now - progress), Secs(HangTimeout()),
                  committed ? "" : ", doubled before the round's first commit");
  if (culprits.empty()) {
    // No member stands out yet. A stopped one goes silent within a few seconds: wait for that
    // before deciding that the whole round hangs.
    if (now - progress < limit + std::chrono::seconds(3)) return;
    // No member stands out (all wait in the same collective): the round is re-formed.
    Log(Action::kWarn, span + "; no member stands out; aborting the round and re-forming");
    Event("round_hung", {{"round", s_.formed}, {"seconds", Secs(now - progress)}});
    AbortRound("", span);
    s_.formed_at = now;
    s_.round_broken = true;
    Replan("round " + std::to_string(s_.formed) + " hung");
    return;
  }
  for (Worker* w : culprits) {
    if (s_.shutting_down) break;
    DeclareHung(*w, why + "; " + span);
  }
}

void Policy::HungEvent(const Worker& w, const std::string& why) {
  Event("worker_hung", {{"slot", w.slot},
                        {"rank", w.rank >= 0 ? JsonValue(int64_t{w.rank}) : JsonValue()},
                        {"host", w.host},
                        {"pid", w.pid},
                        {"step", w.step},
                        {"reason", why}});
}

void Policy::CheckExitHang() {
  if (s_.shutting_down || !s_.finishing || Now() < s_.finishing_at + HangTimeout()) return;
  for (const auto& slot : FinishingMembers()) {
    auto it = s_.workers.find(slot);
    if (it == s_.workers.end() || !it->second.running || it->second.exit_hung) continue;
    Worker& w = it->second;
    w.exit_hung = true;
    std::string why =
        fmt::format("did not exit {:.0f} s after worker {} finished (--hang-timeout {:.0f} s){}",
                    Secs(Now() - s_.finishing_at), Label(s_.finisher), Secs(HangTimeout()),
                    w.finished ? "; it had finished training: a hang in its teardown" : "");
    HungEvent(w, why);
    Log(Action::kWarn, fmt::format("worker {} (slot {}, host {}, pid {}) {}; dumping its stacks "
                                   "into its log and killing it",
                                   Label(w.slot), w.slot, w.host, w.pid, why));
    DumpStacks(w);
    SignalSlot(w.slot, SIGKILL);
  }
}

void Policy::DeclareHung(Worker& w, const std::string& why) {
  if (!w.running || w.dropped) return;
  std::string what = fmt::format("worker {} (slot {}, host {}, pid {}, last step {}) {}",
                                 Label(w.slot), w.slot, w.host, w.pid, w.step, why);
  HungEvent(w, why);
  Log(Action::kWarn, what + "; dumping its stacks into its log and killing it");
  w.lost_at = TimePoint::max();
  // Its peers are aborted and the next round proposed first: they recover (the rendezvous
  // core forms the round by itself) while the stacks are dumped; then it is killed.
  if (!d_.elastic || s_.finishing) {
    ++s_.failures;
    w.dropped = true;
    Terminate(1, what);
  } else {
    LoseWorker(w, what);
  }
  DumpStacks(w);
  SignalSlot(w.slot, SIGKILL);
}

void Policy::DumpStacks(const Worker& w) {
  Action dump;
  dump.kind = Action::kDumpStacks;
  dump.slot = w.slot;
  dump.signal = w.stack_signal;
  Emit(std::move(dump));
}

JobView Policy::View() const {
  JobView v;
  TimePoint now = Now();
  v.round = s_.round;
  v.formed_round = s_.formed;
  v.min_np = d_.min_np;
  v.max_np = d_.max_np;
  v.resets = s_.resets;
  v.failures = s_.failures;
  v.stragglers = s_.stragglers;
  if (s_.recovery_start != TimePoint{}) v.since_recovery = Secs(now - s_.recovery_start);
  v.checkpoints = !d_.checkpoint_dir.empty();
  v.checkpoint_version = s_.checkpoint_version;
  v.checkpoint_step = s_.checkpoint_step;
  v.checkpoint_seconds = s_.checkpoint_seconds;
  v.checkpoint_path = s_.checkpoint_path;
  v.checkpoint_error = s_.checkpoint_error;
  v.checkpoint_failures = s_.checkpoint_failures;
  v.phase = s_.shutting_down                    ? "stopping"
            : s_.finishing                      ? "finishing"
            : s_.wait_until != TimePoint::max() ? "waiting"
            : !s_.started                       ? "starting"
            : s_.round != s_.formed             ? "changing"
                                                : "training";
  for (const auto& slot : s_.formed_members) {
    const Worker& w = s_.workers.at(slot);
    MemberView m;
    m.rank = w.rank;
    m.slot = slot;
    m.host = w.host;
    m.pid = w.pid;
    m.step = w.step;
    m.epoch = w.epoch;
    m.cursor = w.cursor;
    m.samples = w.samples;
    m.epoch_size = w.epoch_size;
    if (w.commit_at != TimePoint{}) m.since_commit = Secs(now - w.commit_at);
    m.steps_per_second = w.rate;
    if (w.window_round == s_.formed) {
      m.step_compute = w.step_compute;
      m.step_wait = w.step_wait;
    }
    m.straggler = w.straggler;
    v.members.push_back(m);
  }
  for (const auto& [host, until] : hosts_.Blacklist()) {
    v.blacklisted.emplace_back(host, until == TimePoint::max() ? -1.0 : Secs(until - now));
  }
  for (const auto& [slot, w] : s_.workers) {
    if (w.running && w.spare && !w.dropped && !w.removed) {
      (w.joiner ? v.newcomers : v.spares).emplace_back(slot, w.pid);
    }
  }
  return v;
}

void Policy::Progress() {
  TimePoint now = Now();
  JobView v = View();
  int64_t step = -1, epoch = -1, cursor = -1, samples = -1, epoch_size = -1;
  for (const auto& m : v.members) {
    if (m.step > step) {
      step = m.step;
      epoch = m.epoch;
      cursor = m.cursor;
      samples = m.samples;
      epoch_size = m.epoch_size;
    }
  }
  std::string line = fmt::format("progress: {} worker(s) in round {} ({}), step {}",
                                 v.members.size(), s_.formed, v.phase, step);
  if (epoch >= 0) {
    line += fmt::format(", epoch {}", epoch);
    if (epoch_size > 0) line += fmt::format(" ({:.0f}%)", 100.0 * cursor / epoch_size);
  }
  if (samples >= 0 && s_.progress_samples >= 0 && now > s_.progress_at) {
    line += fmt::format(", {:.1f} samples/s",
                        (samples - s_.progress_samples) / Secs(now - s_.progress_at));
  }
  line += v.since_recovery < 0 ? ", no recovery yet"
                               : fmt::format(", last recovery {:.0f} s ago", v.since_recovery);
  double rate = samples >= 0 && s_.progress_samples >= 0 && now > s_.progress_at
                    ? (samples - s_.progress_samples) / Secs(now - s_.progress_at)
                    : -1;
  double step_rate = step >= 0 && s_.progress_step >= 0 && now > s_.progress_at
                         ? (step - s_.progress_step) / Secs(now - s_.progress_at)
                         : -1;
  s_.progress_step = step;
  s_.progress_samples = samples;
  s_.progress_at = now;
  Log(Action::kInfo, line);
  auto known = [](int64_t x) { return x >= 0 ? JsonValue(x) : JsonValue(); };
  Event("progress", {{"round", s_.formed},
                     {"size", int64_t(v.members.size())},
                     {"step", known(step)},
                     {"epoch", known(epoch)},
                     {"samples", known(samples)},
                     {"samples_per_second", rate >= 0 ? JsonValue(rate) : JsonValue()},
                     {"steps_per_second", step_rate >= 0 ? JsonValue(step_rate) : JsonValue()}});
}

void Policy::OnTimer() {
  TimePoint now = Now();
  if (!s_.shutting_down && s_.started && d_.progress_interval > Duration::zero()) {
    if (s_.next_progress == TimePoint{}) {
      s_.next_progress = now + d_.progress_interval;
    } else if (now >= s_.next_progress) {
      s_.next_progress = now + d_.progress_interval;
      Progress();
    }
  }
  if (s_.shutting_down) {
    if (now >= s_.kill_at) {
      for (auto& [slot, w] : s_.workers) {
        if (!w.running) continue;
        SignalSlot(slot, SIGKILL);
      }
      s_.kill_at = TimePoint::max();
    }
    return;
  }
  if (now >= s_.wait_until) {
    s_.wait_until = TimePoint::max();
    std::string what =
        std::string("timed out waiting for ") +
        (s_.started ? "--min-np " + std::to_string(d_.min_np) : "-np " + std::to_string(d_.np)) +
        " workers";
    Terminate(1, hosts_.Available().empty()
                     ? "no hosts left (every listed host is gone or blacklisted); " + what
                     : what);
    return;
  }
  if (hosts_.TakeEndedCooldowns()) Replan("a blacklist cooldown ended");
  for (auto& [slot, w] : s_.workers) {
    // A newcomer gets the time a new member gets to join (--rendezvous-timeout); its peers do
    // not wait for it, but its slot is planned for no one else meanwhile.
    if (Starting(w) && now >= w.launched_at + d_.rendezvous_timeout) {
      std::string what = fmt::format(
          "the new worker in slot {} (host {}) did not get ready "
          "within {:.0f} s (--rendezvous-timeout); killing it",
          slot, w.host, Secs(d_.rendezvous_timeout));
      Log(Action::kWarn, what);
      w.dropped = true;
      SignalSlot(slot, SIGKILL);
      if (CountNewcomerFailure(w, what)) return;
    }
  }
  for (auto& [slot, w] : s_.workers) {
    if (w.running && now >= w.lost_at && !s_.shutting_down) {
      w.lost_at = TimePoint::max();
      if (!IsMember(slot)) {  // not in the job (removed, leaving): its process goes
        SignalSlot(slot, SIGKILL);
        // Its old round may still run, its peers waiting on it in a collective; a peer cut
        // off by the network never tells them it died: they are aborted out of it.
        if (s_.aborted < s_.formed) {
          AbortFormedRound(
              slot, "slot " + slot + " of round " + std::to_string(s_.formed) + " lost contact");
        }
        continue;
      }
      DeclareHung(w, "lost contact: its Watch stream broke and stayed broken (the process is "
                     "stopped or hung, or its host is unreachable)");
    }
  }
  CheckHang();
  CheckExitHang();
}

}  // namespace elastic::driver
