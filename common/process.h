// Child processes (workers, the discovery script): fork/exec in their own process group, with
// stdout/stderr pipes (non-blocking) and a pidfd to poll for the exit.
#pragma once

#include <sys/types.h>
#include <sys/wait.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/status.h"

namespace elastic {

struct LaunchSpec {
  std::vector<std::string> argv;           // program and arguments (argv[0] searched in PATH)
  std::map<std::string, std::string> env;  // added to the driver's environment
  bool die_with_parent = true;  // PR_SET_PDEATHSIG(SIGKILL): dies with the thread that started it
  // Runs the program under a small reaper process (a child subreaper) that, when the program
  // exits, kills whatever it left behind, even children that left its process group
  // (setsid), and then exits with the program's status. The reaper alone is in the group
  // SignalGroup reaches: SIGTERM to it kills the program's group, then the rest as above.
  // For short-lived helpers such as the discovery script.
  bool reap_orphans = false;
  // Written to the process's stdin, which then ends (at most 64 KiB: it must fit the pipe).
  // Empty: stdin is /dev/null. How secrets reach a remote command without a command line.
  std::string stdin_data;
  // With stdin_data: the pipe is not closed after the data but kept open until the process is
  // reaped (or CloseStdin): the program sees EOF on its stdin exactly when this side is gone
  // (this process died, or gave up on the program). The remote side of a launch watches it.
  bool keep_stdin_open = false;
  // Where the program's stdout and stderr go instead of pipes: files it appends to (created
  // 0600), which outlive this process, so the program can write on after it is gone (no
  // SIGPIPE, no EPIPE). stdout_fd() and stderr_fd() then read the files from where they ended
  // when the program started; a read returning 0 means "nothing new yet", not the end, and
  // the descriptors are not pollable (follow them with inotify, see Process::output_in_files).
  // Both or neither.
  std::string stdout_file, stderr_file;
  // Non-empty: the program runs under a status keeper, its parent, which outlives this
  // process. When the program ends, the keeper kills what is left of its process group,
  // writes its wait status to `<status_dir>/<program's pid>` (KeptStatus reads it) and exits
  // with the same status (so a living parent sees the program's end as before). A process
  // that adopts the program after this one died (Process::Adopt) learns how it ended from
  // that file instead of "unknown". The keeper is `keeper_program` (this program by
  // default) run with kStatusKeeperFlag: its main must call RunStatusKeeper. It has an empty
  // environment and /dev/null as its streams, ignores every signal SIGKILL aside, and is a
  // member of the program's process group: while this process lives the group is not an
  // orphan, and when it dies a program stopped then gets the kernel's SIGHUP and SIGCONT (as
  // a program that is this process's child does). pid() stays the program's.
  std::string status_dir;
  std::string keeper_program = "/proc/self/exe";
};

// The first argument that makes a program the status keeper of LaunchSpec::status_dir; its
// main then returns RunStatusKeeper(argc, argv).
inline constexpr const char* kStatusKeeperFlag = "--internal-status-keeper";
// The keeper's main: waits for its one child, records its wait status, and exits with it.
int RunStatusKeeper(int argc, char** argv);
// The wait status a keeper recorded for `pid` in `status_dir`; NOT_FOUND when there is none
// (the keeper has not written it yet, or was killed). `remove`: the file goes once read.
StatusOr<int> KeptStatus(const std::string& status_dir, pid_t pid, bool remove);
// Whether `pid` is a status keeper of `status_dir` (its command line says so).
bool IsStatusKeeper(pid_t pid, const std::string& status_dir);

// Lowers the calling thread's nice value by `boost` (threads it starts later inherit it), where
// this process may (root, CAP_SYS_NICE, or RLIMIT_NICE allowing it); processes started later
// by Process::Start run at the nice value from before. Returns the new nice value, or the
// reason it stayed. The driver calls it first thing: on a machine whose cores its workers
// keep busy, its reaction to a failure (aborts, the next round) waited for a time slice.
StatusOr<int> RaiseOwnPriority(int boost);

// This process's environment variable `name`, or "" when it is not set.
std::string Env(const char* name);

// An on/off switch from the environment: 1, true, yes, on (any case) are on; 0, false, no, off
// and the empty string are off; unset, or any other value, is `dflt`. One convention for every
// ELASTIC_* switch: a variable set to 0 never turns a thing on.
bool EnvFlag(const char* name, bool dflt);

class Process {
 public:
  // Starts the process; NOT_FOUND (exit 127 semantics) when argv[0] cannot be executed.
  static StatusOr<std::unique_ptr<Process>> Start(const LaunchSpec& spec);
  // A process this one did not start (a worker of the driver before it, driver/journal.h):
  // watched through a pidfd, its output followed in its files from the offsets given (what
  // the driver before had read; past a file's end, or negative: from the end; empty paths: no
  // output). It cannot be reaped: TryReap says it ended once it is gone, with an unknown
  // status (code -1; DescribeExit says so). NOT_FOUND when it is gone already.
  // With a keeper (LaunchSpec::status_dir: the keeper's pid and that folder), its end is
  // watched through the keeper instead, and TryReap gives the status it recorded.
  static StatusOr<std::unique_ptr<Process>> Adopt(pid_t pid, const std::string& stdout_file,
                                                  const std::string& stderr_file,
                                                  int64_t stdout_offset = -1,
                                                  int64_t stderr_offset = -1,
                                                  pid_t keeper = 0,
                                                  const std::string& status_dir = "");
  ~Process();  // closes the fds; does not kill (the driver decides)

  pid_t pid() const { return pid_; }
  // The status keeper's pid (LaunchSpec::status_dir), or 0.
  pid_t keeper() const { return keeper_; }
  int stdout_fd() const { return out_fd_; }
  int stderr_fd() const { return err_fd_; }
  int pidfd() const { return pidfd_; }
  // True when stdout and stderr are files (LaunchSpec::stdout_file), not pipes.
  bool output_in_files() const { return output_in_files_; }
  // How far this driver has read each output file (-1: not files, or unknown).
  int64_t stdout_offset() const;
  int64_t stderr_offset() const;
  void CloseStdout();
  void CloseStderr();
  // Closes the kept stdin (LaunchSpec::keep_stdin_open): the program sees EOF. Also done when
  // the process is reaped.
  void CloseStdin();
  // Writes a short message (well under the pipe's buffer) to the kept stdin without blocking;
  // false when it is closed or full, or the process is gone (EPIPE; SIGPIPE must be ignored).
  bool WriteStdin(const std::string& text);
  // Sends `sig` to the whole process group. Safe after exit (the group may be gone). With a
  // status keeper, SIGKILL goes to the program alone: its keeper, a member of the group,
  // kills the rest once it has recorded the program's end.
  void SignalGroup(int sig) const;
  // Reaps the process if it has exited: true and its code (exit status, or 128+signal).
  bool TryReap(int* code);
  bool reaped() const { return reaped_; }
  bool adopted() const { return adopted_; }
  // Whether TryReap's code is how the program ended: always for a child, for an adopted one
  // when its keeper recorded it.
  bool status_known() const { return !adopted_ || status_known_; }
  // Reaped, and it ended by exit() rather than by a signal.
  bool exited_normally() const { return reaped_ && status_known() && WIFEXITED(raw_status_); }
  // "exit status 3" or "signal 9 (Killed)".
  std::string DescribeExit() const;

 private:
  pid_t pid_ = -1;
  int out_fd_ = -1, err_fd_ = -1, in_fd_ = -1, pidfd_ = -1;
  bool reaped_ = false;
  bool output_in_files_ = false;
  bool adopted_ = false;
  bool status_known_ = false;
  pid_t keeper_ = 0;
  int program_pidfd_ = -1;  // with a keeper: the program's own pidfd (pidfd_ is the keeper's)
  std::string status_dir_;
  int raw_status_ = 0;
};

// Removes what a dead process left in /dev/shm: the host segments it made
// ("/dev/shm/elastic-<pid>-<token>", worker_agent/shm_group.cc), whose names live only until
// every rank of the host has mapped them; a process killed in between leaves one. Called by
// whoever reaps the process, so the pid cannot have been reused yet. Returns how many went.
int RemoveShmSegmentsOf(pid_t pid);
// Removes the host segments of processes that are gone (a job killed whole, driver and
// workers at once, leaves its workers' segments behind: nobody saw them die). Returns how
// many went.
int RemoveStaleShmSegments();

// Resolves a program name through PATH as execvp would. NOT_FOUND when it is not there or
// not executable.
StatusOr<std::string> FindProgram(const std::string& name);

// What RunToEnd saw of a short-lived program (a discovery script, a launcher).
struct Captured {
  int exit_code = 0;       // 128+signal when killed
  bool timed_out = false;  // past its deadline, or stopped: its group was killed
  bool truncated = false;  // stdout over the cap
  std::string out;         // stdout, at most the cap
  std::string err;         // the last 8 KiB of stderr
};
// Starts `spec` and runs it to its end, reading its output: its own exit ends the run, not a
// child it left in the background holding its pipes. Past `timeout`, when `stop` (if given)
// says so, or when stdout goes over `max_output`, its group gets SIGTERM, and SIGKILL 2 s
// later; its end is awaited. Errors are only for failing to start it.
StatusOr<Captured> RunToEnd(const LaunchSpec& spec, Duration timeout, size_t max_output,
                            const std::function<bool()>& stop = nullptr);

// Quotes a word for /bin/sh.
std::string ShellQuote(const std::string& s);

}  // namespace elastic
