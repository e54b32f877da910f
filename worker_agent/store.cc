#include "worker_agent/store.h"

#include <gloo/common/error.h>

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

GlooStore::GlooStore(RoundStore* store, Duration timeout, std::vector<std::string> prefetch)
    : store_(store), timeout_(timeout), prefetch_(std::move(prefetch)) {}

void GlooStore::set(const std::string& key, const std::vector<char>& data) {
  Status s = store_->Set(key, std::string(data.begin(), data.end()));
  if (!s.ok()) throw gloo::IoException("store set '" + key + "': " + s.ToString());
}

void GlooStore::Fetch(std::vector<std::string> keys, Duration timeout) {
  {
    std::lock_guard<std::mutex> g(mu_);
    bool want_prefetch =
        !prefetched_ && !prefetch_.empty() &&
        std::any_of(keys.begin(), keys.end(), [&](const std::string& k) {
          return std::find(prefetch_.begin(), prefetch_.end(), k) != prefetch_.end();
        });
    if (want_prefetch) {
      prefetched_ = true;
      for (const auto& k : prefetch_) {
        if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
      }
    }
    keys.erase(std::remove_if(keys.begin(), keys.end(),
                              [&](const std::string& k) { return cache_.count(k) > 0; }),
               keys.end());
  }
  if (keys.empty()) return;
  auto values = store_->Get(keys, timeout);
  if (!values.ok()) throw gloo::IoException("store wait: " + values.status().ToString());
  std::lock_guard<std::mutex> g(mu_);
  for (size_t i = 0; i < keys.size(); ++i) {
    cache_[keys[i]] = std::vector<char>((*values)[i].begin(), (*values)[i].end());
  }
}

std::vector<char> GlooStore::get(const std::string& key) {
  Fetch({key}, timeout_);
  std::lock_guard<std::mutex> g(mu_);
  return cache_.at(key);
}

void GlooStore::wait(const std::vector<std::string>& keys) { Fetch(keys, timeout_); }

void GlooStore::wait(const std::vector<std::string>& keys,
                     const std::chrono::milliseconds& timeout) {
  Fetch(keys, timeout);
}

}  // namespace elastic::worker_agent
