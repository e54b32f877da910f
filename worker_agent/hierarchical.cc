// The hierarchical allreduce (worker_agent/hierarchical.h).
#include "worker_agent/hierarchical.h"

#include <algorithm>
#include <cstring>

#include "worker_agent/reduce.h"

namespace elastic::worker_agent {

void HierarchicalAllreduce(const Topology& topo, ShmCommunicator* host, Communicator* cross,
                           size_t chunk_bytes, Duration collective_timeout, void* data,
                           size_t count, DataType dtype, ReduceOp op) {
  // The cross-host ring sums; the average divides once, by the whole size, at the end.
  const ReduceOp cross_op = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  const size_t es = DataTypeSize(dtype);
  const size_t chunk = chunk_bytes / es;
  char* bytes = static_cast<char*>(data);
  if (!host) {
    // The only rank of its host: straight into the cross-host ring, in the same chunks as
    // the other hosts.
    for (size_t off = 0; off < count; off += chunk) {
      cross->Allreduce(bytes + off * es, std::min(chunk, count - off), dtype, cross_op);
    }
  } else {
    const TimePoint deadline = SteadyClock::now() + collective_timeout;
    const bool cross_phase = topo.cross_size > 1;
    // One host: the chunk is finished within it, averaged block by block as it is reduced.
    const int average_over = !cross_phase && op == ReduceOp::kAvg ? topo.size : 0;
    for (size_t off = 0; off < count; off += chunk) {
      const size_t n = std::min(chunk, count - off);
      char* mine = bytes + off * es;
      char* out = host->ReduceChunk(mine, n, dtype, cross_op, !cross_phase, average_over, deadline);
      if (cross_phase) {
        if (cross) cross->Allreduce(out, n, dtype, cross_op);
        host->HostBarrier(deadline);
        std::memcpy(mine, out, n * es);
      } else {
        host->CopyOthersOut(mine, n, dtype);
      }
    }
    if (!cross_phase) return;  // averaged block by block above
  }
  if (op == ReduceOp::kAvg) DivideAll(data, count, dtype, topo.size);
}

}  // namespace elastic::worker_agent
