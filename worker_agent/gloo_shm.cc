// GlooCommunicator's shared-memory host group: the plan each round agrees on (which hosts
// map a segment, reused or new), and the collectives through it (the hierarchical allreduce,
// broadcast and allgather of one host). The rest of the communicator is in
// worker_agent/gloo_communicator.cc.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>

#include "common/mutex.h"
#include "common/test_hook.h"
#include "worker_agent/gloo_communicator.h"
#include "worker_agent/reduce.h"
#include "worker_agent/shm_group.h"

namespace elastic::worker_agent {

namespace {

// The keys of the cross-host communicator, apart from the round's own: "x/<cross_rank>".
class PrefixStore : public RoundStore {
 public:
  PrefixStore(RoundStore* inner, std::string prefix) : inner_(inner), prefix_(std::move(prefix)) {}
  Status Set(const std::string& key, const std::string& value) override {
    return inner_->Set(prefix_ + key, value);
  }
  StatusOr<std::vector<std::string>> Get(const std::vector<std::string>& keys,
                                         Duration timeout) override {
    return inner_->Get(Prefixed(keys), timeout);
  }
  StatusOr<std::vector<std::string>> SetAndGet(const std::string& key, const std::string& value,
                                               const std::vector<std::string>& keys,
                                               Duration timeout) override {
    return inner_->SetAndGet(prefix_ + key, value, Prefixed(keys), timeout);
  }

 private:
  std::vector<std::string> Prefixed(const std::vector<std::string>& keys) const {
    std::vector<std::string> k;
    for (const auto& key : keys) k.push_back(prefix_ + key);
    return k;
  }
  RoundStore* inner_;
  std::string prefix_;
};

}  // namespace

uint64_t GlooCommunicator::shm_token() const { return shm_ ? shm_->token() : 0; }

std::string GlooCommunicator::NewSegment(std::unique_ptr<ShmGroup>* group,
                                         std::string* why) const {
  auto made = ShmGroup::Create(topo_.local_size, options_.shm_slot_bytes);
  if (!made.ok()) {
    *why = made.status().message();
    return "off";
  }
  *group = std::move(made).value();
  TestHook("shm_made", 0);
  return (*group)->Describe();
}

std::unique_ptr<ShmGroup> GlooCommunicator::OpenSegment(const std::string& description,
                                                        std::string* why) const {
  auto opened = ShmGroup::Open(description, topo_.local_rank, topo_.local_size);
  if (!opened.ok()) {
    *why = opened.status().message();
    return nullptr;
  }
  return std::move(opened).value();
}

Status GlooCommunicator::PlanShm(RoundStore* store, ShmPlan* plan) {
  if (!SomeHostShared()) return Status::Ok();
  plan->want = options_.shm;
  if (topo_.local_size < 2) return Status::Ok();
  const std::string key = "shm/" + std::to_string(topo_.cross_rank);
  if (topo_.local_rank != 0) {
    plan->fetch_key = key;
    return Status::Ok();
  }
  // Local rank 0 always answers, so that the others never wait for a segment that will not
  // come.
  plan->description = "off";
  if (plan->want) {
    const size_t slot = options_.shm_slot_bytes;
    std::unique_ptr<ShmGroup> kept = options_.shm_keeper ? options_.shm_keeper->Take() : nullptr;
    if (kept && kept->Fits(topo_.local_size) && (slot == 0 || slot == kept->slot_bytes()) &&
        kept->AllMappersQuiet()) {
      kept->Reuse(0, topo_.local_size);
      plan->description = kept->DescribeReuse();
      plan->group = std::move(kept);
    } else {
      kept.reset();  // unmapped before a new one is made
      plan->description = NewSegment(&plan->group, &plan->why);
    }
  }
  return store->Set(key, plan->description);
}

Status GlooCommunicator::SetUpHierarchy(RoundStore* store, ShmPlan* plan) {
  if (!SomeHostShared()) return Status::Ok();
  std::unique_ptr<ShmGroup> group = std::move(plan->group);
  std::string why = plan->why;  // why this rank cannot take part (empty: it can, or it is off)
  uint64_t token = 0;
  const bool offered = topo_.local_size > 1 && plan->want &&
                       ShmGroup::ParseReuse(plan->description, &token);
  bool missing = false;  // its host reuses a segment this rank does not hold
  if (topo_.local_size > 1 && topo_.local_rank != 0 && plan->want &&
      plan->description != "off") {
    std::unique_ptr<ShmGroup> kept = options_.shm_keeper ? options_.shm_keeper->Take() : nullptr;
    if (offered) {
      if (kept && kept->token() == token && kept->Fits(topo_.local_size)) {
        kept->Reuse(topo_.local_rank, topo_.local_size);
        group = std::move(kept);
      } else {
        missing = true;
      }
    } else {
      kept.reset();  // a new segment replaces it
      group = OpenSegment(plan->description, &why);
    }
  }
  // 2: this rank takes part (alone on its host, or holding the segment); 1: it would, but its
  // host reuses a segment it does not hold (it is new there); 0: it cannot, or it is off.
  int64_t vote = 0;
  if (plan->want) vote = topo_.local_size == 1 || group ? 2 : missing ? 1 : 0;
  {
    MutexLock g(abort_mu_);
    if (aborted_.load()) return Aborted("the communicator was aborted while connecting");
    shm_ = std::move(group);
  }
  // Every rank agrees, and on the chunk: the cross-host ring reduces a chunk at a time, so
  // every host must cut the same chunks (the smallest slot). After it every local rank has
  // mapped the segment, so its name can go.
  int64_t agree[2] = {vote, shm_ ? static_cast<int64_t>(shm_->slot_bytes()) : INT64_MAX};
  RETURN_IF_ERROR(Agree(store, "shm", agree, 2));
  const bool replaced = agree[0] == 1;
  if (replaced) {
    // A rank new to its host's reused segment: the hosts that reused one make a new one, and
    // every rank agrees again.
    if (offered) {
      RETURN_IF_ERROR(ReplaceReusedSegment(
          store, "shm/" + std::to_string(topo_.cross_rank) + "/new", &why));
    }
    agree[0] = plan->want && (topo_.local_size == 1 || shm_) ? 2 : 0;
    agree[1] = shm_ ? static_cast<int64_t>(shm_->slot_bytes()) : INT64_MAX;
    RETURN_IF_ERROR(Agree(store, "shm-again", agree, 2));
  }
  if (shm_) shm_->Unlink();
  chunk_bytes_ = static_cast<size_t>(agree[1]);
  if (agree[0] != 2) {
    if (!why.empty()) {
      spdlog::info("hierarchical shared-memory allreduce off for this round: {}", why);
    }
    MutexLock g(abort_mu_);
    shm_.reset();
    return Status::Ok();
  }
  if (topo_.local_rank == 0 && topo_.cross_size > 1) {
    GlooOptions cross_options = options_;
    cross_options.shm = false;
    Topology cross{topo_.cross_rank, topo_.cross_size, 0, 1, topo_.cross_rank, topo_.cross_size};
    ASSIGN_OR_RETURN(std::unique_ptr<GlooCommunicator> made, New(cross, cross_options));
    GlooCommunicator* c = made.get();
    {
      MutexLock g(abort_mu_);
      cross_ = std::move(made);
      if (aborted_.load()) cross_->Abort();
    }
    PrefixStore prefixed(store, "x/");
    RETURN_IF_ERROR(c->Connect(&prefixed));
  }
  hier_ = true;
  if (topo_.local_rank == 0 && topo_.local_size > 1) {
    spdlog::debug("rank {}: shared-memory segment {:x} for {} local ranks: {}", topo_.rank,
                  shm_->token(), topo_.local_size,
                  offered && !replaced ? "kept from an earlier round"
                  : replaced           ? "new (a rank was new to some host's kept one)"
                                       : "new");
  }
  return Status::Ok();
}

Status GlooCommunicator::ReplaceReusedSegment(RoundStore* store, const std::string& key,
                                              std::string* why) {
  {
    MutexLock g(abort_mu_);
    shm_.reset();
  }
  std::unique_ptr<ShmGroup> group;
  if (topo_.local_rank == 0) {
    RETURN_IF_ERROR(store->Set(key, NewSegment(&group, why)));
  } else {
    ASSIGN_OR_RETURN(std::vector<std::string> got, store->Get({key}, options_.connect_timeout));
    if (got.size() == 1 && got[0] != "off") group = OpenSegment(got[0], why);
  }
  MutexLock g(abort_mu_);
  if (aborted_.load()) return Aborted("the communicator was aborted while connecting");
  shm_ = std::move(group);
  return Status::Ok();
}

void GlooCommunicator::HierarchicalAllreduce(void* data, size_t count, DataType dtype,
                                             ReduceOp op) {
  // The cross-host ring sums; the average divides once, by the whole size, at the end.
  const ReduceOp cross_op = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  const size_t es = DataTypeSize(dtype);
  const size_t chunk = chunk_bytes_ / es;
  if (!shm_) {
    // The only rank of its host: straight into the cross-host ring, in the same chunks as
    // the other hosts.
    char* bytes = static_cast<char*>(data);
    for (size_t off = 0; off < count; off += chunk) {
      cross_->Allreduce(bytes + off * es, std::min(chunk, count - off), dtype, cross_op);
    }
  } else {
    const TimePoint deadline = SteadyClock::now() + options_.collective_timeout;
    const int local_size = shm_->local_size(), me = shm_->local_rank();
    const bool cross_phase = topo_.cross_size > 1;
    // Local rank r reduces slice r of each chunk (whole cache lines), reading its own
    // slice from its own buffer: that slice is never copied in. The result goes to slot 0
    // of the half (slice 0 there is free: rank 0 never copies it in), where the cross-host
    // ring finds it whole.
    const size_t line = std::max<size_t>(1, 64 / es);
    const auto fn = ReduceFunc(dtype, cross_op);
    char* bytes = static_cast<char*>(data);
    // The reduction runs a block at a time in a buffer that stays in the L1 cache: each
    // input is read once, the result written once.
    constexpr size_t kBlockBytes = 16 << 10;
    alignas(64) char acc[kBlockBytes];
    const size_t block = kBlockBytes / es;
    for (size_t off = 0; off < count; off += chunk) {
      const size_t n = std::min(chunk, count - off);
      const int half = static_cast<int>(chunks_++ & 1);
      char* mine = bytes + off * es;
      const size_t per = ((n + local_size - 1) / local_size + line - 1) / line * line;
      auto slice = [&](int r) {
        size_t b = std::min(n, per * r);
        return std::make_pair(b, std::min(n, b + per));
      };
      auto [b, e] = slice(me);
      // Copy in everything but this rank's own slice.
      std::memcpy(shm_->slot(half, me), mine, b * es);
      std::memcpy(shm_->slot(half, me) + e * es, mine + e * es, (n - e) * es);
      shm_->Barrier(aborted_, deadline);
      TestHook("shm_reduce", static_cast<int64_t>(chunks_ - 1));
      char* out = shm_->slot(half, 0);
      for (size_t k = b; k < e; k += block) {
        const size_t m = std::min(block, e - k);
        auto input = [&](int r) { return r == me ? mine + k * es : shm_->slot(half, r) + k * es; };
        std::memcpy(acc, input(0), m * es);
        for (int r = 1; r < local_size; ++r) fn(acc, acc, input(r), m);
        // One host: the average is made here, while the block is in the cache, rather than
        // in a pass of its own over the whole result afterwards.
        if (!cross_phase && op == ReduceOp::kAvg) DivideAll(acc, m, dtype, topo_.size);
        std::memcpy(out + k * es, acc, m * es);
        if (!cross_phase) std::memcpy(mine + k * es, acc, m * es);
      }
      shm_->Barrier(aborted_, deadline);
      if (cross_phase) {
        if (cross_) cross_->Allreduce(out, n, dtype, cross_op);
        shm_->Barrier(aborted_, deadline);
        std::memcpy(mine, out, n * es);
      } else {
        // Copy out the others' slices (this rank's own is in place already).
        std::memcpy(mine, out, b * es);
        std::memcpy(mine + e * es, out + e * es, (n - e) * es);
      }
      // The next chunk uses the other half: no barrier is needed after the copy-out.
    }
    if (!cross_phase) return;  // averaged block by block above
  }
  if (op == ReduceOp::kAvg) DivideAll(data, count, dtype, topo_.size);
}

// Every rank is on this host: the data goes through the segment in chunks of a half (all its
// slots), alternating halves as the allreduce does, so a chunk needs one barrier (between the
// copy in and the copies out) and none after: the half a rank still reads from is written
// again only two chunks later, after a barrier that rank has not reached yet.
void GlooCommunicator::ShmBroadcast(char* data, size_t bytes, int root) {
  const TimePoint deadline = SteadyClock::now() + options_.collective_timeout;
  const size_t cap = shm_->half_bytes();
  for (size_t off = 0; off < bytes; off += cap) {
    const size_t n = std::min(cap, bytes - off);
    const int half = static_cast<int>(chunks_++ & 1);
    char* buf = shm_->slot(half, 0);
    if (topo_.rank == root) std::memcpy(buf, data + off, n);
    TestHook("shm_broadcast", static_cast<int64_t>(off / cap));
    shm_->Barrier(aborted_, deadline);
    if (topo_.rank != root) std::memcpy(data + off, buf, n);
  }
}

// Each rank writes its part into its own slot, a slot at a time (the first chunk starts with
// its rank and size), and reads everyone's after the chunk's barrier; halves alternate as in
// ShmBroadcast. Ranks may give different sizes: the chunks go on until the largest is whole.
std::vector<std::vector<char>> GlooCommunicator::ShmAllgather(const char* data, size_t bytes) {
  struct Head {
    int64_t rank;
    int64_t bytes;
  };
  std::vector<std::vector<char>> out(topo_.size);
  const TimePoint deadline = SteadyClock::now() + options_.collective_timeout;
  const int local_size = shm_->local_size(), me = shm_->local_rank();
  const size_t slot = shm_->slot_bytes(), first = slot - sizeof(Head);
  std::vector<int> rank_of(local_size, -1);
  size_t chunks = 1;
  for (size_t j = 0; j < chunks; ++j) {
    const int half = static_cast<int>(chunks_++ & 1);
    // What of a part of `size` bytes chunk j holds: [begin, end), at `at` in the slot.
    auto piece = [&](size_t size, size_t* begin, size_t* end) {
      *begin = j == 0 ? 0 : first + (j - 1) * slot;
      *end = std::min(size, j == 0 ? first : *begin + slot);
      *begin = std::min(*begin, *end);
      return j == 0 ? sizeof(Head) : 0;
    };
    char* mine = shm_->slot(half, me);
    if (j == 0) {
      Head h{topo_.rank, static_cast<int64_t>(bytes)};
      std::memcpy(mine, &h, sizeof h);
    }
    size_t b, e;
    size_t at = piece(bytes, &b, &e);
    if (e > b) std::memcpy(mine + at, data + b, e - b);
    TestHook("shm_allgather", static_cast<int64_t>(j));
    shm_->Barrier(aborted_, deadline);
    if (j == 0) {
      size_t largest = 0;
      for (int l = 0; l < local_size; ++l) {
        Head h;
        std::memcpy(&h, shm_->slot(half, l), sizeof h);
        if (h.rank < 0 || h.rank >= topo_.size || h.bytes < 0 ||
            std::count(rank_of.begin(), rank_of.end(), h.rank) > 0) {
          throw WorkerLostError("allgather: local rank " + std::to_string(l) +
                                " wrote a bad header (rank " + std::to_string(h.rank) + ")");
        }
        rank_of[l] = static_cast<int>(h.rank);
        out[h.rank].resize(static_cast<size_t>(h.bytes));
        largest = std::max(largest, static_cast<size_t>(h.bytes));
      }
      if (largest > first) chunks = 1 + (largest - first + slot - 1) / slot;
    }
    for (int l = 0; l < local_size; ++l) {
      std::vector<char>& part = out[rank_of[l]];
      at = piece(part.size(), &b, &e);
      if (e > b) std::memcpy(part.data() + b, shm_->slot(half, l) + at, e - b);
    }
  }
  return out;
}

}  // namespace elastic::worker_agent
