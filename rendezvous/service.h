// The gRPC Rendezvous service over a Core, on gRPC's callback API: no thread is parked per
// waiting Join, Get or Watch. Each handler authenticates (x-elastic-token, constant time),
// validates, converts the proto to plain structs, calls the Core, and converts back.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "common/process.h"
#include "common/status.h"
#include "common/tls.h"
#include "rendezvous/core.h"

namespace grpc {
class Server;
}

namespace elastic::rendezvous {

struct ServerOptions {
  std::string address = "0.0.0.0:0";  // host:port; port 0 picks a free one
  std::string token;                  // required on every call; must not be empty
  // Mutual TLS (common/tls.h): every client must present a certificate the identity's CA
  // signed. Empty: plain text.
  TlsIdentity tls;
  // Longest server-side wait of a Join or Get whose call has no deadline.
  Duration max_wait = std::chrono::hours(24);
  // Keepalive pings on every connection: a peer that does not answer one within the timeout
  // (stopped, or its link gone) has its calls and Watch stream broken.
  Duration keepalive_time = std::chrono::seconds(2);
  Duration keepalive_timeout = std::chrono::seconds(2);
  // Answers Status calls (thread-safe); unset: UNIMPLEMENTED.
  std::function<std::string()> status_json;
  // HTTP/2 bandwidth-delay probing; off (elastic-run turns it on for
  // ELASTIC_GRPC_BDP_PROBE=1, driver/main.cc).
  bool bdp_probe = false;
};

class RendezvousService;

class Server {
 public:
  // Starts serving `core` (not owned; must outlive the Server). Returns UNAVAILABLE when the
  // address cannot be bound, INVALID_ARGUMENT for an empty token.
  static StatusOr<std::unique_ptr<Server>> Start(Core* core, ServerOptions options);
  ~Server();  // Shutdown()

  int port() const { return port_; }
  // Shuts the core down (every waiting call ends with UNAVAILABLE, watchers get SHUTDOWN),
  // then stops the server, cancelling what is still open after `grace`. Idempotent.
  void Shutdown(Duration grace = std::chrono::seconds(2));

 private:
  Server() = default;
  Core* core_ = nullptr;
  int port_ = 0;
  std::unique_ptr<RendezvousService> service_;
  std::unique_ptr<grpc::Server> server_;
  bool shut_down_ = false;
};

// Compares two strings in time that depends only on their lengths.
bool ConstantTimeEquals(const std::string& a, const std::string& b);

}  // namespace elastic::rendezvous
