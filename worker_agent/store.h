// Key-value access to one round's scope (the communicator publishes and fetches addresses
// through it).
#pragma once

#include <memory>
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
  // Set(key, value), then Get(keys, timeout); over the network, one call.
  virtual StatusOr<std::vector<std::string>> SetAndGet(const std::string& key,
                                                       const std::string& value,
                                                       const std::vector<std::string>& keys,
                                                       Duration timeout) {
    RETURN_IF_ERROR(Set(key, value));
    return Get(keys, timeout);
  }
};

// Over the rendezvous gRPC client (a real worker).
std::unique_ptr<RoundStore> MakeRpcRoundStore(rendezvous::Client* client, int64_t round);
// Over an in-process rendezvous Core (ranks as threads in tests and benchmarks).
std::unique_ptr<RoundStore> MakeCoreRoundStore(rendezvous::Core* core, int64_t round);

}  // namespace elastic::worker_agent
