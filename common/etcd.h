// A small client of etcd v3 (3.4 and later) through its JSON gateway (/v3/...): the calls the
// driver's leadership and journal need (docs/high-availability.md), and the one lookup a worker
// makes to find the driver that leads its job. It holds no connection between calls; each call
// tries the endpoints in turn, starting with the one that answered last, within its deadline.
// Thread-safe.
//
// Keys are given relative to the URL's prefix: Get("leader") reads PREFIX/leader.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/clock.h"
#include "common/mutex.h"
#include "common/status.h"
#include "common/tls.h"

namespace httplib {
enum class Error;
}

namespace elastic {

struct EtcdUrl {
  std::vector<std::string> endpoints;  // host:port
  std::string prefix;                  // "/elastic-run/job1": no trailing '/'
  std::string text;                    // as given
  // etcds://: HTTPS, the server's certificate verified (for the endpoint's host name or
  // address) against tls.ca, or the system's CAs when it is empty; tls.cert and tls.key, when
  // given, are the client certificate etcd's --client-cert-auth asks for.
  bool secure = false;
  TlsIdentity tls;
};

// etcd://HOST:PORT[,HOST:PORT...]/PREFIX, or etcds://... INVALID_ARGUMENT saying what is wrong
// with it.
StatusOr<EtcdUrl> ParseEtcdUrl(const std::string& url);

// RFC 4648 base64 (etcd's JSON carries keys and values so); Base64Decode fails on bad input.
std::string Base64Encode(const std::string& bytes);
StatusOr<std::string> Base64Decode(const std::string& text);

// What a transport failure of an etcd call likely means, for the user: " (...)" naming the
// flag to check, or "" when there is nothing to add. `secure` is EtcdUrl::secure.
std::string EtcdTransportHint(httplib::Error error, bool secure);

class Etcd {
 public:
  explicit Etcd(EtcdUrl url, Duration call_timeout = std::chrono::seconds(2));

  struct Kv {
    std::string value;
    int64_t create_revision = 0, mod_revision = 0, lease = 0;
  };
  // One write of a transaction: a put (with a lease when lease != 0) or, with erase, a delete.
  struct Write {
    std::string key, value;
    int64_t lease = 0;
    bool erase = false;
  };

  // A lease of `ttl_seconds`; its id.
  StatusOr<int64_t> Grant(int64_t ttl_seconds);
  // Renews it; the seconds it has left, 0 when it is gone (expired or revoked).
  StatusOr<int64_t> KeepAlive(int64_t lease);
  Status Revoke(int64_t lease);
  // The whole seconds a lease has left, without renewing it; -1 (or 0) when it is gone.
  StatusOr<int64_t> TimeToLive(int64_t lease);

  // The key's value, nullopt when it does not exist. `revision` (if given) gets the store's
  // revision at the read.
  StatusOr<std::optional<Kv>> Get(const std::string& key, int64_t* revision = nullptr);
  // The writes, atomically, only if `key` does not exist; whether they were made.
  StatusOr<bool> WriteIfAbsent(const std::string& key, const std::vector<Write>& writes);
  // The writes, atomically, only if `key` exists and holds `value`; whether they were made.
  StatusOr<bool> WriteIfHolds(const std::string& key, const std::string& value,
                              const std::vector<Write>& writes);
  // `lease` != 0: the key lives as long as that lease.
  Status Put(const std::string& key, const std::string& value, int64_t lease = 0);
  Status Delete(const std::string& key);
  // The keys that start with `key_prefix` (relative, as Get's), with their values, in key
  // order: at most `limit` (> 0) of them (etcd's own limit; the rest are not read).
  StatusOr<std::vector<std::pair<std::string, Kv>>> List(const std::string& key_prefix,
                                                          int64_t limit);

  const EtcdUrl& url() const { return url_; }

 private:
  // POSTs `body` to `path` on an endpoint; the response's JSON text.
  StatusOr<std::string> Call(const std::string& path, const std::string& body);
  StatusOr<bool> Txn(const std::string& compare, const std::vector<Write>& writes);
  std::string Key(const std::string& key) const { return url_.prefix + "/" + key; }

  // etcds://: the URL's CA, certificate and key, parsed once (or why they could not be).
  struct Tls;
  EtcdUrl url_;
  std::shared_ptr<const Tls> tls_;
  Duration timeout_;
  Mutex mu_;
  size_t good_ ELASTIC_GUARDED_BY(mu_) = 0;  // the endpoint that answered last
};

}  // namespace elastic
