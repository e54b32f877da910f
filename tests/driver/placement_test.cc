// --drivers (driver/placement.h): where standbys go, the command line a placed standby gets,
// the launch script run for real through /bin/sh (the standby outlives its launcher, in a
// session of its own, etcd's credentials in its environment and not in its argv), the
// launcher's deadline, and the placer's loop keeping the count as standbys come and go.
#include "driver/placement.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include "common/process.h"

namespace elastic::driver {
namespace {

std::string Slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

bool Alive(pid_t pid) { return kill(pid, 0) == 0; }

struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/elastic-placement-test-XXXXXX";
    REQUIRE(mkdtemp(tmpl) != nullptr);
    path = tmpl;
  }
  ~TempDir() { std::filesystem::remove_all(path); }
};

auto Never = [] { return false; };

TEST_CASE("placement: standbys go to the job's other hosts, one each, in the job's order",
          "[unit]") {
  std::vector<std::string> hosts = {"10.0.0.2", "10.0.0.1", "10.0.0.3", "10.0.0.2",
                                    "localhost", "127.0.0.1", "10.0.0.4"};
  CHECK(ChooseStandbyHosts(hosts, "10.0.0.1", {}, {}, 2) ==
        std::vector<std::string>{"10.0.0.2", "10.0.0.3"});
  // Not where a standby waits, nor where a launch is in flight; never loopback.
  CHECK(ChooseStandbyHosts(hosts, "10.0.0.1", {"10.0.0.2"}, {"10.0.0.3"}, 5) ==
        std::vector<std::string>{"10.0.0.4"});
  CHECK(ChooseStandbyHosts(hosts, "10.0.0.9", {}, {}, 0).empty());
  CHECK(ChooseStandbyHosts({"localhost", "127.0.0.1"}, "127.0.0.1", {}, {}, 3).empty());
}

TEST_CASE("placement: a placed standby's command line is the leader's, less this machine's",
          "[unit]") {
  // The worker's command (the last 3 words) is left as it is, whatever it holds.
  std::vector<std::string> argv = {
      "--state-store", "etcds://e:2379/job", "--state-store-ca", "/a/ca.pem",
      "--state-store-cert=/a/c.pem", "--state-store-key", "/a/c.key", "--driver-address",
      "10.0.0.1", "--job-file=/run/j.json", "--fresh", "--drivers", "3", "-H", "10.0.0.2:2",
      "./train", "--driver-address", "x", "--fresh"};
  CHECK(StandbyArgv(argv, 3, "10.0.0.2") ==
        std::vector<std::string>{"--standby", "--driver-address", "10.0.0.2", "--state-store",
                                 "etcds://e:2379/job", "--drivers", "3", "-H", "10.0.0.2:2",
                                 "./train", "--driver-address", "x", "--fresh"});
  CHECK(StandbyLogPath("/s", "node-1.example") == "/s/driver-node-1.example.log");
  CHECK(StandbyLogPath("/s", "a b/../c") == "/s/driver-a_b_.._c.log");
}

TEST_CASE("placement: the launch script leaves the standby running on its own, with etcd's "
          "credentials in its environment",
          "[unit]") {
  TempDir dir;
  const std::string prog = dir.path + "/fake-driver.sh";
  {
    std::ofstream f(prog);
    // Records what it got, then waits until the test says stop (bounded).
    f << "#!/bin/sh\n"
         "echo \"args:$*\" >\"$0.args\"\n"
         "echo \"tls:$ELASTIC_STATE_STORE_TLS level:$ELASTIC_LOG_LEVEL\" >>\"$0.args\"\n"
         "echo \"sid:$(cut -d' ' -f6 /proc/$$/stat) pid:$$\" >>\"$0.args\"\n"
         "ls -l /proc/$$/fd/0 >>\"$0.args\"\n"
         "echo 'standing by'\n"
         "i=0; while [ ! -e \"$0.stop\" ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done\n";
  }
  REQUIRE(chmod(prog.c_str(), 0755) == 0);
  const std::string state = dir.path + "/state";
  const std::string log = StandbyLogPath(state, "10.0.0.2");
  std::string script = StandbyScript(dir.path, prog, {"--standby", "it's"}, state, log,
                                     {{"ELASTIC_LOG_LEVEL", "debug"}});
  // A launcher as --launcher-template 'sh -c {command}' makes it.
  auto out = RunLauncher({"/bin/sh", "-c", script}, "TLSLINE\n", std::chrono::seconds(10), Never);
  REQUIRE(out.ok());
  auto pid = ParseStandbyPid(*out);
  REQUIRE(pid.ok());
  // The launcher has ended; the standby runs on.
  REQUIRE(Alive(static_cast<pid_t>(*pid)));
  std::string args;
  for (int i = 0; i < 100; ++i) {
    args = Slurp(prog + ".args");
    if (args.find("/dev/null") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  CHECK(args.find("args:--standby it's\n") != std::string::npos);
  CHECK(args.find("tls:TLSLINE level:debug\n") != std::string::npos);
  // A session of its own (its sid is its pid), and /dev/null as its stdin.
  CHECK(args.find("sid:" + std::to_string(*pid) + " pid:" + std::to_string(*pid)) !=
        std::string::npos);
  CHECK(args.find("-> /dev/null") != std::string::npos);
  struct stat st;
  REQUIRE(stat(state.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0700);
  for (int i = 0; i < 100 && Slurp(log).empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  CHECK(Slurp(log) == "standing by\n");
  // The stop script leaves a process that is no standby alone (the fake's argv has
  // "--standby" as a word only because the test gave it; a plain sleep has not).
  auto other = RunLauncher({"/bin/sh", "-c", "sleep 30 & echo $!"}, "", std::chrono::seconds(10),
                           Never);
  REQUIRE(other.ok());
  const pid_t sleeper = static_cast<pid_t>(std::atoi(other->c_str()));
  REQUIRE(sleeper > 0);
  auto gone = RunLauncher({"/bin/sh", "-c", StopStandbyScript(sleeper)}, "",
                          std::chrono::seconds(10), Never);
  REQUIRE(gone.ok());
  CHECK(*gone == "gone\n");
  auto stopped = RunLauncher({"/bin/sh", "-c", StopStandbyScript(*pid)}, "",
                             std::chrono::seconds(10), Never);
  REQUIRE(stopped.ok());
  CHECK(*stopped == "stopped\n");
  for (int i = 0; i < 100 && Alive(static_cast<pid_t>(*pid)); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  CHECK(!Alive(static_cast<pid_t>(*pid)));
  // A standby that exits at once is said so, with the end of its log.
  const std::string bad = dir.path + "/bad-driver.sh";
  std::ofstream(bad) << "#!/bin/sh\necho 'elastic-run: --fresh: not with --standby'\nexit 2\n";
  REQUIRE(chmod(bad.c_str(), 0755) == 0);
  auto failed = RunLauncher({"/bin/sh", "-c", StandbyScript(dir.path, bad, {}, state, log)},
                            "\n", std::chrono::seconds(10), Never);
  CHECK(failed.status().code() == Code::kUnavailable);
  CHECK(failed.status().message().find("exited at once") != std::string::npos);
  CHECK(failed.status().message().find("not with --standby") != std::string::npos);
  CHECK(ParseStandbyPid("elastic-standby: x").status().code() == Code::kInvalidArgument);
  CHECK(ParseStandbyPid("").status().code() == Code::kInvalidArgument);
}

TEST_CASE("placement: this machine is known by its loopback and its interfaces' addresses",
          "[unit]") {
  CHECK(IsThisMachine("127.0.0.1"));
  CHECK(IsThisMachine("localhost"));
  CHECK(IsThisMachine("::1"));
  // TEST-NET-1 (RFC 5737): nobody's address, and a numeric lookup sends nothing.
  CHECK(!IsThisMachine("192.0.2.1"));
  ifaddrs* ifs = nullptr;
  REQUIRE(getifaddrs(&ifs) == 0);
  for (ifaddrs* i = ifs; i; i = i->ifa_next) {
    if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET) {
      char text[INET_ADDRSTRLEN];
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, text,
                sizeof text);
      CHECK(IsThisMachine(text));
    }
  }
  freeifaddrs(ifs);
}

TEST_CASE("placement: a launcher that fails, hangs or is stopped is said so, and killed",
          "[unit]") {
  auto failed = RunLauncher({"/bin/sh", "-c", "echo no route to host >&2; exit 255"}, "x\n",
                            std::chrono::seconds(10), Never);
  CHECK(failed.status().code() == Code::kUnavailable);
  CHECK(failed.status().message().find("status 255: no route to host") != std::string::npos);
  TempDir dir;
  const std::string mark = dir.path + "/child";
  auto start = std::chrono::steady_clock::now();
  auto hung = RunLauncher({"/bin/sh", "-c", "sleep 30 & echo $! >" + mark + "; wait"}, "",
                          std::chrono::milliseconds(500), Never);
  CHECK(hung.status().code() == Code::kDeadlineExceeded);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
  // Its whole group went: the sleep it started too.
  pid_t child = static_cast<pid_t>(std::atoi(Slurp(mark).c_str()));
  REQUIRE(child > 0);
  for (int i = 0; i < 100 && Alive(child); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  CHECK(!Alive(child));
  int asked = 0;
  auto stopped = RunLauncher({"/bin/sh", "-c", "sleep 30"}, "", std::chrono::seconds(30),
                             [&] { return ++asked > 2; });
  CHECK(stopped.status().code() == Code::kDeadlineExceeded);
  CHECK(stopped.status().message() == "stopped");
}

TEST_CASE("placement: the placer keeps drivers - 1 standbys as they come and go", "[unit]") {
  // The listing is what the launches made, less what the test removed (a standby that died).
  std::mutex mu;
  std::vector<StandbyView> listed;
  std::vector<std::string> launches;
  StandbyPlacer::Options o;
  o.drivers = 3;
  o.ttl_seconds = 1;
  o.own_address = "10.0.0.1";
  o.log_dir = "/s";
  o.list = [&]() -> StatusOr<std::vector<StandbyView>> {
    std::lock_guard<std::mutex> g(mu);
    return listed;
  };
  o.launch = [&](const std::string& host, const std::function<bool()>&) -> StatusOr<int64_t> {
    std::lock_guard<std::mutex> g(mu);
    launches.push_back(host);
    if (host == "10.0.0.3") return Unavailable("ssh: connect to host 10.0.0.3: refused");
    StandbyView v;
    v.address = host;
    listed.push_back(v);
    return int64_t{4242};
  };
  auto wait_for = [&](size_t n) {
    for (int i = 0; i < 200; ++i) {
      {
        std::lock_guard<std::mutex> g(mu);
        if (launches.size() >= n) return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  };
  o.is_this_machine = [](const std::string& host) { return host == "10.0.0.5"; };
  StandbyPlacer placer(o);
  placer.SetHosts({"10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"});
  wait_for(3);
  {
    std::lock_guard<std::mutex> g(mu);
    // 10.0.0.3 refused: the next host took its place.
    CHECK(launches == std::vector<std::string>{"10.0.0.2", "10.0.0.3", "10.0.0.4"});
    // The standby on 10.0.0.2 dies (its listing goes).
    listed.erase(listed.begin());
  }
  wait_for(4);
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));  // two more turns
  std::lock_guard<std::mutex> g(mu);
  // Replaced at once (10.0.0.3 is passed over for a while), and no more than that; never on
  // this machine (10.0.0.5, another of its addresses).
  CHECK(launches == std::vector<std::string>{"10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.2"});
  CHECK(listed.size() == 2);
}

TEST_CASE("placement: a standby that never lists itself is stopped, and its host passed over",
          "[unit]") {
  std::mutex mu;
  std::vector<std::string> launches;
  std::vector<std::pair<std::string, int64_t>> stops;
  StandbyPlacer::Options o;
  o.drivers = 2;
  o.ttl_seconds = 1;
  o.own_address = "10.0.0.1";
  o.listing_deadline = std::chrono::milliseconds(600);
  o.back_off = std::chrono::seconds(60);
  o.list = []() -> StatusOr<std::vector<StandbyView>> { return std::vector<StandbyView>{}; };
  o.launch = [&](const std::string& host, const std::function<bool()>&) -> StatusOr<int64_t> {
    std::lock_guard<std::mutex> g(mu);
    launches.push_back(host);
    return int64_t{100} + static_cast<int64_t>(launches.size());
  };
  o.stop = [&](const std::string& host, int64_t pid, const std::function<bool()>&) {
    std::lock_guard<std::mutex> g(mu);
    stops.emplace_back(host, pid);
    return Status::Ok();
  };
  StandbyPlacer placer(o);
  placer.SetHosts({"10.0.0.1", "10.0.0.2", "10.0.0.3"});
  for (int i = 0; i < 300; ++i) {
    {
      std::lock_guard<std::mutex> g(mu);
      if (stops.size() >= 2) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::lock_guard<std::mutex> g(mu);
  // One at a time: the next only once the last was given up on; each stopped by its pid.
  REQUIRE(stops.size() >= 2);
  CHECK(stops[0] == std::make_pair(std::string("10.0.0.2"), int64_t{101}));
  CHECK(stops[1] == std::make_pair(std::string("10.0.0.3"), int64_t{102}));
  // Both hosts are passed over now (60 s): no third launch.
  CHECK(launches == std::vector<std::string>{"10.0.0.2", "10.0.0.3"});
}

}  // namespace
}  // namespace elastic::driver
