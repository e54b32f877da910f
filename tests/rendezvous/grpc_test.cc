// The rendezvous service over real gRPC on loopback.
#include <grpcpp/grpcpp.h>

#include <catch2/catch.hpp>
#include <future>
#include <thread>

#include "common/etcd.h"
#include "proto/elastic.grpc.pb.h"
#include "rendezvous/rendezvous.h"

namespace elastic::rendezvous {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

class WatchListener : public Listener {
 public:
  void OnWatchOpened(const std::string& slot) override {
    std::lock_guard<std::mutex> g(mu);
    opened.push_back(slot);
    cv.notify_all();
  }
  void OnWatchClosed(const std::string& slot) override {
    std::lock_guard<std::mutex> g(mu);
    closed.push_back(slot);
    cv.notify_all();
  }
  bool WaitClosed(size_t n) {
    std::unique_lock<std::mutex> l(mu);
    return cv.wait_for(l, seconds(10), [&] { return closed.size() >= n; });
  }
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::string> opened, closed;
};

struct Fixture {
  explicit Fixture(Listener* listener = nullptr, TlsIdentity tls = {}) {
    CoreOptions co;
    co.listener = listener;
    core = std::make_unique<Core>(co);
    ServerOptions so;
    so.address = "127.0.0.1:0";
    so.token = "secret-token";
    so.tls = std::move(tls);
    auto s = Server::Start(core.get(), so);
    REQUIRE(s.ok());
    server = std::move(s).value();
    address = "127.0.0.1:" + std::to_string(server->port());
  }
  Client MakeClient(const std::string& token = "secret-token", const std::string& worker_id = "") {
    ClientOptions o;
    o.address = address;
    o.token = token;
    o.worker_id = worker_id;
    o.call_timeout = seconds(5);
    return Client(o);
  }
  void Form(int64_t round, const std::vector<std::string>& slots, int64_t last) {
    std::map<std::string, Assignment> m;
    for (size_t i = 0; i < slots.size(); ++i) {
      m[slots[i]].rank = static_cast<int>(i);
      m[slots[i]].size = static_cast<int>(slots.size());
    }
    REQUIRE(core->ProposeRound(round, m, {}).ok());
    std::vector<std::future<StatusOr<JoinResult>>> joins;
    for (const auto& s : slots) {
      joins.push_back(std::async(std::launch::async, [this, s, last] {
        return MakeClient().Join(s, last, 0, seconds(10));
      }));
    }
    for (auto& j : joins) REQUIRE(j.get().ok());
  }
  std::unique_ptr<Core> core;
  std::unique_ptr<Server> server;
  std::string address;
};

TEST_CASE("grpc: join, set and get over the wire", "[integration]") {
  Fixture f;
  REQUIRE(f.core
              ->ProposeRound(0,
                             {{"a:0", Assignment{-1, 0, 2, 0, 2, 0, 1, false}},
                              {"a:1", Assignment{-1, 1, 2, 1, 2, 0, 1, true}}},
                             {})
              .ok());
  auto other = std::async(std::launch::async, [&] {
    Client c = f.MakeClient();
    auto r = c.Join("a:1", -1, 0, seconds(10));
    REQUIRE(r.ok());
    // Its own key set and the others' fetched in one call (waits for "0").
    return c.SetAndGet(0, "1", "addr1", {"0", "1"}, seconds(10));
  });
  Client c = f.MakeClient();
  auto r = c.Join("a:0", -1, 0, seconds(10));
  REQUIRE(r.ok());
  CHECK(r->assignment.round == 0);
  CHECK(r->assignment.rank == 0);
  CHECK(r->assignment.local_size == 2);
  REQUIRE(c.Set(0, "0", std::string("addr\0zero", 9)).ok());
  auto mine = c.Get(0, {"1", "0"}, seconds(10));
  REQUIRE(mine.ok());
  CHECK((*mine)[0] == "addr1");
  CHECK((*mine)[1] == std::string("addr\0zero", 9));
  auto theirs = other.get();
  REQUIRE(theirs.ok());
  CHECK((*theirs)[0] == std::string("addr\0zero", 9));
}

TEST_CASE("grpc: a wrong or missing token gets UNAUTHENTICATED and changes nothing",
          "[integration]") {
  Fixture f;
  f.Form(0, {"a:0"}, -1);
  for (std::string token : {"wrong-token", "", "secret-token-but-longer"}) {
    Client bad = f.MakeClient(token);
    CHECK(bad.Set(0, "k", "v").code() == Code::kUnauthenticated);
    CHECK(bad.Get(0, {"k"}, milliseconds(100)).status().code() == Code::kUnauthenticated);
    CHECK(bad.Join("a:0", -1, 0, seconds(1)).status().code() == Code::kUnauthenticated);
    Report r;
    r.slot = "a:0";
    CHECK(bad.SendReport(r).code() == Code::kUnauthenticated);
    CHECK(bad.Watch("a:0", [](const Event&) {}).code() == Code::kUnauthenticated);
  }
  CHECK(f.core->stored_keys() == 0);
  CHECK(f.core->events().watcher_count() == 0);
}

TEST_CASE("grpc: a Watch from another process of a slot is refused and counts for nothing",
          "[integration]") {
  // A driver that adopted a job takes a member as re-attached when its stream opens: a stray
  // copy of the slot (an old launch) must not pass for it.
  Fixture f;
  f.Form(0, {"a:0"}, -1);
  f.core->SetWorkerId("a:0", "launch-2");
  for (std::string id : {"launch-1", ""}) {
    Client stray = f.MakeClient("secret-token", id);
    Status s = stray.Watch("a:0", [](const Event&) {});
    CHECK(s.code() == Code::kFailedPrecondition);
    CHECK_THAT(s.message(), Catch::Contains("belongs to another process"));
  }
  CHECK(f.core->events().watcher_count() == 0);
  Client own = f.MakeClient("secret-token", "launch-2");
  auto watching =
      std::async(std::launch::async, [&] { return own.Watch("a:0", [](const Event&) {}); });
  for (int i = 0; i < 500 && f.core->events().watcher_count() == 0; ++i) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  CHECK(f.core->events().watcher_count() == 1);
  own.CancelWatch();
  CHECK(watching.wait_for(seconds(10)) == std::future_status::ready);
  // A slot with no id set (not started by the driver) is not checked here: its Join is.
  Client other = f.MakeClient("secret-token", "x");
  CHECK(other.Join("b:0", -1, 0, seconds(1)).status().code() == Code::kFailedPrecondition);
}

TEST_CASE("grpc: oversized input is refused with INVALID_ARGUMENT", "[integration]") {
  Fixture f;
  f.Form(0, {"a:0"}, -1);
  Client c = f.MakeClient();
  CHECK(c.Set(0, std::string(600, 'k'), "v").code() == Code::kInvalidArgument);
  CHECK(c.Set(0, "k", std::string((16u << 20) + 10, 'v')).code() == Code::kInvalidArgument);
  // A refused put fails the SetAndGet at once: it does not wait for the keys.
  CHECK(c.SetAndGet(0, std::string(600, 'k'), "v", {"never"}, seconds(30)).status().code() ==
        Code::kInvalidArgument);
  CHECK(f.core->pending_waiters() == 0);
  std::vector<std::string> keys((64u << 10) + 1, "k");
  CHECK(c.Get(0, keys, seconds(1)).status().code() == Code::kInvalidArgument);
  CHECK(c.Join(std::string(300, 's'), -1, 0, seconds(1)).status().code() == Code::kInvalidArgument);
  CHECK(c.Join("has space", -1, 0, seconds(1)).status().code() == Code::kInvalidArgument);
  // A message far beyond the server's receive limit is refused by gRPC itself.
  CHECK(c.Set(0, "k", std::string(40u << 20, 'v')).code() == Code::kResourceExhausted);
  CHECK(f.core->stored_keys() == 0);
}

TEST_CASE("grpc: unknown and stale rounds", "[integration]") {
  Fixture f;
  f.Form(0, {"a:0"}, -1);
  f.Form(1, {"a:0"}, 0);
  Client c = f.MakeClient();
  CHECK(c.Set(0, "k", "v").code() == Code::kFailedPrecondition);
  CHECK(c.Set(7, "k", "v").code() == Code::kFailedPrecondition);
  CHECK(c.Get(-5, {"k"}, seconds(1)).status().code() == Code::kFailedPrecondition);
  CHECK(c.Set(1, "k", "v").ok());
}

TEST_CASE("grpc: a client that disconnects in the middle of a Get frees its waiter",
          "[integration]") {
  Fixture f;
  f.Form(0, {"a:0"}, -1);
  auto channel = grpc::CreateChannel(f.address, grpc::InsecureChannelCredentials());
  auto stub = v1::Rendezvous::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.AddMetadata("x-elastic-token", "secret-token");
  v1::GetRequest req;
  req.set_round(0);
  req.add_keys("never");
  req.set_timeout_ms(60000);
  v1::GetResponse resp;
  auto call = std::async(std::launch::async, [&] { return stub->Get(&ctx, req, &resp); });
  // Wait (bounded) until the call is parked in the core, then cut it.
  for (int i = 0; i < 1000 && f.core->pending_waiters() == 0; ++i) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  REQUIRE(f.core->pending_waiters() == 1);
  ctx.TryCancel();
  CHECK(call.get().error_code() == grpc::StatusCode::CANCELLED);
  for (int i = 0; i < 1000 && f.core->pending_waiters() != 0; ++i) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  CHECK(f.core->pending_waiters() == 0);
}

TEST_CASE("grpc: watch delivers events, server shutdown ends every waiting call", "[integration]") {
  WatchListener listener;
  Fixture f(&listener);
  f.Form(0, {"a:0", "a:1"}, -1);
  std::promise<void> opened;
  std::mutex mu;
  std::vector<Event> events;
  auto watch = std::async(std::launch::async, [&] {
    Client c = f.MakeClient();
    return c.Watch(
        "a:0",
        [&](const Event& e) {
          std::lock_guard<std::mutex> g(mu);
          events.push_back(e);
        },
        [&] { opened.set_value(); });
  });
  REQUIRE(opened.get_future().wait_for(seconds(10)) == std::future_status::ready);
  f.core->events().Publish("a:0", Event{EventKind::kMembershipChanging, 0, "host added"});
  f.core->events().Publish("a:1", Event{EventKind::kAbort, 0, "not for a:0"});

  // z:0 waits for round 1, which also needs y:0. The calls' own deadlines (30 s) are far
  // beyond the shutdown: only the shutdown can end them, with UNAVAILABLE.
  REQUIRE(f.core->ProposeRound(1, AssignRanks({"z:0", "y:0"}, false), {}).ok());
  auto get =
      std::async(std::launch::async, [&] { return f.MakeClient().Get(0, {"never"}, seconds(30)); });
  auto join =
      std::async(std::launch::async, [&] { return f.MakeClient().Join("z:0", -1, 0, seconds(30)); });
  for (int i = 0; i < 1000 && f.core->pending_waiters() < 2; ++i) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  REQUIRE(f.core->pending_waiters() == 2);
  f.server->Shutdown(seconds(2));
  CHECK(watch.get().ok());
  auto got = get.get();
  auto joined = join.get();
  CHECK(got.status().code() == Code::kUnavailable);
  CHECK(joined.status().code() == Code::kUnavailable);
  std::lock_guard<std::mutex> g(mu);
  REQUIRE(events.size() == 2);
  CHECK(events[0].kind == EventKind::kMembershipChanging);
  CHECK(events[0].message == "host added");
  CHECK(events[1].kind == EventKind::kShutdown);
  CHECK(listener.WaitClosed(1));
}

TEST_CASE("grpc: a watcher that goes away is reported closed", "[integration]") {
  WatchListener listener;
  Fixture f(&listener);
  ClientOptions o;
  o.address = f.address;
  o.token = "secret-token";
  Client c(o);
  std::promise<void> opened;
  auto watch = std::async(std::launch::async, [&] {
    return c.Watch(
        "b:3", [](const Event&) {}, [&] { opened.set_value(); });
  });
  REQUIRE(opened.get_future().wait_for(seconds(10)) == std::future_status::ready);
  c.CancelWatch();
  CHECK(watch.get().code() == Code::kCancelled);
  REQUIRE(listener.WaitClosed(1));
  std::lock_guard<std::mutex> g(listener.mu);
  CHECK(listener.closed == std::vector<std::string>{"b:3"});
  CHECK(listener.opened == std::vector<std::string>{"b:3"});
}

TEST_CASE("grpc: versions travel in Join, rank 0 is the newest holder", "[integration]") {
  Fixture f;
  REQUIRE(f.core
              ->ProposeRound(0,
                             {{"a:0", Assignment{-1, 0, 2, 0, 2, 0, 1, false}},
                              {"a:1", Assignment{-1, 1, 2, 1, 2, 0, 1, false}}},
                             {})
              .ok());
  auto behind = std::async(std::launch::async,
                           [&] { return f.MakeClient().Join("a:0", -1, 3, seconds(10)); });
  auto newest = f.MakeClient().Join("a:1", -1, 5, seconds(10));
  REQUIRE(newest.ok());
  auto r0 = behind.get();
  REQUIRE(r0.ok());
  CHECK(newest->assignment.rank == 0);
  CHECK(r0->assignment.rank == 1);
  CHECK(newest->assignment.sync_required);
  CHECK(r0->assignment.sync_required);
}

TEST_CASE("grpc: CancelGets ends a waiting Get of an aborted round and refuses later ones",
          "[integration]") {
  Fixture f;
  f.Form(0, {"a:0"}, -1);
  Client c = f.MakeClient();
  auto waiting = std::async(std::launch::async, [&] { return c.Get(0, {"never"}, seconds(30)); });
  for (int i = 0; i < 2000 && f.core->pending_waiters() < 1; ++i) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  REQUIRE(f.core->pending_waiters() == 1);
  c.CancelGets(0);
  REQUIRE(waiting.wait_for(seconds(10)) == std::future_status::ready);
  CHECK(waiting.get().status().code() == Code::kAborted);
  CHECK(c.Get(0, {"never"}, seconds(30)).status().code() == Code::kAborted);  // at once
  // The server freed the waiter (cancelled on the wire), and newer rounds are untouched.
  for (int i = 0; i < 2000 && f.core->pending_waiters() > 0; ++i) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  CHECK(f.core->pending_waiters() == 0);
  CHECK(c.Get(1, {"k"}, seconds(1)).status().code() == Code::kFailedPrecondition);
}

TEST_CASE("grpc: Close ends a waiting Join and Watch, and fails every later call at once",
          "[integration]") {
  Listener listener;
  Fixture f(&listener);
  std::map<std::string, Assignment> m;
  m["a:0"].size = m["b:0"].size = 2;
  m["b:0"].rank = 1;
  REQUIRE(f.core->ProposeRound(0, m, {}).ok());  // b:0 never joins: a:0 waits
  Client c = f.MakeClient();
  auto joining =
      std::async(std::launch::async, [&] { return c.Join("a:0", -1, 0, seconds(60)); });
  auto watching = std::async(std::launch::async, [&] { return c.Watch("a:0", [](const Event&) {}); });
  for (int i = 0; i < 2000 && f.core->pending_waiters() < 1; ++i) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  REQUIRE(f.core->pending_waiters() == 1);
  c.Close("the agent ended");
  c.Close("a second reason");  // the first stays
  REQUIRE(joining.wait_for(seconds(10)) == std::future_status::ready);
  auto joined = joining.get();
  CHECK(joined.status().code() == Code::kCancelled);
  CHECK(joined.status().message() == "the agent ended");
  REQUIRE(watching.wait_for(seconds(10)) == std::future_status::ready);
  CHECK(watching.get().code() == Code::kCancelled);
  Report r;
  r.slot = "a:0";
  CHECK(c.SendReport(r).code() == Code::kCancelled);
  CHECK(c.Join("a:0", -1, 0, seconds(60)).status().code() == Code::kCancelled);
  CHECK(c.Get(0, {"k"}, seconds(30)).status().code() != Code::kOk);
  // The server freed the Join's waiter (cancelled on the wire).
  for (int i = 0; i < 2000 && f.core->pending_waiters() > 0; ++i) {
    std::this_thread::sleep_for(milliseconds(5));
  }
  CHECK(f.core->pending_waiters() == 0);
}

}  // namespace
}  // namespace elastic::rendezvous

namespace elastic::rendezvous {
namespace {

TEST_CASE("the BDP probe is off unless the options turn it on (not the environment)",
          "[unit]") {
  // The processes read ELASTIC_GRPC_BDP_PROBE once (driver/main.cc, WorkerOptions); the
  // library's options never do.
  const char* name = "ELASTIC_GRPC_BDP_PROBE";
  std::string saved = Env(name);
  bool was_set = std::getenv(name) != nullptr;
  setenv(name, "1", 1);
  CHECK_FALSE(ClientOptions{}.bdp_probe);
  CHECK_FALSE(ServerOptions{}.bdp_probe);
  if (was_set) {
    setenv(name, saved.c_str(), 1);
  } else {
    unsetenv(name);
  }
}

}  // namespace
}  // namespace elastic::rendezvous

namespace elastic::rendezvous {
namespace {

TEST_CASE("tls: an identity survives its one-line encoding, and bad lines are refused", "[unit]") {
  auto made = MakeJobCredentials(std::chrono::hours(24));
  REQUIRE(made.ok());
  const TlsIdentity& id = made->client;
  CHECK(id.ca == made->server.ca);
  CHECK(id.cert != made->server.cert);
  CHECK(id.key.find("PRIVATE KEY") != std::string::npos);
  std::string line = EncodeTlsIdentity(id);
  CHECK(line.find('\n') == std::string::npos);
  auto back = DecodeTlsIdentity(line);
  REQUIRE(back.ok());
  CHECK(back->ca == id.ca);
  CHECK(back->cert == id.cert);
  CHECK(back->key == id.key);
  CHECK(DecodeTlsIdentity("").ok());
  CHECK(DecodeTlsIdentity("").value().empty());
  CHECK(DecodeTlsIdentity("not base64!").status().code() == Code::kInvalidArgument);
  CHECK(DecodeTlsIdentity(Base64Encode("a\0b")).status().code() == Code::kInvalidArgument);
  CHECK(DecodeTlsIdentity(Base64Encode("x\0y\0z")).status().code() == Code::kInvalidArgument);
  CHECK(DecodeTlsIdentity(std::string(kMaxEncodedIdentity + 1, 'A')).status().code() ==
        Code::kInvalidArgument);
}

TEST_CASE("grpc: with the job's TLS, only a client holding its credentials is served",
          "[integration]") {
  auto job = MakeJobCredentials(std::chrono::hours(24));
  auto other = MakeJobCredentials(std::chrono::hours(24));
  REQUIRE(job.ok());
  REQUIRE(other.ok());
  Fixture f(nullptr, job->server);
  auto client = [&](TlsIdentity tls) {
    ClientOptions o;
    o.address = f.address;
    o.token = "secret-token";
    o.tls = std::move(tls);
    o.call_timeout = seconds(1);
    return std::make_unique<Client>(o);
  };
  // The job's own client: a round forms and a key goes through.
  std::map<std::string, Assignment> m;
  m["a:0"].size = 1;
  REQUIRE(f.core->ProposeRound(0, m, {}).ok());
  auto good = client(job->client);
  REQUIRE(good->Join("a:0", -1, 0, seconds(10)).ok());
  REQUIRE(good->Set(0, "k", "v").ok());
  // Plain text, another job's credentials, the job's CA without a client certificate, and a
  // client of this job's CA that trusts another CA (the driver cannot prove who it is): all
  // refused before a call is made.
  TlsIdentity no_cert{job->client.ca, "", ""};
  TlsIdentity wrong_ca{other->client.ca, job->client.cert, job->client.key};
  for (TlsIdentity tls : {TlsIdentity{}, other->client, no_cert, wrong_ca}) {
    auto bad = client(tls);
    Status set = bad->Set(0, "k", "stolen");
    CHECK_FALSE(set.ok());
    CHECK(set.code() != Code::kFailedPrecondition);  // never reached the core
    CHECK_FALSE(bad->Get(0, {"k"}, seconds(1)).ok());
  }
  auto still = good->Get(0, {"k"}, seconds(5));
  REQUIRE(still.ok());
  CHECK(still->at(0) == "v");
  // A plain-text server is no place for a TLS client either (it would send the token).
  Fixture plain;
  ClientOptions o;
  o.address = plain.address;
  o.token = "secret-token";
  o.tls = job->client;
  o.call_timeout = seconds(2);
  Client tls_to_plain(o);
  CHECK_FALSE(tls_to_plain.Set(0, "k", "v").ok());
}

}  // namespace
}  // namespace elastic::rendezvous
