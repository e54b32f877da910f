// The driver's start-up, launching, stack dumps and the carrying out of the policy's actions.
// One thread owns all state: driver_loop.cc's event loop polls worker pipes and pidfds, a
// signalfd, and an eventfd through which the rendezvous and discovery threads post events;
// driver_resume.cc keeps the journal (--state-dir) and adopts a job's running workers.
// Membership decisions are in policy.cc.
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/inotify.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>

#include "common/mutex.h"
#include "driver/events.h"
#include "driver/driver_internal.h"
#include "driver/launch.h"

namespace elastic::driver {

void BlockDriverSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGCHLD);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  signal(SIGPIPE, SIG_IGN);
}

namespace internal {

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

// mkdir -p
Status MakeDirs(const std::string& path) {
  for (size_t pos = 1; pos != std::string::npos;) {
    pos = path.find('/', pos + 1);
    std::string prefix = path.substr(0, pos);
    struct stat st;
    if (stat(prefix.c_str(), &st) == 0) {
      if (!S_ISDIR(st.st_mode)) return InvalidArgument(prefix + " exists and is not a folder");
      continue;
    }
    if (mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return InvalidArgument("cannot create " + prefix + ": " + strerror(errno));
    }
  }
  return Status::Ok();
}

// Removes a spool folder: <dir>/<slot>/{stdout,stderr}, nothing deeper (OutputMux::WorkerFile).
void RemoveSpool(const std::string& dir) {
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      std::string name = e->d_name;
      if (name == "." || name == "..") continue;
      std::string sub = dir + "/" + name;
      unlink((sub + "/stdout").c_str());
      unlink((sub + "/stderr").c_str());
      rmdir(sub.c_str());
    }
    closedir(d);
  }
  rmdir(dir.c_str());
}

Status Driver::Start() {
  RETURN_IF_ERROR(log_.Open(opts_.event_log));
  if (!opts_.output_dir.empty()) {
    Status made = MakeDirs(opts_.output_dir);
    if (!made.ok()) return made.WithContext("--output-dir " + opts_.output_dir);
  }
  // A job killed whole (driver and workers) leaves its workers' host segments in /dev/shm.
  if (int n = RemoveStaleShmSegments(); n > 0) {
    spdlog::info("removed {} shared-memory segment(s) of workers that are gone from /dev/shm", n);
  }
  if (!opts_.state_store.empty()) {
    RETURN_IF_ERROR(TakeLeadership());
    if (standby_ended_) return Status::Ok();
  }
  if (!opts_.state_dir.empty()) RETURN_IF_ERROR(OpenStateDir());
  token_ = resume_ ? resume_->token : RandomToken();
  RETURN_IF_ERROR(SetUpOutput());
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
  // With checkpoints, a round in which nobody holds a commit forms: its rank 0 loads the newest
  // checkpoint, and the policy ends the job only when there is none (Policy::OnReport).
  co.start_over_if_state_lost = opts_.start_over_if_state_lost || !opts_.checkpoint_dir.empty();
  core_ = std::make_unique<rendezvous::Core>(co);
  if (resume_) RETURN_IF_ERROR(core_->Restore(resume_->core));
  // The first host set: static, or the first discovery run (whose failure is fatal). A driver
  // that adopts a job has the host table of the one before: discovery runs on in a second.
  std::vector<HostSlots> initial = opts_.hosts;
  if (!opts_.discovery_script.empty() && !resume_) {
    std::vector<std::string> warnings;
    auto found = discovery::Discover(opts_.discovery_script, opts_.discovery_timeout,
                                     opts_.discovery_max_output, opts_.slots_per_host, &warnings);
    for (const auto& w : warnings) spdlog::warn("discovery: {}", w);
    if (!found.ok()) return found.status().WithContext("the first host discovery failed");
    initial = *found;
  }
  bool all_local = std::all_of(initial.begin(), initial.end(),
                               [](const HostSlots& h) { return IsLocalHost(h.host); });
  RETURN_IF_ERROR(StartServer(all_local));
  if (leadership_) {
    // Workers that lose their driver look this address up (worker_agent/agent.cc).
    Status said = leadership_->Announce(driver_addr_);
    if (!said.ok()) return said.WithContext("--state-store");
    leadership_->KeepAlive([this](const std::string&) {
      uint64_t one = 1;  // Loop sees it (Leads) at its next turn
      if (write(wake_fd_, &one, sizeof one) < 0) {
      }
    });
    const auto& endpoints = leadership_->store().url().endpoints;
    const bool local_store = std::any_of(endpoints.begin(), endpoints.end(),
                                         [](const std::string& e) { return IsLoopback(e); });
    if (opts_.drivers > 1 && local_store) {
      spdlog::warn("--drivers {}: --state-store {} names this machine's loopback, which standbys "
                   "on other hosts cannot reach; none is started (give etcd's address on the "
                   "network)",
                   opts_.drivers, opts_.state_store);
    } else if (opts_.drivers > 1) {
      StandbyPlacer::Options po;
      po.drivers = opts_.drivers;
      po.ttl_seconds = opts_.lease_ttl;
      po.own_address = driver_addr_.substr(0, driver_addr_.rfind(':'));
      po.log_dir = opts_.state_dir;
      po.list = [this] { return ListStandbys(leadership_->store()); };
      po.counted = [this](const std::vector<StandbyView>& waiting) {
        std::vector<Monitor::Standby> seen;
        for (const auto& s : waiting) seen.push_back({s.address, s.host, s.pid});
        monitor_.SetStandbys(opts_.drivers - 1, std::move(seen));
      };
      monitor_.SetStandbys(opts_.drivers - 1, {});
      po.launch = [this](const std::string& host, const std::function<bool()>& stop) {
        return LaunchStandby(host, stop);
      };
      po.stop = [this](const std::string& host, int64_t pid, const std::function<bool()>& stop) {
        auto out = RunLauncher(LauncherArgv(host, StopStandbyScript(pid)), "",
                               StandbyPlacer::kLaunchDeadline, stop);
        return out.ok() ? Status::Ok() : out.status();
      };
      // Looked up once per name (the placer's thread alone calls it).
      po.is_this_machine = [cache = std::make_shared<std::map<std::string, bool>>()](
                               const std::string& host) {
        auto it = cache->find(host);
        if (it == cache->end()) it = cache->emplace(host, IsThisMachine(host)).first;
        return it->second;
      };
      placer_ = std::make_unique<StandbyPlacer>(std::move(po));
    }
  }
  if (resume_) {
    Adopt();
  } else {
    policy_->Start(initial);
  }
  if (!opts_.discovery_script.empty()) discovery_ = std::thread([this] { DiscoveryLoop(); });
  return Status::Ok();
}

Status Driver::SetUpOutput() {
  // Local workers write their output to files this driver follows (inotify), which outlive
  // it: a worker that rides out a lost driver (--driver-timeout) is never harmed by a pipe
  // whose reader is gone. Under --output-dir, else a folder of this job's own (in
  // --state-dir, where a driver that adopts the job finds them).
  if (opts_.output_dir.empty() && !opts_.state_dir.empty()) {
    spool_dir_ = opts_.state_dir + "/output";
    if (mkdir(spool_dir_.c_str(), 0700) != 0 && errno != EEXIST) {
      return InvalidArgument("--state-dir: cannot create " + spool_dir_ + ": " + strerror(errno));
    }
    out_.SetSpoolDir(spool_dir_);
  } else if (opts_.output_dir.empty()) {
    std::string jobs = DefaultJobDir();
    mkdir(jobs.c_str(), 0700);
    spool_dir_ = jobs + "/" + std::to_string(getpid()) + ".output";
    if (mkdir(spool_dir_.c_str(), 0700) != 0 && errno != EEXIST) {
      spdlog::warn(
          "cannot create {} ({}): worker output goes through pipes, and a worker "
          "writing after this driver is gone gets EPIPE",
          spool_dir_, strerror(errno));
      spool_dir_.clear();
    }
    out_.SetSpoolDir(spool_dir_);
  }
  inotify_fd_ = inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
  if (inotify_fd_ < 0) {
    spdlog::warn("inotify: {}; worker output goes through pipes", strerror(errno));
  } else if (!out_.files_dir().empty()) {
    spdlog::info("worker output is kept in {}/<slot>/stdout and stderr (it outlives this driver)",
                 out_.files_dir());
  }
  return Status::Ok();
}

Status Driver::ChooseTls(const std::string& bind) {
  bool on;
  if (resume_) {  // the workers that still run dial as they were told at their launch
    on = !resume_->tls.server.empty();
    if ((opts_.tls == "on" && !on) || (opts_.tls == "off" && on)) {
      spdlog::warn("--tls {} is not what the adopted job runs: its workers speak {}; keeping "
                   "that (pass --fresh to start the job afresh with --tls {})",
                   opts_.tls, on ? "TLS" : "plain text", opts_.tls);
    }
  } else {
    on = opts_.tls == "on" || (opts_.tls == "auto" && !IsLoopback(bind));
  }
  // Beyond loopback, /metrics and /status need the job's TLS. A new job without it is refused;
  // a driver that adopts such a job (a standby's options may differ from its leader's) must
  // not leave it for that, and serves them on loopback.
  if (!on && opts_.metrics_port >= 0 && !IsLoopback(opts_.metrics_address)) {
    if (resume_) {
      spdlog::warn("--metrics-address {}: the adopted job runs without TLS, and /metrics and "
                   "/status are served beyond loopback only with it; serving them on 127.0.0.1",
                   opts_.metrics_address);
      opts_.metrics_address = "127.0.0.1";
    } else {
      return InvalidArgument("--metrics-address " + opts_.metrics_address +
                             " is beyond loopback, where /metrics and /status are served only "
                             "over TLS with the job token, and TLS is off; give --tls on, or a "
                             "loopback --metrics-address (the default, 127.0.0.1)");
    }
  }
  if (resume_) {
    tls_ = resume_->tls;
    return Status::Ok();
  }
  if (!on) {
    if (!IsLoopback(bind)) {
      spdlog::warn("--tls off: the job token and the job's state cross the network in clear");
    }
    return Status::Ok();
  }
  // Valid for ten years: the CA's key is gone once they are signed, so they can never be
  // renewed, and a job must not stop for it.
  auto made = MakeJobCredentials(std::chrono::hours(24 * 3650));
  if (!made.ok()) return made.status().WithContext("--tls " + opts_.tls);
  tls_ = *std::move(made);
  return Status::Ok();
}

Status Driver::StartServer(bool all_local) {
  std::string host = opts_.driver_address;
  if (host.empty()) {
    char name[256] = {0};
    gethostname(name, sizeof name - 1);
    host = all_local ? "127.0.0.1" : name;
  }
  rendezvous::ServerOptions so;
  so.bdp_probe = opts_.grpc_bdp_probe;
  // Listen where the workers dial: on loopback alone when they dial a loopback address (every
  // host is this machine), on --driver-address when it is an IPv4 address, else everywhere.
  in_addr numeric;
  std::string bind = "0.0.0.0";
  if (IsLoopback(host)) {
    bind = "127.0.0.1";
  } else if (inet_pton(AF_INET, host.c_str(), &numeric) == 1) {
    bind = host;
  }
  if (resume_ && !leadership_) {  // where the workers dial (with a store, they look it up)
    bind = resume_->bind;
    host = resume_->driver_addr.substr(0, resume_->driver_addr.rfind(':'));
  }
  bind_ = bind;
  RETURN_IF_ERROR(ChooseTls(bind));
  so.address = bind + ":" + std::to_string(resume_ && !leadership_ ? resume_->port : opts_.port);
  so.token = token_;
  so.tls = tls_.server;
  so.keepalive_time = so.keepalive_timeout = opts_.liveness_timeout / 3;
  so.status_json = [this] { return monitor_.StatusJson(); };
  auto server = rendezvous::Server::Start(core_.get(), so);
  if (!server.ok()) {
    if (resume_) {
      return server.status().WithContext(
          "cannot listen again on " + so.address +
          ", where the journal's workers dial (is "
          "another process on the port?); pass --fresh to start the job afresh");
    }
    if (opts_.port != 0) {  // the user's choice: a bad argument
      return InvalidArgument("--port " + std::to_string(opts_.port) + ": " +
                             server.status().message());
    }
    return server.status();
  }
  server_ = std::move(server).value();
  driver_addr_ = host + ":" + std::to_string(server_->port());
  spdlog::info("rendezvous server on {}:{}; workers dial {} ({})", bind, server_->port(),
               driver_addr_,
               tls_.server.empty() ? "plain text" : "mutual TLS with the job's own CA");
  return PublishJob(host);
}

Status Driver::PublishJob(const std::string& host) {
  // `elastic-run status` finds the job through this file (address and token, mode 0600).
  job_file_ = opts_.job_file.empty() ? DefaultJobDir() + "/" + std::to_string(getpid()) + ".json"
                                     : opts_.job_file;
  Status wrote = WriteJobFile(job_file_, driver_addr_, token_, tls_.client);
  if (!wrote.ok()) {
    job_file_.clear();
    if (!opts_.job_file.empty()) return wrote.WithContext("--job-file");
    spdlog::warn("{}; `elastic-run status` cannot find this job", wrote.message());
  } else {
    spdlog::debug("job file {} (for `elastic-run status`)", job_file_);
  }
  if (opts_.metrics_port >= 0) {
    const std::string& at = opts_.metrics_address;
    // Beyond loopback, /metrics and /status tell the job's state to whoever asks: only over
    // the job's TLS, to a client with its certificate and the token (docs/security.md).
    MetricsAccess access;
    if (!IsLoopback(at)) access = MetricsAccess{tls_.server, token_};
    auto metrics = MetricsServer::Start(&monitor_, at, opts_.metrics_port, access);
    if (!metrics.ok()) return metrics.status();
    metrics_ = std::move(metrics).value();
    spdlog::info("metrics on {}://{}:{}/metrics{}", access.tls.empty() ? "http" : "https",
                 at == "0.0.0.0" ? host : at, metrics_->port(),
                 access.tls.empty() ? ""
                                    : " (a client certificate of the job's CA and the job token "
                                      "required: `elastic-run credentials` writes them)");
  }
  return Status::Ok();
}

void Driver::DiscoveryLoop() {
  while (true) {
    {
      MutexLock l(disc_mu_);
      if (disc_cv_.wait_for(l.native(), opts_.discovery_interval,
                            [&]() ELASTIC_REQUIRES(disc_mu_) { return disc_stop_; }))
        return;
    }
    Posted p{Posted::kDiscovery};
    p.hosts = discovery::Discover(opts_.discovery_script, opts_.discovery_timeout,
                                  opts_.discovery_max_output, opts_.slots_per_host, &p.warnings);
    monitor_.OnDiscoveryRun(p.hosts->ok());
    Post(std::move(p));
  }
}

void Driver::Launch(Worker& w, bool spare) {
  // Each launch gets its own id: the rendezvous refuses a Join from any other process that
  // claims the slot (a stray copy, a stale process from an earlier launch).
  std::string worker_id = RandomToken().substr(0, 16);
  core_->SetWorkerId(w.slot, worker_id);
  w.worker_id = worker_id;
  w.remote = RemoteWorker{};
  w.header_done = w.local;
  w.header.clear();
  w.relayed[1] = w.relayed[2] = 0;
  w.attached = false;
  w.exit_note.clear();
  std::map<std::string, std::string> env = {
      {"ELASTIC_DRIVER_ADDR", driver_addr_},
      {"ELASTIC_WORKER_ID", worker_id},
      {"ELASTIC_JOB_TOKEN", token_},
      {"ELASTIC_SLOT", w.slot},
      {"ELASTIC_HOSTNAME", w.host},
      {"ELASTIC_IFACE", opts_.network_interface},
      {"ELASTIC_BACKEND", opts_.backend},
      {"ELASTIC_SHM_ALLREDUCE", opts_.shm_allreduce ? "1" : "0"},
      {"ELASTIC_DRIVER_TIMEOUT",
       fmt::format("{}", std::chrono::duration<double>(opts_.driver_timeout).count())},
      {"PYTHONUNBUFFERED", "1"}};
  if (!tls_.client.empty()) env["ELASTIC_JOB_TLS"] = EncodeTlsIdentity(tls_.client);
  if (spare) env["ELASTIC_SPARE"] = "1";
  if (!opts_.state_store.empty()) env["ELASTIC_STATE_STORE"] = opts_.state_store;
  if (!opts_.state_store_tls.empty()) {
    env["ELASTIC_STATE_STORE_TLS"] = EncodeTlsIdentity(opts_.state_store_tls);
  }
  if (!opts_.checkpoint_dir.empty()) {
    env["ELASTIC_CHECKPOINT_DIR"] = opts_.checkpoint_dir;
    env["ELASTIC_CHECKPOINT_INTERVAL"] =
        fmt::format("{}", std::chrono::duration<double>(opts_.checkpoint_interval).count());
    env["ELASTIC_CHECKPOINT_KEEP"] = std::to_string(opts_.checkpoint_keep);
  }
  LaunchSpec spec;
  spec.env = env;
  if (w.local) {
    spec.argv = opts_.command;
    // With a journal, a driver may adopt the worker: its keeper tells that one how it ended.
    spec.status_dir = exits_dir_;
    if (inotify_fd_ >= 0 && !out_.files_dir().empty()) {
      spec.stdout_file = out_.WorkerFile(w.slot, 1);
      spec.stderr_file = out_.WorkerFile(w.slot, 2);
    }
  } else {
    if (IsLoopback(driver_addr_) && !warned_loopback_) {
      warned_loopback_ = true;
      spdlog::warn(
          "remote slot {} will dial the driver at {}, a loopback address; pass "
          "--driver-address with an address the hosts can reach",
          w.slot, driver_addr_);
    }
    char cwd[4096] = {0};
    // The job token and TLS credentials never appear on a command line (`ps` shows those to
    // every user): the remote script reads them from the launcher's stdin, its first three
    // lines (the job's TLS, then etcd's; each empty when there is none). The stdin then stays open for the worker's life:
    // its closing is how the remote side learns that the driver or the launcher is gone, and
    // ends the worker (driver/launch.h).
    spec.stdin_data = token_ + "\n" + EncodeTlsIdentity(tls_.client) + "\n" +
                      EncodeTlsIdentity(opts_.state_store_tls) + "\n";
    spec.keep_stdin_open = true;
    for (const char* secret :
         {"ELASTIC_JOB_TOKEN", "ELASTIC_JOB_TLS", "ELASTIC_STATE_STORE_TLS"}) {
      spec.env.erase(secret);
      env.erase(secret);
    }
    int grace = static_cast<int>(
        std::max<int64_t>(1, std::chrono::duration_cast<std::chrono::seconds>(opts_.grace).count()));
    std::string remote =
        RemoteScript(getcwd(cwd, sizeof cwd) ? cwd : "/", env, opts_.command, grace);
    spec.argv = LauncherArgv(w.host, remote);
  }
  auto proc = Process::Start(spec);
  if (!proc.ok()) {
    policy_->OnLaunchFailed(w.slot, proc.status());
    return;
  }
  w.proc = std::move(proc).value();
  w.start_ticks = ProcessStartTicks(w.proc->pid());
  if (w.proc->output_in_files()) {
    // Watched by inode: a later launch of the slot appends to the same files (same watch).
    for (const std::string& path : {spec.stdout_file, spec.stderr_file}) {
      if (inotify_add_watch(inotify_fd_, path.c_str(), IN_MODIFY) < 0) {
        spdlog::warn("inotify_add_watch({}): {}; its lines show up within a second", path,
                     strerror(errno));
      }
    }
  }
  spdlog::debug("started slot {} as pid {}", w.slot, w.proc->pid());
  policy_->OnLaunched(w.slot, w.proc->pid());
}

StatusOr<int64_t> Driver::LaunchStandby(const std::string& host,
                                         const std::function<bool()>& stop) {
  char exe[PATH_MAX] = {0}, cwd[PATH_MAX] = {0};
  ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) return Internal(std::string("readlink /proc/self/exe: ") + strerror(errno));
  exe[n] = '\0';
  const std::string program = exe;
  if (program.size() > 10 && program.compare(program.size() - 10, 10, " (deleted)") == 0) {
    return FailedPrecondition("this driver's program " + program.substr(0, program.size() - 10) +
                              " was replaced or removed since it started: a standby would run "
                              "another version");
  }
  // The driver's own settings from its environment, which a remote login does not have.
  std::map<std::string, std::string> env;
  for (const char* name : {"ELASTIC_LOG_LEVEL", "ELASTIC_SHM_ALLREDUCE", "ELASTIC_DRIVER_NICE",
                           "ELASTIC_GRPC_BDP_PROBE"}) {
    if (const char* v = getenv(name)) env[name] = v;
  }
  // The same program, folder and options on the host (as a worker's command), less what
  // names this machine alone; etcd's credentials on the launcher's stdin, never in argv.
  std::string script =
      StandbyScript(getcwd(cwd, sizeof cwd) ? cwd : "/", program,
                    StandbyArgv(opts_.argv, opts_.command.size(), host), opts_.state_dir,
                    StandbyLogPath(opts_.state_dir, host), env);
  ASSIGN_OR_RETURN(std::string out,
                   RunLauncher(LauncherArgv(host, script),
                               EncodeTlsIdentity(opts_.state_store_tls) + "\n",
                               StandbyPlacer::kLaunchDeadline, stop));
  return ParseStandbyPid(out);
}

std::vector<std::string> Driver::LauncherArgv(const std::string& host,
                                              const std::string& script) const {
  if (!opts_.launcher_template.empty()) {
    return {"/bin/sh", "-c", ExpandTemplate(opts_.launcher_template, host, ShellQuote(script))};
  }
  std::vector<std::string> argv = {"ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no"};
  if (opts_.ssh_port > 0) argv.insert(argv.end(), {"-p", std::to_string(opts_.ssh_port)});
  if (!opts_.ssh_identity_file.empty()) {
    argv.insert(argv.end(), {"-i", opts_.ssh_identity_file});
  }
  // ssh joins its remote words with spaces for the remote shell: one quoted word.
  argv.insert(argv.end(), {host, "sh -c " + ShellQuote(script)});
  return argv;
}

namespace {

// The dump itself, on its own thread: only the pid, the signal and the stop flag are shared
// with the loop. Returns what to print (the header lines included).
std::string RunStackDump(pid_t pid, int signal, const std::atomic<bool>& stop) {
  std::string text;
  auto say = [&](const std::string& line) { text += "[elastic-run] " + line + "\n"; };
  if (signal > 0) {
    kill(pid, signal);  // the worker prints its own stacks (Python: faulthandler)
    for (int i = 0; i < 6 && !stop; ++i) usleep(50 * 1000);
  }
  // Native stacks of every thread, from outside the process.
  std::vector<std::string> argv;
  if (FindProgram("eu-stack").ok()) {
    argv = {"eu-stack", "-p", std::to_string(pid)};
  } else if (FindProgram("gdb").ok()) {
    argv = {"gdb", "-p", std::to_string(pid), "-batch", "-nx", "-ex", "thread apply all bt"};
  } else {
    say("stacks not dumped: neither eu-stack (elfutils) nor gdb is installed");
    return text;
  }
  say("stacks of pid " + std::to_string(pid) + " (" + argv[0] + "):");
  LaunchSpec spec;
  spec.argv = argv;
  auto dumper = Process::Start(spec);
  if (!dumper.ok()) {
    say("stacks not dumped: " + dumper.status().message());
    return text;
  }
  Process& d = **dumper;
  TimePoint deadline = SteadyClock::now() + std::chrono::seconds(15);
  std::string out;
  char buf[8192];
  int code = 0;
  auto drain = [&](int fd) {
    ssize_t got;
    while (fd >= 0 && (got = read(fd, buf, sizeof buf)) > 0 && out.size() < (4u << 20)) {
      out.append(buf, static_cast<size_t>(got));
    }
  };
  while (!d.TryReap(&code) && SteadyClock::now() < deadline && !stop) {
    pollfd fds[3] = {{d.stdout_fd(), POLLIN, 0}, {d.stderr_fd(), POLLIN, 0}, {d.pidfd(), POLLIN, 0}};
    poll(fds, 3, 200);
    drain(d.stdout_fd());
    drain(d.stderr_fd());
  }
  const bool killed = !d.reaped();
  if (killed) {
    d.SignalGroup(SIGKILL);
    pollfd exit_fd{d.pidfd(), POLLIN, 0};
    while (!d.TryReap(&code)) poll(&exit_fd, 1, 100);
  }
  drain(d.stdout_fd());
  drain(d.stderr_fd());
  if (!out.empty() && out.back() != '\n') out += '\n';
  text += out;
  if (killed) {
    say(stop ? "the stack dump was stopped: the job is ending"
             : "the stack dump took over 15 s and was stopped");
  }
  return text;
}

}  // namespace

void Driver::DumpStacks(Worker& w, int signal) {
  std::string label = policy_->Label(w.slot);
  auto say = [&](const std::string& line) {
    std::string text = "[elastic-run] " + line + "\n";
    out_.Feed(w.slot, 2, text.data(), text.size(), label);
  };
  if (!w.proc || w.proc->reaped()) return;
  if (!w.local) {
    say("stacks not dumped: the worker runs on another host (" + w.host + ")");
    return;
  }
  if (dumps_.count(w.slot)) return;  // one at a time per slot
  auto dump = std::make_unique<StackDump>();
  pid_t pid = w.proc->pid();
  std::string slot = w.slot;
  StackDump* raw = dump.get();
  dump->pid = pid;
  dump->started = SteadyClock::now();
  dump->thread = std::thread([this, raw, pid, signal, slot] {
    Posted p{Posted::kStacksDumped};
    p.slots = {slot};
    p.text = RunStackDump(pid, signal, raw->stop);
    Post(std::move(p));
  });
  dumps_[slot] = std::move(dump);
}

void Driver::StacksDumped(const std::string& slot, const std::string& text) {
  auto it = dumps_.find(slot);
  if (it == dumps_.end()) return;
  it->second->thread.join();
  int held = it->second->held_signal;
  double seconds = std::chrono::duration<double>(SteadyClock::now() - it->second->started).count();
  log_.Write(events::kStacksDumped,
             {{"slot", slot}, {"pid", int64_t{it->second->pid}}, {"seconds", seconds}});
  dumps_.erase(it);
  auto w = workers_.find(slot);
  if (w == workers_.end()) return;
  out_.Feed(slot, 2, text.data(), text.size(), policy_->Label(slot));
  if (held != 0 && w->second.proc && !w->second.proc->reaped()) {
    w->second.proc->SignalGroup(held);
  }
}

void Driver::StopDumps() {
  for (auto& [slot, dump] : dumps_) dump->stop = true;
  for (auto& [slot, dump] : dumps_) {
    if (dump->thread.joinable()) dump->thread.join();
  }
  dumps_.clear();
}

void Driver::Perform() {
  for (std::vector<Action> actions; !(actions = policy_->TakeActions()).empty();) {
    // A round proposed is journalled before the workers can hear of it: a driver killed
    // between the two would otherwise leave a successor that takes the old round as the
    // current one while its members already join the new one. Proposed again by the next
    // driver (Policy::OnResumed), a round the workers never heard of costs nothing.
    bool proposes = std::any_of(actions.begin(), actions.end(), [](const Action& a) {
      return a.kind == Action::kProposeRound;
    });
    journal_due_ = true;
    if (proposes) MaybeWriteJournal();
    journal_due_ = true;  // and again after the launches, with their pids
    for (Action& a : actions) {
      switch (a.kind) {
        case Action::kProposeRound: {
          Status s = core_->ProposeRound(a.round, std::move(a.assignments), a.removed);
          if (!s.ok()) {
            policy_->Terminate(1, "internal error proposing round " + std::to_string(a.round) +
                                      ": " + s.ToString());
          }
          break;
        }
        case Action::kWithdrawRound:
          core_->WithdrawRound(a.round);
          break;
        case Action::kRestartWait:
          core_->RestartWait(a.slots);
          break;
        case Action::kPublish:
          core_->events().Publish(a.slot, a.event);
          break;
        case Action::kLaunch: {
          Worker& w = workers_[a.slot];
          if (w.slot.empty()) {
            w.slot = a.slot;
            w.host = rendezvous::Slot::Parse(a.slot).host;
            w.local = IsLocalHost(w.host);
          }
          Launch(w, a.spare);
          break;
        }
        case Action::kSignal:
          SignalWorker(a.slot, a.signal);
          break;
        case Action::kDumpStacks: {
          auto it = workers_.find(a.slot);
          if (it != workers_.end()) DumpStacks(it->second, a.signal);
          break;
        }
        case Action::kWriteEvent:
          log_.Write(a.name, a.fields);
          monitor_.OnEvent(a.name, a.fields);
          break;
        case Action::kLog: {
          static constexpr spdlog::level::level_enum kLevels[] = {
              spdlog::level::debug, spdlog::level::info, spdlog::level::warn,
              spdlog::level::err};
          spdlog::log(kLevels[a.level], "{}", a.message);
          break;
        }
      }
    }
  }
}

void Driver::SignalWorker(const std::string& slot, int signal) {
  auto it = workers_.find(slot);
  if (it == workers_.end() || !it->second.proc || it->second.proc->reaped()) return;
  auto dump = dumps_.find(slot);
  if (dump != dumps_.end()) {
    if (signal == SIGKILL && !policy_->shutting_down()) {
      // Its stacks are being dumped: it goes once the dump is done (StacksDumped).
      dump->second->held_signal = SIGKILL;
      return;
    }
    dump->second->stop = true;  // the job is ending: no dump holds it up
  }
  if (!it->second.local) {
    // The remote side ends the worker on this line (driver/launch.h) and the launch
    // then exits with it; a signal to the launcher alone would cut the connection
    // first, which a worker that rides out a lost driver outlives. SIGKILL (a grace
    // period after SIGTERM) also ends the launcher, for a host that does not answer.
    it->second.proc->WriteStdin("stop\n");
    if (signal != SIGKILL) return;
  }
  it->second.proc->SignalGroup(signal);
  if (signal == SIGKILL && policy_->shutting_down()) {
    // A worker that ignores its closed pipes still goes: stop waiting for its output.
    it->second.proc->CloseStdout();
    it->second.proc->CloseStderr();
  }
}

void Driver::HandlePosted(Posted& p) {
  switch (p.kind) {
    case Posted::kRoundFormed:
      policy_->OnRoundFormed(p.formed);
      break;
    case Posted::kStateLost:
      policy_->OnStateLost(p.formed);
      break;
    case Posted::kJoinTimeout:
      policy_->OnJoinTimeout(p.round, p.slots);
      break;
    case Posted::kMemberLeft:
      policy_->OnMemberLeft(p.round, p.slots[0]);
      break;
    case Posted::kReport:
      policy_->OnReport(p.report);
      break;
    case Posted::kWaitingForPlace:
      policy_->OnWaitingForPlace(p.slots[0]);
      break;
    case Posted::kWatchOpened:
      policy_->OnWatch(p.slots[0], true);
      if (reattach_pending_.erase(p.slots[0]) > 0) CheckReattached(false);
      break;
    case Posted::kWatchClosed:
      policy_->OnWatch(p.slots[0], false);
      break;
    case Posted::kDiscovery:
      policy_->OnDiscovery(*p.hosts, p.warnings);
      break;
    case Posted::kStacksDumped:
      StacksDumped(p.slots[0], p.text);
      break;
  }
}

int Driver::Run() {
  Status s = Start();
  if (s.ok() && standby_ended_) {
    const int code = standby_ended_->code;
    const std::string said = fmt::format(
        "standby: the job ended under another driver ({}; exit {}); nothing to take over",
        standby_ended_->message, code);
    if (code == 0) {
      spdlog::info("{}", said);
    } else {
      spdlog::error("{}", said);
    }
    return code;
  }
  if (!s.ok()) {
    spdlog::error("{}", s.message());
    metrics_.reset();
    if (server_) server_->Shutdown(std::chrono::seconds(1));
    if (!job_file_.empty()) unlink(job_file_.c_str());
    return s.code() == Code::kInvalidArgument ? 2 : 1;
  }
  Loop();
  placer_.reset();  // no standby is started for a job that ends
  CheckReattached(true);  // the job ended before every adopted worker was back
  StopDumps();
  {
    MutexLock g(disc_mu_);
    disc_stop_ = true;
  }
  disc_cv_.notify_all();
  if (discovery_.joinable()) discovery_.join();
  metrics_.reset();
  server_->Shutdown(std::chrono::seconds(1));
  if (!job_file_.empty()) unlink(job_file_.c_str());
  // Every worker is reaped and its output printed: the spool goes (--output-dir stays), and
  // the journal: the job is over, a driver started on the folder again starts a new one.
  if (!spool_dir_.empty()) RemoveSpool(spool_dir_);
  if (leadership_) {
    Status done = leadership_->Finish(policy_->exit_code(), policy_->final_message());
    if (!done.ok()) spdlog::warn("the state store: {}", done.message());
  }
  if (!opts_.state_dir.empty()) RemoveJournal(opts_.state_dir);
  RemoveKeptStatuses();
  // Again at the end: a job killed whole just before this driver started may still have been
  // dying at Start (a checkpoint soak, seed 895258539: a worker killed while it made its
  // host's segment was not gone yet when the driver started again 50 ms later).
  if (int n = RemoveStaleShmSegments(); n > 0) {
    spdlog::info("removed {} shared-memory segment(s) of workers that are gone from /dev/shm", n);
  }
  if (policy_->exit_code() == 0) {
    spdlog::info("elastic-run: {}", policy_->final_message());
  } else {
    spdlog::error("elastic-run: {} (exit {})", policy_->final_message(), policy_->exit_code());
  }
  log_.Write(events::kJobEnded,
             {{"code", int64_t{policy_->exit_code()}}, {"message", policy_->final_message()}});
  return policy_->exit_code();
}

}  // namespace internal

int RunDriver(const DriverOptions& options) {
  internal::Driver d(options);
  return d.Run();
}

}  // namespace elastic::driver
