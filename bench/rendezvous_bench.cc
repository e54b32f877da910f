// rendezvous_bench: N simulated workers (threads, each with its own gRPC channel) Join a round,
// then each does one Set of its pair addresses and one Get of its Gloo peers' keys (GlooPeers:
// about 2 log2 N), the pattern of the communicator's set-up. `--full-mesh` Gets all N keys
// instead (the old full-mesh pattern: N^2 values through the server). The server runs in a
// child process, so that its peak memory (VmHWM) and CPU time are its own: the CPU per joining
// worker is the server's cost; the wall time also holds N client threads sharing this
// machine's cores with it.
//
//   build/bench/rendezvous_bench [--full-mesh] [N ...]     (default: 16 64 256 1024)
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

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

// Child: serve one round of n members; write the port, wait for EOF on `in`, write peak RSS.
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
  std::map<std::string, Assignment> members;
  for (int i = 0; i < n; ++i) {
    members[Slot(i)].rank = i;
    members[Slot(i)].size = n;
  }
  if (!core.ProposeRound(0, members, {}).ok()) _exit(1);
  int port = (*server)->port();
  if (write(out_fd, &port, sizeof port) != sizeof port) _exit(1);
  char c;
  while (read(in_fd, &c, 1) > 0) {
  }
  long rss = PeakRssKiB();
  if (write(out_fd, &rss, sizeof rss) != sizeof rss) _exit(1);
  (*server)->Shutdown(std::chrono::seconds(1));
  _exit(0);
}

struct Result {
  double seconds = 0;
  long server_peak_kib = 0;
  double server_cpu = 0;
  double client_cpu = 0;  // this process: the N client threads and their gRPC channels
  int failures = 0;
};

bool g_full_mesh = false;

Result RunOnce(int n) {
  int to_parent[2], to_child[2];
  if (pipe(to_parent) != 0 || pipe(to_child) != 0) std::abort();
  pid_t pid = fork();
  if (pid == 0) {
    // gRPC does not survive fork(): the server child starts afresh through exec.
    dup2(to_child[0], 0);
    dup2(to_parent[1], 1);
    close(to_child[0]);
    close(to_child[1]);
    close(to_parent[0]);
    close(to_parent[1]);
    std::string arg = std::to_string(n);
    execl("/proc/self/exe", "rendezvous_bench", "--serve", arg.c_str(), (char*)nullptr);
    _exit(127);
  }
  close(to_parent[1]);
  close(to_child[0]);
  int port = 0;
  if (read(to_parent[0], &port, sizeof port) != sizeof port) std::abort();
  std::string address = "127.0.0.1:" + std::to_string(port);

  std::atomic<int> ready{0}, failures{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      ClientOptions o;
      o.address = address;
      o.token = "bench-token";
      Client client(o);
      ready.fetch_add(1);
      while (!go.load()) std::this_thread::yield();
      auto a = client.Join(Slot(i), -1, 0, std::chrono::seconds(60));
      bool ok = a.ok() && a->assignment.rank == i;
      std::vector<std::string> keys;
      if (g_full_mesh) {
        for (int k = 0; k < n; ++k) keys.push_back(std::to_string(k));
      } else {
        for (int k : elastic::worker_agent::GlooPeers(i, n)) keys.push_back(std::to_string(k));
      }
      // A pair address is ~140 bytes (Gloo's tcp::Address); one per key asked for.
      ok = ok && client.Set(0, std::to_string(i), std::string(140 * keys.size(), 'a' + i % 26)).ok();
      auto v = ok ? client.Get(0, keys, std::chrono::seconds(60))
                  : StatusOr<std::vector<std::string>>(Internal("skipped"));
      ok = ok && v.ok() && v->size() == keys.size();
      if (!ok) failures.fetch_add(1);
    });
  }
  while (ready.load() < n) std::this_thread::yield();
  auto cpu = [] {
    struct rusage u {};
    getrusage(RUSAGE_SELF, &u);
    return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
  };
  const double cpu0 = cpu();
  auto start = std::chrono::steady_clock::now();
  go.store(true);
  for (auto& t : threads) t.join();
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  close(to_child[1]);
  Result r;
  r.seconds = secs;
  r.client_cpu = cpu() - cpu0;
  r.failures = failures.load();
  if (read(to_parent[0], &r.server_peak_kib, sizeof r.server_peak_kib) != sizeof(long)) {
    r.server_peak_kib = -1;
  }
  close(to_parent[0]);
  struct rusage ru {};
  int status = 0;
  wait4(pid, &status, 0, &ru);
  r.server_cpu =
      ru.ru_utime.tv_sec + ru.ru_stime.tv_sec + (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--serve") Serve(std::atoi(argv[2]), 1, 0);
  std::vector<int> sizes;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--full-mesh") {
      g_full_mesh = true;
    } else {
      sizes.push_back(std::atoi(argv[i]));
    }
  }
  if (sizes.empty()) sizes = {16, 64, 256, 1024};
  std::printf("rendezvous_bench: Join + Set + Get(%s) per worker, one channel each\n",
              g_full_mesh ? "all N keys" : "its Gloo peers' keys");
  std::printf("%8s %14s %18s %12s %16s %12s %10s\n", "workers", "round+exchange",
              "server peak RSS", "server CPU", "CPU per worker", "client CPU", "failures");
  for (int n : sizes) {
    Result r = RunOnce(n);
    std::printf("%8d %12.3f s %14.1f MiB %10.2f s %13.2f ms %10.2f s %10d\n", n, r.seconds,
                r.server_peak_kib / 1024.0, r.server_cpu, r.server_cpu * 1000 / n, r.client_cpu,
                r.failures);
    std::fflush(stdout);
  }
  return 0;
}
