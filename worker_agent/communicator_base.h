// CommunicatorBase: what the communicators (worker_agent/gloo_communicator.h,
// worker_agent/nccl_communicator.h, and the tests' in-process one) share, written once: the
// ranks of their Topology, and the bookkeeping the driver's hang and straggler detection reads
// (docs/recovery.md, "Hangs and silent workers", "Stragglers").
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

#include "common/clock.h"
#include "common/communicator.h"
#include "worker_agent/round_communicator.h"
#include "worker_agent/topology.h"

namespace elastic::worker_agent {

// `Interface`: Communicator, RoundCommunicator, or DeviceCommunicator for one on device memory.
template <class Interface = Communicator>
class CommunicatorBase : public Interface {
 public:
  explicit CommunicatorBase(const Topology& topo) : topo_(topo) {}

  int rank() const override { return topo_.rank; }
  int size() const override { return topo_.size; }
  int local_rank() const override { return topo_.local_rank; }
  int local_size() const override { return topo_.local_size; }
  int cross_rank() const override { return topo_.cross_rank; }
  int cross_size() const override { return topo_.cross_size; }
  const Topology& topology() const { return topo_; }

  // For the driver's hang and straggler detection (thread-safe): collectives started on this
  // communicator, whether one is running now, when the last started (steady clock; the epoch
  // when none has), and the compute and wait times that Collective scopes counted.
  CollectiveStats collective_stats() const {
    CollectiveStats s;
    s.started = started_.load();
    s.running = running_.load();
    s.last_start = TimePoint(Duration(last_start_.load()));
    s.compute_seconds = Seconds(compute_.load());
    s.wait_seconds = Seconds(wait_.load());
    return s;
  }

 protected:
  // A collective from construction to destruction: counted, dated, running meanwhile; the
  // gap since the last one ended counts as compute, its own time as wait.
  class Collective {
   public:
    explicit Collective(CommunicatorBase* c)
        : c_(c), start_(SteadyClock::now().time_since_epoch().count()) {
      c_->NoteStarted(start_);
      // Collectives from two threads at once (a background allreduce beside the training
      // thread's barrier) overlap: a gap only counts when this one starts after the last end.
      Duration::rep end = c_->last_end_.load();
      if (end != 0 && start_ > end) c_->compute_.fetch_add(start_ - end);
      c_->NoteRunning(true);
    }
    ~Collective() {
      Duration::rep now = SteadyClock::now().time_since_epoch().count();
      c_->wait_.fetch_add(now - start_);
      c_->last_end_.store(now);
      c_->NoteRunning(false);
    }
    Collective(const Collective&) = delete;
    Collective& operator=(const Collective&) = delete;

   private:
    CommunicatorBase* c_;
    Duration::rep start_;
  };

  // For a communicator whose collectives are not one scope (NCCL's: enqueued, then waited
  // for): a collective starts at `now` (steady clock ticks), counted and dated. It runs from
  // NoteRunning(true) until NoteRunning(false).
  void NoteStarted(Duration::rep now) {
    started_.fetch_add(1);
    last_start_.store(now);
  }
  void NoteRunning(bool running) { running_.store(running); }

  const Topology topo_;

 private:
  static double Seconds(Duration::rep d) {
    return std::chrono::duration<double>(Duration(d)).count();
  }

  std::atomic<uint64_t> started_{0};
  std::atomic<bool> running_{false};
  std::atomic<Duration::rep> last_start_{0};
  std::atomic<Duration::rep> last_end_{0};  // when the last Collective ended (0: none has)
  std::atomic<Duration::rep> compute_{0}, wait_{0};
};

}  // namespace elastic::worker_agent
