// The element-wise reductions of the collectives, by data type and op: what Gloo's allreduce
// and the shared-memory host reduction (worker_agent/gloo_communicator.cc) apply.
#pragma once

#include <cstddef>
#include <functional>

#include "common/communicator.h"

namespace elastic::worker_agent {

// out[i] = a[i] (op) b[i] for n elements; the type of gloo::AllreduceOptions::Func.
using ReduceFn = std::function<void(void* out, const void* a, const void* b, size_t n)>;

// The element-wise reduction of `op` on `dtype` (kAvg sums; the caller divides).
ReduceFn ReduceFunc(DataType dtype, ReduceOp op);

// Divides a sum of `count` elements by `size` in place (kAvg; integers truncate).
void DivideAll(void* data, size_t count, DataType dtype, int size);

}  // namespace elastic::worker_agent
