// Warm spares (elastic-run --spares), on the policy's state (driver/policy_state.h): which
// running spares must go (their slot is no longer listed) and which free slots get a new one.
// Pure: Policy::TopUpSpares (driver/policy.cc) signals and launches what it says;
// tests/driver/spares_test.cc checks it on state values.
#pragma once

#include <string>
#include <vector>

#include "common/clock.h"
#include "discovery/discovery.h"
#include "driver/policy_state.h"

namespace elastic::driver {

struct SparePlan {
  std::vector<std::string> stop;   // running spares whose slot is no longer listed
  std::vector<std::string> start;  // free slots to start a spare in, in host order
};

// With `want` spares (--spares): the spares waiting for a place (newcomers, which wait for a
// place of their own, do not count) are topped up from the slots of `available` that are in
// no one's `plan`, run no process and are not evicted at `now`. `listed`: the slots discovery
// lists now. None is started once more spares failed than `want` + 2 (they keep failing).
SparePlan PlanSpares(const PolicyState& s, const std::vector<discovery::HostSlots>& listed,
                     const std::vector<discovery::HostSlots>& available,
                     const std::vector<std::string>& plan, int want, TimePoint now);

}  // namespace elastic::driver
