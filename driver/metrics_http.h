// The --metrics-port endpoint: GET /metrics serves Monitor::Prometheus() and GET /status
// Monitor::StatusJson() (Debian's cpp-httplib), from its own thread. On loopback it is plain
// HTTP; beyond loopback the driver serves it only as MetricsAccess says: HTTPS with the job's
// driver certificate, a client certificate of the job's CA, and the job token as a bearer token
// (docs/security.md).
#pragma once

#include <memory>
#include <string>

#include "common/status.h"
#include "common/tls.h"
#include "driver/monitor.h"

namespace elastic::driver {

struct MetricsAccess {
  // Not empty: HTTPS with tls.cert and tls.key, and only for clients whose certificate tls.ca
  // signed.
  TlsIdentity tls;
  // Not empty: every request must carry "Authorization: Bearer <token>"; others get 401.
  std::string token;
};

class MetricsServer {
 public:
  // Listens on `address`:`port` (0: any free port) until destroyed. INVALID_ARGUMENT when it
  // cannot listen there or `access.tls` does not hold a certificate and its key.
  static StatusOr<std::unique_ptr<MetricsServer>> Start(const Monitor* monitor,
                                                        const std::string& address, int port,
                                                        const MetricsAccess& access = {});
  ~MetricsServer();
  int port() const { return port_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

}  // namespace elastic::driver
