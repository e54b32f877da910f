#include "rendezvous/service.h"

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <cstdlib>
#include <deque>
#include <set>

#include "common/mutex.h"
#include "proto/elastic.grpc.pb.h"
#include "rendezvous/client.h"
#include "rendezvous/convert.h"

namespace elastic::rendezvous {

bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const std::string& longer = a.size() >= b.size() ? a : b;
  for (size_t i = 0; i < longer.size(); ++i) {
    unsigned char x = i < a.size() ? a[i] : 0;
    unsigned char y = i < b.size() ? b[i] : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

class RendezvousService : public v1::Rendezvous::CallbackService {
 public:
  RendezvousService(Core* core, ServerOptions options)
      : core_(core), options_(std::move(options)) {}

  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* ctx, const v1::JoinRequest* req,
                                 v1::JoinResponse* resp) override;
  grpc::ServerUnaryReactor* Set(grpc::CallbackServerContext* ctx, const v1::SetRequest* req,
                                v1::SetResponse* resp) override;
  grpc::ServerUnaryReactor* Get(grpc::CallbackServerContext* ctx, const v1::GetRequest* req,
                                v1::GetResponse* resp) override;
  grpc::ServerWriteReactor<v1::Event>* Watch(grpc::CallbackServerContext* ctx,
                                             const v1::WatchRequest* req) override;
  grpc::ServerUnaryReactor* Report(grpc::CallbackServerContext* ctx, const v1::ReportRequest* req,
                                   v1::ReportResponse* resp) override;
  grpc::ServerUnaryReactor* Status(grpc::CallbackServerContext* ctx, const v1::StatusRequest*,
                                   v1::StatusResponse* resp) override;

  Core* core() const { return core_; }

  // A valid token, or UNAUTHENTICATED (logged once per peer).
  grpc::Status Authenticate(grpc::CallbackServerContext* ctx) {
    const auto& md = ctx->client_metadata();
    auto it = md.find("x-elastic-token");
    if (it != md.end() &&
        ConstantTimeEquals(std::string(it->second.data(), it->second.size()), options_.token)) {
      return grpc::Status::OK;
    }
    const char* why = it == md.end() ? "missing" : "wrong";
    std::string peer = ctx->peer();
    size_t colon = peer.rfind(':');
    std::string host = colon == std::string::npos ? peer : peer.substr(0, colon);
    {
      MutexLock g(mu_);
      if (logged_peers_.size() < 1024 && logged_peers_.insert(host).second) {
        spdlog::warn("rejected a call from {} with a {} job token (logged once per peer)", host,
                     why);
      }
    }
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        std::string(why) + " x-elastic-token metadata");
  }

  // The server-side deadline of a waiting call, on the core's clock.
  TimePoint DeadlineOf(grpc::CallbackServerContext* ctx, int64_t timeout_ms = 0) {
    TimePoint now = core_->clock()->Now();
    Duration wait = options_.max_wait;
    auto d = ctx->deadline();
    auto sys_now = std::chrono::system_clock::now();
    if (d != std::chrono::system_clock::time_point::max()) {
      wait = std::min<Duration>(wait, std::chrono::duration_cast<Duration>(d - sys_now));
    }
    if (timeout_ms > 0) wait = std::min<Duration>(wait, std::chrono::milliseconds(timeout_ms));
    if (wait < Duration::zero()) wait = Duration::zero();
    return now + wait;
  }

 private:
  Core* core_;
  ServerOptions options_;
  Mutex mu_;
  std::set<std::string> logged_peers_ ELASTIC_GUARDED_BY(mu_);
};

namespace {

// A unary call that waits in the core; OnCancel cancels the core waiter.
class WaitingReactor : public grpc::ServerUnaryReactor {
 public:
  WaitingReactor(Core* core, grpc::CallbackServerContext* ctx) : core_(core), ctx_(ctx) {}
  // Called once the core waiter exists (id 0: it completed inline).
  // Ends the set-up: the reactor lives until both this and OnDone have run, since the core may
  // finish the call (and gRPC call OnDone) before the waiter id is known here.
  void SetWaiter(WaiterId id) {
    id_.store(id);
    if (id != 0 && ctx_->IsCancelled()) core_->Cancel(id);
    Unref();
  }
  void OnCancel() override {
    WaiterId id = id_.load();
    if (id != 0) core_->Cancel(id);
  }
  void OnDone() override { Unref(); }

 private:
  Core* core_;
  void Unref() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }
  grpc::CallbackServerContext* ctx_;
  std::atomic<WaiterId> id_{0};
  std::atomic<int> refs_{2};
};

class WatchReactor : public grpc::ServerWriteReactor<v1::Event> {
 public:
  WatchReactor(Core* core, std::string slot) : core_(core), slot_(std::move(slot)) {}

  void Begin(grpc::CallbackServerContext* ctx) {
    ctx->AddInitialMetadata("x-elastic-watch", "open");
    {
      // Initial metadata tells the client the stream is open (before any event); it is sent
      // like a write, so that nothing else is written or finished while it is in flight.
      MutexLock g(mu_);
      writing_ = true;
      StartSendInitialMetadata();
    }
    auto sub = core_->events().Subscribe(slot_, [this](const Event& e) { Enqueue(e); });
    if (!sub.ok()) {
      MutexLock g(mu_);
      final_ = ToGrpc(sub.status());
      finish_requested_ = true;
      MaybeFinishLocked();
    }
    if (!sub.ok()) {
      Unref();
      return;
    }
    sub_id_ = *sub;
    if (Listener* l = core_->options().listener) l->OnWatchOpened(slot_);
    Unref();
  }

  void OnSendInitialMetadataDone(bool ok) override { OnWriteDone(ok); }

  void OnWriteDone(bool ok) override {
    MutexLock g(mu_);
    writing_ = false;
    if (!ok) finish_requested_ = true;
    if (!finish_requested_ && !queue_.empty()) {
      StartNextLocked();
      return;
    }
    MaybeFinishLocked();
  }

  void OnCancel() override {
    MutexLock g(mu_);
    finish_requested_ = true;
    final_ = grpc::Status::CANCELLED;
    MaybeFinishLocked();
  }

  void OnDone() override { Unref(); }

 private:
  // The reactor lives until both Begin() and OnDone() have finished with it.
  void Unref() {
    if (refs_.fetch_sub(1) != 1) return;
    if (sub_id_ != 0) {
      core_->events().Unsubscribe(sub_id_);
      if (Listener* l = core_->options().listener) l->OnWatchClosed(slot_);
    }
    delete this;
  }
  void Enqueue(const Event& e) {
    MutexLock g(mu_);
    if (finish_requested_) return;
    if (queue_.size() >= 64) queue_.pop_front();  // a stuck reader keeps only the newest events
    queue_.push_back(e);
    if (!writing_) StartNextLocked();
  }
  void StartNextLocked() ELASTIC_REQUIRES(mu_) {
    Event e = queue_.front();
    queue_.pop_front();
    ToProto(e, &current_);
    writing_ = true;
    if (e.kind == EventKind::kShutdown) finish_requested_ = true;
    StartWrite(&current_);
  }
  void MaybeFinishLocked() ELASTIC_REQUIRES(mu_) {
    if (writing_ || finished_ || !finish_requested_) return;
    finished_ = true;
    Finish(final_);
  }

  Core* core_;
  std::string slot_;
  uint64_t sub_id_ = 0;
  std::atomic<int> refs_{2};
  Mutex mu_;
  std::deque<Event> queue_ ELASTIC_GUARDED_BY(mu_);
  v1::Event current_ ELASTIC_GUARDED_BY(mu_);  // the message being written
  bool writing_ ELASTIC_GUARDED_BY(mu_) = false;
  bool finish_requested_ ELASTIC_GUARDED_BY(mu_) = false;
  bool finished_ ELASTIC_GUARDED_BY(mu_) = false;
  grpc::Status final_ ELASTIC_GUARDED_BY(mu_);
};

grpc::ServerUnaryReactor* FinishNow(grpc::CallbackServerContext* ctx, const grpc::Status& s) {
  auto* r = ctx->DefaultReactor();
  r->Finish(s);
  return r;
}

}  // namespace

grpc::ServerUnaryReactor* RendezvousService::Join(grpc::CallbackServerContext* ctx,
                                                  const v1::JoinRequest* req,
                                                  v1::JoinResponse* resp) {
  grpc::Status auth = Authenticate(ctx);
  if (!auth.ok()) return FinishNow(ctx, auth);
  if (req->worker_id().size() > 256) {
    return FinishNow(ctx, grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "worker id too long"));
  }
  auto* reactor = new WaitingReactor(core_, ctx);
  WaiterId id = core_->JoinAsync(req->slot(), req->last_round(), req->version(), DeadlineOf(ctx),
                                 [reactor, resp](StatusOr<JoinResult> r) {
                                   if (r.ok()) {
                                     resp->set_removed(r->removed);
                                     if (!r->removed)
                                       ToProto(r->assignment, resp->mutable_assignment());
                                   }
                                   reactor->Finish(ToGrpc(r.status()));
                                 },
                                 req->worker_id());
  reactor->SetWaiter(id);
  return reactor;
}

grpc::ServerUnaryReactor* RendezvousService::Set(grpc::CallbackServerContext* ctx,
                                                 const v1::SetRequest* req, v1::SetResponse*) {
  grpc::Status auth = Authenticate(ctx);
  if (!auth.ok()) return FinishNow(ctx, auth);
  return FinishNow(ctx, ToGrpc(core_->Set(req->round(), req->key(), req->value())));
}

grpc::ServerUnaryReactor* RendezvousService::Get(grpc::CallbackServerContext* ctx,
                                                 const v1::GetRequest* req, v1::GetResponse* resp) {
  grpc::Status auth = Authenticate(ctx);
  if (!auth.ok()) return FinishNow(ctx, auth);
  if (!req->put_key().empty()) {
    grpc::Status put = ToGrpc(core_->Set(req->round(), req->put_key(), req->put_value()));
    if (!put.ok()) return FinishNow(ctx, put);
  }
  auto* reactor = new WaitingReactor(core_, ctx);
  std::vector<std::string> keys(req->keys().begin(), req->keys().end());
  WaiterId id = core_->GetAsync(req->round(), std::move(keys), DeadlineOf(ctx, req->timeout_ms()),
                                [reactor, resp](StatusOr<Values> r) {
                                  if (r.ok()) {
                                    for (const auto& v : *r) resp->add_values(*v);
                                  }
                                  reactor->Finish(ToGrpc(r.status()));
                                });
  reactor->SetWaiter(id);
  return reactor;
}

grpc::ServerWriteReactor<v1::Event>* RendezvousService::Watch(grpc::CallbackServerContext* ctx,
                                                              const v1::WatchRequest* req) {
  grpc::Status auth = Authenticate(ctx);
  if (auth.ok() && !ValidSlotName(req->slot(), core_->options().limits.max_slot_bytes)) {
    auth = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "invalid slot name");
  }
  if (auth.ok() && req->worker_id().size() > 256) {
    auth = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "worker id longer than 256 bytes");
  }
  if (auth.ok()) {
    // Only the slot's own process counts as its watcher (a driver that adopted the job takes
    // a member as re-attached when its stream opens).
    elastic::Status mine = core_->CheckWorker(req->slot(), req->worker_id());
    if (!mine.ok()) auth = ToGrpc(mine);
  }
  if (!auth.ok()) {
    class Refuse : public grpc::ServerWriteReactor<v1::Event> {
     public:
      explicit Refuse(const grpc::Status& s) { Finish(s); }
      void OnDone() override { delete this; }
    };
    return new Refuse(auth);
  }
  auto* reactor = new WatchReactor(core_, req->slot());
  reactor->Begin(ctx);
  return reactor;
}

grpc::ServerUnaryReactor* RendezvousService::Report(grpc::CallbackServerContext* ctx,
                                                    const v1::ReportRequest* req,
                                                    v1::ReportResponse*) {
  grpc::Status auth = Authenticate(ctx);
  if (!auth.ok()) return FinishNow(ctx, auth);
  rendezvous::Report report;
  if (!FromProto(*req, &report)) {
    return FinishNow(ctx, grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "unknown report kind"));
  }
  return FinishNow(ctx, ToGrpc(core_->HandleReport(report)));
}

grpc::ServerUnaryReactor* RendezvousService::Status(grpc::CallbackServerContext* ctx,
                                                  const v1::StatusRequest*,
                                                  v1::StatusResponse* resp) {
  grpc::Status auth = Authenticate(ctx);
  if (!auth.ok()) return FinishNow(ctx, auth);
  if (!options_.status_json) {
    return FinishNow(ctx, grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "no status here"));
  }
  resp->set_json(options_.status_json());
  return FinishNow(ctx, grpc::Status::OK);
}

StatusOr<std::unique_ptr<Server>> Server::Start(Core* core, ServerOptions options) {
  TuneGrpcRuntime();
  if (options.token.empty()) return InvalidArgument("the job token must not be empty");
  std::unique_ptr<Server> s(new Server());
  s->core_ = core;
  std::string address = options.address;
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (!options.tls.empty()) {
    grpc::SslServerCredentialsOptions ssl(
        GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    ssl.pem_root_certs = options.tls.ca;
    ssl.pem_key_cert_pairs.push_back({options.tls.key, options.tls.cert});
    credentials = grpc::SslServerCredentials(ssl);
  }
  s->service_ = std::make_unique<RendezvousService>(core, std::move(options));
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, credentials, &s->port_);
  builder.RegisterService(s->service_.get());
  const Limits& lim = core->options().limits;
  builder.SetMaxReceiveMessageSize(static_cast<int>(lim.max_value_bytes + (1 << 20)));
  builder.SetMaxSendMessageSize(static_cast<int>(lim.max_get_response_bytes + (1 << 20)));
  // Liveness: clients ping every 2 s; a silent peer's stream breaks within a few seconds.
  auto ms = [](Duration d) {
    return static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(d).count());
  };
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, ms(options.keepalive_time));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, ms(options.keepalive_timeout));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 500);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  // Messages are small: no bandwidth-delay probing (a PING with every burst of data).
  if (!options.bdp_probe) builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  s->server_ = builder.BuildAndStart();
  if (!s->server_ || s->port_ == 0) {
    return Unavailable("cannot listen on " + address + " (address in use or not local?)");
  }
  return s;
}

void Server::Shutdown(Duration grace) {
  if (shut_down_) return;
  shut_down_ = true;
  core_->Shutdown();
  if (!server_) return;  // it never started
  server_->Shutdown(std::chrono::system_clock::now() +
                    std::chrono::duration_cast<std::chrono::system_clock::duration>(grace));
  server_->Wait();
}

Server::~Server() { Shutdown(); }

}  // namespace elastic::rendezvous
