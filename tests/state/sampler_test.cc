#include <catch2/catch.hpp>
#include <map>
#include <random>
#include <set>

#include "state/state.h"

namespace elastic {
namespace {

// One step of every rank at `size`; returns the non-padding indices they consumed.
std::vector<int64_t> Step(std::vector<ElasticSampler>& ranks, int batch) {
  std::vector<int64_t> out;
  for (auto& s : ranks) {
    auto b = s.Next(batch);
    REQUIRE(b.indices.size() == static_cast<size_t>(batch));
    for (size_t k = 0; k < b.indices.size(); ++k) {
      if (!b.padding[k]) out.push_back(b.indices[k]);
    }
  }
  return out;
}

TEST_CASE("sampler: one step of all ranks consumes the next prefix of the order", "[unit]") {
  const int n = 103, size = 4, batch = 5;
  std::vector<ElasticSampler> ranks(size, ElasticSampler(n, true, 7));
  for (int r = 0; r < size; ++r) ranks[r].SetRank(r, size);
  ElasticSampler reference(n, true, 7);
  std::vector<int64_t> order;
  reference.SetRank(0, 1);
  while (!reference.EpochDone()) {
    for (auto i : reference.Next(1).indices) order.push_back(i);
  }
  std::vector<int64_t> seen;
  while (!ranks[0].EpochDone()) {
    auto got = Step(ranks, batch);
    std::multiset<int64_t> a(got.begin(), got.end());
    std::multiset<int64_t> b(order.begin() + seen.size(), order.begin() + seen.size() + got.size());
    CHECK(a == b);
    seen.insert(seen.end(), got.begin(), got.end());
    for (auto& s : ranks) CHECK(s.cursor() == ranks[0].cursor());
  }
  CHECK(seen.size() == static_cast<size_t>(n));  // 103 = 5 steps of 20 + 3: padding in the last
}

TEST_CASE("sampler: with a global batch, every size takes the same steps", "[unit]") {
  // 50 indices, global batch 12: steps are the order's slices [0,12) [12,24) ... [48,50) at
  // any size; ranks beyond the global batch get padding.
  const int n = 50, global = 12;
  ElasticSampler reference(n, true, 3);
  std::vector<int64_t> order;
  while (!reference.EpochDone()) {
    for (auto i : reference.Next(1).indices) order.push_back(i);
  }
  for (int size : {1, 2, 3, 5, 7, 12, 13}) {
    INFO("size " << size);
    std::vector<ElasticSampler> ranks(size, ElasticSampler(n, true, 3));
    for (int r = 0; r < size; ++r) ranks[r].SetRank(r, size);
    const int per_rank = (global + size - 1) / size;
    size_t at = 0;
    while (!ranks[0].EpochDone()) {
      std::multiset<int64_t> got;
      for (auto& s : ranks) {
        auto b = s.Next(per_rank, global);
        for (size_t k = 0; k < b.indices.size(); ++k) {
          if (!b.padding[k]) got.insert(b.indices[k]);
        }
      }
      size_t len = std::min<size_t>(global, order.size() - at);
      CHECK(got == std::multiset<int64_t>(order.begin() + at, order.begin() + at + len));
      at += len;
    }
    CHECK(at == order.size());
  }
}

TEST_CASE("sampler: the epoch's order depends on seed + epoch", "[unit]") {
  ElasticSampler a(50, true, 1), b(50, true, 1);
  b.SetEpoch(1);
  CHECK(a.Next(50).indices != b.Next(50).indices);
  ElasticSampler c(10, false, 1);
  auto in_order = c.Next(10).indices;
  CHECK(in_order == std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
}

TEST_CASE("sampler: serialize keeps epoch and cursor, and bad bytes are refused", "[unit]") {
  ElasticSampler s(100, true, 3);
  s.SetEpoch(2);
  s.Next(7);
  ElasticSampler t(100, true, 3);
  REQUIRE(t.Deserialize(s.Serialize()).ok());
  CHECK(t.epoch() == 2);
  CHECK(t.cursor() == 7);
  CHECK(t.Next(5).indices == s.Next(5).indices);
  CHECK_FALSE(t.Deserialize("short").ok());
}

// Property: under a random sequence of sizes, commits and rollbacks, every index of every
// epoch is consumed by exactly one committed step.
TEST_CASE("sampler property: exactly once under random resizes and rollbacks", "[unit]") {
  auto seed = GENERATE(range(1, 41));
  std::mt19937 rng(seed);
  const int64_t n = 1 + rng() % 500;
  const int epochs = 3;
  const int batch = 1 + rng() % 9;
  int size = 1 + rng() % 8;
  std::vector<ElasticSampler> ranks(size, ElasticSampler(n, true, seed));
  for (int r = 0; r < size; ++r) ranks[r].SetRank(r, size);
  std::string committed = ranks[0].Serialize();
  std::map<int64_t, std::vector<int64_t>> consumed_committed;
  std::vector<int64_t> pending;
  int64_t epoch = 0;
  while (epoch < epochs) {
    if (ranks[0].EpochDone()) {
      for (auto& s : ranks) s.SetEpoch(epoch + 1);
      consumed_committed[epoch].insert(consumed_committed[epoch].end(), pending.begin(),
                                       pending.end());
      pending.clear();
      ++epoch;
      committed = ranks[0].Serialize();
      continue;
    }
    auto got = Step(ranks, batch);
    pending.insert(pending.end(), got.begin(), got.end());
    switch (rng() % 4) {
      case 0: {  // commit
        consumed_committed[ranks[0].epoch()].insert(consumed_committed[ranks[0].epoch()].end(),
                                                    pending.begin(), pending.end());
        pending.clear();
        committed = ranks[0].Serialize();
        break;
      }
      case 1: {  // a worker dies: roll back, re-form at a new size
        pending.clear();
        size = 1 + rng() % 8;
        ranks.assign(size, ElasticSampler(n, true, seed));
        for (int r = 0; r < size; ++r) {
          REQUIRE(ranks[r].Deserialize(committed).ok());
          ranks[r].SetRank(r, size);
        }
        epoch = ranks[0].epoch();
        break;
      }
      case 2: {  // announced change: commit, then re-form at a new size
        consumed_committed[ranks[0].epoch()].insert(consumed_committed[ranks[0].epoch()].end(),
                                                    pending.begin(), pending.end());
        pending.clear();
        committed = ranks[0].Serialize();
        size = 1 + rng() % 8;
        ranks.assign(size, ElasticSampler(n, true, seed));
        for (int r = 0; r < size; ++r) {
          REQUIRE(ranks[r].Deserialize(committed).ok());
          ranks[r].SetRank(r, size);
        }
        break;
      }
      default:
        break;  // another step before the next commit
    }
  }
  for (int e = 0; e < epochs; ++e) {
    std::vector<int64_t> v = consumed_committed[e];
    std::sort(v.begin(), v.end());
    std::vector<int64_t> want(n);
    for (int64_t i = 0; i < n; ++i) want[i] = i;
    INFO("seed " << seed << " epoch " << e);
    CHECK(v == want);
  }
}

}  // namespace
}  // namespace elastic
