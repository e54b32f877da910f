// The driver's journal (--state-dir): taking the folder, writing what the driver decided, and
// a restarted driver's adoption of the workers that still run (docs/recovery.md, "A driver that
// comes back").
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
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>

#include "common/mutex.h"
#include "driver/events.h"
#include "driver/driver_internal.h"
#include "driver/launch.h"

namespace elastic::driver::internal {

Status Driver::TakeLeadership() {
  auto url = ParseEtcdUrl(opts_.state_store);
  if (!url.ok()) return url.status();
  LeadershipOptions lo;
  lo.store = *url;
  lo.store.tls = opts_.state_store_tls;
  lo.ttl_seconds = opts_.lease_ttl;
  lo.standby = opts_.standby;
  lo.address = opts_.driver_address;
  // A standby checks the job before it leads: one it could not adopt is refused while the
  // leader may still be there (it never takes the lease for it).
  lo.check_journal = [this](const std::string& text) {
    auto journal = ParseJournal(text, opts_.state_store + " (journal)");
    return journal.ok() ? SameJob(*journal, false) : journal.status();
  };
  // SIGINT and SIGTERM are blocked (read through the signalfd once the job runs): a standby
  // that waits looks for them itself.
  auto stop = [] {
    sigset_t pending;
    sigpending(&pending);
    return sigismember(&pending, SIGINT) == 1 || sigismember(&pending, SIGTERM) == 1;
  };
  if (opts_.standby) {
    spdlog::info("standby for the job in {}: waiting for its leader to go (lease TTL {} s)",
                 url->text, opts_.lease_ttl);
  }
  auto taken = Leadership::Take(lo, stop, &standby_ended_);
  if (!taken.ok()) return taken.status();
  if (standby_ended_) return Status::Ok();
  leadership_ = std::move(taken).value();
  spdlog::info("this driver leads the job in {}", url->text);
  log_.Write(events::kLeading, {{"store", url->text}, {"standby", opts_.standby}});
  return Status::Ok();
}

void Driver::LostLeadership(const std::string& why) {
  spdlog::critical(
      "this driver no longer leads the job ({}); it ends now without touching the workers, "
      "which follow the driver that leads next (exit 3)",
      why);
  log_.Write(events::kLeadershipLost, {{"reason", why}});
  spdlog::default_logger()->flush();
  std::_Exit(3);
}

void Driver::DropJournal() {
  RemoveJournal(opts_.state_dir);
  if (leadership_) {
    Status s = leadership_->RemoveJournal();
    if (s.code() == Code::kFailedPrecondition) LostLeadership(s.message());
    if (!s.ok()) spdlog::warn("the state store: {}", s.message());
  }
}

Status Driver::SameJob(const Journal& journal, bool say) const {
  // With a store, the prefix names the job, and a standby elsewhere has paths of its own
  // (--state-dir, --event-log, ...): the program and its arguments must be the job's.
  if (!leadership_ && opts_.state_store.empty()) {
    if (journal.argv == opts_.argv) return Status::Ok();
    return InvalidArgument(fmt::format(
        "--state-dir {} holds the journal of another command line (`{}`); run that one to "
        "resume its job, pass --fresh to start this one there, or use another folder",
        opts_.state_dir, fmt::join(journal.argv, " ")));
  }
  const auto& cmd = opts_.command;
  if (journal.argv.size() >= cmd.size() &&
      std::equal(cmd.rbegin(), cmd.rend(), journal.argv.rbegin())) {
    if (say && journal.argv != opts_.argv) {
      spdlog::info("this driver's options differ from the leader's (`{}`); the journal's "
                   "decided the job so far, this driver's decide it from now on",
                   fmt::join(journal.argv, " "));
    }
    return Status::Ok();
  }
  return InvalidArgument(fmt::format(
      "--state-store {}: its job runs another program (`{}`); give this command that program "
      "and its arguments to stand by for it, or another prefix",
      opts_.state_store, fmt::join(journal.argv, " ")));
}

Status Driver::OpenStateDir() {
  auto lock = LockStateDir(opts_.state_dir);
  if (lock.ok()) {
    state_lock_fd_ = *lock;
  } else if (leadership_ && lock.status().code() == Code::kFailedPrecondition) {
    // A standby here, and the driver it took over from is alive but no longer leads (paused,
    // cut off from etcd): the store decides who leads; that one ends when it sees it.
    spdlog::warn("--state-dir: {}; this driver leads by the state store and goes on",
                 lock.status().message());
  } else {
    return lock.status().WithContext("--state-dir");
  }
  // Local workers' status keepers record how they ended here (common/process.h).
  const std::string exits = opts_.state_dir + "/exits";
  struct stat st;
  if ((mkdir(exits.c_str(), 0700) == 0 || errno == EEXIST) && lstat(exits.c_str(), &st) == 0 &&
      S_ISDIR(st.st_mode) && st.st_uid == geteuid()) {
    exits_dir_ = exits;
  } else {
    spdlog::warn("cannot use {} ({}): a driver that adopts this job will not know how its "
                 "local workers ended", exits, strerror(errno));
  }
  StatusOr<Journal> journal = NotFound("no journal");
  if (leadership_) {
    auto text = leadership_->ReadJournal();
    if (!text.ok()) return text.status().WithContext("--state-store");
    if (text->has_value()) journal = ParseJournal(**text, opts_.state_store + " (journal)");
  } else {
    journal = ReadJournal(opts_.state_dir);
  }
  if (!journal.ok() && journal.status().code() == Code::kNotFound) return Status::Ok();
  if (!journal.ok()) {
    if (!opts_.fresh) {
      return journal.status().WithContext(
          "--state-dir: the journal cannot be read; pass --fresh to start the job afresh "
          "(its workers, if any still run, then exit by --driver-timeout)");
    }
    spdlog::warn("--fresh: not reading the damaged journal ({})", journal.status().message());
    DropJournal();
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
    DropJournal();
    return Status::Ok();
  }
  RETURN_IF_ERROR(SameJob(*journal, true));
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
    log_.Write(events::kDriverResumed, {{"resumed", false},
                                        {"outage_seconds", ago},
                                        {"reason", "every worker of the journal is gone"}});
    DropJournal();
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
      auto kept = AwaitKeptStatus(jw);
      if (kept.ok()) {
        int code = WIFEXITED(*kept) ? WEXITSTATUS(*kept) : 128 + WTERMSIG(*kept);
        std::string how = WIFEXITED(*kept) ? fmt::format("exit status {}", code)
                                           : fmt::format("signal {} ({})", WTERMSIG(*kept),
                                                         strsignal(WTERMSIG(*kept)));
        ended_at_resume_[slot] = {code, how + " (recorded by its status keeper)"};
      }
      continue;
    }
    auto proc = Process::Adopt(jw.pid, jw.stdout_file, jw.stderr_file, jw.stdout_offset,
                               jw.stderr_offset, static_cast<pid_t>(jw.keeper_pid), exits_dir_);
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
      leadership_ ? opts_.state_store : opts_.state_dir, outage_seconds_, restarts_,
      adopted_.size(), fmt::join(adopted_, " "),
      lost_at_resume_.empty()
          ? ""
          : fmt::format(", {} ended while no driver ran [{}]", lost_at_resume_.size(),
                        fmt::join(lost_at_resume_, " ")),
      resume_->core.formed_round);
  policy_->OnResumed(adopted_, ended_at_resume_);
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
  log_.Write(events::kDriverResumed, fields);
  monitor_.OnEvent(events::kDriverResumed, fields);
  resumed_at_ = TimePoint{};
  reattach_pending_.clear();
}

void Driver::MaybeWriteJournal() {
  if (opts_.state_dir.empty() || (state_lock_fd_ < 0 && !leadership_)) return;
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
  j.tls = tls_;
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
    jw.keeper_pid = w.local ? w.proc->keeper() : 0;
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
  // With a store, fenced by the lease: a driver that no longer leads never writes
  // (driver/leadership.h).
  Status wrote = leadership_ ? leadership_->WriteJournal(SerializeJournal(j))
                             : WriteJournal(opts_.state_dir, j);
  if (leadership_ && wrote.code() == Code::kFailedPrecondition) LostLeadership(wrote.message());
  if (!wrote.ok() && wrote.message() != journal_error_) {
    spdlog::warn("{}{}; {} would resume an older decision", leadership_ ? "the state store: " : "",
                 wrote.message(),
                 leadership_ ? "a standby" : "a driver started again on --state-dir");
  }
  journal_error_ = wrote.ok() ? "" : wrote.message();
}

StatusOr<int> Driver::AwaitKeptStatus(const JournalWorker& jw) {
  if (!jw.local || jw.keeper_pid <= 1 || exits_dir_.empty()) {
    return NotFound("no status keeper");
  }
  const pid_t keeper = static_cast<pid_t>(jw.keeper_pid);
  // A keeper still running has reaped the worker or is about to: it writes the status, then
  // exits. Waited for up to 2 s.
  int fd = static_cast<int>(syscall(SYS_pidfd_open, keeper, 0));
  if (fd >= 0) {
    if (IsStatusKeeper(keeper, exits_dir_)) {
      pollfd gone{fd, POLLIN, 0};
      while (poll(&gone, 1, 2000) < 0 && errno == EINTR) {
      }
    }
    close(fd);
  }
  return KeptStatus(exits_dir_, static_cast<pid_t>(jw.pid), true);
}

void Driver::RemoveKeptStatuses() {
  if (exits_dir_.empty()) return;
  if (DIR* d = opendir(exits_dir_.c_str())) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] != '.') unlinkat(dirfd(d), e->d_name, 0);
    }
    closedir(d);
  }
  rmdir(exits_dir_.c_str());
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

}  // namespace elastic::driver::internal
