// The standbys a leader keeps (driver/placement.h).
#include "driver/placement.h"

#include <poll.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>

#include "common/process.h"
#include "driver/launch.h"

namespace elastic::driver {

namespace {

// How long a standby that a launch started has to list itself in etcd before its host is
// passed over for a while (kBackOff).
constexpr auto kListingDeadline = std::chrono::seconds(30);
constexpr auto kBackOff = std::chrono::seconds(60);
constexpr size_t kMaxLauncherOutput = 64 << 10;
constexpr const char* kStandbyHeader = "elastic-standby:";

// Options of this machine alone, not given to a placed standby: option -> takes a value.
bool DroppedOption(const std::string& word, bool* with_value) {
  for (const char* o : {"--driver-address", "--job-file", "--state-store-ca",
                        "--state-store-cert", "--state-store-key"}) {
    const std::string name = o;
    if (word == name) {
      *with_value = true;
      return true;
    }
    if (word.rfind(name + "=", 0) == 0) {
      *with_value = false;
      return true;
    }
  }
  return false;
}

}  // namespace

std::vector<std::string> ChooseStandbyHosts(const std::vector<std::string>& job_hosts,
                                            const std::string& own,
                                            const std::set<std::string>& standby_addresses,
                                            const std::set<std::string>& skip, int wanted) {
  std::vector<std::string> out;
  for (const auto& h : job_hosts) {
    if (static_cast<int>(out.size()) >= wanted) break;
    if (h.empty() || h == own || IsLoopback(h) || standby_addresses.count(h) || skip.count(h) ||
        std::find(out.begin(), out.end(), h) != out.end()) {
      continue;
    }
    out.push_back(h);
  }
  return out;
}

std::vector<std::string> StandbyArgv(const std::vector<std::string>& argv, size_t command_size,
                                     const std::string& host) {
  std::vector<std::string> out = {"--standby", "--driver-address", host};
  const size_t options = argv.size() >= command_size ? argv.size() - command_size : 0;
  for (size_t i = 0; i < argv.size(); ++i) {
    bool with_value = false;
    if (i < options && argv[i] == "--standby") continue;
    if (i < options && DroppedOption(argv[i], &with_value)) {
      if (with_value) ++i;
      continue;
    }
    out.push_back(argv[i]);
  }
  return out;
}

std::string StandbyLogPath(const std::string& state_dir, const std::string& host) {
  std::string safe = host;
  for (char& c : safe) {
    if (!isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '-' && c != '_') c = '_';
  }
  return state_dir + "/driver-" + safe + ".log";
}

std::string StandbyScript(const std::string& cwd, const std::string& program,
                          const std::vector<std::string>& args, const std::string& state_dir,
                          const std::string& log) {
  std::string run = ShellQuote(program);
  for (const auto& a : args) run += " " + ShellQuote(a);
  std::string s;
  s += "IFS= read -r ELASTIC_STATE_STORE_TLS || { echo 'elastic-run: no etcd TLS line on "
       "stdin' >&2; exit 1; }\n";
  s += "if [ -n \"$ELASTIC_STATE_STORE_TLS\" ]; then export ELASTIC_STATE_STORE_TLS; fi\n";
  s += "cd " + ShellQuote(cwd) + " || exit 1\n";
  s += "mkdir -p " + ShellQuote(state_dir) + " && chmod 0700 " + ShellQuote(state_dir) +
       " || exit 1\n";
  s += "command -v setsid >/dev/null 2>&1 || { echo 'elastic-run: no setsid on this host "
       "(util-linux): a standby cannot outlive its launch here' >&2; exit 1; }\n";
  // setsid, from a shell that is not its group's leader, does not fork: $! is the driver.
  s += "setsid " + run + " </dev/null >>" + ShellQuote(log) + " 2>&1 &\n";
  s += "p=$!\n";
  // Not before it is in a session of its own: a launcher whose group is killed when it ends
  // (the driver's Process does so) must not take the standby with it.
  s += "i=0; while [ $i -lt 200 ]; do "
       "s=$(sed 's/.*) //' /proc/$p/stat 2>/dev/null | cut -d' ' -f4); "
       "[ \"$s\" = \"$p\" ] && break; [ -z \"$s\" ] && break; sleep 0.02; i=$((i+1)); done\n";
  s += "[ \"$s\" = \"$p\" ] || { echo \"elastic-run: the standby (pid $p) did not start in a "
       "session of its own\" >&2; kill $p 2>/dev/null; exit 1; }\n";
  s += "echo \"" + std::string(kStandbyHeader) + " $p\"\n";
  return s;
}

StatusOr<int64_t> ParseStandbyPid(const std::string& output) {
  size_t at = output.find(kStandbyHeader);
  if (at == std::string::npos) {
    return InvalidArgument("the launch printed no standby pid");
  }
  const char* p = output.c_str() + at + strlen(kStandbyHeader);
  char* end = nullptr;
  long long pid = strtoll(p, &end, 10);
  if (end == p || pid <= 0) return InvalidArgument("the launch printed no standby pid");
  return static_cast<int64_t>(pid);
}

StatusOr<std::string> RunLauncher(const std::vector<std::string>& argv,
                                  const std::string& stdin_data, Duration deadline,
                                  const std::function<bool()>& stop) {
  LaunchSpec spec;
  spec.argv = argv;
  spec.stdin_data = stdin_data;
  ASSIGN_OR_RETURN(std::unique_ptr<Process> proc, Process::Start(spec));
  const TimePoint until = SteadyClock::now() + deadline;
  std::string out;
  char buf[4096];
  auto drain = [&](int stream) {
    int fd = stream == 0 ? proc->stdout_fd() : proc->stderr_fd();
    while (fd >= 0) {
      ssize_t got = read(fd, buf, sizeof buf);
      if (got < 0 && (errno == EAGAIN || errno == EINTR)) return;
      if (got <= 0) {
        stream == 0 ? proc->CloseStdout() : proc->CloseStderr();
        return;
      }
      if (out.size() < kMaxLauncherOutput) out.append(buf, static_cast<size_t>(got));
    }
  };
  int code = 0;
  bool exited = false, stopped = false;
  while (!exited) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - SteadyClock::now());
    if (left.count() <= 0 || stop()) {
      stopped = true;
      break;
    }
    pollfd fds[3] = {{proc->stdout_fd(), POLLIN, 0},
                     {proc->stderr_fd(), POLLIN, 0},
                     {proc->pidfd(), POLLIN, 0}};
    if (poll(fds, 3, static_cast<int>(std::min<long>(left.count(), 200))) < 0 && errno != EINTR) {
      break;
    }
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd >= 0 && (fds[i].revents & (POLLIN | POLLHUP | POLLERR))) drain(i);
    }
    if (proc->TryReap(&code)) {
      exited = true;
      drain(0);
      drain(1);
    }
  }
  if (!exited) {
    proc->SignalGroup(SIGKILL);
    pollfd exit_fd{proc->pidfd(), POLLIN, 0};
    while (!proc->TryReap(&code)) poll(&exit_fd, 1, 100);
    if (stopped && stop()) return DeadlineExceeded("stopped");
    return DeadlineExceeded(fmt::format(
        "the launcher did not finish within {} s; killed",
        std::chrono::duration_cast<std::chrono::seconds>(deadline).count()));
  }
  if (code != 0) {
    while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
    return Unavailable("the launcher exited with status " + std::to_string(code) +
                   (out.empty() ? "" : ": " + out));
  }
  return out;
}

StandbyPlacer::StandbyPlacer(Options options) : options_(std::move(options)) {
  thread_ = std::thread([this] { Run(); });
}

StandbyPlacer::~StandbyPlacer() {
  {
    MutexLock g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void StandbyPlacer::SetHosts(std::vector<std::string> hosts) {
  MutexLock g(mu_);
  hosts_ = std::move(hosts);
}

bool StandbyPlacer::Stopping() {
  MutexLock g(mu_);
  return stop_;
}

void StandbyPlacer::Run() {
  const auto period = std::chrono::milliseconds(std::max(500, options_.ttl_seconds * 500));
  while (true) {
    {
      MutexLock g(mu_);
      if (cv_.wait_for(g.native(), period, [&]() ELASTIC_REQUIRES(mu_) { return stop_; })) {
        return;
      }
    }
    Turn();
  }
}

void StandbyPlacer::Turn() {
  std::vector<std::string> hosts;
  {
    MutexLock g(mu_);
    hosts = hosts_;
  }
  if (hosts.empty()) return;  // no round formed yet
  auto listed = options_.list();
  if (!listed.ok()) {
    spdlog::debug("--drivers: cannot count the standbys: {}", listed.status().message());
    return;
  }
  if (options_.counted) options_.counted(*listed);
  const auto now = SteadyClock::now();
  std::set<std::string> addresses, skip;
  for (const auto& s : *listed) addresses.insert(s.address);
  int pending = 0;
  for (auto it = launched_.begin(); it != launched_.end();) {
    if (addresses.count(it->first)) {
      it = launched_.erase(it);  // it listed itself
    } else if (now - it->second > kListingDeadline) {
      spdlog::warn("--drivers: the standby started on {} did not list itself in etcd within "
                   "{} s (its output: {} there); another host gets one, and {} again in {} s",
                   it->first, std::chrono::duration_cast<std::chrono::seconds>(kListingDeadline).count(),
                   StandbyLogPath(options_.log_dir, it->first), it->first,
                   std::chrono::duration_cast<std::chrono::seconds>(kBackOff).count());
      failed_[it->first] = now;
      it = launched_.erase(it);
    } else {
      skip.insert(it->first);
      ++pending;
      ++it;
    }
  }
  for (auto it = failed_.begin(); it != failed_.end();) {
    if (now - it->second > kBackOff) {
      it = failed_.erase(it);
    } else {
      skip.insert(it->first);
      ++it;
    }
  }
  const int missing = options_.drivers - 1 - static_cast<int>(listed->size()) - pending;
  if (missing <= 0) {
    said_.clear();
    return;
  }
  auto chosen = ChooseStandbyHosts(hosts, options_.own_address, addresses, skip, missing);
  if (chosen.empty()) {
    std::string say = fmt::format(
        "--drivers {}: {} standby(s) wait, and no other host of the job is free for one "
        "(hosts: {}; this driver's: {})",
        options_.drivers, listed->size(), fmt::join(hosts, ", "), options_.own_address);
    if (say != said_ && pending == 0) spdlog::warn("{}", say);
    said_ = say;
    return;
  }
  for (const auto& host : chosen) {
    if (Stopping()) return;
    auto pid = options_.launch(host, [this] { return Stopping(); });
    if (!pid.ok()) {
      if (Stopping()) return;
      spdlog::warn("--drivers: could not start a standby driver on {}: {}; trying another "
                   "host, and {} again in {} s",
                   host, pid.status().message(), host,
                   std::chrono::duration_cast<std::chrono::seconds>(kBackOff).count());
      failed_[host] = SteadyClock::now();
      continue;
    }
    spdlog::info("--drivers: started a standby driver on {} (pid {} there; its output: {})",
                 host, *pid, StandbyLogPath(options_.log_dir, host));
    launched_[host] = SteadyClock::now();
  }
}

}  // namespace elastic::driver
