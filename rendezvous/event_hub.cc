#include "rendezvous/event_hub.h"

#include <vector>

#include "common/mutex.h"

namespace elastic::rendezvous {

StatusOr<uint64_t> EventHub::Subscribe(const std::string& slot, Handler handler) {
  MutexLock g(mu_);
  if (closed_) return Unavailable("the job is shutting down");
  size_t& count = per_slot_[slot];
  if (count >= max_per_slot_) {
    return ResourceExhausted("slot '" + slot + "' already has " + std::to_string(count) +
                             " watchers");
  }
  ++count;
  uint64_t id = next_id_++;
  // The newest abort first when a later event followed it (it is older): a worker whose
  // stream was down when its round was aborted must still leave that round.
  auto abort = last_abort_.find(slot);
  auto it = last_event_.find(slot);
  if (abort != last_abort_.end() && (it == last_event_.end() || it->second.seq != abort->second.seq)) {
    handler(abort->second.event);
  }
  if (it != last_event_.end()) handler(it->second.event);
  subs_.emplace(id, Sub{slot, std::move(handler)});
  return id;
}

void EventHub::Unsubscribe(uint64_t id) {
  MutexLock g(mu_);
  auto it = subs_.find(id);
  if (it == subs_.end()) return;
  auto count = per_slot_.find(it->second.slot);
  if (count != per_slot_.end() && --count->second == 0) per_slot_.erase(count);
  subs_.erase(it);
}

void EventHub::Publish(const std::string& slot, const Event& event) {
  MutexLock g(mu_);
  if (closed_) return;
  Remember(slot, event);
  for (auto& [id, sub] : subs_) {
    if (sub.slot == slot) sub.handler(event);
  }
}

void EventHub::PublishAll(const Event& event) {
  MutexLock g(mu_);
  if (closed_) return;
  for (auto& [id, sub] : subs_) {
    Remember(sub.slot, event);
    sub.handler(event);
  }
}

void EventHub::Remember(const std::string& slot, const Event& event) {
  Kept kept{event, next_seq_++};
  if (event.kind == EventKind::kAbort) last_abort_[slot] = kept;
  last_event_[slot] = std::move(kept);
}

void EventHub::Close() {
  MutexLock g(mu_);
  if (closed_) return;
  closed_ = true;
  Event shutdown{EventKind::kShutdown, -1, "the job is shutting down"};
  for (auto& [id, sub] : subs_) sub.handler(shutdown);
}

size_t EventHub::watcher_count() const {
  MutexLock g(mu_);
  return subs_.size();
}

}  // namespace elastic::rendezvous
