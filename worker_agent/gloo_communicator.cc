#include "worker_agent/gloo_communicator.h"

#include <gloo/allgather.h>
#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/context.h>
#include <gloo/transport/pair.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/tcp/device.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <map>
#include <cstdlib>
#include <csignal>
#include <cstring>
#include <thread>

#include <spdlog/spdlog.h>

#include "common/process.h"
#include "common/test_hook.h"
#include "worker_agent/shm_group.h"

namespace elastic::worker_agent {
namespace {

// IEEE half and bfloat16 <-> float, for reductions on 16-bit types.
float HalfToFloat(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ff;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  int32_t exp = static_cast<int32_t>((x >> 23) & 0xff) - 127 + 15;
  uint32_t mant = x & 0x7fffffu;
  if (((x >> 23) & 0xff) == 0xff) return static_cast<uint16_t>(sign | 0x7c00u | (mant ? 0x200 : 0));
  if (exp >= 31) return static_cast<uint16_t>(sign | 0x7c00u);
  if (exp <= 0) {
    if (exp < -10) return static_cast<uint16_t>(sign);
    mant |= 0x800000u;
    uint32_t shift = static_cast<uint32_t>(14 - exp);
    uint32_t half = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = sign | (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1))) ++half;  // may carry into exponent: ok
  return static_cast<uint16_t>(half);
}

float Bf16ToFloat(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToBf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7f800000u) == 0x7f800000u && (x & 0x7fffffu))
    return static_cast<uint16_t>((x >> 16) | 0x40);
  uint32_t rounding = 0x7fffu + ((x >> 16) & 1);
  return static_cast<uint16_t>((x + rounding) >> 16);
}

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
gloo::AllreduceOptions::Func NativeReduce(ReduceOp op) {
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
gloo::AllreduceOptions::Func HalfReduce(ReduceOp op) {
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

// The element-wise reduction of `op` (kAvg sums; the caller divides) on `dtype`.
gloo::AllreduceOptions::Func ReduceFunc(DataType dtype, ReduceOp op) {
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

// Divides a sum by `size` (kAvg).
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

template <typename T>
void RunAllreduce(const std::shared_ptr<gloo::Context>& ctx, void* data, size_t count,
                  gloo::AllreduceOptions::Func fn, Duration timeout) {
  gloo::AllreduceOptions opts(ctx);
  opts.setOutput(static_cast<T*>(data), count);
  opts.setReduceFunction(std::move(fn));
  opts.setTimeout(std::chrono::duration_cast<std::chrono::milliseconds>(timeout));
  gloo::allreduce(opts);
}

}  // namespace

void SignalTcpContext(void* tcp_context, const std::string& msg);  // gloo_abort.cc

// Gloo's closeConnections() is graceful: it wakes no pending unbound-buffer wait, and a closed
// pair no longer sees its peer's EOF. What wakes every wait is the transport context's
// signalException; this subclass reaches the (protected) transport context, and lets the mesh
// be connected here rather than in connectFullMesh, which keeps its transport context out of
// reach (and so out of reach of an abort) until every pair has connected.
class AbortableContext : public gloo::rendezvous::Context {
 public:
  using gloo::rendezvous::Context::Context;
  void Adopt(std::shared_ptr<gloo::transport::Device> dev,
             std::shared_ptr<gloo::transport::Context> pairs) {
    device_ = std::move(dev);
    transportContext_ = std::move(pairs);
  }
  // gloo::Context::getDevice() throws when no device was set.
  std::shared_ptr<gloo::transport::Device> device() const { return device_; }
};

namespace {

void Signal(const std::shared_ptr<void>& pairs, const std::string& msg) {
  // A gloo::transport::Context made by a TCP device is a tcp::Context.
  if (pairs) SignalTcpContext(static_cast<gloo::transport::Context*>(pairs.get()), msg);
}

}  // namespace

// A rank's pairs all listen on the same device, so their addresses differ in a few bytes (the
// port and the sequence number): the first address goes out whole and each one after it as
// the bytes where it differs from the first. At 1024 ranks that is ~12 bytes per pair instead
// of 148, and the rendezvous server relays ~7 MiB instead of ~52 MiB per round.
//
//   "GA1" | base length (u32) | base | count (u32) |
//   count x [ peer (i32) | n (u16) | n x (offset (u16), byte) ]      n == 0xFFFF: whole address
//                                                                     follows (u32 length, bytes)
std::string EncodeAddresses(const std::vector<std::pair<int, std::vector<char>>>& per_peer) {
  auto put = [](std::string& out, auto v) {
    out.append(reinterpret_cast<const char*>(&v), sizeof v);
  };
  const std::vector<char> empty;
  const std::vector<char>& base = per_peer.empty() ? empty : per_peer.front().second;
  std::string out = "GA1";
  put(out, static_cast<uint32_t>(base.size()));
  out.append(base.data(), base.size());
  put(out, static_cast<uint32_t>(per_peer.size()));
  for (const auto& [peer, a] : per_peer) {
    put(out, static_cast<int32_t>(peer));
    std::string diffs;
    uint16_t n = 0;
    bool whole = a.size() != base.size() || a.size() > 0xFFFF;
    for (size_t i = 0; !whole && i < a.size(); ++i) {
      if (a[i] == base[i]) continue;
      if (++n == 0xFFFF) whole = true;
      put(diffs, static_cast<uint16_t>(i));
      diffs.push_back(a[i]);
    }
    if (whole) {
      put(out, static_cast<uint16_t>(0xFFFF));
      put(out, static_cast<uint32_t>(a.size()));
      out.append(a.data(), a.size());
    } else {
      put(out, n);
      out += diffs;
    }
  }
  return out;
}

std::vector<char> CanonicalPairAddress(const std::vector<char>& bytes) {
  gloo::transport::tcp::Address a(bytes);
  const sockaddr_storage& ss = a.getSockaddr();
  sockaddr_storage clean{};
  size_t len = ss.ss_family == AF_INET6 ? sizeof(sockaddr_in6)
               : ss.ss_family == AF_INET ? sizeof(sockaddr_in)
                                         : sizeof(sockaddr_storage);
  std::memcpy(&clean, &ss, len);
  return gloo::transport::tcp::Address(clean, a.getSeq()).bytes();
}

StatusOr<std::vector<char>> AddressFor(const std::string& blob, int rank, int peer) {
  size_t off = 0;
  auto get = [&](auto* v) {
    if (blob.size() - off < sizeof *v) return false;
    std::memcpy(v, blob.data() + off, sizeof *v);
    off += sizeof *v;
    return true;
  };
  auto bad = [&](const std::string& what) {
    return InvalidArgument("the addresses published by rank " + std::to_string(peer) +
                           " are malformed (" + what + ", " + std::to_string(blob.size()) +
                           " bytes)");
  };
  if (blob.compare(0, 3, "GA1") != 0) return bad("no GA1 header");
  off = 3;
  uint32_t base_len = 0, count = 0;
  if (!get(&base_len) || blob.size() - off < base_len) return bad("truncated first address");
  std::vector<char> base(blob.data() + off, blob.data() + off + base_len);
  off += base_len;
  if (!get(&count)) return bad("no count");
  for (uint32_t k = 0; k < count; ++k) {
    int32_t r = -1;
    uint16_t n = 0;
    if (!get(&r) || !get(&n)) return bad("truncated entry");
    if (n == 0xFFFF) {
      uint32_t len = 0;
      if (!get(&len) || blob.size() - off < len) return bad("truncated whole address");
      if (r == rank) return std::vector<char>(blob.data() + off, blob.data() + off + len);
      off += len;
      continue;
    }
    if (blob.size() - off < n * size_t{3}) return bad("truncated differences");
    if (r != rank) {
      off += n * size_t{3};
      continue;
    }
    std::vector<char> a = base;
    for (uint16_t d = 0; d < n; ++d) {
      uint16_t at = 0;
      get(&at);
      if (at >= a.size()) return bad("difference past the address");
      a[at] = blob[off++];
    }
    return a;
  }
  return InvalidArgument("rank " + std::to_string(peer) + " published no address for rank " +
                         std::to_string(rank));
}

namespace {

// Whether two socket addresses are the same IP address and port.
bool SameEndpoint(const sockaddr_storage& a, const sockaddr_storage& b) {
  if (a.ss_family != b.ss_family) return false;
  if (a.ss_family == AF_INET) {
    const auto& x = reinterpret_cast<const sockaddr_in&>(a);
    const auto& y = reinterpret_cast<const sockaddr_in&>(b);
    return x.sin_port == y.sin_port && x.sin_addr.s_addr == y.sin_addr.s_addr;
  }
  if (a.ss_family == AF_INET6) {
    const auto& x = reinterpret_cast<const sockaddr_in6&>(a);
    const auto& y = reinterpret_cast<const sockaddr_in6&>(b);
    return x.sin6_port == y.sin6_port &&
           std::memcmp(&x.sin6_addr, &y.sin6_addr, sizeof x.sin6_addr) == 0;
  }
  return false;
}

}  // namespace

// Gloo closes a pair with a FIN, and the side that closes first keeps the connection in
// TIME_WAIT for a minute. A job whose rounds change often (every recovery closes every
// pair) fills the ephemeral port range with them, and each new pair's listening socket then
// has to search that range for a free port (bind to port 0): at 128 local ranks, with 10k
// such sockets left by earlier rounds, a round change took 1-2 s instead of 0.4 s, most of it
// in the kernel. Gloo does not expose its sockets, so this process's connected TCP sockets
// are matched by address, once the pairs are connected: those to a peer's pair address (this
// side connected) and those on one of this rank's own pair addresses (it accepted). They
// close with a reset (SO_LINGER 0) instead: nothing is in flight when a communicator goes.
int ResetPairsOnClose(const std::vector<sockaddr_storage>& peers,
                      const std::vector<sockaddr_storage>& own) {
  DIR* dir = opendir("/proc/self/fd");
  if (!dir) return 0;
  const int dir_fd = dirfd(dir);
  int found = 0;
  while (dirent* e = readdir(dir)) {
    char* end = nullptr;
    long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == dir_fd) continue;
    sockaddr_storage local{}, remote{};
    socklen_t len = sizeof local;
    if (getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&local), &len) != 0) {
      continue;  // not a socket
    }
    if (local.ss_family != AF_INET && local.ss_family != AF_INET6) continue;
    len = sizeof remote;
    if (getpeername(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&remote), &len) != 0) {
      continue;  // not connected (a listening socket)
    }
    bool pair = false;
    for (const auto& a : peers) pair = pair || SameEndpoint(remote, a);
    for (const auto& a : own) pair = pair || SameEndpoint(local, a);
    if (!pair) continue;
    linger l{1, 0};
    if (setsockopt(static_cast<int>(fd), SOL_SOCKET, SO_LINGER, &l, sizeof l) == 0) ++found;
  }
  closedir(dir);
  return found;
}

namespace {

// One Gloo TCP device per address while some communicator of the process uses it: a device is
// an epoll loop thread that wakes every 10 ms (Debian's Gloo) as long as it lives. A recovery
// whose new round connects no pairs (one host, shared memory, no state sync) then has none
// ticking, and a waiting worker wakes only for its own work. Building a device costs a thread
// start; destroying one joins that thread (up to a tick), so the last holder hands it to
// ReleaseDevice, which destroys it on a helper thread, off the round's path.
//
// only_if_new: returns nullptr (and makes nothing) when this process made the device of this
// key before, so its address is known to work.
std::shared_ptr<gloo::transport::Device> SharedDevice(const gloo::transport::tcp::attr& attr,
                                                      const std::string& key,
                                                      bool only_if_new = false) {
  static auto* mu = new std::mutex();  // never destroyed: helper threads outlive main()
  static auto* devices = new std::map<std::string, std::weak_ptr<gloo::transport::Device>>();
  std::lock_guard<std::mutex> g(*mu);
  auto it = devices->find(key);
  if (only_if_new && it != devices->end()) return nullptr;
  std::shared_ptr<gloo::transport::Device> d;
  if (it != devices->end()) d = it->second.lock();
  if (!d) {
    d = gloo::transport::tcp::CreateDevice(attr);  // throws for an address it cannot use
    (*devices)[key] = d;
  }
  return d;
}

gloo::transport::tcp::attr DeviceAttr(const GlooOptions& options, std::string* key) {
  gloo::transport::tcp::attr attr;
  if (!options.iface.empty()) {
    attr.iface = options.iface;
    *key = "iface " + attr.iface;
  } else {
    attr.hostname = options.hostname.empty() ? "127.0.0.1" : options.hostname;
    *key = "host " + attr.hostname;
  }
  return attr;
}

// Threads kept for ForEachInParallel: created on first use and never joined (they sleep on a
// condition variable between uses). Creating and joining threads for every round cost more
// than the work they did when dozens of workers share a few cores.
class HelperPool {
 public:
  static HelperPool& Get() {
    static auto* pool = new HelperPool();  // never destroyed: its threads outlive main()
    return *pool;
  }
  // Runs `task` on up to `helpers` pool threads (started as needed, at most kMax in all).
  void Post(size_t helpers, const std::function<void()>& task) {
    std::lock_guard<std::mutex> g(mu_);
    for (size_t i = 0; i < helpers; ++i) queue_.push_back(task);
    while (threads_ < kMax && threads_ - busy_ < queue_.size()) {
      ++threads_;
      std::thread([this] { Loop(); }).detach();
    }
    // One wake-up per task: waking every idle thread for each post made them all contend for
    // the lock (hundreds of needless context switches per round with a hundred workers on a
    // few cores).
    for (size_t i = 0; i < helpers; ++i) cv_.notify_one();
  }

 private:
  static constexpr size_t kMax = 15;
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return !queue_.empty(); });
      std::function<void()> task = std::move(queue_.front());
      queue_.pop_front();
      ++busy_;
      lock.unlock();
      task();
      task = nullptr;
      lock.lock();
      --busy_;
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;  // guarded by mu_
  size_t threads_ = 0;                       // guarded by mu_
  size_t busy_ = 0;                          // guarded by mu_
};

// Drops `device`; when that is its last reference, on a pool thread: destroying a device joins
// its loop thread, which takes up to a tick (10 ms) and sat on the path of every recovery.
void ReleaseDevice(std::shared_ptr<gloo::transport::Device> device) {
  if (!device || device.use_count() > 1) return;
  auto holder = std::make_shared<std::shared_ptr<gloo::transport::Device>>(std::move(device));
  HelperPool::Get().Post(1, [holder] { holder->reset(); });
}

// Runs fn(i) for every i in `items`, on the calling thread and up to 15 pool threads at once,
// and rethrows the first exception. Gloo's TCP pairs block their caller on the device loop's
// next tick (up to 10 ms) when they connect (the active side) and when they close: one pair
// after another, the ticks add up; together they share a tick.
void ForEachInParallel(const std::vector<int>& items, const std::function<void(int)>& fn) {
  if (items.size() <= 1) {
    for (int i : items) fn(i);
    return;
  }
  struct Job {
    std::vector<int> items;
    std::function<void(int)> fn;
    std::atomic<size_t> next{0};
    std::mutex mu;
    std::condition_variable cv;
    size_t done = 0;  // guarded by mu
    std::exception_ptr first;  // guarded by mu
    void Work() {
      for (size_t k = next++; k < items.size(); k = next++) {
        std::exception_ptr error;
        try {
          fn(items[k]);
        } catch (...) {
          error = std::current_exception();
        }
        std::lock_guard<std::mutex> g(mu);
        if (error && !first) first = error;
        if (++done == items.size()) cv.notify_all();
      }
    }
  };
  // Shared with the helpers: one that starts after the items are all done finds none left.
  auto job = std::make_shared<Job>();
  job->items = items;
  job->fn = fn;
  HelperPool::Get().Post(std::min<size_t>(items.size(), 16) - 1, [job] { job->Work(); });
  job->Work();
  std::unique_lock<std::mutex> lock(job->mu);
  job->cv.wait(lock, [&] { return job->done == job->items.size(); });
  if (job->first) std::rethrow_exception(job->first);
}

}  // namespace

struct GlooCommunicator::Executor {
  std::mutex mu;
  std::condition_variable cv;
  std::function<void()> job;  // guarded by mu; the collective to run next
  uint64_t posted = 0;        // guarded by mu; jobs posted
  uint64_t finished = 0;      // guarded by mu; jobs finished
  std::exception_ptr error;   // guarded by mu; of the last finished job
  bool stop = false;          // guarded by mu
  bool abandoned = false;     // guarded by mu; a job outlived an abort
  std::thread thread;

  // A started executor: an idle one left by an earlier communicator, or a new one.
  static std::shared_ptr<Executor> Take() {
    {
      std::lock_guard<std::mutex> g(IdleMu());
      auto& idle = Idle();
      if (!idle.empty()) {
        auto ex = std::move(idle.back());
        idle.pop_back();
        return ex;
      }
    }
    auto ex = std::make_shared<Executor>();
    ex->thread = std::thread(&Executor::Loop, ex);
    return ex;
  }
  // Keeps an executor with nothing left to run for the next communicator (a thread started
  // and joined every round cost a recovery more than its collectives did); false when enough
  // are kept already.
  static bool Keep(const std::shared_ptr<Executor>& ex) {
    std::lock_guard<std::mutex> g(IdleMu());
    auto& idle = Idle();
    if (idle.size() >= 4) return false;
    {
      std::lock_guard<std::mutex> g(ex->mu);
      ex->abandoned = false;  // that communicator's; its collective ended
    }
    idle.push_back(ex);
    return true;
  }
  static std::mutex& IdleMu() {
    static auto* mu = new std::mutex();
    return *mu;
  }
  static std::vector<std::shared_ptr<Executor>>& Idle() {
    // Never destroyed: the idle threads hold their executors and outlive main().
    static auto* idle = new std::vector<std::shared_ptr<Executor>>();
    return *idle;
  }

  static void Loop(std::shared_ptr<Executor> self) {
    std::unique_lock<std::mutex> lock(self->mu);
    while (true) {
      self->cv.wait(lock, [&] { return self->stop || self->posted > self->finished; });
      if (self->posted == self->finished) return;  // stopped, nothing left
      std::function<void()> job = std::move(self->job);
      lock.unlock();
      std::exception_ptr error;
      try {
        job();
      } catch (...) {
        error = std::current_exception();
      }
      job = nullptr;
      lock.lock();
      self->error = error;
      ++self->finished;
      self->cv.notify_all();
    }
  }
};

GlooCommunicator::GlooCommunicator(std::shared_ptr<AbortableContext> ctx, Topology topo,
                                   GlooOptions options)
    : ctx_(std::move(ctx)), topo_(topo), options_(std::move(options)) {}

GlooCommunicator::~GlooCommunicator() {
  bool abandoned = false;
  if (exec_) {
    {
      std::lock_guard<std::mutex> g(exec_->mu);
      abandoned = exec_->abandoned && exec_->finished < exec_->posted;
    }
    if (abandoned || !Executor::Keep(exec_)) {
      {
        std::lock_guard<std::mutex> g(exec_->mu);
        exec_->stop = true;
        exec_->cv.notify_all();
      }
      // An abandoned collective holds the Gloo context it uses (its options share it) and
      // ends at Gloo's timeout; its thread then finds `stop` and returns.
      if (abandoned) {
        exec_->thread.detach();
      } else {
        exec_->thread.join();
      }
    }
  }
  std::lock_guard<std::mutex> g(abort_mu_);
  if (!abandoned && pairs_ && !peers_.empty()) {
    // Nothing uses the pairs any more: close them together (each close waits for a tick of
    // the device loop) rather than one by one in the context's destructor.
    auto* pairs = static_cast<gloo::transport::Context*>(pairs_.get());
    try {
      ForEachInParallel(peers_, [pairs](int i) { pairs->getPair(i).reset(); });
    } catch (const std::exception& e) {
      spdlog::debug("closing the Gloo pairs: {}", e.what());
    }
  }
  std::shared_ptr<gloo::transport::Device> device;
  if (device_) {
    device = std::static_pointer_cast<gloo::transport::Device>(device_);
  } else if (ctx_) {
    device = ctx_->device();
  }
  device_.reset();
  ctx_.reset();
  pairs_.reset();
  ReleaseDevice(std::move(device));
  // Nothing of this process uses the segment any more: the next round may reuse it.
  if (!abandoned && shm_ && options_.shm_keeper) options_.shm_keeper->Keep(std::move(shm_));
}

StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::New(const Topology& topo,
                                                                  const GlooOptions& options) {
  if (topo.size < 1 || topo.rank < 0 || topo.rank >= topo.size) {
    return InvalidArgument("bad topology: rank " + std::to_string(topo.rank) + " of " +
                           std::to_string(topo.size));
  }
  // Gloo writes to its peers' sockets without MSG_NOSIGNAL on some paths: a peer that dies
  // must surface as WorkerLostError, not kill this process with SIGPIPE.
  signal(SIGPIPE, SIG_IGN);
  try {
    std::string key;
    gloo::transport::tcp::attr attr = DeviceAttr(options, &key);
    // The first communicator of the process makes the device here, so that an address it
    // cannot use is an error of New (the caller's to fix) rather than of a later connect.
    // The others make it when their pairs connect (ConnectPairs), if they ever do.
    auto device = SharedDevice(attr, key, /*only_if_new=*/true);
    auto ctx = std::make_shared<AbortableContext>(topo.rank, topo.size);
    std::unique_ptr<GlooCommunicator> comm(new GlooCommunicator(ctx, topo, options));
    comm->device_ = device;
    return comm;
  } catch (const std::exception& e) {
    return Unavailable(std::string("creating the Gloo TCP device failed: ") + e.what());
  }
}

std::vector<int> GlooPeers(int rank, int size) {
  std::vector<int> out;
  for (long d = 1; d < size; d <<= 1) {
    out.push_back(static_cast<int>((rank + d) % size));
    out.push_back(static_cast<int>((rank - d % size + size) % size));
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  out.erase(std::remove(out.begin(), out.end(), rank), out.end());
  return out;
}

Status GlooCommunicator::Attempt(const std::function<Status()>& connect) {
  Status s;
  try {
    s = connect();
  } catch (const std::exception& e) {
    s = Unavailable(std::string("connecting the Gloo pairs failed: ") + e.what());
  }
  if (!s.ok() && aborted_.load()) {
    return Aborted("connecting the Gloo pairs was aborted (a peer of this round is gone): " +
                   s.message());
  }
  return s;
}

Status GlooCommunicator::Connect(RoundStore* store) {
  return Attempt([&] {
    ShmPlan plan;
    Status s = PlanShm(store, &plan);
    // Every rank on one host with the shared-memory allreduce: the flat pairs would serve
    // only broadcast, allgather and barrier, which go through the segment too unless
    // ELASTIC_SHM_COLLECTIVES=0; then they connect at the first of those (EnsurePairs), which
    // a round without a state sync may never call.
    shm_flat_ = Env("ELASTIC_SHM_COLLECTIVES") != "0";
    const bool lazy = plan.want && topo_.cross_size == 1 && topo_.size > 1 &&
                      Env("ELASTIC_GLOO_LAZY_PAIRS") != "0";
    if (s.ok() && lazy) {
      lazy_store_ = store;
      if (!plan.fetch_key.empty()) {
        auto got = store->Get({plan.fetch_key}, options_.connect_timeout);
        if (got.ok()) {
          plan.description = std::move((*got)[0]);
        } else {
          s = got.status();
        }
      }
    } else if (s.ok()) {
      s = ConnectPairs(store, plan.fetch_key, &plan.description);
    }
    if (s.ok()) s = SetUpHierarchy(store, &plan);
    // The shared memory turned off after all: the flat ring allreduces, over the pairs.
    std::string unused;
    if (s.ok() && !hier_ && !pairs_connected_) s = ConnectPairs(store, "", &unused);
    if (s.ok() && shm_collectives() && device_) {
      // The device New made (this process's first communicator) will never serve a pair:
      // its loop thread would only wake every 10 ms for as long as this round lasts.
      auto device = std::static_pointer_cast<gloo::transport::Device>(device_);
      device_.reset();
      ReleaseDevice(std::move(device));
    }
    return s;
  });
}

Status GlooCommunicator::ConnectPairs(RoundStore* store, const std::string& extra_key,
                                      std::string* extra_value) {
  if (pairs_connected_) return FailedPrecondition("Connect() called twice");
  auto device = std::static_pointer_cast<gloo::transport::Device>(device_);
  if (!device) {
    std::string key;
    gloo::transport::tcp::attr attr = DeviceAttr(options_, &key);
    try {
      device = SharedDevice(attr, key);
    } catch (const std::exception& e) {
      return Unavailable(std::string("creating the Gloo TCP device failed: ") + e.what());
    }
    device_ = device;  // for the destructor, should this connect fail
  }
  auto timeout = std::chrono::duration_cast<std::chrono::milliseconds>(options_.connect_timeout);
  std::shared_ptr<gloo::transport::Context> pairs = device->createContext(topo_.rank, topo_.size);
  pairs->setTimeout(timeout);
  std::vector<int> peers_to;
  if (options_.full_mesh || Env("ELASTIC_GLOO_FULL_MESH") == "1") {
    for (int i = 0; i < topo_.size; ++i) {
      if (i != topo_.rank) peers_to.push_back(i);
    }
  } else {
    peers_to = GlooPeers(topo_.rank, topo_.size);
  }
  std::vector<std::pair<int, std::vector<char>>> mine;
  std::vector<std::string> keys;
  for (int i : peers_to) {
    mine.emplace_back(i, CanonicalPairAddress(pairs->createPair(i)->address().bytes()));
    keys.push_back(std::to_string(i));
  }
  {
    std::lock_guard<std::mutex> g(abort_mu_);
    if (aborted_.load()) return Aborted("the communicator was aborted before it connected");
    pairs_ = pairs;  // from here on Abort() fails every pair's wait
  }
  // This rank's addresses go out and its peers' come back in one call (with the segment of
  // the host's local rank 0, when there is one to fetch).
  std::vector<std::string> peers;
  if (!extra_key.empty()) keys.push_back(extra_key);
  if (keys.empty()) {
    RETURN_IF_ERROR(store->Set(std::to_string(topo_.rank), EncodeAddresses(mine)));
  } else {
    ASSIGN_OR_RETURN(peers, store->SetAndGet(std::to_string(topo_.rank), EncodeAddresses(mine),
                                             keys, options_.connect_timeout));
  }
  if (!extra_key.empty()) {
    *extra_value = std::move(peers.back());
    peers.pop_back();
    keys.pop_back();
  }
  TestHook("connect", 0);
  if (!keys.empty()) {
    std::vector<std::vector<char>> addrs(topo_.size);
    for (size_t k = 0; k < peers_to.size(); ++k) {
      ASSIGN_OR_RETURN(addrs[peers_to[k]], AddressFor(peers[k], topo_.rank, peers_to[k]));
    }
    if (aborted_.load()) return Aborted("the communicator was aborted while connecting");
    // All at once: a pair on the listening side waits for its peer to connect, and one after
    // another those waits chained across ranks.
    ForEachInParallel(peers_to, [&](int i) {
      if (!aborted_.load()) pairs->getPair(i)->connect(addrs[i]);
    });
    std::vector<sockaddr_storage> theirs, ours;
    for (int i : peers_to) {
      theirs.push_back(gloo::transport::tcp::Address(addrs[i]).getSockaddr());
    }
    for (const auto& [peer, bytes] : mine) {
      ours.push_back(gloo::transport::tcp::Address(bytes).getSockaddr());
    }
    ResetPairsOnClose(theirs, ours);
  }
  std::lock_guard<std::mutex> g(abort_mu_);
  if (aborted_.load()) return Aborted("the communicator was aborted while connecting");
  ctx_->Adopt(device, pairs);
  pairs_connected_ = true;
  peers_ = peers_to;
  ctx_->setTimeout(
      std::chrono::duration_cast<std::chrono::milliseconds>(options_.collective_timeout));
  device_.reset();
  return Status::Ok();
}

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

size_t GlooCommunicator::AskedSlotBytes() const {
  size_t slot = options_.shm_slot_bytes;
  if (const char* v = std::getenv("ELASTIC_SHM_SLOT_BYTES"); v && slot == 0) {
    slot = std::strtoull(v, nullptr, 10);
  }
  return slot;
}

std::string GlooCommunicator::NewSegment(std::unique_ptr<ShmGroup>* group,
                                         std::string* why) const {
  auto made = ShmGroup::Create(topo_.local_size, AskedSlotBytes());
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
  plan->want = options_.shm && Env("ELASTIC_SHM_ALLREDUCE") != "0";
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
    const size_t slot = AskedSlotBytes();
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
    std::lock_guard<std::mutex> g(abort_mu_);
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
    std::lock_guard<std::mutex> g(abort_mu_);
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
      std::lock_guard<std::mutex> g(abort_mu_);
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
    std::lock_guard<std::mutex> g(abort_mu_);
    shm_.reset();
  }
  std::unique_ptr<ShmGroup> group;
  if (topo_.local_rank == 0) {
    RETURN_IF_ERROR(store->Set(key, NewSegment(&group, why)));
  } else {
    ASSIGN_OR_RETURN(std::vector<std::string> got, store->Get({key}, options_.connect_timeout));
    if (got.size() == 1 && got[0] != "off") group = OpenSegment(got[0], why);
  }
  std::lock_guard<std::mutex> g(abort_mu_);
  if (aborted_.load()) return Aborted("the communicator was aborted while connecting");
  shm_ = std::move(group);
  return Status::Ok();
}

Status GlooCommunicator::EnsurePairs() {
  if (pairs_connected_ || !lazy_store_) return Status::Ok();
  return Attempt([&] {
    std::string unused;
    return ConnectPairs(lazy_store_, "", &unused);
  });
}

void GlooCommunicator::RequirePairs(const char* what) {
  Status s = EnsurePairs();
  if (!s.ok()) throw WorkerLostError(std::string(what) + ": " + s.message());
}

Status GlooCommunicator::Agree(RoundStore* store, const std::string& key, int64_t* values,
                               size_t n) {
  if (pairs_connected_) {
    AgreeMin(values, n);
    return Status::Ok();
  }
  if (topo_.size == 1 || n == 0) return Status::Ok();
  // Without pairs (they connect later, if ever): through the round's store. Every rank puts
  // its values; rank 0 takes the min of all and puts it; the others fetch it with their put.
  const std::string prefix = "agree/" + key + "/";
  const size_t bytes = n * sizeof(int64_t);
  auto min_of = [&](const std::string& v, const std::string& from) -> Status {
    if (v.size() != bytes) {
      return InvalidArgument("the agreement's value from " + from + " has " +
                             std::to_string(v.size()) + " bytes, not " + std::to_string(bytes));
    }
    for (size_t i = 0; i < n; ++i) {
      int64_t x;
      std::memcpy(&x, v.data() + i * sizeof x, sizeof x);
      values[i] = std::min(values[i], x);
    }
    return Status::Ok();
  };
  if (topo_.rank == 0) {
    std::vector<std::string> keys;
    for (int r = 1; r < topo_.size; ++r) keys.push_back(prefix + std::to_string(r));
    ASSIGN_OR_RETURN(std::vector<std::string> got, store->Get(keys, options_.connect_timeout));
    for (size_t k = 0; k < got.size(); ++k) RETURN_IF_ERROR(min_of(got[k], keys[k]));
    return store->Set(prefix + "min", std::string(reinterpret_cast<const char*>(values), bytes));
  }
  ASSIGN_OR_RETURN(std::vector<std::string> got,
                   store->SetAndGet(prefix + std::to_string(topo_.rank),
                                    std::string(reinterpret_cast<const char*>(values), bytes),
                                    {prefix + "min"}, options_.connect_timeout));
  if (got.size() != 1) return Internal("the agreement's result is missing");
  return min_of(got[0], prefix + "min");
}

void GlooCommunicator::AgreeMin(int64_t* values, size_t n) {
  if (topo_.size == 1 || n == 0) return;
  Guard("agreement", [&] {
    auto timeout =
        std::chrono::duration_cast<std::chrono::milliseconds>(options_.collective_timeout);
    std::vector<int64_t> in(n);
    auto out_buf = ctx_->createUnboundBuffer(values, n * sizeof(int64_t));
    auto in_buf = ctx_->createUnboundBuffer(in.data(), n * sizeof(int64_t));
    // After the round at distance d, a rank holds the min over itself and the 2d-1 ranks
    // before it; a value counted twice does not change a min.
    for (long d = 1; d < topo_.size; d <<= 1) {
      const uint64_t slot = static_cast<uint64_t>(ctx_->nextSlot());
      const int to = static_cast<int>((topo_.rank + d) % topo_.size);
      const int from = static_cast<int>((topo_.rank - d % topo_.size + topo_.size) % topo_.size);
      in_buf->recv(from, slot);
      out_buf->send(to, slot);
      if (!in_buf->waitRecv(timeout) || !out_buf->waitSend(timeout)) {
        throw WorkerLostError("the agreement was aborted");
      }
      for (size_t i = 0; i < n; ++i) values[i] = std::min(values[i], in[i]);
    }
  });
}

StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::Create(RoundStore* store,
                                                                     const Topology& topo,
                                                                     const GlooOptions& options) {
  ASSIGN_OR_RETURN(std::unique_ptr<GlooCommunicator> comm, New(topo, options));
  RETURN_IF_ERROR(comm->Connect(store));
  return comm;
}

// What the hang watch reads of a collective: one more started, when, and whether one runs
// (until this goes out of scope).
class GlooCommunicator::Running {
 public:
  explicit Running(GlooCommunicator* c)
      : c_(c), start_(SteadyClock::now().time_since_epoch().count()) {
    c_->started_.fetch_add(1);
    c_->last_start_.store(start_);
    // Collectives from two threads at once (a background allreduce beside the training
    // thread's barrier) overlap: a gap only counts when this one starts after the last end.
    Duration::rep end = c_->last_end_.load();
    if (end != 0 && start_ > end) c_->compute_.fetch_add(start_ - end);
    c_->running_.store(true);
  }
  ~Running() {
    Duration::rep now = SteadyClock::now().time_since_epoch().count();
    c_->wait_.fetch_add(now - start_);
    c_->last_end_.store(now);
    c_->running_.store(false);
  }

 private:
  GlooCommunicator* c_;
  Duration::rep start_;
};

void GlooCommunicator::Guard(const char* what, std::function<void()> fn, Duration grace) {
  auto lost = [what](const std::string& why) {
    return WorkerLostError(std::string(what) + (why.empty() ? "" : ": ") + why);
  };
  if (aborted_.load()) throw lost("the communicator was aborted (a peer is gone)");
  Running running(this);
  if (!exec_) {
    auto ex = Executor::Take();
    std::lock_guard<std::mutex> g(abort_mu_);  // Abort() reads exec_ from another thread
    exec_ = std::move(ex);
  }
  Executor& ex = *exec_;
  std::unique_lock<std::mutex> lock(ex.mu);
  ex.job = std::move(fn);
  uint64_t ticket = ++ex.posted;
  ex.cv.notify_all();
  ex.cv.wait(lock, [&] { return ex.finished >= ticket || aborted_.load(); });
  if (ex.finished < ticket) {
    // Aborted while running: every pair is closed now; a wait Gloo left unwoken can do no
    // more I/O, and one that was about to end ends within the grace.
    bool ended = ex.cv.wait_for(lock, grace, [&] { return ex.finished >= ticket; });
    if (!ended) {
      ex.abandoned = true;
      throw lost(
          "the communicator was aborted (a peer is gone); the collective is left to "
          "Gloo's timeout");
    }
  }
  std::exception_ptr error = ex.error;
  lock.unlock();
  if (error) {
    try {
      std::rethrow_exception(error);
    } catch (const gloo::Exception& e) {
      throw lost(std::string("failed, a peer is gone: ") + e.what());
    }
  }
  if (aborted_.load()) throw lost("the communicator was aborted (a peer is gone)");
}

void GlooCommunicator::Inline(const char* what, const std::function<void()>& fn) {
  auto lost = [what](const std::string& why) {
    return WorkerLostError(std::string(what) + ": " + why);
  };
  if (aborted_.load()) throw lost("the communicator was aborted (a peer is gone)");
  Running running(this);
  try {
    fn();
  } catch (const gloo::Exception& e) {
    throw lost(std::string("failed, a peer is gone: ") + e.what());
  } catch (const WorkerLostError& e) {
    if (shm_) shm_->Abort();  // the local ranks waiting for this one stop waiting
    const std::string why = e.what();
    if (why.rfind(what, 0) == 0) throw;  // named already (the cross-host communicator's)
    throw lost(why);
  }
  if (aborted_.load()) throw lost("the communicator was aborted (a peer is gone)");
}

void GlooCommunicator::Allreduce(void* data, size_t count, DataType dtype, ReduceOp op) {
  if (count == 0) return;
  if (hier_) {
    // On the caller's thread: every wait in it ends at an abort by itself (the host's barrier
    // wakes, the cross-host communicator has its own Guard), so the two thread switches of
    // the executor would buy nothing.
    Inline("allreduce", [&] { HierarchicalAllreduce(data, count, dtype, op); });
    return;
  }
  Guard("allreduce", [&] {
    if (topo_.size > 1) {
      Duration t = options_.collective_timeout;
      auto fn = ReduceFunc(dtype, op);
      switch (DataTypeSize(dtype)) {
        case 8:
          RunAllreduce<uint64_t>(ctx_, data, count, std::move(fn), t);
          break;
        case 4:
          RunAllreduce<uint32_t>(ctx_, data, count, std::move(fn), t);
          break;
        default:
          RunAllreduce<uint16_t>(ctx_, data, count, std::move(fn), t);
          break;
      }
    }
    if (op == ReduceOp::kAvg) DivideAll(data, count, dtype, topo_.size);
  });
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

void GlooCommunicator::AllreduceMany(const std::vector<TensorView>& tensors, ReduceOp op) {
  ForEachFusionBucket(
      tensors, options_.fusion_bytes,
      [&](const TensorView& t) { Allreduce(t.data, t.count, t.dtype, op); },
      [&](size_t begin, size_t end, size_t bytes) {
        const size_t esize = DataTypeSize(tensors[begin].dtype);
        if (fusion_.size() < bytes) fusion_.resize(bytes);
        size_t off = 0;
        for (size_t k = begin; k < end; ++k) {
          std::memcpy(fusion_.data() + off, tensors[k].data, tensors[k].count * esize);
          off += tensors[k].count * esize;
        }
        Allreduce(fusion_.data(), bytes / esize, tensors[begin].dtype, op);
        off = 0;
        for (size_t k = begin; k < end; ++k) {
          std::memcpy(tensors[k].data, fusion_.data() + off, tensors[k].count * esize);
          off += tensors[k].count * esize;
        }
      });
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

void GlooCommunicator::Broadcast(void* data, size_t bytes, int root) {
  if (root < 0 || root >= topo_.size) {
    throw std::invalid_argument("broadcast root " + std::to_string(root) + " out of range");
  }
  if (bytes == 0 || topo_.size == 1) return;
  if (shm_collectives()) {
    Inline("broadcast", [&] { ShmBroadcast(static_cast<char*>(data), bytes, root); });
    return;
  }
  RequirePairs("broadcast");
  Guard("broadcast", [&] {
    gloo::BroadcastOptions opts(ctx_);
    opts.setRoot(root);
    opts.setOutput(static_cast<uint8_t*>(data), bytes);
    opts.setTimeout(
        std::chrono::duration_cast<std::chrono::milliseconds>(options_.collective_timeout));
    gloo::broadcast(opts);
  });
}

std::vector<std::vector<char>> GlooCommunicator::Allgather(const void* data, size_t bytes) {
  std::vector<std::vector<char>> out(topo_.size);
  if (topo_.size == 1) {
    out[0].assign(static_cast<const char*>(data), static_cast<const char*>(data) + bytes);
    return out;
  }
  if (shm_collectives()) {
    Inline("allgather", [&] { out = ShmAllgather(static_cast<const char*>(data), bytes); });
    return out;
  }
  RequirePairs("allgather");
  Guard("allgather", [&] {
    auto timeout =
        std::chrono::duration_cast<std::chrono::milliseconds>(options_.collective_timeout);
    std::vector<int64_t> sizes(topo_.size);
    int64_t mine = static_cast<int64_t>(bytes);
    {
      gloo::AllgatherOptions opts(ctx_);
      opts.setInput(&mine, 1);
      opts.setOutput(sizes.data(), sizes.size());
      opts.setTimeout(timeout);
      gloo::allgather(opts);
    }
    std::vector<size_t> counts(sizes.begin(), sizes.end());
    size_t total = 0;
    for (size_t c : counts) total += c;
    std::vector<char> flat(std::max<size_t>(total, 1));
    std::vector<char> input(static_cast<const char*>(data), static_cast<const char*>(data) + bytes);
    input.resize(std::max<size_t>(bytes, 1));
    gloo::AllgathervOptions opts(ctx_);
    opts.setInput(input.data(), bytes);
    opts.setOutput(flat.data(), counts);
    opts.setTimeout(timeout);
    gloo::allgatherv(opts);
    size_t off = 0;
    for (int r = 0; r < topo_.size; ++r) {
      out[r].assign(flat.begin() + off, flat.begin() + off + counts[r]);
      off += counts[r];
    }
  });
  return out;
}

void GlooCommunicator::Barrier() {
  if (topo_.size == 1) return;
  if (shm_collectives()) {
    Inline("barrier",
           [&] { shm_->Barrier(aborted_, SteadyClock::now() + options_.collective_timeout); });
    return;
  }
  RequirePairs("barrier");
  Guard("barrier", [&] {
    gloo::BarrierOptions opts(ctx_);
    opts.setTimeout(
        std::chrono::duration_cast<std::chrono::milliseconds>(options_.collective_timeout));
    gloo::barrier(opts);
  });
}

void GlooCommunicator::Abort() {
  aborted_.store(true);
  {
    std::lock_guard<std::mutex> g(abort_mu_);
    if (shm_) shm_->Abort();
    if (cross_) cross_->Abort();
    try {
      Signal(pairs_, "aborted: a peer of this round is gone");
    } catch (const std::exception&) {
      // Signalling pairs that already failed may throw; the flag above is what later calls
      // check.
    }
  }
  std::shared_ptr<Executor> ex;
  {
    std::lock_guard<std::mutex> g(abort_mu_);
    ex = exec_;
  }
  if (ex) {
    std::lock_guard<std::mutex> g(ex->mu);
    ex->cv.notify_all();
  }
}

}  // namespace elastic::worker_agent
