// Leadership of a job in etcd (driver/leadership.h) against a real etcd (Debian's etcd-server,
// started by the test on free loopback ports): one driver leads at a time, a driver whose
// lease is gone never writes again (the fence is etcd's transaction, not the driver's belief),
// a standby adopts only a job that exists and ends with it, and the client skips an endpoint
// that does not answer. Also the URL's and base64's edge cases.
#include "driver/leadership.h"

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <httplib.h>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <mutex>
#include <thread>

namespace elastic::driver {
namespace {

int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t n = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n);
  close(fd);
  return ntohs(a.sin_port);
}

std::string Slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// One etcd member on loopback for the test case; killed and its data removed at the end.
// With tls, it serves HTTPS only to clients with a certificate of its CA
// (tests/etcd_tls_certs.sh made them, in dir/certs).
struct EtcdServer {
  std::string dir;
  int port = 0;
  pid_t pid = -1;
  bool tls = false;
  explicit EtcdServer(bool with_tls = false) : tls(with_tls) {
    char tmpl[] = "/tmp/elastic-etcd-test-XXXXXX";
    REQUIRE(mkdtemp(tmpl) != nullptr);
    dir = tmpl;
    if (tls) {
      std::string make = std::string(ELASTIC_SOURCE_DIR) + "/tests/etcd_tls_certs.sh " + dir +
                         "/certs 127.0.0.1";
      REQUIRE(std::system(make.c_str()) == 0);
    }
    for (int attempt = 0; attempt < 5 && pid < 0; ++attempt) {
      port = FreePort();
      int peer = FreePort();
      std::string client = (tls ? "https://127.0.0.1:" : "http://127.0.0.1:") +
                           std::to_string(port);
      std::string peers = "http://127.0.0.1:" + std::to_string(peer);
      const std::string certs = dir + "/certs/";
      std::vector<std::string> args = {
          "etcd", "--data-dir", dir + "/data", "--name", "t", "--listen-client-urls", client,
          "--advertise-client-urls", client, "--listen-peer-urls", peers,
          "--initial-advertise-peer-urls", peers, "--initial-cluster", "t=" + peers};
      if (tls) {
        for (const std::string& a :
             {"--cert-file=" + certs + "server.pem", "--key-file=" + certs + "server.key",
              "--trusted-ca-file=" + certs + "ca.pem", std::string("--client-cert-auth")}) {
          args.push_back(a);
        }
      }
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      pid = fork();
      REQUIRE(pid >= 0);
      if (pid == 0) {
        std::string log = dir + "/etcd.log";
        FILE* f = freopen(log.c_str(), "w", stdout);
        (void)f;
        dup2(1, 2);
        execvp("etcd", argv.data());
        _exit(127);
      }
      Etcd probe(Url("probe"), std::chrono::milliseconds(500));
      auto deadline = SteadyClock::now() + std::chrono::seconds(30);
      bool up = false;
      while (SteadyClock::now() < deadline) {
        int status;
        if (waitpid(pid, &status, WNOHANG) == pid) break;  // a port taken meanwhile: again
        if (probe.Get("x").ok()) {
          up = true;
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      if (!up) {
        kill(pid, SIGKILL);
        waitpid(pid, nullptr, 0);
        pid = -1;
        std::filesystem::remove_all(dir + "/data");
      }
    }
    REQUIRE(pid > 0);  // etcd is installed by scripts/setup-deps.sh (etcd-server)
  }
  ~EtcdServer() {
    if (pid > 0) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
    std::filesystem::remove_all(dir);
  }
  // The URL of `prefix`; with tls, etcds:// with the CA and the client certificate.
  EtcdUrl Url(const std::string& prefix) const {
    auto url = ParseEtcdUrl((tls ? "etcds://127.0.0.1:" : "etcd://127.0.0.1:") +
                            std::to_string(port) + "/" + prefix);
    REQUIRE(url.ok());
    if (tls) {
      url->tls = {Slurp(dir + "/certs/ca.pem"), Slurp(dir + "/certs/client.pem"),
                  Slurp(dir + "/certs/client.key")};
    }
    return *url;
  }
  LeadershipOptions Options(const std::string& prefix, bool standby = false) const {
    LeadershipOptions o;
    o.store = Url(prefix);
    o.ttl_seconds = 2;
    o.standby = standby;
    return o;
  }
};

auto Never = [] { return false; };

TEST_CASE("leadership: one driver leads, and a second is refused naming the leader") {
  EtcdServer etcd;
  std::optional<Leadership::Ended> ended;
  auto a = Leadership::Take(etcd.Options("job"), Never, &ended);
  REQUIRE(a.ok());
  REQUIRE(*a);
  REQUIRE((*a)->Announce("10.0.0.1:5000").ok());
  auto b = Leadership::Take(etcd.Options("job"), Never, &ended);
  REQUIRE(b.status().code() == Code::kFailedPrecondition);
  CHECK_THAT(b.status().message(), Catch::Contains("10.0.0.1:5000 (pid " +
                                                   std::to_string(getpid())));
  CHECK_THAT(b.status().message(), Catch::Contains("--standby"));
  // Another prefix is another job.
  auto c = Leadership::Take(etcd.Options("job2"), Never, &ended);
  REQUIRE(c.ok());
}

TEST_CASE("leadership: a driver whose lease is gone can never write again") {
  EtcdServer etcd;
  std::optional<Leadership::Ended> ended;
  auto a = Leadership::Take(etcd.Options("job"), Never, &ended);
  REQUIRE(a.ok());
  REQUIRE((*a)->WriteJournal("journal of A").ok());
  // A's lease ends as it would if A were paused or cut off: etcd drops the leader key.
  Etcd store(etcd.Options("job").store);
  auto key = store.Get("leader");
  REQUIRE(key.ok());
  REQUIRE(key->has_value());
  REQUIRE((*key)->lease != 0);
  REQUIRE(store.Revoke((*key)->lease).ok());
  // A standby sees a journal and no leader: it leads.
  auto b = Leadership::Take(etcd.Options("job", true), Never, &ended);
  REQUIRE(b.ok());
  REQUIRE(*b);
  auto text = (*b)->ReadJournal();
  REQUIRE(text.ok());
  CHECK(**text == "journal of A");
  // A still believes it leads (no renewal has failed yet), but etcd refuses its writes.
  Status stale = (*a)->WriteJournal("journal of A, later");
  CHECK(stale.code() == Code::kFailedPrecondition);
  CHECK_THAT(stale.message(), Catch::Contains("no longer leads"));
  CHECK((*a)->Finish(0, "A says the job ended").code() == Code::kFailedPrecondition);
  CHECK((*a)->Announce("10.0.0.1:1").code() == Code::kFailedPrecondition);
  REQUIRE((*b)->WriteJournal("journal of B").ok());
  auto now = store.Get("journal");
  REQUIRE(now.ok());
  CHECK((*now)->value == "journal of B");
  auto done = store.Get("done");
  REQUIRE(done.ok());
  CHECK(!done->has_value());
}

TEST_CASE("leadership: a lost lease is seen by the keeper, and Leads says why") {
  EtcdServer etcd;
  std::optional<Leadership::Ended> ended;
  auto a = Leadership::Take(etcd.Options("job"), Never, &ended);
  REQUIRE(a.ok());
  std::mutex mu;
  std::condition_variable cv;
  std::string why;
  (*a)->KeepAlive([&](const std::string& w) {
    std::lock_guard<std::mutex> g(mu);
    why = w;
    cv.notify_all();
  });
  // Renewals keep it past several TTLs.
  std::this_thread::sleep_for(std::chrono::seconds(3));
  CHECK((*a)->Leads());
  Etcd store(etcd.Options("job").store);
  auto key = store.Get("leader");
  REQUIRE(key.ok());
  REQUIRE(store.Revoke((*key)->lease).ok());
  std::unique_lock<std::mutex> g(mu);
  REQUIRE(cv.wait_for(g, std::chrono::seconds(10), [&] { return !why.empty(); }));
  CHECK_THAT(why, Catch::Contains("lease expired"));
  std::string said;
  CHECK(!(*a)->Leads(&said));
  CHECK(said == why);
}

TEST_CASE("leadership: a standby adopts only a job that exists, and ends with it") {
  EtcdServer etcd;
  std::optional<Leadership::Ended> ended;
  // No job yet: it waits (here until told to stop).
  int asked = 0;
  auto waited = Leadership::Take(etcd.Options("job", true), [&] { return ++asked > 20; }, &ended);
  CHECK(waited.status().code() == Code::kCancelled);
  CHECK(!ended);
  auto a = Leadership::Take(etcd.Options("job"), Never, &ended);
  REQUIRE(a.ok());
  REQUIRE((*a)->WriteJournal("j").ok());
  std::optional<Leadership::Ended> standby_ended;
  StatusOr<std::unique_ptr<Leadership>> standby = Internal("not run");
  std::thread t([&] {
    standby = Leadership::Take(etcd.Options("job", true), Never, &standby_ended);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  REQUIRE((*a)->Finish(7, "worker 3 failed").ok());
  t.join();
  REQUIRE(standby.ok());
  CHECK(!*standby);
  REQUIRE(standby_ended);
  CHECK(standby_ended->code == 7);
  CHECK(standby_ended->message == "worker 3 failed");
  // The job's end left no journal and no leader.
  Etcd store(etcd.Options("job").store);
  CHECK(!store.Get("journal")->has_value());
  CHECK(!store.Get("leader")->has_value());
}

TEST_CASE("leadership: a standby started after its job ended ends at once with its code") {
  // Soak seed 918896353, job 3: a standby started just after the job ended (its driver had
  // taken over the moment the workers finished) waited for ever for a job that never came.
  EtcdServer etcd;
  std::optional<Leadership::Ended> ended;
  {
    auto a = Leadership::Take(etcd.Options("job"), Never, &ended);
    REQUIRE(a.ok());
    REQUIRE((*a)->WriteJournal("j").ok());
    REQUIRE((*a)->Finish(0, "success").ok());
  }
  int asked = 0;
  auto late = Leadership::Take(etcd.Options("job", true), [&] { return ++asked > 40; }, &ended);
  REQUIRE(late.ok());
  CHECK(!*late);
  REQUIRE(ended);
  CHECK(ended->code == 0);
  // A new job under the prefix: its leader removes the record as it takes the lead, and a
  // standby then stands by for it.
  ended.reset();
  auto next = Leadership::Take(etcd.Options("job"), Never, &ended);
  REQUIRE(next.ok());
  Etcd store(etcd.Options("job").store);
  CHECK(!store.Get("done")->has_value());
  asked = 0;
  auto waits = Leadership::Take(etcd.Options("job", true), [&] { return ++asked > 20; }, &ended);
  CHECK(waits.status().code() == Code::kCancelled);
  CHECK(!ended);
}

TEST_CASE("leadership: a standby is listed while it waits, and no longer once it leads") {
  EtcdServer etcd;
  std::optional<Leadership::Ended> ended;
  auto a = Leadership::Take(etcd.Options("job"), Never, &ended);
  REQUIRE(a.ok());
  REQUIRE((*a)->WriteJournal("j").ok());
  (*a)->KeepAlive([](const std::string&) {});
  Etcd store(etcd.Options("job").store);
  auto standbys = [&] {
    auto listed = ListStandbys(store);
    REQUIRE(listed.ok());
    return *listed;
  };
  REQUIRE(standbys().empty());
  // Another job's standby, under a prefix that starts the same, is not this job's.
  Etcd other(etcd.Options("job2").store);
  REQUIRE(other.Put("standbys/x", R"({"address":"10.0.0.9"})").ok());
  auto options = etcd.Options("job", true);
  options.address = "10.0.0.7";
  std::atomic<bool> stop{false};
  StatusOr<std::unique_ptr<Leadership>> standby = Internal("not run");
  std::thread t([&] { standby = Leadership::Take(options, [&] { return stop.load(); }, &ended); });
  std::vector<StandbyView> seen;
  for (int i = 0; i < 100 && seen.empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    seen = standbys();
  }
  REQUIRE(seen.size() == 1);
  CHECK(seen[0].address == "10.0.0.7");
  CHECK(seen[0].pid == getpid());
  // Listed past its TTL (2 s): it renews its own lease while it waits.
  std::this_thread::sleep_for(std::chrono::seconds(3));
  CHECK(standbys().size() == 1);
  // The leader goes (its lease runs out): the standby leads, and is no longer listed.
  a->reset();
  t.join();
  REQUIRE(standby.ok());
  REQUIRE(*standby);
  CHECK(standbys().empty());
  // Keys that are not a standby's listing are passed over.
  REQUIRE(store.Put("standbys/junk", "not json").ok());
  CHECK(standbys().empty());
  // List is bounded by its limit.
  for (int i = 0; i < 5; ++i) REQUIRE(store.Put("many/" + std::to_string(i), "v").ok());
  auto three = store.List("many/", 3), all = store.List("many/", 100);
  REQUIRE(three.ok());
  REQUIRE(all.ok());
  CHECK(three->size() == 3);
  CHECK(all->size() == 5);
  CHECK((*all)[0].first == "many/0");
  CHECK(store.List("many/", 0).status().code() == Code::kInvalidArgument);
}

TEST_CASE("etcd: an endpoint that does not answer is skipped") {
  EtcdServer etcd;
  int dead = FreePort();
  auto url = ParseEtcdUrl("etcd://127.0.0.1:" + std::to_string(dead) + ",127.0.0.1:" +
                          std::to_string(etcd.port) + "/p");
  REQUIRE(url.ok());
  Etcd store(*url, std::chrono::milliseconds(500));
  REQUIRE(store.Put("k", std::string("v\0w", 3)).ok());
  auto got = store.Get("k");
  REQUIRE(got.ok());
  CHECK((*got)->value == std::string("v\0w", 3));
  Etcd none(*ParseEtcdUrl("etcd://127.0.0.1:" + std::to_string(dead) + "/p"),
            std::chrono::milliseconds(300));
  auto refused = none.Get("k");
  CHECK(refused.status().code() == Code::kUnavailable);
  CHECK_THAT(refused.status().message(), Catch::Contains("no etcd endpoint"));
}

TEST_CASE("etcd over TLS: only with its CA and a client certificate it trusts", "[integration]") {
  EtcdServer etcd(/*with_tls=*/true);
  const std::string certs = etcd.dir + "/certs/";
  // Leadership runs over it as over plain etcd.
  auto leader = Leadership::Take(etcd.Options("tls-job"), [] { return false; }, nullptr);
  REQUIRE(leader.ok());
  CHECK((*leader)->Leads());
  Etcd store(etcd.Url("tls-job"), std::chrono::seconds(2));
  REQUIRE(store.Put("k", "v").ok());
  REQUIRE(store.Get("k").ok());
  CHECK(store.Get("k").value()->value == "v");
  // Refused: no client certificate; a CA that did not sign etcd's (and the system's CAs, which
  // did not either); plain HTTP to its HTTPS port; PEM text that is not what it claims.
  EtcdUrl no_cert = etcd.Url("tls-job");
  no_cert.tls.cert = no_cert.tls.key = "";
  EtcdUrl other_ca = etcd.Url("tls-job");
  other_ca.tls.ca = Slurp(certs + "other-ca.pem");
  EtcdUrl system_cas = etcd.Url("tls-job");
  system_cas.tls.ca = "";
  EtcdUrl plain = *ParseEtcdUrl("etcd://127.0.0.1:" + std::to_string(etcd.port) + "/tls-job");
  for (const EtcdUrl& url : {no_cert, other_ca, system_cas, plain}) {
    auto got = Etcd(url, std::chrono::milliseconds(500)).Get("k");
    INFO(url.text << " " << got.status().ToString());
    CHECK_FALSE(got.ok());
  }
  // Each refusal says what to check, however it shows: a refused client certificate fails the
  // handshake (TLS 1.2), or the request's read or write after it (TLS 1.3).
  CHECK_THAT(Etcd(no_cert, std::chrono::milliseconds(500)).Get("k").status().message(),
             Catch::Contains("client certificate"));
  CHECK_THAT(Etcd(other_ca, std::chrono::milliseconds(500)).Get("k").status().message(),
             Catch::Contains("--state-store-ca"));
  EtcdUrl wrong_key = etcd.Url("tls-job");
  wrong_key.tls.key = Slurp(certs + "other-ca.key");
  auto mismatched = Etcd(wrong_key).Get("k");
  CHECK(mismatched.status().code() == Code::kFailedPrecondition);
  CHECK_THAT(mismatched.status().message(), Catch::Contains("not the key of its certificate"));
  EtcdUrl garbage = etcd.Url("tls-job");
  garbage.tls.ca = "-----BEGIN CERTIFICATE-----\nnot one\n-----END CERTIFICATE-----\n";
  CHECK_THAT(Etcd(garbage).Get("k").status().message(), Catch::Contains("no PEM certificate"));
}

TEST_CASE("etcd: a transport failure's hint names what to check, however TLS shows it") {
  // A CI run saw a refused client certificate fail the request's write, not its read: every
  // way a connection can end after the handshake must point at the certificate.
  for (httplib::Error e :
       {httplib::Error::SSLConnection, httplib::Error::Read, httplib::Error::Write}) {
    INFO(httplib::to_string(e));
    CHECK_THAT(EtcdTransportHint(e, true), Catch::Contains("--state-store-cert"));
  }
  for (httplib::Error e : {httplib::Error::Read, httplib::Error::Write}) {
    INFO(httplib::to_string(e));
    CHECK_THAT(EtcdTransportHint(e, false), Catch::Contains("give etcds://"));
  }
  CHECK_THAT(EtcdTransportHint(httplib::Error::SSLServerVerification, true),
             Catch::Contains("--state-store-ca"));
  CHECK(EtcdTransportHint(httplib::Error::Success, true).empty());
}

TEST_CASE("etcd: URLs are checked and bounded") {
  CHECK(ParseEtcdUrl("etcd://a:1,b:2/x/y/")->prefix == "/x/y");
  CHECK(ParseEtcdUrl("etcd://a:1,b:2/x")->endpoints == std::vector<std::string>{"a:1", "b:2"});
  CHECK(!ParseEtcdUrl("etcd://a:1/x")->secure);
  CHECK(ParseEtcdUrl("etcds://a:1/x")->secure);
  CHECK(ParseEtcdUrl("etcds://a:1/x")->endpoints == std::vector<std::string>{"a:1"});
  for (const char* bad : {"etcd://a:1", "etcd://a/x", "etcd://a:0/x", "etcd://a:1,/x",
                          "http://a:1/x", "etcd://a:1//", "etcds://a:1", "etcd://a:1/x y"}) {
    INFO(bad);
    CHECK(ParseEtcdUrl(bad).status().code() == Code::kInvalidArgument);
  }
  CHECK(ParseEtcdUrl("etcd://a:1/" + std::string(5000, 'x')).status().code() ==
        Code::kInvalidArgument);
  std::string many = "etcd://";
  for (int i = 0; i < 17; ++i) many += (i ? "," : "") + std::string("h:1");
  CHECK(ParseEtcdUrl(many + "/x").status().code() == Code::kInvalidArgument);
}

TEST_CASE("etcd: base64 round trip of every byte and of every length's padding") {
  std::string all;
  for (int i = 0; i < 256; ++i) all += static_cast<char>(i);
  for (size_t n = 0; n <= all.size(); n += (n < 8 ? 1 : 37)) {
    std::string in = all.substr(0, n);
    auto out = Base64Decode(Base64Encode(in));
    REQUIRE(out.ok());
    CHECK(*out == in);
  }
  CHECK(Base64Encode("ab") == "YWI=");
  CHECK(!Base64Decode("YW*=").ok());
  CHECK(!Base64Decode("Y===").ok());
}

}  // namespace
}  // namespace elastic::driver
