#include "driver/metrics_http.h"

#include <httplib.h>

// Debian's libcpp-httplib is built with these, and its classes' layout depends on them: compiled
// without, an httplib::Client is 8 bytes where the library writes 16 (common/CMakeLists.txt).
#if !defined(CPPHTTPLIB_OPENSSL_SUPPORT) || !defined(CPPHTTPLIB_ZLIB_SUPPORT)
#error "compile with cpp-httplib's pkg-config Cflags (-DCPPHTTPLIB_OPENSSL_SUPPORT ...)"
#endif

#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>

#include <thread>

#include "rendezvous/service.h"

namespace elastic::driver {

struct MetricsServer::Impl {
  std::unique_ptr<httplib::Server> server;
  std::thread thread;
};

namespace {

// The TLS context of the HTTPS endpoint: the driver's certificate and key, and a client
// certificate of the job's CA required (the handshake fails without one).
bool SetUpTls(SSL_CTX& ctx, const TlsIdentity& id) {
  bool ok = false;
  BIO* c = BIO_new_mem_buf(id.cert.data(), static_cast<int>(id.cert.size()));
  BIO* k = BIO_new_mem_buf(id.key.data(), static_cast<int>(id.key.size()));
  BIO* a = BIO_new_mem_buf(id.ca.data(), static_cast<int>(id.ca.size()));
  X509* cert = c ? PEM_read_bio_X509(c, nullptr, nullptr, nullptr) : nullptr;
  EVP_PKEY* key = k ? PEM_read_bio_PrivateKey(k, nullptr, nullptr, nullptr) : nullptr;
  X509* ca = a ? PEM_read_bio_X509(a, nullptr, nullptr, nullptr) : nullptr;
  if (cert && key && ca && SSL_CTX_use_certificate(&ctx, cert) == 1 &&
      SSL_CTX_use_PrivateKey(&ctx, key) == 1 && SSL_CTX_check_private_key(&ctx) == 1 &&
      X509_STORE_add_cert(SSL_CTX_get_cert_store(&ctx), ca) == 1) {
    SSL_CTX_set_min_proto_version(&ctx, TLS1_2_VERSION);
    SSL_CTX_set_verify(&ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
    ok = true;
  }
  X509_free(cert);
  EVP_PKEY_free(key);
  X509_free(ca);
  BIO_free(c);
  BIO_free(k);
  BIO_free(a);
  ERR_clear_error();
  return ok;
}

}  // namespace

StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const Monitor* monitor,
                                                              const std::string& address,
                                                              int port,
                                                              const MetricsAccess& access) {
  std::unique_ptr<MetricsServer> s(new MetricsServer());
  s->impl_ = std::make_unique<Impl>();
  if (access.tls.empty()) {
    s->impl_->server = std::make_unique<httplib::Server>();
  } else {
    TlsIdentity id = access.tls;
    auto https = std::make_unique<httplib::SSLServer>(
        [id](SSL_CTX& ctx) { return SetUpTls(ctx, id); });
    if (!https->is_valid()) {
      return InvalidArgument("--metrics-address " + address +
                             ": the job's driver certificate, key and CA are not usable PEM");
    }
    s->impl_->server = std::move(https);
  }
  httplib::Server& http = *s->impl_->server;
  if (!access.token.empty()) {
    const std::string expected = "Bearer " + access.token;
    http.set_pre_routing_handler([expected](const httplib::Request& req,
                                            httplib::Response& res) {
      if (rendezvous::ConstantTimeEquals(req.get_header_value("Authorization"), expected)) {
        return httplib::Server::HandlerResponse::Unhandled;
      }
      res.status = 401;
      res.set_header("WWW-Authenticate", "Bearer");
      res.set_content("the job token is required: Authorization: Bearer <token> (the job "
                      "file's \"token\"; `elastic-run credentials` writes it)\n",
                      "text/plain");
      return httplib::Server::HandlerResponse::Handled;
    });
  }
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
  s->impl_->thread =
      std::thread([impl = s->impl_.get()] { impl->server->listen_after_bind(); });
  return s;
}

MetricsServer::~MetricsServer() {
  if (!impl_) return;
  impl_->server->stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

}  // namespace elastic::driver
