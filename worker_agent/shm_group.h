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
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "common/common.h"

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
  // Removes the segment's name (the creator, once every local rank has mapped it). Idempotent.
  void Unlink();

  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  size_t slot_bytes() const { return slot_bytes_; }
  char* slot(int half, int local_rank) const;

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

}  // namespace elastic::worker_agent
