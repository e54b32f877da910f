#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>

#include "discovery/discovery.h"

namespace elastic::discovery {

StatusOr<ScriptResult> RunScript(const std::string& script, Duration timeout, size_t max_output) {
  int out_pipe[2], err_pipe[2];
  if (pipe2(out_pipe, O_CLOEXEC) != 0) return Internal(std::string("pipe: ") + strerror(errno));
  if (pipe2(err_pipe, O_CLOEXEC) != 0) {
    close(out_pipe[0]);
    close(out_pipe[1]);
    return Internal(std::string("pipe: ") + strerror(errno));
  }
  pid_t pid = fork();
  if (pid < 0) return Internal(std::string("fork: ") + strerror(errno));
  if (pid == 0) {
    setpgid(0, 0);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    dup2(out_pipe[1], 1);
    dup2(err_pipe[1], 2);
    int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) dup2(devnull, 0);
    if (script.find_first_of(" \t;|&$<>") != std::string::npos) {
      execl("/bin/sh", "sh", "-c", script.c_str(), static_cast<char*>(nullptr));
    } else {
      execl(script.c_str(), script.c_str(), static_cast<char*>(nullptr));
    }
    dprintf(2, "cannot run %s: %s\n", script.c_str(), strerror(errno));
    _exit(127);
  }
  setpgid(pid, pid);
  close(out_pipe[1]);
  close(err_pipe[1]);
  ScriptResult r;
  TimePoint deadline = SteadyClock::now() + timeout;
  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  int open_fds = 2;
  char buf[65536];
  while (open_fds > 0) {
    auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - SteadyClock::now());
    if (left.count() <= 0) {
      r.timed_out = true;
      break;
    }
    int n = poll(fds, 2, static_cast<int>(std::min<long>(left.count(), 1000)));
    if (n < 0 && errno != EINTR) break;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      ssize_t got = read(fds[i].fd, buf, sizeof buf);
      if (got <= 0) {
        close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
        continue;
      }
      std::string& dst = i == 0 ? r.out : r.err;
      dst.append(buf, static_cast<size_t>(got));
      if (i == 0 && r.out.size() > max_output) {
        r.truncated = true;
        r.out.resize(max_output);
      }
      if (i == 1 && r.err.size() > 8192) r.err.erase(0, r.err.size() - 8192);
    }
    if (r.truncated) break;
  }
  for (auto& f : fds) {
    if (f.fd >= 0) close(f.fd);
  }
  if (r.timed_out || r.truncated) kill(-pid, SIGKILL);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (r.timed_out || r.truncated) kill(-pid, SIGKILL);  // anything it left in its group
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
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
