// The driver's membership decisions: who runs in the next round, and what a worker's exit,
// a report, a discovery result or a rendezvous event means for the job (DESIGN §3, §6).
#include <signal.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>
#include <tuple>

#include "driver/driver_internal.h"
#include "driver/plan.h"

namespace elastic::driver::internal {

using rendezvous::Assignment;
using rendezvous::Event;
using rendezvous::EventKind;

std::string Driver::LabelOf(const std::string& slot) const {
  int r = MemberRank(slot);
  return r >= 0 ? std::to_string(r) : slot;
}

int Driver::MemberRank(const std::string& slot) const {
  auto it = std::find(members_.begin(), members_.end(), slot);
  return it == members_.end() ? -1 : static_cast<int>(it - members_.begin());
}

void Driver::Replan(const std::string& reason) {
  if (shutting_down_ || finishing_) return;
  PlanInput in;
  in.listed = last_listed_;
  in.available = hosts_.Available();
  in.host_order = last_listed_order_;
  in.max_np = opts_.max_np > 0 ? static_cast<size_t>(opts_.max_np) : 0;
  for (const auto& [slot, w] : workers_) {
    if (!w.proc || w.proc->reaped()) continue;
    if (!w.dropped && !w.removed && !w.leaving) {
      in.alive.insert(slot);
    } else {
      in.busy.insert(slot);
    }
  }
  auto alive = [&](const std::string& slot) { return in.alive.count(slot) > 0; };
  std::vector<std::string> plan = PlanMembers(in);
  size_t need = static_cast<size_t>(started_ ? opts_.min_np : opts_.np);
  if (plan.size() < need) {
    if (wait_until_ == TimePoint::max()) {
      Duration limit = started_ ? opts_.elastic_timeout : opts_.start_timeout;
      wait_until_ = SteadyClock::now() + limit;
      spdlog::warn("{} slot(s) available, {} needed ({}); waiting up to {:.0f} s for hosts",
                   plan.size(), need, reason, Secs(limit));
      log_.Write("waiting_for_hosts",
                 {{"available", int64_t(plan.size())}, {"needed", int64_t(need)}});
    }
    return;
  }
  wait_until_ = TimePoint::max();
  if (plan == members_ && round_ >= 0 && !round_broken_) return;  // nothing to change
  round_broken_ = false;
  if (round_ >= 0) {
    if (opts_.reset_limit >= 0 && resets_ >= opts_.reset_limit) {
      Terminate(1, "reset limit reached (" + std::to_string(opts_.reset_limit) +
                       " resets; raise --reset-limit to allow more)");
      return;
    }
    ++resets_;
  }
  std::vector<std::string> old = members_;
  int64_t old_round = round_;
  members_ = plan;
  ++round_;
  // Planned ranks; rank 0 and whether a sync is needed are settled when the round forms, from
  // the versions the members say they hold.
  std::map<std::string, Assignment> assign = AssignRanks(plan, false);
  std::vector<std::string> removed;
  for (auto& [slot, w] : workers_) {
    if (alive(slot) && std::find(plan.begin(), plan.end(), slot) == plan.end()) {
      removed.push_back(slot);
      w.removed = true;
    }
  }
  spdlog::info("round {}: {} worker(s) [{}] ({})", round_, plan.size(), fmt::join(plan, " "),
               reason);
  log_.Write("round_proposed",
             {{"round", round_}, {"members", plan}, {"removed", removed}, {"reason", reason}});
  Status s = core_->ProposeRound(round_, assign, removed);
  if (!s.ok()) {
    Terminate(1, "internal error proposing round " + std::to_string(round_) + ": " + s.ToString());
    return;
  }
  // Fence the old round: survivors stop at their next commit.
  for (const auto& slot : old) {
    if (alive(slot)) {
      core_->events().Publish(slot, Event{EventKind::kMembershipChanging, old_round, reason});
    }
  }
  if (old_round >= 0) log_.Write("fence", {{"round", old_round}, {"reason", reason}});
  for (const auto& slot : plan) {
    Worker& w = workers_[slot];
    if (w.slot.empty()) {
      w.slot = slot;
      std::tie(w.host, w.index) = SplitSlot(slot);
      w.local = IsLocalHost(w.host);
    }
    if (!alive(slot)) Launch(w);
  }
}

void Driver::CheckFinished() {
  if (shutting_down_ || !finishing_) return;
  for (const auto& slot : members_) {
    auto it = workers_.find(slot);
    if (it == workers_.end() || !it->second.proc || !it->second.proc->reaped()) return;
  }
  Terminate(0, "success: all " + std::to_string(members_.size()) + " workers of round " +
                   std::to_string(round_) + " finished");
}

void Driver::HandleExit(Worker& w, int code) {
  std::string rank = LabelOf(w.slot);
  log_.Write("worker_exited", {{"slot", w.slot},
                               {"code", int64_t{code}},
                               {"rank", rank},
                               {"status", w.proc->DescribeExit()}});
  bool member = MemberRank(w.slot) >= 0;
  if (shutting_down_) return;
  if (w.leaving) {
    spdlog::info("worker {} (slot {}) left the job: {}", rank, w.slot, w.proc->DescribeExit());
    return;
  }
  if (w.removed || !member) {
    spdlog::info("worker {} (slot {}) left after scale-down: {}", rank, w.slot,
                 w.proc->DescribeExit());
    return;
  }
  if (code == 0) {
    if (!finishing_) spdlog::info("worker {} finished; the job is finishing", rank);
    finishing_ = true;
    CheckFinished();
    return;
  }
  if (w.dropped) {  // the driver already gave up on it (join timeout, lost)
    return;
  }
  ++failures_;
  std::string what = "worker " + rank + " (slot " + w.slot + ", host " + w.host +
                     ") failed: " + w.proc->DescribeExit();
  if (!opts_.elastic || finishing_) {
    Terminate(code, what);
    return;
  }
  spdlog::warn("{}; recovering", what);
  w.dropped = true;
  round_broken_ = true;
  recovery_start_ = SteadyClock::now();
  recovering_ = true;
  log_.Write("worker_lost", {{"slot", w.slot}, {"rank", rank}, {"phase", "detect"}});
  // Fail the survivors' collectives at once (a silent peer would otherwise cost a timeout):
  // the abort names the formed round the worker was in, so that its peers there fail
  // whatever they do in it (a collective, connecting) and those still joining it fail as
  // soon as they are in it. A worker that was only in a proposed round has no peers yet:
  // the members of the formed round are fenced by the new proposal, and roll nothing back.
  AbortFormedRound(w.slot, what);
  log_.Write("recovery_phase",
             {{"phase", "fence"}, {"seconds", Secs(SteadyClock::now() - recovery_start_)}});
  if (hosts_.RecordFailure(w.host)) {
    spdlog::warn("host {} is blacklisted{}", w.host,
                 hosts_.LastCooldown() == Duration::max()
                     ? ""
                     : fmt::format(" for {:.1f} s", Secs(hosts_.LastCooldown())));
    log_.Write("host_blacklisted", {{"host", w.host}});
  }
  if (opts_.max_failures >= 0 && failures_ > opts_.max_failures) {
    Terminate(1, what + "; too many failures (--max-failures " +
                     std::to_string(opts_.max_failures) + ")");
    return;
  }
  Replan("worker " + rank + " failed");
}

void Driver::HandleReport(const rendezvous::Report& r) {
  auto it = workers_.find(r.slot);
  if (it == workers_.end()) return;
  switch (r.kind) {
    case rendezvous::ReportKind::kFinished:
      it->second.finished = true;
      break;
    case rendezvous::ReportKind::kFailed:
      spdlog::warn("slot {} reports a failure: {}", r.slot, r.message);
      break;
    case rendezvous::ReportKind::kLeaving:
      HandleLeaving(it->second, r.message);
      break;
    case rendezvous::ReportKind::kCommitted:
      if (!first_commit_logged_ && r.round == formed_) {
        first_commit_logged_ = true;
        if (recovering_) {
          // The worker's own phases (durations) ride on its first commit report.
          log_.Write("recovery_phase", {{"phase", "rebuild"}, {"duration", r.rebuild_seconds}});
          log_.Write("recovery_phase", {{"phase", "sync"}, {"duration", r.sync_seconds}});
          log_.Write("recovery_phase", {{"phase", "first_step"},
                                        {"seconds", Secs(SteadyClock::now() - recovery_start_)}});
          recovering_ = false;
        }
      }
      log_.Write("committed", {{"slot", r.slot},
                               {"round", r.round},
                               {"version", r.version},
                               {"step", r.step},
                               {"epoch", r.epoch},
                               {"cursor", r.cursor}});
      break;
  }
}

void Driver::HandleFormed(const rendezvous::FormedRound& f) {
  if (f.round != round_) return;
  formed_ = f.round;
  started_ = true;
  members_ = f.members;  // rank order as formed: rank 0 holds the newest version
  formed_members_ = f.members;
  first_commit_logged_ = false;
  std::vector<std::string> behind;
  for (size_t i = 0; i < f.members.size(); ++i) {
    if (f.versions[i] != f.version) behind.push_back(f.members[i]);
  }
  if (f.state_lost) {
    spdlog::warn(
        "state lost: no worker of round {} holds a commit (the newest was version {}); "
        "starting over from the initial state (--start-over-if-state-lost)",
        f.round, f.newest_committed);
    log_.Write("state_lost", {{"round", f.round},
                              {"newest_committed", f.newest_committed},
                              {"members", f.members},
                              {"start_over", true}});
  } else if (f.version > 0 && f.version < f.newest_committed) {
    spdlog::warn(
        "round {}: the newest version any member holds is {} (version {} was committed "
        "by workers that are gone); training goes on from version {}",
        f.round, f.version, f.newest_committed, f.version);
  }
  spdlog::info("round {} formed with {} worker(s); rank 0 is {} (version {}){}", f.round,
               f.members.size(), f.members.empty() ? "-" : f.members[0], f.version,
               f.sync_required ? fmt::format(", state synced from rank 0 to [{}]",
                                             fmt::join(behind.empty() ? f.members : behind, " "))
                               : "");
  log_.Write("round_formed", {{"round", f.round},
                              {"members", f.members},
                              {"versions", f.versions},
                              {"version", f.version},
                              {"sync_required", f.sync_required}});
  if (recovering_) {
    log_.Write("recovery_phase",
               {{"phase", "rendezvous"}, {"seconds", Secs(SteadyClock::now() - recovery_start_)}});
  }
}

void Driver::AbortFormedRound(const std::string& gone, const std::string& why) {
  if (std::find(formed_members_.begin(), formed_members_.end(), gone) == formed_members_.end()) {
    return;
  }
  aborted_ = formed_;
  for (const auto& slot : formed_members_) {
    if (slot != gone) core_->events().Publish(slot, Event{EventKind::kAbort, formed_, why});
  }
}

void Driver::HandleMemberLeft(int64_t round, const std::string& slot) {
  // A member that joins again has left its round. Fenced members do that at a commit (no
  // collective is in flight then; the abort costs nothing); one whose mesh failed to connect
  // leaves peers that may wait for it to connect: they are told now, and when no new round is
  // pending, the same members re-form.
  if (round != formed_ || aborted_ >= round || shutting_down_ || finishing_) return;
  std::string why = "slot " + slot + " left round " + std::to_string(round);
  AbortFormedRound(slot, why);
  if (round_ == formed_) {
    spdlog::warn("{} on its own; re-forming", why);
    log_.Write("member_left", {{"slot", slot}, {"round", round}});
    round_broken_ = true;
    Replan(why);
  }
}

void Driver::HandleLeaving(Worker& w, const std::string& why) {
  if (w.leaving || shutting_down_) return;
  w.leaving = true;
  std::string rank = LabelOf(w.slot);
  spdlog::info("worker {} (slot {}) is leaving{}{}; re-forming without it", rank, w.slot,
               why.empty() ? "" : ": ", why);
  log_.Write("worker_leaving", {{"slot", w.slot}, {"rank", rank}, {"reason", why}});
  if (MemberRank(w.slot) >= 0) {
    round_broken_ = true;
    Replan("worker " + rank + " is leaving");
  }
}

void Driver::HandleDiscovery(Posted& p) {
  for (const auto& w : p.warnings) spdlog::warn("discovery: {}", w);
  if (!p.hosts->ok()) {
    spdlog::warn("discovery failed; keeping the last good host set: {}",
                 p.hosts->status().message());
    log_.Write("discovery", {{"ok", false}, {"error", p.hosts->status().message()}});
    return;
  }
  const auto& listed = p.hosts->value();
  auto change = hosts_.Update(listed);
  last_listed_ = listed;
  for (const auto& h : listed) {
    if (std::find(last_listed_order_.begin(), last_listed_order_.end(), h.host) ==
        last_listed_order_.end()) {
      last_listed_order_.push_back(h.host);
    }
  }
  if (change.empty()) return;
  std::vector<std::string> names;
  for (const auto& h : listed) names.push_back(h.host + ":" + std::to_string(h.slots));
  log_.Write("discovery", {{"hosts", names}, {"ok", true}});
  for (const auto& h : change.added) log_.Write("host_added", {{"host", h}});
  for (const auto& h : change.removed) log_.Write("host_removed", {{"host", h}});
  spdlog::info("hosts changed: +[{}] -[{}] ~[{}]", fmt::join(change.added, " "),
               fmt::join(change.removed, " "), fmt::join(change.changed, " "));
  Replan("hosts changed");
}

void Driver::HandlePosted(Posted& p) {
  switch (p.kind) {
    case Posted::kRoundFormed:
      HandleFormed(p.formed);
      break;
    case Posted::kStateLost: {
      if (p.round != round_ || shutting_down_) break;
      std::string what = "state lost: commits up to version " +
                         std::to_string(p.formed.newest_committed) +
                         " were made, but no worker of round " + std::to_string(p.round) +
                         " holds any (every holder is gone)";
      log_.Write("state_lost", {{"round", p.round},
                                {"newest_committed", p.formed.newest_committed},
                                {"members", p.formed.members},
                                {"start_over", false}});
      Terminate(1, what + "; pass --start-over-if-state-lost to train again from the start");
      break;
    }
    case Posted::kJoinTimeout: {
      if (p.round != round_ || shutting_down_) break;
      spdlog::warn("round {}: slot(s) [{}] did not join within {:.0f} s; dropping them", p.round,
                   fmt::join(p.slots, " "), Secs(opts_.rendezvous_timeout));
      for (const auto& slot : p.slots) {
        Worker& w = workers_[slot];
        if (w.proc && !w.proc->reaped()) w.proc->SignalGroup(SIGKILL);
        w.dropped = true;
        ++failures_;
        hosts_.RecordFailure(w.host);
      }
      round_broken_ = true;
      members_.erase(std::remove_if(members_.begin(), members_.end(),
                                    [&](const std::string& s) {
                                      return std::find(p.slots.begin(), p.slots.end(), s) !=
                                             p.slots.end();
                                    }),
                     members_.end());
      Replan("slots did not join");
      break;
    }
    case Posted::kMemberLeft:
      HandleMemberLeft(p.round, p.slots[0]);
      break;
    case Posted::kReport:
      HandleReport(p.report);
      break;
    case Posted::kWatchClosed: {
      auto it = workers_.find(p.slots[0]);
      // A remote worker whose stream breaks while its launcher runs may be lost (host gone):
      // unless the launcher exits (or the stream re-opens) within a moment, it is killed.
      if (it != workers_.end() && !it->second.local && !it->second.finished && it->second.proc &&
          !it->second.proc->reaped() && !shutting_down_) {
        it->second.lost_at = SteadyClock::now() + std::chrono::seconds(3);
      }
      break;
    }
    case Posted::kWatchOpened: {
      auto it = workers_.find(p.slots[0]);
      if (it != workers_.end()) it->second.lost_at = TimePoint::max();
      break;
    }
    case Posted::kDiscovery:
      HandleDiscovery(p);
      break;
  }
}

}  // namespace elastic::driver::internal
