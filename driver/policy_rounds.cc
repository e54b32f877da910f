// Policy (driver/policy.h), the rendezvous' side: rounds formed (and formed with the state
// lost), join timeouts, members leaving, spares waiting for a place, Watch streams, discovery
// results, signals, and the end of the job.
#include <signal.h>
#include <spdlog/fmt/fmt.h>
#include <spdlog/fmt/ranges.h>

#include <algorithm>

#include "driver/events.h"
#include "driver/plan.h"
#include "driver/policy.h"
#include "driver/stragglers.h"

namespace elastic::driver {

using rendezvous::Assignment;
using rendezvous::EventKind;

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
  Event(events::kStateLost, std::move(fields));
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
                  f.sync_required ? fmt::format(", state synced from rank 0 to [{}]",
                                                fmt::join(behind.empty() ? f.members : behind, " "))
                                  : ""));
  Event(events::kRoundFormed, {{"round", f.round},
                               {"members", f.members},
                               {"versions", f.versions},
                               {"version", f.version},
                               {"sync_required", f.sync_required}});
  if (s_.recovering) {
    Event(events::kRecoveryPhase,
          {{"phase", "rendezvous"}, {"seconds", Secs(Now() - s_.recovery_start)}});
  }
}

void Policy::OnStateLost(const rendezvous::FormedRound& f) {
  if (f.round != s_.round || s_.shutting_down) return;
  Event(events::kStateLost, {{"round", f.round},
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
    Event(events::kRoundHung, {{"round", s_.formed}, {"seconds", Secs(Now() - s_.formed_at)}});
    for (const auto& slot : stuck) DumpStacks(s_.workers.at(slot));
    AbortRound("", why);  // and their waits start again
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
  const bool first = s_.aborted < s_.formed;
  s_.aborted = s_.formed;
  Action again;
  again.kind = Action::kRestartWait;
  for (const auto& slot : s_.formed_members) {
    if (slot == skip) continue;
    Action a;
    a.kind = Action::kPublish;
    a.slot = slot;
    a.event = rendezvous::Event{EventKind::kAbort, s_.formed, why};
    Emit(std::move(a));
    auto it = s_.workers.find(slot);
    if (first && it != s_.workers.end() && it->second.running && !it->second.dropped &&
        it->second.round == s_.formed) {
      again.slots.push_back(slot);
    }
  }
  // An aborted member rolls back to its last commit before it can join: its wait starts now.
  // A pending proposal may have expected it for most of the rendezvous timeout already (while
  // it sat in the collective this abort ends), and the core carries that wait over into the
  // proposal that follows; once aborted, a member missing its wait is dropped, not aborted
  // again (OnJoinTimeout), so without a new wait the state's holders could be killed the
  // moment after their abort. Only the round's first abort gives one, and only to the
  // processes of the round (not a slot's newer process, nor a dropped one): later losses do
  // not keep pushing the wait of a member that ignores the abort.
  if (!again.slots.empty()) Emit(std::move(again));
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
    Event(events::kMemberLeft, {{"slot", slot}, {"round", round}});
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
  Event(events::kWorkerLeaving, {{"slot", w.slot},
                                 {"rank", w.rank >= 0 ? JsonValue(int64_t{w.rank}) : JsonValue()},
                                 {"reason", why}});
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
  Event(events::kNewcomerReady, {{"slot", slot}, {"seconds", Secs(Now() - w.launched_at)}});
  if (Gathering(w)) return;
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
    Log(Action::kWarn,
        "discovery failed; keeping the last good host set: " + result.status().message());
    Event(events::kDiscovery, {{"ok", false}, {"error", result.status().message()}});
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
  Event(events::kDiscovery, {{"hosts", names}, {"ok", true}});
  for (const auto& h : change.added) Event(events::kHostAdded, {{"host", h}});
  for (const auto& h : change.removed) Event(events::kHostRemoved, {{"host", h}});
  for (const auto& h : change.changed) {
    for (const auto& l : listed) {
      if (l.host == h) Event(events::kHostChanged, {{"host", h}, {"slots", int64_t{l.slots}}});
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
  Event(events::kJobEnding, {{"code", int64_t{code}}, {"message", message}});
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

}  // namespace elastic::driver
