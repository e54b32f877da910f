// rendezvous_bench: N simulated workers (each with its own gRPC channel) Join a round,
// then each does one Set of its pair addresses and one Get of its Gloo peers' keys (GlooPeers:
// about 2 log2 N), the pattern of the communicator's set-up. `--full-mesh` Gets all N keys
// instead (the old full-mesh pattern: N^2 values through the server). The server runs in a
// child process, so that its peak memory (VmHWM) and CPU time are its own: the CPU per joining
// worker is the server's cost; the wall time also holds N client threads sharing this
// machine's cores with it. By default each worker is a thread blocked in the worker's own
// Client calls. `--async` keeps each worker's Client and channel (so still N connections, N
// HTTP/2 sessions, the same calls with the same metadata) but issues the calls through gRPC's
// callback API from one thread: the client side then costs what N processes on other machines
// would not put on this one, N threads scheduled on 2 cores.
//
//   build/bench/rendezvous_bench [--full-mesh] [--separate] [--async] [--whole-addresses]
//                                [N ...]
//                                                           (default: 16 64 256 1024)
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "common/mutex.h"
#include "proto/elastic.grpc.pb.h"
#include "rendezvous/rendezvous.h"
#include "worker_agent/gloo_communicator.h"

using namespace elastic;
using namespace elastic::rendezvous;

namespace {

long PeakRssKiB() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::atol(line.c_str() + 6);
  }
  return -1;
}

std::string Slot(int i) { return "host" + std::to_string(i / 8) + ":" + std::to_string(i % 8); }

double CpuSeconds(int who) {
  struct rusage u {};
  getrusage(who, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

std::map<std::string, Assignment> Members(int n) {
  std::map<std::string, Assignment> members;
  for (int i = 0; i < n; ++i) {
    members[Slot(i)].rank = i;
    members[Slot(i)].size = n;
  }
  return members;
}

// Child: serves rounds of n members. Writes the port; then for each byte read: 'c' writes its
// CPU seconds so far, 'p' proposes the next round (and writes 1). At EOF writes its peak RSS.
[[noreturn]] void Serve(int n, int out_fd, int in_fd) {
  Core core(CoreOptions{});
  ServerOptions so;
  so.address = "127.0.0.1:0";
  so.token = "bench-token";
  auto server = Server::Start(&core, so);
  if (!server.ok()) {
    std::fprintf(stderr, "server: %s\n", server.status().ToString().c_str());
    _exit(1);
  }
  int64_t round = 0;
  if (!core.ProposeRound(round, Members(n), {}).ok()) _exit(1);
  int port = (*server)->port();
  if (write(out_fd, &port, sizeof port) != sizeof port) _exit(1);
  char c;
  while (read(in_fd, &c, 1) > 0) {
    if (c == 'c') {
      double cpu = CpuSeconds(RUSAGE_SELF);
      if (write(out_fd, &cpu, sizeof cpu) != sizeof cpu) _exit(1);
    } else if (c == 'p') {
      int ok = core.ProposeRound(++round, Members(n), {}).ok() ? 1 : 0;
      if (write(out_fd, &ok, sizeof ok) != sizeof ok) _exit(1);
    }
  }
  long rss = PeakRssKiB();
  if (write(out_fd, &rss, sizeof rss) != sizeof rss) _exit(1);
  (*server)->Shutdown(std::chrono::seconds(1));
  _exit(0);
}

struct Phase {
  double seconds = 0;
  double server_cpu = 0;
  double client_cpu = 0;  // this process: the N client threads and their gRPC channels
  int failures = 0;
};

struct Result {
  Phase first, next;  // round 0 (connect, Join, exchange); round 1 (Join, exchange)
  long server_peak_kib = 0;
};

bool g_full_mesh = false;
bool g_separate = false;
bool g_async = false;

ClientOptions BenchClientOptions(const std::string& address) {
  ClientOptions o;
  o.address = address;
  o.token = "bench-token";
  return o;
}

// The keys worker i of n fetches: its Gloo peers', or all n with --full-mesh.
std::vector<std::string> KeysOf(int i, int n) {
  std::vector<std::string> keys;
  if (g_full_mesh) {
    for (int k = 0; k < n; ++k) keys.push_back(std::to_string(k));
  } else {
    for (int k : elastic::worker_agent::GlooPeers(i, n)) keys.push_back(std::to_string(k));
  }
  return keys;
}

bool g_whole_addresses = false;

// What worker i publishes: one pair address (Gloo's tcp::Address, 136 bytes) per key it asks
// for, the pairs' addresses differing in their port, encoded as the communicator does
// (EncodeAddresses: the first whole, the others as differences). --whole-addresses: each
// address whole with its peer and length (148 bytes a peer), the encoding before.
std::string AddressesOf(int i, size_t keys) {
  if (g_whole_addresses) return std::string(148 * keys, static_cast<char>('a' + i % 26));
  std::vector<std::pair<int, std::vector<char>>> mine;
  for (size_t k = 0; k < keys; ++k) {
    std::vector<char> a(136, 0);
    a[0] = 2;  // AF_INET
    // Ephemeral ports, scattered as bind(0) gives them: both bytes differ from pair to pair.
    const uint32_t port = 32768 + (static_cast<uint32_t>(i * 64 + k) * 2654435761u >> 16) % 28000;
    a[2] = static_cast<char>(port >> 8);
    a[3] = static_cast<char>(port);
    a[4] = 127;
    a[7] = 1;
    mine.emplace_back(static_cast<int>(k), a);
  }
  return elastic::worker_agent::EncodeAddresses(mine);
}

// One simulated worker of --async: its Client's channel, and the calls of a phase in flight.
struct AsyncWorker {
  std::unique_ptr<Client> client;
  std::unique_ptr<v1::Rendezvous::Stub> stub;
  std::vector<std::string> keys;
  std::string mine;
  std::unique_ptr<grpc::ClientContext> ctx;
  v1::JoinRequest join;
  v1::JoinResponse joined;
  v1::GetRequest get;
  v1::GetResponse got;
};

std::unique_ptr<grpc::ClientContext> Context() {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->AddMetadata("x-elastic-token", "bench-token");  // as Client::Prepare does
  ctx->set_wait_for_ready(true);
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  return ctx;
}

// Join, then SetAndGet (Get with put_key), for worker i in round `phase`; `finish(ok)` once.
void StartAsync(AsyncWorker& w, int i, int phase, std::function<void(bool)> finish) {
  w.ctx = Context();
  w.join.Clear();
  w.join.set_slot(Slot(i));
  w.join.set_last_round(phase - 1);
  w.stub->async()->Join(w.ctx.get(), &w.join, &w.joined,
                        [&w, i, phase, finish](grpc::Status s) {
    if (!s.ok() || w.joined.assignment().rank() != i ||
        w.joined.assignment().round() != phase) {
      finish(false);
      return;
    }
    w.ctx = Context();
    w.get.Clear();
    w.get.set_round(phase);
    w.get.set_put_key(std::to_string(i));
    w.get.set_put_value(w.mine);
    for (const auto& k : w.keys) w.get.add_keys(k);
    w.get.set_timeout_ms(60000);
    w.stub->async()->Get(w.ctx.get(), &w.get, &w.got, [&w, finish](grpc::Status s2) {
      finish(s2.ok() && w.got.values_size() == static_cast<int>(w.keys.size()));
    });
  });
}

// The rendezvous server in a child process of its own, and the pipes to ask it things.
struct ServerChild {
  pid_t pid = -1;
  int to_parent[2] = {-1, -1};
  int to_child[2] = {-1, -1};
  std::string address;

  // Sends the request `c`, reads `size` bytes of answer into `out`.
  void Ask(char c, void* out, size_t size) {
    if (write(to_child[1], &c, 1) != 1) std::abort();
    if (read(to_parent[0], out, size) != static_cast<ssize_t>(size)) std::abort();
  }
  double Cpu() {
    double v = 0;
    Ask('c', &v, sizeof v);
    return v;
  }
  // Closes its input (it exits), reads its peak RSS, reaps it.
  long Finish() {
    long peak = -1;
    close(to_child[1]);
    if (read(to_parent[0], &peak, sizeof peak) != sizeof(long)) peak = -1;
    close(to_parent[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    return peak;
  }
};

ServerChild StartServer(int n) {
  ServerChild c;
  if (pipe(c.to_parent) != 0 || pipe(c.to_child) != 0) std::abort();
  c.pid = fork();
  if (c.pid == 0) {
    // gRPC does not survive fork(): the server child starts afresh through exec.
    dup2(c.to_child[0], 0);
    dup2(c.to_parent[1], 1);
    close(c.to_child[0]);
    close(c.to_child[1]);
    close(c.to_parent[0]);
    close(c.to_parent[1]);
    std::string arg = std::to_string(n);
    execl("/proc/self/exe", "rendezvous_bench", "--serve", arg.c_str(), (char*)nullptr);
    _exit(127);
  }
  close(c.to_parent[1]);
  close(c.to_child[0]);
  int port = 0;
  if (read(c.to_parent[0], &port, sizeof port) != sizeof port) std::abort();
  c.address = "127.0.0.1:" + std::to_string(port);
  return c;
}

// What the workers of a run and the measuring thread share: phase `go` starts a phase.
struct Gate {
  std::atomic<int> ready{0}, done{0}, failures[2] = {{0}, {0}};
  std::atomic<int> go{-1};
  Mutex mu;
  std::condition_variable cv;  // threads sleep between phases, not spin
};

// A worker on a thread with its own channel. Phase 0 connects, joins round 0 and exchanges
// addresses; phase 1 (on the same channel, as after a membership change) joins round 1 and
// exchanges again.
void SyncWorker(int i, int n, const std::string& address, Gate& gate) {
  Client client(BenchClientOptions(address));
  const std::vector<std::string> keys = KeysOf(i, n);
  const std::string mine = AddressesOf(i, keys.size());
  gate.ready.fetch_add(1);
  for (int phase = 0; phase < 2; ++phase) {
    {
      MutexLock l(gate.mu);
      gate.cv.wait(l.native(), [&]() ELASTIC_REQUIRES(gate.mu) { return gate.go.load() >= phase; });
    }
    auto a = client.Join(Slot(i), phase - 1, 0, std::chrono::seconds(60));
    bool ok = a.ok() && a->assignment.rank == i && a->assignment.round == phase;
    StatusOr<std::vector<std::string>> v = Internal("skipped");
    if (ok && g_separate) {  // the pattern before the two were one call
      ok = client.Set(phase, std::to_string(i), mine).ok();
      if (ok) v = client.Get(phase, keys, std::chrono::seconds(60));
    } else if (ok) {
      v = client.SetAndGet(phase, std::to_string(i), mine, keys, std::chrono::seconds(60));
    }
    ok = ok && v.ok() && v->size() == keys.size();
    if (!ok) gate.failures[phase].fetch_add(1);
    gate.done.fetch_add(1);
  }
}

Result RunOnce(int n) {
  ServerChild server = StartServer(n);
  Gate gate;
  std::vector<std::thread> threads;
  std::vector<AsyncWorker> async_workers(g_async ? n : 0);
  for (int i = 0; g_async && i < n; ++i) {
    AsyncWorker& w = async_workers[i];
    w.client = std::make_unique<Client>(BenchClientOptions(server.address));
    w.stub = v1::Rendezvous::NewStub(w.client->channel());
    w.keys = KeysOf(i, n);
    w.mine = AddressesOf(i, w.keys.size());
    gate.ready.fetch_add(1);
  }
  for (int i = 0; !g_async && i < n; ++i) {
    threads.emplace_back([&, i] { SyncWorker(i, n, server.address, gate); });
  }
  while (gate.ready.load() < n) std::this_thread::yield();
  Result r;
  for (int phase = 0; phase < 2; ++phase) {
    Phase& p = phase == 0 ? r.first : r.next;
    if (phase == 1) {
      int ok = 0;
      server.Ask('p', &ok, sizeof ok);
      if (!ok) std::abort();
    }
    const double server0 = server.Cpu(), client0 = CpuSeconds(RUSAGE_SELF);
    auto start = std::chrono::steady_clock::now();
    {
      MutexLock g(gate.mu);
      gate.go.store(phase);
    }
    gate.cv.notify_all();
    for (int i = 0; g_async && i < n; ++i) {
      StartAsync(async_workers[i], i, phase, [&, phase](bool ok) {
        if (!ok) gate.failures[phase].fetch_add(1);
        gate.done.fetch_add(1);
      });
    }
    while (gate.done.load() < n * (phase + 1)) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    p.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    p.client_cpu = CpuSeconds(RUSAGE_SELF) - client0;
    p.server_cpu = server.Cpu() - server0;
    p.failures = gate.failures[phase].load();
  }
  for (auto& t : threads) t.join();
  r.server_peak_kib = server.Finish();
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--serve") Serve(std::atoi(argv[2]), 1, 0);
  std::vector<int> sizes;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--full-mesh") {
      g_full_mesh = true;
    } else if (std::string(argv[i]) == "--separate") {
      g_separate = true;
    } else if (std::string(argv[i]) == "--whole-addresses") {
      g_whole_addresses = true;
    } else if (std::string(argv[i]) == "--async") {
      g_async = true;
    } else if (std::string(argv[i]) == "--help" || std::string(argv[i]) == "-h") {
      std::printf("usage: rendezvous_bench [--full-mesh] [--separate] [--async] "
                  "[--whole-addresses] [N ...]\n"
                  "  N simulated workers (1 to 4096 each; default 16 64 256 1024) join a round,\n"
                  "  then Set their pair addresses and Get their Gloo peers' keys; round 0\n"
                  "  connects the channels, round 1 reuses them.\n"
                  "  --full-mesh  Get all N keys (the old full-mesh pattern)\n"
                  "  --separate   a Set then a Get (the pattern before SetAndGet)\n"
                  "  --async      the calls from one thread (gRPC callback API), not a thread each\n"
                  "  --whole-addresses  publish each pair address whole (148 bytes a peer), as\n"
                  "               before the addresses were sent as differences\n");
      return 0;
    } else {
      char* end = nullptr;
      long n = std::strtol(argv[i], &end, 10);
      if (end == argv[i] || *end != '\0' || n < 1 || n > 4096) {
        std::fprintf(stderr, "rendezvous_bench: '%s' is neither an option nor a worker count "
                             "(1 to 4096); see --help\n", argv[i]);
        return 2;
      }
      sizes.push_back(static_cast<int>(n));
    }
  }
  if (sizes.empty()) sizes = {16, 64, 256, 1024};
  if (g_async && g_separate) {
    std::fprintf(stderr, "rendezvous_bench: --async runs SetAndGet only (no --separate)\n");
    return 2;
  }
  std::printf("rendezvous_bench: Join + %s(%s) per worker, one channel each, %s; round 0 (the "
              "channels connect) and round 1 (the same channels, as after a membership change)\n",
              g_separate ? "Set + Get" : "SetAndGet",
              g_full_mesh ? "all N keys" : "its Gloo peers' keys",
              g_async ? "calls issued asynchronously from one thread" : "a thread each");
  std::printf("%8s %6s %12s %14s %16s %12s %10s %16s\n", "workers", "round", "wall",
              "server CPU", "CPU per worker", "client CPU", "failures", "server peak RSS");
  for (int n : sizes) {
    Result r = RunOnce(n);
    for (int phase = 0; phase < 2; ++phase) {
      const Phase& p = phase == 0 ? r.first : r.next;
      std::printf("%8d %6d %10.3f s %12.2f s %13.2f ms %10.2f s %10d %12.1f MiB\n", n, phase,
                  p.seconds, p.server_cpu, p.server_cpu * 1000 / n, p.client_cpu, p.failures,
                  r.server_peak_kib / 1024.0);
    }
    std::fflush(stdout);
  }
  return 0;
}
