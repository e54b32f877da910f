// RoundCommunicator: what the Agent (worker_agent/worker_agent.h) needs of the communicator it
// builds for each round, beyond the collectives: connecting through the round's store, and the
// figures its reports give the driver. CommunicatorFactory makes them: Gloo's
// (MakeGlooFactory, worker_agent/gloo_communicator.h) in a worker, an in-process one in tests
// (tests/worker_agent/in_process_communicator.h).
#pragma once

#include <cstdint>
#include <memory>

#include "common/clock.h"
#include "common/communicator.h"
#include "common/status.h"
#include "worker_agent/store.h"
#include "worker_agent/topology.h"

namespace elastic::worker_agent {

// A communicator's collectives so far, for the driver's hang and straggler detection
// (docs/recovery.md, "Hangs and silent workers", "Stragglers").
struct CollectiveStats {
  uint64_t started = 0;  // collectives started
  bool running = false;  // one is running now
  TimePoint last_start;  // when the last started (steady clock; the epoch when none has)
  // Time between collectives (this rank's own work: compute) and in them (the collective,
  // and waiting there for its peers), counted from the end of the first collective.
  double compute_seconds = 0;
  double wait_seconds = 0;
};

class RoundCommunicator : public Communicator {
 public:
  // Connects to the round's other ranks through `store` (which must outlive the communicator).
  // Blocks up to the communicator's connect timeout. ABORTED when Abort() came before or
  // during it; UNAVAILABLE or DEADLINE_EXCEEDED when peers do not show up. Call once.
  virtual Status Connect(RoundStore* store) = 0;
  // Thread-safe.
  virtual CollectiveStats stats() const = 0;
};

// Makes one RoundCommunicator per round. Thread-safe.
class CommunicatorFactory {
 public:
  virtual ~CommunicatorFactory() = default;
  // A communicator for `topo`, not connected yet; Abort() works on it at once.
  // INVALID_ARGUMENT for a bad topology; UNAVAILABLE when it cannot be made here.
  virtual StatusOr<std::unique_ptr<RoundCommunicator>> New(const Topology& topo) = 0;
};

}  // namespace elastic::worker_agent
