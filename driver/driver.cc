// The driver's start-up, launching and event loop. One thread owns all state: it polls
// worker pipes and pidfds, a signalfd, and an eventfd through which the rendezvous and
// discovery threads post events. Membership decisions are in policy.cc.
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

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>

#include "common/mutex.h"
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
  if (!opts_.state_dir.empty()) RETURN_IF_ERROR(OpenStateDir());
  token_ = resume_ ? resume_->token : RandomToken();
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
  if (host == "localhost" || host.rfind("127.", 0) == 0) {
    bind = "127.0.0.1";
  } else if (inet_pton(AF_INET, host.c_str(), &numeric) == 1) {
    bind = host;
  }
  if (resume_) {  // where the workers dial
    bind = resume_->bind;
    host = resume_->driver_addr.substr(0, resume_->driver_addr.rfind(':'));
  }
  bind_ = bind;
  so.address = bind + ":" + std::to_string(resume_ ? resume_->port : opts_.port);
  so.token = token_;
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
  spdlog::info("rendezvous server on {}:{}; workers dial {}", bind, server_->port(), driver_addr_);
  // `elastic-run status` finds the job through this file (address and token, mode 0600).
  job_file_ = opts_.job_file.empty() ? DefaultJobDir() + "/" + std::to_string(getpid()) + ".json"
                                     : opts_.job_file;
  Status wrote = WriteJobFile(job_file_, driver_addr_, token_);
  if (!wrote.ok()) {
    job_file_.clear();
    if (!opts_.job_file.empty()) return wrote.WithContext("--job-file");
    spdlog::warn("{}; `elastic-run status` cannot find this job", wrote.message());
  } else {
    spdlog::debug("job file {} (for `elastic-run status`)", job_file_);
  }
  if (opts_.metrics_port >= 0) {
    auto metrics = MetricsServer::Start(&monitor_, "0.0.0.0", opts_.metrics_port);
    if (!metrics.ok()) return metrics.status();
    metrics_ = std::move(metrics).value();
    spdlog::info("metrics on http://{}:{}/metrics", host, metrics_->port());
  }
  if (resume_) {
    Adopt();
  } else {
    policy_->Start(initial);
  }
  if (!opts_.discovery_script.empty()) discovery_ = std::thread([this] { DiscoveryLoop(); });
  return Status::Ok();
}

Status Driver::OpenStateDir() {
  auto lock = LockStateDir(opts_.state_dir);
  if (!lock.ok()) return lock.status().WithContext("--state-dir");
  state_lock_fd_ = *lock;
  auto journal = ReadJournal(opts_.state_dir);
  if (!journal.ok() && journal.status().code() == Code::kNotFound) return Status::Ok();
  if (!journal.ok()) {
    if (!opts_.fresh) {
      return journal.status().WithContext(
          "--state-dir: the journal cannot be read; pass --fresh to start the job afresh "
          "(its workers, if any still run, then exit by --driver-timeout)");
    }
    spdlog::warn("--fresh: not reading the damaged journal ({})", journal.status().message());
    RemoveJournal(opts_.state_dir);
    return Status::Ok();
  }
  std::vector<std::string> running;
  for (const auto& [slot, w] : journal->workers) {
    if (StillRunning(w)) running.push_back(slot);
  }
  if (opts_.fresh) {
    for (const auto& slot : running) {
      const JournalWorker& w = journal->workers.at(slot);
      // A remote worker's pid is of its host: it exits when its Watch is refused (another
      // token) or past --driver-timeout.
      if (w.local) kill(-w.pid, SIGKILL);
    }
    spdlog::warn("--fresh: not resuming the job in {}{}; starting afresh", opts_.state_dir,
                 running.empty() ? ""
                                 : fmt::format(" (its {} worker(s) still running were killed: "
                                               "{})",
                                               running.size(), fmt::join(running, " ")));
    RemoveJournal(opts_.state_dir);
    return Status::Ok();
  }
  if (journal->argv != opts_.argv) {
    return InvalidArgument(fmt::format(
        "--state-dir {} holds the journal of another command line (`{}`); run that one to "
        "resume its job, pass --fresh to start this one there, or use another folder",
        opts_.state_dir, fmt::join(journal->argv, " ")));
  }
  double ago =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count() -
      journal->written_at;
  if (running.empty()) {
    spdlog::warn(
        "the journal in {} is of a job whose workers are all gone (its driver died {:.0f} s "
        "ago; workers wait --driver-timeout for it); starting the job afresh from round 0{}",
        opts_.state_dir, ago,
        opts_.checkpoint_dir.empty() ? ""
                                     : ", from the newest checkpoint in " + opts_.checkpoint_dir);
    log_.Write("driver_resumed", {{"resumed", false},
                                  {"outage_seconds", ago},
                                  {"reason", "every worker of the journal is gone"}});
    RemoveJournal(opts_.state_dir);
    return Status::Ok();
  }
  // The policy's state is checked here, before anything of the job is touched: one that does
  // not load is a damaged journal (exit 2), and its workers ride on.
  auto state = LoadPolicyState(journal->policy, SteadyClock::now());
  if (!state.ok()) {
    return state.status().WithContext(
        "--state-dir: the journal cannot be read; pass --fresh to start the job afresh (its "
        "workers, if any still run, then exit by --driver-timeout): " +
        JournalPath(opts_.state_dir));
  }
  outage_seconds_ = std::max(0.0, ago);
  resume_ = std::move(journal).value();
  return Status::Ok();
}

void Driver::Adopt() {
  restarts_ = resume_->restarts + 1;
  auto state = LoadPolicyState(resume_->policy, SteadyClock::now());
  auto restored = state.ok()
                      ? Policy::Restore(PolicyOptions{opts_, RealClock(),
                                                      static_cast<uint64_t>(getpid()), IsLocalHost},
                                        std::move(state).value())
                      : StatusOr<std::unique_ptr<Policy>>(state.status());
  if (!restored.ok()) {
    policy_->Terminate(1, "the journal's policy state: " + restored.status().message());
    return;
  }
  policy_ = std::move(restored).value();
  for (const auto& [slot, jw] : resume_->workers) {
    if (!jw.local && !jw.remote_dir.empty()) {
      Worker& w = workers_[slot];
      w.slot = slot;
      w.host = jw.host;
      w.local = false;
      if (!AttachRemote(w, jw)) {
        workers_.erase(slot);
        lost_at_resume_.push_back(slot);
        continue;
      }
      adopted_.push_back(slot);
      reattach_pending_.insert(slot);
      continue;
    }
    if (!StillRunning(jw)) {
      lost_at_resume_.push_back(slot);
      continue;
    }
    auto proc =
        Process::Adopt(jw.pid, jw.stdout_file, jw.stderr_file, jw.stdout_offset, jw.stderr_offset);
    if (!proc.ok()) {
      lost_at_resume_.push_back(slot);
      continue;
    }
    Worker& w = workers_[slot];
    w.slot = slot;
    w.host = jw.host;
    w.local = jw.local;
    w.start_ticks = jw.start_ticks;
    w.proc = std::move(proc).value();
    if (w.proc->output_in_files() && inotify_fd_ >= 0) {
      for (const std::string& path : {jw.stdout_file, jw.stderr_file}) {
        inotify_add_watch(inotify_fd_, path.c_str(), IN_MODIFY);
      }
    }
    adopted_.push_back(slot);
    reattach_pending_.insert(slot);
  }
  resumed_at_ = SteadyClock::now();
  monitor_.SetDriverRestarts(restarts_);
  spdlog::warn(
      "resuming the job in {} (its driver died {:.1f} s ago; this is restart {}): adopted {} "
      "running worker(s) [{}]{}; round {} goes on once they re-attach",
      opts_.state_dir, outage_seconds_, restarts_, adopted_.size(), fmt::join(adopted_, " "),
      lost_at_resume_.empty()
          ? ""
          : fmt::format(", {} ended while no driver ran [{}]", lost_at_resume_.size(),
                        fmt::join(lost_at_resume_, " ")),
      resume_->core.formed_round);
  policy_->OnResumed(adopted_);
  CheckReattached(false);
}

void Driver::CheckReattached(bool time_up) {
  if (!resume_ || resumed_at_ == TimePoint{}) return;
  if (!reattach_pending_.empty() && !time_up) return;
  std::vector<std::string> back;
  auto in = [](const std::vector<std::string>& v, const std::string& s) {
    return std::find(v.begin(), v.end(), s) != v.end();
  };
  for (const auto& slot : adopted_) {
    if (!reattach_pending_.count(slot) && !in(lost_at_resume_, slot) &&
        !in(left_at_resume_, slot)) {
      back.push_back(slot);
    }
  }
  std::vector<std::string> lost = lost_at_resume_;
  lost.insert(lost.end(), reattach_pending_.begin(), reattach_pending_.end());
  double took = std::chrono::duration<double>(SteadyClock::now() - resumed_at_).count();
  spdlog::info("{} worker(s) re-attached in {:.2f} s{}{}", back.size(), took,
               lost.empty() ? "" : fmt::format("; lost: [{}]", fmt::join(lost, " ")),
               left_at_resume_.empty() ? ""
                                       : fmt::format("; sent away before they re-attached: [{}]",
                                                     fmt::join(left_at_resume_, " ")));
  JsonFields fields = {{"resumed", true},
                       {"outage_seconds", outage_seconds_},
                       {"reattached", back},
                       {"lost", lost},
                       {"left", left_at_resume_},
                       {"reattach_seconds", took},
                       {"round", resume_->core.formed_round},
                       {"restarts", restarts_}};
  log_.Write("driver_resumed", fields);
  monitor_.OnEvent("driver_resumed", fields);
  resumed_at_ = TimePoint{};
  reattach_pending_.clear();
}

void Driver::MaybeWriteJournal() {
  if (opts_.state_dir.empty() || state_lock_fd_ < 0) return;
  TimePoint now = SteadyClock::now();
  if (!journal_due_ && !(journal_touched_ && now - journal_written_ >= std::chrono::seconds(1))) {
    return;
  }
  journal_due_ = journal_touched_ = false;
  journal_written_ = now;
  Journal j;
  j.argv = opts_.argv;
  j.bind = bind_;
  j.driver_addr = driver_addr_;
  j.port = server_ ? server_->port() : 0;
  j.token = token_;
  j.restarts = restarts_;
  j.written_at =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  j.core = core_->Snapshot();
  j.policy = SavePolicyState(policy_->state(), now);
  for (auto& [slot, w] : workers_) {
    if (!w.proc || w.proc->reaped()) continue;
    if (w.start_ticks == 0) w.start_ticks = ProcessStartTicks(w.proc->pid());
    JournalWorker jw;
    jw.pid = w.proc->pid();
    jw.start_ticks = w.start_ticks;
    jw.local = w.local;
    jw.host = w.host;
    if (!w.local && !w.remote.dir.empty()) {
      // The worker on its host, not the launcher here: the driver that adopts the job
      // attaches to it there (driver/launch.h).
      jw.pid = w.remote.pid;
      jw.start_ticks = 0;
      jw.remote_group = w.remote.group;
      jw.remote_dir = w.remote.dir;
      const std::string& name = slot;
      jw.stdout_offset = w.relayed[1] - static_cast<int64_t>(out_.Pending(name, 1));
      jw.stderr_offset = w.relayed[2] - static_cast<int64_t>(out_.Pending(name, 2));
    } else if (w.proc->output_in_files()) {
      jw.stdout_file = out_.WorkerFile(slot, 1);
      jw.stderr_file = out_.WorkerFile(slot, 2);
      // What was shown: a line read without its end yet is read again by the next driver.
      const std::string& name = slot;  // a structured binding cannot be captured (C++17)
      auto shown = [&](int64_t read, int stream) {
        return read < 0 ? read : read - static_cast<int64_t>(out_.Pending(name, stream));
      };
      jw.stdout_offset = shown(w.proc->stdout_offset(), 1);
      jw.stderr_offset = shown(w.proc->stderr_offset(), 2);
    }
    j.workers[slot] = jw;
  }
  Status wrote = WriteJournal(opts_.state_dir, j);
  if (!wrote.ok() && wrote.message() != journal_error_) {
    spdlog::warn("{}; a driver started again on --state-dir would resume an older decision",
                 wrote.message());
  }
  journal_error_ = wrote.ok() ? "" : wrote.message();
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
  if (spare) env["ELASTIC_SPARE"] = "1";
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
    if (inotify_fd_ >= 0 && !out_.files_dir().empty()) {
      spec.stdout_file = out_.WorkerFile(w.slot, 1);
      spec.stderr_file = out_.WorkerFile(w.slot, 2);
    }
  } else {
    if (driver_addr_.rfind("127.", 0) == 0 && !warned_loopback_) {
      warned_loopback_ = true;
      spdlog::warn(
          "remote slot {} will dial the driver at {}, a loopback address; pass "
          "--driver-address with an address the hosts can reach",
          w.slot, driver_addr_);
    }
    char cwd[4096] = {0};
    // The job token never appears on a command line (`ps` shows those to every user): the
    // remote script reads it from the launcher's stdin, its first line. The stdin then stays
    // open for the worker's life: its closing is how the remote side learns that the driver
    // or the launcher is gone, and ends the worker (driver/launch.h).
    spec.stdin_data = token_ + "\n";
    spec.keep_stdin_open = true;
    spec.env.erase("ELASTIC_JOB_TOKEN");
    env.erase("ELASTIC_JOB_TOKEN");
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

bool Driver::AttachRemote(Worker& w, const JournalWorker& jw) {
  auto id = resume_->core.worker_ids.find(w.slot);
  w.remote.pid = jw.pid;
  w.remote.group = static_cast<pid_t>(jw.remote_group);
  w.remote.dir = jw.remote_dir;
  w.remote.worker_id = id == resume_->core.worker_ids.end() ? "" : id->second;
  w.worker_id = w.remote.worker_id;
  w.header_done = true;
  w.relayed[1] = std::max<int64_t>(jw.stdout_offset, 0);
  w.relayed[2] = std::max<int64_t>(jw.stderr_offset, 0);
  int grace = static_cast<int>(
      std::max<int64_t>(1, std::chrono::duration_cast<std::chrono::seconds>(opts_.grace).count()));
  LaunchSpec spec;
  spec.stdin_data = "attach\n";  // its first line; the stdin then stays open, as a launch's
  spec.keep_stdin_open = true;
  spec.argv = LauncherArgv(w.host, AttachScript(w.remote, w.relayed[1], w.relayed[2], grace));
  auto proc = Process::Start(spec);
  if (!proc.ok()) {
    spdlog::warn("cannot attach to the worker of slot {} on {} (pid {}): {}", w.slot, w.host,
                 jw.pid, proc.status().message());
    return false;
  }
  w.proc = std::move(proc).value();
  w.attached = true;
  return true;
}

void Driver::FeedPipe(Worker& w, int stream, const char* data, size_t n,
                      const std::string& label) {
  if (stream == 2 && !w.header_done) {
    // The launcher may write lines of its own first (ssh's warnings): those are output; the
    // header is looked for in the first 64 lines or 16 KiB.
    w.header.append(data, n);
    std::string out;
    size_t end;
    while (!w.header_done && (end = w.header.find('\n')) != std::string::npos) {
      auto parsed = ParseRemoteHeader(w.header.substr(0, end));
      if (parsed.ok()) {
        w.remote = *parsed;
        w.remote.worker_id = w.worker_id;
        w.header_done = true;
        journal_due_ = true;
        spdlog::debug("slot {}: pid {} on {}, its output in {}", w.slot, w.remote.pid, w.host,
                      w.remote.dir);
      } else {
        out.append(w.header, 0, end + 1);
        w.header_lines++;
      }
      w.header.erase(0, end + 1);
    }
    if (!w.header_done && (w.header_lines >= 64 || out.size() + w.header.size() > 16384)) {
      w.header_done = true;  // none: the worker writes to the pipes (driver/launch.h)
    }
    // Lines before the header are the launcher's, not counted as the worker file's bytes.
    if (!out.empty()) out_.Feed(w.slot, stream, out.data(), out.size(), label);
    if (w.header_done && !w.header.empty()) {
      std::string rest = std::move(w.header);
      w.header.clear();
      FeedPipe(w, stream, rest.data(), rest.size(), label);
    }
    return;
  }
  if (!w.local) w.relayed[stream] += static_cast<int64_t>(n);
  out_.Feed(w.slot, stream, data, n, label);
}

void Driver::FlushHeader(Worker& w, const std::string& label) {
  if (w.header_done) return;
  w.header_done = true;
  std::string rest = std::move(w.header);
  w.header.clear();
  if (!rest.empty()) FeedPipe(w, 2, rest.data(), rest.size(), label);
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
  log_.Write("stacks_dumped",
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
        case Action::kSignal: {
          auto it = workers_.find(a.slot);
          if (it == workers_.end() || !it->second.proc || it->second.proc->reaped()) break;
          auto dump = dumps_.find(a.slot);
          if (dump != dumps_.end()) {
            if (a.signal == SIGKILL && !policy_->shutting_down()) {
              // Its stacks are being dumped: it goes once the dump is done (StacksDumped).
              dump->second->held_signal = SIGKILL;
              break;
            }
            dump->second->stop = true;  // the job is ending: no dump holds it up
          }
          if (!it->second.local) {
            // The remote side ends the worker on this line (driver/launch.h) and the launch
            // then exits with it; a signal to the launcher alone would cut the connection
            // first, which a worker that rides out a lost driver outlives. SIGKILL (a grace
            // period after SIGTERM) also ends the launcher, for a host that does not answer.
            it->second.proc->WriteStdin("stop\n");
            if (a.signal != SIGKILL) break;
          }
          it->second.proc->SignalGroup(a.signal);
          if (a.signal == SIGKILL && policy_->shutting_down()) {
            // A worker that ignores its closed pipes still goes: stop waiting for its output.
            it->second.proc->CloseStdout();
            it->second.proc->CloseStderr();
          }
          break;
        }
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


void Driver::Loop() {
  std::vector<char> buf(65536);
  while (true) {
    Perform();
    MaybeWriteJournal();
    if (resumed_at_ != TimePoint{} &&
        SteadyClock::now() >= resumed_at_ + opts_.rendezvous_timeout) {
      CheckReattached(true);
    }
    monitor_.Update(policy_->View());
    // Done when shutting down and every process is reaped.
    bool any_running = false;
    for (auto& [slot, w] : workers_) {
      if (w.proc && !w.proc->reaped()) any_running = true;
    }
    if (policy_->shutting_down() && !any_running) return;

    std::vector<pollfd> fds = {{signal_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    struct Ref {
      Worker* w;
      int what;  // 1 stdout, 2 stderr, 3 exit
    };
    std::vector<Ref> refs = {{nullptr, 0}, {nullptr, 0}};
    if (inotify_fd_ >= 0) {
      fds.push_back({inotify_fd_, POLLIN, 0});
      refs.push_back({nullptr, 0});
    }
    const size_t first_worker = fds.size();
    for (auto& [slot, w] : workers_) {
      if (!w.proc || w.proc->reaped()) continue;
      if (w.proc->output_in_files()) {
        // Files are always "readable": followed through inotify (FollowFiles), not polled.
      } else if (w.proc->stdout_fd() >= 0) {
        fds.push_back({w.proc->stdout_fd(), POLLIN, 0});
        refs.push_back({&w, 1});
      }
      if (w.proc->stderr_fd() >= 0 && !w.proc->output_in_files()) {
        fds.push_back({w.proc->stderr_fd(), POLLIN, 0});
        refs.push_back({&w, 2});
      }
      fds.push_back({w.proc->pidfd(), POLLIN, 0});
      refs.push_back({&w, 3});
    }
    TimePoint now = SteadyClock::now();
    TimePoint next = std::min(policy_->NextDeadline(), now + std::chrono::seconds(1));
    int timeout_ms = static_cast<int>(std::max<int64_t>(
        0, std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count() + 1));
    int n = poll(fds.data(), fds.size(), timeout_ms);
    if (n < 0 && errno != EINTR) {
      policy_->Terminate(1, std::string("poll failed: ") + strerror(errno));
      continue;
    }
    if (fds[0].revents & POLLIN) {
      signalfd_siginfo si;
      if (read(signal_fd_, &si, sizeof si) == sizeof si) {
        int sig = static_cast<int>(si.ssi_signo);
        policy_->OnSignal(sig, strsignal(sig));
        Perform();
      }
    }
    if (fds[1].revents & POLLIN) {
      uint64_t count;
      ssize_t ignored = read(wake_fd_, &count, sizeof count);
      (void)ignored;
      std::deque<Posted> batch;
      {
        MutexLock g(post_mu_);
        batch.swap(posted_);
      }
      for (auto& p : batch) {
        HandlePosted(p);
        Perform();
      }
      journal_touched_ |= !batch.empty();
    }
    if (inotify_fd_ >= 0) {
      if (fds[2].revents & POLLIN) {
        alignas(inotify_event) char events[4096];
        while (read(inotify_fd_, events, sizeof events) > 0) {
        }
      }
      FollowFiles(buf);  // also after a timeout: a line whose watch could not be added
    }
    std::vector<std::pair<Worker*, int>> exits;
    for (size_t i = first_worker; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      Worker& w = *refs[i].w;
      if (!w.proc) continue;
      // Each line carries the rank of the round the worker is in.
      std::string label = policy_->Label(w.slot);
      if (refs[i].what == 3) {
        int code = 0;
        if (!w.proc->TryReap(&code)) continue;
        // An adopted process is not this driver's child: how it ended is what its agent said
        // (FINISHED, then exit 0), else a failure.
        if (w.attached) {
          w.exit_note = code == kAttachGone
                            ? "gone before this driver attached to it (adopted on " + w.host + ")"
                            : "an end whose status is unknown (adopted on " + w.host +
                                  ": not this driver's launch)";
        }
        if (w.proc->adopted() || w.attached) {
          code = policy_->finished(w.slot) ? 0 : 1;
          // Gone before it re-attached: it finished, or died, while no driver ran, or this
          // driver sent it away (a scale-down it heard of through its Join), which is no loss.
          if (reattach_pending_.erase(w.slot) > 0 && code != 0) {
            (policy_->sent_away(w.slot) ? left_at_resume_ : lost_at_resume_).push_back(w.slot);
          }
          CheckReattached(false);
        }
        // A worker killed while its host's segment was still named leaves it in /dev/shm.
        if (w.local && RemoveShmSegmentsOf(w.proc->pid()) > 0) {
          spdlog::debug("removed the shared-memory segment slot {} (pid {}) left behind",
                        w.slot, w.proc->pid());
        }
        // Drain what the worker wrote before it died, so no output line is lost.
        for (int stream : {1, 2}) {
          int fd = stream == 1 ? w.proc->stdout_fd() : w.proc->stderr_fd();
          if (fd < 0) continue;
          ssize_t got;
          while ((got = read(fd, buf.data(), buf.size())) > 0) {
            if (w.proc->output_in_files()) {
              out_.Feed(w.slot, stream, buf.data(), static_cast<size_t>(got), label, true);
            } else {
              FeedPipe(w, stream, buf.data(), static_cast<size_t>(got), label);
            }
          }
          if (stream == 2) FlushHeader(w, label);
          out_.Finish(w.slot, stream, label, w.proc->output_in_files());
        }
        w.proc->CloseStdout();
        w.proc->CloseStderr();
        exits.emplace_back(&w, code);
        continue;
      }
      int fd = refs[i].what == 1 ? w.proc->stdout_fd() : w.proc->stderr_fd();
      if (fd < 0) continue;
      ssize_t got = read(fd, buf.data(), buf.size());
      if (got > 0) {
        FeedPipe(w, refs[i].what, buf.data(), static_cast<size_t>(got), label);
      } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
        if (refs[i].what == 2) FlushHeader(w, label);
        out_.Finish(w.slot, refs[i].what, label);
        if (refs[i].what == 1) {
          w.proc->CloseStdout();
        } else {
          w.proc->CloseStderr();
        }
      }
    }
    // Failures before clean exits seen at the same moment: a worker that exits 0 right after a
    // peer died most likely reacted to that death, and must not turn it into the job's end.
    std::stable_sort(exits.begin(), exits.end(), [](const auto& a, const auto& b) {
      return (a.second != 0) > (b.second != 0);
    });
    for (auto& [w, code] : exits) {
      policy_->OnExit(w->slot, code, w->exit_note.empty() ? w->proc->DescribeExit() : w->exit_note);
      Perform();
    }
    policy_->OnTimer();
  }
}

void Driver::FollowFiles(std::vector<char>& buf) {
  for (auto& [slot, w] : workers_) {
    if (!w.proc || w.proc->reaped() || !w.proc->output_in_files()) continue;
    std::string label;
    for (int stream : {1, 2}) {
      int fd = stream == 1 ? w.proc->stdout_fd() : w.proc->stderr_fd();
      if (fd < 0) continue;
      ssize_t got;
      // Bounded per call, so that one worker writing without pause cannot hold the loop.
      for (int i = 0; i < 16 && (got = read(fd, buf.data(), buf.size())) > 0; ++i) {
        if (label.empty()) label = policy_->Label(w.slot);
        out_.Feed(w.slot, stream, buf.data(), static_cast<size_t>(got), label, true);
      }
    }
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
  if (!s.ok()) {
    spdlog::error("{}", s.message());
    metrics_.reset();
    if (server_) server_->Shutdown(std::chrono::seconds(1));
    if (!job_file_.empty()) unlink(job_file_.c_str());
    return s.code() == Code::kInvalidArgument ? 2 : 1;
  }
  Loop();
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
  if (!opts_.state_dir.empty()) RemoveJournal(opts_.state_dir);
  if (policy_->exit_code() == 0) {
    spdlog::info("elastic-run: {}", policy_->final_message());
  } else {
    spdlog::error("elastic-run: {} (exit {})", policy_->final_message(), policy_->exit_code());
  }
  log_.Write("job_ended",
             {{"code", int64_t{policy_->exit_code()}}, {"message", policy_->final_message()}});
  return policy_->exit_code();
}

}  // namespace internal

int RunDriver(const DriverOptions& options) {
  internal::Driver d(options);
  return d.Run();
}

}  // namespace elastic::driver
