// Failure accounting's rules, on the policy's state (driver/policy_state.h): when failures end
// the job instead of a relaunch, and which failures of a host are one incident. Pure:
// driver/policy_failures.cc asks, then ends the job or charges the host (the blacklist is the
// host table's, discovery/discovery.h); tests/driver/failures_test.cc checks them on state values.
#pragma once

#include <string>

#include "driver/policy_state.h"

namespace elastic::driver {

// When every member of the formed round reported a failure of its own there (the same error
// in user code on every rank: relaunching would fail the same way), the first of them to
// report it; else null.
const WorkerState* EveryMemberFailed(const PolicyState& s);

// When no round ever formed, no worker runs, and every worker launched so far exited with a
// code of its own before it was heard from (the program fails before it connects), how many
// did; else 0.
int EveryStartFailed(const PolicyState& s);

// Whether a failure of `host` in `round` starts a new incident: every failure of a host's
// workers in one round is one incident, charged to the host once.
bool NewIncident(const PolicyState& s, const std::string& host, int64_t round);

// Whether `failures` exceed --max-failures (`max_failures` < 0: no limit).
inline bool OverFailureBudget(int failures, int max_failures) {
  return max_failures >= 0 && failures > max_failures;
}

}  // namespace elastic::driver
