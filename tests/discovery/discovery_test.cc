#include "discovery/discovery.h"

#include <unistd.h>

#include <cstdio>

#include <catch2/catch.hpp>
#include <fstream>

namespace elastic::discovery {
namespace {

using std::chrono::seconds;

TEST_CASE("discovery output: host, host:slots, comments, blanks, duplicates", "[unit]") {
  std::vector<std::string> warnings;
  auto hosts =
      ParseHostLines("# cluster\nnode1:4\n\n  node2  # spare\nnode1:2\n10.0.0.5:8\n", 3, &warnings);
  REQUIRE(hosts.ok());
  REQUIRE(hosts->size() == 3);
  CHECK((*hosts)[0] == HostSlots{"node1", 2});
  CHECK((*hosts)[1] == HostSlots{"node2", 3});
  CHECK((*hosts)[2] == HostSlots{"10.0.0.5", 8});
  REQUIRE(warnings.size() == 1);
  CHECK(warnings[0].find("node1") != std::string::npos);
}

TEST_CASE("discovery output: a bad line is an error naming the line", "[unit]") {
  auto [text, needle] = GENERATE(table<std::string, std::string>({
      {"ok:1\nbad host\n", "line 2"},
      {"node:0\n", "outside 1..4096"},
      {"node:4097\n", "outside 1..4096"},
      {"node:abc\n", "not a number"},
      {"node:\n", "not a number"},
      {"-rf:2\n", "not a valid host name"},
      {"a;b:1\n", "not a valid host name"},
  }));
  auto hosts = ParseHostLines(text, 1, nullptr);
  REQUIRE_FALSE(hosts.ok());
  CHECK(hosts.status().code() == Code::kInvalidArgument);
  CHECK(hosts.status().message().find(needle) != std::string::npos);
}

TEST_CASE("host lists given with -H", "[unit]") {
  auto hosts = ParseHostList("a:2,b,c:1", 4);
  REQUIRE(hosts.ok());
  CHECK(*hosts == std::vector<HostSlots>{{"a", 2}, {"b", 4}, {"c", 1}});
  CHECK_FALSE(ParseHostList("", 1).ok());
  CHECK_FALSE(ParseHostList("a:2,,b", 1).ok());
}

std::string TempPath(const std::string& name) {
  return "/tmp/elastic-discovery-test-" + std::to_string(getpid()) + "-" + name;
}

std::vector<pid_t> ReadPids(const std::string& path) {
  std::vector<pid_t> out;
  std::ifstream f(path);
  for (pid_t p; f >> p;) out.push_back(p);
  std::remove(path.c_str());
  return out;
}

// Alive and not a zombie.
bool Alive(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(f, line)) return false;
  size_t paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] != 'Z';
}

TEST_CASE("the script runner: output, exit code, timeout, cap", "[unit]") {
  SECTION("output and stderr") {
    auto r = RunScript("echo host1:2; echo oops >&2; exit 0", seconds(5), 1 << 20);
    REQUIRE(r.ok());
    CHECK(r->out == "host1:2\n");
    CHECK(r->err == "oops\n");
    CHECK(r->exit_code == 0);
  }
  SECTION("a failing script") {
    auto d = Discover("echo broken >&2; exit 3", seconds(5), 1 << 20, 1, nullptr);
    REQUIRE_FALSE(d.ok());
    CHECK(d.status().message().find("exited with status 3") != std::string::npos);
    CHECK(d.status().message().find("broken") != std::string::npos);
  }
  SECTION("a hanging script is killed with everything it started") {
    std::string pids = TempPath("hang");
    auto r = RunScript("sleep 100 & echo $! > " + pids + "; setsid sleep 101 & echo $! >> " +
                           pids + "; sleep 100",
                       std::chrono::milliseconds(500), 1 << 20);
    REQUIRE(r.ok());
    CHECK(r->timed_out);
    auto left = ReadPids(pids);
    CHECK(left.size() == 2);
    for (pid_t p : left) CHECK_FALSE(Alive(p));
  }
  SECTION("the run ends when the script exits, whatever holds its output") {
    std::string pids = TempPath("bg");
    auto start = std::chrono::steady_clock::now();
    auto r = RunScript("echo h:2; (sleep 100; echo late) & echo $! > " + pids +
                           "; setsid sleep 101 & echo $! >> " + pids + "; exit 0",
                       seconds(30), 1 << 20);
    REQUIRE(r.ok());
    CHECK_FALSE(r->timed_out);
    CHECK(r->out == "h:2\n");
    CHECK(std::chrono::steady_clock::now() - start < seconds(20));
    auto left = ReadPids(pids);
    CHECK(left.size() == 2);
    for (pid_t p : left) CHECK_FALSE(Alive(p));
  }
  SECTION("too much output") {
    auto d = Discover("head -c 3000000 /dev/zero", seconds(10), 1 << 20, 1, nullptr);
    REQUIRE_FALSE(d.ok());
    CHECK(d.status().code() == Code::kResourceExhausted);
  }
  SECTION("a script that does not exist") {
    auto d = Discover("/no/such/discover.sh", seconds(5), 1 << 20, 1, nullptr);
    REQUIRE_FALSE(d.ok());
    CHECK(d.status().code() == Code::kNotFound);
    CHECK(d.status().message().find("does not exist") != std::string::npos);
  }
}

TEST_CASE("host table: first-seen order, added, removed, changed", "[unit]") {
  HostTable t(HostTableOptions{});
  auto c1 = t.Update({{"b", 2}, {"a", 1}});
  CHECK(c1.added == std::vector<std::string>{"b", "a"});
  auto c2 = t.Update({{"a", 3}, {"c", 1}});
  CHECK(c2.added == std::vector<std::string>{"c"});
  CHECK(c2.removed == std::vector<std::string>{"b"});
  CHECK(c2.changed == std::vector<std::string>{"a"});
  t.Update({{"c", 1}, {"a", 3}, {"b", 2}});
  auto avail = t.Available();
  REQUIRE(avail.size() == 3);
  CHECK(avail[0].host == "b");  // first seen first, even after coming back
  CHECK(avail[1].host == "a");
  CHECK(avail[2].host == "c");
}

TEST_CASE("host table: blacklist with cooldown on a fake clock", "[unit]") {
  FakeClock clock;
  HostTableOptions o;
  o.clock = &clock;
  o.failure_limit = 2;
  o.cooldown_min = seconds(10);
  o.cooldown_max = seconds(100);
  HostTable t(o);
  t.Update({{"a", 1}, {"b", 1}});
  CHECK_FALSE(t.RecordFailure("a"));
  CHECK_FALSE(t.Blacklisted("a"));
  CHECK(t.RecordFailure("a"));
  CHECK(t.Blacklisted("a"));
  CHECK(t.Available().size() == 1);
  Duration first = t.LastCooldown();
  CHECK(first >= seconds(10));
  CHECK(first <= seconds(15));
  CHECK(t.NextCooldownEnd() == clock.Now() + first);
  clock.Advance(first + seconds(1));
  CHECK_FALSE(t.Blacklisted("a"));
  CHECK(t.Available().size() == 2);
  // Blacklisted again: the cooldown doubles (exponential backoff), capped at the maximum.
  t.RecordFailure("a");
  t.RecordFailure("a");
  CHECK(t.LastCooldown() >= seconds(20));
  for (int i = 0; i < 10; ++i) {
    clock.Advance(seconds(200));
    t.RecordFailure("a");
    t.RecordFailure("a");
  }
  CHECK(t.LastCooldown() <= seconds(100));
}

TEST_CASE("host table: no cooldown range means a permanent blacklist", "[unit]") {
  FakeClock clock;
  HostTableOptions o;
  o.clock = &clock;
  HostTable t(o);
  t.Update({{"a", 1}});
  CHECK(t.RecordFailure("a"));
  clock.Advance(std::chrono::hours(1000));
  CHECK(t.Blacklisted("a"));
  CHECK(t.Available().empty());
  CHECK(t.NextCooldownEnd() == TimePoint::max());
}

}  // namespace
}  // namespace elastic::discovery
