// Key-value access to one round's scope, and the Gloo Store adapter over it.
#pragma once

#include <gloo/rendezvous/store.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"
#include "rendezvous/rendezvous.h"

namespace elastic::worker_agent {

// One round's keys. Implementations are thread-safe.
class RoundStore {
 public:
  virtual ~RoundStore() = default;
  virtual Status Set(const std::string& key, const std::string& value) = 0;
  // Waits up to `timeout` for all keys; values in key order.
  virtual StatusOr<std::vector<std::string>> Get(const std::vector<std::string>& keys,
                                                 Duration timeout) = 0;
};

// Over the rendezvous gRPC client (a real worker).
std::unique_ptr<RoundStore> MakeRpcRoundStore(rendezvous::Client* client, int64_t round);
// Over an in-process rendezvous Core (ranks as threads in tests and benchmarks).
std::unique_ptr<RoundStore> MakeCoreRoundStore(rendezvous::Core* core, int64_t round);

// gloo::rendezvous::Store over a RoundStore. wait() of many keys is one Get whose values are
// cached for the get()s that follow; get() of a key that was never waited for waits itself
// (Gloo's connectFullMesh relies on that). `prefetch` keys, when given, are fetched together
// on the first wait or get of any of them, so a full-mesh set-up costs one Get per rank.
// Failures throw gloo::IoException with the Status text (Gloo's own convention).
class GlooStore : public gloo::rendezvous::Store {
 public:
  GlooStore(RoundStore* store, Duration timeout, std::vector<std::string> prefetch = {});
  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

 private:
  void Fetch(std::vector<std::string> keys, Duration timeout);
  RoundStore* store_;
  Duration timeout_;
  std::vector<std::string> prefetch_;
  std::mutex mu_;
  std::map<std::string, std::vector<char>> cache_;  // guarded by mu_
  bool prefetched_ = false;                         // guarded by mu_
};

}  // namespace elastic::worker_agent
