// NcclCommunicator: the Communicator over NCCL, on device buffers, for the collectives of a
// GPU job (gradients, parameters). The agent keeps a GlooCommunicator beside it for what must
// run on the CPU (the commit agreement, CPU state sync).
//
// Every NCCL communicator is non-blocking (config.blocking = 0): init, shrink and every
// collective are polled with a deadline, so a rank that dies or hangs never blocks the others
// past it, and Abort() (from the agent's Watch thread, on the driver's ABORT) is honoured while
// they wait. Abort() revokes the communicator (ncclCommRevoke, NCCL >= 2.28.7: the handle stays
// valid, so the survivors can shrink it) or else aborts it (ncclCommAbort). A communicator is
// always released with ncclCommAbort, never with a destroy that waits for dead peers.
//
// Lifecycle (phase()): kCreated -> Connect()/ConnectByShrink() -> kInitializing -> kReady.
// Abort() in kInitializing -> kAborted; in kReady -> kRevoked (or kAborted without revoke).
// A failed init, a collective's async error or its deadline -> kFailed. Only kReady runs
// collectives; every other phase throws WorkerLostError.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/common.h"
#include "common/mutex.h"
#include "worker_agent/communicator_base.h"
#include "worker_agent/nccl_api.h"
#include "worker_agent/round_communicator.h"
#include "worker_agent/store.h"
#include "worker_agent/topology.h"

namespace elastic::worker_agent {

struct NcclOptions {
  Duration init_timeout = std::chrono::seconds(60);
  Duration collective_timeout = std::chrono::seconds(300);
  size_t fusion_bytes = 64u << 20;  // the device fusion buffer of AllreduceMany
};

class NcclCommunicator : public CommunicatorBase<DeviceRoundCommunicator> {
 public:
  enum class Phase { kCreated, kInitializing, kReady, kRevoked, kAborted, kFailed };
  static const char* PhaseName(Phase p);

  // A communicator for `topo` on CUDA device `device`, not connected yet. INVALID_ARGUMENT
  // for a bad topology or device.
  static StatusOr<std::unique_ptr<NcclCommunicator>> New(std::shared_ptr<NcclApi> api,
                                                         const Topology& topo, int device,
                                                         const NcclOptions& options);
  ~NcclCommunicator() override;

  // A fresh communicator: rank 0 makes an ncclUniqueId and publishes it in the round's store
  // (key "nccl/id"), every other rank waits for it there; then each inits (non-blocking) and
  // polls until ready. ABORTED after Abort(); DEADLINE_EXCEEDED past the init timeout;
  // UNAVAILABLE with NCCL's message when init fails (a peer died). Call once.
  Status Connect(RoundStore* store) override;
  // The survivors of `parent`'s round build this one from it with ncclCommShrink
  // (NCCL_SHRINK_ABORT), leaving out the parent's ranks `exclude`. NCCL numbers the survivors
  // in the order of their parent ranks; `nccl_rank_of[r]` is where this round's rank r is in
  // the result (Broadcast's root and Allgather's order are translated through it). Every
  // survivor must call it, with the same `exclude`. Errors as Connect; FAILED_PRECONDITION when
  // the parent cannot be shrunk (the library has no shrink, or the parent was aborted).
  // FAILED_PRECONDITION too when `parent` is not an NcclCommunicator.
  Status ConnectByShrink(DeviceRoundCommunicator* parent, const std::vector<int>& exclude,
                         std::vector<int> nccl_rank_of) override;

  void set_stream(void* stream) override { stream_ = stream; }
  int device() const override { return device_; }
  // This rank's number inside the NCCL communicator (its round rank unless shrunk).
  int nccl_rank() const { return nccl_rank_of_[topo_.rank]; }
  int device_rank() const override { return nccl_rank(); }
  Phase phase() const;
  bool shrinkable() const override {
    const Phase p = phase();
    return p == Phase::kReady || p == Phase::kRevoked;
  }
  CollectiveStats stats() const override { return collective_stats(); }

  // Device buffers. Allgather's source may be device or host memory; its result is on the host.
  void Allreduce(void* data, size_t count, DataType dtype, ReduceOp op) override;
  void AllreduceMany(const std::vector<TensorView>& tensors, ReduceOp op) override;
  void Broadcast(void* data, size_t bytes, int root) override;
  std::vector<std::vector<char>> Allgather(const void* data, size_t bytes) override;
  void Barrier() override;
  void Abort() override;

 private:
  NcclCommunicator(std::shared_ptr<NcclApi> api, Topology topo, int device, NcclOptions options);
  // Polls the communicator's async state until it leaves kInProgress (init, shrink, an
  // enqueue): OK when ready; ABORTED after Abort(); DEADLINE_EXCEEDED; UNAVAILABLE on error.
  Status PollReady(const char* what, Duration timeout);
  // Init and shrink alike: under the lock, `create` makes the communicator (kInitializing), or
  // its error fails this one (UNAVAILABLE naming `call`); Finish() polls it to kReady.
  Status Start(const char* what, const char* call,
               const std::function<int(NcclApi::Comm*)>& create);
  Status Finish(const char* what);
  // ncclCommGetAsyncError's verdict: kSuccess, kInProgress or an error (the call's own
  // error when the query itself fails).
  int AsyncState(NcclApi::Comm comm);
  // Enqueues `enqueue(comm)` on the stream under the lock and waits for it (see WaitStream).
  void Run(const char* what, const std::function<int(NcclApi::Comm)>& enqueue);
  // Records the event on the stream and waits for it, checking Abort(), NCCL's async error
  // and the collective deadline; throws WorkerLostError for each.
  void WaitStream(const char* what);
  [[noreturn]] void Fail(const std::string& what);
  // A device buffer (`*buf` of `*size` bytes), grown to at least `bytes` on demand.
  void* Grow(void** buf, size_t* size, size_t bytes, const char* what);
  std::string Describe(int result) ELASTIC_REQUIRES(mu_);

  std::shared_ptr<NcclApi> api_;
  int device_;
  NcclOptions options_;
  std::vector<int> nccl_rank_of_;  // this round's rank -> NCCL rank
  void* stream_ = nullptr;
  NcclApi::Event event_ = nullptr;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  void* fusion_ = nullptr;
  size_t fusion_size_ = 0;
  mutable Mutex mu_;  // Abort() comes from another thread
  NcclApi::Comm comm_ ELASTIC_GUARDED_BY(mu_) = nullptr;
  Phase phase_ ELASTIC_GUARDED_BY(mu_) = Phase::kCreated;
  std::atomic<bool> aborted_{false};
};

// The factory of NcclCommunicators over `api` with `options`: what the Agent builds each
// round's device communicator with.
std::shared_ptr<DeviceCommunicatorFactory> MakeNcclFactory(std::shared_ptr<NcclApi> api,
                                                           NcclOptions options);

// Which CUDA device the worker with `local_rank` uses: local_rank itself, among the devices
// CUDA shows this process (CUDA_VISIBLE_DEVICES applies). FAILED_PRECONDITION naming the host's
// visible device count and the fix when there are fewer than local_size.
StatusOr<int> DeviceForLocalRank(NcclApi* api, int local_rank, int local_size,
                                 const std::string& host);

}  // namespace elastic::worker_agent
