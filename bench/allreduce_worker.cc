// The elastic-run side of allreduce_bench: run under elastic-run; rank 0 prints one JSON line
// per measurement: {"impl": "elastic", "what": ..., "bytes": ..., "seconds": ...}.
//   allreduce_worker SIZE_BYTES... (sizes of f32 buffers)
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/clock.h"
#include "worker_agent/elastic.h"

using namespace elastic;

namespace {

int ItersFor(size_t bytes) {
  if (bytes <= (1u << 20)) return 50;
  if (bytes <= (16u << 20)) return 10;
  return 5;
}

double TimeIt(Communicator& c, int iters, const std::function<void()>& op) {
  op();  // warm-up
  c.Barrier();
  auto t0 = SteadyClock::now();
  for (int i = 0; i < iters; ++i) op();
  c.Barrier();
  double local = std::chrono::duration<double>(SteadyClock::now() - t0).count() / iters;
  c.Allreduce(&local, 1, DataType::kF64, ReduceOp::kMax);
  return local;
}

}  // namespace

int main(int argc, char** argv) {
  Agent& agent = Init();
  Communicator& c = agent.comm();
  for (int a = 1; a < argc; ++a) {
    size_t bytes = std::strtoull(argv[a], nullptr, 10);
    std::vector<float> buf(bytes / 4, 1.0f);
    double s = TimeIt(c, ItersFor(bytes),
                      [&] { c.Allreduce(buf.data(), buf.size(), DataType::kF32, ReduceOp::kSum); });
    // A broadcast of the same bytes from rank 0 (what a state sync does): on one host through
    // the shared memory, or over the Gloo pairs (--no-shm-allreduce).
    double b = TimeIt(c, ItersFor(bytes), [&] { c.Broadcast(buf.data(), bytes, 0); });
    if (c.rank() == 0) {
      std::printf(
          "{\"impl\": \"elastic\", \"what\": \"allreduce\", \"bytes\": %zu, \"seconds\": %.9f}\n",
          bytes, s);
      std::printf(
          "{\"impl\": \"elastic\", \"what\": \"broadcast\", \"bytes\": %zu, \"seconds\": %.9f}\n",
          bytes, b);
      // The anchor for the machine's memory: one memcpy of the same bytes, on one core while
      // the other ranks wait in a barrier.
      std::vector<char> src(bytes, 1), dst(bytes, 0);
      std::memcpy(dst.data(), src.data(), bytes);
      const int iters = ItersFor(bytes) * 2;
      auto t0 = SteadyClock::now();
      for (int i = 0; i < iters; ++i) {
        src[i % bytes] = static_cast<char>(i);
        std::memcpy(dst.data(), src.data(), bytes);
      }
      double m = std::chrono::duration<double>(SteadyClock::now() - t0).count() / iters;
      std::printf(
          "{\"impl\": \"memcpy\", \"what\": \"memcpy\", \"bytes\": %zu, \"seconds\": %.9f, "
          "\"check\": %d}\n",
          bytes, m, static_cast<int>(dst[bytes / 2]));
      std::fflush(stdout);
    }
    c.Barrier();
  }
  // 1000 tensors of 4 KiB: fused into one collective.
  std::vector<std::vector<float>> tensors(1000, std::vector<float>(1024, 1.0f));
  std::vector<TensorView> views;
  for (auto& t : tensors) views.push_back({t.data(), t.size(), DataType::kF32});
  double fused = TimeIt(c, 20, [&] { c.AllreduceMany(views, ReduceOp::kSum); });
  // The same 1000 tensors one collective each: our own unfused anchor.
  double loop = TimeIt(c, 3, [&] {
    for (auto& v : views) c.Allreduce(v.data, v.count, v.dtype, ReduceOp::kSum);
  });
  if (c.rank() == 0) {
    std::printf(
        "{\"impl\": \"elastic\", \"what\": \"1000x4KiB\", \"bytes\": %d, \"seconds\": %.9f}\n",
        1000 * 4096, fused);
    std::printf(
        "{\"impl\": \"elastic\", \"what\": \"1000x4KiB-loop\", \"bytes\": %d, \"seconds\": %.9f}\n",
        1000 * 4096, loop);
  }
  return 0;
}
