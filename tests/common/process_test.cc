// Child processes (common/process.h): descriptors, the kept stdin, and EnvFlag.
#include "common/process.h"

#include <dirent.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

namespace elastic {
namespace {

int OpenDescriptors() {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  REQUIRE(d != nullptr);
  while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
  closedir(d);
  return n;
}

// Waits (bounded) for the process to exit; its code, or -1 when it did not.
int WaitExit(Process& p, std::chrono::seconds limit) {
  auto deadline = std::chrono::steady_clock::now() + limit;
  int code = -1;
  while (!p.TryReap(&code)) {
    if (std::chrono::steady_clock::now() > deadline) return -1;
    pollfd fd{p.pidfd(), POLLIN, 0};
    poll(&fd, 1, 100);
  }
  return code;
}

TEST_CASE("A start refused for stdin data over 64 KiB leaves no descriptor open", "[unit]") {
  int before = OpenDescriptors();
  LaunchSpec spec;
  spec.argv = {"true"};
  spec.stdin_data = std::string(65537, 'x');
  auto p = Process::Start(spec);
  CHECK(p.status().code() == Code::kInvalidArgument);
  CHECK(OpenDescriptors() == before);
}

TEST_CASE("A start of a program that is not there leaves no descriptor open", "[unit]") {
  int before = OpenDescriptors();
  LaunchSpec spec;
  spec.argv = {"/no/such/program"};
  spec.stdin_data = "token\n";
  CHECK(Process::Start(spec).status().code() == Code::kNotFound);
  CHECK(OpenDescriptors() == before);
}

TEST_CASE("stdin data reaches the program, and then EOF", "[unit]") {
  LaunchSpec spec;
  spec.argv = {"/bin/sh", "-c", "read -r a; read -r b && exit 9; [ \"$a\" = secret ] && exit 7"};
  spec.stdin_data = "secret\n";
  auto p = Process::Start(spec);
  REQUIRE(p.ok());
  CHECK(WaitExit(**p, std::chrono::seconds(30)) == 7);
}

// The python soak (seed 11757255, job 15): a PyTorch worker killed by SIGKILL left its
// DataLoader processes, in its process group, running after the job had ended.
TEST_CASE("A reaped process takes what it left in its process group with it", "[unit]") {
  LaunchSpec spec;
  spec.argv = {"/bin/sh", "-c", "sleep 600 & echo $!; exit 3"};
  auto p = Process::Start(spec);
  REQUIRE(p.ok());
  CHECK(WaitExit(**p, std::chrono::seconds(30)) == 3);
  std::string out;
  char buf[64];
  ssize_t got;
  while ((got = read((*p)->stdout_fd(), buf, sizeof buf)) > 0) out.append(buf, got);
  const pid_t child = static_cast<pid_t>(std::atol(out.c_str()));
  REQUIRE(child > 0);
  // The oracle is /proc: the child is gone (or a zombie of init's, as good as gone).
  auto alive = [child] {
    std::string stat;
    FILE* f = std::fopen(("/proc/" + std::to_string(child) + "/stat").c_str(), "r");
    if (!f) return false;
    char line[512] = {0};
    size_t n = std::fread(line, 1, sizeof line - 1, f);
    std::fclose(f);
    stat.assign(line, n);
    size_t close = stat.rfind(')');
    return close != std::string::npos && close + 2 < stat.size() && stat[close + 2] != 'Z';
  };
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (alive() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  CHECK_FALSE(alive());
  if (alive()) kill(child, SIGKILL);
}

TEST_CASE("A kept stdin gives the program EOF only when it is closed", "[unit]") {
  LaunchSpec spec;
  // The first line, then it waits for EOF: exit 5 once stdin ends.
  spec.argv = {"/bin/sh", "-c", "read -r a; [ \"$a\" = tok ] || exit 1; "
                                "while read -r _; do :; done; exit 5"};
  spec.stdin_data = "tok\n";
  spec.keep_stdin_open = true;
  auto started = Process::Start(spec);
  REQUIRE(started.ok());
  Process& p = **started;
  // Still running: its stdin has not ended.
  pollfd fd{p.pidfd(), POLLIN, 0};
  CHECK(poll(&fd, 1, 300) == 0);
  int code = 0;
  CHECK_FALSE(p.TryReap(&code));
  p.CloseStdin();
  CHECK(WaitExit(p, std::chrono::seconds(30)) == 5);
}

// Everything readable from a file descriptor now (regular files: up to the end).
std::string ReadAll(int fd) {
  std::string out;
  char buf[256];
  ssize_t got;
  while ((got = read(fd, buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(got));
  return out;
}

std::string FileText(const std::string& path) {
  FILE* f = fopen(path.c_str(), "r");
  if (f == nullptr) return "<missing>";
  std::string out;
  char buf[256];
  size_t got;
  while ((got = fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, got);
  fclose(f);
  return out;
}

TEST_CASE("Output files: the reader starts at their end, and the program outlives its reader",
          "[unit]") {
  char tmpl[] = "/tmp/elastic-process-test-XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  const std::string dir = tmpl, out = dir + "/stdout", err = dir + "/stderr";
  {
    FILE* f = fopen(out.c_str(), "w");
    REQUIRE(f != nullptr);
    fputs("an earlier launch\n", f);
    fclose(f);
  }
  LaunchSpec spec;
  // Writes, waits for its stdin to end, writes again: with pipes, whose reader is gone by
  // then, the second echo would die of SIGPIPE (sh reports 141).
  spec.argv = {"/bin/sh", "-c",
               "read -r a; echo one; echo bad >&2; "
               "while read -r _; do :; done; echo two; exit 3"};
  spec.stdin_data = "go\n";
  spec.keep_stdin_open = true;
  spec.stdout_file = out;
  spec.stderr_file = err;
  auto started = Process::Start(spec);
  REQUIRE(started.ok());
  Process& p = **started;
  CHECK(p.output_in_files());
  std::string seen;
  for (int i = 0; i < 300 && seen.find("one\n") == std::string::npos; ++i) {
    seen += ReadAll(p.stdout_fd());  // 0 means "nothing yet", never the end
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK(seen == "one\n");
  p.CloseStdout();
  p.CloseStderr();
  p.CloseStdin();
  CHECK(WaitExit(p, std::chrono::seconds(30)) == 3);
  CHECK(FileText(out) == "an earlier launch\none\ntwo\n");
  CHECK(FileText(err) == "bad\n");
  struct stat st;
  REQUIRE(stat(err.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  unlink(out.c_str());
  unlink(err.c_str());
  rmdir(dir.c_str());
}

TEST_CASE("Output files that cannot be opened refuse the start, leaving no descriptor open",
          "[unit]") {
  int before = OpenDescriptors();
  LaunchSpec spec;
  spec.argv = {"/bin/true"};
  spec.stdout_file = "/nonexistent-dir/stdout";
  spec.stderr_file = "/nonexistent-dir/stderr";
  auto p = Process::Start(spec);
  REQUIRE_FALSE(p.ok());
  CHECK(p.status().message().find("/nonexistent-dir/stdout") != std::string::npos);
  CHECK(OpenDescriptors() == before);
}

TEST_CASE("A kept stdin closes by itself when the process is destroyed", "[unit]") {
  int before = OpenDescriptors();
  {
    LaunchSpec spec;
    spec.argv = {"/bin/sh", "-c", "read -r a; exit 0"};
    spec.stdin_data = "tok\n";
    spec.keep_stdin_open = true;
    auto p = Process::Start(spec);
    REQUIRE(p.ok());
    CHECK(WaitExit(**p, std::chrono::seconds(30)) == 0);
  }
  CHECK(OpenDescriptors() == before);
}

TEST_CASE("EnvFlag: one on/off convention, and 0 never turns a thing on", "[unit]") {
  const char* name = "ELASTIC_TEST_ENV_FLAG";
  unsetenv(name);
  CHECK(EnvFlag(name, false) == false);
  CHECK(EnvFlag(name, true) == true);
  for (const char* on : {"1", "true", "TRUE", "yes", "On"}) {
    setenv(name, on, 1);
    CHECK(EnvFlag(name, false));
  }
  for (const char* off : {"0", "false", "No", "off", ""}) {
    setenv(name, off, 1);
    CHECK_FALSE(EnvFlag(name, true));
  }
  setenv(name, "maybe", 1);
  CHECK(EnvFlag(name, true));
  CHECK_FALSE(EnvFlag(name, false));
  unsetenv(name);
}

}  // namespace
}  // namespace elastic

namespace elastic {
namespace {

// The descriptors a process holds, as numbers (from /proc/PID/fd).
std::vector<int> DescriptorsOf(pid_t pid) {
  std::vector<int> out;
  DIR* d = opendir(("/proc/" + std::to_string(pid) + "/fd").c_str());
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] != '.') out.push_back(std::atoi(e->d_name));
  }
  closedir(d);
  return out;
}

TEST_CASE("The orphan reaper holds none of this process's other descriptors", "[unit]") {
  // A kept stdin of another child: the reaper (which never execs) must not keep it open.
  LaunchSpec kept;
  kept.argv = {"/bin/sh", "-c", "read -r a; while read -r _; do :; done; exit 5"};
  kept.stdin_data = "tok\n";
  kept.keep_stdin_open = true;
  auto first = Process::Start(kept);
  REQUIRE(first.ok());
  LaunchSpec reaped;
  reaped.argv = {"sleep", "30"};
  reaped.reap_orphans = true;
  auto second = Process::Start(reaped);
  REQUIRE(second.ok());
  // The reaper is the started pid; wait (bounded) until it has forked the program.
  pid_t reaper = (*second)->pid();
  for (int i = 0; i < 300 && DescriptorsOf(reaper).size() > 3; ++i) usleep(10 * 1000);
  for (int fd : DescriptorsOf(reaper)) CHECK(fd <= 2);
  (*first)->CloseStdin();
  CHECK(WaitExit(**first, std::chrono::seconds(30)) == 5);
  (*second)->SignalGroup(SIGTERM);  // the reaper kills the program's group, then exits
  CHECK(WaitExit(**second, std::chrono::seconds(30)) != -1);
}

TEST_CASE("Shared-memory segments of processes that are gone are removed, others are kept",
          "[unit]") {
  pid_t dead = fork();
  if (dead == 0) _exit(0);
  REQUIRE(dead > 0);
  REQUIRE(waitpid(dead, nullptr, 0) == dead);  // reaped: the pid names no process now
  std::string gone = "/dev/shm/elastic-" + std::to_string(dead) + "-beef";
  std::string live = "/dev/shm/elastic-" + std::to_string(getpid()) + "-beef";
  std::string other = "/dev/shm/elastic-notapid-beef";
  for (const auto& p : {gone, live, other}) {
    FILE* f = std::fopen(p.c_str(), "w");
    REQUIRE(f != nullptr);
    std::fclose(f);
  }
  // A zombie (dead, not reaped yet: kill(pid, 0) still finds it) maps nothing any more.
  pid_t zombie = fork();
  if (zombie == 0) _exit(0);
  REQUIRE(zombie > 0);
  siginfo_t info{};
  REQUIRE(waitid(P_PID, zombie, &info, WEXITED | WNOWAIT) == 0);  // it exited, still unreaped
  std::string zombie_segment = "/dev/shm/elastic-" + std::to_string(zombie) + "-beef";
  FILE* z = std::fopen(zombie_segment.c_str(), "w");
  REQUIRE(z != nullptr);
  std::fclose(z);
  CHECK(RemoveStaleShmSegments() >= 2);
  CHECK(access(gone.c_str(), F_OK) != 0);
  CHECK(access(zombie_segment.c_str(), F_OK) != 0);
  REQUIRE(waitpid(zombie, nullptr, 0) == zombie);
  CHECK(access(live.c_str(), F_OK) == 0);
  CHECK(access(other.c_str(), F_OK) == 0);
  unlink(live.c_str());
  unlink(other.c_str());
}

}  // namespace
}  // namespace elastic
