// The --metrics-port endpoint: GET /metrics serves Monitor::Prometheus() over HTTP (Debian's
// cpp-httplib), from its own thread.
#pragma once

#include <memory>
#include <string>

#include "common/status.h"
#include "driver/monitor.h"

namespace elastic::driver {

class MetricsServer {
 public:
  // Listens on `address`:`port` (0: any free port) until destroyed.
  static StatusOr<std::unique_ptr<MetricsServer>> Start(const Monitor* monitor,
                                                        const std::string& address, int port);
  ~MetricsServer();
  int port() const { return port_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

}  // namespace elastic::driver
