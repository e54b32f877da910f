#include "rendezvous/client.h"

#include <absl/synchronization/mutex.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <thread>

#include "common/mutex.h"
#include "proto/elastic.grpc.pb.h"
#include "rendezvous/convert.h"

namespace elastic::rendezvous {

using Rpc = v1::Rendezvous::Stub;

// One connection to one driver address: what Redirect swaps. Calls hold theirs for an attempt.
struct Client::Stub {
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Rendezvous::Stub> stub;
};

void TuneGrpcRuntime() {
  static std::once_flag once;
  std::call_once(once, [] { absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore); });
}

Client::Client(ClientOptions options) : options_(std::move(options)) {
  TuneGrpcRuntime();
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 2000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 2000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // Large enough that a Get of many keys needs no flow-control round trip.
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 4 << 20);
  // Reconnect quickly: the driver may come up a moment after its workers try it. Not through
  // GRPC_ARG_MIN_RECONNECT_BACKOFF_MS: gRPC also takes it as the connect timeout, and with
  // dozens of workers connecting at once a 50 ms connect fails, the channel goes to
  // TRANSIENT_FAILURE and calls wait for gRPC's 5 s backup poller (round 0 of 32 workers took
  // 5-10 s). The connect timeout stays gRPC's (20 s); calls wait for the channel to be ready
  // (Prepare), each within its own deadline.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // Each client its own connection, so simulated workers in one process are like real ones.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // Messages are small: no bandwidth-delay probing (a PING with every burst of data).
  if (!options_.bdp_probe) args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  // The driver's certificate names the job's driver, not a host: it may move (a standby).
  if (!options_.tls.empty()) args.SetSslTargetNameOverride(kTlsServerName);
  args_ = std::make_unique<grpc::ChannelArguments>(args);
  auto first = Connect(options_.address);
  MutexLock g(stub_mu_);
  stub_ = std::move(first);
}

Client::~Client() = default;

std::shared_ptr<Client::Stub> Client::Connect(const std::string& address) const {
  auto s = std::make_shared<Stub>();
  s->address = address;
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (!options_.tls.empty()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options_.tls.ca;
    ssl.pem_private_key = options_.tls.key;
    ssl.pem_cert_chain = options_.tls.cert;
    credentials = grpc::SslCredentials(ssl);
  }
  s->channel = grpc::CreateCustomChannel(address, credentials, *args_);
  s->stub = v1::Rendezvous::NewStub(s->channel);
  return s;
}

std::shared_ptr<Client::Stub> Client::current() const {
  MutexLock g(stub_mu_);
  return stub_;
}

std::shared_ptr<grpc::Channel> Client::channel() const { return current()->channel; }

std::string Client::address() const { return current()->address; }

bool Client::Redirect(const std::string& address) {
  {
    MutexLock g(stub_mu_);
    if (stub_->address == address) return false;
  }
  auto next = Connect(address);
  MutexLock g(stub_mu_);
  Stub* old = stub_.get();
  stub_ = std::move(next);
  // Calls waiting on the old address (for a connection that may never come: a driver that
  // is paused, or whose host is gone) end now, and Retry sends them to the new one.
  for (auto& [ctx, on] : inflight_) {
    if (on == old) ctx->TryCancel();
  }
  MutexLock w(watch_mu_);
  if (watch_ctx_ && watch_stub_ == old) watch_ctx_->TryCancel();
  return true;
}

void Client::Prepare(grpc::ClientContext* ctx, TimePoint deadline) const {
  ctx->AddMetadata("x-elastic-token", options_.token);
  // A call on a channel still connecting (or between attempts) waits for it, up to the
  // call's deadline, instead of failing at once.
  ctx->set_wait_for_ready(true);
  auto left = deadline - SteadyClock::now();
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::duration_cast<std::chrono::system_clock::duration>(left));
}

template <typename Fn>
Status Client::Retry(TimePoint deadline, Fn&& attempt) {
  Duration backoff = options_.first_backoff;
  while (true) {
    grpc::ClientContext ctx;
    Prepare(&ctx, deadline);
    std::shared_ptr<Stub> stub;
    {
      MutexLock g(stub_mu_);
      if (closed_) return Cancelled(closed_why_);
      stub = stub_;
      inflight_.emplace(&ctx, stub.get());
    }
    Status s = FromGrpc(attempt(&ctx, *stub->stub));
    bool moved;
    {
      MutexLock g(stub_mu_);
      inflight_.erase(&ctx);
      if (closed_) return Cancelled(closed_why_);
      moved = stub_ != stub;
    }
    // Cancelled by Redirect (or a driver that moved meanwhile): again, at the new address.
    if (moved && (s.code() == Code::kCancelled || s.code() == Code::kUnavailable ||
                  s.code() == Code::kDeadlineExceeded) &&
        SteadyClock::now() < deadline) {
      continue;
    }
    // A deadline that passed while the call waited for a connection (the driver is gone or
    // not reachable) is the driver's unavailability, as a failed attempt would have said.
    if (s.code() == Code::kDeadlineExceeded &&
        stub->channel->GetState(false) != GRPC_CHANNEL_READY) {
      return Unavailable("no connection before the call's deadline (" + s.message() + ")")
          .WithContext("driver at " + stub->address);
    }
    if (s.code() != Code::kUnavailable) return s;
    TimePoint now = SteadyClock::now();
    if (now + backoff >= deadline) return s.WithContext("driver at " + stub->address);
    std::this_thread::sleep_for(backoff);  // backoff between reconnect attempts, bounded above
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
}

StatusOr<JoinResult> Client::Join(const std::string& slot, int64_t last_round, int64_t version,
                                  Duration timeout) {
  v1::JoinRequest req;
  req.set_slot(slot);
  req.set_last_round(last_round);
  req.set_version(version);
  req.set_worker_id(options_.worker_id);
  v1::JoinResponse resp;
  Status s = Retry(SteadyClock::now() + timeout,
                   [&](grpc::ClientContext* ctx, Rpc& rpc) { return rpc.Join(ctx, req, &resp); });
  if (!s.ok()) return s;
  JoinResult r;
  r.removed = resp.removed();
  if (!r.removed) r.assignment = FromProto(resp.assignment());
  return r;
}

Status Client::Set(int64_t round, const std::string& key, const std::string& value) {
  v1::SetRequest req;
  req.set_round(round);
  req.set_key(key);
  req.set_value(value);
  v1::SetResponse resp;
  return Retry(SteadyClock::now() + options_.call_timeout,
               [&](grpc::ClientContext* ctx, Rpc& rpc) { return rpc.Set(ctx, req, &resp); });
}

StatusOr<std::vector<std::string>> Client::Get(int64_t round, const std::vector<std::string>& keys,
                                               Duration timeout) {
  return SetAndGet(round, "", "", keys, timeout);
}

StatusOr<std::vector<std::string>> Client::SetAndGet(int64_t round, const std::string& key,
                                                     const std::string& value,
                                                     const std::vector<std::string>& keys,
                                                     Duration timeout) {
  v1::GetRequest req;
  req.set_round(round);
  if (!key.empty()) {
    req.set_put_key(key);
    req.set_put_value(value);
  }
  for (const auto& k : keys) req.add_keys(k);
  req.set_timeout_ms(std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count());
  v1::GetResponse resp;
  auto cancelled = [&] {
    return Aborted("the Get of round " + std::to_string(round) +
                   " was cancelled: the driver aborted that round");
  };
  // The server waits up to timeout_ms; the call's own deadline leaves a little room beyond it.
  Status s =
      Retry(SteadyClock::now() + timeout + std::chrono::seconds(1),
            [&](grpc::ClientContext* ctx, Rpc& rpc) {
        {
          MutexLock g(get_mu_);
          if (round <= cancelled_round_) {
            return grpc::Status(grpc::StatusCode::ABORTED, "cancelled");
          }
          get_ctxs_.emplace(ctx, round);
        }
        grpc::Status st = rpc.Get(ctx, req, &resp);
        MutexLock g(get_mu_);
        get_ctxs_.erase(ctx);
        if (round <= cancelled_round_) {
          return grpc::Status(grpc::StatusCode::ABORTED, "cancelled");
        }
        return st;
      });
  if (s.code() == Code::kAborted) {
    MutexLock g(get_mu_);
    if (round <= cancelled_round_) return cancelled();
  }
  if (!s.ok()) return s;
  if (static_cast<size_t>(resp.values_size()) != keys.size()) {
    return Internal("Get returned " + std::to_string(resp.values_size()) + " values for " +
                    std::to_string(keys.size()) + " keys");
  }
  std::vector<std::string> out(resp.values().begin(), resp.values().end());
  return out;
}

Status Client::SendReport(const Report& report) {
  v1::ReportRequest req;
  ToProto(report, &req);
  v1::ReportResponse resp;
  return Retry(SteadyClock::now() + options_.call_timeout,
               [&](grpc::ClientContext* ctx, Rpc& rpc) { return rpc.Report(ctx, req, &resp); });
}

StatusOr<std::string> Client::JobStatus(Duration timeout) {
  v1::StatusRequest req;
  v1::StatusResponse resp;
  Status s = Retry(SteadyClock::now() + timeout,
                   [&](grpc::ClientContext* ctx, Rpc& rpc) { return rpc.Status(ctx, req, &resp); });
  if (!s.ok()) return s;
  return resp.json();
}

Status Client::Watch(const std::string& slot, const std::function<void(const Event&)>& on_event,
                     const std::function<void()>& on_open) {
  grpc::ClientContext ctx;
  ctx.AddMetadata("x-elastic-token", options_.token);
  std::shared_ptr<Stub> stub = current();
  {
    MutexLock g(watch_mu_);
    if (watch_cancelled_) return Cancelled("watch cancelled");
    watch_ctx_ = &ctx;
    watch_stub_ = stub.get();
  }
  // A Redirect before watch_ctx_ was set could not cancel this Watch: it goes to the new
  // address at the next try.
  if (current() != stub) {
    MutexLock g(watch_mu_);
    watch_ctx_ = nullptr;
    return Unavailable("the driver moved to " + address());
  }
  v1::WatchRequest req;
  req.set_slot(slot);
  req.set_worker_id(options_.worker_id);
  auto reader = stub->stub->Watch(&ctx, req);
  // The server marks an accepted stream in its initial metadata; a refused one has none.
  reader->WaitForInitialMetadata();
  bool opened = ctx.GetServerInitialMetadata().count("x-elastic-watch") > 0;
  if (opened && on_open) on_open();
  v1::Event ev;
  while (opened && reader->Read(&ev)) {
    Event e;
    // An event of a kind this worker does not know (a newer driver's) is not for it.
    if (FromProto(ev, &e)) on_event(e);
  }
  Status s = FromGrpc(reader->Finish());
  {
    MutexLock g(watch_mu_);
    watch_ctx_ = nullptr;
  }
  return s;
}

void Client::CancelGets(int64_t round) {
  MutexLock g(get_mu_);
  cancelled_round_ = std::max(cancelled_round_, round);
  for (auto& [ctx, r] : get_ctxs_) {
    if (r <= round) ctx->TryCancel();
  }
}

void Client::Close(const std::string& why) {
  {
    MutexLock g(stub_mu_);
    if (closed_) return;
    closed_ = true;
    closed_why_ = why;
    for (auto& [ctx, stub] : inflight_) ctx->TryCancel();
  }
  CancelGets(INT64_MAX);
  CancelWatch();
}

void Client::CancelWatch() {
  MutexLock g(watch_mu_);
  watch_cancelled_ = true;
  if (watch_ctx_) watch_ctx_->TryCancel();
}

}  // namespace elastic::rendezvous
