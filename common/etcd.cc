// etcd v3 through its JSON gateway (common/etcd.h). etcd's gateway takes and gives proto3 JSON:
// bytes fields in base64, 64-bit integers as strings, fields at their default value left out.
#include "common/etcd.h"

#include <httplib.h>

// Debian's libcpp-httplib is built with these, and its classes' layout depends on them: compiled
// without, an httplib::Client is 8 bytes where the library writes 16 (common/CMakeLists.txt).
#if !defined(CPPHTTPLIB_OPENSSL_SUPPORT) || !defined(CPPHTTPLIB_ZLIB_SUPPORT)
#error "compile with cpp-httplib's pkg-config Cflags (-DCPPHTTPLIB_OPENSSL_SUPPORT ...)"
#endif

#include <nlohmann/json.hpp>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

namespace elastic {

using json = nlohmann::json;

namespace {

constexpr size_t kMaxUrl = 4096;
constexpr size_t kMaxEndpoints = 16;

int64_t Int(const json& j, const char* field) {
  auto it = j.find(field);
  if (it == j.end()) return 0;
  if (it->is_string()) return std::strtoll(it->get<std::string>().c_str(), nullptr, 10);
  if (it->is_number_integer()) return it->get<int64_t>();
  return 0;
}

}  // namespace

std::string EtcdTransportHint(httplib::Error e, bool secure) {
  switch (e) {
    case httplib::Error::SSLServerVerification:
      return " (etcd's certificate is not signed by the CA of --state-store-ca, or the "
             "system's CAs, or does not name this address)";
    case httplib::Error::SSLConnection:
      return " (the TLS handshake failed: is etcd serving HTTPS, and does it ask for a "
             "client certificate? --state-store-cert, --state-store-key)";
    case httplib::Error::Read:
    case httplib::Error::Write:  // TLS 1.3: a refused client certificate shows after the
                                 // handshake, as a reset on the request's write or read
      return secure ? " (etcd closed the connection: does it ask for a client certificate? "
                      "--state-store-cert, --state-store-key)"
                    : " (etcd closed the connection: does it serve HTTPS? give etcds://)";
    default:
      return "";
  }
}

StatusOr<EtcdUrl> ParseEtcdUrl(const std::string& url) {
  auto bad = [&](const std::string& why) {
    return InvalidArgument("--state-store " + url.substr(0, 200) + ": " + why +
                           " (give etcd://HOST:PORT[,HOST:PORT...]/PREFIX, e.g. "
                           "etcd://127.0.0.1:2379/elastic-run/myjob, or etcds://... for "
                           "etcd over TLS)");
  };
  if (url.size() > kMaxUrl) return bad("longer than 4096 characters");
  const bool secure = url.rfind("etcds://", 0) == 0;
  const std::string scheme = secure ? "etcds://" : "etcd://";
  if (url.rfind(scheme, 0) != 0) return bad("not an etcd:// or etcds:// URL");
  std::string rest = url.substr(scheme.size());
  size_t slash = rest.find('/');
  if (slash == std::string::npos) return bad("no /PREFIX after the endpoints");
  EtcdUrl out;
  out.text = url;
  out.secure = secure;
  out.prefix = rest.substr(slash);
  while (out.prefix.size() > 1 && out.prefix.back() == '/') out.prefix.pop_back();
  if (out.prefix == "/") return bad("the prefix is empty");
  for (char c : out.prefix) {
    if (c < 0x21 || c > 0x7e) return bad("the prefix holds a space or a control character");
  }
  std::string hosts = rest.substr(0, slash);
  size_t start = 0;
  while (start <= hosts.size()) {
    size_t comma = hosts.find(',', start);
    std::string ep = hosts.substr(start, comma == std::string::npos ? std::string::npos
                                                                    : comma - start);
    size_t colon = ep.rfind(':');
    if (ep.empty() || colon == std::string::npos || colon == 0 || colon + 1 == ep.size()) {
      return bad("endpoint '" + ep + "' is not HOST:PORT");
    }
    char* end = nullptr;
    long port = std::strtol(ep.c_str() + colon + 1, &end, 10);
    if (*end != '\0' || port <= 0 || port > 65535) return bad("endpoint '" + ep + "': bad port");
    out.endpoints.push_back(ep);
    if (out.endpoints.size() > kMaxEndpoints) return bad("more than 16 endpoints");
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

std::string Base64Encode(const std::string& in) {
  static const char* t = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8) | uint8_t(in[i + 2]);
    out += t[v >> 18];
    out += t[(v >> 12) & 63];
    out += t[(v >> 6) & 63];
    out += t[v & 63];
  }
  if (i + 1 == in.size()) {
    uint32_t v = uint8_t(in[i]) << 16;
    out += t[v >> 18];
    out += t[(v >> 12) & 63];
    out += "==";
  } else if (i + 2 == in.size()) {
    uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8);
    out += t[v >> 18];
    out += t[(v >> 12) & 63];
    out += t[(v >> 6) & 63];
    out += '=';
  }
  return out;
}

StatusOr<std::string> Base64Decode(const std::string& in) {
  auto val = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+' || c == '-') return 62;
    if (c == '/' || c == '_') return 63;
    return -1;
  };
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  size_t pad = 0;
  for (char c : in) {
    if (c == '=') {
      ++pad;
      continue;
    }
    int v = val(c);
    if (v < 0 || pad > 0) return InvalidArgument("not base64");
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xff);
    }
  }
  if (pad > 2) return InvalidArgument("not base64");
  return out;
}

struct Etcd::Tls {
  X509_STORE* ca = nullptr;  // null: the system's CAs
  X509* cert = nullptr;
  EVP_PKEY* key = nullptr;
  std::string error;  // why the PEM text could not be used; every call fails with it
  ~Tls() {
    X509_STORE_free(ca);
    X509_free(cert);
    EVP_PKEY_free(key);
  }
};

namespace {

// Every certificate of `pem` into a new store; null when there is none.
X509_STORE* StoreOf(const std::string& pem) {
  BIO* bio = BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size()));
  if (!bio) return nullptr;
  X509_STORE* store = X509_STORE_new();
  int added = 0;
  while (X509* cert = PEM_read_bio_X509(bio, nullptr, nullptr, nullptr)) {
    added += X509_STORE_add_cert(store, cert) == 1;
    X509_free(cert);
  }
  ERR_clear_error();  // the end of the text reads as an error
  BIO_free(bio);
  if (added == 0) {
    X509_STORE_free(store);
    return nullptr;
  }
  return store;
}

}  // namespace

Etcd::Etcd(EtcdUrl url, Duration call_timeout) : url_(std::move(url)), timeout_(call_timeout) {
  if (!url_.secure) return;
  auto tls = std::make_shared<Tls>();
  const TlsIdentity& id = url_.tls;
  if (!id.ca.empty() && !(tls->ca = StoreOf(id.ca))) {
    tls->error = "the etcd CA holds no PEM certificate";
  }
  if (!id.cert.empty() || !id.key.empty()) {
    BIO* c = BIO_new_mem_buf(id.cert.data(), static_cast<int>(id.cert.size()));
    BIO* k = BIO_new_mem_buf(id.key.data(), static_cast<int>(id.key.size()));
    tls->cert = c ? PEM_read_bio_X509(c, nullptr, nullptr, nullptr) : nullptr;
    tls->key = k ? PEM_read_bio_PrivateKey(k, nullptr, nullptr, nullptr) : nullptr;
    BIO_free(c);
    BIO_free(k);
    ERR_clear_error();
    if (!tls->cert || !tls->key) {
      tls->error = "the etcd client certificate and key must both be PEM (a certificate, and "
                   "its private key without a passphrase)";
    } else if (X509_check_private_key(tls->cert, tls->key) != 1) {
      ERR_clear_error();
      tls->error = "the etcd client key is not the key of its certificate";
    }
  }
  tls_ = std::move(tls);
}

StatusOr<std::string> Etcd::Call(const std::string& path, const std::string& body) {
  size_t first;
  {
    MutexLock g(mu_);
    first = good_;
  }
  if (tls_ && !tls_->error.empty()) return FailedPrecondition(url_.text + ": " + tls_->error);
  const auto seconds = std::chrono::duration_cast<std::chrono::microseconds>(timeout_).count();
  std::string errors;
  for (size_t i = 0; i < url_.endpoints.size(); ++i) {
    size_t at = (first + i) % url_.endpoints.size();
    const std::string& ep = url_.endpoints[at];
    size_t colon = ep.rfind(':');
    std::unique_ptr<httplib::ClientImpl> made;
    if (url_.secure) {
      auto ssl = std::make_unique<httplib::SSLClient>(ep.substr(0, colon),
                                                      std::atoi(ep.c_str() + colon + 1),
                                                      tls_->cert, tls_->key);
      if (tls_->ca) {
        X509_STORE_up_ref(tls_->ca);  // the client's context takes one reference
        ssl->set_ca_cert_store(tls_->ca);
      }
      ssl->enable_server_certificate_verification(true);
      made = std::move(ssl);
    } else {
      made = std::make_unique<httplib::ClientImpl>(ep.substr(0, colon),
                                                   std::atoi(ep.c_str() + colon + 1));
    }
    httplib::ClientImpl& cli = *made;
    cli.set_connection_timeout(seconds / 1000000, seconds % 1000000);
    cli.set_read_timeout(seconds / 1000000, seconds % 1000000);
    cli.set_write_timeout(seconds / 1000000, seconds % 1000000);
    auto res = cli.Post(path.c_str(), body, "application/json");
    if (!res) {
      errors += (errors.empty() ? "" : "; ") + ep + ": " + httplib::to_string(res.error()) +
                EtcdTransportHint(res.error(), url_.secure);
      continue;
    }
    if (res->status != 200) {
      // etcd answered: a refusal (a bad request, no leader yet) is its word, not a transport
      // failure; a member without a quorum answers 503, and another member may have one.
      std::string why = ep + ": HTTP " + std::to_string(res->status) + " " +
                        res->body.substr(0, 300);
      if (res->status >= 500) {
        errors += (errors.empty() ? "" : "; ") + why;
        continue;
      }
      return FailedPrecondition("etcd refused " + path + ": " + why);
    }
    {
      MutexLock g(mu_);
      good_ = at;
    }
    return res->body;
  }
  return Unavailable("no etcd endpoint of " + url_.text + " answered " + path + " (" + errors +
                     ")");
}

StatusOr<int64_t> Etcd::Grant(int64_t ttl) {
  ASSIGN_OR_RETURN(std::string body, Call("/v3/lease/grant", json{{"TTL", ttl}}.dump()));
  try {
    json j = json::parse(body);
    int64_t id = Int(j, "ID");
    if (id == 0) return Internal("etcd granted no lease: " + body.substr(0, 300));
    return id;
  } catch (const std::exception& e) {
    return Internal(std::string("etcd's lease grant: ") + e.what());
  }
}

StatusOr<int64_t> Etcd::KeepAlive(int64_t lease) {
  ASSIGN_OR_RETURN(std::string body,
                   Call("/v3/lease/keepalive", json{{"ID", std::to_string(lease)}}.dump()));
  try {
    json j = json::parse(body);
    if (!j.contains("result")) return Internal("etcd's keepalive: " + body.substr(0, 300));
    return Int(j["result"], "TTL");
  } catch (const std::exception& e) {
    return Internal(std::string("etcd's keepalive: ") + e.what());
  }
}

StatusOr<int64_t> Etcd::TimeToLive(int64_t lease) {
  ASSIGN_OR_RETURN(std::string body,
                   Call("/v3/lease/timetolive", json{{"ID", std::to_string(lease)}}.dump()));
  try {
    json j = json::parse(body);
    return Int(j, "TTL");  // 0 when etcd leaves the field out
  } catch (const std::exception& e) {
    return Internal(std::string("etcd's timetolive: ") + e.what());
  }
}

Status Etcd::Revoke(int64_t lease) {
  auto body = Call("/v3/lease/revoke", json{{"ID", std::to_string(lease)}}.dump());
  return body.ok() ? Status::Ok() : body.status();
}

namespace {
// One of a range's "kvs" (throws nlohmann's exceptions on a malformed one, as its callers
// catch).
StatusOr<Etcd::Kv> KvOf(const json& kv) {
  Etcd::Kv out;
  if (kv.contains("value")) {
    ASSIGN_OR_RETURN(out.value, Base64Decode(kv["value"].get<std::string>()));
  }
  out.create_revision = Int(kv, "create_revision");
  out.mod_revision = Int(kv, "mod_revision");
  out.lease = Int(kv, "lease");
  return out;
}
}  // namespace

StatusOr<std::optional<Etcd::Kv>> Etcd::Get(const std::string& key, int64_t* revision) {
  ASSIGN_OR_RETURN(std::string body,
                   Call("/v3/kv/range", json{{"key", Base64Encode(Key(key))}}.dump()));
  try {
    json j = json::parse(body);
    if (revision && j.contains("header")) *revision = Int(j["header"], "revision");
    if (!j.contains("kvs") || j["kvs"].empty()) return std::optional<Kv>();
    ASSIGN_OR_RETURN(Kv out, KvOf(j["kvs"][0]));
    return std::optional<Kv>(std::move(out));
  } catch (const std::exception& e) {
    return Internal(std::string("etcd's range: ") + e.what());
  }
}

StatusOr<bool> Etcd::Txn(const std::string& compare, const std::vector<Write>& writes) {
  json success = json::array();
  for (const auto& w : writes) {
    if (w.erase) {
      success.push_back({{"request_delete_range", {{"key", Base64Encode(Key(w.key))}}}});
    } else {
      json put = {{"key", Base64Encode(Key(w.key))}, {"value", Base64Encode(w.value)}};
      if (w.lease != 0) put["lease"] = std::to_string(w.lease);
      success.push_back({{"request_put", put}});
    }
  }
  json req = {{"compare", json::array({json::parse(compare)})}, {"success", success}};
  ASSIGN_OR_RETURN(std::string body, Call("/v3/kv/txn", req.dump()));
  try {
    json j = json::parse(body);
    return j.value("succeeded", false);
  } catch (const std::exception& e) {
    return Internal(std::string("etcd's txn: ") + e.what());
  }
}

StatusOr<bool> Etcd::WriteIfAbsent(const std::string& key, const std::vector<Write>& writes) {
  json c = {{"key", Base64Encode(Key(key))},
            {"result", "EQUAL"},
            {"target", "CREATE"},
            {"create_revision", "0"}};
  return Txn(c.dump(), writes);
}

StatusOr<bool> Etcd::WriteIfHolds(const std::string& key, const std::string& value,
                                  const std::vector<Write>& writes) {
  json c = {{"key", Base64Encode(Key(key))},
            {"result", "EQUAL"},
            {"target", "VALUE"},
            {"value", Base64Encode(value)}};
  return Txn(c.dump(), writes);
}

Status Etcd::Put(const std::string& key, const std::string& value, int64_t lease) {
  json put = {{"key", Base64Encode(Key(key))}, {"value", Base64Encode(value)}};
  if (lease != 0) put["lease"] = std::to_string(lease);
  auto body = Call("/v3/kv/put", put.dump());
  return body.ok() ? Status::Ok() : body.status();
}

StatusOr<std::vector<std::pair<std::string, Etcd::Kv>>> Etcd::List(const std::string& key_prefix,
                                                                  int64_t limit) {
  if (limit <= 0) return InvalidArgument("etcd: a listing's limit must be positive");
  // The range [prefix, prefix with its last byte one higher): every key that starts so.
  std::string from = Key(key_prefix), end = from;
  while (!end.empty() && static_cast<unsigned char>(end.back()) == 0xff) end.pop_back();
  if (end.empty()) return InvalidArgument("etcd: a key prefix of 0xff bytes alone");
  end.back() = static_cast<char>(static_cast<unsigned char>(end.back()) + 1);
  ASSIGN_OR_RETURN(std::string body,
                   Call("/v3/kv/range", json{{"key", Base64Encode(from)},
                                             {"range_end", Base64Encode(end)},
                                             {"limit", std::to_string(limit)}}
                                            .dump()));
  std::vector<std::pair<std::string, Kv>> out;
  try {
    json j = json::parse(body);
    if (!j.contains("kvs")) return out;
    const size_t strip = url_.prefix.size() + 1;
    for (const json& kv : j["kvs"]) {
      if (static_cast<int64_t>(out.size()) >= limit) break;
      ASSIGN_OR_RETURN(std::string key, Base64Decode(kv.value("key", std::string())));
      ASSIGN_OR_RETURN(Kv v, KvOf(kv));
      out.emplace_back(key.size() >= strip ? key.substr(strip) : key, std::move(v));
    }
  } catch (const std::exception& e) {
    return Internal(std::string("etcd's range: ") + e.what());
  }
  return out;
}

Status Etcd::Delete(const std::string& key) {
  auto body = Call("/v3/kv/deleterange", json{{"key", Base64Encode(Key(key))}}.dump());
  return body.ok() ? Status::Ok() : body.status();
}

}  // namespace elastic
