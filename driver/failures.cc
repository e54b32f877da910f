// Failure accounting's rules (driver/failures.h).
#include "driver/failures.h"

#include <algorithm>

namespace elastic::driver {

const WorkerState* EveryMemberFailed(const PolicyState& s) {
  if (s.formed < 0 || s.formed_members.empty()) return nullptr;
  for (const auto& slot : s.formed_members) {
    auto it = s.workers.find(slot);
    if (it == s.workers.end() || it->second.failed_round != s.formed) return nullptr;
  }
  for (const auto& slot : s.failure_order) {
    auto it = s.workers.find(slot);
    if (it != s.workers.end() && it->second.failed_round == s.formed &&
        std::find(s.formed_members.begin(), s.formed_members.end(), slot) !=
            s.formed_members.end()) {
      return &it->second;
    }
  }
  return nullptr;
}

int EveryStartFailed(const PolicyState& s) {
  if (s.started) return 0;
  int failed = 0;
  for (const auto& [slot, w] : s.workers) {
    if (w.running) return 0;                     // one may still start
    if (w.launched_at == TimePoint{}) continue;  // never launched
    if (!w.start_failed) return 0;
    ++failed;
  }
  return failed;
}

bool NewIncident(const PolicyState& s, const std::string& host, int64_t round) {
  auto it = s.incident_round.find(host);
  return it == s.incident_round.end() || round > it->second;
}

}  // namespace elastic::driver
