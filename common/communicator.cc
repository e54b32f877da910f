#include "common/communicator.h"

#include <algorithm>

namespace elastic {

size_t DataTypeSize(DataType dtype) {
  switch (dtype) {
    case DataType::kF32:
      return 4;
    case DataType::kF64:
      return 8;
    case DataType::kF16:
      return 2;
    case DataType::kBF16:
      return 2;
    case DataType::kI32:
      return 4;
    case DataType::kI64:
      return 8;
  }
  return 1;
}

const char* DataTypeName(DataType dtype) {
  switch (dtype) {
    case DataType::kF32:
      return "f32";
    case DataType::kF64:
      return "f64";
    case DataType::kF16:
      return "f16";
    case DataType::kBF16:
      return "bf16";
    case DataType::kI32:
      return "i32";
    case DataType::kI64:
      return "i64";
  }
  return "?";
}

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kMax:
      return "max";
  }
  return "?";
}

void ForEachFusionBucket(const std::vector<TensorView>& tensors, size_t cap,
                         const std::function<void(const TensorView&)>& alone,
                         const std::function<void(size_t, size_t, size_t)>& bucket) {
  cap = std::max<size_t>(cap, 8);
  size_t i = 0;
  while (i < tensors.size()) {
    const TensorView& first = tensors[i];
    const size_t esize = DataTypeSize(first.dtype);
    size_t j = i;
    size_t bytes = 0;
    while (j < tensors.size() && tensors[j].dtype == first.dtype &&
           bytes + tensors[j].count * esize <= cap) {
      bytes += tensors[j].count * esize;
      ++j;
    }
    if (j <= i + 1) {  // too big to fuse, or a bucket of one
      alone(first);
      ++i;
      continue;
    }
    bucket(i, j, bytes);
    i = j;
  }
}

void AllreduceFused(const std::vector<TensorView>& tensors, size_t cap, const FusionOps& ops) {
  ForEachFusionBucket(
      tensors, cap, [&](const TensorView& t) { ops.allreduce(t.data, t.count, t.dtype); },
      [&](size_t begin, size_t end, size_t bytes) {
        const size_t esize = DataTypeSize(tensors[begin].dtype);
        char* fusion = ops.buffer(bytes);
        size_t off = 0;
        for (size_t k = begin; k < end; ++k) {
          ops.copy(fusion + off, tensors[k].data, tensors[k].count * esize);
          off += tensors[k].count * esize;
        }
        ops.allreduce(fusion, bytes / esize, tensors[begin].dtype);
        off = 0;
        for (size_t k = begin; k < end; ++k) {
          ops.copy(tensors[k].data, fusion + off, tensors[k].count * esize);
          off += tensors[k].count * esize;
        }
        if (ops.after_bucket) ops.after_bucket();
      });
}

}  // namespace elastic
