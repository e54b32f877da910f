#include "worker_agent/reduce.h"

#include <gloo/math.h>

#include <cstdint>

#include "common/half.h"

namespace elastic::worker_agent {
namespace {

template <typename T>
T Combine(T a, T b, ReduceOp op) {
  switch (op) {
    case ReduceOp::kMin:
      return b < a ? b : a;
    case ReduceOp::kMax:
      return a < b ? b : a;
    default:
      return a + b;  // sum, and avg (divided afterwards)
  }
}

// Gloo's own element-wise loops: one op per function, so the compiler vectorizes them.
template <typename T>
ReduceFn NativeReduce(ReduceOp op) {
  using Fn = void (*)(void*, const void*, const void*, size_t);
  switch (op) {
    case ReduceOp::kMin:
      return static_cast<Fn>(&gloo::min<T>);
    case ReduceOp::kMax:
      return static_cast<Fn>(&gloo::max<T>);
    default:
      return static_cast<Fn>(&gloo::sum<T>);  // sum, and avg (divided afterwards)
  }
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
ReduceFn HalfReduce(ReduceOp op) {
  return [op](void* c, const void* a, const void* b, size_t n) {
    uint16_t* out = static_cast<uint16_t*>(c);
    const uint16_t* x = static_cast<const uint16_t*>(a);
    const uint16_t* y = static_cast<const uint16_t*>(b);
    for (size_t i = 0; i < n; ++i) out[i] = FromF(Combine(ToF(x[i]), ToF(y[i]), op));
  };
}

template <typename T>
void DivideBy(void* data, size_t count, int size) {
  T* p = static_cast<T*>(data);
  for (size_t i = 0; i < count; ++i) p[i] = static_cast<T>(p[i] / size);
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void DivideHalf(void* data, size_t count, int size) {
  uint16_t* p = static_cast<uint16_t*>(data);
  for (size_t i = 0; i < count; ++i) p[i] = FromF(ToF(p[i]) / static_cast<float>(size));
}

}  // namespace

ReduceFn ReduceFunc(DataType dtype, ReduceOp op) {
  switch (dtype) {
    case DataType::kF32:
      return NativeReduce<float>(op);
    case DataType::kF64:
      return NativeReduce<double>(op);
    case DataType::kI32:
      return NativeReduce<int32_t>(op);
    case DataType::kI64:
      return NativeReduce<int64_t>(op);
    case DataType::kF16:
      return HalfReduce<HalfToFloat, FloatToHalf>(op);
    case DataType::kBF16:
      return HalfReduce<Bf16ToFloat, FloatToBf16>(op);
  }
  return NativeReduce<float>(op);
}

void DivideAll(void* data, size_t count, DataType dtype, int size) {
  if (size == 1) return;
  switch (dtype) {
    case DataType::kF32:
      return DivideBy<float>(data, count, size);
    case DataType::kF64:
      return DivideBy<double>(data, count, size);
    case DataType::kI32:
      return DivideBy<int32_t>(data, count, size);
    case DataType::kI64:
      return DivideBy<int64_t>(data, count, size);
    case DataType::kF16:
      return DivideHalf<HalfToFloat, FloatToHalf>(data, count, size);
    case DataType::kBF16:
      return DivideHalf<Bf16ToFloat, FloatToBf16>(data, count, size);
  }
}
}  // namespace elastic::worker_agent
