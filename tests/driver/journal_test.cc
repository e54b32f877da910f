// The driver's journal (driver/journal.h): every field survives a write and a read, a damaged
// journal is refused naming the field, the folder is held by one driver at a time, and a
// recorded process is told from a later one that reuses its pid.
#include "driver/journal.h"

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace elastic::driver {
namespace {

// A folder of the test's own, removed at the end of the case.
struct TempDir {
  std::string root, state;
  TempDir() {
    char tmpl[] = "/tmp/elastic-journal-test-XXXXXX";
    REQUIRE(mkdtemp(tmpl) != nullptr);
    root = tmpl;
    state = root + "/state";
  }
  ~TempDir() { std::filesystem::remove_all(root); }
};

Journal Sample() {
  Journal j;
  j.argv = {"-np", "2", "./train", "--epochs", "3"};
  j.bind = "0.0.0.0";
  j.driver_addr = "10.0.0.5:4321";
  j.port = 4321;
  j.token = "0123456789abcdef";
  j.restarts = 2;
  j.written_at = 1796300000.25;
  j.core.formed_round = 7;
  j.core.newest_committed = 41;
  rendezvous::Assignment a;
  a.round = 7;
  a.rank = 1;
  a.size = 2;
  a.local_rank = 0;
  a.local_size = 1;
  a.cross_rank = 1;
  a.cross_size = 2;
  a.sync_required = true;
  j.core.formed_members["b:0"] = a;
  j.core.worker_ids = {{"a:0", "id-a"}, {"b:0", "id-b"}};
  j.core.known_slots = {"a:0", "b:0"};
  j.core.removed = {"c:0"};
  j.policy = R"({"format":1,"x":[1,2]})";
  JournalWorker w;
  w.pid = 4242;
  w.start_ticks = 99;
  w.local = false;
  w.host = "b";
  w.stdout_file = "/s/out";
  w.stderr_file = "/s/err";
  w.stdout_offset = 10;
  w.stderr_offset = -1;
  w.remote_dir = "/tmp/elastic-run.abc";
  w.remote_group = -4242;
  j.workers["b:0"] = w;
  return j;
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST_CASE("journal: every field survives a write and a read", "[journal]") {
  TempDir tmp;
  const std::string& dir = tmp.state;
  auto lock = LockStateDir(dir);
  REQUIRE(lock.ok());
  REQUIRE(ReadJournal(dir).status().code() == Code::kNotFound);
  Journal j = Sample();
  REQUIRE(WriteJournal(dir, j).ok());
  struct stat st;
  REQUIRE(stat(dir.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0700);
  REQUIRE(stat(JournalPath(dir).c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);  // it holds the token
  auto back = ReadJournal(dir);
  REQUIRE(back.ok());
  CHECK(back->argv == j.argv);
  CHECK(back->bind == j.bind);
  CHECK(back->driver_addr == j.driver_addr);
  CHECK(back->port == j.port);
  CHECK(back->token == j.token);
  CHECK(back->restarts == j.restarts);
  CHECK(back->written_at == j.written_at);
  CHECK(back->core.formed_round == 7);
  CHECK(back->core.newest_committed == 41);
  REQUIRE(back->core.formed_members.count("b:0") == 1);
  const auto& m = back->core.formed_members.at("b:0");
  CHECK((m.round == 7 && m.rank == 1 && m.size == 2 && m.local_rank == 0 && m.local_size == 1 &&
         m.cross_rank == 1 && m.cross_size == 2 && m.sync_required));
  CHECK(back->core.worker_ids == j.core.worker_ids);
  CHECK(back->core.known_slots == j.core.known_slots);
  CHECK(back->core.removed == j.core.removed);
  CHECK(back->policy == j.policy);
  REQUIRE(back->workers.count("b:0") == 1);
  const JournalWorker& w = back->workers.at("b:0");
  CHECK((w.pid == 4242 && w.start_ticks == 99 && !w.local && w.host == "b" &&
         w.stdout_file == "/s/out" && w.stderr_file == "/s/err" && w.stdout_offset == 10 &&
         w.stderr_offset == -1 && w.remote_dir == "/tmp/elastic-run.abc" &&
         w.remote_group == -4242));
  CHECK(back->tls.server.empty());  // plain text: no "tls" in it
  // With --tls, the job's identities, so that a driver that adopts the job presents the one
  // its workers trust.
  auto tls = MakeJobCredentials(std::chrono::hours(1));
  REQUIRE(tls.ok());
  j.tls = *tls;
  REQUIRE(WriteJournal(dir, j).ok());
  back = ReadJournal(dir);
  REQUIRE(back.ok());
  CHECK((back->tls.server.ca == tls->server.ca && back->tls.server.cert == tls->server.cert &&
         back->tls.server.key == tls->server.key && back->tls.client.cert == tls->client.cert &&
         back->tls.client.key == tls->client.key));
  RemoveJournal(dir);
  CHECK(ReadJournal(dir).status().code() == Code::kNotFound);
  close(*lock);
}

TEST_CASE("journal: a damaged journal is refused naming what is wrong", "[journal]") {
  TempDir tmp;
  const std::string& dir = tmp.state;
  auto lock = LockStateDir(dir);
  REQUIRE(lock.ok());
  REQUIRE(WriteJournal(dir, Sample()).ok());
  std::string text = Slurp(JournalPath(dir));
  auto with = [&](const std::string& from, const std::string& to) {
    std::string t = text;
    auto at = t.find(from);
    REQUIRE(at != std::string::npos);
    t.replace(at, from.size(), to);
    std::ofstream(JournalPath(dir), std::ios::trunc) << t;
    return ReadJournal(dir).status();
  };
  Status s = with("\"port\":4321", "\"port\":70000");
  CHECK(s.code() == Code::kInvalidArgument);
  CHECK_THAT(s.message(), Catch::Contains("journal.port is out of range"));
  s = with("\"pid\":4242", "\"pid\":\"x\"");
  CHECK_THAT(s.message(), Catch::Contains("journal.workers.b:0.pid has the wrong type"));
  s = with("\"remote_group\":-4242", "\"remote_group\":77");
  CHECK_THAT(s.message(), Catch::Contains("journal.workers.b:0.remote_group is not the pid's"));
  s = with("\"remote_dir\":\"/tmp", "\"remote_dir\":\"tmp");
  CHECK_THAT(s.message(), Catch::Contains("journal.workers.b:0.remote_dir is out of range"));
  s = with("\"token\":", "\"tokn\":");
  CHECK_THAT(s.message(), Catch::Contains("journal.token is missing"));
  std::string saved = text;
  text.insert(text.size() - 1, ",\"tls\":{\"server\":\"bm90IFBFTQ==\",\"client\":\"\"}");
  s = with("\"restarts\":", "\"restarts\":");
  CHECK_THAT(s.message(), Catch::Contains("journal.tls.server: the TLS credentials hold 1"));
  text = saved;
  s = with("\"format\":1,", "\"format\":9,");
  CHECK_THAT(s.message(), Catch::Contains("journal.format is 9"));
  std::ofstream(JournalPath(dir), std::ios::trunc) << text.substr(0, text.size() / 2);
  CHECK(ReadJournal(dir).status().code() == Code::kInvalidArgument);
  close(*lock);
}

TEST_CASE("journal: one that another user could write is not trusted", "[journal]") {
  TempDir tmp;
  const std::string& dir = tmp.state;
  auto lock = LockStateDir(dir);
  REQUIRE(lock.ok());
  REQUIRE(WriteJournal(dir, Sample()).ok());
  REQUIRE(ReadJournal(dir).ok());
  for (mode_t mode : {0620, 0602, 0666}) {
    REQUIRE(chmod(JournalPath(dir).c_str(), mode) == 0);
    Status s = ReadJournal(dir).status();
    CHECK(s.code() == Code::kInvalidArgument);
    CHECK_THAT(s.message(), Catch::Contains("not a file only this user can write"));
  }
  // A link in its place (to a file someone else chose) is refused too.
  REQUIRE(chmod(JournalPath(dir).c_str(), 0600) == 0);
  std::string real = tmp.root + "/elsewhere.json";
  REQUIRE(rename(JournalPath(dir).c_str(), real.c_str()) == 0);
  REQUIRE(symlink(real.c_str(), JournalPath(dir).c_str()) == 0);
  CHECK(ReadJournal(dir).status().code() == Code::kInvalidArgument);
  // A folder of another user is refused before anything is read from it (root can make
  // one: CI runs as root).
  if (geteuid() == 0) {
    std::string other = tmp.root + "/other";
    REQUIRE(mkdir(other.c_str(), 0700) == 0);
    REQUIRE(chown(other.c_str(), 65534, 65534) == 0);
    auto refused = LockStateDir(other);
    REQUIRE_FALSE(refused.ok());
    CHECK_THAT(refused.status().message(), Catch::Contains("belongs to uid 65534"));
  } else {
    WARN("not root: the folder of another user is not checked");
  }
  close(*lock);
}

TEST_CASE("journal: one driver holds the folder, and its death releases it", "[journal]") {
  TempDir tmp;
  const std::string& dir = tmp.state;
  int ready[2];
  REQUIRE(pipe(ready) == 0);
  pid_t holder = fork();
  if (holder == 0) {
    auto lock = LockStateDir(dir);
    char c = lock.ok() ? 'y' : 'n';
    (void)!write(ready[1], &c, 1);
    pause();
    _exit(0);
  }
  char c = 0;
  REQUIRE(read(ready[0], &c, 1) == 1);
  REQUIRE(c == 'y');
  auto second = LockStateDir(dir);
  REQUIRE_FALSE(second.ok());
  CHECK(second.status().code() == Code::kFailedPrecondition);
  CHECK_THAT(
      second.status().message(),
      Catch::Contains("held by a running driver (elastic-run pid " + std::to_string(holder) + ")"));
  kill(holder, SIGKILL);
  waitpid(holder, nullptr, 0);
  auto third = LockStateDir(dir);
  REQUIRE(third.ok());
  close(*third);
  close(ready[0]);
  close(ready[1]);
}

TEST_CASE("journal: a recorded process is told from one that reuses its pid", "[journal]") {
  pid_t child = fork();
  if (child == 0) {
    pause();
    _exit(0);
  }
  JournalWorker w;
  w.pid = child;
  w.start_ticks = ProcessStartTicks(child);
  CHECK(w.start_ticks > 0);
  CHECK(StillRunning(w));
  JournalWorker other = w;
  other.start_ticks = w.start_ticks + 1;  // the same pid, a later process
  CHECK_FALSE(StillRunning(other));
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  CHECK_FALSE(StillRunning(w));
  CHECK(ProcessStartTicks(child) == 0);
}

}  // namespace
}  // namespace elastic::driver
