// The hierarchical allreduce: a composition of the host's ShmCommunicator
// (worker_agent/shm_communicator.h) and a cross-host communicator among the hosts' local
// ranks 0. Each chunk is reduced within the host through shared memory, across hosts by local
// rank 0 (the ring of `cross`), and copied back out to every local rank.
#pragma once

#include <cstddef>

#include "common/communicator.h"
#include "worker_agent/shm_communicator.h"
#include "worker_agent/topology.h"

namespace elastic::worker_agent {

// `topo`: the round's. `host`: null when this rank is alone on its host. `cross`: the
// cross-host communicator (local rank 0 of a round that spans hosts), else null.
// `chunk_bytes`: every host's the same. Throws WorkerLostError as the two do.
void HierarchicalAllreduce(const Topology& topo, ShmCommunicator* host, Communicator* cross,
                           size_t chunk_bytes, Duration collective_timeout, void* data,
                           size_t count, DataType dtype, ReduceOp op);

}  // namespace elastic::worker_agent
