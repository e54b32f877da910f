// The remote side of a launch (driver/launch.h), run for real through /bin/sh: the worker ends
// when the launcher's stdin closes, whatever it does with SIGTERM; signals pass through; the
// exit status comes back. And the template expansion and --driver-address check.
#include "driver/launch.h"

#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

#include "common/process.h"

namespace elastic::driver {
namespace {

bool Alive(pid_t pid) {
  // getline, not an istreambuf_iterator: a process reaped between the open and the read makes
  // read() fail with ESRCH, which libstdc++'s filebuf throws as an exception that only an
  // istream's sentry catches (the test failed once on it: "basic_filebuf::underflow error
  // reading the file: No such process").
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!std::getline(f, text) || text.empty()) return false;
  size_t paren = text.rfind(')');
  return paren != std::string::npos && text.size() > paren + 2 && text[paren + 2] != 'Z';
}

// Waits up to `limit` for `pred`; whether it came true.
template <typename Pred>
bool WaitFor(Pred pred, std::chrono::seconds limit) {
  auto deadline = std::chrono::steady_clock::now() + limit;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

int WaitExit(Process& p, std::chrono::seconds limit) {
  int code = -1;
  WaitFor([&] { return p.TryReap(&code); }, limit);
  return p.reaped() ? code : -1;
}

struct Remote {
  std::unique_ptr<Process> proc;
  std::string pid_file;
};

// Starts RemoteScript around `program` (a /bin/sh snippet) the way the driver starts a
// launcher: the token and a TLS line on a kept stdin.
Remote StartRemote(const std::string& program, int grace = 2) {
  char tmpl[] = "/tmp/launch_test.XXXXXX";
  int fd = mkstemp(tmpl);
  REQUIRE(fd >= 0);
  close(fd);
  Remote r;
  r.pid_file = tmpl;
  std::string body = "echo $$ > " + r.pid_file + "; " + program;
  std::string script = RemoteScript("/", {{"ELASTIC_SLOT", "h:0"}, {"ELASTIC_WORKER_ID", "w-1"}},
                                    {"/bin/sh", "-c", body}, grace);
  LaunchSpec spec;
  spec.argv = {"/bin/sh", "-c", script};
  spec.stdin_data = "the-token\nthe-tls\n\n";
  spec.keep_stdin_open = true;
  auto p = Process::Start(spec);
  REQUIRE(p.ok());
  r.proc = std::move(p).value();
  return r;
}

pid_t ProgramPid(const Remote& r) {
  pid_t pid = 0;
  REQUIRE(WaitFor(
      [&] {
        std::ifstream f(r.pid_file);
        return static_cast<bool>(f >> pid) && pid > 0;
      },
      std::chrono::seconds(30)));
  return pid;
}

// Whether the process has a handler for `sig` (/proc/PID/status, SigCgt): a shell's `trap` is
// in place, an event to wait for instead of a clock (a fixed 200 ms was too little under
// load: a SIGTERM before the trap ended the script or the program with 143, not the 42 of the
// program's trap).
bool Catches(pid_t pid, int sig) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("SigCgt:", 0) == 0) {
      return (std::strtoull(line.c_str() + 7, nullptr, 16) >> (sig - 1)) & 1;
    }
  }
  return false;
}

TEST_CASE("The remote script passes the exit status, the token and the TLS line", "[unit]") {
  Remote r = StartRemote("[ \"$ELASTIC_JOB_TOKEN\" = the-token ] && [ \"$ELASTIC_SLOT\" = h:0 ] "
                         "&& [ \"$ELASTIC_JOB_TLS\" = the-tls ] && exit 3; exit 1");
  CHECK(WaitExit(*r.proc, std::chrono::seconds(30)) == 3);
  unlink(r.pid_file.c_str());
}

TEST_CASE("The remote script dies by the signal that killed the program", "[unit]") {
  Remote r = StartRemote("sleep 1000");
  pid_t pid = ProgramPid(r);
  kill(pid, SIGKILL);
  CHECK(WaitExit(*r.proc, std::chrono::seconds(30)) == 128 + SIGKILL);
  CHECK(r.proc->DescribeExit().find("signal 9") != std::string::npos);
  unlink(r.pid_file.c_str());
}

TEST_CASE("The program ends when the launcher's stdin closes, even one that ignores SIGTERM",
          "[unit]") {
  Remote r = StartRemote("trap '' TERM; while :; do sleep 1; done");
  pid_t pid = ProgramPid(r);
  // The program runs in a session of its own: not in the launcher's process group.
  CHECK(getpgid(pid) != r.proc->pid());
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  CHECK(Alive(pid));
  r.proc->CloseStdin();  // what the driver's death, or a dropped connection, does
  CHECK(WaitFor([&] { return !Alive(pid); }, std::chrono::seconds(30)));
  WaitExit(*r.proc, std::chrono::seconds(30));
  CHECK(r.proc->reaped());
  unlink(r.pid_file.c_str());
}

TEST_CASE("SIGKILL of the launcher's group still ends the program (once stdin closes)",
          "[unit]") {
  Remote r = StartRemote("sleep 1000");
  pid_t pid = ProgramPid(r);
  r.proc->SignalGroup(SIGKILL);
  CHECK(WaitExit(*r.proc, std::chrono::seconds(30)) == 128 + SIGKILL);  // reaping closes stdin
  CHECK(WaitFor([&] { return !Alive(pid); }, std::chrono::seconds(30)));
  unlink(r.pid_file.c_str());
}

TEST_CASE("SIGTERM to the launcher's group reaches the program", "[unit]") {
  Remote r = StartRemote("trap 'exit 42' TERM; while :; do sleep 0.1; done");
  pid_t pid = ProgramPid(r);
  // Both traps in place: the launcher script's (it passes SIGTERM on) and the program's.
  REQUIRE(WaitFor([&] { return Catches(r.proc->pid(), SIGTERM) && Catches(pid, SIGTERM); },
                  std::chrono::seconds(30)));
  r.proc->SignalGroup(SIGTERM);
  CHECK(WaitExit(*r.proc, std::chrono::seconds(30)) == 42);
  CHECK_FALSE(Alive(pid));
  unlink(r.pid_file.c_str());
}

// Reads what the launcher's pipe gives until `pred` holds for all of it, for up to `limit`.
template <typename Pred>
std::string ReadUntil(int fd, std::string* text, Pred pred, std::chrono::seconds limit) {
  WaitFor(
      [&] {
        char buf[4096];
        ssize_t got;
        while (fd >= 0 && (got = read(fd, buf, sizeof buf)) > 0) {
          text->append(buf, static_cast<size_t>(got));
        }
        return pred(*text);
      },
      limit);
  return *text;
}

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The header line of a launch's stderr (the first line), parsed.
RemoteWorker Header(Remote& r, std::string* err) {
  ReadUntil(
      r.proc->stderr_fd(), err, [](const std::string& t) { return Contains(t, "\n"); },
      std::chrono::seconds(30));
  auto parsed = ParseRemoteHeader(err->substr(0, err->find('\n')));
  REQUIRE(parsed.ok());
  err->erase(0, err->find('\n') + 1);
  return *parsed;
}

bool DirExists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

TEST_CASE("The remote script relays the worker's output from its files and names it first",
          "[unit]") {
  Remote r = StartRemote("echo out-line; echo err-line >&2; exit 0");
  std::string err, out;
  RemoteWorker w = Header(r, &err);
  CHECK(w.pid == ProgramPid(r));
  CHECK(w.group == -w.pid);  // setsid: its own process group
  CHECK(w.dir.rfind("/tmp/elastic-run.", 0) == 0);
  CHECK(WaitExit(*r.proc, std::chrono::seconds(30)) == 0);
  ReadUntil(
      r.proc->stdout_fd(), &out, [](const std::string& t) { return !t.empty(); },
      std::chrono::seconds(5));
  ReadUntil(
      r.proc->stderr_fd(), &err, [](const std::string& t) { return !t.empty(); },
      std::chrono::seconds(5));
  CHECK(out == "out-line\n");
  CHECK(err == "err-line\n");
  CHECK_FALSE(DirExists(w.dir));  // relayed whole: removed
  unlink(r.pid_file.c_str());
}

// Runs the AttachScript for `w` (its stdout shown up to `stdout_offset`, grace 1 s) as a
// driver that adopted the job does: its stdin's first line, then kept open.
std::unique_ptr<Process> StartAttach(const RemoteWorker& w, int64_t stdout_offset) {
  LaunchSpec spec;
  spec.argv = {"/bin/sh", "-c", AttachScript(w, stdout_offset, 0, 1)};
  spec.stdin_data = "attach\n";
  spec.keep_stdin_open = true;
  auto p = Process::Start(spec);
  REQUIRE(p.ok());
  return std::move(p).value();
}

TEST_CASE("A worker that rides out a lost driver outlives the launcher's stdin, and 'stop' ends it",
          "[unit]") {
  // The program stands in for an agent that lost its driver: it makes the file and trains on.
  Remote r = StartRemote(
      "trap '' TERM; : >\"$ELASTIC_RIDE_OUT_FILE\"; i=0; "
      "while :; do echo \"step $i\"; i=$((i+1)); sleep 0.1; done");
  std::string err;
  RemoteWorker w = Header(r, &err);
  pid_t pid = ProgramPid(r);
  REQUIRE(WaitFor([&] { return DirExists(w.dir + "/ride-out"); }, std::chrono::seconds(30)));
  r.proc->CloseStdin();  // the driver died: its launcher with it
  CHECK(r.proc->stdout_fd() >= 0);
  r.proc->CloseStdout();  // and nothing reads the relays any more
  r.proc->CloseStderr();
  std::this_thread::sleep_for(std::chrono::seconds(3));
  CHECK(Alive(pid));  // past the watcher's 2 s look for the file
  std::ifstream f(w.dir + "/stdout");
  std::string kept((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  CHECK(Contains(kept, "step 25"));  // it wrote on, into its file

  // An attach to a pid that is not that launch's worker (another id in /proc/PID/environ:
  // the pid was reused) finds it gone: it prints what the folder kept past the offset
  // ("step 0\n" had been shown) and removes it.
  w.worker_id = "w-2";
  auto gone = StartAttach(w, 7);
  CHECK(WaitExit(*gone, std::chrono::seconds(30)) == kAttachUnknown);
  std::string out;
  ReadUntil(gone->stdout_fd(), &out, [](const std::string& t) { return Contains(t, "step 25"); },
            std::chrono::seconds(5));
  CHECK(out.rfind("step 1\n", 0) == 0);
  CHECK_FALSE(DirExists(w.dir));
  kill(-pid, SIGKILL);
  CHECK(WaitFor([&] { return !Alive(pid); }, std::chrono::seconds(30)));
  WaitExit(*r.proc, std::chrono::seconds(30));
  unlink(r.pid_file.c_str());
}

TEST_CASE("A driver attaches to a remote worker that rode out its death, and stops it", "[unit]") {
  Remote r = StartRemote(
      "trap '' TERM; : >\"$ELASTIC_RIDE_OUT_FILE\"; i=0; "
      "while :; do echo \"step $i\"; i=$((i+1)); sleep 0.1; done",
      /*grace=*/1);
  std::string err;
  RemoteWorker w = Header(r, &err);
  pid_t pid = ProgramPid(r);
  REQUIRE(WaitFor([&] { return DirExists(w.dir + "/ride-out"); }, std::chrono::seconds(30)));
  r.proc->CloseStdin();
  r.proc->CloseStdout();
  r.proc->CloseStderr();
  std::this_thread::sleep_for(std::chrono::seconds(3));
  REQUIRE(Alive(pid));
  w.worker_id = "w-1";  // the launch's
  auto attach = StartAttach(w, 7);  // "step 0\n" was shown
  std::string out;
  ReadUntil(attach->stdout_fd(), &out,
            [](const std::string& t) { return Contains(t, "step 40"); }, std::chrono::seconds(30));
  CHECK(out.rfind("step 1\n", 0) == 0);  // from the offset on, nothing missed
  CHECK(Contains(out, "step 40\n"));
  CHECK(Alive(pid));
  CHECK(attach->WriteStdin("stop\n"));
  CHECK(WaitFor([&] { return !Alive(pid); }, std::chrono::seconds(30)));
  // It ignores SIGTERM: SIGKILL after the grace period, as its keeper recorded.
  CHECK(WaitExit(*attach, std::chrono::seconds(30)) == 128 + SIGKILL);
  CHECK_FALSE(DirExists(w.dir));
  WaitExit(*r.proc, std::chrono::seconds(30));
  unlink(r.pid_file.c_str());
}

TEST_CASE("An attach exits with the status the worker's keeper recorded after the launch died",
          "[unit]") {
  // The launch script goes with its launcher (SIGKILL of the group, as when the launcher is
  // the driver's child); the worker's keeper, in a session of its own, does not.
  Remote r = StartRemote(
      "trap '' TERM; : >\"$ELASTIC_RIDE_OUT_FILE\"; "
      "while [ ! -e \"${ELASTIC_RIDE_OUT_FILE%/*}/go\" ]; do sleep 0.05; done; exit 5",
      /*grace=*/1);
  std::string err;
  RemoteWorker w = Header(r, &err);
  pid_t pid = ProgramPid(r);
  REQUIRE(WaitFor([&] { return DirExists(w.dir + "/ride-out"); }, std::chrono::seconds(30)));
  r.proc->SignalGroup(SIGKILL);
  WaitExit(*r.proc, std::chrono::seconds(30));  // its stdin closes: the watcher leaves it
  std::this_thread::sleep_for(std::chrono::seconds(3));
  REQUIRE(Alive(pid));
  CHECK(DirExists(w.dir + "/adoptable"));
  w.worker_id = "w-1";
  auto attach = StartAttach(w, 0);
  std::ofstream(w.dir + "/go").close();
  CHECK(WaitExit(*attach, std::chrono::seconds(30)) == 5);
  CHECK_FALSE(Alive(pid));
  CHECK(WaitFor([&] { return !DirExists(w.dir); }, std::chrono::seconds(30)));
  unlink(r.pid_file.c_str());
}

TEST_CASE("Without the ride-out file, the end of the stdin still ends a worker", "[unit]") {
  Remote r = StartRemote("trap '' TERM; while :; do sleep 0.1; done", /*grace=*/1);
  std::string err;
  RemoteWorker w = Header(r, &err);
  pid_t pid = ProgramPid(r);
  r.proc->CloseStdin();
  CHECK(WaitFor([&] { return !Alive(pid); }, std::chrono::seconds(30)));
  CHECK(WaitExit(*r.proc, std::chrono::seconds(30)) == 128 + SIGKILL);
  CHECK_FALSE(DirExists(w.dir));
  unlink(r.pid_file.c_str());
}

TEST_CASE("A worker ended by 'stop' and SIGKILL of the launcher's group leaves no output folder",
          "[unit]") {
  // What the driver does to a hung worker's launcher: "stop", then SIGKILL of the group, which
  // takes the script and its relays at once; the watcher, in a session of its own, ends the
  // worker and removes the folder.
  Remote r = StartRemote("trap '' TERM; while :; do sleep 0.1; done", /*grace=*/1);
  std::string err;
  RemoteWorker w = Header(r, &err);
  pid_t pid = ProgramPid(r);
  CHECK(r.proc->WriteStdin("stop\n"));
  r.proc->SignalGroup(SIGKILL);
  CHECK(WaitExit(*r.proc, std::chrono::seconds(30)) == 128 + SIGKILL);
  CHECK(WaitFor([&] { return !Alive(pid); }, std::chrono::seconds(30)));
  CHECK(WaitFor([&] { return !DirExists(w.dir); }, std::chrono::seconds(30)));
  unlink(r.pid_file.c_str());
}

TEST_CASE("SIGTERM to the launcher's group leaves no output folder once the worker is gone",
          "[unit]") {
  // The relays die of the SIGTERM too, so the script keeps the folder; the watcher removes it
  // when the launcher's stdin closes (the driver reaped it).
  Remote r = StartRemote("trap 'exit 42' TERM; while :; do sleep 0.1; done", /*grace=*/1);
  std::string err;
  RemoteWorker w = Header(r, &err);
  pid_t pid = ProgramPid(r);
  // Both traps in place: the launcher script's (it passes SIGTERM on) and the program's.
  REQUIRE(WaitFor([&] { return Catches(r.proc->pid(), SIGTERM) && Catches(pid, SIGTERM); },
                  std::chrono::seconds(30)));
  r.proc->SignalGroup(SIGTERM);
  CHECK(WaitExit(*r.proc, std::chrono::seconds(30)) == 42);  // reaping closes stdin
  CHECK(WaitFor([&] { return !Alive(pid); }, std::chrono::seconds(30)));
  CHECK(WaitFor([&] { return !DirExists(w.dir); }, std::chrono::seconds(30)));
  unlink(r.pid_file.c_str());
}

TEST_CASE("'stop' on the stdin ends a worker even while it rides out", "[unit]") {
  Remote r = StartRemote(": >\"$ELASTIC_RIDE_OUT_FILE\"; while :; do sleep 0.1; done");
  std::string err;
  RemoteWorker w = Header(r, &err);
  pid_t pid = ProgramPid(r);
  REQUIRE(WaitFor([&] { return DirExists(w.dir + "/ride-out"); }, std::chrono::seconds(30)));
  CHECK(r.proc->WriteStdin("stop\n"));
  CHECK(WaitFor([&] { return !Alive(pid); }, std::chrono::seconds(30)));
  CHECK(WaitExit(*r.proc, std::chrono::seconds(30)) == 128 + SIGTERM);
  unlink(r.pid_file.c_str());
}

TEST_CASE("A remote header is parsed only when it is one", "[unit]") {
  auto w = ParseRemoteHeader("elastic-remote: 1234 -1234 /tmp/elastic-run.abc");
  REQUIRE(w.ok());
  CHECK(w->pid == 1234);
  CHECK(w->group == -1234);
  CHECK(w->dir == "/tmp/elastic-run.abc");
  for (const char* bad : {"elastic-remote: 1234 -1234", "elastic-remote: 1234 99 /tmp/x",
                          "elastic-remote: 1 1 /tmp/x", "elastic-remote: 12 12 tmp/x",
                          "elastic-remote: 12 12 /tmp/x y", "hello", "",
                          "elastic-remote: 4294967298 4294967298 /tmp/x"}) {
    INFO(bad);
    CHECK_FALSE(ParseRemoteHeader(bad).ok());
  }
}

TEST_CASE("A template is expanded once: what is substituted is never expanded again",
          "[unit]") {
  CHECK(ExpandTemplate("sh -c {command}", "h", "'echo {command} {host}'") ==
        "sh -c 'echo {command} {host}'");
  CHECK(ExpandTemplate("ssh {host} -- {command} {host}", "{command}", "x") ==
        "ssh {command} -- x {command}");
  CHECK(ExpandTemplate("{hos{host}t}", "h", "c") == "{hosht}");
  CHECK(ExpandTemplate("{", "h", "c") == "{");
  CHECK(ExpandTemplate("", "h", "c").empty());
  CHECK(CheckTemplate("kubectl exec -i {host} -- sh -c {command}").ok());
  CHECK(CheckTemplate("ssh {host}").code() == Code::kInvalidArgument);
}

TEST_CASE("The driver address check takes IPv4 addresses and host names, and names anything else", "[unit]") {
  for (const char* good : {"127.0.0.1", "10.1.2.3", "head-node", "node_1.cluster.local",
                           "a", "x1"}) {
    INFO(good);
    CHECK(CheckDriverAddress(good).ok());
  }
  struct Bad {
    const char* address;
    const char* says;
  };
  for (const Bad& b : {Bad{"bad addr", "a space"}, Bad{"", "empty"},
                       Bad{"host:29500", "--port"}, Bad{"::1", "IPv6"},
                       Bad{"[::1]", "IPv6"}, Bad{"a..b", "empty label"},
                       Bad{"-a", "starts with '-'"}, Bad{"a-", "ends with '-'"},
                       Bad{"a/b", "'/'"}}) {
    INFO(b.address);
    Status s = CheckDriverAddress(b.address);
    CHECK(s.code() == Code::kInvalidArgument);
    CHECK(s.message().find(b.says) != std::string::npos);
  }
  CHECK(CheckDriverAddress(std::string(64, 'a')).code() == Code::kInvalidArgument);
  CHECK(CheckDriverAddress(std::string(300, 'a')).code() == Code::kInvalidArgument);
}

}  // namespace
}  // namespace elastic::driver
