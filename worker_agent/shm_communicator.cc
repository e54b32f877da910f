// ShmCommunicator (worker_agent/shm_communicator.h): the host's collectives through its
// shared-memory segment.
#include "worker_agent/shm_communicator.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "common/test_hook.h"
#include "worker_agent/hierarchical.h"
#include "worker_agent/reduce.h"

namespace elastic::worker_agent {

ShmCommunicator::ShmCommunicator(const Topology& topo, std::unique_ptr<ShmGroup> group,
                                 size_t chunk_bytes, Duration collective_timeout)
    : CommunicatorBase(topo),
      group_(std::move(group)),
      chunk_bytes_(chunk_bytes),
      timeout_(collective_timeout) {}

namespace {
void RequireOneHost(const Topology& topo, const char* what) {
  if (topo.cross_size != 1) {
    throw std::logic_error(std::string("ShmCommunicator::") + what +
                           " on a round that spans hosts (the host's part of it is "
                           "HierarchicalAllreduce's)");
  }
}
}  // namespace

void ShmCommunicator::Allreduce(void* data, size_t count, DataType dtype, ReduceOp op) {
  RequireOneHost(topo_, "Allreduce");
  if (count == 0) return;
  HierarchicalAllreduce(topo_, this, nullptr, chunk_bytes_, timeout_, data, count, dtype, op);
}

void ShmCommunicator::AllreduceMany(const std::vector<TensorView>& tensors, ReduceOp op) {
  for (const TensorView& t : tensors) Allreduce(t.data, t.count, t.dtype, op);
}

char* ShmCommunicator::ReduceChunk(char* mine, size_t n, DataType dtype, ReduceOp op,
                                   bool finish_here, int average_over, TimePoint deadline) {
  const size_t es = DataTypeSize(dtype);
  const int local_size = group_->local_size(), me = group_->local_rank();
  // Local rank r reduces slice r of the chunk (whole cache lines). The result goes to slot 0
  // of the half (slice 0 there is free: rank 0 never copies it in), where the cross-host ring
  // finds it whole.
  const size_t line = std::max<size_t>(1, 64 / es);
  const auto fn = ReduceFunc(dtype, op);
  half_ = NextHalf();
  const size_t per = ((n + local_size - 1) / local_size + line - 1) / line * line;
  begin_ = std::min(n, per * me);
  end_ = std::min(n, begin_ + per);
  const size_t b = begin_, e = end_;
  // Copy in everything but this rank's own slice.
  std::memcpy(group_->slot(half_, me), mine, b * es);
  std::memcpy(group_->slot(half_, me) + e * es, mine + e * es, (n - e) * es);
  group_->Barrier(aborted_, deadline);
  TestHook("shm_reduce", static_cast<int64_t>(chunks_ - 1));
  char* out = group_->slot(half_, 0);
  // The reduction runs a block at a time in a buffer that stays in the L1 cache: each input is
  // read once, the result written once.
  constexpr size_t kBlockBytes = 16 << 10;
  alignas(64) char acc[kBlockBytes];
  const size_t block = kBlockBytes / es;
  for (size_t k = b; k < e; k += block) {
    const size_t m = std::min(block, e - k);
    auto input = [&](int r) { return r == me ? mine + k * es : group_->slot(half_, r) + k * es; };
    std::memcpy(acc, input(0), m * es);
    for (int r = 1; r < local_size; ++r) fn(acc, acc, input(r), m);
    // The average is made here, while the block is in the cache, rather than in a pass of
    // its own over the whole result afterwards.
    if (average_over > 0) DivideAll(acc, m, dtype, average_over);
    std::memcpy(out + k * es, acc, m * es);
    if (finish_here) std::memcpy(mine + k * es, acc, m * es);
  }
  group_->Barrier(aborted_, deadline);
  return out;
}

void ShmCommunicator::CopyOthersOut(char* mine, size_t n, DataType dtype) const {
  // This rank's own slice is in place already. The next chunk uses the other half: no
  // barrier is needed after the copy-out.
  const size_t es = DataTypeSize(dtype);
  const char* out = group_->slot(half_, 0);
  std::memcpy(mine, out, begin_ * es);
  std::memcpy(mine + end_ * es, out + end_ * es, (n - end_) * es);
}

// The data goes through the segment in chunks of a half (all its slots), alternating halves
// as the allreduce does, so a chunk needs one barrier (between the copy in and the copies out)
// and none after: the half a rank still reads from is written again only two chunks later,
// after a barrier that rank has not reached yet.
void ShmCommunicator::Broadcast(void* data, size_t bytes, int root) {
  RequireOneHost(topo_, "Broadcast");
  if (root < 0 || root >= topo_.size) {
    throw std::invalid_argument("broadcast root " + std::to_string(root) + " out of range");
  }
  char* p = static_cast<char*>(data);
  const TimePoint deadline = SteadyClock::now() + timeout_;
  const size_t cap = group_->half_bytes();
  for (size_t off = 0; off < bytes; off += cap) {
    const size_t n = std::min(cap, bytes - off);
    const int half = NextHalf();
    char* buf = group_->slot(half, 0);
    if (topo_.rank == root) std::memcpy(buf, p + off, n);
    TestHook("shm_broadcast", static_cast<int64_t>(off / cap));
    group_->Barrier(aborted_, deadline);
    if (topo_.rank != root) std::memcpy(p + off, buf, n);
  }
}

// Each rank writes its part into its own slot, a slot at a time (the first chunk starts with
// its rank and size), and reads everyone's after the chunk's barrier; halves alternate as in
// Broadcast. Ranks may give different sizes: the chunks go on until the largest is whole.
std::vector<std::vector<char>> ShmCommunicator::Allgather(const void* source, size_t bytes) {
  RequireOneHost(topo_, "Allgather");
  struct Head {
    int64_t rank;
    int64_t bytes;
  };
  const char* data = static_cast<const char*>(source);
  std::vector<std::vector<char>> out(topo_.size);
  const TimePoint deadline = SteadyClock::now() + timeout_;
  const int local_size = group_->local_size(), me = group_->local_rank();
  const size_t slot = group_->slot_bytes(), first = slot - sizeof(Head);
  std::vector<int> rank_of(local_size, -1);
  size_t chunks = 1;
  for (size_t j = 0; j < chunks; ++j) {
    const int half = NextHalf();
    // What of a part of `size` bytes chunk j holds: [begin, end), at `at` in the slot.
    auto piece = [&](size_t size, size_t* begin, size_t* end) {
      *begin = j == 0 ? 0 : first + (j - 1) * slot;
      *end = std::min(size, j == 0 ? first : *begin + slot);
      *begin = std::min(*begin, *end);
      return j == 0 ? sizeof(Head) : 0;
    };
    char* mine = group_->slot(half, me);
    if (j == 0) {
      Head h{topo_.rank, static_cast<int64_t>(bytes)};
      std::memcpy(mine, &h, sizeof h);
    }
    size_t b, e;
    size_t at = piece(bytes, &b, &e);
    if (e > b) std::memcpy(mine + at, data + b, e - b);
    TestHook("shm_allgather", static_cast<int64_t>(j));
    group_->Barrier(aborted_, deadline);
    if (j == 0) {
      size_t largest = 0;
      for (int l = 0; l < local_size; ++l) {
        Head h;
        std::memcpy(&h, group_->slot(half, l), sizeof h);
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
      if (e > b) std::memcpy(part.data() + b, group_->slot(half, l) + at, e - b);
    }
  }
  return out;
}

void ShmCommunicator::Barrier() { group_->Barrier(aborted_, SteadyClock::now() + timeout_); }

void ShmCommunicator::Abort() {
  aborted_.store(true);
  if (group_) group_->Abort();
}

}  // namespace elastic::worker_agent
