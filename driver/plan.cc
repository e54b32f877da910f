#include "driver/plan.h"

#include <algorithm>
#include <cstdint>

namespace elastic::driver {

bool SlotListed(const std::vector<discovery::HostSlots>& listed, const std::string& slot) {
  Slot s = Slot::Parse(slot);
  return std::any_of(listed.begin(), listed.end(),
                     [&](const auto& h) { return h.host == s.host && s.index < h.slots; });
}

std::vector<std::string> PlanMembers(const PlanInput& in) {
  std::vector<std::string> kept, survivors, spares, fresh;
  for (const auto& slot : in.keep) {
    if (in.alive.count(slot) && !in.evicted.count(slot)) kept.push_back(slot);
  }
  // A running spare is used like a survivor: blacklisting its host stops new launches only.
  for (const auto& slot : in.alive) {
    if (SlotListed(in.listed, slot) && !in.keep.count(slot) && !in.evicted.count(slot)) {
      survivors.push_back(slot);
    }
  }
  // A spare that does not answer (stopped or hung before it took a place, or not yet
  // connected) would hold a round until the rendezvous timeout: a new process goes first.
  std::vector<std::string> silent_spares;
  for (const auto& slot : in.spares) {
    if (SlotListed(in.listed, slot) && !in.evicted.count(slot)) {
      (in.silent.count(slot) ? silent_spares : spares).push_back(slot);
    }
  }
  for (const auto& h : in.available) {
    for (int i = 0; i < h.slots; ++i) {
      std::string slot = Slot{h.host, i}.ToString();
      if (!in.alive.count(slot) && !in.busy.count(slot) && !in.spares.count(slot) &&
          !in.evicted.count(slot)) {
        fresh.push_back(slot);
      }
    }
  }
  auto key = [&](const std::string& slot) {
    Slot s = Slot::Parse(slot);
    size_t pos =
        std::find(in.host_order.begin(), in.host_order.end(), s.host) - in.host_order.begin();
    return std::make_pair(pos, s.index);
  };
  auto by_key = [&](const std::string& a, const std::string& b) { return key(a) < key(b); };
  // Holders of the newest commit first (the cap must not leave out the state's only copy),
  // those that answer before silent ones (a silent holder may be lost a moment later).
  std::sort(survivors.begin(), survivors.end(), [&](const std::string& a, const std::string& b) {
    bool ha = in.holders.count(a) > 0, hb = in.holders.count(b) > 0;
    if (ha != hb) return ha;
    bool sa = in.silent.count(a) > 0, sb = in.silent.count(b) > 0;
    return sa != sb ? sb : key(a) < key(b);
  });
  std::sort(spares.begin(), spares.end(), by_key);
  std::sort(silent_spares.begin(), silent_spares.end(), by_key);
  std::sort(fresh.begin(), fresh.end(), by_key);
  size_t cap = in.max_np > 0 ? in.max_np : SIZE_MAX;
  if (in.reserve > 0) {
    // A listed slot whose process is still going away is the job's too: not counting it
    // would shrink the job again at every re-plan while one leaves.
    size_t going = 0;
    for (const auto& slot : in.busy) {
      if (SlotListed(in.available, slot)) ++going;
    }
    size_t slots = kept.size() + survivors.size() + spares.size() + silent_spares.size() +
                   fresh.size() + going;
    size_t floor = std::min(in.need, slots);
    cap = std::min(cap, std::max(floor, slots > in.reserve ? slots - in.reserve : 0));
  }
  std::vector<std::string> plan;
  for (const auto* group : {&kept, &survivors, &spares, &fresh, &silent_spares}) {
    for (const auto& s : *group) {
      if (plan.size() < cap) plan.push_back(s);
    }
  }
  std::sort(plan.begin(), plan.end(), by_key);
  return plan;
}

}  // namespace elastic::driver
