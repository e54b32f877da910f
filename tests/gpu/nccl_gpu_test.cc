// The NCCL backend on real GPUs (tests/gpu/run.sh runs it). Without a visible CUDA device it
// prints one line saying why and exits 0.
//
// On one GPU (NCCL refuses two ranks on one device) it runs what one GPU allows: size-1
// communicators through init, every collective and dtype against a CPU reference, an abort of
// a collective blocked on the stream from another thread, 100 rebuilds (no leaked device
// memory), Gloo beside NCCL. With two or more GPUs, ranks as threads (one device each): every
// collective across ranks, and one rank lost mid-allreduce with the survivors recovering by
// shrink and by a fresh init, timed.
#define CATCH_CONFIG_RUNNER
#include <dlfcn.h>

#include <catch2/catch.hpp>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <future>
#include <numeric>
#include <thread>

#include "rendezvous/rendezvous.h"
#include "worker_agent/gloo_communicator.h"
#include "worker_agent/nccl_communicator.h"

namespace elastic::worker_agent {
namespace {

using namespace std::chrono_literals;

// New(), which must succeed, as a unique_ptr.
template <typename... A>
std::unique_ptr<NcclCommunicator> MakeComm(A&&... a) {
  auto c = NcclCommunicator::New(std::forward<A>(a)...);
  REQUIRE(c.ok());
  return std::move(c).value();
}

std::shared_ptr<NcclApi> g_api;
int g_devices = 0;

// CUDA runtime calls the product does not need, looked up in the already loaded cudart.
template <typename Fn>
Fn Cudart(const char* name) {
  void* sym = dlsym(RTLD_DEFAULT, name);
  if (!sym) FAIL(std::string(name) + " not found in the loaded CUDA runtime");
  return reinterpret_cast<Fn>(sym);
}

size_t FreeDeviceMemory() {
  auto mem_get_info = Cudart<int (*)(size_t*, size_t*)>("cudaMemGetInfo");
  size_t free_b = 0, total = 0;
  REQUIRE(mem_get_info(&free_b, &total) == 0);
  return free_b;
}

double Ms(Duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

NcclOptions Opts() {
  NcclOptions o;
  o.init_timeout = 60s;
  o.collective_timeout = 60s;
  return o;
}

// `n` ranks (threads, device = rank) of round `round` on `core`; `body` on each.
void RunRanks(rendezvous::Core* core, int64_t round, int n,
              const std::function<void(int, NcclCommunicator&)>& body) {
  std::map<std::string, rendezvous::Assignment> m;
  for (int i = 0; i < n; ++i) m["g:" + std::to_string(i)].rank = i;
  REQUIRE(core->ProposeRound(round, m, {}).ok());
  std::vector<std::future<std::string>> fs;
  for (int i = 0; i < n; ++i) {
    fs.push_back(std::async(std::launch::async, [&, i]() -> std::string {
      auto a = core->Join("g:" + std::to_string(i), round - 1, 0, core->clock()->Now() + 60s);
      if (!a.ok()) return a.status().ToString();
      auto store = MakeCoreRoundStore(core, round);
      auto c = NcclCommunicator::New(g_api, Topology{i, n, i, n, 0, 1}, i, Opts());
      if (!c.ok()) return c.status().ToString();
      Status s = (*c)->Connect(store.get());
      if (!s.ok()) return s.ToString();
      try {
        body(i, **c);
      } catch (const std::exception& e) {
        return e.what();
      }
      return "";
    }));
  }
  for (auto& f : fs) CHECK(f.get() == "");
}

struct DeviceBuffer {
  void* p = nullptr;
  size_t bytes;
  explicit DeviceBuffer(size_t b) : bytes(b) { REQUIRE(g_api->Malloc(&p, b).ok()); }
  ~DeviceBuffer() { (void)g_api->Free(p); }
  void Put(const void* host) {
    REQUIRE(g_api->MemcpyAsync(p, host, bytes, nullptr).ok());
    REQUIRE(g_api->StreamSynchronize(nullptr).ok());
  }
  void Get(void* host) {
    REQUIRE(g_api->MemcpyAsync(host, p, bytes, nullptr).ok());
    REQUIRE(g_api->StreamSynchronize(nullptr).ok());
  }
};

// Every dtype and op over `n` ranks: rank r holds (r + 1) * (i % 7 + 1); checked on the host.
void CheckAllreduce(int rank, int n, NcclCommunicator& c) {
  const size_t count = 1000;
  for (DataType d : {DataType::kF32, DataType::kF64, DataType::kF16, DataType::kBF16,
                     DataType::kI32, DataType::kI64}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax}) {
      const size_t es = DataTypeSize(d);
      std::vector<char> host(count * es), out(count * es);
      auto val = [&](int r, size_t i) { return static_cast<double>((r + 1) * (i % 7 + 1)); };
      auto put = [&](char* p, size_t i, double v) {
        switch (d) {
          case DataType::kF32: { float f = v; std::memcpy(p + i * 4, &f, 4); break; }
          case DataType::kF64: std::memcpy(p + i * 8, &v, 8); break;
          case DataType::kI32: { int32_t x = v; std::memcpy(p + i * 4, &x, 4); break; }
          case DataType::kI64: { int64_t x = v; std::memcpy(p + i * 8, &x, 8); break; }
          case DataType::kF16: case DataType::kBF16: {  // small integers are exact in both
            float f = v;
            uint32_t b;
            std::memcpy(&b, &f, 4);
            uint16_t h;
            if (d == DataType::kBF16) {
              h = static_cast<uint16_t>(b >> 16);
            } else {
              int e = static_cast<int>((b >> 23) & 0xff) - 127 + 15;
              h = f == 0 ? 0 : static_cast<uint16_t>((e << 10) | ((b >> 13) & 0x3ff));
            }
            std::memcpy(p + i * 2, &h, 2);
            break;
          }
        }
      };
      auto get = [&](const char* p, size_t i) -> double {
        switch (d) {
          case DataType::kF32: { float f; std::memcpy(&f, p + i * 4, 4); return f; }
          case DataType::kF64: { double x; std::memcpy(&x, p + i * 8, 8); return x; }
          case DataType::kI32: { int32_t x; std::memcpy(&x, p + i * 4, 4); return x; }
          case DataType::kI64: { int64_t x; std::memcpy(&x, p + i * 8, 8); return x; }
          default: {
            uint16_t h;
            std::memcpy(&h, p + i * 2, 2);
            uint32_t b;
            if (d == DataType::kBF16) {
              b = static_cast<uint32_t>(h) << 16;
            } else {
              int e = (h >> 10) & 0x1f;
              b = h == 0 ? 0 : (static_cast<uint32_t>(e - 15 + 127) << 23) | ((h & 0x3ff) << 13);
            }
            float f;
            std::memcpy(&f, &b, 4);
            return f;
          }
        }
      };
      for (size_t i = 0; i < count; ++i) put(host.data(), i, val(rank, i));
      DeviceBuffer buf(count * es);
      buf.Put(host.data());
      c.Allreduce(buf.p, count, d, op);
      buf.Get(out.data());
      for (size_t i = 0; i < count; ++i) {
        double sum = 0, mn = 1e30, mx = -1e30;
        for (int r = 0; r < n; ++r) {
          sum += val(r, i);
          mn = std::min(mn, val(r, i));
          mx = std::max(mx, val(r, i));
        }
        bool integer = d == DataType::kI32 || d == DataType::kI64;
        double want = op == ReduceOp::kSum   ? sum
                      : op == ReduceOp::kAvg ? (integer ? std::trunc(sum / n) : sum / n)
                      : op == ReduceOp::kMin ? mn
                                             : mx;
        double tol = (d == DataType::kF16 || d == DataType::kBF16) ? 0.05 * std::abs(want) : 1e-6;
        INFO(DataTypeName(d) << " " << ReduceOpName(op) << " element " << i);
        REQUIRE(std::abs(get(out.data(), i) - want) <= tol);
      }
    }
  }
  // Broadcast, allgather (sizes differ by rank), barrier, fused allreduce.
  std::string msg = rank == n - 1 ? "from the last rank" : std::string(18, '?');
  DeviceBuffer b(msg.size());
  b.Put(msg.data());
  c.Broadcast(b.p, msg.size(), n - 1);
  b.Get(msg.data());
  REQUIRE(msg == "from the last rank");
  std::string mine(rank + 3, static_cast<char>('a' + rank));
  DeviceBuffer g(mine.size());
  g.Put(mine.data());
  auto all = c.Allgather(g.p, mine.size());
  for (int r = 0; r < n; ++r) {
    REQUIRE(std::string(all[r].begin(), all[r].end()) == std::string(r + 3, 'a' + r));
  }
  c.Barrier();
  std::vector<DeviceBuffer> ts;
  std::vector<TensorView> views;
  for (size_t k = 0; k < 20; ++k) {
    std::vector<float> v(100 + k, 1.f);
    ts.emplace_back(v.size() * 4);
    ts.back().Put(v.data());
  }
  for (size_t k = 0; k < 20; ++k) views.push_back({ts[k].p, 100 + k, DataType::kF32});
  c.AllreduceMany(views, ReduceOp::kSum);
  for (size_t k = 0; k < 20; ++k) {
    std::vector<float> v(100 + k);
    ts[k].Get(v.data());
    for (float x : v) REQUIRE(x == static_cast<float>(n));
  }
}

TEST_CASE("gpu: a size-1 communicator runs every collective and dtype") {
  rendezvous::Core core(rendezvous::CoreOptions{});
  RunRanks(&core, 0, 1, [](int r, NcclCommunicator& c) { CheckAllreduce(r, 1, c); });
}

TEST_CASE("gpu: Abort() from another thread ends a collective blocked on the stream") {
  rendezvous::Core core(rendezvous::CoreOptions{});
  RunRanks(&core, 0, 1, [](int, NcclCommunicator& c) {
    // A host function that holds the stream until released: the allreduce queued behind it
    // cannot finish, as one waiting for a dead peer.
    auto launch_host_func =
        Cudart<int (*)(void*, void (*)(void*), void*)>("cudaLaunchHostFunc");
    static std::atomic<bool> release{false};
    release = false;
    REQUIRE(launch_host_func(nullptr, [](void*) { while (!release) std::this_thread::sleep_for(1ms); },
                             nullptr) == 0);
    DeviceBuffer buf(4096);
    auto run = std::async(std::launch::async, [&] {
      try {
        c.Allreduce(buf.p, 1024, DataType::kF32, ReduceOp::kSum);
        return std::string("returned");
      } catch (const WorkerLostError& e) {
        return std::string(e.what());
      }
    });
    std::this_thread::sleep_for(300ms);
    REQUIRE(run.wait_for(0s) == std::future_status::timeout);
    auto t0 = SteadyClock::now();
    c.Abort();
    REQUIRE(run.wait_for(5s) == std::future_status::ready);
    std::printf("abort of a blocked collective: returned in %.2f ms (phase %s)\n",
                Ms(SteadyClock::now() - t0), NcclCommunicator::PhaseName(c.phase()));
    CHECK(run.get().find("aborted") != std::string::npos);
    release = true;
    REQUIRE(g_api->StreamSynchronize(nullptr).ok());
  });
}

TEST_CASE("gpu: 100 rebuilds leak no device memory, init and abort timed") {
  rendezvous::Core core(rendezvous::CoreOptions{});
  size_t before = 0;
  std::vector<double> init_ms, abort_ms;
  for (int cycle = 0; cycle < 100; ++cycle) {
    if (cycle == 5) before = FreeDeviceMemory();  // after NCCL's one-time allocations
    REQUIRE(core.ProposeRound(cycle, {{"g:0", {}}}, {}).ok());
    REQUIRE(core.Join("g:0", cycle - 1, 0, core.clock()->Now() + 60s).ok());
    auto store = MakeCoreRoundStore(&core, cycle);
    auto c = MakeComm(g_api, Topology{0, 1}, 0, Opts());
    auto t0 = SteadyClock::now();
    REQUIRE(c->Connect(store.get()).ok());
    init_ms.push_back(Ms(SteadyClock::now() - t0));
    DeviceBuffer buf(1 << 20);
    c->Allreduce(buf.p, 1 << 18, DataType::kF32, ReduceOp::kSum);
    t0 = SteadyClock::now();
    c.reset();  // ncclCommAbort
    abort_ms.push_back(Ms(SteadyClock::now() - t0));
  }
  size_t after = FreeDeviceMemory();
  std::sort(init_ms.begin(), init_ms.end());
  std::sort(abort_ms.begin(), abort_ms.end());
  std::printf("size 1: init median %.1f ms, abort median %.1f ms (100 cycles); free device "
              "memory cycle 5 -> 100: %+.1f MiB\n",
              init_ms[50], abort_ms[50], (double(after) - double(before)) / (1 << 20));
  CHECK(before < after + (64u << 20));
}

TEST_CASE("gpu: Gloo beside NCCL in one process") {
  rendezvous::Core core(rendezvous::CoreOptions{});
  REQUIRE(core.ProposeRound(0, {{"g:0", {}}}, {}).ok());
  REQUIRE(core.Join("g:0", -1, 0, core.clock()->Now() + 60s).ok());
  auto store = MakeCoreRoundStore(&core, 0);
  auto gloo = GlooCommunicator::Create(store.get(), Topology{0, 1}, GlooOptions{});
  REQUIRE(gloo.ok());
  auto nccl = MakeComm(g_api, Topology{0, 1}, 0, Opts());
  REQUIRE(nccl->Connect(store.get()).ok());
  int32_t flag = 1;
  (*gloo)->Allreduce(&flag, 1, DataType::kI32, ReduceOp::kMax);
  DeviceBuffer buf(4);
  buf.Put(&flag);
  nccl->Allreduce(buf.p, 1, DataType::kI32, ReduceOp::kSum);
  buf.Get(&flag);
  CHECK(flag == 1);
}

TEST_CASE("gpu: every collective across ranks (needs 2 GPUs)") {
  if (g_devices < 2) {
    WARN("1 GPU visible: multi-rank cases skipped");
    return;
  }
  const int n = std::min(g_devices, 8);
  rendezvous::Core core(rendezvous::CoreOptions{});
  RunRanks(&core, 0, n, [n](int r, NcclCommunicator& c) { CheckAllreduce(r, n, c); });
}

// Kills the last rank mid-allreduce (its thread stops and its communicator is aborted, as a
// process death frees it), aborts the survivors' blocked collectives, and rebuilds them by
// shrink or by a fresh init; returns the rebuild time (max over survivors) in ms.
double LoseOneAndRecover(bool shrink) {
  const int n = std::min(g_devices, 8);
  rendezvous::Core core(rendezvous::CoreOptions{});
  std::vector<std::unique_ptr<NcclCommunicator>> comms(n);
  std::map<std::string, rendezvous::Assignment> m;
  for (int i = 0; i < n; ++i) m["g:" + std::to_string(i)].rank = i;
  REQUIRE(core.ProposeRound(0, m, {}).ok());
  {
    std::vector<std::future<Status>> fs;
    for (int i = 0; i < n; ++i) {
      fs.push_back(std::async(std::launch::async, [&, i] {
        auto a = core.Join("g:" + std::to_string(i), -1, 0, core.clock()->Now() + 60s);
        if (!a.ok()) return a.status();
        auto store = MakeCoreRoundStore(&core, 0);
        comms[i] = MakeComm(g_api, Topology{i, n, i, n, 0, 1}, i, Opts());
        return comms[i]->Connect(store.get());
      }));
    }
    for (auto& f : fs) REQUIRE(f.get().ok());
  }
  std::vector<std::future<std::string>> blocked;
  std::vector<std::unique_ptr<DeviceBuffer>> bufs;
  for (int i = 0; i < n - 1; ++i) {
    REQUIRE(g_api->SetDevice(i).ok());
    bufs.push_back(std::make_unique<DeviceBuffer>(64 << 20));
  }
  for (int i = 0; i < n - 1; ++i) {
    blocked.push_back(std::async(std::launch::async, [&, i] {
      try {
        comms[i]->Allreduce(bufs[i]->p, 16 << 20, DataType::kF32, ReduceOp::kSum);
        return std::string("returned");
      } catch (const WorkerLostError& e) {
        return std::string(e.what());
      }
    }));
  }
  std::this_thread::sleep_for(200ms);
  comms[n - 1].reset();  // the lost rank
  for (int i = 0; i < n - 1; ++i) comms[i]->Abort();  // the driver's ABORT
  for (auto& f : blocked) {
    REQUIRE(f.wait_for(10s) == std::future_status::ready);
    CHECK(f.get().find("aborted") != std::string::npos);
  }
  std::map<std::string, rendezvous::Assignment> m1;
  for (int i = 0; i < n - 1; ++i) m1["g:" + std::to_string(i)].rank = i;
  REQUIRE(core.ProposeRound(1, m1, {}).ok());
  std::vector<std::future<double>> fs;
  for (int i = 0; i < n - 1; ++i) {
    fs.push_back(std::async(std::launch::async, [&, i]() -> double {
      REQUIRE(core.Join("g:" + std::to_string(i), 0, 1, core.clock()->Now() + 60s).ok());
      auto c = MakeComm(g_api, Topology{i, n - 1, i, n - 1, 0, 1}, i, Opts());
      auto t0 = SteadyClock::now();
      if (shrink) {
        std::vector<int> rank_of(n - 1);
        std::iota(rank_of.begin(), rank_of.end(), 0);
        REQUIRE(c->ConnectByShrink(comms[i].get(), {n - 1}, rank_of).ok());
      } else {
        auto store = MakeCoreRoundStore(&core, 1);
        REQUIRE(c->Connect(store.get()).ok());
      }
      double ms = Ms(SteadyClock::now() - t0);
      comms[i].reset();
      std::vector<float> one(256, 1.f);
      DeviceBuffer b(one.size() * 4);
      b.Put(one.data());
      c->Allreduce(b.p, one.size(), DataType::kF32, ReduceOp::kSum);
      b.Get(one.data());
      REQUIRE(one[0] == static_cast<float>(n - 1));
      return ms;
    }));
  }
  double worst = 0;
  for (auto& f : fs) worst = std::max(worst, f.get());
  return worst;
}

TEST_CASE("gpu: a rank lost mid-allreduce, survivors recover by shrink and by re-init") {
  if (g_devices < 2) {
    WARN("1 GPU visible: the lost-rank cases skipped");
    return;
  }
  if (g_api->has_shrink()) {
    std::printf("%d ranks, one lost: shrink %.1f ms\n", std::min(g_devices, 8),
                LoseOneAndRecover(true));
  }
  std::printf("%d ranks, one lost: fresh init %.1f ms\n", std::min(g_devices, 8),
              LoseOneAndRecover(false));
}

}  // namespace
}  // namespace elastic::worker_agent

int main(int argc, char** argv) {
  using namespace elastic::worker_agent;
  auto api = LoadNcclApi();
  if (!api.ok()) {
    std::printf("GPU tests skipped: %s\n", api.status().message().c_str());
    return 0;
  }
  g_api = *api;
  elastic::Status s = g_api->DeviceCount(&g_devices);
  if (!s.ok() || g_devices == 0) {
    std::printf("GPU tests skipped: no CUDA device visible (%s)\n",
                s.ok() ? "0 devices" : s.message().c_str());
    return 0;
  }
  std::printf("NCCL %d, %d CUDA device(s)\n", g_api->version(), g_devices);
  return Catch::Session().run(argc, argv);
}
