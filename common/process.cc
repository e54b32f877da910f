#include "common/process.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>

extern char** environ;

namespace elastic {

StatusOr<std::string> FindProgram(const std::string& name) {
  if (name.empty()) return NotFound("empty command");
  auto executable = [](const std::string& p) {
    struct stat st;
    return stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(p.c_str(), X_OK) == 0;
  };
  if (name.find('/') != std::string::npos) {
    if (executable(name)) return name;
    return NotFound("command '" + name + "' does not exist or is not executable");
  }
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/local/bin:/usr/bin:/bin");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    std::string p = (dir.empty() ? "." : dir) + "/" + name;
    if (executable(p)) return p;
  }
  return NotFound("command '" + name + "' was not found in PATH");
}

std::string ShellQuote(const std::string& s) {
  if (!s.empty() && s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                        "0123456789_-./=:,@%+") == std::string::npos) {
    return s;
  }
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

namespace {

// The nice value children are started with (RaiseOwnPriority), or kNoNice: inherit.
constexpr int kNoNice = 1000;
int g_child_nice = kNoNice;

// The reaper's program, set before SIGTERM can make it act.
volatile pid_t g_reaped_program = 0;

// The reaper's SIGTERM: the program's whole group goes (what it leaves is killed after).
void OnReaperTerm(int) {
  if (g_reaped_program > 0) kill(-g_reaped_program, SIGKILL);
}

// The reaper side of LaunchSpec::reap_orphans, in the forked child: async-signal-safe calls
// only. Kills every process reparented to it (it is a child subreaper) until none is left.
void KillAdopted() {
  char path[64] = "/proc/self/task/";
  size_t n = strlen(path);
  char digits[16];
  int len = 0;
  for (pid_t v = getpid(); v > 0; v /= 10) digits[len++] = static_cast<char>('0' + v % 10);
  while (len > 0) path[n++] = digits[--len];
  memcpy(path + n, "/children", 10);
  for (int rounds = 0; rounds < 10000; ++rounds) {
    char buf[4096];
    ssize_t got = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      got = read(fd, buf, sizeof buf - 1);
      close(fd);
    }
    for (ssize_t i = 0; i < got;) {
      pid_t child = 0;
      while (i < got && buf[i] >= '0' && buf[i] <= '9') child = child * 10 + (buf[i++] - '0');
      if (child > 0) kill(child, SIGKILL);
      while (i < got && (buf[i] < '0' || buf[i] > '9')) ++i;
    }
    int status;
    if (waitpid(-1, &status, 0) < 0 && errno == ECHILD) return;
  }
}

// Closes every descriptor from `first` on, in a forked child: async-signal-safe calls only.
void CloseDescriptorsFrom(int first) {
#ifdef SYS_close_range
  if (syscall(SYS_close_range, first, ~0U, 0) == 0) return;
#endif
  long max = sysconf(_SC_OPEN_MAX);
  if (max < 0 || max > 65536) max = 65536;
  for (int fd = first; fd < max; ++fd) close(fd);
}

// Opens `path` for a program's output: fds[1] appends (created 0600), fds[0] reads from the
// file's current end, so that the reader sees only what is written from now on. On failure
// nothing is left open and both are -1.
Status OpenOutputFile(const std::string& path, int fds[2]) {
  fds[1] = open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  if (fds[1] < 0) {
    fds[0] = -1;
    return InvalidArgument("cannot open " + path + ": " + strerror(errno));
  }
  fds[0] = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fds[0] < 0 || lseek(fds[0], 0, SEEK_END) < 0) {
    std::string why = "cannot read " + path + ": " + strerror(errno);
    if (fds[0] >= 0) close(fds[0]);
    close(fds[1]);
    fds[0] = fds[1] = -1;
    return InvalidArgument(why);
  }
  return Status::Ok();
}

}  // namespace

int RemoveShmSegmentsOf(pid_t pid) {
  if (pid <= 0) return 0;
  const std::string prefix = "elastic-" + std::to_string(pid) + "-";
  DIR* d = opendir("/dev/shm");
  if (d == nullptr) return 0;
  int removed = 0;
  while (dirent* e = readdir(d)) {
    std::string name = e->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    if (shm_unlink(("/" + name).c_str()) == 0) ++removed;
  }
  closedir(d);
  return removed;
}

namespace {

// A zombie, or a process being torn down: it maps nothing any more (/proc/PID/stat's state).
bool Dead(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  size_t paren = text.rfind(')');
  if (paren == std::string::npos || paren + 2 >= text.size()) return false;
  char state = text[paren + 2];
  return state == 'Z' || state == 'X' || state == 'x';
}

}  // namespace

int RemoveStaleShmSegments() {
  DIR* d = opendir("/dev/shm");
  if (d == nullptr) return 0;
  std::vector<std::string> stale;
  while (dirent* e = readdir(d)) {
    std::string name = e->d_name;
    if (name.compare(0, 8, "elastic-") != 0) continue;
    size_t dash = name.find('-', 8);
    if (dash == std::string::npos || dash == 8 || dash - 8 > 9) continue;
    std::string digits = name.substr(8, dash - 8);
    if (digits.find_first_not_of("0123456789") != std::string::npos) continue;
    pid_t pid = static_cast<pid_t>(std::stol(digits));
    if (pid > 0 && ((kill(pid, 0) != 0 && errno == ESRCH) || Dead(pid))) stale.push_back(name);
  }
  closedir(d);
  int removed = 0;
  for (const auto& name : stale) removed += shm_unlink(("/" + name).c_str()) == 0;
  return removed;
}

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

bool EnvFlag(const char* name, bool dflt) {
  const char* raw = std::getenv(name);
  if (raw == nullptr) return dflt;
  std::string v(raw);
  std::transform(v.begin(), v.end(), v.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
  if (v.empty() || v == "0" || v == "false" || v == "no" || v == "off") return false;
  return dflt;
}

StatusOr<int> RaiseOwnPriority(int boost) {
  errno = 0;
  int before = getpriority(PRIO_PROCESS, 0);
  if (before == -1 && errno != 0) return Internal(std::string("getpriority: ") + strerror(errno));
  int want = std::max(before - boost, -20);
  if (want >= before) return before;
  g_child_nice = before;  // set first: a child started from now on runs as before
  if (setpriority(PRIO_PROCESS, 0, want) != 0) {
    g_child_nice = kNoNice;
    return PermissionDenied(std::string("setpriority(") + std::to_string(want) +
                            "): " + strerror(errno));
  }
  return want;
}

namespace {

// A child's standard streams: [0] is this side's end, [1] the child's (for `in`, the other way
// round: the child reads [0]). -1: none.
struct ChildPipes {
  int out[2] = {-1, -1};
  int err[2] = {-1, -1};
  int in[2] = {-1, -1};
  void CloseAll() {
    for (int fd : {out[0], out[1], err[0], err[1], in[0], in[1]}) {
      if (fd >= 0) close(fd);
    }
  }
};

// The child's output through pipes, or into spec's files (read back from their current end);
// a pipe for its stdin when spec gives it data. Nothing is left open on failure.
Status OpenChildPipes(const LaunchSpec& spec, ChildPipes* p) {
  auto failed = [p](Status s) {
    p->CloseAll();
    *p = ChildPipes();
    return s;
  };
  auto pipe_error = [] { return Internal(std::string("pipe: ") + strerror(errno)); };
  if (!spec.stdout_file.empty()) {
    RETURN_IF_ERROR(OpenOutputFile(spec.stdout_file, p->out));
    if (Status s = OpenOutputFile(spec.stderr_file, p->err); !s.ok()) return failed(s);
  } else {
    if (pipe2(p->out, O_CLOEXEC) != 0) return failed(pipe_error());
    if (pipe2(p->err, O_CLOEXEC) != 0) return failed(pipe_error());
  }
  if (!spec.stdin_data.empty() && pipe2(p->in, O_CLOEXEC) != 0) return failed(pipe_error());
  return Status::Ok();
}

// This process's environment with `overrides` on top, as "KEY=value" strings.
std::vector<std::string> MergedEnvironment(const std::map<std::string, std::string>& overrides) {
  std::map<std::string, std::string> merged;
  for (char** e = environ; *e; ++e) {
    std::string kv(*e);
    size_t eq = kv.find('=');
    if (eq != std::string::npos) merged[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  for (const auto& [k, v] : overrides) merged[k] = v;
  std::vector<std::string> out;
  for (const auto& [k, v] : merged) out.push_back(k + "=" + v);
  return out;
}

// In a forked child (async-signal-safe calls only): becomes the reaper of LaunchSpec's
// reap_orphans and returns in the program's process, below it. The reaper leads the group the
// driver signals; the program runs in a group of its own below it, so SIGKILL never takes the
// reaper before it has cleaned up. SIGTERM to the reaper kills the program's group.
void BecomeReaper() {
  // The reaper never execs, so O_CLOEXEC never closes what it inherited: every other
  // descriptor of this process, workers' kept stdin pipes among them, would stay open
  // for its life (a remote worker would see its launcher's stdin close only after it).
  CloseDescriptorsFrom(3);
  prctl(PR_SET_CHILD_SUBREAPER, 1);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = OnReaperTerm;
  sigaction(SIGTERM, &sa, nullptr);
  pid_t reaper = getpid();
  pid_t inner = fork();
  if (inner < 0) _exit(127);
  if (inner > 0) {
    setpgid(inner, inner);
    g_reaped_program = inner;
    int status = 0;
    while (waitpid(inner, &status, 0) < 0 && errno == EINTR) {
    }
    kill(-inner, SIGKILL);
    KillAdopted();
    if (WIFEXITED(status)) _exit(WEXITSTATUS(status));
    int sig = WIFSIGNALED(status) ? WTERMSIG(status) : SIGKILL;
    signal(sig, SIG_DFL);
    kill(getpid(), sig);
    _exit(128 + sig);
  }
  setpgid(0, 0);
  signal(SIGTERM, SIG_DFL);
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != reaper) _exit(137);
}

// The forked child (async-signal-safe calls only): its group, priority, signals and streams,
// then the program.
[[noreturn]] void ExecChild(const LaunchSpec& spec, const ChildPipes& p, pid_t parent,
                            const std::string& program, char** argv, char** envp) {
  setpgid(0, 0);
  if (g_child_nice != kNoNice) setpriority(PRIO_PROCESS, 0, g_child_nice);
  if (spec.die_with_parent) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(137);
  }
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  signal(SIGPIPE, SIG_DFL);
  // A driver started under nohup (SIGHUP ignored) must not pass that on: a program stopped
  // when its driver dies is ended by the kernel's SIGHUP to its orphaned group (KeepChild). It
  // is in a group of its own, so a terminal's hangup never reaches it anyway.
  signal(SIGHUP, SIG_DFL);
  dup2(p.out[1], 1);
  dup2(p.err[1], 2);
  if (p.in[0] >= 0) {
    dup2(p.in[0], 0);
  } else {
    int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) dup2(devnull, 0);
  }
  if (spec.reap_orphans) BecomeReaper();
  execve(program.c_str(), argv, envp);
  dprintf(2, "cannot execute %s: %s\n", program.c_str(), strerror(errno));
  _exit(127);
}

// A status keeper ignores every signal that can be ignored: it is a member of its program's
// group, to which the driver sends SIGTERM, SIGCONT and the like (async-signal-safe).
void IgnoreKeeperSignals() {
  for (int sig : {SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2, SIGPIPE, SIGALRM, SIGTSTP,
                  SIGTTIN, SIGTTOU}) {
    signal(sig, SIG_IGN);
  }
  signal(SIGCHLD, SIG_DFL);
}

// Ends this process as `status` says the program ended (async-signal-safe): with its exit
// code, or by its signal (no core dump of this process's own).
[[noreturn]] void ExitLike(int status) {
  if (WIFEXITED(status)) _exit(WEXITSTATUS(status));
  int sig = WIFSIGNALED(status) ? WTERMSIG(status) : SIGKILL;
  struct rlimit no_core = {0, 0};
  setrlimit(RLIMIT_CORE, &no_core);
  signal(sig, SIG_DFL);
  sigset_t one;
  sigemptyset(&one);
  sigaddset(&one, sig);
  sigprocmask(SIG_UNBLOCK, &one, nullptr);
  kill(getpid(), sig);
  _exit(128 + sig);
}

// The keeper side of LaunchSpec::status_dir, in the forked child (async-signal-safe calls
// only): starts the program below it, sends its pid through `report`, and becomes the keeper
// (an exec of spec.keeper_program, RunStatusKeeper). Should that exec fail, it waits for the
// program itself and ends as it did, recording nothing.
[[noreturn]] void KeepChild(const LaunchSpec& spec, const ChildPipes& p, const char* program,
                            char** argv, char** envp, const char* keeper, char** keeper_argv,
                            int report) {
  setpgid(0, 0);
  pid_t self = getpid();
  pid_t w = fork();
  if (w == 0) ExecChild(spec, p, self, program, argv, envp);
  if (w > 0) {
    setpgid(w, w);  // also here, so the group exists before the pid is known
    // The keeper joins the program's group, ignoring the signals the driver sends that group
    // (as RunStatusKeeper does again after the exec; an ignored disposition survives it). A
    // member of the group whose parent (the driver) is outside it keeps the group from being
    // orphaned while the driver lives; when the driver dies the group is orphaned, and a
    // program stopped then gets SIGHUP and SIGCONT from the kernel, as it did before it had a
    // keeper, instead of staying stopped until an adopting driver's rendezvous timeout.
    IgnoreKeeperSignals();
    setpgid(0, w);
  }
  ssize_t ignored = write(report, &w, sizeof w);
  (void)ignored;
  if (w < 0) _exit(127);
  int devnull = open("/dev/null", O_RDWR);
  if (devnull >= 0) {
    dup2(devnull, 0);
    dup2(devnull, 1);
    dup2(devnull, 2);
  }
  CloseDescriptorsFrom(3);
  char* no_env[] = {nullptr};
  execve(keeper, keeper_argv, no_env);
  int status = 0;
  while (waitpid(w, &status, 0) < 0 && errno == EINTR) {
  }
  setpgid(0, 0);  // out of the program's group before that group is killed
  kill(-w, SIGKILL);
  ExitLike(status);
}

std::string KeptStatusPath(const std::string& dir, pid_t pid) {
  return dir + "/" + std::to_string(pid);
}

// A pidfd's process has ended (it is readable).
bool Ended(int pidfd) {
  pollfd gone{pidfd, POLLIN, 0};
  return poll(&gone, 1, 0) == 1;
}

}  // namespace

int RunStatusKeeper(int argc, char** argv) {
  if (argc != 3 || std::string(argv[1]) != kStatusKeeperFlag) return 2;
  const std::string dir = argv[2];
  IgnoreKeeperSignals();
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  // Its one child: the program (started before the exec that made this process the keeper).
  siginfo_t info{};
  while (waitid(P_ALL, 0, &info, WEXITED | WNOWAIT) != 0) {
    if (errno != EINTR) return 127;
  }
  pid_t program = info.si_pid;
  // What it left in its group goes with it (Process::TryReap says why), while its pid, the
  // group's id, cannot be taken by another process. This keeper leaves that group first.
  setpgid(0, 0);
  kill(-program, SIGKILL);
  int status = 0;
  while (waitpid(program, &status, 0) < 0 && errno == EINTR) {
  }
  const std::string path = KeptStatusPath(dir, program);
  const std::string tmp = path + ".tmp";
  const std::string text = std::to_string(status) + "\n";
  int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd >= 0) {
    bool wrote = write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
    close(fd);
    if (!wrote || rename(tmp.c_str(), path.c_str()) != 0) unlink(tmp.c_str());
  }
  ExitLike(status);
}

StatusOr<int> KeptStatus(const std::string& status_dir, pid_t pid, bool remove) {
  const std::string path = KeptStatusPath(status_dir, pid);
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return NotFound("no status recorded for process " + std::to_string(pid));
  char buf[32] = {0};
  ssize_t got = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (remove) unlink(path.c_str());
  char* end = nullptr;
  long v = got > 0 ? std::strtol(buf, &end, 10) : -1;
  if (got <= 0 || end == buf || *end != '\n' || v < 0 || v > 0xffff) {
    return InvalidArgument(path + " is not a recorded wait status");
  }
  return static_cast<int>(v);
}

bool IsStatusKeeper(pid_t pid, const std::string& status_dir) {
  if (pid <= 1) return false;
  int fd = open(("/proc/" + std::to_string(pid) + "/cmdline").c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[4096];
  ssize_t got = read(fd, buf, sizeof buf);
  close(fd);
  if (got <= 0) return false;
  std::vector<std::string> args;
  std::string cur;
  for (ssize_t i = 0; i < got; ++i) {
    if (buf[i] == '\0') {
      args.push_back(cur);
      cur.clear();
    } else {
      cur += buf[i];
    }
  }
  return args.size() == 3 && args[1] == kStatusKeeperFlag && args[2] == status_dir;
}

StatusOr<std::unique_ptr<Process>> Process::Start(const LaunchSpec& spec) {
  if (spec.argv.empty()) return InvalidArgument("no command to run");
  ASSIGN_OR_RETURN(std::string program, FindProgram(spec.argv[0]));
  // Checked before any descriptor is made: a refused start leaves nothing open.
  if (spec.stdin_data.size() > 65536) return InvalidArgument("stdin data over 64 KiB");
  if (spec.stdout_file.empty() != spec.stderr_file.empty()) {
    return InvalidArgument("stdout_file and stderr_file go together");
  }
  ChildPipes pipes;
  RETURN_IF_ERROR(OpenChildPipes(spec, &pipes));
  // Everything the child needs is built before fork: only async-signal-safe calls after it.
  std::vector<std::string> env_strings = MergedEnvironment(spec.env);
  std::vector<char*> envp, argv;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = spec.argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t parent = getpid();
  const bool keep = !spec.status_dir.empty();
  std::string keeper_flag = kStatusKeeperFlag, keeper_dir = spec.status_dir,
              keeper_name = "elastic-run";
  char* keeper_argv[] = {keeper_name.data(), keeper_flag.data(), keeper_dir.data(), nullptr};
  int report[2] = {-1, -1};
  if (keep && pipe2(report, O_CLOEXEC) != 0) {
    std::string why = std::string("pipe: ") + strerror(errno);
    pipes.CloseAll();
    return Internal(why);
  }

  pid_t pid = fork();
  if (pid < 0) {
    std::string why = std::string("fork: ") + strerror(errno);
    pipes.CloseAll();
    if (keep) {
      close(report[0]);
      close(report[1]);
    }
    return Internal(why);
  }
  if (pid == 0 && keep) {
    KeepChild(spec, pipes, program.c_str(), argv.data(), envp.data(),
              spec.keeper_program.c_str(), keeper_argv, report[1]);
  }
  if (pid == 0) ExecChild(spec, pipes, parent, program, argv.data(), envp.data());
  // Also here, so the group exists before the driver signals it. Not for a keeper, which
  // moves into its program's group (KeepChild) before the driver learns the program's pid.
  if (!keep) setpgid(pid, pid);
  pid_t keeper = 0;
  if (keep) {
    // The program's pid, from the keeper: written right after its fork.
    close(report[1]);
    pid_t program_pid = -1;
    ssize_t got;
    while ((got = read(report[0], &program_pid, sizeof program_pid)) < 0 && errno == EINTR) {
    }
    close(report[0]);
    if (got != sizeof program_pid || program_pid <= 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
      pipes.CloseAll();
      return Internal("the status keeper could not start the program (fork failed)");
    }
    keeper = pid;
    pid = program_pid;
    // A status left by an earlier process that had this pid is not this one's.
    unlink(KeptStatusPath(spec.status_dir, pid).c_str());
  }
  close(pipes.out[1]);
  close(pipes.err[1]);
  if (pipes.in[1] >= 0) {
    close(pipes.in[0]);
    // Fits the pipe's buffer: never blocks. A child that is already gone gets EPIPE (ignored).
    ssize_t ignored = write(pipes.in[1], spec.stdin_data.data(), spec.stdin_data.size());
    (void)ignored;
    if (!spec.keep_stdin_open) {
      close(pipes.in[1]);
      pipes.in[1] = -1;
    }
  }
  fcntl(pipes.out[0], F_SETFL, O_NONBLOCK);
  fcntl(pipes.err[0], F_SETFL, O_NONBLOCK);
  std::unique_ptr<Process> p(new Process());
  p->output_in_files_ = !spec.stdout_file.empty();
  p->pid_ = pid;
  p->out_fd_ = pipes.out[0];
  p->err_fd_ = pipes.err[0];
  p->in_fd_ = pipes.in[1];
  p->keeper_ = keeper;
  p->status_dir_ = spec.status_dir;
  p->pidfd_ = static_cast<int>(syscall(SYS_pidfd_open, keep ? keeper : pid, 0));
  if (p->pidfd_ < 0) {
    std::string why = std::string("pidfd_open: ") + strerror(errno);
    kill(-pid, SIGKILL);
    return Internal(why);  // p's destructor closes the pipes and reaps the child
  }
  // -1 when the program is already gone (and reaped by its keeper): its keeper's end says so.
  if (keep) p->program_pidfd_ = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  return p;
}

namespace {

// Positions `fd` (a file opened for reading) at `offset`, or at its end when the offset is
// unknown or past the end (the file was replaced).
void SeekTo(int fd, int64_t offset) {
  struct stat st;
  if (offset >= 0 && fstat(fd, &st) == 0 && offset <= st.st_size) {
    lseek(fd, static_cast<off_t>(offset), SEEK_SET);
  } else {
    lseek(fd, 0, SEEK_END);
  }
}

}  // namespace

int64_t Process::stdout_offset() const {
  return output_in_files_ && out_fd_ >= 0 ? static_cast<int64_t>(lseek(out_fd_, 0, SEEK_CUR)) : -1;
}

int64_t Process::stderr_offset() const {
  return output_in_files_ && err_fd_ >= 0 ? static_cast<int64_t>(lseek(err_fd_, 0, SEEK_CUR)) : -1;
}

StatusOr<std::unique_ptr<Process>> Process::Adopt(pid_t pid, const std::string& stdout_file,
                                                  const std::string& stderr_file,
                                                  int64_t stdout_offset, int64_t stderr_offset,
                                                  pid_t keeper, const std::string& status_dir) {
  std::unique_ptr<Process> p(new Process());
  p->adopted_ = true;
  p->pid_ = pid;
  p->pidfd_ = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (p->pidfd_ < 0) {
    if (errno == ESRCH) return NotFound("process " + std::to_string(pid) + " is gone");
    return Internal(std::string("pidfd_open: ") + strerror(errno));
  }
  if (keeper > 1 && !status_dir.empty()) {
    // Its end is watched through its keeper, which records how it ended before it exits;
    // checked after the pidfd is open, so the pid cannot be another keeper's by then.
    int keeper_fd = static_cast<int>(syscall(SYS_pidfd_open, keeper, 0));
    if (keeper_fd >= 0 && IsStatusKeeper(keeper, status_dir)) {
      p->program_pidfd_ = p->pidfd_;
      p->pidfd_ = keeper_fd;
      p->keeper_ = keeper;
      p->status_dir_ = status_dir;
    } else if (keeper_fd >= 0) {
      close(keeper_fd);
    }
  }
  if (!stdout_file.empty() && !stderr_file.empty()) {
    int out = open(stdout_file.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    int err = open(stderr_file.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (out >= 0 && err >= 0) {
      SeekTo(out, stdout_offset);
      SeekTo(err, stderr_offset);
      p->out_fd_ = out;
      p->err_fd_ = err;
      p->output_in_files_ = true;
    } else {
      if (out >= 0) close(out);
      if (err >= 0) close(err);
    }
  }
  return p;
}

Process::~Process() {
  CloseStdout();
  CloseStderr();
  CloseStdin();
  if (pidfd_ >= 0) close(pidfd_);
  if (program_pidfd_ >= 0) close(program_pidfd_);
  if (adopted_) return;  // not a child: nothing to reap, and its end is the driver's decision
  if (!reaped_ && pid_ > 0) {
    kill(-pid_, SIGKILL);
    waitpid(keeper_ > 0 ? keeper_ : pid_, nullptr, 0);
  }
}

void Process::CloseStdout() {
  if (out_fd_ >= 0) close(out_fd_);
  out_fd_ = -1;
}

void Process::CloseStdin() {
  if (in_fd_ >= 0) close(in_fd_);
  in_fd_ = -1;
}

bool Process::WriteStdin(const std::string& text) {
  if (in_fd_ < 0) return false;
  int flags = fcntl(in_fd_, F_GETFL);
  if (flags >= 0 && !(flags & O_NONBLOCK)) fcntl(in_fd_, F_SETFL, flags | O_NONBLOCK);
  ssize_t wrote = write(in_fd_, text.data(), text.size());
  return wrote == static_cast<ssize_t>(text.size());
}

void Process::CloseStderr() {
  if (err_fd_ >= 0) close(err_fd_);
  err_fd_ = -1;
}

void Process::SignalGroup(int sig) const {
  if (pid_ <= 0) return;
  if (sig == SIGKILL && keeper_ > 0) {
    // The keeper is a member of the group (KeepChild) and must outlive the program to record
    // how it ended: the program alone is killed, and the keeper, continued should it be
    // stopped, kills the rest of the group once it has reaped it (RunStatusKeeper).
    kill(pid_, SIGKILL);
    kill(keeper_, SIGCONT);
    return;
  }
  kill(-pid_, sig);
}

bool Process::TryReap(int* code) {
  if (!reaped_ && adopted_) {
    if (!Ended(pidfd_)) return false;
    if (keeper_ > 0) {
      auto kept = KeptStatus(status_dir_, pid_, true);
      if (!kept.ok() && program_pidfd_ >= 0 && !Ended(program_pidfd_)) {
        // The keeper was killed, the program runs on: watched directly from now on.
        close(pidfd_);
        pidfd_ = program_pidfd_;
        program_pidfd_ = -1;
        keeper_ = 0;
        return false;
      }
      if (kept.ok()) {
        raw_status_ = *kept;
        status_known_ = true;
      }
    }
    reaped_ = true;
  }
  if (adopted_ && !status_known_) {
    *code = -1;
    return true;
  }
  if (!reaped_ && keeper_ > 0) {
    // The keeper ends once it has killed what the program left in its group, reaped it and
    // recorded its status, and ends the same way. Killed before the program ended, it takes
    // the program with it here.
    siginfo_t info{};
    if (waitid(P_PID, static_cast<id_t>(keeper_), &info, WEXITED | WNOHANG | WNOWAIT) != 0 ||
        info.si_pid != keeper_) {
      return false;
    }
    if (program_pidfd_ >= 0 && !Ended(program_pidfd_)) {
      syscall(SYS_pidfd_send_signal, program_pidfd_, SIGKILL, nullptr, 0);
      kill(-pid_, SIGKILL);
    }
    int status = 0;
    if (waitpid(keeper_, &status, WNOHANG) != keeper_) return false;
    reaped_ = true;
    raw_status_ = status;
    CloseStdin();
    unlink(KeptStatusPath(status_dir_, pid_).c_str());
  }
  if (!reaped_) {
    // Ended? (Looked at without reaping it: while the child is a zombie its pid, the id of
    // its process group, cannot be taken by another process.) What it left in its group
    // goes with it: a PyTorch worker's DataLoader processes, say, which otherwise outlive a
    // killed worker by up to 5 s (their own check of their parent) and the job with it (found
    // by the python soak, seed 11757255 job 15).
    siginfo_t info{};
    if (waitid(P_PID, static_cast<id_t>(pid_), &info, WEXITED | WNOHANG | WNOWAIT) != 0 ||
        info.si_pid != pid_) {
      return false;
    }
    kill(-pid_, SIGKILL);
    int status = 0;
    pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r != pid_) return false;
    reaped_ = true;
    raw_status_ = status;
    CloseStdin();
  }
  *code = WIFEXITED(raw_status_) ? WEXITSTATUS(raw_status_) : 128 + WTERMSIG(raw_status_);
  return true;
}

std::string Process::DescribeExit() const {
  if (!reaped_) return "still running";
  if (adopted_ && !status_known_) {
    return "an end whose status is unknown (adopted: not this driver's child)";
  }
  const std::string by_keeper = adopted_ ? " (recorded by its status keeper)" : "";
  if (WIFEXITED(raw_status_)) {
    return "exit status " + std::to_string(WEXITSTATUS(raw_status_)) + by_keeper;
  }
  int sig = WTERMSIG(raw_status_);
  return "signal " + std::to_string(sig) + " (" + strsignal(sig) + ")" + by_keeper;
}

StatusOr<Captured> RunToEnd(const LaunchSpec& spec, Duration timeout, size_t max_output,
                            const std::function<bool()>& stop) {
  ASSIGN_OR_RETURN(std::unique_ptr<Process> proc, Process::Start(spec));
  Captured r;
  const TimePoint deadline = SteadyClock::now() + timeout;
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
  int code = 0;
  bool exited = false;
  while (!exited && !r.truncated) {
    auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - SteadyClock::now());
    if (left.count() <= 0 || (stop && stop())) {
      r.timed_out = true;
      break;
    }
    pollfd fds[3] = {{proc->stdout_fd(), POLLIN, 0},
                     {proc->stderr_fd(), POLLIN, 0},
                     {proc->pidfd(), POLLIN, 0}};
    if (poll(fds, 3, static_cast<int>(std::min<long>(left.count(), stop ? 200 : 1000))) < 0 &&
        errno != EINTR) {
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
  // An overrun program goes with its group: SIGTERM first (a reaper, LaunchSpec::
  // reap_orphans, then kills what it left), SIGKILL if that takes more than a moment. The
  // exit is awaited (bounded: after SIGKILL it comes at once).
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

}  // namespace elastic
