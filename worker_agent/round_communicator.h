// RoundCommunicator: what the Agent (worker_agent/worker_agent.h) needs of the communicator it
// builds for each round, beyond the collectives: connecting through the round's store, and the
// figures its reports give the driver. CommunicatorFactory makes them: Gloo's
// (MakeGlooFactory, worker_agent/gloo_communicator.h) in a worker, an in-process one in tests
// (tests/worker_agent/in_process_communicator.h). DeviceRoundCommunicator and its factory are
// the same for the device communicator beside it (NCCL's, MakeNcclFactory).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

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

// The device communicator of a round (NcclCommunicator, worker_agent/nccl_communicator.h), as
// the Agent builds it beside the host one: afresh, or by shrinking the previous round's.
class DeviceRoundCommunicator : public DeviceCommunicator {
 public:
  // As RoundCommunicator::Connect: a fresh communicator through the round's store.
  virtual Status Connect(RoundStore* store) = 0;
  // The survivors of `parent`'s round build this one from it, leaving out the parent's ranks
  // `exclude`; `rank_of[r]` is where this round's rank r lands. Every survivor calls it with
  // the same `exclude`. FAILED_PRECONDITION when `parent` cannot be shrunk.
  virtual Status ConnectByShrink(DeviceRoundCommunicator* parent, const std::vector<int>& exclude,
                                 std::vector<int> rank_of) = 0;
  // Whether it is connected, or revoked after it was: a shrink's parent can be.
  virtual bool shrinkable() const = 0;
  // This rank's number inside it (its round rank unless it was shrunk).
  virtual int device_rank() const = 0;
  // Thread-safe.
  virtual CollectiveStats stats() const = 0;
};

// Makes one DeviceRoundCommunicator per round (NCCL's: MakeNcclFactory). Thread-safe.
class DeviceCommunicatorFactory {
 public:
  virtual ~DeviceCommunicatorFactory() = default;
  // Whether ConnectByShrink can work at all (the library has a shrink).
  virtual bool can_shrink() const = 0;
  // A communicator for `topo`, not connected, on the device of its local rank; `host` names
  // this host in errors. FAILED_PRECONDITION when the host shows too few devices.
  virtual StatusOr<std::unique_ptr<DeviceRoundCommunicator>> New(const Topology& topo,
                                                                 const std::string& host) = 0;
};

}  // namespace elastic::worker_agent
