// Policy (driver/policy.h), hang detection (a round with no progress, a silent member, a
// member that does not exit after its peers finished), the job's view for `elastic-run
// status`, progress lines, and the timer that drives the deadlines.
#include <signal.h>
#include <spdlog/fmt/fmt.h>
#include <spdlog/fmt/ranges.h>

#include <algorithm>

#include "driver/events.h"
#include "driver/hang.h"
#include "driver/plan.h"
#include "driver/policy.h"
#include "driver/stragglers.h"

namespace elastic::driver {

using rendezvous::Assignment;
using rendezvous::EventKind;

RoundProgress Policy::CurrentProgress() const { return ProgressOf(s_, HangTimeout()); }

Duration Policy::HangTimeout() const {
  return driver::HangTimeout(d_.hang_timeout, s_.longest_interval);
}

void Policy::CheckHang() {
  const HangVerdict v = FindHang(s_, Now(), HangTimeout());
  if (v.kind == HangVerdict::kNone || v.kind == HangVerdict::kWaiting) return;
  std::string span =
      fmt::format("round {} made no progress for {:.1f} s (--hang-timeout {:.0f} s{})", s_.formed,
                  Secs(v.stalled), Secs(HangTimeout()),
                  v.progress.committed ? "" : ", doubled before the round's first commit");
  if (v.kind == HangVerdict::kRoundHung) {
    // No member stands out (all wait in the same collective): the round is re-formed.
    Log(Action::kWarn, span + "; no member stands out; aborting the round and re-forming");
    Event(events::kRoundHung, {{"round", s_.formed}, {"seconds", Secs(v.stalled)}});
    AbortRound("", span);
    s_.formed_at = Now();
    s_.round_broken = true;
    Replan("round " + std::to_string(s_.formed) + " hung");
    return;
  }
  for (const std::string& slot : v.culprits) {
    if (s_.shutting_down) break;
    DeclareHung(s_.workers.at(slot), v.why + "; " + span);
  }
}

void Policy::HungEvent(const Worker& w, const std::string& why) {
  Event(events::kWorkerHung, {{"slot", w.slot},
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
  Event(events::kProgress,
        {{"round", s_.formed},
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
  if (now >= s_.gather_until) {
    s_.gather_until = TimePoint::max();
    Replan("the new workers' --newcomer-window ended");
    if (s_.shutting_down) return;
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
      DeclareHung(w,
                  "lost contact: its Watch stream broke and stayed broken (the process is "
                  "stopped or hung, or its host is unreachable)");
    }
  }
  CheckHang();
  CheckExitHang();
}

}  // namespace elastic::driver
