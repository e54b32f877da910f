#include "state/state.h"

#include <catch2/catch.hpp>
#include <thread>

#include "rendezvous/rendezvous.h"
#include "tests/state/input_communicator.h"
#include "worker_agent/gloo_communicator.h"

namespace elastic {
namespace {

TEST_CASE("ObjectState: save, restore, values, vectors, strings, tracked buffers", "[unit]") {
  ObjectState s;
  int64_t step = 1;
  double lr = 0.1;
  std::vector<float> weights = {1, 2, 3};
  std::string note = "a";
  std::vector<char> big(1 << 20, 'x');
  s.Register("step", &step);
  s.Register("lr", &lr);
  s.Register("weights", &weights);
  s.Register("note", &note);
  s.Track("big", big.data(), big.size());
  s.Save();
  step = 9;
  lr = 0.5;
  weights = {7, 7};
  note = "changed";
  big[100] = 'y';
  s.Restore();
  CHECK(step == 1);
  CHECK(lr == 0.1);
  CHECK(weights == std::vector<float>{1, 2, 3});
  CHECK(note == "a");
  CHECK(big[100] == 'x');
  step = 2;
  s.Commit();
  step = 3;
  s.Restore();
  CHECK(step == 2);
}

TEST_CASE("ObjectState: a commit hook runs after the save, and Reset re-partitions samplers",
          "[unit]") {
  ObjectState s;
  int64_t step = 0;
  s.Register("step", &step);
  ElasticSampler sampler(10, false, 0);
  s.AddSampler("sampler", &sampler);
  int resets = 0;
  s.OnReset([&] { ++resets; });
  s.SetCommitHook([&] { throw HostsUpdated("change"); });
  step = 5;
  CHECK_THROWS_AS(s.Commit(), HostsUpdated);
  step = 6;
  s.Restore();
  CHECK(step == 5);  // the save happened before the hook threw
  s.Reset(1, 2);
  CHECK(resets == 1);
  auto b = sampler.Next(2);
  CHECK(b.indices == std::vector<int64_t>{1, 3});
}

TEST_CASE("State: every commit is a version, a rollback keeps it", "[unit]") {
  ObjectState s;
  int64_t step = 0;
  s.Register("step", &step);
  CHECK(s.version() == 0);  // nothing committed yet
  step = 1;
  s.Commit();
  step = 2;
  s.Commit();
  CHECK(s.version() == 2);
  step = 3;
  s.Restore();
  CHECK(step == 2);
  CHECK(s.version() == 2);
  // A commit whose agreement fails (the hook throws) was still saved: the version counts it.
  s.SetCommitHook([] { throw WorkerLostError("peer gone in the agreement"); });
  step = 3;
  CHECK_THROWS_AS(s.Commit(), WorkerLostError);
  s.Restore();
  CHECK(step == 3);
  CHECK(s.version() == 3);
}

TEST_CASE("ObjectState: Sync makes every rank rank 0's state", "[unit]") {
  const int n = 3;
  rendezvous::Core core(rendezvous::CoreOptions{});
  std::map<std::string, rendezvous::Assignment> members;
  for (int i = 0; i < n; ++i) members["h:" + std::to_string(i)].rank = i;
  REQUIRE(core.ProposeRound(0, members, {}).ok());
  std::vector<int> ok(n, 0);
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      auto a = core.Join("h:" + std::to_string(i), -1, 0,
                         core.clock()->Now() + std::chrono::seconds(30));
      if (!a.ok()) return;
      auto store = worker_agent::MakeCoreRoundStore(&core, 0);
      auto comm = worker_agent::GlooCommunicator::Create(store.get(), {i, n, i, n, 0, 1}, {});
      if (!comm.ok()) return;
      ObjectState s;
      int64_t step = i == 0 ? 42 : i;
      if (i == 0) {  // rank 0 holds version 2; the others hold nothing
        s.Commit();
        s.Commit();
      }
      std::vector<double> v(i == 0 ? 5 : 1, i == 0 ? 1.5 : -1);
      std::vector<float> tracked(1000, static_cast<float>(i));
      ElasticSampler sampler(100, true, 1);
      if (i == 0) sampler.Next(30);
      s.Register("step", &step);
      s.Register("v", &v);
      s.Track("tracked", tracked.data(), tracked.size() * sizeof(float));
      s.AddSampler("sampler", &sampler);
      s.Sync(**comm, 0);
      step = -1;
      s.Restore();  // Sync also committed
      ok[i] = step == 42 && v == std::vector<double>(5, 1.5) && tracked[999] == 0.0f &&
              sampler.cursor() == 30 && s.version() == 2;  // the root's version came along
    });
  }
  for (auto& t : threads) t.join();
  CHECK(ok == std::vector<int>(n, 1));
}

}  // namespace
}  // namespace elastic

namespace elastic {
namespace {

// The receiving side of a sync whose root announces `announced` bytes of state and then is
// gone (found by tests/fuzz/fuzz_state_sync: the size was taken as it came and allocated).
testing::InputCommunicator AnnouncingRoot(uint64_t announced) {
  return testing::InputCommunicator(
      std::string(reinterpret_cast<const char*>(&announced), sizeof announced));
}

TEST_CASE("A sync whose root announces a huge state fails without allocating it", "[unit]") {
  for (uint64_t announced : {uint64_t{1} << 62, (uint64_t{1} << 40) + 1, uint64_t{3} << 30}) {
    INFO(announced);
    ObjectState state;
    int64_t step = 5;
    state.Register("step", &step);
    testing::InputCommunicator comm = AnnouncingRoot(announced);
    // A runtime_error (the limit, or the root gone before it sent that much); never
    // std::length_error or std::bad_alloc from allocating what was announced.
    CHECK_THROWS_AS(state.Sync(comm, 0), std::runtime_error);
    CHECK(step == 5);
  }
}

}  // namespace
}  // namespace elastic
