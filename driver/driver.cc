// The driver's event loop. One thread owns all state: it polls worker pipes and pidfds, a
// signalfd, and an eventfd through which the rendezvous and discovery threads post events.
#include "driver/driver.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include "driver/event_log.h"
#include "driver/output.h"
#include "driver/process.h"
#include "rendezvous/rendezvous.h"

namespace elastic::driver {

using discovery::HostSlots;
using rendezvous::Assignment;
using rendezvous::Event;
using rendezvous::EventKind;

void BlockDriverSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGCHLD);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  signal(SIGPIPE, SIG_IGN);
}

namespace {

double Secs(Duration d) { return std::chrono::duration<double>(d).count(); }

std::string RandomToken() {
  unsigned char bytes[24];
  FILE* f = fopen("/dev/urandom", "rb");
  size_t got = f ? fread(bytes, 1, sizeof bytes, f) : 0;
  if (f) fclose(f);
  if (got != sizeof bytes) {
    std::random_device rd;
    for (auto& b : bytes) b = static_cast<unsigned char>(rd());
  }
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned char b : bytes) {
    out += hex[b >> 4];
    out += hex[b & 15];
  }
  return out;
}

bool IsLocalHost(const std::string& host) {
  if (host == "localhost" || host == "127.0.0.1" || host == "::1") return true;
  char name[256] = {0};
  gethostname(name, sizeof name - 1);
  return host == name;
}

// Events posted to the loop by other threads.
struct Posted {
  enum Kind { kRoundFormed, kJoinTimeout, kReport, kWatchOpened, kWatchClosed, kDiscovery };
  explicit Posted(Kind k, int64_t r = -1) : kind(k), round(r) {}
  Kind kind;
  int64_t round = -1;
  std::vector<std::string> slots;
  rendezvous::Report report;
  std::optional<StatusOr<std::vector<HostSlots>>> hosts;
  std::vector<std::string> warnings;
};

struct Worker {
  std::string slot, host;
  int index = 0;
  std::unique_ptr<Process> proc;
  bool local = true;
  bool dropped = false;   // the driver gave up on it (failed, lost, removed): exit is expected
  bool removed = false;   // scaled away
  bool finished = false;  // reported FINISHED
  bool ever_joined = false;
  std::string label;      // output prefix: its rank
  TimePoint lost_at = TimePoint::max();  // remote: Watch broke; lost unless it exits by then
};

class Driver : public rendezvous::Listener {
 public:
  explicit Driver(const DriverOptions& o)
      : opts_(o),
        hosts_(discovery::HostTableOptions{RealClock(), o.host_failure_limit, o.cooldown_min,
                                           o.cooldown_max, static_cast<uint64_t>(getpid())}),
        out_(stdout, o.output_dir) {}

  int Run();

  // rendezvous::Listener: called on gRPC / timer threads; only posts.
  void OnRoundFormed(int64_t round) override { Post(Posted(Posted::kRoundFormed, round)); }
  void OnJoinTimeout(int64_t round, const std::vector<std::string>& missing) override {
    Posted p{Posted::kJoinTimeout, round};
    p.slots = missing;
    Post(std::move(p));
  }
  void OnReport(const rendezvous::Report& r) override {
    Posted p{Posted::kReport};
    p.report = r;
    Post(std::move(p));
  }
  void OnWatchOpened(const std::string& slot) override {
    Posted p{Posted::kWatchOpened};
    p.slots = {slot};
    Post(std::move(p));
  }
  void OnWatchClosed(const std::string& slot) override {
    Posted p{Posted::kWatchClosed};
    p.slots = {slot};
    Post(std::move(p));
  }

 private:
  void Post(Posted p) {
    {
      std::lock_guard<std::mutex> g(post_mu_);
      posted_.push_back(std::move(p));
    }
    uint64_t one = 1;
    ssize_t ignored = write(wake_fd_, &one, sizeof one);
    (void)ignored;
  }
  Status Start();
  void Loop();
  void HandlePosted(Posted& p);
  void HandleDiscovery(Posted& p);
  void HandleExit(Worker& w, int code);
  void HandleReport(const rendezvous::Report& r);
  void Replan(const std::string& reason);
  void Launch(Worker& w);
  void Terminate(int code, const std::string& message);
  void CheckFinished();
  void DiscoveryLoop();
  std::string LabelOf(const std::string& slot) const;
  int MemberRank(const std::string& slot) const;

  DriverOptions opts_;
  discovery::HostTable hosts_;
  OutputMux out_;
  EventLog log_;
  std::string token_, driver_addr_;
  std::unique_ptr<rendezvous::Core> core_;
  std::unique_ptr<rendezvous::Server> server_;
  int wake_fd_ = -1, signal_fd_ = -1;

  std::mutex post_mu_;
  std::deque<Posted> posted_;  // guarded by post_mu_

  std::thread discovery_;
  std::mutex disc_mu_;
  std::condition_variable disc_cv_;
  bool disc_stop_ = false;  // guarded by disc_mu_

  std::map<std::string, Worker> workers_;  // by slot
  std::vector<std::string> members_;       // of the newest proposed round, in rank order
  int64_t round_ = -1;                      // newest proposed round
  int64_t formed_ = -1;                     // newest formed round
  std::set<std::string> holders_;           // slots that hold the committed state
  int resets_ = 0, failures_ = 0;
  bool finishing_ = false;
  bool shutting_down_ = false;
  int exit_code_ = 0;
  std::string final_message_;
  TimePoint kill_at_ = TimePoint::max();      // SIGKILL after the grace period
  TimePoint wait_until_ = TimePoint::max();   // waiting for --min-np until
  TimePoint recovery_start_{};                // when the current recovery was detected
  bool recovering_ = false;
  bool round_broken_ = false;                 // a member of the newest round is gone
  bool first_commit_logged_ = true;
  bool started_ = false;                      // round 0 formed
  std::vector<HostSlots> last_listed_;        // the last good host set, as listed
  std::vector<std::string> last_listed_order_;  // every host ever listed, first-seen order
  TimePoint scale_up_start_{};                // when discovery last added capacity
};

std::string Driver::LabelOf(const std::string& slot) const {
  int r = MemberRank(slot);
  return r >= 0 ? std::to_string(r) : slot;
}

int Driver::MemberRank(const std::string& slot) const {
  auto it = std::find(members_.begin(), members_.end(), slot);
  return it == members_.end() ? -1 : static_cast<int>(it - members_.begin());
}

Status Driver::Start() {
  RETURN_IF_ERROR(log_.Open(opts_.event_log));
  token_ = RandomToken();
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  signal_fd_ = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
  if (wake_fd_ < 0 || signal_fd_ < 0) return Internal("cannot create eventfd/signalfd");

  rendezvous::CoreOptions co;
  co.listener = this;
  co.rendezvous_timeout = opts_.rendezvous_timeout;
  core_ = std::make_unique<rendezvous::Core>(co);
  rendezvous::ServerOptions so;
  so.address = opts_.bind_address + ":" + std::to_string(opts_.port);
  so.token = token_;
  auto server = rendezvous::Server::Start(core_.get(), so);
  if (!server.ok()) return server.status();
  server_ = std::move(server).value();

  // The first host set: static, or the first discovery run (whose failure is fatal).
  std::vector<HostSlots> initial = opts_.hosts;
  if (!opts_.discovery_script.empty()) {
    std::vector<std::string> warnings;
    auto found = discovery::Discover(opts_.discovery_script, opts_.discovery_timeout,
                                     opts_.discovery_max_output, opts_.slots_per_host, &warnings);
    for (const auto& w : warnings) spdlog::warn("discovery: {}", w);
    if (!found.ok()) return found.status().WithContext("the first host discovery failed");
    initial = *found;
  }
  bool all_local = std::all_of(initial.begin(), initial.end(),
                               [](const HostSlots& h) { return IsLocalHost(h.host); });
  std::string host = opts_.driver_address;
  if (host.empty()) {
    char name[256] = {0};
    gethostname(name, sizeof name - 1);
    host = all_local && opts_.discovery_script.empty() ? "127.0.0.1" : name;
    if (all_local && !opts_.discovery_script.empty()) host = "127.0.0.1";
  }
  driver_addr_ = host + ":" + std::to_string(server_->port());
  spdlog::info("rendezvous server on port {}; workers dial {}", server_->port(), driver_addr_);
  hosts_.Update(initial);
  last_listed_ = initial;
  for (const auto& h : initial) last_listed_order_.push_back(h.host);
  std::vector<std::string> names;
  for (const auto& h : initial) names.push_back(h.host + ":" + std::to_string(h.slots));
  log_.Write("discovery", {{"hosts", names}, {"ok", true}});
  if (!opts_.discovery_script.empty()) discovery_ = std::thread([this] { DiscoveryLoop(); });
  return Status::Ok();
}

void Driver::DiscoveryLoop() {
  while (true) {
    {
      std::unique_lock<std::mutex> l(disc_mu_);
      if (disc_cv_.wait_for(l, opts_.discovery_interval, [&] { return disc_stop_; })) return;
    }
    Posted p{Posted::kDiscovery};
    p.hosts = discovery::Discover(opts_.discovery_script, opts_.discovery_timeout,
                                  opts_.discovery_max_output, opts_.slots_per_host, &p.warnings);
    Post(std::move(p));
  }
}

void Driver::Launch(Worker& w) {
  std::map<std::string, std::string> env = {
      {"ELASTIC_DRIVER_ADDR", driver_addr_}, {"ELASTIC_JOB_TOKEN", token_},
      {"ELASTIC_SLOT", w.slot},             {"ELASTIC_HOSTNAME", w.host},
      {"ELASTIC_IFACE", opts_.network_interface}, {"PYTHONUNBUFFERED", "1"}};
  LaunchSpec spec;
  spec.env = env;
  if (w.local) {
    spec.argv = opts_.command;
  } else {
    char cwd[4096] = {0};
    std::string remote = std::string("cd ") + ShellQuote(getcwd(cwd, sizeof cwd) ? cwd : "/") + " && env";
    for (const auto& [k, v] : env) remote += " " + ShellQuote(k + "=" + v);
    for (const auto& a : opts_.command) remote += " " + ShellQuote(a);
    if (!opts_.launcher_template.empty()) {
      std::string cmd = opts_.launcher_template;
      for (auto [key, value] : {std::pair<std::string, std::string>{"{host}", w.host},
                                {"{command}", ShellQuote(remote)}}) {
        for (size_t pos; (pos = cmd.find(key)) != std::string::npos;) cmd.replace(pos, key.size(), value);
      }
      spec.argv = {"/bin/sh", "-c", cmd};
    } else {
      spec.argv = {"ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", w.host, remote};
    }
  }
  auto proc = Process::Start(spec);
  if (!proc.ok()) {
    spdlog::error("cannot start the worker for slot {}: {}", w.slot, proc.status().message());
    log_.Write("worker_start_failed", {{"slot", w.slot}, {"error", proc.status().message()}});
    w.dropped = true;
    ++failures_;
    if (!opts_.elastic) Terminate(proc.status().code() == Code::kNotFound ? 127 : 1, proc.status().message());
    return;
  }
  w.proc = std::move(proc).value();
  w.dropped = w.removed = w.finished = w.ever_joined = false;
  spdlog::debug("started slot {} as pid {}", w.slot, w.proc->pid());
  log_.Write("worker_started", {{"slot", w.slot}, {"pid", int64_t{w.proc->pid()}}});
}

void Driver::Replan(const std::string& reason) {
  if (shutting_down_ || finishing_) return;
  // Candidates: healthy running workers (survivors) and free slots on available hosts.
  auto alive = [&](const std::string& slot) {
    auto it = workers_.find(slot);
    return it != workers_.end() && it->second.proc && !it->second.proc->reaped() &&
           !it->second.dropped;
  };
  auto busy = [&](const std::string& slot) {  // a process that is still going away
    auto it = workers_.find(slot);
    return it != workers_.end() && it->second.proc && !it->second.proc->reaped();
  };
  std::vector<HostSlots> all = hosts_.Available();
  std::vector<std::string> survivors, fresh;
  // Survivors keep their place on hosts that are still listed (blacklisting only stops new
  // launches); slots beyond a host's new count, or on hosts no longer listed, are removed.
  for (const auto& [slot, w] : workers_) {
    if (!alive(slot)) continue;
    bool still_listed = false;
    for (const auto& h : last_listed_) {
      if (h.host == w.host && w.index < h.slots) still_listed = true;
    }
    if (still_listed) survivors.push_back(slot);
  }
  for (const auto& h : all) {
    for (int i = 0; i < h.slots; ++i) {
      std::string slot = h.host + ":" + std::to_string(i);
      if (!alive(slot) && !busy(slot)) fresh.push_back(slot);
    }
  }
  // Order everything host by host (first-seen order), slots in order; cap at max_np with
  // survivors first.
  const std::vector<std::string>& host_order = last_listed_order_;
  auto key = [&](const std::string& slot) {
    std::string host = slot.substr(0, slot.rfind(':'));
    int idx = std::stoi(slot.substr(slot.rfind(':') + 1));
    size_t pos = std::find(host_order.begin(), host_order.end(), host) - host_order.begin();
    return std::make_pair(pos, idx);
  };
  auto by_key = [&](const std::string& a, const std::string& b) { return key(a) < key(b); };
  std::sort(survivors.begin(), survivors.end(), by_key);
  std::sort(fresh.begin(), fresh.end(), by_key);
  size_t cap = opts_.max_np > 0 ? static_cast<size_t>(opts_.max_np) : SIZE_MAX;
  std::vector<std::string> plan;
  for (const auto& s : survivors) {
    if (plan.size() < cap) plan.push_back(s);
  }
  for (const auto& s : fresh) {
    if (plan.size() < cap) plan.push_back(s);
  }
  std::sort(plan.begin(), plan.end(), by_key);
  // Rank 0 is always a holder of the committed state when there is one.
  for (size_t i = 0; i < plan.size(); ++i) {
    if (holders_.count(plan[i])) {
      std::rotate(plan.begin(), plan.begin() + static_cast<long>(i), plan.begin() + static_cast<long>(i) + 1);
      break;
    }
  }
  size_t need = static_cast<size_t>(started_ ? opts_.min_np : opts_.np);
  if (plan.size() < need) {
    if (wait_until_ == TimePoint::max()) {
      Duration limit = started_ ? opts_.elastic_timeout : opts_.start_timeout;
      wait_until_ = SteadyClock::now() + limit;
      spdlog::warn("{} slot(s) available, {} needed ({}); waiting up to {:.0f} s for hosts",
                   plan.size(), need, reason, Secs(limit));
      log_.Write("waiting_for_hosts", {{"available", int64_t(plan.size())}, {"needed", int64_t(need)}});
    }
    return;
  }
  wait_until_ = TimePoint::max();
  if (plan == members_ && round_ >= 0 && !round_broken_) return;  // nothing to change
  round_broken_ = false;
  if (round_ >= 0) {
    if (opts_.reset_limit >= 0 && resets_ >= opts_.reset_limit) {
      Terminate(1, "reset limit reached (" + std::to_string(opts_.reset_limit) +
                       " resets; raise --reset-limit to allow more)");
      return;
    }
    ++resets_;
  }
  std::vector<std::string> old = members_;
  int64_t old_round = round_;
  members_ = plan;
  ++round_;
  bool sync = round_ == 0 || std::any_of(plan.begin(), plan.end(),
                                         [&](const std::string& s) { return !holders_.count(s); });
  // Assignments: local and cross ranks by host.
  std::map<std::string, Assignment> assign;
  std::vector<std::string> hosts_in_round;
  std::map<std::string, int> local_count;
  for (const auto& s : plan) {
    std::string host = s.substr(0, s.rfind(':'));
    if (!local_count.count(host)) hosts_in_round.push_back(host);
    ++local_count[host];
  }
  std::map<std::string, int> local_next;
  for (size_t r = 0; r < plan.size(); ++r) {
    std::string host = plan[r].substr(0, plan[r].rfind(':'));
    Assignment a;
    a.rank = static_cast<int>(r);
    a.size = static_cast<int>(plan.size());
    a.local_rank = local_next[host]++;
    a.local_size = local_count[host];
    a.cross_rank = static_cast<int>(std::find(hosts_in_round.begin(), hosts_in_round.end(), host) -
                                    hosts_in_round.begin());
    a.cross_size = static_cast<int>(hosts_in_round.size());
    a.sync_required = sync;
    assign[plan[r]] = a;
  }
  std::vector<std::string> removed;
  for (auto& [slot, w] : workers_) {
    if (alive(slot) && std::find(plan.begin(), plan.end(), slot) == plan.end()) {
      removed.push_back(slot);
      w.removed = true;
    }
  }
  spdlog::info("round {}: {} worker(s) [{}] ({}){}", round_, plan.size(), fmt::join(plan, " "),
               reason, sync ? ", state will be synced from rank 0" : "");
  log_.Write("round_proposed", {{"round", round_}, {"members", plan}, {"removed", removed},
                                {"reason", reason}, {"sync_required", sync}});
  Status s = core_->ProposeRound(round_, assign, removed);
  if (!s.ok()) {
    Terminate(1, "internal error proposing round " + std::to_string(round_) + ": " + s.ToString());
    return;
  }
  // Fence the old round: survivors stop at their next commit.
  for (const auto& slot : old) {
    if (alive(slot)) {
      core_->events().Publish(slot, Event{EventKind::kMembershipChanging, old_round, reason});
    }
  }
  if (old_round >= 0) log_.Write("fence", {{"round", old_round}, {"reason", reason}});
  for (const auto& slot : plan) {
    Worker& w = workers_[slot];
    if (w.slot.empty()) {
      w.slot = slot;
      w.host = slot.substr(0, slot.rfind(':'));
      w.index = std::stoi(slot.substr(slot.rfind(':') + 1));
      w.local = IsLocalHost(w.host);
    }
    if (!alive(slot)) Launch(w);
  }
}

void Driver::Terminate(int code, const std::string& message) {
  if (shutting_down_) return;
  shutting_down_ = true;
  exit_code_ = code;
  final_message_ = message;
  log_.Write("job_ending", {{"code", int64_t{code}}, {"message", message}});
  bool any = false;
  for (auto& [slot, w] : workers_) {
    if (w.proc && !w.proc->reaped()) {
      w.dropped = true;
      w.proc->SignalGroup(SIGTERM);
      any = true;
    }
  }
  if (any) {
    spdlog::info("stopping workers (SIGTERM; SIGKILL after {:.1f} s)", Secs(opts_.grace));
    kill_at_ = SteadyClock::now() + opts_.grace;
  }
}

void Driver::CheckFinished() {
  if (shutting_down_ || !finishing_) return;
  for (const auto& slot : members_) {
    auto it = workers_.find(slot);
    if (it == workers_.end() || !it->second.proc || !it->second.proc->reaped()) return;
  }
  Terminate(0, "success: all " + std::to_string(members_.size()) +
                   " workers of round " + std::to_string(round_) + " finished");
}

void Driver::HandleExit(Worker& w, int code) {
  std::string rank = LabelOf(w.slot);
  log_.Write("worker_exited", {{"slot", w.slot}, {"code", int64_t{code}}, {"rank", rank},
                               {"status", w.proc->DescribeExit()}});
  bool member = MemberRank(w.slot) >= 0;
  if (shutting_down_) return;
  if (w.removed || !member) {
    spdlog::info("worker {} (slot {}) left after scale-down: {}", rank, w.slot, w.proc->DescribeExit());
    return;
  }
  if (code == 0) {
    if (!finishing_) spdlog::info("worker {} finished; the job is finishing", rank);
    finishing_ = true;
    CheckFinished();
    return;
  }
  if (w.dropped) {  // the driver already gave up on it (join timeout, lost)
    return;
  }
  ++failures_;
  std::string what = "worker " + rank + " (slot " + w.slot + ", host " + w.host + ") failed: " +
                     w.proc->DescribeExit();
  if (!opts_.elastic || finishing_) {
    Terminate(code, what);
    return;
  }
  spdlog::warn("{}; recovering", what);
  w.dropped = true;
  round_broken_ = true;
  recovery_start_ = SteadyClock::now();
  recovering_ = true;
  log_.Write("worker_lost", {{"slot", w.slot}, {"rank", rank}, {"phase", "detect"}});
  // Fail the survivors' collectives at once (a silent peer would otherwise cost a timeout).
  for (const auto& slot : members_) {
    if (slot != w.slot) core_->events().Publish(slot, Event{EventKind::kAbort, round_, what});
  }
  log_.Write("recovery_phase", {{"phase", "fence"},
                                {"seconds", Secs(SteadyClock::now() - recovery_start_)}});
  if (hosts_.RecordFailure(w.host)) {
    spdlog::warn("host {} is blacklisted{}", w.host,
                 hosts_.LastCooldown() == Duration::max()
                     ? ""
                     : fmt::format(" for {:.1f} s", Secs(hosts_.LastCooldown())));
    log_.Write("host_blacklisted", {{"host", w.host}});
  }
  holders_.erase(w.slot);
  if (opts_.max_failures >= 0 && failures_ > opts_.max_failures) {
    Terminate(1, what + "; too many failures (--max-failures " + std::to_string(opts_.max_failures) + ")");
    return;
  }
  Replan("worker " + rank + " failed");
}

void Driver::HandleReport(const rendezvous::Report& r) {
  auto it = workers_.find(r.slot);
  if (it == workers_.end()) return;
  switch (r.kind) {
    case rendezvous::ReportKind::kFinished: it->second.finished = true; break;
    case rendezvous::ReportKind::kFailed:
      spdlog::warn("slot {} reports a failure: {}", r.slot, r.message);
      break;
    case rendezvous::ReportKind::kLeaving: it->second.removed = true; break;
    case rendezvous::ReportKind::kCommitted:
      if (!first_commit_logged_ && r.round == formed_) {
        first_commit_logged_ = true;
        if (recovering_) {
          // The worker's own phases (durations) ride on its first commit report.
          double rebuild = 0, sync = 0;
          if (std::sscanf(r.message.c_str(), "rebuild=%lf sync=%lf", &rebuild, &sync) == 2) {
            log_.Write("recovery_phase", {{"phase", "rebuild"}, {"duration", rebuild}});
            log_.Write("recovery_phase", {{"phase", "sync"}, {"duration", sync}});
          }
          log_.Write("recovery_phase", {{"phase", "first_step"},
                                        {"seconds", Secs(SteadyClock::now() - recovery_start_)}});
          recovering_ = false;
        }
      }
      log_.Write("committed", {{"slot", r.slot}, {"round", r.round}, {"step", r.step},
                               {"epoch", r.epoch}, {"cursor", r.cursor}});
      break;
  }
}

void Driver::HandleDiscovery(Posted& p) {
  for (const auto& w : p.warnings) spdlog::warn("discovery: {}", w);
  if (!p.hosts->ok()) {
    spdlog::warn("discovery failed; keeping the last good host set: {}", p.hosts->status().message());
    log_.Write("discovery", {{"ok", false}, {"error", p.hosts->status().message()}});
    return;
  }
  const auto& listed = p.hosts->value();
  auto change = hosts_.Update(listed);
  last_listed_ = listed;
  for (const auto& h : listed) {
    if (std::find(last_listed_order_.begin(), last_listed_order_.end(), h.host) == last_listed_order_.end()) {
      last_listed_order_.push_back(h.host);
    }
  }
  if (change.empty()) return;
  std::vector<std::string> names;
  for (const auto& h : listed) names.push_back(h.host + ":" + std::to_string(h.slots));
  log_.Write("discovery", {{"hosts", names}, {"ok", true}});
  for (const auto& h : change.added) log_.Write("host_added", {{"host", h}});
  for (const auto& h : change.removed) log_.Write("host_removed", {{"host", h}});
  spdlog::info("hosts changed: +[{}] -[{}] ~[{}]", fmt::join(change.added, " "),
               fmt::join(change.removed, " "), fmt::join(change.changed, " "));
  scale_up_start_ = SteadyClock::now();
  Replan("hosts changed");
}

void Driver::HandlePosted(Posted& p) {
  switch (p.kind) {
    case Posted::kRoundFormed: {
      if (p.round != round_) break;
      formed_ = p.round;
      started_ = true;
      holders_.clear();
      for (const auto& s : members_) {
        holders_.insert(s);
        workers_[s].ever_joined = true;
      }
      first_commit_logged_ = false;
      spdlog::info("round {} formed with {} worker(s)", p.round, members_.size());
      log_.Write("round_formed", {{"round", p.round}, {"members", members_}});
      if (recovering_) {
        log_.Write("recovery_phase", {{"phase", "rendezvous"},
                                      {"seconds", Secs(SteadyClock::now() - recovery_start_)}});
      }
      break;
    }
    case Posted::kJoinTimeout: {
      if (p.round != round_ || shutting_down_) break;
      spdlog::warn("round {}: slot(s) [{}] did not join within {:.0f} s; dropping them", p.round,
                   fmt::join(p.slots, " "), Secs(opts_.rendezvous_timeout));
      for (const auto& slot : p.slots) {
        Worker& w = workers_[slot];
        if (w.proc && !w.proc->reaped()) w.proc->SignalGroup(SIGKILL);
        w.dropped = true;
        holders_.erase(slot);
        ++failures_;
        hosts_.RecordFailure(w.host);
      }
      round_broken_ = true;
      members_.erase(std::remove_if(members_.begin(), members_.end(),
                                    [&](const std::string& s) {
                                      return std::find(p.slots.begin(), p.slots.end(), s) != p.slots.end();
                                    }),
                     members_.end());
      Replan("slots did not join");
      break;
    }
    case Posted::kReport: HandleReport(p.report); break;
    case Posted::kWatchClosed: {
      auto it = workers_.find(p.slots[0]);
      // A remote worker whose stream breaks while its launcher runs may be lost (host gone):
      // unless the launcher exits (or the stream re-opens) within a moment, it is killed.
      if (it != workers_.end() && !it->second.local && !it->second.finished &&
          it->second.proc && !it->second.proc->reaped() && !shutting_down_) {
        it->second.lost_at = SteadyClock::now() + std::chrono::seconds(3);
      }
      break;
    }
    case Posted::kWatchOpened: {
      auto it = workers_.find(p.slots[0]);
      if (it != workers_.end()) it->second.lost_at = TimePoint::max();
      break;
    }
    case Posted::kDiscovery: HandleDiscovery(p); break;
  }
}

void Driver::Loop() {
  std::vector<char> buf(65536);
  while (true) {
    // Done when shutting down and every process is reaped.
    bool any_running = false;
    for (auto& [slot, w] : workers_) {
      if (w.proc && !w.proc->reaped()) any_running = true;
    }
    if (shutting_down_ && !any_running) return;

    std::vector<pollfd> fds = {{signal_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    struct Ref {
      Worker* w;
      int what;  // 1 stdout, 2 stderr, 3 exit
    };
    std::vector<Ref> refs = {{nullptr, 0}, {nullptr, 0}};
    for (auto& [slot, w] : workers_) {
      if (!w.proc || w.proc->reaped()) continue;
      if (w.proc->stdout_fd() >= 0) {
        fds.push_back({w.proc->stdout_fd(), POLLIN, 0});
        refs.push_back({&w, 1});
      }
      if (w.proc->stderr_fd() >= 0) {
        fds.push_back({w.proc->stderr_fd(), POLLIN, 0});
        refs.push_back({&w, 2});
      }
      fds.push_back({w.proc->pidfd(), POLLIN, 0});
      refs.push_back({&w, 3});
    }
    TimePoint now = SteadyClock::now();
    TimePoint next = std::min({kill_at_, wait_until_, now + std::chrono::seconds(1)});
    for (auto& [slot, w] : workers_) {
      if (w.proc && !w.proc->reaped()) next = std::min(next, w.lost_at);
    }
    const TimePoint cooldown_end = hosts_.NextCooldownEnd();
    if (!shutting_down_) next = std::min(next, cooldown_end);
    int timeout_ms = static_cast<int>(std::max<int64_t>(
        0, std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count() + 1));
    int n = poll(fds.data(), fds.size(), timeout_ms);
    if (n < 0 && errno != EINTR) {
      Terminate(1, std::string("poll failed: ") + strerror(errno));
      return;
    }
    if (fds[0].revents & POLLIN) {
      signalfd_siginfo si;
      if (read(signal_fd_, &si, sizeof si) == sizeof si) {
        int sig = static_cast<int>(si.ssi_signo);
        if (shutting_down_) {
          kill_at_ = SteadyClock::now();  // a second signal: no more grace
        } else {
          spdlog::warn("received {}; stopping the job", strsignal(sig));
          Terminate(128 + sig, std::string("stopped by ") + strsignal(sig));
        }
      }
    }
    if (fds[1].revents & POLLIN) {
      uint64_t count;
      ssize_t ignored = read(wake_fd_, &count, sizeof count);
      (void)ignored;
      std::deque<Posted> batch;
      {
        std::lock_guard<std::mutex> g(post_mu_);
        batch.swap(posted_);
      }
      for (auto& p : batch) HandlePosted(p);
    }
    for (size_t i = 2; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      Worker& w = *refs[i].w;
      if (!w.proc) continue;
      if (refs[i].what == 3) {
        int code = 0;
        if (!w.proc->TryReap(&code)) continue;
        // Drain what the worker wrote before it died, so no output line is lost.
        for (int stream : {1, 2}) {
          int fd = stream == 1 ? w.proc->stdout_fd() : w.proc->stderr_fd();
          if (fd < 0) continue;
          ssize_t got;
          while ((got = read(fd, buf.data(), buf.size())) > 0) {
            out_.Feed(w.slot, stream, buf.data(), static_cast<size_t>(got), LabelOf(w.slot));
          }
          out_.Finish(w.slot, stream, LabelOf(w.slot));
        }
        w.proc->CloseStdout();
        w.proc->CloseStderr();
        HandleExit(w, code);
        continue;
      }
      int fd = refs[i].what == 1 ? w.proc->stdout_fd() : w.proc->stderr_fd();
      if (fd < 0) continue;
      ssize_t got = read(fd, buf.data(), buf.size());
      if (got > 0) {
        out_.Feed(w.slot, refs[i].what, buf.data(), static_cast<size_t>(got), LabelOf(w.slot));
      } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
        out_.Finish(w.slot, refs[i].what, LabelOf(w.slot));
        if (refs[i].what == 1) {
          w.proc->CloseStdout();
        } else {
          w.proc->CloseStderr();
        }
      }
    }
    now = SteadyClock::now();
    if (shutting_down_ && now >= kill_at_) {
      for (auto& [slot, w] : workers_) {
        if (w.proc && !w.proc->reaped()) {
          w.proc->SignalGroup(SIGKILL);
          // A worker that ignores its closed pipes still goes: stop waiting for its output.
          w.proc->CloseStdout();
          w.proc->CloseStderr();
        }
      }
      kill_at_ = TimePoint::max();
    }
    if (!shutting_down_ && now >= wait_until_) {
      wait_until_ = TimePoint::max();
      bool none = hosts_.Available().empty();
      std::string what = std::string("timed out waiting for ") +
                         (started_ ? "--min-np " + std::to_string(opts_.min_np)
                                   : "-np " + std::to_string(opts_.np)) +
                         " workers";
      Terminate(1, none ? "no hosts left (every listed host is gone or blacklisted); " + what
                        : what);
    }
    if (!shutting_down_ && now >= cooldown_end) Replan("a blacklist cooldown ended");
    for (auto& [slot, w] : workers_) {
      if (w.proc && !w.proc->reaped() && now >= w.lost_at && !shutting_down_) {
        spdlog::warn("lost contact with slot {}; killing its launcher", slot);
        log_.Write("worker_lost", {{"slot", slot}, {"reason", "watch stream broke"}});
        w.lost_at = TimePoint::max();
        w.proc->SignalGroup(SIGKILL);
      }
    }
  }
}

int Driver::Run() {
  Status s = Start();
  if (!s.ok()) {
    spdlog::error("{}", s.message());
    if (server_) server_->Shutdown(std::chrono::seconds(1));
    return s.code() == Code::kInvalidArgument ? 2 : 1;
  }
  Replan("start");
  Loop();
  {
    std::lock_guard<std::mutex> g(disc_mu_);
    disc_stop_ = true;
  }
  disc_cv_.notify_all();
  if (discovery_.joinable()) discovery_.join();
  server_->Shutdown(std::chrono::seconds(1));
  if (exit_code_ == 0) {
    spdlog::info("elastic-run: {}", final_message_);
  } else {
    spdlog::error("elastic-run: {} (exit {})", final_message_, exit_code_);
  }
  log_.Write("job_ended", {{"code", int64_t{exit_code_}}, {"message", final_message_}});
  return exit_code_;
}

}  // namespace

int RunDriver(const DriverOptions& options) {
  Driver d(options);
  return d.Run();
}

}  // namespace elastic::driver
