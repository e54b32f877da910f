// ShmGroup: the ranks of one host sharing a POSIX shared-memory segment, for the hierarchical
// allreduce of GlooCommunicator (ranks of a host reduce through memory; one rank per host
// takes part in the cross-host ring).
//
// The segment holds a header (a barrier, an abort flag, each local rank's pid) and two halves
// of `local_size` slots of `slot_bytes` each; consecutive chunks of an allreduce alternate
// between the halves, so a chunk needs no barrier after its copy-out.
//
// Local rank 0 creates the segment (Create) under a random name and publishes Describe()
// through the round's store; the others Open() it. The creator unlinks the name once every
// local rank has it mapped (Unlink), so nothing is left in /dev/shm when processes die.
//
// A segment can serve later rounds of the same processes (ShmKeeper): mapping a new one in
// every local rank, and the first touch of each of its pages, is most of a round change's
// cost on a host with many ranks. Local rank 0 offers it (DescribeReuse) only when every
// process that ever mapped it is quiet (its communicator is gone, Quiesce) or dead
// (AllMappersQuiet): a removed worker that is alive, stopped in the middle of a copy into its
// slot, could otherwise write into a slot of the new round.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "common/common.h"
#include "common/mutex.h"

namespace elastic::worker_agent {

class ShmGroup {
 public:
  // Ranks a segment holds at most (the pid table in the header).
  static constexpr int kMaxLocalSize = 512;

  // The slot size used when none is given: a half of about 4 MiB, slots of 64 KiB to 1 MiB.
  static size_t DefaultSlotBytes(int local_size);

  // A new segment for `local_size` ranks (this process is local rank 0). UNAVAILABLE, with
  // the reason, when /dev/shm cannot hold it (space is reserved up front: a full tmpfs fails
  // here, not with SIGBUS in the middle of a collective).
  static StatusOr<std::unique_ptr<ShmGroup>> Create(int local_size, size_t slot_bytes);
  // Maps the segment `description` (Describe() of local rank 0) as `local_rank`.
  static StatusOr<std::unique_ptr<ShmGroup>> Open(const std::string& description, int local_rank,
                                                  int local_size);
  ~ShmGroup();
  ShmGroup(const ShmGroup&) = delete;
  ShmGroup& operator=(const ShmGroup&) = delete;

  // What the others pass to Open(): the segment's name, a random token and its geometry.
  std::string Describe() const;
  // What local rank 0 publishes when a new round reuses this segment: "reuse <token>"; the
  // others take theirs from their ShmKeeper when it has the same token.
  std::string DescribeReuse() const;
  static bool ParseReuse(const std::string& description, uint64_t* token);
  uint64_t token() const { return token_; }
  // Whether a round of `local_size` ranks fits (no more than the segment was made for).
  bool Fits(int local_size) const { return local_size >= 1 && local_size <= capacity_; }
  // This process's collectives on the segment are over (its communicator is gone).
  void Quiesce();
  // Local rank 0, before offering the segment to a new round: every process that mapped it is
  // quiet or gone.
  bool AllMappersQuiet() const;
  // Takes part in a new round as `local_rank` of `local_size`. Local rank 0 calls it first
  // (before it publishes DescribeReuse; it resets the barrier), the others after.
  void Reuse(int local_rank, int local_size);
  // Removes the segment's name (the creator, once every local rank has mapped it). Idempotent.
  void Unlink();

  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  size_t slot_bytes() const { return slot_bytes_; }
  char* slot(int half, int local_rank) const;
  // A half's slots are contiguous: slot(half, 0) starts half_bytes() of them.
  size_t half_bytes() const { return slot_bytes_ * static_cast<size_t>(local_size_); }

  // Waits until every local rank has called Barrier() as often as this one. Throws
  // WorkerLostError when this group or `aborted` is aborted, when a local rank's process is
  // gone, or at `deadline`.
  void Barrier(const std::atomic<bool>& aborted, TimePoint deadline);
  // Fails every local rank's Barrier() (now and later). Thread-safe; any process may call it.
  void Abort();

 private:
  struct Header;
  ShmGroup() = default;
  void CheckPeersAlive() const;

  std::string name_;
  int mapper_ = 0;  // this process's index among those that mapped it (its first local rank)
  int capacity_ = 1;
  bool owner_ = false;
  bool unlinked_ = false;
  uint64_t token_ = 0;
  int local_rank_ = 0;
  int local_size_ = 1;
  size_t slot_bytes_ = 0;
  size_t bytes_ = 0;
  void* base_ = nullptr;
  Header* header_ = nullptr;
};

// Keeps a process's segment from one round to the next (GlooOptions::shm_keeper): a
// communicator that goes without an abandoned collective hands its segment over, quiet.
class ShmKeeper {
 public:
  void Keep(std::unique_ptr<ShmGroup> group);  // replaces (unmaps) the one kept before
  std::unique_ptr<ShmGroup> Take();            // the kept one, or null

 private:
  Mutex mu_;
  std::unique_ptr<ShmGroup> kept_ ELASTIC_GUARDED_BY(mu_);
};

}  // namespace elastic::worker_agent
