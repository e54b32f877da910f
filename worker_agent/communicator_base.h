// CommunicatorBase: what the Gloo and NCCL communicators (worker_agent/gloo_communicator.h,
// worker_agent/nccl_communicator.h) share, written once: the ranks of their Topology, and the
// bookkeeping the driver's hang detection reads (docs/recovery.md, "Hangs and silent workers").
#pragma once

#include <atomic>
#include <cstdint>

#include "common/clock.h"
#include "common/communicator.h"
#include "worker_agent/topology.h"

namespace elastic::worker_agent {

class CommunicatorBase : public Communicator {
 public:
  explicit CommunicatorBase(const Topology& topo) : topo_(topo) {}

  int rank() const override { return topo_.rank; }
  int size() const override { return topo_.size; }
  int local_rank() const override { return topo_.local_rank; }
  int local_size() const override { return topo_.local_size; }
  int cross_rank() const override { return topo_.cross_rank; }
  int cross_size() const override { return topo_.cross_size; }
  const Topology& topology() const { return topo_; }

  // For the driver's hang detection (thread-safe): collectives started on this communicator,
  // whether one is running now, and when the last started (steady clock; the epoch when none
  // has).
  uint64_t collectives_started() const { return started_.load(); }
  bool in_collective() const { return running_.load(); }
  TimePoint last_collective_start() const { return TimePoint(Duration(last_start_.load())); }

 protected:
  // A collective starts at `now` (steady clock ticks): counted and dated. It runs from
  // NoteRunning(true) until NoteRunning(false).
  void NoteStarted(Duration::rep now) {
    started_.fetch_add(1);
    last_start_.store(now);
  }
  void NoteRunning(bool running) { running_.store(running); }

  const Topology topo_;

 private:
  std::atomic<uint64_t> started_{0};
  std::atomic<bool> running_{false};
  std::atomic<Duration::rep> last_start_{0};
};

}  // namespace elastic::worker_agent
