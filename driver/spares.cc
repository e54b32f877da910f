// Warm spares' rule (driver/spares.h).
#include "driver/spares.h"

#include <algorithm>

#include "driver/plan.h"
#include "rendezvous/types.h"

namespace elastic::driver {

SparePlan PlanSpares(const PolicyState& s, const std::vector<discovery::HostSlots>& listed,
                     const std::vector<discovery::HostSlots>& available,
                     const std::vector<std::string>& plan, int want, TimePoint now) {
  SparePlan out;
  int have = 0;
  for (const auto& [slot, w] : s.workers) {
    if (!w.running || !w.spare || w.dropped || w.removed) continue;
    if (!SlotListed(listed, slot)) {
      out.stop.push_back(slot);
      continue;
    }
    if (!w.joiner) ++have;  // a newcomer waits for a place of its own
  }
  if (want <= 0 || s.spare_failures > want + 2) return out;
  for (const auto& h : available) {
    for (int i = 0; i < h.slots && have < want; ++i) {
      std::string slot = rendezvous::Slot{h.host, i}.ToString();
      if (std::find(plan.begin(), plan.end(), slot) != plan.end()) continue;
      auto it = s.workers.find(slot);
      if (it != s.workers.end() && (it->second.running || it->second.evicted_until > now)) {
        continue;
      }
      out.start.push_back(slot);
      ++have;
    }
  }
  return out;
}

}  // namespace elastic::driver
