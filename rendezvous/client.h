// Client of the Rendezvous service, used by the worker agent (and tests and benchmarks).
// Every call has a deadline; calls that fail with UNAVAILABLE are retried with backoff until
// that deadline, no other failure is retried. Thread-safe: one Client may serve many threads.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/mutex.h"
#include "common/process.h"
#include "common/status.h"
#include "common/tls.h"
#include "rendezvous/types.h"

namespace grpc {
class Channel;
class ChannelArguments;
class ClientContext;
}  // namespace grpc

namespace elastic::rendezvous {

struct ClientOptions {
  std::string address;  // host:port of the driver
  std::string token;
  // Mutual TLS with the driver (common/tls.h): the job's CA, and the certificate and key this
  // client presents. Empty: plain text.
  TlsIdentity tls;
  std::string worker_id;  // sent in every Join (ELASTIC_WORKER_ID)
  Duration call_timeout = std::chrono::seconds(30);  // Set and Report
  Duration first_backoff = std::chrono::milliseconds(20);
  Duration max_backoff = std::chrono::milliseconds(500);
  // HTTP/2 bandwidth-delay probing (a PING with every burst of data); off, since messages are
  // small. A worker turns it on for ELASTIC_GRPC_BDP_PROBE=1 (WorkerOptions).
  bool bdp_probe = false;
};

class Client {
 public:
  explicit Client(ClientOptions options);
  ~Client();

  // Waits up to `timeout` for a round newer than `last_round` that includes `slot`;
  // `version` is the version of the committed state this worker holds (0: none).
  StatusOr<JoinResult> Join(const std::string& slot, int64_t last_round, int64_t version,
                            Duration timeout);
  Status Set(int64_t round, const std::string& key, const std::string& value);
  // Waits server-side, up to `timeout`, until every key exists; values in key order.
  // ABORTED at once when CancelGets() covered `round`.
  StatusOr<std::vector<std::string>> Get(int64_t round, const std::vector<std::string>& keys,
                                         Duration timeout);
  // Set(round, key, value), then Get(round, keys, timeout), in one call.
  StatusOr<std::vector<std::string>> SetAndGet(int64_t round, const std::string& key,
                                               const std::string& value,
                                               const std::vector<std::string>& keys,
                                               Duration timeout);
  Status SendReport(const Report& report);
  // The driver's status document (JSON), for `elastic-run status`.
  StatusOr<std::string> JobStatus(Duration timeout);
  // Streams events of `slot` to `on_event` until the stream ends (server shutdown, error, or
  // CancelWatch()); returns how it ended. Not retried: a broken stream is the caller's signal.
  // `on_open` runs once the stream is established.
  Status Watch(const std::string& slot, const std::function<void(const Event&)>& on_event,
               const std::function<void()>& on_open = nullptr);
  // Ends every Get of a round <= `round` in progress on other threads, and fails later ones,
  // with ABORTED: the driver aborted that round. Thread-safe.
  void CancelGets(int64_t round);
  // Ends a Watch in progress on another thread (it returns CANCELLED). Thread-safe.
  void CancelWatch();
  // Ends every call in progress on other threads (Join, Get, Report, Watch) and fails every
  // later one at once with CANCELLED saying `why`: the caller is done with the driver (a
  // worker's agent that ended, worker_agent/agent.cc). Thread-safe; the first `why` stays.
  void Close(const std::string& why);
  // The channel (its own connection, with the settings above), for a benchmark that drives
  // the protocol through gRPC's asynchronous API.
  std::shared_ptr<grpc::Channel> channel() const;
  // Dials `address` from now on (the driver that leads the job moved: a standby took over,
  // docs/high-availability.md); calls in progress finish on the old connection (and, when it
  // is gone, retry on the new one). False when it already dials there. Thread-safe.
  bool Redirect(const std::string& address);
  std::string address() const;

 private:
  template <typename Fn>
  Status Retry(TimePoint deadline, Fn&& attempt);
  void Prepare(grpc::ClientContext* ctx, TimePoint deadline) const;

  struct Stub;
  std::shared_ptr<Stub> Connect(const std::string& address) const;
  std::shared_ptr<Stub> current() const;

  ClientOptions options_;
  std::unique_ptr<grpc::ChannelArguments> args_;
  mutable Mutex stub_mu_;
  std::shared_ptr<Stub> stub_ ELASTIC_GUARDED_BY(stub_mu_);
  // Calls in flight (Retry's attempts) and the stub each went out on, for Redirect to cancel.
  std::map<grpc::ClientContext*, Stub*> inflight_ ELASTIC_GUARDED_BY(stub_mu_);
  bool closed_ ELASTIC_GUARDED_BY(stub_mu_) = false;  // Close() was called, saying closed_why_
  std::string closed_why_ ELASTIC_GUARDED_BY(stub_mu_);
  Mutex watch_mu_;
  grpc::ClientContext* watch_ctx_ ELASTIC_GUARDED_BY(watch_mu_) = nullptr;
  Stub* watch_stub_ ELASTIC_GUARDED_BY(watch_mu_) = nullptr;
  bool watch_cancelled_ ELASTIC_GUARDED_BY(watch_mu_) = false;
  Mutex get_mu_;
  std::map<grpc::ClientContext*, int64_t> get_ctxs_;  // Gets in flight, by round; get_mu_
  int64_t cancelled_round_ ELASTIC_GUARDED_BY(get_mu_) = INT64_MIN;
};

// Turns off Abseil's mutex deadlock detection (a debugging aid that Debian's Abseil leaves on;
// it costs gRPC ~15 % of its CPU). Idempotent; called by Client and Server.
void TuneGrpcRuntime();

}  // namespace elastic::rendezvous
