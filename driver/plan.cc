#include "driver/plan.h"

#include <algorithm>
#include <cstdint>

namespace elastic::driver {

std::pair<std::string, int> SplitSlot(const std::string& slot) {
  size_t colon = slot.rfind(':');
  if (colon == std::string::npos) return {slot, 0};
  return {slot.substr(0, colon), std::atoi(slot.c_str() + colon + 1)};
}

std::vector<std::string> PlanMembers(const PlanInput& in) {
  std::vector<std::string> survivors, fresh;
  for (const auto& slot : in.alive) {
    auto [host, index] = SplitSlot(slot);
    bool still_listed = std::any_of(in.listed.begin(), in.listed.end(), [&](const auto& h) {
      return h.host == host && index < h.slots;
    });
    if (still_listed) survivors.push_back(slot);
  }
  for (const auto& h : in.available) {
    for (int i = 0; i < h.slots; ++i) {
      std::string slot = h.host + ":" + std::to_string(i);
      if (!in.alive.count(slot) && !in.busy.count(slot)) fresh.push_back(slot);
    }
  }
  auto key = [&](const std::string& slot) {
    auto [host, index] = SplitSlot(slot);
    size_t pos =
        std::find(in.host_order.begin(), in.host_order.end(), host) - in.host_order.begin();
    return std::make_pair(pos, index);
  };
  auto by_key = [&](const std::string& a, const std::string& b) { return key(a) < key(b); };
  std::sort(survivors.begin(), survivors.end(), by_key);
  std::sort(fresh.begin(), fresh.end(), by_key);
  size_t cap = in.max_np > 0 ? in.max_np : SIZE_MAX;
  std::vector<std::string> plan;
  for (const auto* group : {&survivors, &fresh}) {
    for (const auto& s : *group) {
      if (plan.size() < cap) plan.push_back(s);
    }
  }
  std::sort(plan.begin(), plan.end(), by_key);
  for (size_t i = 0; i < plan.size(); ++i) {
    if (in.holders.count(plan[i])) {
      std::rotate(plan.begin(), plan.begin() + static_cast<long>(i),
                  plan.begin() + static_cast<long>(i) + 1);
      break;
    }
  }
  return plan;
}

std::map<std::string, rendezvous::Assignment> AssignRanks(const std::vector<std::string>& members,
                                                          bool sync_required) {
  std::vector<std::string> hosts;
  std::map<std::string, int> local_count;
  for (const auto& s : members) {
    std::string host = SplitSlot(s).first;
    if (!local_count.count(host)) hosts.push_back(host);
    ++local_count[host];
  }
  std::map<std::string, int> local_next;
  std::map<std::string, rendezvous::Assignment> out;
  for (size_t r = 0; r < members.size(); ++r) {
    std::string host = SplitSlot(members[r]).first;
    rendezvous::Assignment a;
    a.rank = static_cast<int>(r);
    a.size = static_cast<int>(members.size());
    a.local_rank = local_next[host]++;
    a.local_size = local_count[host];
    a.cross_rank = static_cast<int>(std::find(hosts.begin(), hosts.end(), host) - hosts.begin());
    a.cross_size = static_cast<int>(hosts.size());
    a.sync_required = sync_required;
    out[members[r]] = a;
  }
  return out;
}

}  // namespace elastic::driver
