#include "worker_agent/store.h"

#include <algorithm>

namespace elastic::worker_agent {
namespace {

class RpcRoundStore : public RoundStore {
 public:
  RpcRoundStore(rendezvous::Client* client, int64_t round) : client_(client), round_(round) {}
  Status Set(const std::string& key, const std::string& value) override {
    return client_->Set(round_, key, value);
  }
  StatusOr<std::vector<std::string>> Get(const std::vector<std::string>& keys,
                                         Duration timeout) override {
    return client_->Get(round_, keys, timeout);
  }
  StatusOr<std::vector<std::string>> SetAndGet(const std::string& key, const std::string& value,
                                               const std::vector<std::string>& keys,
                                               Duration timeout) override {
    return client_->SetAndGet(round_, key, value, keys, timeout);
  }

 private:
  rendezvous::Client* client_;
  int64_t round_;
};

class CoreRoundStore : public RoundStore {
 public:
  CoreRoundStore(rendezvous::Core* core, int64_t round) : core_(core), round_(round) {}
  Status Set(const std::string& key, const std::string& value) override {
    return core_->Set(round_, key, value);
  }
  StatusOr<std::vector<std::string>> Get(const std::vector<std::string>& keys,
                                         Duration timeout) override {
    auto v = core_->Get(round_, keys, core_->clock()->Now() + timeout);
    if (!v.ok()) return v.status();
    std::vector<std::string> out;
    out.reserve(v->size());
    for (const auto& p : *v) out.push_back(*p);
    return out;
  }

 private:
  rendezvous::Core* core_;
  int64_t round_;
};

}  // namespace

std::unique_ptr<RoundStore> MakeRpcRoundStore(rendezvous::Client* client, int64_t round) {
  return std::make_unique<RpcRoundStore>(client, round);
}

std::unique_ptr<RoundStore> MakeCoreRoundStore(rendezvous::Core* core, int64_t round) {
  return std::make_unique<CoreRoundStore>(core, round);
}

}  // namespace elastic::worker_agent
