#include "driver/stragglers.h"

#include <algorithm>
#include <cmath>

namespace elastic::driver {
namespace {

bool Valid(double seconds) { return std::isfinite(seconds) && seconds >= 0 && seconds < 1e9; }

void Anchor(WorkerState& w, const rendezvous::Report& r) {
  w.window_round = r.round;
  w.window_step = r.step;
  w.window_compute = r.compute_seconds;
  w.window_wait = r.wait_seconds;
}

}  // namespace

void ResetStragglerWindow(WorkerState& w) {
  w.window_round = w.window_step = -1;
  w.window_compute = w.window_wait = 0;
  w.step_compute = w.step_wait = -1;
  w.slow_windows = w.fast_windows = 0;
}

bool ObserveCommit(WorkerState& w, const rendezvous::Report& r, int window) {
  if (!Valid(r.compute_seconds) || !Valid(r.wait_seconds) ||
      r.compute_seconds + r.wait_seconds <= 0) {
    w.window_round = -1;
    return false;
  }
  if (w.window_round != r.round) {
    // A new round: a new communicator, whose sums start at 0. The streaks go on (a straggler
    // stays one across a round change until it is judged otherwise), the figures do not.
    w.step_compute = w.step_wait = -1;
    Anchor(w, r);
    return false;
  }
  if (r.step < w.window_step || r.compute_seconds < w.window_compute ||
      r.wait_seconds < w.window_wait) {
    Anchor(w, r);  // not a later point of the same communicator's sums: start again
    return false;
  }
  const int64_t steps = r.step - w.window_step;
  if (steps < std::max(1, window / kStragglerSubWindows)) return false;
  w.step_compute = (r.compute_seconds - w.window_compute) / static_cast<double>(steps);
  w.step_wait = (r.wait_seconds - w.window_wait) / static_cast<double>(steps);
  Anchor(w, r);
  return true;
}

std::optional<StragglerVerdict> JudgeStraggler(const WorkerState& w,
                                               const std::vector<double>& peers, double factor) {
  if (peers.empty() || w.step_compute < 0) return std::nullopt;
  std::vector<double> sorted = peers;
  std::sort(sorted.begin(), sorted.end());
  const size_t n = sorted.size();
  StragglerVerdict v;
  v.median = n % 2 ? sorted[n / 2] : (sorted[n / 2 - 1] + sorted[n / 2]) / 2;
  v.compute = w.step_compute;
  v.wait = std::max(0.0, w.step_wait);
  v.ratio = std::min(1e6, v.compute / std::max(v.median, 1e-9));
  const double gap = v.compute - v.median;
  v.slow = v.compute >= factor * v.median && gap >= kStragglerMinGapSeconds;
  v.fast = v.compute < (1 + factor) / 2 * v.median || gap < kStragglerMinGapSeconds;
  return v;
}

StragglerEstimate EstimateStraggler(const StragglerVerdict& v, size_t members) {
  auto rate = [](double seconds) { return seconds > 0 ? 1.0 / seconds : 0.0; };
  StragglerEstimate e;
  e.now = rate(v.compute + v.wait);
  e.replaced = rate(v.median + v.wait);
  if (members >= 2) {
    const double n = static_cast<double>(members);
    e.dropped = rate(v.median * n / (n - 1) + v.wait);
  }
  return e;
}

bool ChangePays(double now, double after) {
  if (now <= 0 || after <= now) return false;
  return kStragglerHorizonSeconds * (after - now) >= kStragglerChangeSeconds * after;
}

int ApplyVerdict(WorkerState& w, const StragglerVerdict& v) {
  w.slow_windows = v.slow ? w.slow_windows + 1 : 0;
  w.fast_windows = v.fast ? w.fast_windows + 1 : 0;
  if (!w.straggler && w.slow_windows >= kStragglerSubWindows) {
    w.straggler = true;
    return 1;
  }
  if (w.straggler && w.fast_windows >= kStragglerSubWindows) {
    w.straggler = false;
    return -1;
  }
  return 0;
}

}  // namespace elastic::driver
