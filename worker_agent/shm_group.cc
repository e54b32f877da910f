#include "worker_agent/shm_group.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>
#include <random>
#include <sstream>

#include "common/mutex.h"

namespace elastic::worker_agent {
namespace {

constexpr uint64_t kMagic = 0x31686d7363616c65ull;  // "elacshm1"
constexpr size_t kHeaderBytes = 8192;
constexpr uint32_t kAbortedBit = 1u << 31;  // in Header::generation
constexpr uint32_t kAbortedPeer = 1, kAbortedTimeout = 2;  // Header::aborted

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, Duration timeout) {
  auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(timeout).count();
  timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  // Not FUTEX_PRIVATE: the word is shared between processes.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void FutexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr,
          0);
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

}  // namespace

struct ShmGroup::Header {
  uint64_t magic;
  uint64_t token;
  uint64_t slot_bytes;
  uint32_t capacity;  // the local ranks it was made for: the most a round may use
  alignas(64) std::atomic<uint32_t> arrived;
  // The barrier's futex word: the count of barriers passed (low 31 bits) and kAbortedBit.
  alignas(64) std::atomic<uint32_t> generation;
  std::atomic<uint32_t> aborted;  // 0; kAbortedPeer; kAbortedTimeout (the first reason stays)
  alignas(64) std::atomic<int32_t> pids[kMaxLocalSize];  // this round's local ranks
  // The processes that mapped it (only the first round's can: the name goes after it), and
  // whether each one's collectives on it are over (Quiesce; Reuse clears it).
  std::atomic<int32_t> mapper_pids[kMaxLocalSize];
  std::atomic<uint8_t> quiet[kMaxLocalSize];
};
static_assert(sizeof(std::atomic<uint32_t>) == 4 && std::atomic<uint32_t>::is_always_lock_free,
              "the barrier's futex word must be a plain lock-free 32-bit word");

size_t ShmGroup::DefaultSlotBytes(int local_size) {
  // A half of 4 MiB in all stays in the cache; larger slots measured slower (bench/README).
  size_t per = (4u << 20) / static_cast<size_t>(std::max(local_size, 1));
  size_t slot = 64u << 10;
  while (slot * 2 <= per && slot < (1u << 20)) slot *= 2;
  return slot;
}

StatusOr<std::unique_ptr<ShmGroup>> ShmGroup::Create(int local_size, size_t slot_bytes) {
  if (local_size < 1 || local_size > kMaxLocalSize) {
    return InvalidArgument("a shared-memory group holds 1 to " + std::to_string(kMaxLocalSize) +
                           " local ranks, not " + std::to_string(local_size));
  }
  static_assert(sizeof(Header) <= kHeaderBytes, "the header outgrew its pages");
  if (slot_bytes == 0) slot_bytes = DefaultSlotBytes(local_size);
  if (slot_bytes > (256u << 20)) {
    return InvalidArgument("a shared-memory slot of " + std::to_string(slot_bytes) +
                           " bytes is over the limit of 256 MiB (ELASTIC_SHM_SLOT_BYTES?)");
  }
  slot_bytes = (slot_bytes + 4095) / 4096 * 4096;
  std::unique_ptr<ShmGroup> g(new ShmGroup());
  std::random_device rd;
  g->token_ = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  if (g->token_ == 0) g->token_ = 1;
  std::ostringstream name;
  name << "/elastic-" << getpid() << "-" << std::hex << g->token_;
  g->name_ = name.str();
  g->owner_ = true;
  g->local_rank_ = 0;
  g->local_size_ = local_size;
  g->capacity_ = local_size;
  g->slot_bytes_ = slot_bytes;
  g->bytes_ = kHeaderBytes + 2 * static_cast<size_t>(local_size) * slot_bytes;
  int fd = shm_open(g->name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return Unavailable(Errno("shm_open(" + g->name_ + ")"));
  auto fail = [&](const std::string& why) {
    close(fd);
    shm_unlink(g->name_.c_str());
    g->unlinked_ = true;
    return Unavailable(why);
  };
  if (ftruncate(fd, static_cast<off_t>(g->bytes_)) != 0) return fail(Errno("ftruncate"));
  // Reserve the pages now: on a full tmpfs a later first touch would be SIGBUS.
  if (int err = posix_fallocate(fd, 0, static_cast<off_t>(g->bytes_)); err != 0) {
    return fail("reserving " + std::to_string(g->bytes_ >> 10) + " KiB in /dev/shm failed: " +
                std::strerror(err) + " (a small /dev/shm, e.g. a container's 64 MiB default?)");
  }
  void* p = mmap(nullptr, g->bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) return fail(Errno("mmap"));
  close(fd);
  g->base_ = p;
  g->header_ = new (p) Header();
  g->header_->magic = kMagic;
  g->header_->token = g->token_;
  g->header_->slot_bytes = slot_bytes;
  g->header_->capacity = static_cast<uint32_t>(local_size);
  g->header_->pids[0].store(getpid());
  g->header_->mapper_pids[0].store(getpid());
  return g;
}

StatusOr<std::unique_ptr<ShmGroup>> ShmGroup::Open(const std::string& description,
                                                   int local_rank, int local_size) {
  std::istringstream in(description);
  std::string name;
  uint64_t token = 0, slot_bytes = 0;
  int size = 0;
  in >> name >> std::hex >> token >> std::dec >> slot_bytes >> size;
  if (!in || name.rfind("/elastic-", 0) != 0 || name.find('/', 1) != std::string::npos ||
      slot_bytes == 0 || slot_bytes % 4096 != 0 || slot_bytes > (1ull << 30)) {
    return InvalidArgument("bad shared-memory description '" + description + "'");
  }
  if (size != local_size || local_rank < 1 || local_rank >= local_size) {
    return InvalidArgument("shared-memory group of " + std::to_string(size) +
                           " ranks opened as local rank " + std::to_string(local_rank) + " of " +
                           std::to_string(local_size));
  }
  std::unique_ptr<ShmGroup> g(new ShmGroup());
  g->name_ = name;
  g->token_ = token;
  g->local_rank_ = local_rank;
  g->local_size_ = local_size;
  g->capacity_ = local_size;
  g->slot_bytes_ = slot_bytes;
  g->bytes_ = kHeaderBytes + 2 * static_cast<size_t>(local_size) * slot_bytes;
  int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    return Unavailable(Errno("shm_open(" + name + ")") +
                       " (is local rank 0 of this host on another machine?)");
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != g->bytes_) {
    close(fd);
    return Unavailable("shared-memory segment " + name + " has the wrong size");
  }
  void* p = mmap(nullptr, g->bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return Unavailable(Errno("mmap"));
  g->base_ = p;
  g->header_ = static_cast<Header*>(p);
  if (g->header_->magic != kMagic || g->header_->token != token ||
      g->header_->capacity != static_cast<uint32_t>(local_size) ||
      g->header_->slot_bytes != slot_bytes) {
    return Unavailable("shared-memory segment " + name + " is not the one local rank 0 made");
  }
  g->mapper_ = local_rank;
  g->header_->pids[local_rank].store(getpid());
  g->header_->mapper_pids[local_rank].store(getpid());
  return g;
}

std::string ShmGroup::DescribeReuse() const {
  std::ostringstream out;
  out << "reuse " << std::hex << token_;
  return out.str();
}

bool ShmGroup::ParseReuse(const std::string& description, uint64_t* token) {
  std::istringstream in(description);
  std::string word;
  uint64_t t = 0;
  in >> word >> std::hex >> t;
  if (!in || word != "reuse" || t == 0) return false;
  *token = t;
  return true;
}

void ShmGroup::Quiesce() {
  if (header_) header_->quiet[mapper_].store(1, std::memory_order_release);
}

bool ShmGroup::AllMappersQuiet() const {
  for (uint32_t m = 0; m < header_->capacity; ++m) {
    if (header_->quiet[m].load(std::memory_order_acquire)) continue;
    int32_t pid = header_->mapper_pids[m].load();
    if (pid <= 0) continue;  // that local rank never mapped it
    if (kill(pid, 0) != 0 && errno == ESRCH) continue;  // gone: it writes no more
    return false;
  }
  return true;
}

void ShmGroup::Reuse(int local_rank, int local_size) {
  if (local_rank == 0) {
    // Every process that mapped it is quiet or gone (AllMappersQuiet): nothing is inside a
    // barrier or a copy, so the barrier, the abort flag and the pid table start afresh.
    header_->arrived.store(0);
    header_->aborted.store(0);
    header_->generation.fetch_and(~kAbortedBit);
    for (auto& pid : header_->pids) pid.store(0);
  }
  local_rank_ = local_rank;
  local_size_ = local_size;
  header_->quiet[mapper_].store(0);
  header_->pids[local_rank].store(getpid());
}

ShmGroup::~ShmGroup() {
  // Unmapped, this process can write into it no more: as quiet as a process that is gone.
  Quiesce();
  if (base_) munmap(base_, bytes_);
  Unlink();
}

void ShmGroup::Unlink() {
  if (owner_ && !unlinked_) {
    shm_unlink(name_.c_str());
    unlinked_ = true;
  }
}

std::string ShmGroup::Describe() const {
  std::ostringstream out;
  out << name_ << " " << std::hex << token_ << std::dec << " " << slot_bytes_ << " "
      << local_size_;
  return out.str();
}

char* ShmGroup::slot(int half, int local_rank) const {
  return static_cast<char*>(base_) + kHeaderBytes +
         (static_cast<size_t>(half) * local_size_ + local_rank) * slot_bytes_;
}

void ShmKeeper::Keep(std::unique_ptr<ShmGroup> group) {
  group->Unlink();
  group->Quiesce();
  MutexLock g(mu_);
  kept_ = std::move(group);
}

std::unique_ptr<ShmGroup> ShmKeeper::Take() {
  MutexLock g(mu_);
  return std::move(kept_);
}

void ShmGroup::CheckPeersAlive() const {
  for (int r = 0; r < local_size_; ++r) {
    int32_t pid = header_->pids[r].load();
    if (pid > 0 && kill(pid, 0) != 0 && errno == ESRCH) {
      throw WorkerLostError("local rank " + std::to_string(r) + " (pid " + std::to_string(pid) +
                            ") is gone");
    }
  }
}

void ShmGroup::Barrier(const std::atomic<bool>& aborted, TimePoint deadline) {
  auto fail = [&] {
    throw WorkerLostError(
        header_->aborted.load() == kAbortedTimeout
            ? "host barrier (shared memory): a local rank timed out waiting for the other "
              "ranks of this host"
            : "host barrier (shared memory): aborted (a peer is gone)");
  };
  if (header_->aborted.load(std::memory_order_acquire) || aborted.load()) fail();
  const uint32_t word = header_->generation.load(std::memory_order_acquire);
  if (word & kAbortedBit) fail();
  if (header_->arrived.fetch_add(1, std::memory_order_acq_rel) + 1 ==
      static_cast<uint32_t>(local_size_)) {
    header_->arrived.store(0, std::memory_order_relaxed);
    // The count moves on; an abort bit set meanwhile stays.
    uint32_t cur = header_->generation.load(std::memory_order_relaxed);
    while (!header_->generation.compare_exchange_weak(
        cur, (cur & kAbortedBit) | ((cur + 1) & ~kAbortedBit), std::memory_order_acq_rel)) {
    }
    FutexWakeAll(&header_->generation);
    return;
  }
  // Passed when the count moves (the last rank arrived: passed even if an abort came after);
  // failed when the abort bit is set with the count unmoved. Both wake the futex, and the
  // bit also ends a futex wait that starts after Abort() (the word is no longer `word`).
  auto passed = [&] {
    const uint32_t now = header_->generation.load(std::memory_order_acquire);
    if ((now & ~kAbortedBit) != word) return true;
    if (now & kAbortedBit) fail();
    return false;
  };
  // A short spin (the others are often a few microseconds away), then sleep on the futex:
  // with more ranks than cores, spinning would take the core the last rank needs.
  for (int i = 0; i < 200; ++i) {
    if (passed()) return;
    CpuRelax();
  }
  // The sleep lasts until the word changes or the next check that the local peers are alive:
  // no periodic wake-ups, which with a hundred ranks on a few cores cost more than the
  // barrier itself.
  constexpr Duration kCheckEvery = std::chrono::milliseconds(200);
  TimePoint next_check = SteadyClock::now() + kCheckEvery;
  while (!passed()) {
    if (aborted.load()) fail();  // the communicator's own flag (its Abort() also sets the bit)
    TimePoint now = SteadyClock::now();
    if (now >= deadline) {
      uint32_t none = 0;
      header_->aborted.compare_exchange_strong(none, kAbortedTimeout);
      throw WorkerLostError(
          "host barrier (shared memory): timed out waiting for the other ranks of this host");
    }
    if (now >= next_check) {
      CheckPeersAlive();
      next_check = now + kCheckEvery;
    }
    FutexWait(&header_->generation, word, std::min(next_check, deadline) - now);
  }
}

void ShmGroup::Abort() {
  if (!header_) return;
  uint32_t none = 0;
  header_->aborted.compare_exchange_strong(none, kAbortedPeer);
  header_->generation.fetch_or(kAbortedBit, std::memory_order_acq_rel);
  FutexWakeAll(&header_->generation);
}

}  // namespace elastic::worker_agent
