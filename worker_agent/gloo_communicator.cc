#include "worker_agent/gloo_communicator.h"

#include <dirent.h>
#include <gloo/allgather.h>
#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/context.h>
#include <gloo/transport/pair.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/tcp/device.h>
#include <netinet/in.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <algorithm>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <thread>

#include "common/mutex.h"
#include "common/process.h"
#include "common/test_hook.h"
#include "common/thread_pool.h"
#include "worker_agent/gloo_device.h"
#include "worker_agent/hierarchical.h"
#include "worker_agent/reduce.h"
#include "worker_agent/shm_communicator.h"
#include "worker_agent/shm_group.h"

namespace elastic::worker_agent {
namespace {

template <typename T>
void RunAllreduce(const std::shared_ptr<gloo::Context>& ctx, void* data, size_t count,
                  ReduceFn fn, Duration timeout) {
  gloo::AllreduceOptions opts(ctx);
  opts.setOutput(static_cast<T*>(data), count);
  opts.setReduceFunction(std::move(fn));
  opts.setTimeout(std::chrono::duration_cast<std::chrono::milliseconds>(timeout));
  gloo::allreduce(opts);
}

}  // namespace

void SignalTcpContext(void* tcp_context, const std::string& msg);  // gloo_abort.cc

// Gloo's closeConnections() is graceful: it wakes no pending unbound-buffer wait, and a closed
// pair no longer sees its peer's EOF. What wakes every wait is the transport context's
// signalException; this subclass reaches the (protected) transport context, and lets the mesh
// be connected here rather than in connectFullMesh, which keeps its transport context out of
// reach (and so out of reach of an abort) until every pair has connected.
class AbortableContext : public gloo::rendezvous::Context {
 public:
  using gloo::rendezvous::Context::Context;
  void Adopt(std::shared_ptr<gloo::transport::Device> dev,
             std::shared_ptr<gloo::transport::Context> pairs) {
    device_ = std::move(dev);
    transportContext_ = std::move(pairs);
  }
  // gloo::Context::getDevice() throws when no device was set.
  std::shared_ptr<gloo::transport::Device> device() const { return device_; }
};

namespace {

void Signal(const std::shared_ptr<void>& pairs, const std::string& msg) {
  // A gloo::transport::Context made by a TCP device is a tcp::Context.
  if (pairs) SignalTcpContext(static_cast<gloo::transport::Context*>(pairs.get()), msg);
}

}  // namespace

struct GlooCommunicator::Executor {
  Mutex mu;
  std::condition_variable cv;
  std::function<void()> job ELASTIC_GUARDED_BY(mu);  // the collective to run next
  uint64_t posted ELASTIC_GUARDED_BY(mu) = 0;        // jobs posted
  uint64_t finished ELASTIC_GUARDED_BY(mu) = 0;      // jobs finished
  std::exception_ptr error ELASTIC_GUARDED_BY(mu);   // of the last finished job
  bool stop ELASTIC_GUARDED_BY(mu) = false;
  bool abandoned ELASTIC_GUARDED_BY(mu) = false;  // a job outlived an abort
  std::thread thread;

  // A started executor: an idle one left by an earlier communicator, or a new one.
  static std::shared_ptr<Executor> Take() {
    {
      MutexLock g(IdleMu());
      auto& idle = Idle();
      if (!idle.empty()) {
        auto ex = std::move(idle.back());
        idle.pop_back();
        return ex;
      }
    }
    auto ex = std::make_shared<Executor>();
    ex->thread = std::thread(&Executor::Loop, ex);
    return ex;
  }
  // Keeps an executor with nothing left to run for the next communicator (a thread started
  // and joined every round cost a recovery more than its collectives did); false when enough
  // are kept already.
  static bool Keep(const std::shared_ptr<Executor>& ex) {
    MutexLock g(IdleMu());
    auto& idle = Idle();
    if (idle.size() >= 4) return false;
    {
      MutexLock g(ex->mu);
      ex->abandoned = false;  // that communicator's; its collective ended
    }
    idle.push_back(ex);
    return true;
  }
  static Mutex& IdleMu() {
    static auto* mu = new Mutex();
    return *mu;
  }
  static std::vector<std::shared_ptr<Executor>>& Idle() {
    // Never destroyed: the idle threads hold their executors and outlive main().
    static auto* idle = new std::vector<std::shared_ptr<Executor>>();
    return *idle;
  }

  static void Loop(std::shared_ptr<Executor> self) {
    MutexLock lock(self->mu);
    while (true) {
      self->cv.wait(lock.native(), [&]() ELASTIC_REQUIRES(self->mu) {
        return self->stop || self->posted > self->finished;
      });
      if (self->posted == self->finished) return;  // stopped, nothing left
      std::function<void()> job = std::move(self->job);
      lock.Unlock();
      std::exception_ptr error;
      try {
        job();
      } catch (...) {
        error = std::current_exception();
      }
      job = nullptr;
      lock.Lock();
      self->error = error;
      ++self->finished;
      self->cv.notify_all();
    }
  }
};

GlooCommunicator::GlooCommunicator(std::shared_ptr<AbortableContext> ctx, Topology topo,
                                   GlooOptions options)
    : CommunicatorBase(topo), ctx_(std::move(ctx)), options_(std::move(options)) {}

GlooCommunicator::~GlooCommunicator() {
  bool abandoned = false;
  if (exec_) {
    {
      MutexLock g(exec_->mu);
      abandoned = exec_->abandoned && exec_->finished < exec_->posted;
    }
    if (abandoned || !Executor::Keep(exec_)) {
      {
        MutexLock g(exec_->mu);
        exec_->stop = true;
        exec_->cv.notify_all();
      }
      // An abandoned collective holds the Gloo context it uses (its options share it) and
      // ends at Gloo's timeout; its thread then finds `stop` and returns.
      if (abandoned) {
        exec_->thread.detach();
      } else {
        exec_->thread.join();
      }
    }
  }
  MutexLock g(abort_mu_);
  if (!abandoned && pairs_ && !peers_.empty()) {
    // Nothing uses the pairs any more: close them together (each close waits for a tick of
    // the device loop) rather than one by one in the context's destructor.
    auto* pairs = static_cast<gloo::transport::Context*>(pairs_.get());
    try {
      ForEachInParallel(peers_, [pairs](int i) { pairs->getPair(i).reset(); });
    } catch (const std::exception& e) {
      spdlog::debug("closing the Gloo pairs: {}", e.what());
    }
  }
  std::shared_ptr<gloo::transport::Device> device;
  if (device_) {
    device = std::static_pointer_cast<gloo::transport::Device>(device_);
  } else if (ctx_) {
    device = ctx_->device();
  }
  device_.reset();
  ctx_.reset();
  pairs_.reset();
  ReleaseDevice(std::move(device));
  // Nothing of this process uses the segment any more: the next round may reuse it.
  std::unique_ptr<ShmGroup> group = host_ ? host_->Release() : std::move(shm_);
  if (!abandoned && group && options_.shm_keeper) options_.shm_keeper->Keep(std::move(group));
}

namespace {
class GlooFactory : public CommunicatorFactory {
 public:
  explicit GlooFactory(GlooOptions options) : options_(std::move(options)) {}
  StatusOr<std::unique_ptr<RoundCommunicator>> New(const Topology& topo) override {
    ASSIGN_OR_RETURN(auto made, GlooCommunicator::New(topo, options_));
    return std::unique_ptr<RoundCommunicator>(std::move(made));
  }

 private:
  const GlooOptions options_;
};
}  // namespace

std::shared_ptr<CommunicatorFactory> MakeGlooFactory(GlooOptions options) {
  return std::make_shared<GlooFactory>(std::move(options));
}

StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::New(const Topology& topo,
                                                                  const GlooOptions& options) {
  if (topo.size < 1 || topo.rank < 0 || topo.rank >= topo.size) {
    return InvalidArgument("bad topology: rank " + std::to_string(topo.rank) + " of " +
                           std::to_string(topo.size));
  }
  // Gloo writes to its peers' sockets without MSG_NOSIGNAL on some paths: a peer that dies
  // must surface as WorkerLostError, not kill this process with SIGPIPE. Only the default
  // disposition is changed (a handler of the program's own stays); worker_agent/elastic.h
  // and docs/python.md say so.
  struct sigaction pipe_action {};
  if (sigaction(SIGPIPE, nullptr, &pipe_action) == 0 && pipe_action.sa_handler == SIG_DFL) {
    signal(SIGPIPE, SIG_IGN);
  }
  try {
    std::string key;
    gloo::transport::tcp::attr attr = DeviceAttr(options, &key);
    // The first communicator of the process makes the device here, so that an address it
    // cannot use is an error of New (the caller's to fix) rather than of a later connect.
    // The others make it when their pairs connect (ConnectPairs), if they ever do.
    auto device = SharedDevice(attr, key, /*only_if_new=*/true);
    auto ctx = std::make_shared<AbortableContext>(topo.rank, topo.size);
    std::unique_ptr<GlooCommunicator> comm(new GlooCommunicator(ctx, topo, options));
    comm->device_ = device;
    return comm;
  } catch (const std::exception& e) {
    return Unavailable(std::string("creating the Gloo TCP device failed: ") + e.what());
  }
}

std::vector<int> GlooPeers(int rank, int size) {
  std::vector<int> out;
  for (long d = 1; d < size; d <<= 1) {
    out.push_back(static_cast<int>((rank + d) % size));
    out.push_back(static_cast<int>((rank - d % size + size) % size));
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  out.erase(std::remove(out.begin(), out.end(), rank), out.end());
  return out;
}

Status GlooCommunicator::Attempt(const std::function<Status()>& connect) {
  Status s;
  try {
    s = connect();
  } catch (const std::exception& e) {
    s = Unavailable(std::string("connecting the Gloo pairs failed: ") + e.what());
  }
  if (!s.ok() && aborted_.load()) {
    return Aborted("connecting the Gloo pairs was aborted (a peer of this round is gone): " +
                   s.message());
  }
  return s;
}

Status GlooCommunicator::Connect(RoundStore* store) {
  return Attempt([&] {
    ShmPlan plan;
    Status s = PlanShm(store, &plan);
    // Every rank on one host with the shared-memory allreduce: the flat pairs would serve
    // only broadcast, allgather and barrier, which go through the segment too unless
    // GlooOptions::shm_collectives is off; then they connect at the first of those (EnsurePairs), which
    // a round without a state sync may never call.
    shm_flat_ = options_.shm_collectives;
    const bool lazy = plan.want && topo_.cross_size == 1 && topo_.size > 1 &&
                      options_.lazy_pairs;
    if (s.ok() && lazy) {
      lazy_store_ = store;
      if (!plan.fetch_key.empty()) {
        auto got = store->Get({plan.fetch_key}, options_.connect_timeout);
        if (got.ok()) {
          plan.description = std::move((*got)[0]);
        } else {
          s = got.status();
        }
      }
    } else if (s.ok()) {
      s = ConnectPairs(store, plan.fetch_key, &plan.description);
    }
    if (s.ok()) s = SetUpHierarchy(store, &plan);
    // The shared memory turned off after all: the flat ring allreduces, over the pairs.
    std::string unused;
    if (s.ok() && !hier_ && !pairs_connected_) s = ConnectPairs(store, "", &unused);
    if (s.ok() && shm_collectives() && device_) {
      // The device New made (this process's first communicator) will never serve a pair:
      // its loop thread would only wake every 10 ms for as long as this round lasts.
      auto device = std::static_pointer_cast<gloo::transport::Device>(device_);
      device_.reset();
      ReleaseDevice(std::move(device));
    }
    return s;
  });
}

Status GlooCommunicator::ConnectPairs(RoundStore* store, const std::string& extra_key,
                                      std::string* extra_value) {
  if (pairs_connected_) return FailedPrecondition("Connect() called twice");
  auto device = std::static_pointer_cast<gloo::transport::Device>(device_);
  if (!device) {
    std::string key;
    gloo::transport::tcp::attr attr = DeviceAttr(options_, &key);
    try {
      device = SharedDevice(attr, key);
    } catch (const std::exception& e) {
      return Unavailable(std::string("creating the Gloo TCP device failed: ") + e.what());
    }
    device_ = device;  // for the destructor, should this connect fail
  }
  auto timeout = std::chrono::duration_cast<std::chrono::milliseconds>(options_.connect_timeout);
  std::shared_ptr<gloo::transport::Context> pairs = device->createContext(topo_.rank, topo_.size);
  pairs->setTimeout(timeout);
  std::vector<int> peers_to;
  if (options_.full_mesh) {
    for (int i = 0; i < topo_.size; ++i) {
      if (i != topo_.rank) peers_to.push_back(i);
    }
  } else {
    peers_to = GlooPeers(topo_.rank, topo_.size);
  }
  std::vector<std::pair<int, std::vector<char>>> mine;
  std::vector<std::string> keys;
  for (int i : peers_to) {
    mine.emplace_back(i, CanonicalPairAddress(pairs->createPair(i)->address().bytes()));
    keys.push_back(std::to_string(i));
  }
  {
    MutexLock g(abort_mu_);
    if (aborted_.load()) return Aborted("the communicator was aborted before it connected");
    pairs_ = pairs;  // from here on Abort() fails every pair's wait
  }
  // This rank's addresses go out and its peers' come back in one call (with the segment of
  // the host's local rank 0, when there is one to fetch).
  std::vector<std::string> peers;
  if (!extra_key.empty()) keys.push_back(extra_key);
  if (keys.empty()) {
    RETURN_IF_ERROR(store->Set(std::to_string(topo_.rank), EncodeAddresses(mine)));
  } else {
    ASSIGN_OR_RETURN(peers, store->SetAndGet(std::to_string(topo_.rank), EncodeAddresses(mine),
                                             keys, options_.connect_timeout));
  }
  if (!extra_key.empty()) {
    *extra_value = std::move(peers.back());
    peers.pop_back();
    keys.pop_back();
  }
  TestHook("connect", 0);
  if (!keys.empty()) {
    std::vector<std::vector<char>> addrs(topo_.size);
    for (size_t k = 0; k < peers_to.size(); ++k) {
      ASSIGN_OR_RETURN(addrs[peers_to[k]], AddressFor(peers[k], topo_.rank, peers_to[k]));
    }
    if (aborted_.load()) return Aborted("the communicator was aborted while connecting");
    // All at once: a pair on the listening side waits for its peer to connect, and one after
    // another those waits chained across ranks.
    ForEachInParallel(peers_to, [&](int i) {
      if (!aborted_.load()) pairs->getPair(i)->connect(addrs[i]);
    });
    std::vector<sockaddr_storage> theirs, ours;
    for (int i : peers_to) {
      theirs.push_back(gloo::transport::tcp::Address(addrs[i]).getSockaddr());
    }
    for (const auto& [peer, bytes] : mine) {
      ours.push_back(gloo::transport::tcp::Address(bytes).getSockaddr());
    }
    ResetPairsOnClose(theirs, ours);
  }
  MutexLock g(abort_mu_);
  if (aborted_.load()) return Aborted("the communicator was aborted while connecting");
  ctx_->Adopt(device, pairs);
  pairs_connected_ = true;
  peers_ = peers_to;
  ctx_->setTimeout(
      std::chrono::duration_cast<std::chrono::milliseconds>(options_.collective_timeout));
  device_.reset();
  return Status::Ok();
}

Status GlooCommunicator::EnsurePairs() {
  if (pairs_connected_ || !lazy_store_) return Status::Ok();
  return Attempt([&] {
    std::string unused;
    return ConnectPairs(lazy_store_, "", &unused);
  });
}

void GlooCommunicator::RequirePairs(const char* what) {
  Status s = EnsurePairs();
  if (!s.ok()) throw WorkerLostError(std::string(what) + ": " + s.message());
}

Status GlooCommunicator::Agree(RoundStore* store, const std::string& key, int64_t* values,
                               size_t n) {
  if (pairs_connected_) {
    AgreeMin(values, n);
    return Status::Ok();
  }
  if (topo_.size == 1 || n == 0) return Status::Ok();
  // Without pairs (they connect later, if ever): through the round's store. Every rank puts
  // its values; rank 0 takes the min of all and puts it; the others fetch it with their put.
  const std::string prefix = "agree/" + key + "/";
  const size_t bytes = n * sizeof(int64_t);
  auto min_of = [&](const std::string& v, const std::string& from) -> Status {
    if (v.size() != bytes) {
      return InvalidArgument("the agreement's value from " + from + " has " +
                             std::to_string(v.size()) + " bytes, not " + std::to_string(bytes));
    }
    for (size_t i = 0; i < n; ++i) {
      int64_t x;
      std::memcpy(&x, v.data() + i * sizeof x, sizeof x);
      values[i] = std::min(values[i], x);
    }
    return Status::Ok();
  };
  if (topo_.rank == 0) {
    std::vector<std::string> keys;
    for (int r = 1; r < topo_.size; ++r) keys.push_back(prefix + std::to_string(r));
    ASSIGN_OR_RETURN(std::vector<std::string> got, store->Get(keys, options_.connect_timeout));
    for (size_t k = 0; k < got.size(); ++k) RETURN_IF_ERROR(min_of(got[k], keys[k]));
    return store->Set(prefix + "min", std::string(reinterpret_cast<const char*>(values), bytes));
  }
  ASSIGN_OR_RETURN(std::vector<std::string> got,
                   store->SetAndGet(prefix + std::to_string(topo_.rank),
                                    std::string(reinterpret_cast<const char*>(values), bytes),
                                    {prefix + "min"}, options_.connect_timeout));
  if (got.size() != 1) return Internal("the agreement's result is missing");
  return min_of(got[0], prefix + "min");
}

void GlooCommunicator::AgreeMin(int64_t* values, size_t n) {
  if (topo_.size == 1 || n == 0) return;
  Guard("agreement", [&] {
    auto timeout =
        std::chrono::duration_cast<std::chrono::milliseconds>(options_.collective_timeout);
    std::vector<int64_t> in(n);
    auto out_buf = ctx_->createUnboundBuffer(values, n * sizeof(int64_t));
    auto in_buf = ctx_->createUnboundBuffer(in.data(), n * sizeof(int64_t));
    // After the round at distance d, a rank holds the min over itself and the 2d-1 ranks
    // before it; a value counted twice does not change a min.
    for (long d = 1; d < topo_.size; d <<= 1) {
      const uint64_t slot = static_cast<uint64_t>(ctx_->nextSlot());
      const int to = static_cast<int>((topo_.rank + d) % topo_.size);
      const int from = static_cast<int>((topo_.rank - d % topo_.size + topo_.size) % topo_.size);
      in_buf->recv(from, slot);
      out_buf->send(to, slot);
      if (!in_buf->waitRecv(timeout) || !out_buf->waitSend(timeout)) {
        throw WorkerLostError("the agreement was aborted");
      }
      for (size_t i = 0; i < n; ++i) values[i] = std::min(values[i], in[i]);
    }
  });
}

StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::Create(RoundStore* store,
                                                                     const Topology& topo,
                                                                     const GlooOptions& options) {
  ASSIGN_OR_RETURN(std::unique_ptr<GlooCommunicator> comm, New(topo, options));
  RETURN_IF_ERROR(comm->Connect(store));
  return comm;
}

void GlooCommunicator::Guard(const char* what, std::function<void()> fn, Duration grace) {
  auto lost = [what](const std::string& why) {
    return WorkerLostError(std::string(what) + (why.empty() ? "" : ": ") + why);
  };
  if (aborted_.load()) throw lost("the communicator was aborted (a peer is gone)");
  Collective running(this);
  if (!exec_) {
    auto ex = Executor::Take();
    MutexLock g(abort_mu_);  // Abort() reads exec_ from another thread
    exec_ = std::move(ex);
  }
  Executor& ex = *exec_;
  MutexLock lock(ex.mu);
  ex.job = std::move(fn);
  uint64_t ticket = ++ex.posted;
  ex.cv.notify_all();
  ex.cv.wait(lock.native(),
             [&]() ELASTIC_REQUIRES(ex.mu) { return ex.finished >= ticket || aborted_.load(); });
  if (ex.finished < ticket) {
    // Aborted while running: every pair is closed now; a wait Gloo left unwoken can do no
    // more I/O, and one that was about to end ends within the grace.
    bool ended = ex.cv.wait_for(lock.native(), grace,
                                [&]() ELASTIC_REQUIRES(ex.mu) { return ex.finished >= ticket; });
    if (!ended) {
      ex.abandoned = true;
      throw lost(
          "the communicator was aborted (a peer is gone); the collective is left to "
          "Gloo's timeout");
    }
  }
  std::exception_ptr error = ex.error;
  lock.Unlock();
  if (error) {
    try {
      std::rethrow_exception(error);
    } catch (const gloo::Exception& e) {
      throw lost(std::string("failed, a peer is gone: ") + e.what());
    }
  }
  if (aborted_.load()) throw lost("the communicator was aborted (a peer is gone)");
}

void GlooCommunicator::Inline(const char* what, const std::function<void()>& fn) {
  auto lost = [what](const std::string& why) {
    return WorkerLostError(std::string(what) + ": " + why);
  };
  if (aborted_.load()) throw lost("the communicator was aborted (a peer is gone)");
  Collective running(this);
  try {
    fn();
  } catch (const gloo::Exception& e) {
    throw lost(std::string("failed, a peer is gone: ") + e.what());
  } catch (const WorkerLostError& e) {
    // The local ranks waiting for this one stop waiting.
    if (host_) host_->AbortGroup();
    const std::string why = e.what();
    if (why.rfind(what, 0) == 0) throw;  // named already (the cross-host communicator's)
    throw lost(why);
  }
  if (aborted_.load()) throw lost("the communicator was aborted (a peer is gone)");
}

void GlooCommunicator::Allreduce(void* data, size_t count, DataType dtype, ReduceOp op) {
  if (count == 0) return;
  if (hier_) {
    // On the caller's thread: every wait in it ends at an abort by itself (the host's barrier
    // wakes, the cross-host communicator has its own Guard), so the two thread switches of
    // the executor would buy nothing.
    Inline("allreduce", [&] {
      HierarchicalAllreduce(topo_, host_.get(), cross_.get(), chunk_bytes_,
                            options_.collective_timeout, data, count, dtype, op);
    });
    return;
  }
  Guard("allreduce", [&] {
    if (topo_.size > 1) {
      Duration t = options_.collective_timeout;
      auto fn = ReduceFunc(dtype, op);
      switch (DataTypeSize(dtype)) {
        case 8:
          RunAllreduce<uint64_t>(ctx_, data, count, std::move(fn), t);
          break;
        case 4:
          RunAllreduce<uint32_t>(ctx_, data, count, std::move(fn), t);
          break;
        default:
          RunAllreduce<uint16_t>(ctx_, data, count, std::move(fn), t);
          break;
      }
    }
    if (op == ReduceOp::kAvg) DivideAll(data, count, dtype, topo_.size);
  });
}

void GlooCommunicator::AllreduceMany(const std::vector<TensorView>& tensors, ReduceOp op) {
  FusionOps ops;
  ops.allreduce = [&](void* data, size_t count, DataType dtype) {
    Allreduce(data, count, dtype, op);
  };
  ops.buffer = [&](size_t bytes) {
    if (fusion_.size() < bytes) fusion_.resize(bytes);
    return fusion_.data();
  };
  ops.copy = [](void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); };
  AllreduceFused(tensors, options_.fusion_bytes, ops);
}

void GlooCommunicator::Broadcast(void* data, size_t bytes, int root) {
  if (root < 0 || root >= topo_.size) {
    throw std::invalid_argument("broadcast root " + std::to_string(root) + " out of range");
  }
  if (bytes == 0 || topo_.size == 1) return;
  if (shm_collectives()) {
    Inline("broadcast", [&] { host_->Broadcast(data, bytes, root); });
    return;
  }
  RequirePairs("broadcast");
  Guard("broadcast", [&] {
    gloo::BroadcastOptions opts(ctx_);
    opts.setRoot(root);
    opts.setOutput(static_cast<uint8_t*>(data), bytes);
    opts.setTimeout(
        std::chrono::duration_cast<std::chrono::milliseconds>(options_.collective_timeout));
    gloo::broadcast(opts);
  });
}

std::vector<std::vector<char>> GlooCommunicator::Allgather(const void* data, size_t bytes) {
  std::vector<std::vector<char>> out(topo_.size);
  if (topo_.size == 1) {
    out[0].assign(static_cast<const char*>(data), static_cast<const char*>(data) + bytes);
    return out;
  }
  if (shm_collectives()) {
    Inline("allgather", [&] { out = host_->Allgather(data, bytes); });
    return out;
  }
  RequirePairs("allgather");
  Guard("allgather", [&] {
    auto timeout =
        std::chrono::duration_cast<std::chrono::milliseconds>(options_.collective_timeout);
    std::vector<int64_t> sizes(topo_.size);
    int64_t mine = static_cast<int64_t>(bytes);
    {
      gloo::AllgatherOptions opts(ctx_);
      opts.setInput(&mine, 1);
      opts.setOutput(sizes.data(), sizes.size());
      opts.setTimeout(timeout);
      gloo::allgather(opts);
    }
    std::vector<size_t> counts(sizes.begin(), sizes.end());
    size_t total = 0;
    for (size_t c : counts) total += c;
    std::vector<char> flat(std::max<size_t>(total, 1));
    std::vector<char> input(static_cast<const char*>(data), static_cast<const char*>(data) + bytes);
    input.resize(std::max<size_t>(bytes, 1));
    gloo::AllgathervOptions opts(ctx_);
    opts.setInput(input.data(), bytes);
    opts.setOutput(flat.data(), counts);
    opts.setTimeout(timeout);
    gloo::allgatherv(opts);
    size_t off = 0;
    for (int r = 0; r < topo_.size; ++r) {
      out[r].assign(flat.begin() + off, flat.begin() + off + counts[r]);
      off += counts[r];
    }
  });
  return out;
}

void GlooCommunicator::Barrier() {
  if (topo_.size == 1) return;
  if (shm_collectives()) {
    Inline("barrier", [&] { host_->Barrier(); });
    return;
  }
  RequirePairs("barrier");
  Guard("barrier", [&] {
    gloo::BarrierOptions opts(ctx_);
    opts.setTimeout(
        std::chrono::duration_cast<std::chrono::milliseconds>(options_.collective_timeout));
    gloo::barrier(opts);
  });
}

void GlooCommunicator::Abort() {
  aborted_.store(true);
  {
    MutexLock g(abort_mu_);
    if (host_) host_->Abort();
    if (shm_) shm_->Abort();  // still connecting: the segment, not yet the host's communicator
    if (cross_) cross_->Abort();
    try {
      Signal(pairs_, "aborted: a peer of this round is gone");
    } catch (const std::exception&) {
      // Signalling pairs that already failed may throw; the flag above is what later calls
      // check.
    }
  }
  std::shared_ptr<Executor> ex;
  {
    MutexLock g(abort_mu_);
    ex = exec_;
  }
  if (ex) {
    MutexLock g(ex->mu);
    ex->cv.notify_all();
  }
}

}  // namespace elastic::worker_agent
