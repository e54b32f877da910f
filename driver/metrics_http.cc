#include "driver/metrics_http.h"

#include <httplib.h>

// Debian's libcpp-httplib is built with these, and its classes' layout depends on them: compiled
// without, an httplib::Client is 8 bytes where the library writes 16 (common/CMakeLists.txt).
#if !defined(CPPHTTPLIB_OPENSSL_SUPPORT) || !defined(CPPHTTPLIB_ZLIB_SUPPORT)
#error "compile with cpp-httplib's pkg-config Cflags (-DCPPHTTPLIB_OPENSSL_SUPPORT ...)"
#endif

#include <thread>

namespace elastic::driver {

struct MetricsServer::Impl {
  httplib::Server http;
  std::thread thread;
};

StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const Monitor* monitor,
                                                              const std::string& address,
                                                              int port) {
  std::unique_ptr<MetricsServer> s(new MetricsServer());
  s->impl_ = std::make_unique<Impl>();
  httplib::Server& http = s->impl_->http;
  http.Get("/metrics", [monitor](const httplib::Request&, httplib::Response& res) {
    res.set_content(monitor->Prometheus(), "text/plain; version=0.0.4; charset=utf-8");
  });
  http.Get("/status", [monitor](const httplib::Request&, httplib::Response& res) {
    res.set_content(monitor->StatusJson(), "application/json");
  });
  int bound = port == 0 ? http.bind_to_any_port(address) : (http.bind_to_port(address, port)
                                                               ? port
                                                               : -1);
  if (bound <= 0) {
    return InvalidArgument("--metrics-port " + std::to_string(port) + ": cannot listen on " +
                           address + " (in use?)");
  }
  s->port_ = bound;
  s->impl_->thread = std::thread([impl = s->impl_.get()] { impl->http.listen_after_bind(); });
  return s;
}

MetricsServer::~MetricsServer() {
  if (!impl_) return;
  impl_->http.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

}  // namespace elastic::driver
