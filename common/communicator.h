// The abstract collective Communicator. state/ syncs through it without knowing Gloo or NCCL;
// worker_agent/ implements it (GlooCommunicator; NcclCommunicator, a DeviceCommunicator).
//
// Collectives are called by every rank in the same order. They block until done and are not
// thread-safe against each other; Abort() is the one method that may be called from another
// thread. A collective that fails because a peer is gone, or because Abort() was called,
// throws WorkerLostError.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace elastic {

// A collective failed because a peer of this round is gone: roll back and re-form.
class WorkerLostError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The driver announced a membership change, and this rank stopped at a commit to re-form.
class HostsUpdated : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The one list of each: the Python binding hands these codes (and DataTypeName /
// ReduceOpName) to the elastic package, which names them (python/src/module.cc).
enum class DataType { kF32, kF64, kF16, kBF16, kI32, kI64 };
enum class ReduceOp { kSum, kAvg, kMin, kMax };
inline constexpr DataType kDataTypes[] = {DataType::kF32,  DataType::kF64, DataType::kF16,
                                          DataType::kBF16, DataType::kI32, DataType::kI64};
inline constexpr ReduceOp kReduceOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin,
                                          ReduceOp::kMax};

size_t DataTypeSize(DataType dtype);
const char* DataTypeName(DataType dtype);
const char* ReduceOpName(ReduceOp op);

// A view of `count` elements of `dtype` at `data`; not owned.
struct TensorView {
  void* data = nullptr;
  size_t count = 0;
  DataType dtype = DataType::kF32;
};

// The fusion buckets of AllreduceMany: consecutive tensors of one dtype that fit together in
// `cap` bytes. Calls `bucket(begin, end, bytes)` for each bucket of two or more tensors, and
// `alone(tensor)` for a tensor that is too big to fuse or alone in its bucket (reduced in
// place, without copies).
void ForEachFusionBucket(const std::vector<TensorView>& tensors, size_t cap,
                         const std::function<void(const TensorView&)>& alone,
                         const std::function<void(size_t begin, size_t end, size_t bytes)>& bucket);

// What a communicator's AllreduceMany does through its fusion buffer, by AllreduceFused:
// `allreduce` reduces in place; `buffer(bytes)` is the fusion buffer, at least that big;
// `copy(dst, src, bytes)` copies to or from it; `after_bucket` (optional) runs after a bucket's
// copies out.
struct FusionOps {
  std::function<void(void* data, size_t count, DataType dtype)> allreduce;
  std::function<char*(size_t bytes)> buffer;
  std::function<void(void* dst, const void* src, size_t bytes)> copy;
  std::function<void()> after_bucket;
};
// AllreduceMany over ForEachFusionBucket: a tensor alone is reduced in place; a bucket is
// copied into the buffer, reduced there in one call, and copied back out.
void AllreduceFused(const std::vector<TensorView>& tensors, size_t cap, const FusionOps& ops);

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual int local_rank() const = 0;
  virtual int local_size() const = 0;
  virtual int cross_rank() const = 0;
  virtual int cross_size() const = 0;

  // In-place allreduce of `count` elements. kAvg divides the sum by size() (integers truncate).
  virtual void Allreduce(void* data, size_t count, DataType dtype, ReduceOp op) = 0;
  // Allreduces many tensors through a fusion buffer: one collective per bucket of tensors of
  // one dtype. Equivalent to calling Allreduce on each tensor.
  virtual void AllreduceMany(const std::vector<TensorView>& tensors, ReduceOp op) = 0;
  // Broadcasts `bytes` bytes from `root` into `data` on every other rank.
  virtual void Broadcast(void* data, size_t bytes, int root) = 0;
  // Gathers each rank's bytes (sizes may differ); result[i] is rank i's contribution.
  virtual std::vector<std::vector<char>> Allgather(const void* data, size_t bytes) = 0;
  virtual void Barrier() = 0;
  // Fails any collective in flight (and every later one) with WorkerLostError. Thread-safe.
  virtual void Abort() = 0;
};

// A Communicator whose buffers are device (CUDA) memory: NCCL's (elastic-run --backend nccl).
class DeviceCommunicator : public Communicator {
 public:
  // The CUDA stream the collectives run on (a cudaStream_t; nullptr: the legacy default
  // stream). Each collective waits for its own work on that stream to finish.
  virtual void set_stream(void* stream) = 0;
  // The CUDA device this rank uses.
  virtual int device() const = 0;
};

}  // namespace elastic
