// EventHub: fan-out of driver events to the Watch streams of workers, per slot.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "common/mutex.h"
#include "common/status.h"
#include "rendezvous/types.h"

namespace elastic::rendezvous {

class EventHub {
 public:
  using Handler = std::function<void(const Event&)>;
  explicit EventHub(size_t max_watchers_per_slot) : max_per_slot_(max_watchers_per_slot) {}

  // Registers `handler` for events of `slot`. The last event sent to the slot (if any) is
  // replayed to it at once, so a watcher that connects late still learns of a pending fence;
  // before it, the newest ABORT sent to the slot when another event came after it (a worker
  // whose stream was down when its round was aborted, then fenced, must still leave it).
  // Returns a subscription id, or RESOURCE_EXHAUSTED when the slot has too many watchers,
  // or UNAVAILABLE after Close(). Handlers run with the hub's lock held: they must be quick
  // and must not call back into the hub.
  StatusOr<uint64_t> Subscribe(const std::string& slot, Handler handler);
  // After Unsubscribe returns, the handler is not running and will not run again.
  void Unsubscribe(uint64_t id);
  void Publish(const std::string& slot, const Event& event);
  void PublishAll(const Event& event);
  // Sends SHUTDOWN to everyone and refuses new subscriptions.
  void Close();
  size_t watcher_count() const;

 private:
  struct Sub {
    std::string slot;
    Handler handler;
  };
  const size_t max_per_slot_;
  mutable Mutex mu_;
  bool closed_ ELASTIC_GUARDED_BY(mu_) = false;
  uint64_t next_id_ ELASTIC_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, Sub> subs_ ELASTIC_GUARDED_BY(mu_);
  std::unordered_map<std::string, size_t> per_slot_ ELASTIC_GUARDED_BY(mu_);
  struct Kept {
    Event event;
    uint64_t seq = 0;  // publish order
  };
  // Keeps `event` as the slot's last (and its last abort); with mu_ held.
  void Remember(const std::string& slot, const Event& event) ELASTIC_REQUIRES(mu_);
  uint64_t next_seq_ ELASTIC_GUARDED_BY(mu_) = 1;
  std::unordered_map<std::string, Kept> last_event_ ELASTIC_GUARDED_BY(mu_);
  std::unordered_map<std::string, Kept> last_abort_ ELASTIC_GUARDED_BY(mu_);
};

}  // namespace elastic::rendezvous
