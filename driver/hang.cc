// Hang detection's rules (driver/hang.h).
#include "driver/hang.h"

#include <algorithm>

namespace elastic::driver {

Duration HangTimeout(Duration configured, Duration longest_interval) {
  if (configured > Duration::zero()) return configured;
  if (longest_interval == Duration::zero()) return std::chrono::seconds(300);
  return std::max<Duration>(std::chrono::seconds(60), 10 * longest_interval);
}

RoundProgress ProgressOf(const PolicyState& s, Duration hang_timeout) {
  RoundProgress p;
  p.at = s.formed_at;
  for (const auto& slot : s.formed_members) {
    const WorkerState& w = s.workers.at(slot);
    if (w.commit_at >= s.formed_at && w.commit_at != TimePoint{}) p.committed = true;
    p.at = std::max({p.at, w.commit_at, w.moved_at});
  }
  p.limit = hang_timeout * (p.committed ? 1 : 2);
  return p;
}

HangVerdict FindHang(const PolicyState& s, TimePoint now, Duration hang_timeout) {
  HangVerdict v;
  if (s.shutting_down || s.finishing || !s.started || s.round != s.formed) return v;
  v.progress = ProgressOf(s, hang_timeout);
  v.stalled = now - v.progress.at;
  if (v.stalled < v.progress.limit) return v;
  std::vector<const WorkerState*> silent, idle, behind;
  int64_t most = 0;
  for (const auto& slot : s.formed_members) {
    const WorkerState& w = s.workers.at(slot);
    const bool current = w.heard_round == s.formed;
    if (now - w.heard_at > kSilence) {
      silent.push_back(&w);
    } else if (!current || !w.in_collective) {
      idle.push_back(&w);
    }
    most = std::max(most, current ? w.collectives : 0);
  }
  for (const auto& slot : s.formed_members) {
    const WorkerState& w = s.workers.at(slot);
    if ((w.heard_round == s.formed ? w.collectives : 0) < most) behind.push_back(&w);
  }
  const std::vector<const WorkerState*>* culprits = nullptr;
  if (!silent.empty()) {
    culprits = &silent;
    v.why = "is silent (no report for over 2 s)";
  } else if (!idle.empty() && idle.size() < s.formed_members.size()) {
    culprits = &idle;
    v.why = "is not in a collective while its peers wait in one";
  } else if (!behind.empty()) {
    culprits = &behind;
    v.why = "started fewer collectives than its peers";
  }
  if (culprits) {
    v.kind = HangVerdict::kCulprits;
    for (const WorkerState* w : *culprits) v.culprits.push_back(w->slot);
    return v;
  }
  v.kind = v.stalled < v.progress.limit + std::chrono::seconds(3) ? HangVerdict::kWaiting
                                                                  : HangVerdict::kRoundHung;
  return v;
}

}  // namespace elastic::driver
