// An in-process RoundCommunicator for the Agent's tests (tests/worker_agent/agent_test.cc): ranks
// are threads of one process, and a collective is an exchange of byte strings through memory
// (no sockets, no Gloo). The ranks of a round find each other through the round's store, as
// Gloo's do: rank 0 puts a group number under "inproc", the others read it.
//
// Every wait has a deadline (kWait) and ends at Abort(): an abort of any rank's communicator
// fails every rank's collective, as a peer gone does. Thread-safe like the real ones.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/mutex.h"
#include "worker_agent/communicator_base.h"
#include "worker_agent/reduce.h"

namespace elastic::worker_agent::testing {

inline constexpr Duration kWait = std::chrono::seconds(20);

// The ranks of one round.
class InProcessGroup {
 public:
  explicit InProcessGroup(int size) : size_(size), in_(size) {}

  // Waits until every rank has attached (a connect), or fails.
  Status Attach() {
    MutexLock l(mu_);
    ++attached_;
    cv_.notify_all();
    TimePoint deadline = SteadyClock::now() + kWait;
    if (!cv_.wait_until(l.native(), deadline,
                        [&]() ELASTIC_REQUIRES(mu_) { return attached_ >= size_ || aborted_; })) {
      return DeadlineExceeded("in-process group: peers did not attach");
    }
    if (aborted_) return Aborted("in-process group: aborted while connecting");
    return Status();
  }

  // Every rank's `mine`, in rank order. Throws WorkerLostError after Abort() or at kWait.
  std::vector<std::vector<char>> Exchange(int rank, std::vector<char> mine) {
    MutexLock l(mu_);
    if (aborted_) throw WorkerLostError("in-process group: aborted (a peer is gone)");
    const uint64_t generation = generation_;
    in_[rank] = std::move(mine);
    if (++arrived_ == size_) {
      out_ = std::move(in_);
      in_.assign(size_, {});
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return out_;
    }
    // The result stays in out_ until this rank reads it: the next exchange cannot complete
    // without this rank.
    TimePoint deadline = SteadyClock::now() + kWait;
    cv_.wait_until(l.native(), deadline,
                   [&]() ELASTIC_REQUIRES(mu_) { return generation_ != generation || aborted_; });
    if (generation_ == generation) {
      throw WorkerLostError(aborted_ ? "in-process group: aborted (a peer is gone)"
                                     : "in-process group: timed out waiting for peers");
    }
    return out_;
  }

  void Abort() {
    MutexLock l(mu_);
    aborted_ = true;
    cv_.notify_all();
  }

 private:
  const int size_;
  Mutex mu_;
  std::condition_variable cv_;
  int attached_ ELASTIC_GUARDED_BY(mu_) = 0;
  int arrived_ ELASTIC_GUARDED_BY(mu_) = 0;
  uint64_t generation_ ELASTIC_GUARDED_BY(mu_) = 0;
  bool aborted_ ELASTIC_GUARDED_BY(mu_) = false;
  std::vector<std::vector<char>> in_ ELASTIC_GUARDED_BY(mu_);
  std::vector<std::vector<char>> out_ ELASTIC_GUARDED_BY(mu_);
};

class InProcessFactory;

class InProcessCommunicator : public CommunicatorBase<RoundCommunicator> {
 public:
  InProcessCommunicator(const Topology& topo, InProcessFactory* factory)
      : CommunicatorBase(topo), factory_(factory) {}

  Status Connect(RoundStore* store) override;
  CollectiveStats stats() const override { return collective_stats(); }

  void Allreduce(void* data, size_t count, DataType dtype, ReduceOp op) override {
    Collective c(this);
    const size_t bytes = count * DataTypeSize(dtype);
    auto all = Group().Exchange(
        rank(), std::vector<char>(static_cast<char*>(data), static_cast<char*>(data) + bytes));
    ReduceFn reduce = ReduceFunc(dtype, op);
    std::memcpy(data, all[0].data(), bytes);
    for (int r = 1; r < size(); ++r) reduce(data, data, all[r].data(), count);
    if (op == ReduceOp::kAvg) DivideAll(data, count, dtype, size());
  }
  void AllreduceMany(const std::vector<TensorView>& tensors, ReduceOp op) override {
    for (const TensorView& t : tensors) Allreduce(t.data, t.count, t.dtype, op);
  }
  void Broadcast(void* data, size_t bytes, int root) override {
    Collective c(this);
    std::vector<char> mine;
    if (rank() == root) mine.assign(static_cast<char*>(data), static_cast<char*>(data) + bytes);
    auto all = Group().Exchange(rank(), std::move(mine));
    if (all[root].size() != bytes) throw WorkerLostError("in-process broadcast: sizes differ");
    std::memcpy(data, all[root].data(), bytes);
  }
  std::vector<std::vector<char>> Allgather(const void* data, size_t bytes) override {
    Collective c(this);
    const char* p = static_cast<const char*>(data);
    return Group().Exchange(rank(), std::vector<char>(p, p + bytes));
  }
  void Barrier() override {
    Collective c(this);
    Group().Exchange(rank(), {});
  }
  void Abort() override {
    aborted_.store(true);
    MutexLock l(mu_);
    if (group_) group_->Abort();
  }

  bool aborted() const { return aborted_.load(); }

 private:
  InProcessGroup& Group() {
    MutexLock l(mu_);
    if (aborted_.load()) throw WorkerLostError("in-process communicator: aborted");
    if (!group_) throw WorkerLostError("in-process communicator: not connected");
    return *group_;
  }

  InProcessFactory* const factory_;
  std::atomic<bool> aborted_{false};
  Mutex mu_;
  std::shared_ptr<InProcessGroup> group_ ELASTIC_GUARDED_BY(mu_);
};

// Makes InProcessCommunicators and keeps every one it made, for the test to look at.
class InProcessFactory : public CommunicatorFactory {
 public:
  StatusOr<std::unique_ptr<RoundCommunicator>> New(const Topology& topo) override {
    auto c = std::make_unique<InProcessCommunicator>(topo, this);
    MutexLock l(mu_);
    made_.push_back(c.get());
    cv_.notify_all();
    return std::unique_ptr<RoundCommunicator>(std::move(c));
  }
  // Waits (up to kWait) until it has made `n`; whether it has.
  bool WaitForMade(size_t n) {
    MutexLock l(mu_);
    return cv_.wait_until(l.native(), SteadyClock::now() + kWait,
                          [&]() ELASTIC_REQUIRES(mu_) { return made_.size() >= n; });
  }

  // How many communicators it made.
  size_t made() const {
    MutexLock l(mu_);
    return made_.size();
  }
  // Whether `c` is one of those it made (communicators are only compared, never used: the
  // agent may have destroyed them).
  bool Made(const Communicator* c) const {
    MutexLock l(mu_);
    return std::find(made_.begin(), made_.end(), c) != made_.end();
  }

  // Connects of rank `rank` wait until ReleaseConnects() (or kWait): a rank slow to connect.
  void HoldConnects(int rank) { held_rank_.store(rank); }
  void ReleaseConnects() {
    MutexLock l(mu_);
    held_rank_.store(-1);
    cv_.notify_all();
  }

  // A new group of `size` ranks (rank 0's connect); its number.
  int64_t NewGroup(int size) {
    MutexLock l(mu_);
    groups_[next_] = std::make_shared<InProcessGroup>(size);
    return next_++;
  }
  std::shared_ptr<InProcessGroup> GroupOf(int64_t id) {
    MutexLock l(mu_);
    auto it = groups_.find(id);
    return it == groups_.end() ? nullptr : it->second;
  }
  void WaitIfHeld(int rank) {
    MutexLock l(mu_);
    cv_.wait_until(l.native(), SteadyClock::now() + kWait,
                   [&] { return held_rank_.load() != rank; });
  }

 private:
  mutable Mutex mu_;
  std::condition_variable cv_;
  std::vector<const Communicator*> made_ ELASTIC_GUARDED_BY(mu_);
  std::map<int64_t, std::shared_ptr<InProcessGroup>> groups_ ELASTIC_GUARDED_BY(mu_);
  int64_t next_ ELASTIC_GUARDED_BY(mu_) = 0;
  std::atomic<int> held_rank_{-1};
};

inline Status InProcessCommunicator::Connect(RoundStore* store) {
  factory_->WaitIfHeld(rank());
  if (aborted_.load()) return Aborted("in-process communicator: aborted before connecting");
  int64_t id = -1;
  if (rank() == 0) {
    id = factory_->NewGroup(size());
    RETURN_IF_ERROR(store->Set("inproc", std::to_string(id)));
  } else {
    auto got = store->Get({"inproc"}, kWait);
    if (!got.ok()) return aborted_.load() ? Aborted(got.status().message()) : got.status();
    id = std::stoll((*got)[0]);
  }
  std::shared_ptr<InProcessGroup> group = factory_->GroupOf(id);
  if (!group) return Internal("in-process communicator: no group " + std::to_string(id));
  {
    MutexLock l(mu_);
    group_ = group;
    if (aborted_.load()) group_->Abort();  // an Abort() that came meanwhile
  }
  return group->Attach();
}

}  // namespace elastic::worker_agent::testing
