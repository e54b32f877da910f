// Checkpoints on a real disk (a temp folder): the layout, what is kept, what is refused.
#include "state/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "state/state.h"

namespace elastic {
namespace {

struct TempDir {
  TempDir() {
    char tmpl[] = "/tmp/elastic-ckpt-test-XXXXXX";
    path = mkdtemp(tmpl);
  }
  ~TempDir() { std::system(("rm -rf '" + path + "'").c_str()); }
  std::string path;
};

// A program's state: a tracked buffer, two registered values and a sampler.
struct Program {
  explicit Program(double fill = 0) : w(1000, fill), sampler(100, true, 3) {
    state.Track("w", w.data(), w.size() * sizeof(double));
    state.Register("step", &step);
    state.Register("name", &name);
    state.AddSampler("sampler", &sampler);
  }
  // Trains one "step" and commits it.
  void Step() {
    for (auto& x : w) x += 1;
    ++step;
    sampler.Next(10);
    state.Commit();
  }
  std::vector<double> w;
  int64_t step = 0;
  std::string name = "a name/with odd chars";
  ElasticSampler sampler;
  ObjectState state;
};

CheckpointInfo Meta(const State& s) {
  CheckpointInfo m;
  m.version = s.version();
  m.step = s.progress().step;
  m.epoch = s.progress().epoch;
  m.cursor = s.progress().cursor;
  m.samples = s.progress().samples;
  m.world_size = 1;
  m.time = 1.5;
  return m;
}

std::string Write(Program& p, const std::string& dir, int keep = 2) {
  CheckpointInfo written;
  Status s = WriteCheckpoint(dir, Meta(p.state), p.state.CheckpointFiles(), keep, &written);
  REQUIRE(s.ok());
  return written.path;
}

void Corrupt(const std::string& path, bool truncate) {
  if (truncate) {
    REQUIRE(::truncate(path.c_str(), 10) == 0);
    return;
  }
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(100);
  char c = 0;
  f.read(&c, 1);
  c ^= 0x10;
  f.seekp(100);
  f.write(&c, 1);
}

}  // namespace

TEST_CASE("checkpoint: a written version loads back into another process's state", "[unit]") {
  TempDir d;
  Program a;
  for (int i = 0; i < 7; ++i) a.Step();
  std::string path = Write(a, d.path);
  CHECK(path == d.path + "/v00000000000000000007");
  CheckpointInfo m;
  REQUIRE(ReadManifest(path, &m).ok());
  CHECK(m.version == 7);
  CHECK(m.cursor == 70);
  CHECK(m.files.size() == 4);
  // Odd bytes in a name are escaped in the file name; the manifest keeps the name.
  struct stat st {};
  CHECK(stat((path + "/value.name").c_str(), &st) == 0);
  CHECK(stat((path + "/tracked.w").c_str(), &st) == 0);
  CHECK(st.st_size == 8000);

  Program b;
  b.name = "";
  std::vector<std::string> skipped;
  auto got = RestoreNewestCheckpoint(b.state, d.path, &skipped);
  REQUIRE(got.ok());
  CHECK(skipped.empty());
  CHECK(b.state.version() == 7);
  CHECK(b.w == a.w);
  CHECK(b.step == 7);
  CHECK(b.name == a.name);
  CHECK(b.sampler.cursor() == 70);
  // Loaded means committed: a rollback keeps it.
  b.w[0] = -1;
  b.state.Restore();
  CHECK(b.w == a.w);
}

TEST_CASE("checkpoint: the newest K versions are kept", "[unit]") {
  TempDir d;
  Program a;
  for (int i = 0; i < 5; ++i) {
    a.Step();
    Write(a, d.path, 2);
  }
  auto list = ListCheckpoints(d.path);
  REQUIRE(list.size() == 2);
  CHECK(list[0].version == 5);
  CHECK(list[1].version == 4);
}

TEST_CASE("checkpoint: a corrupt or truncated newest version is skipped, naming the file",
          "[unit]") {
  for (bool truncate : {false, true}) {
    INFO(truncate);
    TempDir d;
    Program a;
    a.Step();
    Write(a, d.path, 3);
    std::vector<double> at1 = a.w;
    a.Step();
    std::string newest = Write(a, d.path, 3);
    Corrupt(newest + "/tracked.w", truncate);
    Program b;
    std::vector<std::string> skipped;
    auto got = RestoreNewestCheckpoint(b.state, d.path, &skipped);
    REQUIRE(got.ok());
    CHECK(got->version == 1);
    CHECK(b.w == at1);
    REQUIRE(skipped.size() == 1);
    CHECK_THAT(skipped[0], Catch::Contains(newest + "/tracked.w"));
    CHECK_THAT(skipped[0], Catch::Contains(truncate ? "truncated" : "checksum"));
  }
}

TEST_CASE("checkpoint: an unfinished write, a bad manifest or another program's is never taken",
          "[unit]") {
  TempDir d;
  Program a;
  a.Step();
  std::string path = Write(a, d.path);
  // A folder that was being written when its process died.
  REQUIRE(std::system(("cp -r " + path + " " + d.path + "/.tmp-v00000000000000000009-1").c_str()) == 0);
  // A complete-looking newer version whose manifest is not JSON.
  REQUIRE(std::system(("cp -r " + path + " " + d.path + "/v00000000000000000008").c_str()) == 0);
  { std::ofstream(d.path + "/v00000000000000000008/manifest.json") << "{not json"; }
  // A manifest that names a file outside its folder.
  REQUIRE(std::system(("cp -r " + path + " " + d.path + "/v00000000000000000007").c_str()) == 0);
  REQUIRE(std::system(("sed -i 's#\"tracked.w\"#\"../x\"#' " + d.path +
                       "/v00000000000000000007/manifest.json").c_str()) == 0);
  std::vector<std::string> skipped;
  auto list = ListCheckpoints(d.path, &skipped);
  REQUIRE(list.size() == 1);
  CHECK(list[0].version == 1);
  CHECK(skipped.size() == 2);
  // Another program's state (a value this one does not have) is refused whole.
  struct Other {
    int64_t x = 0;
    ObjectState state;
  } other;
  other.state.Register("x", &other.x);
  skipped.clear();
  auto got = RestoreNewestCheckpoint(other.state, d.path, &skipped);
  CHECK_FALSE(got.ok());
  CHECK(other.state.version() == 0);
  RemoveUnfinishedCheckpoints(d.path);
  struct stat st {};
  CHECK(stat((d.path + "/.tmp-v00000000000000000009-1").c_str(), &st) != 0);
}

TEST_CASE("checkpoint: a version being written stays that version while newer commits are made",
          "[unit]") {
  Program a;
  a.Step();
  std::vector<CheckpointFile> held = a.state.CheckpointFiles();
  std::vector<double> at1 = a.w;
  for (int i = 0; i < 3; ++i) a.Step();  // commits while the checkpoint holds version 1
  const CheckpointFile* w = nullptr;
  for (const auto& f : held) {
    if (f.name == "w") w = &f;
  }
  REQUIRE(w != nullptr);
  REQUIRE(w->size == at1.size() * sizeof(double));
  CHECK(std::memcmp(w->data, at1.data(), w->size) == 0);
  // And the commits are there: a rollback goes to version 4, not 1.
  std::vector<double> at4 = a.w;
  a.w[0] = -7;
  a.state.Restore();
  CHECK(a.w == at4);
}

TEST_CASE("checkpoint: the writer skips a version due while one is being written", "[unit]") {
  TempDir d;
  Program a;
  a.Step();
  std::vector<int64_t> written;
  Checkpointer::Options o;
  o.dir = d.path;
  o.interval = std::chrono::duration<double>(0);
  std::mutex mu;
  Checkpointer c(o, [&](const Status& s, const CheckpointInfo& info, double) {
    REQUIRE(s.ok());
    std::lock_guard<std::mutex> g(mu);
    written.push_back(info.version);
  });
  // A big state, so that the first write is still running when the second comes.
  std::vector<char> big(256u << 20, 1);
  std::vector<CheckpointFile> files = {{"big", "tracked", nullptr, big.data(), big.size()}};
  CheckpointInfo m = Meta(a.state);
  REQUIRE(c.Submit(m, files));
  CHECK_FALSE(c.Due());
  m.version = 2;
  CHECK_FALSE(c.Submit(m, files));
  REQUIRE(c.Wait(std::chrono::seconds(60)));
  CHECK(c.Due());
  std::lock_guard<std::mutex> g(mu);
  CHECK(written == std::vector<int64_t>{1});
}

TEST_CASE("checkpoint: a second lock of one folder is refused with the holder's pid", "[unit]") {
  TempDir d;
  auto first = LockCheckpointDir(d.path + "/ck");
  REQUIRE(first.ok());
  auto second = LockCheckpointDir(d.path + "/ck");
  REQUIRE_FALSE(second.ok());
  CHECK_THAT(second.status().message(), Catch::Contains("in use by another job"));
  CHECK_THAT(second.status().message(), Catch::Contains(std::to_string(getpid())));
  close(*first);
  auto third = LockCheckpointDir(d.path + "/ck");
  CHECK(third.ok());
  if (third.ok()) close(*third);
}

TEST_CASE("checkpoint: a folder that cannot be written fails the write, not the caller",
          "[unit]") {
  TempDir d;
  { std::ofstream(d.path + "/file") << "x"; }
  Program a;
  a.Step();
  CheckpointInfo written;
  Status s = WriteCheckpoint(d.path + "/file/sub", Meta(a.state), a.state.CheckpointFiles(), 2,
                             &written);
  CHECK_FALSE(s.ok());
  CHECK_THAT(s.message(), Catch::Contains(d.path + "/file/sub"));
}

}  // namespace elastic
