// The standbys a leader keeps (driver/placement.h).
#include "driver/placement.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
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

constexpr size_t kMaxLauncherOutput = 64 << 10;
constexpr const char* kStandbyHeader = "elastic-standby:";

// Options of this machine alone, not given to a placed standby: option -> takes a value.
bool DroppedOption(const std::string& word, bool* with_value) {
  if (word == "--fresh") {  // the leader's start alone: a standby refuses it (it adopts)
    *with_value = false;
    return true;
  }
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
                          const std::string& log, const std::map<std::string, std::string>& env) {
  std::string run;
  if (!env.empty()) {
    run = "env";
    for (const auto& [k, v] : env) run += " " + ShellQuote(k + "=" + v);
    run += " ";
  }
  run += ShellQuote(program);
  for (const auto& a : args) run += " " + ShellQuote(a);
  std::string s;
  s += "IFS= read -r ELASTIC_STATE_STORE_TLS || { echo 'elastic-run: no etcd TLS line on "
       "stdin' >&2; exit 1; }\n";
  s += "if [ -n \"$ELASTIC_STATE_STORE_TLS\" ]; then export ELASTIC_STATE_STORE_TLS; fi\n";
  s += "cd " + ShellQuote(cwd) + " || exit 1\n";
  s += "L=" + ShellQuote(log) + "\n";
  s += "mkdir -p " + ShellQuote(state_dir) + " && chmod 0700 " + ShellQuote(state_dir) +
       " || exit 1\n";
  s += "command -v setsid >/dev/null 2>&1 || { echo 'elastic-run: no setsid on this host "
       "(util-linux): a standby cannot outlive its launch here' >&2; exit 1; }\n";
  // setsid, from a shell that is not its group's leader, does not fork: $! is the driver.
  s += "setsid " + run + " </dev/null >>\"$L\" 2>&1 &\n";
  s += "p=$!\n";
  // Not before it is in a session of its own: a launcher whose group is killed when it ends
  // (the driver's Process does so) must not take the standby with it.
  // $t: its state and what follows ("S 1 4242 4242 ..."): empty once it is gone; "Z ..." while
  // it is a zombie this shell has not reaped (it exited at once).
  s += "st() { t=$(sed 's/.*) //' /proc/$p/stat 2>/dev/null); s=$(echo \"$t\" | cut -d' ' -f4); "
       "case \"$t\" in ''|Z*) s=;; esac; }\n";
  s += "i=0; while [ $i -lt 200 ]; do st; [ \"$s\" = \"$p\" ] && break; [ -z \"$s\" ] && break; "
       "sleep 0.02; i=$((i+1)); done\n";
  // A standby refused its options (a bad path, say) within a moment: said here, with why.
  s += "[ \"$s\" = \"$p\" ] && { sleep 0.3; st; }\n";
  s += "if [ -z \"$s\" ]; then echo \"elastic-run: the standby (pid $p) exited at once; the end "
       "of its output ($L):\" >&2; tail -n 5 \"$L\" >&2; exit 1; fi\n";
  s += "[ \"$s\" = \"$p\" ] || { echo \"elastic-run: the standby (pid $p) did not start in a "
       "session of its own\" >&2; kill $p 2>/dev/null; exit 1; }\n";
  s += "echo \"" + std::string(kStandbyHeader) + " $p\"\n";
  return s;
}

std::string StopStandbyScript(int64_t pid) {
  const std::string p = std::to_string(pid);
  return "if tr '\\0' '\\n' </proc/" + p + "/cmdline 2>/dev/null | grep -qx -- --standby; then "
         "kill -TERM " + p + " && echo stopped; else echo gone; fi\n";
}

bool IsThisMachine(const std::string& host) {
  if (IsLoopback(host)) return true;
  std::set<std::string> mine;
  ifaddrs* ifs = nullptr;
  if (getifaddrs(&ifs) != 0) return false;
  char text[INET6_ADDRSTRLEN];
  for (ifaddrs* i = ifs; i; i = i->ifa_next) {
    if (!i->ifa_addr) continue;
    const int family = i->ifa_addr->sa_family;
    const void* a = nullptr;
    if (family == AF_INET) a = &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr;
    if (family == AF_INET6) a = &reinterpret_cast<sockaddr_in6*>(i->ifa_addr)->sin6_addr;
    if (a && inet_ntop(family, a, text, sizeof text)) mine.insert(text);
  }
  freeifaddrs(ifs);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0) return false;
  bool ours = false;
  for (addrinfo* f = found; f && !ours; f = f->ai_next) {
    const void* a = nullptr;
    if (f->ai_family == AF_INET) a = &reinterpret_cast<sockaddr_in*>(f->ai_addr)->sin_addr;
    if (f->ai_family == AF_INET6) a = &reinterpret_cast<sockaddr_in6*>(f->ai_addr)->sin6_addr;
    if (a && inet_ntop(f->ai_family, a, text, sizeof text)) {
      ours = mine.count(text) > 0 || std::string(text).rfind("127.", 0) == 0 ||
             std::string(text) == "::1";
    }
  }
  freeaddrinfo(found);
  return ours;
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
  ASSIGN_OR_RETURN(Captured r, RunToEnd(spec, deadline, kMaxLauncherOutput, stop));
  if (r.timed_out) {
    if (stop()) return DeadlineExceeded("stopped");
    return DeadlineExceeded(fmt::format(
        "the launcher did not finish within {} s; killed",
        std::chrono::duration_cast<std::chrono::seconds>(deadline).count()));
  }
  if (r.exit_code != 0) {
    std::string said = r.err.empty() ? r.out : r.err;
    while (!said.empty() && (said.back() == '\n' || said.back() == '\r')) said.pop_back();
    return Unavailable("the launcher exited with status " + std::to_string(r.exit_code) +
                       (said.empty() ? "" : ": " + said));
  }
  return r.out;
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
    std::string say = "--drivers: cannot count the standbys in etcd: " + listed.status().message();
    if (say != said_) spdlog::warn("{}; none is started until it can", say);
    said_ = say;
    return;
  }
  if (options_.counted) options_.counted(*listed);
  const auto now = SteadyClock::now();
  auto seconds = [](Duration d) {
    return std::chrono::duration_cast<std::chrono::seconds>(d).count();
  };
  // A host passed over: for the back-off, doubled at each failure in a row (at most 16x).
  auto fail = [&](const std::string& host) {
    Failed& f = failed_[host];
    f.count = std::min(f.count + 1, 5);
    f.until = now + options_.back_off * (1 << (f.count - 1));
    return seconds(f.until - now);
  };
  std::set<std::string> addresses, skip;
  for (const auto& s : *listed) {
    if (!s.address.empty()) addresses.insert(s.address);
  }
  int pending = 0;
  for (auto it = launched_.begin(); it != launched_.end();) {
    const std::string host = it->first;
    if (addresses.count(host)) {
      failed_.erase(host);
      it = launched_.erase(it);  // it listed itself
    } else if (now - it->second.at > options_.listing_deadline) {
      // Not counted, so not kept: it may be cut off from etcd for good (a store address its
      // host cannot reach), and would otherwise wait for ever beside the next one.
      const int64_t pid = it->second.pid;
      it = launched_.erase(it);
      Status stopped = options_.stop ? options_.stop(host, pid, [this] { return Stopping(); })
                                     : Status::Ok();
      spdlog::warn("--drivers: the standby started on {} (pid {}) did not list itself in etcd "
                   "within {} s: it was {} (its output: {} there); another host gets one, and "
                   "{} again in {} s",
                   host, pid, seconds(options_.listing_deadline),
                   stopped.ok() ? "stopped" : "not stopped (" + stopped.message() + ")",
                   StandbyLogPath(options_.log_dir, host), host, fail(host));
    } else {
      skip.insert(host);
      ++pending;
      ++it;
    }
  }
  for (const auto& [host, f] : failed_) {
    if (now < f.until) skip.insert(host);
  }
  for (const auto& h : hosts) {
    if (options_.is_this_machine && options_.is_this_machine(h)) skip.insert(h);
  }
  const int missing = options_.drivers - 1 - static_cast<int>(listed->size()) - pending;
  if (missing <= 0) {
    said_.clear();
    return;
  }
  auto chosen = ChooseStandbyHosts(hosts, options_.own_address, addresses, skip, missing);
  if (chosen.empty()) {
    std::string say = fmt::format(
        "--drivers {}: {} standby(s) wait, and no other host of the job is free for one now "
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
                   host, pid.status().message(), host, fail(host));
      continue;
    }
    spdlog::info("--drivers: started a standby driver on {} (pid {} there; its output: {})",
                 host, *pid, StandbyLogPath(options_.log_dir, host));
    launched_[host] = Launched{SteadyClock::now(), *pid};
  }
}

}  // namespace elastic::driver
