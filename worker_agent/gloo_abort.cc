// Reaches gloo::transport::tcp::Context::signalException, which wakes every pending wait on
// every pair of a context. It is protected in Gloo, and Debian's package cannot include its
// header (gloo/transport/tcp/context.h needs gloo/common/memory.h, which is not shipped), so
// this translation unit declares just that member, with the same signature and so the same
// symbol. Gloo's closeConnections() is no substitute: it wakes no pending unbound-buffer wait.
#include <string>

namespace gloo::transport::tcp {
class Context {
 public:
  void signalException(const std::string& msg);
};
}  // namespace gloo::transport::tcp

namespace elastic::worker_agent {

// `tcp_context` is the transport context of a Gloo context built on a TCP device: the
// tcp::Context object itself (gloo::transport::Context is its first base).
void SignalTcpContext(void* tcp_context, const std::string& msg) {
  static_cast<gloo::transport::tcp::Context*>(tcp_context)->signalException(msg);
}

}  // namespace elastic::worker_agent
