// The driver policy's state as a value (driver/policy.h): everything it knows and decided,
// saved and loaded whole. A Policy restored from a saved state makes the same decisions as the
// original for the same events (tests/driver/policy_state_test.cc). What is not in it: the
// options (the command line gives them again) and the actions not yet taken (a state is saved
// between events, after Policy::TakeActions).
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/status.h"
#include "discovery/discovery.h"

namespace elastic::driver {

// What the policy knows of one slot and the process in it.
struct WorkerState {
  std::string slot, host;
  bool local = true;
  bool running = false;   // a process is started and has not exited
  bool dropped = false;   // the driver gave up on it (failed, lost, removed): exit is expected
  bool removed = false;   // scaled away
  bool finished = false;  // reported FINISHED
  bool leaving = false;   // reported LEAVING: no longer a member, whatever its exit
  bool spare = false;     // a warm spare (--spares): started, waiting in Join for a place
  // A newcomer (spare is set too): started for a place its peers do not wait for (a lost
  // member's slot, a slot discovery added); it takes the place at the first re-plan after it
  // is ready (waiting in Join), and until then its slot is planned for no one.
  bool joiner = false;
  bool ready = false;     // a newcomer that waits in Join for its place
  bool paid = false;      // a newcomer for a lost member's place: its round change was counted
  // The change from outside (e.g. a discovery result adding slots) that started this newcomer
  // with others, numbered by PolicyState::cohorts; 0: none. Its cohort joins together
  // (DriverOptions::newcomer_window) and counts one reset (Policy::PayCohortsOf).
  int64_t cohort = 0;
  bool rescued = false;   // removed, then kept as a member for the state it holds
  TimePoint lost_at = TimePoint::max();  // Watch broke; lost unless it exits by then
  int watches = 0;                       // Watch streams open from the slot's process
  int stale_closes = 0;  // closes still to come from the streams of an earlier process
  int64_t round = -1;    // the round it is in (formed member, or launched for)
  int rank = -1;         // its rank there (planned until that round forms)
  int64_t pid = 0;
  int64_t step = -1;          // of its newest commit
  int64_t version = 0;        // of the state it says it holds (its newest commit report)
  TimePoint commit_at{};      // when its newest commit report came
  int64_t logged_round = -1;  // the round of its last `committed` event
  // From its newest report of any kind (a heartbeat comes every second).
  TimePoint heard_at{};
  TimePoint launched_at{};  // when its current process was started
  TimePoint moved_at{};     // when its count of collectives last changed
  int64_t heard_round = -1;
  int64_t collectives = 0;
  bool in_collective = false;
  int stack_signal = 0;
  int64_t epoch = -1, cursor = -1, samples = -1, epoch_size = -1;
  double rate = 0;  // steps per second, between its last two commit reports
  // Its program reported a failure of its own (an exception in user code) in this round,
  // with this message (-1: none since it started).
  int64_t failed_round = -1;
  std::string failure;
  bool exit_hung = false;  // killed for not exiting after its peers finished
  // Its process exited with a code of its own (1-127, not a signal) before it was ever heard
  // from: the program failed before it could connect (an import error, a bad argument).
  bool start_failed = false;
  // Straggler detection (driver/stragglers.h): where its current sub-window began (round,
  // step, and its compute and wait sums then; round -1: none), its compute and wait per
  // step in the last sub-window closed (-1: none in this round), the streaks of slow and fast
  // sub-windows, and whether it is named a straggler now.
  int64_t window_round = -1, window_step = -1;
  double window_compute = 0, window_wait = 0;
  double step_compute = -1, step_wait = -1;
  int slow_windows = 0, fast_windows = 0;
  bool straggler = false;
  // A straggler replaced or dropped (--straggler-action): its slot is planned for no one,
  // and gets no new process, until then.
  TimePoint evicted_until{};
};

struct PolicyState {
  discovery::HostTable::State hosts;
  std::map<std::string, WorkerState> workers;  // by slot
  std::vector<std::string> members;            // newest proposed round, rank order
  int64_t round = -1;                          // newest proposed round
  int64_t formed = -1;                         // newest formed round
  std::vector<std::string> formed_members;
  std::vector<std::string> failure_order;         // slots, in the order their failure reports came
  std::set<std::string> kept;                     // StateKeepers() at the newest re-plan
  int64_t aborted = -1;                           // newest formed round whose members got ABORT
  int64_t withdrawn = -1;                         // newest proposed round withdrawn
  std::map<std::string, int64_t> incident_round;  // host -> round of its last counted failure
  int resets = 0, failures = 0;
  int spare_failures = 0;         // spares that exited before taking a place
  TimePoint formed_at{};          // when the newest formed round formed
  TimePoint next_progress{};      // next progress line (after the first round forms)
  int64_t progress_samples = -1;  // samples at the last progress line
  int64_t progress_step = -1;
  TimePoint progress_at{};
  Duration longest_interval{0};  // between two commits of a worker, per step
  bool finishing = false;
  std::string finisher;      // the first member that finished
  TimePoint finishing_at{};  // when it did: the others must exit within the hang timeout
  bool shutting_down = false;
  int exit_code = 0;
  std::string final_message;
  TimePoint kill_at = TimePoint::max();
  TimePoint wait_until = TimePoint::max();
  int64_t cohorts = 0;                      // newcomer cohorts started so far
  int64_t resumed_version = -1;  // the checkpoint a new job resumed from (-1: none)
  TimePoint gather_until = TimePoint::max();  // a ready newcomer waits for its cohort until
  TimePoint recovery_start{};
  bool recovering = false;
  bool round_broken = false;
  bool first_commit_logged = true;
  bool started = false;  // some round formed
  // A round formed without any commit after commits were made (state lost), with
  // --checkpoint-dir: its rank 0 restores a checkpoint; what was committed before. A round
  // that supersedes it before the restore, with no commit either, takes the restore over
  // (restore_round moves on); lost_round stays the round the state was lost in.
  int64_t restore_round = -1, lost_committed = 0, lost_round = -1;
  int64_t checkpoint_version = -1, checkpoint_step = -1, checkpoint_failures = 0;
  double checkpoint_seconds = 0;
  std::string checkpoint_path, checkpoint_error;
  std::vector<discovery::HostSlots> last_listed;
  std::vector<std::string> last_listed_order;
  int64_t stragglers = 0;  // workers named stragglers, over the job
  TimePoint evicted_at{};  // when a straggler was last replaced or dropped
};

// The state as one JSON object. Time points are saved as offsets from `now` (the steady clock
// means nothing in another process): LoadPolicyState puts them at the same distance from its
// own `now`. TimePoint{} (never) and TimePoint::max() (no deadline) keep their meaning.
std::string SavePolicyState(const PolicyState& state, TimePoint now);
// INVALID_ARGUMENT naming the field when the text is not a state SavePolicyState wrote (not
// JSON, a field missing or of the wrong type, a count out of bounds, a host table that does
// not hold together).
StatusOr<PolicyState> LoadPolicyState(const std::string& text, TimePoint now);

}  // namespace elastic::driver
