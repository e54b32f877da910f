// ShmCommunicator (worker_agent/shm_communicator.h) on its own: the ranks of one host as
// threads of this process, each mapping the same real segment.
#include "worker_agent/shm_communicator.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <functional>
#include <future>
#include <numeric>
#include <string>
#include <vector>

namespace elastic::worker_agent {
namespace {

using namespace std::chrono_literals;

constexpr size_t kSlot = 4096;  // small slots: an allreduce of a few KiB is many chunks

// `n` local ranks of one host (the whole round), over one segment of kSlot-byte slots.
std::vector<std::unique_ptr<ShmCommunicator>> Host(int n, int cross_size = 1) {
  auto first = ShmGroup::Create(n, kSlot);
  REQUIRE(first.ok());
  std::vector<std::unique_ptr<ShmGroup>> groups;
  groups.push_back(std::move(first).value());
  for (int r = 1; r < n; ++r) {
    auto opened = ShmGroup::Open(groups[0]->Describe(), r, n);
    REQUIRE(opened.ok());
    groups.push_back(std::move(opened).value());
  }
  groups[0]->Unlink();  // every rank mapped it: nothing stays in /dev/shm
  std::vector<std::unique_ptr<ShmCommunicator>> out;
  for (int r = 0; r < n; ++r) {
    Topology topo{r, n * cross_size, r, n, 0, cross_size};
    out.push_back(std::make_unique<ShmCommunicator>(topo, std::move(groups[r]), kSlot, 20s));
  }
  return out;
}

// Runs `fn(rank, comm)` on every rank at once; each rank's result ("" when it went well).
std::vector<std::string> OnEveryRank(std::vector<std::unique_ptr<ShmCommunicator>>& comms,
                                     const std::function<std::string(int, ShmCommunicator&)>& fn) {
  std::vector<std::future<std::string>> fs;
  for (size_t r = 0; r < comms.size(); ++r) {
    fs.push_back(std::async(std::launch::async, [&, r]() -> std::string {
      try {
        return fn(static_cast<int>(r), *comms[r]);
      } catch (const std::exception& e) {
        return std::string("threw: ") + e.what();
      }
    }));
  }
  std::vector<std::string> out;
  for (auto& f : fs) {
    REQUIRE(f.wait_for(60s) == std::future_status::ready);
    out.push_back(f.get());
  }
  return out;
}

TEST_CASE("shm communicator: allreduce in many chunks, every op", "[unit]") {
  auto comms = Host(3);
  static constexpr size_t n = 10007;  // 40 KiB of f32: ten chunks and a short one, slices uneven
  auto results = OnEveryRank(comms, [](int rank, ShmCommunicator& c) -> std::string {
    std::vector<float> sum(n);
    for (size_t i = 0; i < n; ++i) sum[i] = static_cast<float>(rank * 1000 + i % 997);
    c.Allreduce(sum.data(), n, DataType::kF32, ReduceOp::kSum);
    for (size_t i = 0; i < n; ++i) {
      if (sum[i] != static_cast<float>(3000 + 3 * (i % 997))) return "sum at " + std::to_string(i);
    }
    std::vector<double> avg(n, rank + 1.0);
    c.Allreduce(avg.data(), n, DataType::kF64, ReduceOp::kAvg);
    for (double v : avg) {
      if (v != 2.0) return "avg " + std::to_string(v);
    }
    std::vector<int64_t> lo(n), hi(n);
    for (size_t i = 0; i < n; ++i) lo[i] = hi[i] = (rank + static_cast<int>(i)) % 3;
    c.AllreduceMany({{lo.data(), n, DataType::kI64}}, ReduceOp::kMin);
    c.Allreduce(hi.data(), n, DataType::kI64, ReduceOp::kMax);
    for (size_t i = 0; i < n; ++i) {
      if (lo[i] != 0 || hi[i] != 2) return "min/max at " + std::to_string(i);
    }
    return "";
  });
  for (const auto& r : results) CHECK(r == "");
}

TEST_CASE("shm communicator: broadcast over several halves, allgather of unequal parts", "[unit]") {
  auto comms = Host(3);
  auto results = OnEveryRank(comms, [](int rank, ShmCommunicator& c) -> std::string {
    std::vector<char> data(40000, 0);  // over three halves of 3 x 4 KiB
    if (rank == 2) std::iota(data.begin(), data.end(), 0);
    c.Broadcast(data.data(), data.size(), 2);
    for (size_t i = 0; i < data.size(); ++i) {
      if (data[i] != static_cast<char>(i)) return "broadcast at " + std::to_string(i);
    }
    std::vector<char> mine(rank == 0 ? 0 : rank == 1 ? 5000 : 20000, static_cast<char>('a' + rank));
    auto all = c.Allgather(mine.data(), mine.size());
    if (all.size() != 3) return "allgather size";
    for (int r = 0; r < 3; ++r) {
      size_t want = r == 0 ? 0 : r == 1 ? 5000 : 20000;
      if (all[r] != std::vector<char>(want, static_cast<char>('a' + r))) {
        return "allgather part " + std::to_string(r);
      }
    }
    c.Barrier();
    return "";
  });
  for (const auto& r : results) CHECK(r == "");
}

TEST_CASE("shm communicator: an abort fails the other ranks' waits at once", "[unit]") {
  auto comms = Host(3);
  std::promise<void> waiting;
  auto aborted = std::async(std::launch::async, [&] {
    waiting.get_future().wait();
    comms[0]->Abort();  // rank 0 never arrives: it aborts instead (a peer of its is gone)
  });
  std::atomic<int> entered{0};
  auto results = OnEveryRank(comms, [&](int rank, ShmCommunicator& c) -> std::string {
    if (rank == 0) {
      return "";
    }
    // Both about to wait (an abort before they do fails them at the barrier's entry).
    if (entered.fetch_add(1) + 1 == 2) waiting.set_value();
    c.Barrier();
    return "passed a barrier rank 0 never reached";
  });
  aborted.get();
  CHECK(results[0] == "");
  for (int r : {1, 2}) CHECK(results[r].find("threw: host barrier") == 0);
}

TEST_CASE("shm communicator: a round that spans hosts is HierarchicalAllreduce's", "[unit]") {
  auto comms = Host(1, 2);  // one local rank, two hosts
  float x = 1;
  CHECK_THROWS_AS(comms[0]->Allreduce(&x, 1, DataType::kF32, ReduceOp::kSum), std::logic_error);
  CHECK_THROWS_AS(comms[0]->Broadcast(&x, sizeof x, 0), std::logic_error);
}

}  // namespace
}  // namespace elastic::worker_agent
