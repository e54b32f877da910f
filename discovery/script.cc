#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>

#include "common/process.h"
#include "discovery/discovery.h"

namespace elastic::discovery {

StatusOr<ScriptResult> RunScript(const std::string& script, Duration timeout, size_t max_output) {
  LaunchSpec spec;
  if (script.find_first_of(" \t;|&$<>") != std::string::npos) {
    spec.argv = {"/bin/sh", "-c", script};
  } else {
    spec.argv = {script};
  }
  spec.reap_orphans = true;  // what it leaves behind goes when it exits
  ASSIGN_OR_RETURN(std::unique_ptr<Process> proc, Process::Start(spec));
  ScriptResult r;
  TimePoint deadline = SteadyClock::now() + timeout;
  char buf[65536];
  // Reads what one stream has now; false when it ended or the output is over the cap.
  auto read_some = [&](int stream) {
    int fd = stream == 0 ? proc->stdout_fd() : proc->stderr_fd();
    if (fd < 0) return false;
    ssize_t got = read(fd, buf, sizeof buf);
    if (got < 0 && (errno == EAGAIN || errno == EINTR)) return false;
    if (got <= 0) {
      stream == 0 ? proc->CloseStdout() : proc->CloseStderr();
      return false;
    }
    std::string& dst = stream == 0 ? r.out : r.err;
    dst.append(buf, static_cast<size_t>(got));
    if (stream == 1 && r.err.size() > 8192) r.err.erase(0, r.err.size() - 8192);
    if (r.out.size() > max_output) {
      r.truncated = true;
      r.out.resize(max_output);
      return false;
    }
    return true;
  };
  // The run ends when the script exits: a child it left in the background holding its
  // stdout does not keep the run going.
  int code = 0;
  bool exited = false;
  while (!exited && !r.truncated) {
    auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - SteadyClock::now());
    if (left.count() <= 0) {
      r.timed_out = true;
      break;
    }
    pollfd fds[3] = {{proc->stdout_fd(), POLLIN, 0},
                     {proc->stderr_fd(), POLLIN, 0},
                     {proc->pidfd(), POLLIN, 0}};
    if (poll(fds, 3, static_cast<int>(std::min<long>(left.count(), 1000))) < 0 && errno != EINTR) {
      break;
    }
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd >= 0 && (fds[i].revents & (POLLIN | POLLHUP | POLLERR))) read_some(i);
    }
    if (proc->TryReap(&code)) {
      exited = true;
      for (int i = 0; i < 2; ++i) {
        while (read_some(i)) {
        }
      }
    }
  }
  // An overrun script goes with everything it started: SIGTERM makes the reaper kill it and
  // what it left; SIGKILL (to the reaper) if that takes more than a moment. The exit is
  // awaited (bounded: after SIGKILL it comes at once).
  if (!exited) {
    proc->SignalGroup(SIGTERM);
    pollfd exit_fd{proc->pidfd(), POLLIN, 0};
    TimePoint kill_at = SteadyClock::now() + std::chrono::seconds(2);
    while (!proc->TryReap(&code)) {
      if (SteadyClock::now() >= kill_at) proc->SignalGroup(SIGKILL);
      poll(&exit_fd, 1, 100);
    }
  }
  r.exit_code = code;
  return r;
}

StatusOr<std::vector<HostSlots>> Discover(const std::string& script, Duration timeout,
                                          size_t max_output, int default_slots,
                                          std::vector<std::string>* warnings) {
  ASSIGN_OR_RETURN(ScriptResult r, RunScript(script, timeout, max_output));
  std::string err = r.err.empty() ? "" : "; its stderr: " + r.err;
  if (r.timed_out) {
    return DeadlineExceeded(
        "discovery script '" + script + "' did not finish within " +
        std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count()) +
        " ms and was killed" + err);
  }
  if (r.truncated) {
    return ResourceExhausted("discovery script '" + script + "' printed more than " +
                             std::to_string(max_output) + " bytes" + err);
  }
  if (r.exit_code != 0) {
    return Unavailable("discovery script '" + script + "' exited with status " +
                       std::to_string(r.exit_code) + err);
  }
  auto hosts = ParseHostLines(r.out, default_slots, warnings);
  if (!hosts.ok()) {
    return hosts.status().WithContext("discovery script '" + script + "' output");
  }
  return hosts;
}

}  // namespace elastic::discovery
