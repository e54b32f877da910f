// The remote side of a launch (driver/launch.h), run for real through /bin/sh: the worker ends
// when the launcher's stdin closes, whatever it does with SIGTERM; signals pass through; the
// exit status comes back. And the template expansion and --driver-address check.
#include "driver/launch.h"

#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <fstream>
#include <string>
#include <thread>

#include "common/process.h"

namespace elastic::driver {
namespace {

bool Alive(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (text.empty()) return false;
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
// launcher: the token on a kept stdin.
Remote StartRemote(const std::string& program, int grace = 2) {
  char tmpl[] = "/tmp/launch_test.XXXXXX";
  int fd = mkstemp(tmpl);
  REQUIRE(fd >= 0);
  close(fd);
  Remote r;
  r.pid_file = tmpl;
  std::string body = "echo $$ > " + r.pid_file + "; " + program;
  std::string script = RemoteScript("/", {{"ELASTIC_SLOT", "h:0"}}, {"/bin/sh", "-c", body}, grace);
  LaunchSpec spec;
  spec.argv = {"/bin/sh", "-c", script};
  spec.stdin_data = "the-token\n";
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

TEST_CASE("The remote script passes the exit status and the token", "[unit]") {
  Remote r = StartRemote("[ \"$ELASTIC_JOB_TOKEN\" = the-token ] && [ \"$ELASTIC_SLOT\" = h:0 ] "
                         "&& exit 3; exit 1");
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
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  r.proc->SignalGroup(SIGTERM);
  CHECK(WaitExit(*r.proc, std::chrono::seconds(30)) == 42);
  CHECK_FALSE(Alive(pid));
  unlink(r.pid_file.c_str());
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
