#include "worker_agent/nccl_communicator.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "common/mutex.h"

namespace elastic::worker_agent {
namespace {

constexpr const char* kIdKey = "nccl/id";

std::string Secs(Duration d) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", std::chrono::duration<double>(d).count());
  return buf;
}

// A wait loop's pause: spin briefly (a small collective is done in microseconds), then sleep
// a little so that a long one does not burn a core.
void Pause(int iteration) {
  if (iteration < 200) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(iteration < 2000 ? 20 : 200));
  }
}

}  // namespace

const char* NcclCommunicator::PhaseName(Phase p) {
  switch (p) {
    case Phase::kCreated: return "created";
    case Phase::kInitializing: return "initializing";
    case Phase::kReady: return "ready";
    case Phase::kRevoked: return "revoked";
    case Phase::kAborted: return "aborted";
    case Phase::kFailed: return "failed";
  }
  return "?";
}

NcclCommunicator::NcclCommunicator(std::shared_ptr<NcclApi> api, Topology topo, int device,
                                   NcclOptions options)
    : CommunicatorBase(topo), api_(std::move(api)), device_(device), options_(options) {
  nccl_rank_of_.resize(topo_.size);
  for (int r = 0; r < topo_.size; ++r) nccl_rank_of_[r] = r;
}

StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::New(std::shared_ptr<NcclApi> api,
                                                                  const Topology& topo,
                                                                  int device,
                                                                  const NcclOptions& options) {
  if (!api) return InvalidArgument("no NCCL library");
  if (topo.size < 1 || topo.rank < 0 || topo.rank >= topo.size) {
    return InvalidArgument("bad topology: rank " + std::to_string(topo.rank) + " of " +
                           std::to_string(topo.size));
  }
  if (device < 0) return InvalidArgument("bad CUDA device " + std::to_string(device));
  RETURN_IF_ERROR(api->SetDevice(device).WithContext("CUDA device " + std::to_string(device)));
  std::unique_ptr<NcclCommunicator> c(new NcclCommunicator(std::move(api), topo, device, options));
  RETURN_IF_ERROR(c->api_->EventCreate(&c->event_));
  return c;
}

NcclCommunicator::~NcclCommunicator() {
  MutexLock g(mu_);
  // Never a destroy (it waits for peers that may be dead): abort releases it at once.
  if (comm_) api_->CommAbort(comm_);
  comm_ = nullptr;
  if (fusion_) (void)api_->Free(fusion_);
  if (scratch_) (void)api_->Free(scratch_);
  if (event_) (void)api_->EventDestroy(event_);
}

NcclCommunicator::Phase NcclCommunicator::phase() const {
  MutexLock g(mu_);
  return phase_;
}

std::string NcclCommunicator::Describe(int result) {
  std::string s = api_->ErrorString(result);
  std::string last = comm_ ? api_->LastError(comm_) : "";
  if (!last.empty()) s += " (" + last + ")";
  return s;
}

int NcclCommunicator::AsyncState(NcclApi::Comm comm) {
  int async = NcclApi::kSuccess;
  int r = api_->CommGetAsyncError(comm, &async);
  return r != NcclApi::kSuccess ? r : async;
}

Status NcclCommunicator::PollReady(const char* what, Duration timeout) {
  const TimePoint deadline = SteadyClock::now() + timeout;
  for (int i = 0;; ++i) {
    {
      MutexLock g(mu_);
      if (aborted_.load() || !comm_) return Aborted(std::string(what) + ": aborted");
      const int async = AsyncState(comm_);
      if (async == NcclApi::kSuccess) return Status();
      if (async != NcclApi::kInProgress) {
        std::string why = Describe(async);
        phase_ = Phase::kFailed;
        api_->CommAbort(comm_);
        comm_ = nullptr;
        return Unavailable(std::string(what) + " failed: " + why);
      }
    }
    if (SteadyClock::now() > deadline) {
      Abort();
      {
        MutexLock g(mu_);
        phase_ = Phase::kFailed;
      }
      return DeadlineExceeded(std::string(what) + " did not finish within " +
                              Secs(timeout) + " (a peer is gone or stuck)");
    }
    Pause(i);
  }
}

Status NcclCommunicator::Connect(RoundStore* store) {
  std::string id;
  if (topo_.rank == 0) {
    int r = api_->GetUniqueId(&id);
    if (r != NcclApi::kSuccess) return Unavailable("ncclGetUniqueId: " + api_->ErrorString(r));
    RETURN_IF_ERROR(store->Set(kIdKey, id).WithContext("publishing the NCCL id"));
  } else {
    auto got = store->Get({kIdKey}, options_.init_timeout);
    if (!got.ok()) {
      if (aborted_.load()) return Aborted("NCCL init: aborted while waiting for rank 0's id");
      return got.status().WithContext("waiting for rank 0's NCCL id");
    }
    id = (*got)[0];
    if (id.size() != static_cast<size_t>(NcclApi::kUniqueIdBytes)) {
      return InvalidArgument("rank 0's NCCL id has " + std::to_string(id.size()) +
                             " bytes, not " + std::to_string(NcclApi::kUniqueIdBytes));
    }
  }
  RETURN_IF_ERROR(Start("NCCL init", "ncclCommInitRankConfig", [&](NcclApi::Comm* c) {
    return api_->CommInitRank(c, topo_.size, id, topo_.rank);
  }));
  return Finish("NCCL init");
}

Status NcclCommunicator::Start(const char* what, const char* call,
                               const std::function<int(NcclApi::Comm*)>& create) {
  MutexLock g(mu_);
  if (aborted_.load()) return Aborted(std::string(what) + ": aborted");
  if (phase_ != Phase::kCreated) return FailedPrecondition("NCCL communicator connected twice");
  RETURN_IF_ERROR(api_->SetDevice(device_));
  NcclApi::Comm c = nullptr;
  int r = create(&c);
  comm_ = c;
  if (r != NcclApi::kSuccess && r != NcclApi::kInProgress) {
    std::string why = Describe(r);
    if (comm_) api_->CommAbort(comm_);
    comm_ = nullptr;
    phase_ = Phase::kFailed;
    return Unavailable(std::string(call) + ": " + why);
  }
  phase_ = Phase::kInitializing;
  return Status();
}

Status NcclCommunicator::Finish(const char* what) {
  RETURN_IF_ERROR(PollReady(what, options_.init_timeout));
  MutexLock g(mu_);
  if (aborted_.load()) return Aborted(std::string(what) + ": aborted");
  phase_ = Phase::kReady;
  return Status();
}

Status NcclCommunicator::ConnectByShrink(DeviceRoundCommunicator* device_parent,
                                         const std::vector<int>& exclude,
                                         std::vector<int> nccl_rank_of) {
  auto* parent = dynamic_cast<NcclCommunicator*>(device_parent);
  if (parent == nullptr)
    return FailedPrecondition("shrink: the parent is not an NCCL communicator");
  if (!api_->has_shrink()) {
    return FailedPrecondition("NCCL " + std::to_string(api_->version()) + " has no ncclCommShrink");
  }
  if (static_cast<int>(nccl_rank_of.size()) != topo_.size) {
    return InvalidArgument("shrink: a rank map of " + std::to_string(nccl_rank_of.size()) +
                           " for " + std::to_string(topo_.size) + " ranks");
  }
  {
    // A revoked parent must be quiescent before it is shrunk.
    MutexLock g(parent->mu_);
    if (!parent->comm_ || (parent->phase_ != Phase::kReady && parent->phase_ != Phase::kRevoked)) {
      return FailedPrecondition(std::string("shrink: the parent communicator is ") +
                                PhaseName(parent->phase_));
    }
  }
  const TimePoint deadline = SteadyClock::now() + options_.init_timeout;
  for (int i = 0;; ++i) {
    MutexLock g(parent->mu_);
    if (!parent->comm_) return FailedPrecondition("shrink: the parent was released meanwhile");
    if (AsyncState(parent->comm_) != NcclApi::kInProgress) break;  // quiescent (an old error does not matter)
    if (SteadyClock::now() > deadline) return DeadlineExceeded("shrink: the parent stays busy");
    if (aborted_.load()) return Aborted("NCCL shrink: aborted");
    Pause(i);
  }
  {
    MutexLock pg(parent->mu_);
    if (!parent->comm_) return FailedPrecondition("shrink: the parent was released meanwhile");
    RETURN_IF_ERROR(
        Start("NCCL shrink", "ncclCommShrink", [&](NcclApi::Comm* c) ELASTIC_REQUIRES(parent->mu_) {
          return api_->CommShrink(parent->comm_, exclude, c);
        }));
  }
  nccl_rank_of_ = std::move(nccl_rank_of);
  return Finish("NCCL shrink");
}

void NcclCommunicator::Abort() {
  aborted_.store(true);
  MutexLock g(mu_);
  switch (phase_) {
    case Phase::kInitializing:  // a pending init or shrink: abort is how NCCL cancels it
      if (comm_) api_->CommAbort(comm_);
      comm_ = nullptr;
      phase_ = Phase::kAborted;
      break;
    case Phase::kReady:
      // Revoke stops the kernels in flight and keeps the handle, so the next round can shrink
      // it; without revoke, abort frees it.
      if (api_->has_revoke() && api_->CommRevoke(comm_) == NcclApi::kSuccess) {
        phase_ = Phase::kRevoked;
      } else {
        api_->CommAbort(comm_);
        comm_ = nullptr;
        phase_ = Phase::kAborted;
      }
      break;
    case Phase::kCreated:
      phase_ = Phase::kAborted;
      break;
    default:
      break;
  }
}

void NcclCommunicator::Fail(const std::string& what) {
  NoteRunning(false);
  throw WorkerLostError(what);
}

void NcclCommunicator::Run(const char* what, const std::function<int(NcclApi::Comm)>& enqueue) {
  NoteStarted(SteadyClock::now().time_since_epoch().count());
  NoteRunning(true);
  int r;
  {
    MutexLock g(mu_);
    if (aborted_.load() || phase_ != Phase::kReady) {
      Fail(std::string("NCCL ") + what + ": the communicator is " + PhaseName(phase_) +
           " (a peer of this round is gone)");
    }
    // cudaSetDevice is per thread: a collective may come from any thread (Python's
    // DistributedOptimizer reduces on its own).
    Status dev = api_->SetDevice(device_);
    if (!dev.ok()) Fail(dev.message());
    r = enqueue(comm_);
  }
  if (r == NcclApi::kInProgress) {  // a non-blocking enqueue still in progress
    Status s = PollReady(what, options_.collective_timeout);
    if (!s.ok()) Fail(std::string("NCCL ") + what + ": " + s.message());
  } else if (r != NcclApi::kSuccess) {
    std::string why;
    {
      MutexLock g(mu_);
      why = Describe(r);
    }
    Fail(std::string("NCCL ") + what + ": " + why);
  }
  WaitStream(what);
}

void NcclCommunicator::WaitStream(const char* what) {
  NoteRunning(true);
  Status rec = api_->EventRecord(event_, stream_);
  if (!rec.ok()) Fail(std::string("NCCL ") + what + ": " + rec.message());
  const TimePoint deadline = SteadyClock::now() + options_.collective_timeout;
  for (int i = 0;; ++i) {
    if (aborted_.load()) Fail(std::string("NCCL ") + what + ": aborted (a peer of this round is gone)");
    Status q = api_->EventQuery(event_);
    if (q.ok()) break;
    if (q.code() != Code::kUnavailable) Fail(std::string("NCCL ") + what + ": " + q.message());
    if (i % 64 == 63) {  // NCCL's async error: a peer failed under us
      MutexLock g(mu_);
      if (comm_) {
        const int async = AsyncState(comm_);
        if (async != NcclApi::kSuccess && async != NcclApi::kInProgress) {
          std::string why = Describe(async);
          api_->CommAbort(comm_);
          comm_ = nullptr;
          phase_ = Phase::kFailed;
          Fail(std::string("NCCL ") + what + ": " + why);
        }
      }
    }
    if (SteadyClock::now() > deadline) {
      Abort();
      Fail(std::string("NCCL ") + what + " did not finish within " +
           Secs(options_.collective_timeout));
    }
    Pause(i);
  }
  NoteRunning(false);
}

void* NcclCommunicator::Grow(void** buf, size_t* size, size_t bytes, const char* what) {
  if (*size < bytes) {
    if (*buf) (void)api_->Free(*buf);
    *buf = nullptr;
    *size = 0;
    Status s = api_->Malloc(buf, bytes);
    if (!s.ok()) throw std::runtime_error(std::string("NCCL ") + what + " buffer: " + s.message());
    *size = bytes;
  }
  return *buf;
}

void NcclCommunicator::Allreduce(void* data, size_t count, DataType dtype, ReduceOp op) {
  if (count == 0) return;
  Run("allreduce", [&](NcclApi::Comm c) {
    return api_->AllReduce(data, data, count, dtype, op, c, stream_);
  });
}

void NcclCommunicator::AllreduceMany(const std::vector<TensorView>& tensors, ReduceOp op) {
  FusionOps ops;
  ops.allreduce = [&](void* data, size_t count, DataType dtype) {
    Allreduce(data, count, dtype, op);
  };
  ops.buffer = [&](size_t bytes) {
    return static_cast<char*>(Grow(&fusion_, &fusion_size_, bytes, "fusion"));
  };
  ops.copy = [&](void* dst, const void* src, size_t bytes) {
    Status s = api_->MemcpyAsync(dst, src, bytes, stream_);
    if (!s.ok()) throw std::runtime_error("NCCL fusion copy: " + s.message());
  };
  ops.after_bucket = [&] { WaitStream("fusion copy-out"); };
  AllreduceFused(tensors, options_.fusion_bytes, ops);
}

void NcclCommunicator::Broadcast(void* data, size_t bytes, int root) {
  if (root < 0 || root >= topo_.size) {
    throw std::invalid_argument("broadcast root " + std::to_string(root) + " out of range");
  }
  if (bytes == 0) return;
  const int nroot = nccl_rank_of_[root];
  Run("broadcast",
      [&](NcclApi::Comm c) { return api_->Broadcast(data, data, bytes, nroot, c, stream_); });
}

std::vector<std::vector<char>> NcclCommunicator::Allgather(const void* data, size_t bytes) {
  const int n = topo_.size;
  // Sizes first (they may differ by rank), then every contribution padded to the largest.
  int64_t mine = static_cast<int64_t>(bytes);
  char* scratch = static_cast<char*>(Grow(&scratch_, &scratch_bytes_, sizeof(int64_t) * (n + 1), "scratch"));
  std::vector<int64_t> sizes(n);
  auto check = [](const Status& s) {
    if (!s.ok()) throw std::runtime_error("NCCL allgather: " + s.message());
  };
  check(api_->MemcpyAsync(scratch, &mine, sizeof mine, stream_));
  Run("allgather sizes", [&](NcclApi::Comm c) {
    return api_->AllGather(scratch, scratch + sizeof(int64_t), sizeof(int64_t), c, stream_);
  });
  check(api_->MemcpyAsync(sizes.data(), scratch + sizeof(int64_t), sizeof(int64_t) * n, stream_));
  check(api_->StreamSynchronize(stream_));
  const size_t max = static_cast<size_t>(*std::max_element(sizes.begin(), sizes.end()));
  std::vector<std::vector<char>> out(n);
  if (max > 0) {
    char* buf = static_cast<char*>(Grow(&fusion_, &fusion_size_, max * (n + 1), "fusion"));
    if (bytes) check(api_->MemcpyAsync(buf, data, bytes, stream_));
    Run("allgather", [&](NcclApi::Comm c) {
      return api_->AllGather(buf, buf + max, max, c, stream_);
    });
    std::vector<char> host(max * n);
    check(api_->MemcpyAsync(host.data(), buf + max, max * n, stream_));
    check(api_->StreamSynchronize(stream_));
    for (int r = 0; r < n; ++r) {
      const int from = nccl_rank_of_[r];
      const char* p = host.data() + max * from;
      out[r].assign(p, p + sizes[from]);
    }
  }
  return out;
}

void NcclCommunicator::Barrier() {
  void* one = Grow(&scratch_, &scratch_bytes_, sizeof(int32_t), "scratch");
  Run("barrier", [&](NcclApi::Comm c) {
    return api_->AllReduce(one, one, 1, DataType::kI32, ReduceOp::kSum, c, stream_);
  });
}

namespace {
class NcclFactory : public DeviceCommunicatorFactory {
 public:
  NcclFactory(std::shared_ptr<NcclApi> api, NcclOptions options)
      : api_(std::move(api)), options_(options) {}
  bool can_shrink() const override { return api_->has_shrink(); }
  StatusOr<std::unique_ptr<DeviceRoundCommunicator>> New(const Topology& topo,
                                                         const std::string& host) override {
    ASSIGN_OR_RETURN(int device,
                     DeviceForLocalRank(api_.get(), topo.local_rank, topo.local_size, host));
    ASSIGN_OR_RETURN(auto made, NcclCommunicator::New(api_, topo, device, options_));
    return std::unique_ptr<DeviceRoundCommunicator>(std::move(made));
  }

 private:
  const std::shared_ptr<NcclApi> api_;
  const NcclOptions options_;
};
}  // namespace

std::shared_ptr<DeviceCommunicatorFactory> MakeNcclFactory(std::shared_ptr<NcclApi> api,
                                                           NcclOptions options) {
  return std::make_shared<NcclFactory>(std::move(api), options);
}

StatusOr<int> DeviceForLocalRank(NcclApi* api, int local_rank, int local_size,
                                 const std::string& host) {
  int count = 0;
  Status s = api->DeviceCount(&count);
  if (!s.ok()) count = 0;
  if (local_size > count || local_rank >= count) {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    return FailedPrecondition(
        "host " + host + " runs " + std::to_string(local_size) + " worker(s) but this process " +
        "sees " + std::to_string(count) + " CUDA device(s)" +
        (visible ? std::string(" (CUDA_VISIBLE_DEVICES=") + visible + ")" : std::string()) +
        (s.ok() ? std::string() : " [" + s.message() + "]") +
        ": the NCCL backend needs one GPU per worker; give the host at most " +
        std::to_string(count) + " slot(s) (-H " + host + ":" + std::to_string(count) +
        ") or use --backend gloo");
  }
  return local_rank;
}

}  // namespace elastic::worker_agent
