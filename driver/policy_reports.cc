// Policy (driver/policy.h), the workers' reports: heartbeats, commits (the step and cursor a
// worker holds, the recovery's last phases, the finisher's check), failures, stragglers
// (driver/stragglers.h) and checkpoints.
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
      w.version = std::max(w.version, r.version);  // what it holds as it ends
      // Not below a commit already heard from it: after a driver outage a worker's pending
      // commit report and its FINISHED may come in either order.
      if (r.step > 0) w.step = std::max(w.step, r.step);
      break;
    case rendezvous::ReportKind::kFailed:
      OnFailedReport(w, r);
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
      OnCommitReport(w, r);
      break;
  }
}

void Policy::OnFailedReport(Worker& w, const rendezvous::Report& r) {
  Log(Action::kWarn, fmt::format("slot {} reports a failure: {}", r.slot, r.message));
  if (w.failed_round != r.round) {
    w.failed_round = r.round;
    w.failure = r.message;
    s_.failure_order.push_back(r.slot);
    if (s_.failure_order.size() > 4096) s_.failure_order.erase(s_.failure_order.begin());
  }
  EndIfEveryMemberFailed();
}

void Policy::OnCommitReport(Worker& w, const rendezvous::Report& r) {
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
    return;
  }
  if (w.step >= 0 && r.step > w.step && w.commit_at > s_.formed_at && r.round == s_.formed) {
    s_.longest_interval = std::max(s_.longest_interval, (Now() - w.commit_at) / (r.step - w.step));
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
      Event(events::kRecoveryPhase, {{"phase", "rebuild"}, {"seconds", r.rebuild_seconds}});
      Event(events::kRecoveryPhase, {{"phase", "sync"}, {"seconds", r.sync_seconds}});
      Event(events::kRecoveryPhase,
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
    Event(events::kCommitted, {{"slot", r.slot},
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
  JsonFields fields = {{"slot", r.slot},          {"rank", int64_t{w.rank}},
                       {"host", w.host},          {"compute_seconds", v->compute},
                       {"wait_seconds", v->wait}, {"median_seconds", v->median},
                       {"ratio", v->ratio},       {"window", int64_t{d_.straggler_window}}};
  if (changed > 0) {
    ++s_.stragglers;
    StragglerEstimate e = EstimateStraggler(*v, s_.formed_members.size());
    auto [decision, why, after] = DecideOnStraggler(w, e);
    fields.emplace_back("action", std::string(StragglerActionName(d_.straggler_action)));
    fields.emplace_back("decision", decision);
    fields.emplace_back("reason", why);
    fields.emplace_back("steps_per_second_now", e.now);
    fields.emplace_back("steps_per_second_after", after);
    Log(Action::kWarn,
        fmt::format("worker {} (slot {}, host {}) is a straggler: it computes {:.4f} s a step "
                    "against its peers' median of {:.4f} s ({:.2f}x, throughout the last {} "
                    "steps), and its peers wait for it; --straggler-action {}: {}",
                    w.rank, r.slot, w.host, v->compute, v->median, v->ratio, d_.straggler_window,
                    StragglerActionName(d_.straggler_action), why));
    Event(events::kStraggler, std::move(fields));
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
    Event(events::kStragglerCleared, std::move(fields));
  }
}

std::tuple<std::string, std::string, double> Policy::DecideOnStraggler(Worker& w,
                                                                       const StragglerEstimate& e) {
  auto rate = [](double v) { return fmt::format("{:.1f}", v); };
  if (d_.straggler_action == StragglerAction::kWarn) return {"none", "named only", 0.0};
  if (s_.evicted_at != TimePoint{} && Now() - s_.evicted_at < kStragglerCooldown) {
    return {"none",
            fmt::format("named only: a straggler was {} {:.0f} s ago, and none is again "
                        "within {:.0f} s",
                        d_.straggler_action == StragglerAction::kReplace ? "replaced" : "dropped",
                        Secs(Now() - s_.evicted_at), Secs(kStragglerCooldown)),
            0.0};
  }
  if (s_.round != s_.formed) return {"none", "named only: a membership change is under way", 0.0};
  const size_t n = s_.formed_members.size();
  if (d_.straggler_action == StragglerAction::kReplace) {
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
    Log(Action::kDebug, fmt::format("checkpoint of version {} written to {} in {:.3f} s", r.version,
                                    r.message, r.seconds));
    Event(events::kCheckpointWritten, {{"slot", r.slot},
                                       {"version", r.version},
                                       {"step", r.step},
                                       {"epoch", known(r.epoch)},
                                       {"path", r.message},
                                       {"seconds", r.seconds}});
    return;
  }
  if (r.kind == rendezvous::ReportKind::kCheckpointFailed) {
    ++s_.checkpoint_failures;
    Event(events::kCheckpointFailed,
          {{"slot", r.slot}, {"version", r.version}, {"message", r.message}});
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
        fmt::format(
            "{} checkpoint version {} (step {}{}) from {}{}",
            lost ? "state restored from" : "resuming from", r.version, r.step,
            r.epoch >= 0 ? ", epoch " + std::to_string(r.epoch) : "", r.message,
            lost ? fmt::format("; {} committed step(s) since it are lost", steps_lost) : ""));
    Event(events::kStateRestored, {{"round", r.round},
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
    if (!lost) s_.resumed_version = r.version;
    return;
  }
  if (!lost) {
    Log(Action::kInfo, fmt::format("{}; starting from the initial state", r.message));
    return;
  }
  s_.restore_round = -1;
  if (d_.start_over_if_state_lost) {
    Log(Action::kWarn, fmt::format("{}; starting over from the initial state "
                                   "(--start-over-if-state-lost)",
                                   r.message));
    return;
  }
  Terminate(1, "state lost: commits up to version " + std::to_string(s_.lost_committed) +
                   " were made, but no worker of round " + std::to_string(r.round) +
                   " holds any (every holder is gone), and " + r.message +
                   "; pass --start-over-if-state-lost to train again from the start");
}

}  // namespace elastic::driver
