// ShmCommunicator: the ranks of one host as a Communicator of their own, through the POSIX
// shared-memory segment of a ShmGroup (worker_agent/shm_group.h).
//
// When every rank of the round is on this host, it is the round's communicator for allreduce,
// broadcast, allgather and barrier (GlooCommunicator hands them to it; its Gloo pairs are then
// never connected). When the round spans hosts it is the host stage of HierarchicalAllreduce
// (worker_agent/hierarchical.h), which composes it with a cross-host communicator.
//
// Collectives are called by every local rank in the same order, from one thread at a time;
// Abort() may come from any thread. A collective fails with WorkerLostError when a local rank
// is gone, when any local rank aborted the segment, or at the collective timeout.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <vector>

#include "common/clock.h"
#include "worker_agent/communicator_base.h"
#include "worker_agent/shm_group.h"

namespace elastic::worker_agent {

class ShmCommunicator : public CommunicatorBase<> {
 public:
  // `topo`: the round's; `group` holds its local ranks (local_rank / local_size of topo).
  // `chunk_bytes`: the size an allreduce is cut into (every host of the round the same: the
  // cross-host ring reduces a chunk at a time).
  ShmCommunicator(const Topology& topo, std::unique_ptr<ShmGroup> group, size_t chunk_bytes,
                  Duration collective_timeout);

  // Every rank of the round on this host (cross_size 1), or a logic_error: the host's part of
  // a wider round is HierarchicalAllreduce's.
  void Allreduce(void* data, size_t count, DataType dtype, ReduceOp op) override;
  // A tensor at a time: the segment's chunks are the batching, a fusion buffer would add a
  // copy.
  void AllreduceMany(const std::vector<TensorView>& tensors, ReduceOp op) override;
  void Broadcast(void* data, size_t bytes, int root) override;
  std::vector<std::vector<char>> Allgather(const void* data, size_t bytes) override;
  void Barrier() override;
  void Abort() override;

  // --- the host stage of a hierarchical allreduce, a chunk at a time -----------------------
  // Reduces `n` elements of `mine` (this rank's chunk) over the local ranks with `op` into the
  // chunk's shared result, which it returns (`n` elements; local rank 0 reduces it across
  // hosts). Local rank r reduces slice r, reading its own slice from `mine`, which is never
  // copied in. `finish_here` (one host: nothing else to add): the result is also written back
  // into `mine`'s own slice, divided by `average_over` when that is > 0. Ends with a barrier:
  // every slice of the result is complete when it returns.
  char* ReduceChunk(char* mine, size_t n, DataType dtype, ReduceOp op, bool finish_here,
                    int average_over, TimePoint deadline);
  // After ReduceChunk(finish_here): copies the other slices of the result into `mine`.
  void CopyOthersOut(char* mine, size_t n, DataType dtype) const;
  // Waits for every local rank (and the deadline, and aborts).
  void HostBarrier(TimePoint deadline) { group_->Barrier(aborted_, deadline); }
  size_t chunk_bytes() const { return chunk_bytes_; }
  Duration collective_timeout() const { return timeout_; }

  uint64_t token() const { return group_->token(); }
  // Fails the segment's waits in every local rank (the host's peers stop waiting for this
  // one); thread-safe.
  void AbortGroup() { group_->Abort(); }
  // The segment, for a later round (ShmKeeper); the communicator is unusable after it.
  std::unique_ptr<ShmGroup> Release() { return std::move(group_); }

 private:
  // The half of the segment the next chunk uses: consecutive chunks alternate, so a chunk
  // needs no barrier after its copy-out.
  int NextHalf() { return static_cast<int>(chunks_++ & 1); }

  std::unique_ptr<ShmGroup> group_;
  const size_t chunk_bytes_;
  const Duration timeout_;
  std::atomic<bool> aborted_{false};
  uint64_t chunks_ = 0;  // chunks so far, in every collective: which half is next
  // The current chunk of ReduceChunk: its half and this rank's slice [begin_, end_).
  int half_ = 0;
  size_t begin_ = 0, end_ = 0;
};

}  // namespace elastic::worker_agent
