// The NCCL backend without a GPU.
//
// * The real NCCL and CUDA runtime of this machine are loaded through LoadNcclApi (every
//   symbol resolved, the version read, a real ncclUniqueId made) when the build has them.
// * NcclCommunicator's logic (the id exchange through a real rendezvous store, init polled
//   with a deadline, the abort path's state machine, revoke vs abort, shrink's rank map, the
//   fusion buffer, allgather of different sizes) runs against FakeNccl: an in-memory stand-in
//   for the library, ranks as threads, host memory as "device" memory. It is a test double,
//   not a backend: tests/gpu/run.sh runs the same communicator on the real library and a GPU.
#include <catch2/catch.hpp>
#include <atomic>
#include <cstring>
#include <future>
#include <map>
#include <numeric>
#include <thread>
#include <sys/wait.h>

#include "rendezvous/rendezvous.h"
#include "rendezvous/service.h"
#include "worker_agent/nccl_communicator.h"
#include "worker_agent/worker_agent.h"

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

// --- FakeNccl --------------------------------------------------------------------------------

struct FakeOp {  // one collective of a group, matched by sequence number
  std::string kind;
  std::map<int, std::pair<const void*, void*>> bufs;  // rank -> (send, recv)
  size_t count = 0;
  DataType dtype = DataType::kF32;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  bool done = false;
  bool failed = false;
};

struct FakeGroup {
  int n = 0;
  std::map<int64_t, FakeOp> ops;
};

struct FakeComm {
  std::string group;
  int rank = 0;
  int n = 0;
  int64_t seq = 0;
  int polls = 0;            // GetAsyncError calls so far
  bool revoked = false;
  bool aborted = false;
};

// Shared by the ranks of one test.
struct FakeWorld {
  std::mutex mu;
  std::map<std::string, FakeGroup> groups;
  // Knobs.
  int init_polls = 3;       // polls until an init is ready; -1: never
  int init_error = 0;       // async error an init ends with
  bool has_revoke = true;
  bool has_shrink = true;
  int devices = 1;
  std::atomic<int> next_id{0};
  std::atomic<int> peer_error{0};  // the async error every ready comm reports (a peer failed)
  // Observations.
  std::atomic<int> aborts{0}, revokes{0}, shrinks{0};
  std::vector<std::string> ids_seen;
  std::vector<int> last_exclude;
  std::vector<int> broadcast_roots;
};

thread_local FakeOp* t_last_op = nullptr;  // what an EventRecord on this thread waits for

class FakeNccl : public NcclApi {
 public:
  explicit FakeNccl(FakeWorld* w) : w_(w) {}
  int version() const override { return 22809; }
  bool has_revoke() const override { return w_->has_revoke; }
  bool has_shrink() const override { return w_->has_shrink; }
  std::string ErrorString(int r) override { return "fake NCCL error " + std::to_string(r); }
  std::string LastError(Comm) override { return ""; }
  Status DeviceCount(int* n) override {
    *n = w_->devices;
    return Status();
  }
  Status SetDevice(int d) override {
    return d < w_->devices ? Status() : Internal("cudaSetDevice: invalid device ordinal");
  }
  Status Malloc(void** p, size_t bytes) override {
    *p = std::malloc(bytes ? bytes : 1);
    return Status();
  }
  Status Free(void* p) override {
    std::free(p);
    return Status();
  }
  Status MemcpyAsync(void* dst, const void* src, size_t bytes, Stream) override {
    std::memcpy(dst, src, bytes);
    return Status();
  }
  Status StreamSynchronize(Stream) override { return Status(); }
  Status EventCreate(Event* e) override {
    *e = new FakeOp*(nullptr);
    return Status();
  }
  Status EventRecord(Event e, Stream) override {
    *static_cast<FakeOp**>(e) = t_last_op;
    return Status();
  }
  Status EventQuery(Event e) override {
    std::lock_guard<std::mutex> g(w_->mu);
    FakeOp* op = *static_cast<FakeOp**>(e);
    if (!op || op->done) return Status();
    if (op->failed) return Internal("fake kernel failed");
    return Unavailable("not ready");
  }
  Status EventDestroy(Event e) override {
    delete static_cast<FakeOp**>(e);
    return Status();
  }
  int GetUniqueId(std::string* id) override {
    id->assign(kUniqueIdBytes, '\0');
    std::snprintf(id->data(), id->size(), "fake-id-%d", w_->next_id++);
    return kSuccess;
  }
  int CommInitRank(Comm* comm, int nranks, const std::string& id, int rank) override {
    std::lock_guard<std::mutex> g(w_->mu);
    w_->ids_seen.push_back(id);
    w_->groups[id].n = nranks;
    *comm = new FakeComm{id, rank, nranks};
    return kInProgress;
  }
  int CommShrink(Comm parent, const std::vector<int>& exclude, Comm* comm) override {
    std::lock_guard<std::mutex> g(w_->mu);
    auto* p = static_cast<FakeComm*>(parent);
    w_->shrinks++;
    w_->last_exclude = exclude;
    std::string group = p->group + "/shrink";
    for (int e : exclude) group += "-" + std::to_string(e);
    int rank = 0;
    for (int r = 0; r < p->rank; ++r) {
      if (std::find(exclude.begin(), exclude.end(), r) == exclude.end()) ++rank;
    }
    int n = p->n - static_cast<int>(exclude.size());
    w_->groups[group].n = n;
    *comm = new FakeComm{group, rank, n};
    return kInProgress;
  }
  int CommGetAsyncError(Comm comm, int* async) override {
    std::lock_guard<std::mutex> g(w_->mu);
    auto* c = static_cast<FakeComm*>(comm);
    ++c->polls;
    if (w_->init_polls < 0 || c->polls <= w_->init_polls) {
      *async = kInProgress;
    } else if (c->polls == w_->init_polls + 1 && w_->init_error) {
      *async = w_->init_error;
    } else {
      *async = w_->peer_error.load();
    }
    return kSuccess;
  }
  int CommAbort(Comm comm) override {
    auto* c = static_cast<FakeComm*>(comm);
    {
      std::lock_guard<std::mutex> g(w_->mu);
      FailOpen(c);
    }
    w_->aborts++;
    delete c;
    return kSuccess;
  }
  int CommRevoke(Comm comm) override {
    std::lock_guard<std::mutex> g(w_->mu);
    auto* c = static_cast<FakeComm*>(comm);
    c->revoked = true;
    FailOpen(c);
    w_->revokes++;
    return kSuccess;
  }
  int AllReduce(const void* s, void* r, size_t count, DataType d, ReduceOp op, Comm c,
                Stream) override {
    return Post(c, "allreduce", s, r, count, d, op, 0);
  }
  int Broadcast(const void* s, void* r, size_t bytes, int root, Comm c, Stream) override {
    {
      std::lock_guard<std::mutex> g(w_->mu);
      w_->broadcast_roots.push_back(root);
    }
    return Post(c, "broadcast", s, r, bytes, DataType::kF32, ReduceOp::kSum, root);
  }
  int AllGather(const void* s, void* r, size_t bytes, Comm c, Stream) override {
    return Post(c, "allgather", s, r, bytes, DataType::kF32, ReduceOp::kSum, 0);
  }

 private:
  void FailOpen(FakeComm* c) {  // with w_->mu held: its unfinished collectives end, failed
    for (auto& [seq, op] : w_->groups[c->group].ops) {
      if (!op.done && op.bufs.count(c->rank)) op.failed = true;
    }
  }
  int Post(Comm comm, const char* kind, const void* s, void* r, size_t count, DataType d,
           ReduceOp op, int root) {
    std::lock_guard<std::mutex> g(w_->mu);
    auto* c = static_cast<FakeComm*>(comm);
    if (c->revoked) return 5;  // ncclInvalidUsage
    FakeGroup& grp = w_->groups[c->group];
    FakeOp& o = grp.ops[c->seq++];
    o.kind = kind;
    o.bufs[c->rank] = {s, r};
    o.count = count;
    o.dtype = d;
    o.op = op;
    o.root = root;
    t_last_op = &o;
    if (static_cast<int>(o.bufs.size()) == grp.n) Complete(o, grp.n);
    return kSuccess;
  }
  static void Complete(FakeOp& o, int n) {  // host arithmetic for f32 and i32 only
    if (o.kind == "allreduce") {
      if (o.dtype == DataType::kF32) {
        std::vector<float> acc(o.count, 0.f);
        for (auto& [rank, b] : o.bufs) {
          const float* x = static_cast<const float*>(b.first);
          for (size_t i = 0; i < o.count; ++i) acc[i] += x[i];
        }
        if (o.op == ReduceOp::kAvg) for (float& v : acc) v /= n;
        for (auto& [rank, b] : o.bufs) std::memcpy(b.second, acc.data(), o.count * 4);
      } else {
        std::vector<int32_t> acc(o.count, 0);
        for (auto& [rank, b] : o.bufs) {
          const int32_t* x = static_cast<const int32_t*>(b.first);
          for (size_t i = 0; i < o.count; ++i) {
            acc[i] = o.op == ReduceOp::kMin && rank > 0 ? std::min(acc[i], x[i])
                     : o.op == ReduceOp::kMin          ? x[i]
                                                       : acc[i] + x[i];
          }
        }
        for (auto& [rank, b] : o.bufs) std::memcpy(b.second, acc.data(), o.count * 4);
      }
    } else if (o.kind == "broadcast") {
      std::vector<char> v(static_cast<const char*>(o.bufs[o.root].first),
                          static_cast<const char*>(o.bufs[o.root].first) + o.count);
      for (auto& [rank, b] : o.bufs) std::memcpy(b.second, v.data(), o.count);
    } else {  // allgather
      std::vector<char> v(o.count * n);
      for (auto& [rank, b] : o.bufs) std::memcpy(v.data() + rank * o.count, b.first, o.count);
      for (auto& [rank, b] : o.bufs) std::memcpy(b.second, v.data(), v.size());
    }
    o.done = true;
  }

  FakeWorld* w_;
};

// Proposes round `round` of slots h:0..h:n-1 on `core` and joins them all (the round forms).
void FormRound(rendezvous::Core* core, int64_t round, int n) {
  std::map<std::string, rendezvous::Assignment> m;
  for (int i = 0; i < n; ++i) m["h:" + std::to_string(i)].rank = i;
  REQUIRE(core->ProposeRound(round, m, {}).ok());
  std::vector<std::future<bool>> fs;
  for (int i = 0; i < n; ++i) {
    fs.push_back(std::async(std::launch::async, [core, round, i] {
      return core->Join("h:" + std::to_string(i), round - 1, 0, core->clock()->Now() + 30s).ok();
    }));
  }
  for (auto& f : fs) REQUIRE(f.get());
}

NcclOptions Fast() {
  NcclOptions o;
  o.init_timeout = 5s;
  o.collective_timeout = 5s;
  return o;
}

// Forms round 0 of `n` ranks on a real rendezvous Core, builds each rank's NcclCommunicator
// through the round's store on FakeNccl and runs `body` on its thread. Returns failures.
std::vector<std::string> RunRanks(FakeWorld* w, int n,
                                  const std::function<void(NcclCommunicator&)>& body,
                                  NcclOptions opts = Fast()) {
  rendezvous::Core core(rendezvous::CoreOptions{});
  std::map<std::string, rendezvous::Assignment> members;
  for (int i = 0; i < n; ++i) members["h:" + std::to_string(i)].rank = i;
  REQUIRE(core.ProposeRound(0, members, {}).ok());
  std::mutex mu;
  std::vector<std::string> failures;
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      try {
        auto a = core.Join("h:" + std::to_string(i), -1, 0, core.clock()->Now() + 30s);
        if (!a.ok()) throw std::runtime_error(a.status().ToString());
        auto store = MakeCoreRoundStore(&core, 0);
        auto comm = NcclCommunicator::New(std::make_shared<FakeNccl>(w), Topology{i, n, 0, 1, i, n},
                                          0, opts);
        if (!comm.ok()) throw std::runtime_error(comm.status().ToString());
        Status s = (*comm)->Connect(store.get());
        if (!s.ok()) throw std::runtime_error(s.ToString());
        body(**comm);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> g(mu);
        failures.push_back("rank " + std::to_string(i) + ": " + e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
  return failures;
}

// --- the real library -----------------------------------------------------------------------

TEST_CASE("nccl: the real NCCL and CUDA runtime load and every symbol resolves", "[nccl]") {
  if (!NcclBackendBuilt()) {
    auto api = LoadNcclApi();
    REQUIRE_FALSE(api.ok());
    CHECK(api.status().message().find("ELASTIC_WITH_NCCL") != std::string::npos);
    WARN("this build has no NCCL backend: only its error was checked");
    return;
  }
  auto api = LoadNcclApi();
  REQUIRE(api.ok());
  INFO("NCCL version " << (*api)->version());
  CHECK((*api)->version() >= 22700);
  CHECK((*api)->has_shrink());
  if ((*api)->version() >= 22807) CHECK((*api)->has_revoke());
  // A real id (no GPU needed: it is the bootstrap root's address).
  std::string id;
  int r = (*api)->GetUniqueId(&id);
  INFO("ncclGetUniqueId: " << (*api)->ErrorString(r));
  if (r == NcclApi::kSuccess) CHECK(id.size() == NcclApi::kUniqueIdBytes);
  int devices = -1;
  Status s = (*api)->DeviceCount(&devices);
  INFO("cudaGetDeviceCount: " << s.ToString() << " count " << devices);
  // Loaded once: a second call gives the same library.
  CHECK(LoadNcclApi()->get() == api->get());
}

TEST_CASE("nccl: an NCCL library path pointing nowhere is a clear error", "[nccl]") {
  // In a child process: the library is loaded once per process.
  if (!NcclBackendBuilt()) return;
  pid_t pid = fork();
  if (pid == 0) {
    setenv("LD_LIBRARY_PATH", "/nonexistent", 1);
    auto api = LoadNcclApi("/nonexistent/libnccl.so.2");
    // The env path fails, the defaults still load: the message only matters when all fail.
    _exit(api.ok() ? 0 : 1);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status));
}

// --- backend choice ---------------------------------------------------------------------------

TEST_CASE("nccl: backend names parse and bad ones are refused", "[nccl]") {
  CHECK(*ParseBackend("gloo") == Backend::kGloo);
  CHECK(*ParseBackend("nccl") == Backend::kNccl);
  CHECK(*ParseBackend("auto") == Backend::kAuto);
  auto bad = ParseBackend("mpi");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().message().find("gloo, nccl or auto") != std::string::npos);
}

TEST_CASE("nccl: a host with fewer visible GPUs than slots is named with the fix", "[nccl]") {
  FakeWorld w;
  w.devices = 2;
  FakeNccl api(&w);
  CHECK(*DeviceForLocalRank(&api, 1, 2, "gpu7") == 1);
  auto bad = DeviceForLocalRank(&api, 2, 4, "gpu7");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().code() == Code::kFailedPrecondition);
  CHECK(bad.status().message().find("sees 2 CUDA device(s)") != std::string::npos);
  CHECK(bad.status().message().find("-H gpu7:2") != std::string::npos);
}

// --- id exchange, init ------------------------------------------------------------------------

TEST_CASE("nccl: rank 0's id reaches every rank through the round's store", "[nccl]") {
  FakeWorld w;
  auto failures = RunRanks(&w, 4, [](NcclCommunicator& c) {
    CHECK(c.phase() == NcclCommunicator::Phase::kReady);
  });
  CHECK(failures.empty());
  REQUIRE(w.ids_seen.size() == 4);
  for (const auto& id : w.ids_seen) CHECK(id == w.ids_seen[0]);
  CHECK(w.ids_seen[0].size() == NcclApi::kUniqueIdBytes);
}

TEST_CASE("nccl: an init that never finishes ends at its deadline, released by abort", "[nccl]") {
  FakeWorld w;
  w.init_polls = -1;
  NcclOptions o = Fast();
  o.init_timeout = 300ms;
  auto t0 = SteadyClock::now();
  auto failures = RunRanks(&w, 2, [](NcclCommunicator&) {}, o);
  REQUIRE(failures.size() == 2);
  for (const auto& f : failures) CHECK(f.find("DEADLINE_EXCEEDED") != std::string::npos);
  CHECK(SteadyClock::now() - t0 < 10s);
  CHECK(w.aborts.load() == 2);
}

TEST_CASE("nccl: an init that fails (a peer died) is UNAVAILABLE with NCCL's error", "[nccl]") {
  FakeWorld w;
  w.init_error = 6;  // ncclRemoteError
  auto failures = RunRanks(&w, 2, [](NcclCommunicator&) {});
  REQUIRE(failures.size() == 2);
  for (const auto& f : failures) {
    CHECK(f.find("UNAVAILABLE") != std::string::npos);
    CHECK(f.find("fake NCCL error 6") != std::string::npos);
  }
}

TEST_CASE("nccl: Abort() during init cancels it at once", "[nccl]") {
  FakeWorld w;
  w.init_polls = -1;
  auto comm = MakeComm(std::make_shared<FakeNccl>(&w), Topology{0, 1}, 0, Fast());
  auto store_core = std::make_unique<rendezvous::Core>(rendezvous::CoreOptions{});
  FormRound(store_core.get(), 0, 1);
  auto store = MakeCoreRoundStore(store_core.get(), 0);
  auto done = std::async(std::launch::async, [&] { return comm->Connect(store.get()); });
  std::this_thread::sleep_for(100ms);
  CHECK(comm->phase() == NcclCommunicator::Phase::kInitializing);
  comm->Abort();
  REQUIRE(done.wait_for(2s) == std::future_status::ready);
  CHECK(done.get().code() == Code::kAborted);
  CHECK(comm->phase() == NcclCommunicator::Phase::kAborted);
  CHECK(w.aborts.load() == 1);
}

// --- collectives and aborts -------------------------------------------------------------------

TEST_CASE("nccl: fused allreduce, broadcast, allgather of different sizes, barrier", "[nccl]") {
  FakeWorld w;
  NcclOptions o = Fast();
  o.fusion_bytes = 64;  // 16 floats: the tensors below span several buckets
  auto failures = RunRanks(&w, 3, [](NcclCommunicator& c) {
    const int r = c.rank();
    std::vector<std::vector<float>> ts = {std::vector<float>(5, r + 1.f),
                                          std::vector<float>(9, 2.f * r),
                                          std::vector<float>(40, 1.f), std::vector<float>(3, r)};
    std::vector<TensorView> views;
    for (auto& t : ts) views.push_back({t.data(), t.size(), DataType::kF32});
    c.AllreduceMany(views, ReduceOp::kSum);
    for (float v : ts[0]) REQUIRE(v == 6.f);
    for (float v : ts[1]) REQUIRE(v == 6.f);
    for (float v : ts[2]) REQUIRE(v == 3.f);
    for (float v : ts[3]) REQUIRE(v == 3.f);
    std::vector<float> avg(7, static_cast<float>(r));
    c.Allreduce(avg.data(), avg.size(), DataType::kF32, ReduceOp::kAvg);
    for (float v : avg) REQUIRE(v == 1.f);
    std::string msg = r == 2 ? "from two" : "xxxxxxxx";
    c.Broadcast(msg.data(), msg.size(), 2);
    REQUIRE(msg == "from two");
    std::string mine(r + 1, static_cast<char>('a' + r));
    auto all = c.Allgather(mine.data(), mine.size());
    REQUIRE(all.size() == 3);
    for (int k = 0; k < 3; ++k) {
      REQUIRE(std::string(all[k].begin(), all[k].end()) ==
              std::string(k + 1, static_cast<char>('a' + k)));
    }
    c.Barrier();
    REQUIRE(c.stats().started >= 6);
    REQUIRE_FALSE(c.stats().running);
  }, o);
  CHECK(failures.empty());
}

// Runs rank 0 of a 2-rank communicator whose rank 1 is silent: rank 1 connects but never
// calls the collective. Returns rank 0's communicator after `act` on it.
struct Blocked {
  FakeWorld w;
  std::unique_ptr<NcclCommunicator> c0, c1;
  explicit Blocked(bool revoke) {
    w.has_revoke = revoke;
    rendezvous::Core core(rendezvous::CoreOptions{});
    FormRound(&core, 0, 2);
    auto s = MakeCoreRoundStore(&core, 0);
    c0 = MakeComm(std::make_shared<FakeNccl>(&w), Topology{0, 2}, 0, Fast());
    c1 = MakeComm(std::make_shared<FakeNccl>(&w), Topology{1, 2}, 0, Fast());
    auto f = std::async(std::launch::async, [&] { return c1->Connect(s.get()); });
    REQUIRE(c0->Connect(s.get()).ok());
    REQUIRE(f.get().ok());
  }
};

TEST_CASE("nccl: Abort() from another thread ends a blocked allreduce (revoke)", "[nccl]") {
  Blocked b(/*revoke=*/true);
  std::vector<float> x(4, 1.f);
  auto run = std::async(std::launch::async, [&] {
    try {
      b.c0->Allreduce(x.data(), x.size(), DataType::kF32, ReduceOp::kSum);
      return std::string("returned");
    } catch (const WorkerLostError& e) {
      return std::string(e.what());
    }
  });
  std::this_thread::sleep_for(200ms);
  REQUIRE(run.wait_for(0s) == std::future_status::timeout);  // blocked on the silent peer
  CHECK(b.c0->stats().running);
  b.c0->Abort();
  REQUIRE(run.wait_for(2s) == std::future_status::ready);
  CHECK(run.get().find("aborted") != std::string::npos);
  CHECK(b.c0->phase() == NcclCommunicator::Phase::kRevoked);  // kept: it can be shrunk
  CHECK(b.w.revokes.load() == 1);
  CHECK(b.w.aborts.load() == 0);
  // Every later collective fails at once.
  CHECK_THROWS_AS(b.c0->Barrier(), WorkerLostError);
  b.c0.reset();  // released with abort, never destroy
  CHECK(b.w.aborts.load() == 1);
}

TEST_CASE("nccl: without revoke, Abort() aborts the communicator", "[nccl]") {
  Blocked b(/*revoke=*/false);
  std::vector<float> x(4, 1.f);
  auto run = std::async(std::launch::async, [&] {
    CHECK_THROWS_AS(b.c0->Allreduce(x.data(), x.size(), DataType::kF32, ReduceOp::kSum),
                    WorkerLostError);
  });
  std::this_thread::sleep_for(100ms);
  b.c0->Abort();
  REQUIRE(run.wait_for(2s) == std::future_status::ready);
  CHECK(b.c0->phase() == NcclCommunicator::Phase::kAborted);
  CHECK(b.w.aborts.load() == 1);
}

TEST_CASE("nccl: a peer's async error fails the collective in flight", "[nccl]") {
  Blocked b(/*revoke=*/true);
  std::vector<float> x(4, 1.f);
  auto run = std::async(std::launch::async, [&] {
    try {
      b.c0->Allreduce(x.data(), x.size(), DataType::kF32, ReduceOp::kSum);
      return std::string("returned");
    } catch (const WorkerLostError& e) {
      return std::string(e.what());
    }
  });
  std::this_thread::sleep_for(100ms);
  REQUIRE(run.wait_for(0s) == std::future_status::timeout);
  b.w.peer_error = 6;  // what NCCL reports when a peer's connection breaks (ncclRemoteError)
  REQUIRE(run.wait_for(2s) == std::future_status::ready);
  CHECK(run.get().find("fake NCCL error 6") != std::string::npos);
  CHECK(b.c0->phase() == NcclCommunicator::Phase::kFailed);
  CHECK(b.w.aborts.load() == 1);  // released with abort
}

TEST_CASE("nccl: a collective past its deadline fails and aborts", "[nccl]") {
  FakeWorld w;
  rendezvous::Core core(rendezvous::CoreOptions{});
  FormRound(&core, 0, 2);
  auto s = MakeCoreRoundStore(&core, 0);
  NcclOptions o = Fast();
  o.collective_timeout = 300ms;
  auto c0 = MakeComm(std::make_shared<FakeNccl>(&w), Topology{0, 2}, 0, o);
  auto c1 = MakeComm(std::make_shared<FakeNccl>(&w), Topology{1, 2}, 0, o);
  auto f = std::async(std::launch::async, [&] { return c1->Connect(s.get()); });
  REQUIRE(c0->Connect(s.get()).ok());
  REQUIRE(f.get().ok());
  int32_t v = 1;
  auto t0 = SteadyClock::now();
  try {
    c0->Allreduce(&v, 1, DataType::kI32, ReduceOp::kSum);
    FAIL("returned");
  } catch (const WorkerLostError& e) {
    CHECK(std::string(e.what()).find("did not finish within 0.3 s") != std::string::npos);
  }
  CHECK(SteadyClock::now() - t0 < 5s);
  CHECK(c0->phase() == NcclCommunicator::Phase::kRevoked);
}

// --- shrink -------------------------------------------------------------------------------------

TEST_CASE("nccl: survivors shrink a revoked communicator, roots follow NCCL's numbering",
          "[nccl]") {
  // Round 0: 4 ranks. Old rank 1 dies; the survivors (old 0, 2, 3) form round 1 with ranks
  // assigned by the rendezvous: old 3 -> 0, old 0 -> 1, old 2 -> 2. NCCL numbers them 0, 1, 2
  // in old order (old 0, old 2, old 3), so nccl_rank_of = {2, 0, 1}.
  FakeWorld w;
  rendezvous::Core core(rendezvous::CoreOptions{});
  FormRound(&core, 0, 4);
  auto store = MakeCoreRoundStore(&core, 0);
  std::vector<std::unique_ptr<NcclCommunicator>> old(4);
  for (int i = 0; i < 4; ++i) {
    old[i] = MakeComm(std::make_shared<FakeNccl>(&w), Topology{i, 4}, 0, Fast());
  }
  {
    std::vector<std::future<Status>> fs;
    for (int i = 0; i < 4; ++i) {
      fs.push_back(std::async(std::launch::async, [&, i] { return old[i]->Connect(store.get()); }));
    }
    for (auto& f : fs) REQUIRE(f.get().ok());
  }
  for (int i : {0, 2, 3}) old[i]->Abort();  // the driver's ABORT: revoked, not freed
  const std::map<int, int> new_rank = {{3, 0}, {0, 1}, {2, 2}};
  const std::vector<int> rank_of = {2, 0, 1};
  std::vector<std::future<std::string>> fs;
  for (auto [o, r] : new_rank) {
    fs.push_back(std::async(std::launch::async, [&, o = o, r = r] {
      auto c = MakeComm(std::make_shared<FakeNccl>(&w), Topology{r, 3}, 0, Fast());
      Status s = c->ConnectByShrink(old[o].get(), {1}, rank_of);
      if (!s.ok()) return s.ToString();
      if (c->nccl_rank() != rank_of[r]) return std::string("nccl rank");
      std::string msg = r == 0 ? "root is round rank 0" : std::string(20, '?');
      c->Broadcast(msg.data(), msg.size(), 0);
      if (msg != "root is round rank 0") return "broadcast got " + msg;
      std::string mine = "r" + std::to_string(r);
      auto all = c->Allgather(mine.data(), mine.size());
      for (int k = 0; k < 3; ++k) {
        if (std::string(all[k].begin(), all[k].end()) != "r" + std::to_string(k)) {
          return std::string("allgather order");
        }
      }
      return std::string("ok");
    }));
  }
  for (auto& f : fs) CHECK(f.get() == "ok");
  CHECK(w.shrinks.load() == 3);
  CHECK(w.last_exclude == std::vector<int>{1});
  // Round rank 0 is NCCL rank 2: the broadcasts named root 2.
  for (int root : w.broadcast_roots) CHECK(root == 2);
}

TEST_CASE("nccl: an aborted parent cannot be shrunk (the caller then inits afresh)", "[nccl]") {
  Blocked b(/*revoke=*/false);
  b.c0->Abort();  // without revoke: freed
  auto c = MakeComm(std::make_shared<FakeNccl>(&b.w), Topology{0, 1}, 0, Fast());
  Status s = c->ConnectByShrink(b.c0.get(), {1}, {0});
  CHECK(s.code() == Code::kFailedPrecondition);
  CHECK(s.message().find("aborted") != std::string::npos);
}

// --- the agent: which rebuild a round gets ------------------------------------------------------

// Agents as threads of this process, over a real rendezvous gRPC server, real Gloo on loopback
// and the stand-in NCCL; the test plays the driver (proposes rounds).
struct AgentJob {
  FakeWorld w;
  rendezvous::Core core{rendezvous::CoreOptions{}};
  std::unique_ptr<rendezvous::Server> server;
  std::map<std::string, std::unique_ptr<worker_agent::AgentImpl>> agents;
  AgentJob() {
    w.devices = 8;
    rendezvous::ServerOptions so;
    so.address = "127.0.0.1:0";
    so.token = "t0ken";
    server = std::move(rendezvous::Server::Start(&core, so)).value();
  }
  worker_agent::AgentImpl& Add(const std::string& slot, bool nccl_shrink = true) {
    WorkerOptions env;
    env.nccl_shrink = nccl_shrink;
    env.driver_addr = "127.0.0.1:" + std::to_string(server->port());
    env.token = "t0ken";
    env.slot = slot;
    env.hostname = slot.substr(0, slot.find(':'));
    worker_agent::AgentOptions o;
    o.backend = Backend::kNccl;
    o.nccl_api = std::make_shared<FakeNccl>(&w);
    o.nccl.init_timeout = 10s;
    auto a = worker_agent::AgentImpl::Create(env, o);
    REQUIRE(a.ok());
    return *(agents[slot] = std::move(a).value());
  }
  // Proposes `round` with `slots` (ranks in that order) and has each agent join it; returns
  // each agent's rank.
  void Round(int64_t round, const std::vector<std::string>& slots) {
    std::map<std::string, rendezvous::Assignment> m;
    for (size_t i = 0; i < slots.size(); ++i) {
      auto& a = m[slots[i]];
      a.rank = static_cast<int>(i);
      a.size = static_cast<int>(slots.size());
      a.local_rank = static_cast<int>(i);
      a.local_size = static_cast<int>(slots.size());
      a.cross_rank = 0;
      a.cross_size = 1;
    }
    REQUIRE(core.ProposeRound(round, m, {}).ok());
    std::vector<std::future<std::string>> fs;
    for (const auto& s : slots) {
      fs.push_back(std::async(std::launch::async, [this, s, n = slots.size()]() -> std::string {
        auto joined = agents.at(s)->JoinNextRound(0);
        if (!joined.ok()) return joined.status().ToString();
        if (!agents.at(s)->device_comm()) return "no device communicator";
        // One allreduce on the device communicator: every member takes part.
        float x = 1.f;
        agents.at(s)->device_comm()->Allreduce(&x, 1, DataType::kF32, ReduceOp::kSum);
        return x == static_cast<float>(n) ? "" : "sum " + std::to_string(x);
      }));
    }
    for (auto& f : fs) CHECK(f.get() == "");
  }
};

TEST_CASE("nccl agent: a round that only loses members shrinks, a newcomer inits afresh",
          "[nccl]") {
  AgentJob job;
  for (const char* s : {"a:0", "b:0", "c:0"}) job.Add(s);
  job.Round(0, {"a:0", "b:0", "c:0"});
  CHECK(job.w.ids_seen.size() == 3);  // a fresh init, one id
  CHECK(job.w.shrinks.load() == 0);
  REQUIRE(job.agents.at("a:0")->backend() == Backend::kNccl);

  // b:0 is lost (its process gone: its communicator aborted); the survivors re-form with new
  // ranks in another order (c first): they shrink, leaving out b's old rank 1.
  job.agents.erase("b:0");
  job.Round(1, {"c:0", "a:0"});
  CHECK(job.w.shrinks.load() == 2);
  CHECK(job.w.last_exclude == std::vector<int>{1});
  CHECK(job.w.ids_seen.size() == 3);  // no new init
  CHECK(job.agents.at("c:0")->device_comm()->device_rank() == 1);  // old order: a, then c
  CHECK(job.agents.at("a:0")->device_comm()->device_rank() == 0);

  // A newcomer: no shrink can make it a member, so all init afresh.
  job.Add("d:0");
  job.Round(2, {"c:0", "a:0", "d:0"});
  CHECK(job.w.shrinks.load() == 2);
  CHECK(job.w.ids_seen.size() == 6);
}

TEST_CASE("nccl agent: nccl_shrink off (ELASTIC_NCCL_SHRINK=0) always inits afresh", "[nccl]") {
  AgentJob job;
  for (const char* s : {"a:0", "b:0", "c:0"}) job.Add(s);
  job.Round(0, {"a:0", "b:0", "c:0"});
  job.agents.erase("c:0");
  // Options are read at Create: new agents for a and b would lose their state, so check
  // the switch on fresh agents instead.
  job.agents.clear();
  job.Add("a:0", false);
  job.Add("b:0", false);
  job.Round(1, {"a:0", "b:0"});
  job.Round(2, {"a:0"});  // would be a shrink (b left) if allowed
  CHECK(job.w.shrinks.load() == 0);
}

}  // namespace
}  // namespace elastic::worker_agent
