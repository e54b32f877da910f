// comm_build_bench: how the cost of building a round's Gloo communicator grows with its size.
// N ranks as threads of this process over an in-process rendezvous Core (no gRPC: the store
// costs little), on loopback; timed from the round forming to every rank connected, then to
// one 4-byte allreduce done on every rank. Threads share the machine's cores as processes
// would; beyond ~64 they are the only way to reach 128 here. Since a process keeps one Gloo
// device (one event-loop thread) for all its communicators, the ranks here share one too,
// where processes would have one each.
//
//   build/bench/comm_build_bench [N ...]     (default: 8 16 32 64 128), median of 3
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "rendezvous/rendezvous.h"
#include "worker_agent/gloo_communicator.h"

using namespace elastic;
using namespace elastic::worker_agent;

namespace {

struct Times {
  double connect = 0, first_allreduce = 0, store_bytes = 0;
};

Times Build(int n) {
  rendezvous::Core core(rendezvous::CoreOptions{});
  std::map<std::string, rendezvous::Assignment> m;
  for (int i = 0; i < n; ++i) m["h:" + std::to_string(i)].rank = i;
  if (!core.ProposeRound(0, m, {}).ok()) std::abort();
  std::vector<std::thread> ts;
  std::vector<double> connected(n), reduced(n);
  std::atomic<long> bytes{0};
  auto t0 = SteadyClock::now();
  for (int i = 0; i < n; ++i) {
    ts.emplace_back([&, i] {
      if (!core.Join("h:" + std::to_string(i), -1, 0, core.clock()->Now() + std::chrono::seconds(60)).ok()) std::abort();
      auto store = MakeCoreRoundStore(&core, 0);
      GlooOptions o;
      o.hostname = "127.0.0.1";
      // The pairs' build is what is timed: without the shared-memory allreduce, ranks on one
      // host connect their pairs when the round forms (with it, at their first broadcast).
      o.shm = false;
      auto c = GlooCommunicator::Create(store.get(), Topology{i, n, i, n, 0, 1}, o);
      if (!c.ok()) {
        std::fprintf(stderr, "rank %d: %s\n", i, c.status().ToString().c_str());
        std::abort();
      }
      connected[i] = std::chrono::duration<double>(SteadyClock::now() - t0).count();
      int32_t x = 1;
      (*c)->Allreduce(&x, 1, DataType::kI32, ReduceOp::kSum);
      if (x != n) std::abort();
      reduced[i] = std::chrono::duration<double>(SteadyClock::now() - t0).count();
      auto v = store->Get({std::to_string(i)}, std::chrono::seconds(1));
      if (v.ok()) bytes += static_cast<long>((*v)[0].size());
    });
  }
  for (auto& t : ts) t.join();
  return {*std::max_element(connected.begin(), connected.end()),
          *std::max_element(reduced.begin(), reduced.end()), static_cast<double>(bytes.load())};
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> sizes;
  for (int i = 1; i < argc; ++i) sizes.push_back(std::atoi(argv[i]));
  if (sizes.empty()) sizes = {8, 16, 32, 64, 128};
  std::printf("comm_build_bench: Gloo communicator build, ranks as threads, loopback; median of 3\n");
  std::printf("  %5s %14s %20s %18s\n", "N", "all connected", "first allreduce done",
              "store bytes/round");
  for (int n : sizes) {
    std::vector<Times> runs;
    for (int r = 0; r < 3; ++r) runs.push_back(Build(n));
    std::sort(runs.begin(), runs.end(), [](const Times& a, const Times& b) { return a.connect < b.connect; });
    std::printf("  %5d %12.3f s %18.3f s %18.0f\n", n, runs[1].connect, runs[1].first_allreduce,
                runs[1].store_bytes);
    std::fflush(stdout);
  }
}
