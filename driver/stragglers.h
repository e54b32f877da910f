// Straggler detection (docs/recovery.md, "Stragglers"): the driver's pure rules, on the
// state a worker's commit reports build up (driver/policy_state.h). Each worker's agent
// measures the time its rank spends between collectives (its own work: compute) and in them
// (the collective, and waiting there for its peers) and sends both, summed over the round,
// with every report (worker_agent/gloo_communicator.h). In synchronous training every rank's
// step takes as long as the slowest one's; what tells the slow one is its compute.
//
// A member's steps are cut into sub-windows of window/4 steps (at least 1). At the close of
// each, its compute per step there is judged against the median of its peers' latest
// sub-windows in the same round: slow when at least `factor` times that median (and 1 ms or
// more above it). A member is named a straggler when its last four sub-windows (the whole
// window) were all slow, and no longer one after four that were not (below the half-way
// mark between 1 and `factor`). So one slow step, a pause (a stop, a hiccup, rank 0's
// occasional extra work, an epoch's padded end) that falls into one or two sub-windows, or
// a fault, never names one: only slowness that lasts the whole window does.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "driver/policy_state.h"
#include "rendezvous/types.h"

namespace elastic::driver {

// Sub-windows a window is cut into; all of them slow names a straggler.
inline constexpr int kStragglerSubWindows = 4;
// Below this much compute per step above the median, no rank is slow (timer noise).
inline constexpr double kStragglerMinGapSeconds = 0.001;

// Feeds a member's commit report into its window. True when a sub-window closed: then
// w.step_compute and w.step_wait hold its per-step figures there. Reports without figures
// (an agent that measures none), with figures that are not finite or out of range, or of
// another round than the window's (a new communicator counts from 0) start a new window.
bool ObserveCommit(WorkerState& w, const rendezvous::Report& r, int window);

struct StragglerVerdict {
  bool slow = false;       // at least `factor` times the median, this sub-window
  bool fast = false;       // below the half-way mark: a sub-window towards clearing the name
  double compute = 0;      // its compute per step in the sub-window, seconds
  double wait = 0;         // its wait per step there
  double median = 0;       // its peers' median compute per step
  double ratio = 0;        // compute / median
};

// Judges w's last sub-window against `peers` (its peers' compute per step in their latest
// sub-windows of the same round). None without peers.
std::optional<StragglerVerdict> JudgeStraggler(const WorkerState& w,
                                               const std::vector<double>& peers, double factor);

// What a verdict changes: the streaks of slow and fast sub-windows, and the name. Returns +1
// when w became a straggler, -1 when it no longer is one, 0 otherwise.
int ApplyVerdict(WorkerState& w, const StragglerVerdict& v);

// A new process in the slot (or a new round for w): nothing measured carries over.
void ResetStragglerWindow(WorkerState& w);

// What acting on a straggler would bring (--straggler-action replace or drop), in steps per
// second, from its verdict: a step now takes its compute and wait (every rank's step takes
// as long as the slowest one's; its wait is the collective's own time, since its peers are
// there first); with a peer of median speed in its place, the median compute and the same
// collective; without it, the n-1 others share its part of each step (the global batch is the
// same), the median compute times n/(n-1).
struct StragglerEstimate {
  double now = 0, replaced = 0, dropped = 0;
};
StragglerEstimate EstimateStraggler(const StragglerVerdict& v, size_t members);

// A round change costs the job about this long (the re-form, and the steps since the last
// commit trained again); the steps it wins are counted over this horizon.
inline constexpr double kStragglerChangeSeconds = 2.0;
inline constexpr double kStragglerHorizonSeconds = 60.0;
// A slot whose straggler was replaced or dropped gets no process for this long, and no second
// straggler is replaced or dropped within it (the same slowness again is the job's, not a
// worker's).
inline constexpr Duration kStragglerCooldown = std::chrono::seconds(60);

// Whether going from `now` to `after` steps per second wins, over the horizon, more steps
// than a round change costs at the new pace.
bool ChangePays(double now, double after);

}  // namespace elastic::driver
