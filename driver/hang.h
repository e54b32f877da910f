// Hang detection, on the policy's state (driver/policy_state.h): when the formed round has made
// no progress for too long, and which members hold it up. Pure: Policy::CheckHang
// (driver/policy_hang.cc) asks, then logs, aborts and kills; tests/driver/hang_test.cc checks
// the rules on state values alone.
#pragma once

#include <string>
#include <vector>

#include "common/clock.h"
#include "driver/policy_state.h"

namespace elastic::driver {

// A member with no report for this long is silent (heartbeats come every second).
inline constexpr Duration kSilence = std::chrono::seconds(2);

// --hang-timeout when given (> 0); else 10x the longest time a worker took between two
// commits (per step), at least 60 s; 300 s before any was seen.
Duration HangTimeout(Duration configured, Duration longest_interval);

// The formed round's progress: its last commit or collective started (or its forming), and
// how long it may go without (the hang timeout, doubled before its first commit).
struct RoundProgress {
  TimePoint at{};
  bool committed = false;
  Duration limit{};
};
RoundProgress ProgressOf(const PolicyState& s, Duration hang_timeout);

struct HangVerdict {
  enum Kind {
    kNone,       // progress within the limit (or no round to watch)
    kWaiting,    // past the limit, no member stands out yet: a stopped one soon goes silent
    kRoundHung,  // past the limit and 3 s more, nobody stands out: the whole round is stuck
    kCulprits,   // these members hold it up
  };
  Kind kind = kNone;
  std::vector<std::string> culprits;  // slots, in formed_members' order (kCulprits)
  std::string why;                    // what the culprits do ("is silent (...)")
  RoundProgress progress;
  Duration stalled{};  // now - progress.at
};

// Who holds up the formed round at `now`: members gone silent; else members not in a
// collective while others wait in one; else members that started fewer collectives than the
// most any did. kNone while the job is not training in a formed round.
HangVerdict FindHang(const PolicyState& s, TimePoint now, Duration hang_timeout);

}  // namespace elastic::driver
