// Policy (driver/policy.h), failure accounting: what a worker's exit means (a member that
// finished, failed, or was told to go; a spare or newcomer that ended early), the job's and the
// hosts' failure budgets (the blacklist), and the cases that end the job at once.
#include <signal.h>
#include <spdlog/fmt/fmt.h>
#include <spdlog/fmt/ranges.h>

#include <algorithm>

#include "driver/events.h"
#include "driver/failures.h"
#include "driver/plan.h"
#include "driver/policy.h"
#include "driver/stragglers.h"

namespace elastic::driver {

using rendezvous::Assignment;
using rendezvous::EventKind;

void Policy::OnExit(const std::string& slot, int code, const std::string& how) {
  auto it = s_.workers.find(slot);
  if (it == s_.workers.end()) return;
  Worker& w = it->second;
  w.running = false;
  w.lost_at = TimePoint::max();
  w.start_failed = code > 0 && code < 128 && w.heard_at < w.launched_at;  // never heard
  std::string rank = Label(slot);
  Event(events::kWorkerExited, {{"slot", slot},
                                {"code", int64_t{code}},
                                {"rank", w.rank >= 0 ? JsonValue(int64_t{w.rank}) : JsonValue()},
                                {"round", w.round},
                                {"status", how}});
  if (s_.shutting_down) return;
  if (w.leaving) {
    Log(Action::kInfo, fmt::format("worker {} (slot {}) left the job: {}", rank, slot, how));
    return;
  }
  if (w.exit_hung) return OnHungMemberExit(w, rank, how);
  if (w.dropped) {  // the driver gave up on it already (failed, hung, lost, no join)
    Log(Action::kInfo, fmt::format("worker {} (slot {}) is gone: {}", rank, slot, how));
    // Its slot is free again: a job waiting for slots (the hung worker was killed after the
    // re-plan) can use it now.
    Replan("slot " + slot + " is free");
    return;
  }
  if (w.joiner) return OnNewcomerExit(w, how);
  if (w.spare) return OnSpareExit(w, how);
  if (w.removed || !IsMember(slot)) {
    Log(Action::kInfo,
        fmt::format("worker {} (slot {}) left after scale-down: {}", rank, slot, how));
    return;
  }
  if (w.rescued && code == 0 && !w.finished) return OnRescuedExit(w, rank, how);
  if (code == 0) return OnMemberFinished(w, rank);
  OnMemberFailed(w, rank, code, how);
}

void Policy::OnHungMemberExit(Worker& w, const std::string& rank, const std::string& how) {
  if (!w.finished) {
    ++s_.failures;
    Terminate(1, fmt::format("worker {} (slot {}, host {}) neither finished training nor "
                             "exited after its peers finished; it was killed ({})",
                             rank, w.slot, w.host, how));
    return;
  }
  CheckFinished();
}

void Policy::OnNewcomerExit(Worker& w, const std::string& how) {
  // A newcomer that ends before taking its place: a failure of a new process on its host,
  // as when a relaunched member fails (its peers train on; the slot gets another).
  w.joiner = w.ready = w.paid = w.spare = false;
  std::string what = fmt::format(
      "the new worker in slot {} (host {}) exited before it took "
      "its place: {}",
      w.slot, w.host, how);
  Log(Action::kWarn, what);
  if (!CountNewcomerFailure(w, what)) Replan(what);
}

void Policy::OnSpareExit(Worker& w, const std::string& how) {
  // A spare that ends before taking a place: nothing of the job is lost; another starts,
  // unless they keep failing.
  const std::string slot = w.slot;
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
}

void Policy::OnRescuedExit(Worker& w, const std::string& rank, const std::string& how) {
  // Kept for the state it held, but the earlier removal reached it first.
  const std::string slot = w.slot;
  w.rescued = false;
  Log(Action::kWarn, fmt::format("worker {} (slot {}) was kept for the state it holds, but "
                                 "had been told to leave already: {}",
                                 rank, slot, how));
  s_.round_broken = true;
  s_.members.erase(std::remove(s_.members.begin(), s_.members.end(), slot), s_.members.end());
  AbortFormedRound(slot, "slot " + slot + " left");
  Replan("slot " + slot + " left");
}

void Policy::OnMemberFinished(const Worker& w, const std::string& rank) {
  if (!s_.started && s_.failures > 0) {
    // Nothing was trained: the worker ended before any round formed, and others failed.
    Terminate(1, fmt::format("worker {} (slot {}) exited 0 before round {} formed, after {} "
                             "worker failure(s); no round ever formed",
                             rank, w.slot, s_.round, s_.failures));
    return;
  }
  if (!s_.finishing) {
    Log(Action::kInfo, fmt::format("worker {} finished; the job is finishing", rank));
    s_.finisher = w.slot;
    s_.finishing_at = Now();
  }
  s_.finishing = true;
  CheckFinished();
}

void Policy::OnMemberFailed(Worker& w, const std::string& rank, int code, const std::string& how) {
  if (w.dropped) return;  // the driver already gave up on it (join timeout, lost)
  std::string what =
      "worker " + rank + " (slot " + w.slot + ", host " + w.host + ") failed: " + how;
  if (!w.local && code == 255 && d_.launcher_template.empty()) {
    what +=
        " (ssh could not run the worker: the host is unreachable or refused the login; "
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
  if (s_.shutting_down || !d_.elastic || !last.start_failed) return false;
  if (d_.max_failures >= 0 || d_.reset_limit >= 0) return false;
  const int failed = EveryStartFailed(s_);
  if (failed == 0) return false;
  Event(events::kRoundFailed,
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
  if (s_.shutting_down || !d_.elastic) return false;
  if (d_.max_failures >= 0 || d_.reset_limit >= 0) return false;
  const Worker* first = EveryMemberFailed(s_);
  if (first == nullptr) return false;
  std::string message = first->failure;
  if (message.size() > 2000) message = message.substr(0, 2000) + "...";
  Event(events::kRoundFailed, {{"round", s_.formed},
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
  Event(events::kWorkerLost, {{"slot", slot},
                              {"rank", w.rank >= 0 ? JsonValue(int64_t{w.rank}) : JsonValue()},
                              {"phase", "detect"}});
  // Fail the survivors' collectives at once (a silent peer would otherwise cost a timeout):
  // the abort names the formed round the worker was in, so that its peers there fail
  // whatever they do in it (a collective, connecting) and those still joining it fail as
  // soon as they are in it. A worker that was only in a proposed round has no peers yet:
  // the members of the formed round are fenced by the new proposal, and roll nothing back.
  AbortFormedRound(slot, what);
  Event(events::kRecoveryPhase, {{"phase", "fence"}, {"seconds", Secs(Now() - s_.recovery_start)}});
  RecordHostFailure(w, w.round, what);
  if (EndIfTooManyFailures(what)) return;
  Replan("worker " + rank + " failed");
}

bool Policy::EndIfTooManyFailures(const std::string& what) {
  if (!OverFailureBudget(s_.failures, d_.max_failures)) return false;
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
  if (!NewIncident(s_, w.host, round)) return;  // the same incident
  s_.incident_round[w.host] = round;
  if (!hosts_.RecordFailure(w.host)) return;
  bool forever = hosts_.LastCooldown() == Duration::max();
  Log(Action::kWarn,
      fmt::format("host {} is blacklisted{} ({})", w.host,
                  forever ? "" : fmt::format(" for {:.1f} s", Secs(hosts_.LastCooldown())), what));
  Event(events::kHostBlacklisted,
        {{"host", w.host},
         {"cooldown", forever ? JsonValue() : JsonValue(Secs(hosts_.LastCooldown()))}});
}

}  // namespace elastic::driver
