// The driver's event loop: one thread owns all state and polls the workers' pipes and pidfds,
// a signalfd, inotify (output files), and an eventfd through which the rendezvous and discovery
// threads post events; it feeds what it sees to the policy and carries out its actions.
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

namespace elastic::driver::internal {

void Driver::Loop() {
  std::vector<char> buf(65536);
  while (true) {
    if (std::string why; leadership_ && !leadership_->Leads(&why)) LostLeadership(why);
    Perform();
    MaybeWriteJournal();
    if (resumed_at_ != TimePoint{} &&
        SteadyClock::now() >= resumed_at_ + opts_.rendezvous_timeout) {
      CheckReattached(true);
    }
    JobView view = policy_->View();
    if (placer_) {
      // The hosts of the formed round, rank order: where standbys go (--drivers).
      std::vector<std::string> hosts;
      for (const auto& m : view.members) {
        if (std::find(hosts.begin(), hosts.end(), m.host) == hosts.end()) hosts.push_back(m.host);
      }
      if (policy_->shutting_down()) hosts.clear();
      if (hosts != placer_hosts_) {
        placer_hosts_ = hosts;
        placer_->SetHosts(std::move(hosts));
      }
    }
    monitor_.Update(view);
    // Done when shutting down and every process is reaped.
    bool any_running = false;
    for (auto& [slot, w] : workers_) {
      if (w.proc && !w.proc->reaped()) any_running = true;
    }
    if (policy_->shutting_down() && !any_running) return;

    PollSet set = MakePollSet();
    TimePoint now = SteadyClock::now();
    TimePoint next = std::min(policy_->NextDeadline(), now + std::chrono::seconds(1));
    int timeout_ms = static_cast<int>(std::max<int64_t>(
        0, std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count() + 1));
    int n = poll(set.fds.data(), set.fds.size(), timeout_ms);
    if (n < 0 && errno != EINTR) {
      policy_->Terminate(1, std::string("poll failed: ") + strerror(errno));
      continue;
    }
    if (set.fds[0].revents & POLLIN) ReadSignal();
    if (set.fds[1].revents & POLLIN) TakePosted();
    if (inotify_fd_ >= 0) {
      if (set.fds[2].revents & POLLIN) {
        alignas(inotify_event) char events[4096];
        while (read(inotify_fd_, events, sizeof events) > 0) {
        }
      }
      FollowFiles(buf);  // also after a timeout: a line whose watch could not be added
    }
    std::vector<std::pair<Worker*, int>> exits;
    for (size_t i = set.first_worker; i < set.fds.size(); ++i) {
      if (!set.fds[i].revents) continue;
      Worker& w = *set.refs[i].w;
      if (!w.proc) continue;
      if (set.refs[i].what == PollRef::kExit) {
        int code = 0;
        if (ReapWorker(w, buf, &code)) exits.emplace_back(&w, code);
      } else {
        ReadPipe(w, set.refs[i].what, buf);
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

Driver::PollSet Driver::MakePollSet() {
  PollSet set;
  set.fds = {{signal_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
  set.refs = {{nullptr, 0}, {nullptr, 0}};
  if (inotify_fd_ >= 0) {
    set.fds.push_back({inotify_fd_, POLLIN, 0});
    set.refs.push_back({nullptr, 0});
  }
  set.first_worker = set.fds.size();
  for (auto& [slot, w] : workers_) {
    if (!w.proc || w.proc->reaped()) continue;
    // Output files are always "readable": followed through inotify (FollowFiles), not polled.
    if (!w.proc->output_in_files() && w.proc->stdout_fd() >= 0) {
      set.fds.push_back({w.proc->stdout_fd(), POLLIN, 0});
      set.refs.push_back({&w, PollRef::kStdout});
    }
    if (w.proc->stderr_fd() >= 0 && !w.proc->output_in_files()) {
      set.fds.push_back({w.proc->stderr_fd(), POLLIN, 0});
      set.refs.push_back({&w, PollRef::kStderr});
    }
    set.fds.push_back({w.proc->pidfd(), POLLIN, 0});
    set.refs.push_back({&w, PollRef::kExit});
  }
  return set;
}

void Driver::ReadSignal() {
  signalfd_siginfo si;
  if (read(signal_fd_, &si, sizeof si) == sizeof si) {
    int sig = static_cast<int>(si.ssi_signo);
    policy_->OnSignal(sig, strsignal(sig));
    Perform();
  }
}

void Driver::TakePosted() {
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

bool Driver::ReapWorker(Worker& w, std::vector<char>& buf, int* code_out) {
  int code = 0;
  if (!w.proc->TryReap(&code)) return false;
  // Each line carries the rank of the round the worker is in.
  const std::string label = policy_->Label(w.slot);
  // An adopted process is not this driver's child: how it ended is what its status keeper
  // recorded, else what its agent said (FINISHED, then exit 0), else a failure.
  // A remote one's attach script exits with the status its keeper recorded on the host
  // (driver/launch.h), unless it was killed itself.
  const bool attached_known =
      w.attached && w.proc->exited_normally() && code != kAttachUnknown;
  if (attached_known) {
    w.exit_note = (code > 128 && code < 160
                       ? fmt::format("signal {} ({})", code - 128, strsignal(code - 128))
                       : fmt::format("exit status {}", code)) +
                  " (recorded by its status keeper on " + w.host + ")";
  } else if (w.attached) {
    w.exit_note = "an end whose status is unknown (adopted on " + w.host +
                  ": not this driver's launch, and no status recorded on the host)";
  }
  if (w.proc->adopted() || w.attached) {
    // Unless its status keeper recorded how it ended (common/process.h).
    if (w.attached ? !attached_known : !w.proc->status_known()) {
      code = policy_->finished(w.slot) ? 0 : 1;
    }
    // Gone before it re-attached: it finished (exit 0 after FINISHED: no loss), or died,
    // while no driver ran, or this driver sent it away (a scale-down it heard of through
    // its Join), which is no loss either.
    if (reattach_pending_.erase(w.slot) > 0 && !(code == 0 && policy_->finished(w.slot))) {
      (policy_->sent_away(w.slot) ? left_at_resume_ : lost_at_resume_).push_back(w.slot);
    }
    CheckReattached(false);
  }
  // A worker killed while its host's segment was still named leaves it in /dev/shm.
  if (w.local && RemoveShmSegmentsOf(w.proc->pid()) > 0) {
    spdlog::debug("removed the shared-memory segment slot {} (pid {}) left behind", w.slot,
                  w.proc->pid());
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
  *code_out = code;
  return true;
}

void Driver::ReadPipe(Worker& w, int stream, std::vector<char>& buf) {
  int fd = stream == PollRef::kStdout ? w.proc->stdout_fd() : w.proc->stderr_fd();
  if (fd < 0) return;
  const std::string label = policy_->Label(w.slot);
  ssize_t got = read(fd, buf.data(), buf.size());
  if (got > 0) {
    FeedPipe(w, stream, buf.data(), static_cast<size_t>(got), label);
  } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
    if (stream == PollRef::kStderr) FlushHeader(w, label);
    out_.Finish(w.slot, stream, label);
    if (stream == PollRef::kStdout) {
      w.proc->CloseStdout();
    } else {
      w.proc->CloseStderr();
    }
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

void Driver::FeedPipe(Worker& w, int stream, const char* data, size_t n, const std::string& label) {
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

}  // namespace elastic::driver::internal
