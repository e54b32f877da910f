// The driver's policy on a fake clock: events in, actions out; no process, socket or sleep.
#include "driver/policy.h"

#include <signal.h>

#include <algorithm>
#include <catch2/catch.hpp>

namespace elastic::driver {
namespace {

using discovery::HostSlots;
using rendezvous::EventKind;
using rendezvous::FormedRound;
using std::chrono::seconds;

DriverOptions Static(std::vector<HostSlots> hosts, int np, int min_np) {
  DriverOptions d;
  d.hosts = std::move(hosts);
  d.np = np;
  d.min_np = min_np;
  d.elastic = min_np != np;
  return d;
}

// An elastic job (--min-np 1) whose hosts come from a discovery script, up to max_np workers.
DriverOptions Discovered(int max_np) {
  DriverOptions d;
  d.discovery_script = "discover.sh";
  d.np = d.min_np = 1;
  d.max_np = max_np;
  d.elastic = true;
  return d;
}

// A policy, its fake clock, and every action it took.
struct Job {
  explicit Job(DriverOptions d, std::function<bool(const std::string&)> is_local = nullptr) {
    PolicyOptions o;
    o.driver = std::move(d);
    o.clock = &clock;
    o.seed = 7;
    if (is_local) o.is_local = std::move(is_local);
    policy = std::make_unique<Policy>(o);
  }
  // Takes the new actions (keep them in a variable: the helpers below point into them); every launch is answered as a started process.
  std::vector<Action> Take() {
    std::vector<Action> out = policy->TakeActions();
    for (const auto& a : out) {
      if (a.kind == Action::kLaunch) policy->OnLaunched(a.slot, ++pid);
    }
    std::vector<Action> more = policy->TakeActions();  // worker_started events
    out.insert(out.end(), more.begin(), more.end());
    return out;
  }
  void Form(int64_t round, std::vector<std::string> members, std::vector<int64_t> versions = {}) {
    FormedRound f;
    f.round = round;
    f.members = std::move(members);
    f.versions = versions.empty() ? std::vector<int64_t>(f.members.size(), 0) : versions;
    f.version = *std::max_element(f.versions.begin(), f.versions.end());
    f.newest_committed = f.version;
    policy->OnRoundFormed(f);
  }
  // Starts the job on `hosts` and forms round 0 with `members`.
  void StartFormed(const std::vector<HostSlots>& hosts, std::vector<std::string> members) {
    policy->Start(hosts);
    Take();
    Form(0, std::move(members));
  }
  void Commit(const std::string& slot, int64_t round, int64_t step) {
    rendezvous::Report r;
    r.slot = slot;
    r.kind = rendezvous::ReportKind::kCommitted;
    r.round = round;
    r.step = step;
    r.version = step;
    policy->OnReport(r);
  }
  // Its FINISHED after `step`.
  void Finished(const std::string& slot, int64_t round, int64_t step) {
    rendezvous::Report r;
    r.slot = slot;
    r.kind = rendezvous::ReportKind::kFinished;
    r.round = round;
    r.step = r.version = step;
    policy->OnReport(r);
  }
  // A worker (a spare) that connected its Watch and answers.
  void Ready(const std::string& slot) {
    policy->OnWatch(slot, true);
    Heartbeat(slot, -1, 0, false);
  }
  void Advance(Duration d) {
    clock.Advance(d);
    policy->OnTimer();
  }
  void Heartbeat(const std::string& slot, int64_t round, int64_t collectives, bool in_collective,
                 int stack_signal = 0) {
    rendezvous::Report r;
    r.slot = slot;
    r.kind = rendezvous::ReportKind::kHeartbeat;
    r.round = round;
    r.collectives = collectives;
    r.in_collective = in_collective;
    r.stack_signal = stack_signal;
    policy->OnReport(r);
  }
  // Seconds pass one at a time, with heartbeats from `beating` (slot -> (count, in one)).
  void Pass(int seconds_, int64_t round,
            const std::map<std::string, std::pair<int64_t, bool>>& beating) {
    for (int i = 0; i < seconds_; ++i) {
      for (const auto& [slot, b] : beating) Heartbeat(slot, round, b.first, b.second, 12);
      Advance(std::chrono::seconds(1));
    }
  }

  FakeClock clock;
  std::unique_ptr<Policy> policy;
  int64_t pid = 100;
};

std::vector<const Action*> Of(const std::vector<Action>& actions, Action::Kind kind) {
  std::vector<const Action*> out;
  for (const auto& a : actions) {
    if (a.kind == kind) out.push_back(&a);
  }
  return out;
}

std::vector<std::string> Slots(const std::vector<Action>& actions, Action::Kind kind,
                               int signal = 0) {
  std::vector<std::string> out;
  for (const Action* a : Of(actions, kind)) {
    if (signal == 0 || a->signal == signal) out.push_back(a->slot);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<const Action*> Events(const std::vector<Action>& actions, const std::string& name) {
  std::vector<const Action*> out;
  for (const Action* a : Of(actions, Action::kWriteEvent)) {
    if (a->name == name) out.push_back(a);
  }
  return out;
}

const JsonValue* Field(const Action& a, const std::string& key) {
  for (const auto& [k, v] : a.fields) {
    if (k == key) return &v;
  }
  return nullptr;
}

// Members of a proposal in rank order.
std::vector<std::string> Members(const Action& propose) {
  std::vector<std::string> out(propose.assignments.size());
  for (const auto& [slot, a] : propose.assignments) out[static_cast<size_t>(a.rank)] = slot;
  return out;
}

TEST_CASE("policy: a job starts, forms and succeeds when every member exits 0", "[unit]") {
  Job job(Static({{"localhost", 2}}, 2, 2));
  job.policy->Start({{"localhost", 2}});
  auto a = job.Take();
  auto proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(Members(*proposals[0]) == std::vector<std::string>{"localhost:0", "localhost:1"});
  CHECK(Slots(a, Action::kLaunch) == std::vector<std::string>{"localhost:0", "localhost:1"});
  CHECK(Events(a, "worker_started").size() == 2);
  job.Form(0, {"localhost:0", "localhost:1"});
  job.policy->OnExit("localhost:1", 0, "exit status 0");
  CHECK_FALSE(job.policy->shutting_down());
  job.policy->OnExit("localhost:0", 0, "exit status 0");
  CHECK(job.policy->shutting_down());
  CHECK(job.policy->exit_code() == 0);
  CHECK(job.policy->final_message() == "success: all 2 workers of round 0 finished");
}

TEST_CASE("policy: a program that never joins succeeds when all exit 0", "[unit]") {
  Job job(Static({{"localhost", 2}}, 2, 2));
  job.policy->Start({{"localhost", 2}});
  job.Take();
  job.policy->OnExit("localhost:0", 0, "exit status 0");
  job.policy->OnExit("localhost:1", 0, "exit status 0");
  CHECK(job.policy->exit_code() == 0);
  CHECK(job.policy->final_message() == "success: all 2 workers finished");
}

TEST_CASE("policy bug 1: no workers left and no host can come back ends the job at once",
          "[unit]") {
  DriverOptions d = Static({{"localhost", 2}}, 2, 2);
  d.elastic = true;  // -np 2 --min-np 2
  Job job(d);
  job.policy->Start({{"localhost", 2}});
  job.Take();
  job.policy->OnExit("localhost:0", 1, "exit status 1");
  auto a = job.Take();
  REQUIRE(job.policy->shutting_down());
  CHECK(job.policy->exit_code() == 1);
  CHECK_THAT(job.policy->final_message(), Catch::Contains("no hosts left"));
  CHECK(Slots(a, Action::kSignal, SIGTERM) == std::vector<std::string>{"localhost:1"});
  CHECK(Events(a, "waiting_for_hosts").empty());
}

TEST_CASE("policy: a host in cooldown can come back, so the job waits for it", "[unit]") {
  DriverOptions d = Static({{"localhost", 2}}, 2, 2);
  d.elastic = true;
  d.cooldown_min = seconds(1);
  d.cooldown_max = seconds(8);
  Job job(d);
  job.StartFormed({{"localhost", 2}}, {"localhost:0", "localhost:1"});
  job.policy->OnExit("localhost:0", 1, "exit status 1");
  auto a = job.Take();
  CHECK_FALSE(job.policy->shutting_down());
  CHECK(Events(a, "waiting_for_hosts").size() == 1);
  // The survivor's peer is told at once.
  auto publish = Of(a, Action::kPublish);
  REQUIRE(publish.size() == 1);
  CHECK(publish[0]->slot == "localhost:1");
  CHECK(publish[0]->event.kind == EventKind::kAbort);
  job.policy->OnExit("localhost:0", 1, "exit status 1");  // a duplicate exit changes nothing
  job.Advance(seconds(2));                                 // the cooldown (1-1.5 s) ends
  a = job.Take();
  auto proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(proposals[0]->round == 1);
  CHECK(Slots(a, Action::kLaunch) == std::vector<std::string>{"localhost:0"});
}

TEST_CASE("policy bug 2: one incident on a host is one blacklisting", "[unit]") {
  DriverOptions d = Static({{"h", 8}, {"g", 1}}, 9, 1);
  d.cooldown_min = seconds(1);
  d.cooldown_max = seconds(8);
  Job job(d);
  job.policy->Start({{"h", 8}, {"g", 1}});
  job.Take();
  std::vector<std::string> all;
  for (int i = 0; i < 8; ++i) all.push_back("h:" + std::to_string(i));
  all.push_back("g:0");
  job.Form(0, all);
  std::vector<Action> a;
  for (int i = 0; i < 8; ++i) {
    job.policy->OnExit("h:" + std::to_string(i), 137, "signal 9");
    auto more = job.Take();
    a.insert(a.end(), more.begin(), more.end());
  }
  auto black = Events(a, "host_blacklisted");
  REQUIRE(black.size() == 1);
  const double first = std::get<double>(*Field(*black[0], "cooldown"));
  CHECK(first >= 1.0);
  CHECK(first <= 1.5);
  // The host comes back; a new incident (a later round) is a second blacklisting, longer. Its
  // slots get newcomers (g:0 trains on), and the job re-forms with them once they are ready.
  job.Advance(seconds(2));
  a = job.Take();
  CHECK(Slots(a, Action::kLaunch).size() == 8);
  for (int i = 0; i < 8; ++i) {
    job.policy->OnWaitingForPlace("h:" + std::to_string(i));
    auto more = job.Take();
    a.insert(a.end(), more.begin(), more.end());
  }
  auto proposals = Of(a, Action::kProposeRound);
  REQUIRE_FALSE(proposals.empty());
  int64_t round = proposals.back()->round;
  job.Form(round, Members(*proposals.back()));
  job.policy->OnExit("h:0", 1, "exit status 1");
  job.policy->OnExit("h:1", 1, "exit status 1");
  a = job.Take();
  black = Events(a, "host_blacklisted");
  REQUIRE(black.size() == 1);
  CHECK(std::get<double>(*Field(*black[0], "cooldown")) >= 2.0);
}

TEST_CASE("policy bug 3: a clean exit before any round formed, after failures, is no success",
          "[unit]") {
  DriverOptions d = Static({{"localhost", 1}, {"127.0.0.1", 2}}, 3, 1);
  d.cooldown_min = seconds(1);
  d.cooldown_max = seconds(8);
  Job job(d);
  job.policy->Start(d.hosts);
  job.Take();
  job.policy->OnExit("127.0.0.1:0", 1, "exit status 1");
  job.policy->OnExit("127.0.0.1:1", 1, "exit status 1");
  job.Take();
  job.policy->OnExit("localhost:0", 0, "exit status 0");
  REQUIRE(job.policy->shutting_down());
  CHECK(job.policy->exit_code() == 1);
  CHECK_THAT(job.policy->final_message(), Catch::Contains("before round"));
}

TEST_CASE("policy bug 4: a proposal that lost a member below the minimum is withdrawn",
          "[unit]") {
  DriverOptions d;
  d.discovery_script = "discover.sh";
  d.np = d.min_np = 2;
  d.elastic = true;
  Job job(d);
  job.policy->Start({{"a", 1}, {"b", 1}});
  job.Take();
  job.policy->OnExit("b:0", 1, "exit status 1");  // before round 0 formed
  auto a = job.Take();
  auto withdrawn = Of(a, Action::kWithdrawRound);
  REQUIRE(withdrawn.size() == 1);
  CHECK(withdrawn[0]->round == 0);
  CHECK(Of(a, Action::kProposeRound).empty());
  CHECK(Events(a, "waiting_for_hosts").size() == 1);
  CHECK_FALSE(job.policy->shutting_down());
  // A new host: the next round forms with the survivor.
  job.policy->OnDiscovery(std::vector<HostSlots>{{"a", 1}, {"b", 1}, {"c", 1}}, {});
  a = job.Take();
  auto proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(Members(*proposals[0]) == std::vector<std::string>{"a:0", "c:0"});
  CHECK(Slots(a, Action::kLaunch) == std::vector<std::string>{"c:0"});
}

TEST_CASE("policy bug 8: a rank that stops while its peers go on ends the job with a reason",
          "[unit]") {
  Job job(Static({{"localhost", 3}}, 3, 1));
  job.StartFormed({{"localhost", 3}}, {"localhost:0", "localhost:1", "localhost:2"});
  for (const char* s : {"localhost:0", "localhost:1", "localhost:2"}) job.Commit(s, 0, 5);
  SECTION("a peer commits a later step") {
    job.policy->OnExit("localhost:0", 0, "exit status 0");
    CHECK_FALSE(job.policy->shutting_down());
    job.Commit("localhost:1", 0, 6);
  }
  SECTION("a peer joins again after its collective failed") {
    job.policy->OnExit("localhost:2", 0, "exit status 0");
    job.policy->OnMemberLeft(0, "localhost:0");
  }
  REQUIRE(job.policy->shutting_down());
  CHECK(job.policy->exit_code() == 1);
  CHECK_THAT(job.policy->final_message(), Catch::Contains("same step"));
}

TEST_CASE("policy bug 9: a line carries the rank of the round the worker is in", "[unit]") {
  Job job(Static({{"a", 3}}, 3, 1));
  job.StartFormed({{"a", 3}}, {"a:0", "a:1", "a:2"});
  CHECK(job.policy->Label("a:2") == "2");
  job.policy->OnExit("a:0", 1, "exit status 1");
  auto a = job.Take();
  REQUIRE(Of(a, Action::kProposeRound).size() == 1);
  // Round 1 is only proposed: a:2 still runs as rank 2 of round 0.
  CHECK(job.policy->Label("a:2") == "2");
  job.Form(1, {"a:2", "a:1"});
  CHECK(job.policy->Label("a:2") == "0");
  CHECK(job.policy->Label("a:1") == "1");
  CHECK(job.policy->Label("nobody:0") == "nobody:0");
}

TEST_CASE("policy: worker_exited has the slot and a numeric rank", "[unit]") {
  Job job(Static({{"a", 2}}, 2, 2));
  job.StartFormed({{"a", 2}}, {"a:1", "a:0"});
  job.policy->OnExit("a:0", 0, "exit status 0");
  auto a = job.Take();
  auto exited = Events(a, "worker_exited");
  REQUIRE(exited.size() == 1);
  CHECK(std::get<std::string>(*Field(*exited[0], "slot")) == "a:0");
  CHECK(std::get<int64_t>(*Field(*exited[0], "rank")) == 1);
}

TEST_CASE("policy: slots that miss the rendezvous are killed, counted once, and re-planned",
          "[unit]") {
  DriverOptions d = Static({{"a", 1}, {"b", 2}}, 1, 1);
  d.elastic = true;
  Job job(d);
  job.policy->Start(d.hosts);
  job.Take();
  job.policy->OnJoinTimeout(0, {"b:0", "b:1"});
  auto a = job.Take();
  CHECK(Slots(a, Action::kSignal, SIGKILL) == std::vector<std::string>{"b:0", "b:1"});
  CHECK(Events(a, "host_blacklisted").size() == 1);
  auto proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(Members(*proposals[0]) == std::vector<std::string>{"a:0"});
  job.policy->OnJoinTimeout(0, {"a:0"});  // about an old round: ignored
  CHECK(Of(job.Take(), Action::kSignal).empty());
}

TEST_CASE("policy: members still in the old round at the rendezvous timeout are aborted "
          "before they are killed",
          "[unit]") {
  // Found by the soak (seed 298247134): round 11 made no commit after the fence, its members
  // missed round 12's wait and were killed, the only holder of the state among them.
  Job job(Discovered(4));
  job.StartFormed({{"a", 3}}, {"a:0", "a:1", "a:2"});
  job.Commit("a:0", 0, 5);
  job.policy->OnDiscovery(std::vector<HostSlots>{{"a", 2}}, {});  // round 1: a:2 removed
  job.Take();
  job.policy->OnJoinTimeout(1, {"a:0", "a:1"});
  auto a = job.Take();
  CHECK(Of(a, Action::kSignal).empty());
  CHECK(Of(a, Action::kProposeRound).empty());
  CHECK(Slots(a, Action::kDumpStacks) == std::vector<std::string>{"a:0", "a:1"});
  std::vector<std::string> aborted;
  for (const Action* p : Of(a, Action::kPublish)) {
    if (p->event.kind == EventKind::kAbort && p->event.round == 0) aborted.push_back(p->slot);
  }
  std::sort(aborted.begin(), aborted.end());
  CHECK(aborted == std::vector<std::string>{"a:0", "a:1", "a:2"});
  auto again = Of(a, Action::kRestartWait);
  REQUIRE(again.size() == 1);
  std::vector<std::string> waits = again[0]->slots;
  std::sort(waits.begin(), waits.end());
  CHECK(waits == std::vector<std::string>{"a:0", "a:1", "a:2"});  // every member aborted
  CHECK(Events(a, "round_hung").size() == 1);
  // Missing again after the abort: now they are dropped.
  job.policy->OnJoinTimeout(1, {"a:1"});
  a = job.Take();
  CHECK(Slots(a, Action::kSignal, SIGKILL) == std::vector<std::string>{"a:1"});
  CHECK(Of(a, Action::kRestartWait).empty());
}

TEST_CASE("policy: --max-failures and --reset-limit end the job", "[unit]") {
  DriverOptions d = Static({{"a", 4}}, 4, 1);
  d.host_failure_limit = 0;
  SECTION("max failures") {
    d.max_failures = 1;
    Job job(d);
    job.policy->Start(d.hosts);
    job.Take();
    job.Form(0, {"a:0", "a:1", "a:2", "a:3"});
    job.policy->OnExit("a:0", 1, "exit status 1");
    CHECK_FALSE(job.policy->shutting_down());
    job.policy->OnExit("a:1", 1, "exit status 1");
    CHECK(job.policy->exit_code() == 1);
    CHECK_THAT(job.policy->final_message(), Catch::Contains("--max-failures 1"));
  }
  SECTION("reset limit") {
    d.reset_limit = 1;
    Job job(d);
    job.policy->Start(d.hosts);
    job.Take();
    job.Form(0, {"a:0", "a:1", "a:2", "a:3"});
    job.policy->OnExit("a:0", 1, "exit status 1");  // reset 1: a:0 relaunched
    CHECK_FALSE(job.policy->shutting_down());
    job.policy->OnExit("a:1", 1, "exit status 1");
    CHECK(job.policy->exit_code() == 1);
    CHECK_THAT(job.policy->final_message(), Catch::Contains("reset limit"));
  }
}

TEST_CASE("policy: discovery grows the job up to --max-np, a smaller host drops its slots",
          "[unit]") {
  Job job(Discovered(3));
  job.StartFormed({{"a", 2}}, {"a:0", "a:1"});
  job.policy->OnDiscovery(std::vector<HostSlots>{{"a", 2}, {"b", 4}}, {});
  auto a = job.Take();
  CHECK(Slots(a, Action::kLaunch) == std::vector<std::string>{"b:0"});  // a newcomer
  CHECK(Of(a, Action::kProposeRound).empty());
  job.policy->OnWaitingForPlace("b:0");
  a = job.Take();
  auto proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(Members(*proposals[0]) == std::vector<std::string>{"a:0", "a:1", "b:0"});
  // The old round's members are fenced: they stop at their next commit.
  CHECK(Slots(a, Action::kPublish) == std::vector<std::string>{"a:0", "a:1"});
  job.Form(1, {"a:0", "a:1", "b:0"});
  // a shrinks to one slot and b (rank 0's host in a moment) goes away.
  job.policy->OnDiscovery(std::vector<HostSlots>{{"a", 1}, {"c", 1}}, {});
  a = job.Take();
  proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(Members(*proposals[0]) == std::vector<std::string>{"a:0"});  // c:0: a newcomer
  CHECK(proposals[0]->removed == std::vector<std::string>{"a:1", "b:0"});
  CHECK(Slots(a, Action::kLaunch) == std::vector<std::string>{"c:0"});
  // Removed workers leave; their clean exit does not finish the job.
  job.policy->OnExit("b:0", 0, "exit status 0");
  job.policy->OnExit("a:1", 0, "exit status 0");
  CHECK_FALSE(job.policy->shutting_down());
}

TEST_CASE("policy: a removed host's worker that alone holds the state stays until it is handed "
          "over",
          "[unit]") {
  // Regression (soak seed 609133795): discovery stopped listing the host of the only worker
  // that held the state (the others were new after kills); it was removed and the job ended
  // with "state lost".
  Job job(Discovered(4));
  job.StartFormed({{"b", 1}}, {"b:0"});
  job.Commit("b:0", 0, 5);
  job.policy->OnDiscovery(std::vector<HostSlots>{{"b", 1}, {"a", 1}}, {});  // a:0: new
  job.Take();
  job.policy->OnWaitingForPlace("a:0");
  job.Take();
  job.Form(1, {"b:0", "a:0"}, {5, 0});
  // b goes away (a spot host reclaimed) and c comes: b:0 stays one round to hand the state on.
  job.policy->OnDiscovery(std::vector<HostSlots>{{"a", 1}, {"c", 1}}, {});
  auto a = job.Take();
  REQUIRE(Events(a, "holder_kept").size() == 1);
  CHECK(Of(a, Action::kProposeRound).empty());  // c:0 is a newcomer: nothing changes yet
  job.policy->OnWaitingForPlace("c:0");
  auto more = job.Take();
  a.insert(a.end(), more.begin(), more.end());
  auto proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(Members(*proposals[0]) == std::vector<std::string>{"b:0", "a:0", "c:0"});
  CHECK(proposals[0]->removed.empty());
  REQUIRE(Events(a, "holder_kept").size() == 1);
  CHECK(std::get<std::string>(*Field(*Events(a, "holder_kept")[0], "slot")) == "b:0");
  // Another re-plan before the hand-over keeps it too (no second event).
  job.policy->OnDiscovery(std::vector<HostSlots>{{"a", 1}, {"c", 2}}, {});
  a = job.Take();
  job.policy->OnWaitingForPlace("c:1");
  more = job.Take();
  a.insert(a.end(), more.begin(), more.end());
  proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(Members(*proposals[0]) == std::vector<std::string>{"b:0", "a:0", "c:0", "c:1"});
  CHECK(Events(a, "holder_kept").empty());
  job.Form(3, {"b:0", "a:0", "c:0", "c:1"}, {5, 0, 0, 0});
  // The sync hands the state over; b:0's own commit changes nothing, a listed member's ends it.
  job.Commit("b:0", 3, 6);
  CHECK(Of(job.Take(), Action::kProposeRound).empty());
  job.Commit("a:0", 3, 6);
  a = job.Take();
  proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(Members(*proposals[0]) == std::vector<std::string>{"a:0", "c:0", "c:1"});
  CHECK(proposals[0]->removed == std::vector<std::string>{"b:0"});
}

TEST_CASE("policy: a worker told to go is kept when the other holder dies before it left",
          "[unit]") {
  // Found by the soak (seed 298247134, job 8): a scale-down removed a:1 while a:0 also held
  // the state; a:0 was then lost (SIGSTOP) before a:1 reached its Join, the next round
  // planned without a:1, and a:1 left with the only copy.
  Job job(Discovered(4));
  job.StartFormed({{"a", 2}}, {"a:0", "a:1"});
  job.Commit("a:0", 0, 5);
  job.Commit("a:1", 0, 5);
  job.policy->OnDiscovery(std::vector<HostSlots>{{"a", 1}, {"b", 1}}, {});
  auto a = job.Take();
  auto proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(proposals[0]->removed == std::vector<std::string>{"a:1"});  // a:0 holds it too
  job.policy->OnExit("a:0", 137, "killed by signal 9");
  a = job.Take();
  proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  auto members = Members(*proposals[0]);
  CHECK(std::find(members.begin(), members.end(), "a:1") != members.end());
  REQUIRE(Events(a, "holder_kept").size() == 1);
  // The removal had reached it first: it leaves with exit 0, which does not end the job. The
  // newcomers of b:0 and a:0 are then all there is: the next round waits for them.
  job.policy->OnExit("a:1", 0, "exit status 0");
  a = job.Take();
  CHECK_FALSE(job.policy->shutting_down());
  proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  members = Members(*proposals[0]);
  CHECK(std::find(members.begin(), members.end(), "a:1") == members.end());
}

TEST_CASE("policy: a removed host's worker is not kept when a listed one holds the state",
          "[unit]") {
  Job job(Discovered(4));
  job.StartFormed({{"a", 1}, {"b", 1}}, {"a:0", "b:0"});
  job.Commit("a:0", 0, 5);
  job.Commit("b:0", 0, 5);
  job.policy->OnDiscovery(std::vector<HostSlots>{{"a", 1}}, {});
  auto a = job.Take();
  auto proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(Members(*proposals[0]) == std::vector<std::string>{"a:0"});
  CHECK(proposals[0]->removed == std::vector<std::string>{"b:0"});
  CHECK(Events(a, "holder_kept").empty());
}

TEST_CASE("policy: SIGTERM stops every worker, a second signal or the grace period kills",
          "[unit]") {
  DriverOptions d = Static({{"a", 2}}, 2, 2);
  d.grace = seconds(5);
  Job job(d);
  job.policy->Start(d.hosts);
  job.Take();
  job.policy->OnSignal(SIGTERM, "Terminated");
  auto a = job.Take();
  CHECK(job.policy->exit_code() == 128 + SIGTERM);
  CHECK(Slots(a, Action::kSignal, SIGTERM) == std::vector<std::string>{"a:0", "a:1"});
  job.policy->OnExit("a:0", 143, "signal 15");
  SECTION("grace period") {
    job.Advance(seconds(4));
    CHECK(Of(job.Take(), Action::kSignal).empty());
    job.Advance(seconds(2));
  }
  SECTION("second signal") { job.policy->OnSignal(SIGINT, "Interrupt"); }
  CHECK(Slots(job.Take(), Action::kSignal, SIGKILL) == std::vector<std::string>{"a:1"});
  CHECK(job.policy->exit_code() == 128 + SIGTERM);
}

TEST_CASE("policy: a remote worker whose Watch breaks is killed unless it comes back",
          "[unit]") {
  DriverOptions d = Static({{"r", 2}}, 2, 1);
  Job job(d, [](const std::string& host) { return host != "r"; });
  job.StartFormed(d.hosts, {"r:0", "r:1"});
  job.policy->OnWatch("r:0", false);
  job.policy->OnWatch("r:1", false);
  job.policy->OnWatch("r:1", true);
  job.Advance(seconds(4));
  auto a = job.Take();
  CHECK(Slots(a, Action::kSignal, SIGKILL) == std::vector<std::string>{"r:0"});
  CHECK(Events(a, "worker_lost").size() == 1);
}

TEST_CASE("policy: state lost fails the job and says how to start over", "[unit]") {
  Job job(Static({{"a", 2}}, 2, 1));
  job.policy->Start({{"a", 2}});
  job.Take();
  FormedRound f;
  f.round = 0;
  f.members = {"a:0", "a:1"};
  f.newest_committed = 9;
  job.policy->OnStateLost(f);
  CHECK(job.policy->exit_code() == 1);
  CHECK_THAT(job.policy->final_message(), Catch::Contains("--start-over-if-state-lost"));
}

// Soak seed 837298589 (--checkpoints): every holder killed, round 31 formed state-lost; a
// newcomer fenced it before its rank 0 restored, and round 32 formed with no commit either. The
// core had started versions over (newest_committed 0), so round 32 was no loss to it, and its
// restore was reported as an ordinary resume that lost nothing.
TEST_CASE("policy: a state-lost round superseded before its restore hands the restore on",
          "[unit]") {
  DriverOptions d = Static({{"a", 3}}, 3, 1);
  d.checkpoint_dir = "/ckpt";
  Job job(d);
  job.StartFormed({{"a", 3}}, {"a:0", "a:1", "a:2"});
  job.Commit("a:0", 0, 40);
  job.policy->OnMemberLeft(0, "a:1");  // round 1 is proposed
  job.Take();
  FormedRound lost;
  lost.round = 1;
  lost.members = {"a:0", "a:1", "a:2"};
  lost.versions = {0, 0, 0};
  lost.newest_committed = 40;
  lost.state_lost = true;
  job.policy->OnRoundFormed(lost);
  auto a = job.Take();
  REQUIRE(Events(a, "state_lost").size() == 1);
  // Round 2 forms before round 1's rank 0 said anything: no member holds a commit, and the
  // core no longer counts the loss (it started versions over).
  job.policy->OnMemberLeft(1, "a:2");
  a = job.Take();
  REQUIRE(Of(a, Action::kProposeRound).size() == 1);
  REQUIRE(Of(a, Action::kProposeRound)[0]->round == 2);
  FormedRound next;
  next.round = 2;
  next.members = {"a:0", "a:1", "a:2"};
  next.versions = {0, 0, 0};
  next.newest_committed = 0;
  job.policy->OnRoundFormed(next);
  rendezvous::Report r;
  r.slot = "a:0";
  r.kind = rendezvous::ReportKind::kRestored;
  r.round = 2;
  r.version = 30;
  r.step = 30;
  r.message = "/ckpt/v30";
  job.policy->OnReport(r);
  a = job.Take();
  auto restored = Events(a, "state_restored");
  REQUIRE(restored.size() == 1);
  CHECK(std::get<bool>(*Field(*restored[0], "state_lost")));
  CHECK(std::get<int64_t>(*Field(*restored[0], "steps_lost")) == 10);
  REQUIRE(Field(*restored[0], "lost_in_round") != nullptr);
  CHECK(std::get<int64_t>(*Field(*restored[0], "lost_in_round")) == 1);
  CHECK_FALSE(job.policy->shutting_down());
}

// CI (test_faults.py, every holder gone, --start-over-if-state-lost): both workers killed at
// commit 3; the relaunched slot's newcomer made the policy propose round 3 before the driver's
// loop heard that round 2 had formed state-lost. The policy dropped round 2's formation as
// stale, the core had started versions over, and round 3 formed from version 0 with no word of
// the loss: a silent restart.
TEST_CASE("policy: a state-lost round formed after the policy moved on is still said",
          "[unit]") {
  for (bool checkpoints : {false, true}) {
    DriverOptions d = Static({{"a", 2}}, 2, 1);
    d.start_over_if_state_lost = !checkpoints;
    if (checkpoints) d.checkpoint_dir = "/ckpt";
    Job job(d);
    job.StartFormed({{"a", 2}}, {"a:0", "a:1"});
    job.Commit("a:0", 0, 3);
    job.policy->OnMemberLeft(0, "a:1");  // round 1 is proposed
    job.Take();
    const int64_t first = job.policy->state().round;
    REQUIRE(first == 1);
    job.policy->OnExit("a:0", 137, "signal 9 (Killed)");  // superseded before it is heard formed
    job.Take();
    REQUIRE(job.policy->state().round > first);
    FormedRound lost;
    lost.round = first;
    lost.members = {"a:0", "a:1"};
    lost.versions = {0, 0};
    lost.newest_committed = 3;
    lost.state_lost = true;
    job.policy->OnRoundFormed(lost);  // heard late: the policy is past it
    auto a = job.Take();
    auto said = Events(a, "state_lost");
    REQUIRE(said.size() == 1);
    CHECK(std::get<int64_t>(*Field(*said[0], "newest_committed")) == 3);
    CHECK(std::get<int64_t>(*Field(*said[0], "round")) == lost.round);
    CHECK(Events(a, "round_formed").empty());  // the stale round itself is not taken up
    if (!checkpoints) continue;
    // The next round holds no commit either (the core no longer counts the loss): its rank 0's
    // restore is the loss's, and finding no checkpoint ends the job.
    FormedRound next;
    next.round = job.policy->state().round;
    next.members = {"a:0", "a:1"};
    next.versions = {0, 0};
    job.policy->OnRoundFormed(next);
    rendezvous::Report r;
    r.slot = "a:0";
    r.kind = rendezvous::ReportKind::kRestored;
    r.round = next.round;
    r.version = 0;
    r.message = "no checkpoint in /ckpt";
    job.policy->OnReport(r);
    job.Take();
    CHECK(job.policy->exit_code() == 1);
    CHECK_THAT(job.policy->final_message(), Catch::Contains("state lost"));
  }
}

TEST_CASE("policy: a failed member's survivors get one ABORT each, no fence after it", "[unit]") {
  // The survivors of a formed round are told to abort it; the next round's proposal does not
  // fence them again (they have stopped), so the driver sends one message per survivor.
  Job job(Static({{"a", 4}}, 4, 3));
  job.StartFormed({{"a", 4}}, {"a:0", "a:1", "a:2", "a:3"});
  job.policy->OnExit("a:3", 137, "signal 9 (Killed)");
  auto a = job.Take();
  REQUIRE(Of(a, Action::kProposeRound).size() == 1);
  std::vector<std::string> aborted;
  for (const Action* p : Of(a, Action::kPublish)) {
    CHECK(p->event.kind == EventKind::kAbort);
    CHECK(p->event.round == 0);
    aborted.push_back(p->slot);
  }
  std::sort(aborted.begin(), aborted.end());
  CHECK(aborted == std::vector<std::string>{"a:0", "a:1", "a:2"});
  CHECK(Events(a, "fence").size() == 1);  // the event log still says the round was fenced
}

// The namespace soak (seed 421863111): a restarted driver adopted round 3 and proposed round 4;
// one member, cut off, never re-attached, and its peers sat in a collective with it. Lost 30 s
// later, it aborted round 3, and round 5 was proposed with the waits round 4 had started 30 s
// before: already over, so the aborted peers, the state's only holders, were dropped as
// missing before they could roll back. Aborted members get a new wait, asked for before the
// proposal that follows (the core carries a slot's wait over into the next proposal).
TEST_CASE("policy: the members of an aborted round get a new rendezvous wait before the next "
          "proposal",
          "[unit]") {
  Job job(Discovered(4));
  job.StartFormed({{"a", 3}}, {"a:0", "a:1", "a:2"});
  job.Commit("a:0", 0, 5);
  job.policy->OnDiscovery(std::vector<HostSlots>{{"a", 3}, {"b", 1}}, {});  // round 1 waits
  job.Take();
  job.policy->OnExit("a:2", 137, "signal 9 (Killed)");
  auto a = job.Take();
  auto again = Of(a, Action::kRestartWait);
  REQUIRE(again.size() == 1);
  std::vector<std::string> slots = again[0]->slots;
  std::sort(slots.begin(), slots.end());
  CHECK(slots == std::vector<std::string>{"a:0", "a:1"});
  auto at = [&](Action::Kind kind) {
    return std::find_if(a.begin(), a.end(), [&](const Action& x) { return x.kind == kind; }) -
           a.begin();
  };
  REQUIRE(Of(a, Action::kProposeRound).size() == 1);
  CHECK(at(Action::kRestartWait) < at(Action::kProposeRound));
  // A later loss in the same round gives no new wait: a member that ignores the abort is not
  // kept waiting for by every loss after it.
  job.policy->OnExit("a:1", 137, "signal 9 (Killed)");
  CHECK(Of(job.Take(), Action::kRestartWait).empty());
  // A hung round no member stands out in is aborted the same way.
  DriverOptions d = Static({{"a", 2}}, 2, 1);
  d.elastic = true;
  d.hang_timeout = seconds(3);
  Job hung(d);
  hung.StartFormed(d.hosts, {"a:0", "a:1"});
  for (const char* s : {"a:0", "a:1"}) hung.Commit(s, 0, 1);
  hung.Pass(5, 0, {{"a:0", {9, true}}, {"a:1", {9, true}}});
  hung.Pass(2, 0, {{"a:0", {9, true}}, {"a:1", {9, true}}});
  a = hung.Take();
  REQUIRE(Events(a, "round_hung").size() == 1);
  again = Of(a, Action::kRestartWait);
  REQUIRE(again.size() == 1);
  slots = again[0]->slots;
  std::sort(slots.begin(), slots.end());
  CHECK(slots == std::vector<std::string>{"a:0", "a:1"});
}

TEST_CASE("policy: a member that leaves its round on its own makes its peers re-form",
          "[unit]") {
  Job job(Static({{"a", 3}}, 3, 1));
  job.StartFormed({{"a", 3}}, {"a:0", "a:1", "a:2"});
  job.policy->OnMemberLeft(0, "a:1");
  auto a = job.Take();
  auto publish = Of(a, Action::kPublish);
  std::vector<std::string> aborted;
  for (const Action* p : publish) {
    if (p->event.kind == EventKind::kAbort) aborted.push_back(p->slot);
  }
  std::sort(aborted.begin(), aborted.end());
  CHECK(aborted == std::vector<std::string>{"a:0", "a:2"});
  auto proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(proposals[0]->round == 1);
  CHECK(Members(*proposals[0]) == std::vector<std::string>{"a:0", "a:1", "a:2"});
}

// The namespace soak (seed 443641197, job 8): a member scaled away at a fence left its round
// (rendezvous::Core now says so for a removed slot too); its peers, stuck in the commit
// agreement with a member whose link was out, must be aborted then, not at the rendezvous
// timeout. The pending round stays as proposed.
TEST_CASE("policy: a scaled-away member that leaves at the fence aborts its peers' round",
          "[unit]") {
  Job job(Discovered(3));
  job.StartFormed({{"a", 3}}, {"a:0", "a:1", "a:2"});
  job.policy->OnDiscovery(std::vector<HostSlots>{{"a", 2}}, {});
  auto a = job.Take();
  auto proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(proposals[0]->removed == std::vector<std::string>{"a:2"});
  job.policy->OnMemberLeft(0, "a:2");
  a = job.Take();
  std::vector<std::string> aborted;
  for (const Action* p : Of(a, Action::kPublish)) {
    if (p->event.kind == EventKind::kAbort && p->event.round == 0) aborted.push_back(p->slot);
  }
  std::sort(aborted.begin(), aborted.end());
  CHECK(aborted == std::vector<std::string>{"a:0", "a:1"});
  CHECK(Of(a, Action::kProposeRound).empty());  // round 1 is still the one to form
}

TEST_CASE("policy: the next deadline follows the timers that are set", "[unit]") {
  DriverOptions d;
  d.discovery_script = "discover.sh";
  d.np = d.min_np = 2;
  d.elastic = true;
  d.start_timeout = seconds(30);
  Job job(d);
  job.policy->Start({{"a", 1}});  // one slot of two: waits
  job.Take();
  CHECK(job.policy->NextDeadline() == job.clock.Now() + seconds(30));
  job.Advance(seconds(31));
  CHECK(job.policy->exit_code() == 1);
  CHECK_THAT(job.policy->final_message(), Catch::Contains("timed out waiting for -np 2"));
}

TEST_CASE("policy: a member idle while its peers wait in a collective is named hung",
          "[unit]") {
  DriverOptions d = Static({{"a", 3}}, 3, 2);
  d.elastic = true;
  d.hang_timeout = seconds(3);
  Job job(d);
  job.StartFormed(d.hosts, {"a:0", "a:1", "a:2"});
  for (const char* s : {"a:0", "a:1", "a:2"}) job.Commit(s, 0, 1);
  // Before the first commit window passes: nothing.
  job.Pass(2, 0, {{"a:0", {5, true}}, {"a:1", {4, false}}, {"a:2", {5, true}}});
  CHECK(Events(job.Take(), "worker_hung").empty());
  job.Pass(2, 0, {{"a:0", {5, true}}, {"a:1", {4, false}}, {"a:2", {5, true}}});
  auto a = job.Take();
  auto hung = Events(a, "worker_hung");
  REQUIRE(hung.size() == 1);
  CHECK(std::get<std::string>(*Field(*hung[0], "slot")) == "a:1");
  CHECK(std::get<int64_t>(*Field(*hung[0], "pid")) > 0);
  auto dumps = Of(a, Action::kDumpStacks);
  REQUIRE(dumps.size() == 1);
  CHECK(dumps[0]->slot == "a:1");
  CHECK(dumps[0]->signal == 12);
  CHECK(Slots(a, Action::kSignal, SIGKILL) == std::vector<std::string>{"a:1"});
  // Its peers are aborted and the job re-forms without it.
  auto proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(Members(*proposals[0]) == std::vector<std::string>{"a:0", "a:2"});
  // Its exit (SIGKILL) is expected: no second failure.
  job.policy->OnExit("a:1", 137, "signal 9");
  CHECK(Of(job.Take(), Action::kProposeRound).empty());
}

TEST_CASE("policy: the slot of a killed hung worker is used again once its process is gone",
          "[unit]") {
  // Found by the soak (seed 98094788): the hung worker was still running when the job
  // re-planned (below --min-np, waiting), and its exit re-planned nothing: the job waited
  // for an unrelated host change.
  DriverOptions d = Static({{"a", 2}}, 2, 2);
  d.elastic = true;
  d.host_failure_limit = 0;
  d.hang_timeout = seconds(3);
  Job job(d);
  job.StartFormed(d.hosts, {"a:0", "a:1"});
  for (const char* s : {"a:0", "a:1"}) job.Commit(s, 0, 1);
  job.Pass(4, 0, {{"a:0", {9, true}}});  // a:1 silent
  auto a = job.Take();
  REQUIRE(Events(a, "worker_hung").size() == 1);
  CHECK(Events(a, "waiting_for_hosts").size() == 1);  // a:1's process is still going away
  CHECK(Of(a, Action::kLaunch).empty());
  job.policy->OnExit("a:1", 137, "signal 9");
  a = job.Take();
  auto proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(Members(*proposals[0]) == std::vector<std::string>{"a:0", "a:1"});
  CHECK(Slots(a, Action::kLaunch) == std::vector<std::string>{"a:1"});
}

TEST_CASE("policy: a round that runs collectives but never commits is not hung", "[unit]") {
  DriverOptions d = Static({{"a", 2}}, 2, 1);
  d.elastic = true;
  d.hang_timeout = seconds(3);
  Job job(d);
  job.StartFormed(d.hosts, {"a:0", "a:1"});
  for (int64_t n = 1; n <= 10; ++n) {
    job.Pass(1, 0, {{"a:0", {n, n % 2 == 0}}, {"a:1", {n, false}}});
  }
  auto a = job.Take();
  CHECK(Events(a, "worker_hung").empty());
  CHECK(Events(a, "round_hung").empty());
  // Then the counts stop moving: after 2 x 3 s (no commit in the round yet) it is.
  job.Pass(7, 0, {{"a:0", {10, true}}, {"a:1", {10, false}}});
  a = job.Take();
  auto hung = Events(a, "worker_hung");
  REQUIRE(hung.size() == 1);
  CHECK(std::get<std::string>(*Field(*hung[0], "slot")) == "a:1");
}

TEST_CASE("policy: a silent member is named hung before one that waits", "[unit]") {
  DriverOptions d = Static({{"a", 2}}, 2, 1);
  d.elastic = true;
  d.hang_timeout = seconds(5);
  Job job(d);
  job.StartFormed(d.hosts, {"a:0", "a:1"});
  for (const char* s : {"a:0", "a:1"}) job.Commit(s, 0, 1);
  job.Pass(6, 0, {{"a:0", {9, true}}});  // a:1 sends nothing (stopped)
  auto a = job.Take();
  auto hung = Events(a, "worker_hung");
  REQUIRE(hung.size() == 1);
  CHECK(std::get<std::string>(*Field(*hung[0], "slot")) == "a:1");
  CHECK_THAT(std::get<std::string>(*Field(*hung[0], "reason")), Catch::Contains("silent"));
}

TEST_CASE("policy: when no member stands out the hung round is aborted and re-formed",
          "[unit]") {
  DriverOptions d = Static({{"a", 2}}, 2, 1);
  d.elastic = true;
  d.hang_timeout = seconds(3);
  Job job(d);
  job.StartFormed(d.hosts, {"a:0", "a:1"});
  for (const char* s : {"a:0", "a:1"}) job.Commit(s, 0, 1);
  // Nobody stands out: the driver waits 3 s more for a member to go silent, then aborts.
  job.Pass(5, 0, {{"a:0", {9, true}}, {"a:1", {9, true}}});
  CHECK(Events(job.Take(), "round_hung").empty());
  job.Pass(2, 0, {{"a:0", {9, true}}, {"a:1", {9, true}}});
  auto a = job.Take();
  CHECK(Events(a, "worker_hung").empty());
  CHECK(Events(a, "round_hung").size() == 1);
  CHECK(Of(a, Action::kSignal).empty());
  std::vector<std::string> aborted;
  for (const Action* p : Of(a, Action::kPublish)) {
    if (p->event.kind == EventKind::kAbort) aborted.push_back(p->slot);
  }
  CHECK(aborted.size() == 2);
  REQUIRE(Of(a, Action::kProposeRound).size() == 1);
}

TEST_CASE("policy: the default hang timeout follows the commit interval, with a floor",
          "[unit]") {
  DriverOptions d = Static({{"a", 2}}, 2, 1);
  d.elastic = true;
  Job job(d);
  job.StartFormed(d.hosts, {"a:0", "a:1"});
  std::map<std::string, std::pair<int64_t, bool>> waiting = {{"a:0", {9, true}},
                                                              {"a:1", {8, false}}};
  // A first step of 100 s: before any interval is known the limit is 300 s (doubled before
  // the round's first commit), so nothing trips.
  job.Pass(100, 0, waiting);
  for (const char* s : {"a:0", "a:1"}) job.Commit(s, 0, 1);
  // Steps of 8 s: the timeout becomes max(60, 10 x 8) = 80 s.
  for (int step = 2; step <= 4; ++step) {
    job.Pass(8, 0, waiting);
    for (const char* s : {"a:0", "a:1"}) job.Commit(s, 0, step);
  }
  job.Pass(79, 0, waiting);
  CHECK(Events(job.Take(), "worker_hung").empty());
  job.Pass(2, 0, waiting);
  auto a = job.Take();
  auto hung = Events(a, "worker_hung");
  REQUIRE(hung.size() == 1);
  CHECK(std::get<std::string>(*Field(*hung[0], "slot")) == "a:1");
}

TEST_CASE("policy: a local worker whose Watch stays broken is lost, named and dumped",
          "[unit]") {
  DriverOptions d = Static({{"a", 2}}, 2, 1);
  d.elastic = true;
  d.hang_timeout = seconds(1000);
  d.liveness_timeout = seconds(6);
  Job job(d);
  job.StartFormed(d.hosts, {"a:0", "a:1"});
  job.policy->OnWatch("a:1", false);
  job.Pass(1, 0, {{"a:0", {1, true}}, {"a:1", {1, false}}});
  CHECK(Events(job.Take(), "worker_hung").empty());
  job.Pass(2, 0, {{"a:0", {1, true}}});
  auto a = job.Take();
  auto hung = Events(a, "worker_hung");
  REQUIRE(hung.size() == 1);
  CHECK_THAT(std::get<std::string>(*Field(*hung[0], "reason")), Catch::Contains("Watch stream"));
  CHECK(Slots(a, Action::kDumpStacks) == std::vector<std::string>{"a:1"});
  CHECK(Slots(a, Action::kSignal, SIGKILL) == std::vector<std::string>{"a:1"});
}

// `d` with --spares `spares`, and no host ever blacklisted (a lost worker's slot is reused).
DriverOptions WithSpares(DriverOptions d, int spares) {
  d.spares = spares;
  d.host_failure_limit = 0;
  return d;
}

std::vector<std::string> Spares(const std::vector<Action>& actions) {
  std::vector<std::string> out;
  for (const Action* a : Of(actions, Action::kLaunch)) {
    if (a->spare) out.push_back(a->slot);
  }
  return out;
}

TEST_CASE("policy: warm spares start on free slots, take a lost member's place, and are replaced",
          "[unit]") {
  DriverOptions d = WithSpares(Static({{"a", 5}}, 4, 2), 1);
  Job job(d);
  job.policy->Start(d.hosts);
  auto a = job.Take();
  // Four members and one spare, on the fifth slot.
  auto proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(proposals[0]->assignments.size() == 4);
  CHECK(proposals[0]->assignments.count("a:4") == 0);
  CHECK(Spares(a) == std::vector<std::string>{"a:4"});
  CHECK(Slots(a, Action::kLaunch).size() == 5);
  job.Form(0, {"a:0", "a:1", "a:2", "a:3"});
  job.Take();
  job.Ready("a:4");
  // A member dies: the spare takes its place (no process starts for the round), and a new
  // spare starts on the dead member's slot.
  job.policy->OnExit("a:1", 137, "killed by SIGKILL");
  a = job.Take();
  proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(proposals[0]->assignments.count("a:4") == 1);
  CHECK(proposals[0]->assignments.count("a:1") == 0);
  CHECK(proposals[0]->removed.empty());
  CHECK(Events(a, "spare_promoted").size() == 1);
  auto launches = Of(a, Action::kLaunch);
  REQUIRE(launches.size() == 1);  // only the new spare
  CHECK(launches[0]->slot == "a:1");
  CHECK(launches[0]->spare);
  job.Form(1, {"a:0", "a:2", "a:3", "a:4"});
  job.Take();
  // The new spare fails before it is used: another one starts, the round is untouched.
  job.policy->OnExit("a:1", 1, "exit status 1");
  a = job.Take();
  CHECK(Of(a, Action::kProposeRound).empty());
  CHECK(Spares(a) == std::vector<std::string>{"a:1"});
  job.Ready("a:1");
  // A new slot listed: the spare takes it as a member, a new spare starts on the new slot.
  d.discovery_script = "x";
  job.policy->OnDiscovery(std::vector<HostSlots>{{"a", 6}}, {});
  a = job.Take();
  proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(proposals[0]->assignments.size() == 5);
  CHECK(proposals[0]->assignments.count("a:1") == 1);
  CHECK(Spares(a) == std::vector<std::string>{"a:5"});
}

TEST_CASE("policy: a spare that never connected is not promoted while one that answers is",
          "[unit]") {
  // Namespace PyTorch soak (seed 489384709, job 1): a spare stopped before it connected was
  // promoted, and the round waited 30 s (the rendezvous timeout) for its join.
  DriverOptions d = WithSpares(Static({{"a", 6}}, 4, 2), 2);
  Job job(d);
  job.policy->Start(d.hosts);
  auto a = job.Take();
  REQUIRE(Spares(a) == std::vector<std::string>{"a:4", "a:5"});
  job.Form(0, {"a:0", "a:1", "a:2", "a:3"});
  job.Take();
  job.Advance(seconds(11));  // a:4 never opened its Watch (stopped while it started)
  job.Take();
  job.Ready("a:5");
  job.policy->OnExit("a:1", 137, "killed by SIGKILL");
  a = job.Take();
  auto proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(proposals[0]->assignments.count("a:5") == 1);
  CHECK(proposals[0]->assignments.count("a:4") == 0);
}

TEST_CASE("policy: a spare on a blacklisted host still takes a place, and none starts there",
          "[unit]") {
  DriverOptions d = Static({{"a", 3}}, 2, 1);
  d.spares = 1;  // host_failure_limit 1: the first failure blacklists host a
  Job job(d);
  job.policy->Start(d.hosts);
  auto a = job.Take();
  CHECK(Spares(a) == std::vector<std::string>{"a:2"});
  job.Form(0, {"a:0", "a:1"});
  job.Take();
  job.policy->OnExit("a:0", 137, "killed by SIGKILL");
  a = job.Take();
  auto proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(proposals[0]->assignments.count("a:2") == 1);
  CHECK(proposals[0]->assignments.size() == 2);
  CHECK(Of(a, Action::kLaunch).empty());
}

TEST_CASE("policy: spares give way to members when the hosts have too few slots", "[unit]") {
  DriverOptions d = WithSpares(Static({{"a", 3}}, 3, 2), 2);
  Job job(d);
  job.policy->Start(d.hosts);
  auto a = job.Take();
  auto proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(proposals[0]->assignments.size() == 3);  // -np 3 needs every slot
  CHECK(Spares(a).empty());
  job.Form(0, {"a:0", "a:1", "a:2"});
  job.Take();
  // Spares use only slots beyond -np: after a loss the slot is a member's again (a newcomer's,
  // then a member's once it is ready), and no spare starts.
  job.policy->OnExit("a:2", 137, "killed by SIGKILL");
  a = job.Take();
  proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(proposals[0]->assignments.size() == 2);
  CHECK(Slots(a, Action::kLaunch) == std::vector<std::string>{"a:2"});
  CHECK(Events(a, "newcomer_started").size() == 1);
  job.Form(1, {"a:0", "a:1"});
  job.Take();
  job.policy->OnWaitingForPlace("a:2");
  a = job.Take();
  proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(proposals[0]->assignments.size() == 3);
  CHECK(Of(a, Action::kLaunch).empty());
}

// Found by spares_bench: a member was killed, its slot relaunched with a worker that takes
// seconds to start, and the old process's Watch stream closed only after the relaunch. The
// close was taken for the new process's, which was declared lost (and killed) while it was
// still starting.
TEST_CASE("policy: the Watch close of a slot's previous process does not lose the new one",
          "[unit]") {
  DriverOptions d = Static({{"a", 2}}, 2, 1);
  d.host_failure_limit = 0;
  d.liveness_timeout = std::chrono::seconds(6);
  Job job(d);
  job.StartFormed(d.hosts, {"a:0", "a:1"});
  job.policy->OnWatch("a:0", true);
  job.policy->OnWatch("a:1", true);
  job.policy->OnExit("a:1", 137, "killed by SIGKILL");  // relaunched at once
  auto a = job.Take();
  REQUIRE(Slots(a, Action::kLaunch) == std::vector<std::string>{"a:1"});
  job.policy->OnWatch("a:1", false);  // the old process's stream, late
  job.Pass(5, 1, {{"a:0", {1, false}}});  // the new process is still starting: no stream
  a = job.Take();
  CHECK(Slots(a, Action::kSignal, SIGKILL).empty());
  CHECK(Events(a, "worker_hung").empty());
  // Its own stream, once open and then broken, is watched as before.
  job.policy->OnWatch("a:1", true);
  job.policy->OnWatch("a:1", false);
  job.Advance(std::chrono::seconds(3));
  a = job.Take();
  CHECK(Slots(a, Action::kSignal, SIGKILL) == std::vector<std::string>{"a:1"});
}


void Fail(Job& job, const std::string& slot, int64_t round, const std::string& message) {
  rendezvous::Report r;
  r.slot = slot;
  r.kind = rendezvous::ReportKind::kFailed;
  r.round = round;
  r.message = message;
  job.policy->OnReport(r);
}

TEST_CASE("policy: every member failing in its own code ends the job with the first error",
          "[unit]") {
  // Elastic, with a cooldown: before, the job waited --elastic-timeout for hosts.
  DriverOptions d = Discovered(3);
  d.cooldown_min = seconds(1);
  d.cooldown_max = seconds(2);
  Job job(d);
  job.StartFormed({{"h", 3}}, {"h:0", "h:1", "h:2"});
  job.Take();
  Fail(job, "h:1", 0, "ValueError: the same bug");
  Fail(job, "h:0", 0, "ValueError: the same bug (rank 0)");
  CHECK_FALSE(job.policy->shutting_down());
  // A failure reported in another round does not count for this one.
  Fail(job, "h:2", 5, "ValueError: elsewhere");
  CHECK_FALSE(job.policy->shutting_down());
  job.policy->OnExit("h:1", 1, "exit status 1");
  CHECK_FALSE(job.policy->shutting_down());
  Fail(job, "h:2", 0, "ValueError: the same bug");
  auto a = job.Take();
  REQUIRE(job.policy->shutting_down());
  CHECK(job.policy->exit_code() == 1);
  CHECK_THAT(job.policy->final_message(),
             Catch::Contains("every worker of round 0 (3 of them) failed") &&
                 Catch::Contains("slot h:1") && Catch::Contains("ValueError: the same bug"));
  auto ended = Events(a, "round_failed");
  REQUIRE(ended.size() == 1);
  CHECK(Events(a, "waiting_for_hosts").empty());
}

TEST_CASE("policy: some members failing in their own code is an ordinary failure", "[unit]") {
  Job job(Discovered(3));
  job.StartFormed({{"h", 3}}, {"h:0", "h:1", "h:2"});
  job.Take();
  Fail(job, "h:2", 0, "RuntimeError: one rank's bug");
  job.policy->OnExit("h:2", 1, "exit status 1");
  job.Take();
  CHECK_FALSE(job.policy->shutting_down());
  // The others were killed from outside (no report of their own): the job goes on.
  job.policy->OnExit("h:0", 137, "signal 9 (Killed)");
  job.Take();
  CHECK_FALSE(job.policy->shutting_down());
}

TEST_CASE("policy: with --max-failures or --reset-limit, every member failing is retried",
          "[unit]") {
  for (int which = 0; which < 2; ++which) {
    DriverOptions d = Discovered(2);
    (which == 0 ? d.max_failures : d.reset_limit) = 10;
    Job job(d);
    job.StartFormed({{"h", 2}}, {"h:0", "h:1"});
    job.Take();
    Fail(job, "h:0", 0, "ValueError: flaky");
    Fail(job, "h:1", 0, "ValueError: flaky");
    job.policy->OnExit("h:0", 1, "exit status 1");
    job.policy->OnExit("h:1", 1, "exit status 1");
    job.Take();
    CHECK_FALSE(job.policy->shutting_down());
  }
}

// Found trying Horovod's MNIST example (it imported a module this machine lacked): every
// worker exited 1 before connecting, the host was blacklisted, and the job waited
// --elastic-timeout (600 s) for hosts.
TEST_CASE("policy: every worker failing before it connects ends a job that never formed",
          "[unit]") {
  Job job(Discovered(2));
  job.policy->Start({{"h", 2}});
  job.Take();
  job.policy->OnExit("h:0", 1, "exit status 1");
  job.Take();
  CHECK_FALSE(job.policy->shutting_down());  // h:1 may still start
  job.policy->OnExit("h:1", 2, "exit status 2");
  auto a = job.Take();
  REQUIRE(job.policy->shutting_down());
  CHECK(job.policy->exit_code() == 1);
  CHECK_THAT(job.policy->final_message(),
             Catch::Contains("every worker started so far (2) exited before it connected") &&
                 Catch::Contains("slot h:1") && Catch::Contains("exit status 2"));
  CHECK(Events(a, "round_failed").size() == 1);
}

TEST_CASE(
    "policy: a start failure is not the end when a worker connected, was killed, or "
    "retries are allowed",
    "[unit]") {
  SECTION("one worker connected before it failed") {
    Job job(Discovered(2));
    job.policy->Start({{"h", 2}});
    job.Take();
    job.Heartbeat("h:1", -1, 0, false);
    job.policy->OnExit("h:0", 1, "exit status 1");
    job.policy->OnExit("h:1", 1, "exit status 1");
    job.Take();
    CHECK_FALSE(job.policy->shutting_down());
  }
  SECTION("killed by a signal, not failed on their own") {
    Job job(Discovered(2));
    job.policy->Start({{"h", 2}});
    job.Take();
    job.policy->OnExit("h:0", 137, "signal 9 (Killed)");
    job.policy->OnExit("h:1", 137, "signal 9 (Killed)");
    job.Take();
    CHECK_FALSE(job.policy->shutting_down());
  }
  SECTION("--max-failures allows retries") {
    DriverOptions d = Discovered(2);
    d.max_failures = 5;
    Job job(d);
    job.policy->Start({{"h", 2}});
    job.Take();
    job.policy->OnExit("h:0", 1, "exit status 1");
    job.policy->OnExit("h:1", 1, "exit status 1");
    job.Take();
    CHECK_FALSE(job.policy->shutting_down());
  }
  SECTION("a round formed once: later start failures are ordinary failures") {
    Job job(Discovered(2));
    job.StartFormed({{"h", 2}}, {"h:0", "h:1"});
    job.Take();
    job.policy->OnExit("h:0", 1, "exit status 1");
    job.policy->OnExit("h:1", 1, "exit status 1");
    job.Take();
    CHECK_THAT(job.policy->final_message(), !Catch::Contains("before it connected"));
  }
}

TEST_CASE(
    "policy: a finisher's stale commit report does not make its peers' last step a "
    "violation",
    "[unit]") {
  // Overlap soak (seed 757073668, job 2): after a driver outage the finisher's background
  // report of step 646 came after its FINISHED at 647; taken as its step, its peer's report
  // of 647 read as "went on after the finisher stopped" and the job failed.
  for (bool committed_before : {true, false}) {
    INFO(committed_before);
    Job job(Static({{"h", 2}}, 2, 2));
    job.StartFormed({{"h", 2}}, {"h:0", "h:1"});
    job.Take();
    if (committed_before) {
      job.Commit("h:0", 0, 645);
      job.Commit("h:1", 0, 645);
    }
    job.Finished("h:0", 0, 647);
    job.Commit("h:0", 0, 646);  // stale: sent before the FINISHED, came after it
    job.policy->OnExit("h:0", 0, "exit status 0");
    job.Take();
    CHECK(job.policy->state().workers.at("h:0").step == 647);
    job.Commit("h:1", 0, 647);
    job.Finished("h:1", 0, 647);
    job.Take();
    CHECK_FALSE(job.policy->shutting_down());
    job.policy->OnExit("h:1", 0, "exit status 0");
    job.Take();
    REQUIRE(job.policy->shutting_down());
    CHECK(job.policy->exit_code() == 0);
    INFO(job.policy->final_message());
  }
  SECTION("a peer that went on past the finisher is still one") {
    Job job(Static({{"h", 2}}, 2, 2));
    job.StartFormed({{"h", 2}}, {"h:0", "h:1"});
    job.Take();
    job.Commit("h:0", 0, 646);
    job.Finished("h:0", 0, 647);
    job.policy->OnExit("h:0", 0, "exit status 0");
    job.Commit("h:1", 0, 648);
    job.Take();
    REQUIRE(job.policy->shutting_down());
    CHECK(job.policy->exit_code() == 1);
    CHECK_THAT(job.policy->final_message(), Catch::Contains("went on to step 648"));
  }
}

TEST_CASE("policy: a member that does not exit after its peers finished is named and killed",
          "[unit]") {
  for (bool reported_finished : {true, false}) {
    INFO(reported_finished);
    DriverOptions d = Static({{"h", 2}}, 2, 2);
    d.hang_timeout = seconds(10);
    Job job(d);
    job.StartFormed({{"h", 2}}, {"h:0", "h:1"});
    job.Take();
    if (reported_finished) {
      rendezvous::Report r;
      r.slot = "h:1";
      r.kind = rendezvous::ReportKind::kFinished;
      r.round = 0;
      r.step = 40;
      job.policy->OnReport(r);
    }
    job.policy->OnExit("h:0", 0, "exit status 0");
    job.Take();
    CHECK(job.policy->NextDeadline() <= job.clock.Now() + seconds(10));
    job.Advance(seconds(9));
    CHECK(Slots(job.Take(), Action::kSignal, SIGKILL).empty());
    job.Advance(seconds(2));
    auto a = job.Take();
    CHECK(Slots(a, Action::kDumpStacks) == std::vector<std::string>{"h:1"});
    CHECK(Slots(a, Action::kSignal, SIGKILL) == std::vector<std::string>{"h:1"});
    auto hung = Events(a, "worker_hung");
    REQUIRE(hung.size() == 1);
    job.policy->OnExit("h:1", 137, "signal 9 (Killed)");
    job.Take();
    REQUIRE(job.policy->shutting_down());
    CHECK(job.policy->exit_code() == (reported_finished ? 0 : 1));
  }
}

TEST_CASE("policy: the holder kept for the state is one not yet told to go, by what it said",
          "[unit]") {
  // PyTorch namespace soak (seed 752467358, job 5): a worker told to go (its host was no
  // longer listed) was chosen to keep the state, by its newer commit report, over a member
  // whose join had said as new a version (its reports lagged); the chosen one had already
  // been told to go and exited, the other was scaled away: state lost.
  DriverOptions d = Discovered(4);
  d.min_np = 2;
  d.host_failure_limit = 0;
  Job job(d);
  job.StartFormed({{"h0", 2}, {"h1", 1}}, {"h0:0", "h0:1", "h1:0"});
  for (const char* s : {"h0:0", "h0:1", "h1:0"}) job.Commit(s, 0, 1);
  job.policy->OnDiscovery(std::vector<HostSlots>{{"h0", 2}}, {});
  auto a = job.Take();
  REQUIRE(Of(a, Action::kProposeRound).size() == 1);
  CHECK(Of(a, Action::kProposeRound)[0]->removed == std::vector<std::string>{"h1:0"});
  job.policy->OnDiscovery(std::vector<HostSlots>{{"h0", 1}}, {});  // below --min-np: waits
  job.Take();
  job.Commit("h1:0", 0, 3);  // went on in the old round, reported
  job.Commit("h0:0", 0, 2);  // reports lag behind
  job.Commit("h0:1", 0, 2);
  job.Form(1, {"h0:0", "h0:1"}, {3, 3});  // what they said in their joins
  job.Take();
  job.policy->OnExit("h0:0", 137, "signal 9 (Killed)");
  a = job.Take();
  auto proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  auto members = Members(*proposals[0]);
  CHECK(std::find(members.begin(), members.end(), "h0:1") != members.end());
  auto kept = Events(a, "holder_kept");
  REQUIRE(kept.size() == 1);
  CHECK(std::get<std::string>(*Field(*kept[0], "slot")) == "h0:1");
}

TEST_CASE("policy: a scaled-away worker lost while its old round still runs aborts that round",
          "[unit]") {
  // Namespace soak (seed 113189435, job 1): a worker of the formed round, stopped and then cut
  // off by a partition, was scaled away; found lost, it was only killed, and its peer, still
  // in a collective with it (the partition swallowed the connection's end), waited 30 s for
  // the fence timeout.
  DriverOptions d = Discovered(4);
  d.liveness_timeout = seconds(3);
  Job job(d);
  job.StartFormed({{"a", 2}, {"b", 1}}, {"a:0", "a:1", "b:0"});
  job.policy->OnWatch("b:0", true);
  job.policy->OnDiscovery(std::vector<HostSlots>{{"a", 2}}, {});
  auto a = job.Take();
  REQUIRE(Of(a, Action::kProposeRound).size() == 1);
  job.policy->OnWatch("b:0", false);
  job.Advance(seconds(2));
  a = job.Take();
  CHECK(Slots(a, Action::kSignal, SIGKILL) == std::vector<std::string>{"b:0"});
  std::vector<std::string> aborted;
  for (const Action* p : Of(a, Action::kPublish)) {
    if (p->event.kind == EventKind::kAbort && p->event.round == 0) aborted.push_back(p->slot);
  }
  std::sort(aborted.begin(), aborted.end());
  CHECK(aborted == std::vector<std::string>{"a:0", "a:1"});
}

TEST_CASE("policy: a member lost at the end of training, its peers then finishing, ends the job "
          "at once", "[unit]") {
  // PyTorch namespace soak (seed 933977357, job 14): two ranks were killed just after the last
  // step, their slots relaunched for the next round, and the two others then finished; the
  // relaunched processes waited in their joins, and the job ended with exit 1 only after the
  // hang timeout (67 s), calling them members that never finished.
  DriverOptions d = Discovered(4);
  d.hang_timeout = seconds(60);
  d.host_failure_limit = 0;
  Job job(d);
  job.StartFormed({{"a", 3}}, {"a:0", "a:1", "a:2"});
  job.policy->OnExit("a:2", 137, "signal 9 (Killed)");
  auto a = job.Take();
  REQUIRE(Slots(a, Action::kLaunch) == std::vector<std::string>{"a:2"});  // relaunched
  job.policy->OnExit("a:0", 0, "exit status 0");
  job.policy->OnExit("a:1", 0, "exit status 0");
  a = job.Take();
  REQUIRE(job.policy->shutting_down());
  CHECK(job.policy->exit_code() == 1);
  CHECK_THAT(job.policy->final_message(), Catch::Contains("slot(s) [a:2]"));
  CHECK_THAT(job.policy->final_message(), Catch::Contains("lost before it finished"));
  CHECK(Slots(a, Action::kSignal, SIGTERM) == std::vector<std::string>{"a:2"});
  CHECK(Events(a, "worker_hung").empty());
}

TEST_CASE("policy: a job whose members finish while a round with a newcomer is pending succeeds",
          "[unit]") {
  // Soak seed 833434529 (PyTorch, overlapping faults): the round's members finished training
  // while the next round, with a newcomer, was proposed; the newcomer waited in its join, so
  // the job counted it as a member that neither finished nor exited and ended with exit 1.
  DriverOptions d = Discovered(3);
  d.hang_timeout = seconds(10);
  Job job(d);
  job.StartFormed({{"a", 2}}, {"a:0", "a:1"});
  job.policy->OnDiscovery(std::vector<HostSlots>{{"a", 2}, {"b", 1}}, {});
  job.Take();
  job.policy->OnWaitingForPlace("b:0");
  auto a = job.Take();
  REQUIRE(Of(a, Action::kProposeRound).size() == 1);
  job.policy->OnExit("a:0", 0, "exit status 0");
  job.policy->OnExit("a:1", 0, "exit status 0");
  a = job.Take();
  REQUIRE(job.policy->shutting_down());
  CHECK(job.policy->exit_code() == 0);
  CHECK(job.policy->final_message() == "success: all 2 workers of round 0 finished");
  // The newcomer is stopped, not killed as hung.
  CHECK(Slots(a, Action::kSignal, SIGTERM) == std::vector<std::string>{"b:0"});
  CHECK(Events(a, "worker_hung").empty());
}

// The slots of `proposal` (an assignment map), sorted.
std::vector<std::string> MembersOf(const Action& proposal) {
  std::vector<std::string> out;
  for (const auto& [slot, a] : proposal.assignments) out.push_back(slot);
  return out;
}

TEST_CASE(
    "policy: survivors re-form at once without a lost member's new process, which joins "
    "when it is ready",
    "[unit]") {
  DriverOptions d = WithSpares(Static({{"a", 4}}, 4, 2), 0);
  d.reset_limit = 1;  // the kill is one reset; the newcomer's arrival is not another
  Job job(d);
  job.StartFormed(d.hosts, {"a:0", "a:1", "a:2", "a:3"});
  job.Take();
  job.Commit("a:0", 0, 5);
  job.policy->OnExit("a:1", 137, "killed by SIGKILL");
  auto a = job.Take();
  auto proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(MembersOf(*proposals[0]) == std::vector<std::string>{"a:0", "a:2", "a:3"});
  auto launches = Of(a, Action::kLaunch);
  REQUIRE(launches.size() == 1);
  CHECK(launches[0]->slot == "a:1");
  CHECK(launches[0]->spare);  // it waits in Join for its place, without a deadline
  CHECK(Events(a, "newcomer_started").size() == 1);
  CHECK(job.policy->View().newcomers.size() == 1);
  CHECK(job.policy->View().spares.empty());
  job.Form(1, {"a:0", "a:2", "a:3"}, {5, 5, 5});
  job.Take();
  // A spare's Join or a member's is not the newcomer's: nothing changes.
  job.policy->OnWaitingForPlace("a:0");
  CHECK(Of(job.Take(), Action::kProposeRound).empty());
  // The newcomer is ready: the job re-forms with it at the members' next commit (a fence),
  // and no process starts.
  job.policy->OnWaitingForPlace("a:1");
  a = job.Take();
  proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(MembersOf(*proposals[0]) == std::vector<std::string>{"a:0", "a:1", "a:2", "a:3"});
  CHECK(Of(a, Action::kLaunch).empty());
  CHECK(Events(a, "newcomer_ready").size() == 1);
  CHECK(Events(a, "newcomer_placed").size() == 1);
  auto publishes = Of(a, Action::kPublish);
  REQUIRE(publishes.size() == 3);
  for (const Action* p : publishes) CHECK(p->event.kind == EventKind::kMembershipChanging);
  CHECK(!job.policy->shutting_down());  // within --reset-limit 1
  CHECK(job.policy->View().resets == 1);
  CHECK(job.policy->View().newcomers.empty());
  job.Form(2, {"a:0", "a:1", "a:2", "a:3"}, {5, 0, 5, 5});
  job.Take();
  CHECK(job.policy->View().members.size() == 4);
  // Ready again (a retried Join): nothing more.
  job.policy->OnWaitingForPlace("a:1");
  CHECK(Of(job.Take(), Action::kProposeRound).empty());
}

TEST_CASE("policy: a newcomer that exits before its place is a failure, and another starts",
          "[unit]") {
  DriverOptions d = WithSpares(Static({{"a", 3}}, 3, 1), 0);
  Job job(d);
  job.StartFormed(d.hosts, {"a:0", "a:1", "a:2"});
  job.Take();
  job.policy->OnExit("a:2", 137, "killed by SIGKILL");
  auto a = job.Take();
  REQUIRE(Of(a, Action::kProposeRound).size() == 1);
  job.Form(1, {"a:0", "a:1"});
  job.Take();
  job.policy->OnExit("a:2", 1, "exit status 1");
  a = job.Take();
  CHECK(Of(a, Action::kProposeRound).empty());  // its peers train on
  REQUIRE(Of(a, Action::kLaunch).size() == 1);
  CHECK(Of(a, Action::kLaunch)[0]->slot == "a:2");
  CHECK(job.policy->View().failures == 2);
  CHECK(job.policy->View().newcomers.size() == 1);
}

TEST_CASE("policy: a slot that discovery adds gets a newcomer, and the job grows once it is ready",
          "[unit]") {
  DriverOptions d = Discovered(8);
  Job job(d);
  job.StartFormed({{"a", 2}}, {"a:0", "a:1"});
  job.Take();
  job.policy->OnDiscovery(std::vector<HostSlots>{{"a", 2}, {"b", 1}}, {});
  auto a = job.Take();
  CHECK(Of(a, Action::kProposeRound).empty());  // nobody waits for b:0 to start
  CHECK(Of(a, Action::kPublish).empty());
  REQUIRE(Of(a, Action::kLaunch).size() == 1);
  CHECK(Of(a, Action::kLaunch)[0]->slot == "b:0");
  CHECK(job.policy->View().resets == 0);
  job.policy->OnWaitingForPlace("b:0");
  a = job.Take();
  auto proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(MembersOf(*proposals[0]) == std::vector<std::string>{"a:0", "a:1", "b:0"});
  CHECK(job.policy->View().resets == 1);  // growing is a reset
}

TEST_CASE(
    "policy: survivors too few for --min-np wait for a new process as before, and a ready "
    "newcomer joins them",
    "[unit]") {
  DriverOptions d = WithSpares(Static({{"a", 4}}, 4, 3), 0);
  Job job(d);
  job.StartFormed(d.hosts, {"a:0", "a:1", "a:2", "a:3"});
  job.Take();
  job.policy->OnExit("a:1", 137, "killed by SIGKILL");  // 3 left: enough
  auto a = job.Take();
  REQUIRE(Of(a, Action::kProposeRound).size() == 1);
  CHECK(MembersOf(*Of(a, Action::kProposeRound)[0]).size() == 3);
  job.policy->OnExit("a:2", 137, "killed by SIGKILL");  // 2 left: a:2 starts as a member
  a = job.Take();
  auto proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(MembersOf(*proposals[0]) == std::vector<std::string>{"a:0", "a:2", "a:3"});
  REQUIRE(Of(a, Action::kLaunch).size() == 1);
  CHECK(!Of(a, Action::kLaunch)[0]->spare);
  job.policy->OnWaitingForPlace("a:1");  // the first newcomer: in the next proposal too
  a = job.Take();
  proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(MembersOf(*proposals[0]) == std::vector<std::string>{"a:0", "a:1", "a:2", "a:3"});
}

}  // namespace
}  // namespace elastic::driver

namespace elastic::driver {
namespace {

// The policy of a driver that adopts `dead`'s job: `dead`'s state, on the new job's own
// clock, set to the dead one's time.
void Adopt(const Job& dead, const DriverOptions& d, Job* into) {
  into->clock.Advance(dead.clock.Now() - into->clock.Now());
  PolicyOptions o;
  o.driver = d;
  o.clock = &into->clock;
  o.seed = 8;
  auto resumed = Policy::Restore(o, dead.policy->state());
  REQUIRE(resumed.ok());
  into->policy = std::move(resumed).value();
}

// A driver that adopts the job (driver/journal.h) goes on from the dead one's policy state:
// the adopted members keep their round, one gone while no driver ran is a failure at once,
// and one that never re-opens its stream is lost after the rendezvous timeout.
TEST_CASE("policy: a resumed policy keeps the adopted round, loses the gone and the silent",
          "[policy]") {
  DriverOptions d = Static({{"localhost", 3}}, 3, 1);
  d.rendezvous_timeout = seconds(5);
  Job dead(d);
  dead.StartFormed({{"localhost", 3}}, {"localhost:0", "localhost:1", "localhost:2"});
  dead.Take();
  dead.Commit("localhost:0", 0, 4);
  dead.Take();
  Job j(d);
  Adopt(dead, d, &j);
  j.policy->OnResumed({"localhost:0", "localhost:1"});  // localhost:2 ended meanwhile
  auto acts = j.Take();
  auto proposed = Of(acts, Action::kProposeRound);
  REQUIRE(proposed.size() == 1);  // the peers of the gone one re-form
  CHECK(proposed[0]->round == 1);
  // localhost:0 re-attaches, localhost:1 never does.
  j.policy->OnWatch("localhost:0", true);
  j.Advance(seconds(4));
  CHECK(Of(j.Take(), Action::kSignal).empty());
  j.Advance(seconds(2));
  auto later = j.Take();
  auto killed = Of(later, Action::kSignal);
  REQUIRE(killed.size() == 1);
  CHECK(killed[0]->slot == "localhost:1");
  CHECK(killed[0]->signal == SIGKILL);
}

TEST_CASE("policy: the process started after the adoption for a slot that ended meanwhile is "
          "lost when its stream breaks",
          "[policy]") {
  // Soak seed 84301731, job 4: the old driver had counted the slot's stream; the adopting
  // driver passed that count to the slot's next process as a close to ignore, and when that
  // process was stopped its stream's close was ignored: the round waited 90 s.
  DriverOptions d = Static({{"localhost", 3}}, 3, 1);
  d.host_failure_limit = 0;
  Job dead(d);
  dead.StartFormed({{"localhost", 3}}, {"localhost:0", "localhost:1", "localhost:2"});
  dead.Take();
  for (const char* slot : {"localhost:0", "localhost:1", "localhost:2"}) {
    dead.policy->OnWatch(slot, true);
  }
  dead.Take();
  Job j(d);
  Adopt(dead, d, &j);
  j.policy->OnResumed({"localhost:0", "localhost:1"});  // localhost:2 ended meanwhile
  auto acts = j.Take();
  auto launched = Of(acts, Action::kLaunch);
  REQUIRE(launched.size() == 1);
  CHECK(launched[0]->slot == "localhost:2");
  j.policy->OnWatch("localhost:0", true);
  j.policy->OnWatch("localhost:1", true);
  j.policy->OnWatch("localhost:2", true);  // the new process's stream
  j.Take();
  j.policy->OnWatch("localhost:2", false);  // it is stopped: its stream breaks
  j.Advance(d.liveness_timeout);
  // Lost (a newcomer not yet in the round: killed; a member would be named hung).
  CHECK(Slots(j.Take(), Action::kSignal, SIGKILL) == std::vector<std::string>{"localhost:2"});
}

TEST_CASE("policy: a round proposed but not formed when the driver died is proposed again",
          "[policy]") {
  DriverOptions d = Static({{"localhost", 3}}, 3, 1);
  Job dead(d);
  dead.StartFormed({{"localhost", 3}}, {"localhost:0", "localhost:1", "localhost:2"});
  dead.Take();
  dead.policy->OnExit("localhost:2", 1, "exit status 1");
  auto first = Of(dead.Take(), Action::kProposeRound);
  REQUIRE(first.size() == 1);
  int64_t round = first[0]->round;
  Job j(d);
  Adopt(dead, d, &j);
  j.policy->OnResumed({"localhost:0", "localhost:1", "localhost:2"});
  auto again = Of(j.policy->TakeActions(), Action::kProposeRound);
  REQUIRE(again.size() == 1);
  CHECK(again[0]->round == round);
}

}  // namespace
}  // namespace elastic::driver

namespace elastic::driver {
namespace {

// Commits steps [from, to) of round 0 on every member, with the compute and wait sums each
// worker's agent would send: member i computes compute(i, step) seconds a step, and every
// step takes as long as the slowest member's (the others wait in the collective).
struct Sums {
  std::map<std::string, std::pair<double, double>> by_slot;
};
std::vector<Action> Steps(Job& job, Sums& sums, const std::vector<std::string>& members,
                          int64_t from, int64_t to,
                          const std::function<double(size_t, int64_t)>& compute) {
  std::vector<Action> out;
  for (int64_t step = from; step < to; ++step) {
    double longest = 0;
    for (size_t i = 0; i < members.size(); ++i) longest = std::max(longest, compute(i, step));
    for (size_t i = 0; i < members.size(); ++i) {
      auto& [c, w] = sums.by_slot[members[i]];
      c += compute(i, step);
      w += longest - compute(i, step) + 0.001;
      rendezvous::Report r;
      r.slot = members[i];
      r.kind = rendezvous::ReportKind::kCommitted;
      r.round = 0;
      r.step = r.version = step + 1;
      r.compute_seconds = c;
      r.wait_seconds = w;
      job.policy->OnReport(r);
    }
    job.clock.Advance(std::chrono::milliseconds(static_cast<int64_t>(longest * 1000) + 1));
    std::vector<Action> a = job.Take();
    out.insert(out.end(), a.begin(), a.end());
  }
  return out;
}

const std::vector<std::string> kFour = {"h:0", "h:1", "h:2", "h:3"};

TEST_CASE("policy: a member slower than its peers throughout the window is named a straggler, "
          "once, and cleared when it is back",
          "[unit]") {
  Job job(Static({{"h", 4}}, 4, 4));
  job.StartFormed({{"h", 4}}, kFour);
  job.Take();
  Sums sums;
  auto slow2 = [](size_t i, int64_t) { return i == 2 ? 0.02 : 0.01; };
  // The first report anchors each window: 5 sub-windows of 5 steps, then 4 slow in a row.
  auto a = Steps(job, sums, kFour, 0, 20, slow2);
  CHECK(Events(a, "straggler").empty());
  a = Steps(job, sums, kFour, 20, 21, slow2);
  auto named = Events(a, "straggler");
  REQUIRE(named.size() == 1);
  const JsonFields& f = named[0]->fields;
  auto field = [&](const std::string& k) {
    for (const auto& [name, v] : f) {
      if (name == k) return v;
    }
    FAIL("no field " << k);
    return JsonValue();
  };
  CHECK(std::get<std::string>(field("slot")) == "h:2");
  CHECK(std::get<int64_t>(field("rank")) == 2);
  CHECK(std::get<double>(field("compute_seconds")) == Approx(0.02));
  CHECK(std::get<double>(field("median_seconds")) == Approx(0.01));
  CHECK(std::get<double>(field("ratio")) == Approx(2.0));
  CHECK(std::get<std::string>(field("action")) == "warn");
  CHECK(job.policy->state().stragglers == 1);
  JobView view = job.policy->View();
  CHECK(view.stragglers == 1);
  CHECK(view.members[2].straggler);
  CHECK(view.members[2].step_compute == Approx(0.02));
  CHECK_FALSE(view.members[1].straggler);
  // Named once while it stays slow; cleared after four sub-windows back at speed.
  a = Steps(job, sums, kFour, 21, 60, slow2);
  CHECK(Events(a, "straggler").empty());
  a = Steps(job, sums, kFour, 60, 85, [](size_t, int64_t) { return 0.01; });
  CHECK(Events(a, "straggler_cleared").size() == 1);
  CHECK_FALSE(job.policy->View().members[2].straggler);
  CHECK(job.policy->state().stragglers == 1);
}

TEST_CASE("policy: a slow step, a pause or rank 0's occasional extra work names no straggler",
          "[unit]") {
  Job job(Static({{"h", 4}}, 4, 4));
  job.StartFormed({{"h", 4}}, kFour);
  job.Take();
  Sums sums;
  auto a = Steps(job, sums, kFour, 0, 400, [](size_t i, int64_t step) {
    if (i == 1 && step == 37) return 0.5;          // one step 50x as long (a hiccup)
    if (i == 3 && step == 120) return 4.0;         // a pause of 4 s (stopped, then continued)
    if (i == 0 && step % 10 == 0) return 0.05;     // rank 0's extra work every 10 steps
    if (i == 2 && step >= 200 && step < 212) return 0.03;  // slow for less than the window
    return 0.01;
  });
  CHECK(Events(a, "straggler").empty());
  CHECK(job.policy->state().stragglers == 0);
}

TEST_CASE("policy: a policy restored mid-window names the straggler at the same step",
          "[unit]") {
  // Three of the four slow sub-windows seen, then the state saved and loaded (the journal of
  // a driver that dies): the restored policy names it at the same commit as the original.
  Job a(Static({{"h", 4}}, 4, 4));
  a.StartFormed({{"h", 4}}, kFour);
  a.Take();
  Sums sums;
  auto slow2 = [](size_t i, int64_t) { return i == 2 ? 0.02 : 0.01; };
  CHECK(Events(Steps(a, sums, kFour, 0, 16, slow2), "straggler").empty());
  Job b(Static({{"h", 4}}, 4, 4));
  auto loaded = LoadPolicyState(SavePolicyState(a.policy->state(), a.clock.Now()), b.clock.Now());
  REQUIRE(loaded.ok());
  PolicyOptions o;
  o.driver = Static({{"h", 4}}, 4, 4);
  o.clock = &b.clock;
  o.seed = 7;
  auto restored = Policy::Restore(o, *loaded);
  REQUIRE(restored.ok());
  b.policy = std::move(restored).value();
  Sums copy = sums;
  for (int64_t step = 16; step < 22; ++step) {
    INFO(step);
    auto in_a = Events(Steps(a, sums, kFour, step, step + 1, slow2), "straggler").size();
    auto in_b = Events(Steps(b, copy, kFour, step, step + 1, slow2), "straggler").size();
    CHECK(in_a == in_b);
    CHECK(in_a == (step == 20 ? 1u : 0u));
  }
}

// Steps 0-20 of round 0 on the four members, h:2 computing 3x as long as the others: the
// actions up to the commit that names it a straggler (exactly one event).
std::vector<Action> SlowH2(Job& job, Sums& sums) {
  auto a = Steps(job, sums, kFour, 0, 21, [](size_t i, int64_t) { return i == 2 ? 0.03 : 0.01; });
  REQUIRE(Events(a, "straggler").size() == 1);
  return a;
}

// The field `name` of a straggler event, as a string (decision, reason, action).
std::string Said(const Action& e, const std::string& name) {
  for (const auto& [k, v] : e.fields) {
    if (k == name && std::holds_alternative<std::string>(v)) return std::get<std::string>(v);
  }
  return "";
}

TEST_CASE("policy: --straggler-action replace: the next round goes without it, a warm spare in "
          "its place, and its host counts a failure",
          "[unit]") {
  DriverOptions d = Static({{"h", 5}}, 4, 2);
  d.spares = 1;
  d.host_failure_limit = 2;  // counted, not yet blacklisted
  d.straggler_action = StragglerAction::kReplace;
  Job job(d);
  job.policy->Start(d.hosts);
  job.Take();
  job.Form(0, kFour);
  job.Take();
  job.Ready("h:4");  // the spare waits for a place
  Sums sums;
  auto a = SlowH2(job, sums);
  auto named = Events(a, "straggler");
  CHECK(Said(*named[0], "decision") == "replace");
  CHECK_THAT(Said(*named[0], "reason"), Catch::Contains("replaced"));
  auto proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(proposals[0]->assignments.count("h:2") == 0);
  CHECK(proposals[0]->assignments.count("h:4") == 1);
  CHECK(proposals[0]->removed == std::vector<std::string>{"h:2"});
  CHECK(Events(a, "spare_promoted").size() == 1);
  CHECK(job.policy->state().hosts.hosts.at("h").failures == 1);
  // It leaves at its next commit; its slot gets no new process (no spare) for the cooldown.
  job.Form(1, {"h:0", "h:1", "h:3", "h:4"});
  job.Take();
  job.policy->OnExit("h:2", 0, "exit status 0");
  a = job.Take();
  CHECK(Of(a, Action::kLaunch).empty());
  CHECK(Of(a, Action::kProposeRound).empty());
}

TEST_CASE("policy: --straggler-action replace with no spare and no free slot only names it",
          "[unit]") {
  DriverOptions d = Static({{"h", 4}}, 4, 2);
  d.straggler_action = StragglerAction::kReplace;
  Job job(d);
  job.StartFormed({{"h", 4}}, kFour);
  job.Take();
  Sums sums;
  auto a = SlowH2(job, sums);
  auto named = Events(a, "straggler");
  CHECK(Said(*named[0], "decision") == "none");
  CHECK_THAT(Said(*named[0], "reason"), Catch::Contains("no warm spare"));
  CHECK(Of(a, Action::kProposeRound).empty());
}

TEST_CASE("policy: --straggler-action drop shrinks the job when that is faster, down to "
          "--min-np, once within the cooldown",
          "[unit]") {
  DriverOptions d = Static({{"h", 4}}, 4, 2);
  d.straggler_action = StragglerAction::kDrop;
  Job job(d);
  job.StartFormed({{"h", 4}}, kFour);
  job.Take();
  Sums sums;
  // 3x slower: without it, three ranks at 4/3 of the median beat four waiting for it.
  auto a = SlowH2(job, sums);
  auto named = Events(a, "straggler");
  CHECK(Said(*named[0], "decision") == "drop");
  auto proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(proposals[0]->assignments.size() == 3);
  CHECK(proposals[0]->removed == std::vector<std::string>{"h:2"});
  const std::vector<std::string> three = {"h:0", "h:1", "h:3"};
  job.Form(1, three);
  job.Take();
  job.policy->OnExit("h:2", 0, "exit status 0");
  job.Take();
  // Another straggler within the cooldown is named only.
  auto slow1 = [](size_t i, int64_t) { return i == 1 ? 0.03 : 0.01; };
  auto rounds = [&](int64_t from, int64_t to) {
    std::vector<Action> out;
    for (int64_t step = from; step < to; ++step) {
      for (size_t i = 0; i < three.size(); ++i) {
        auto& [c, w] = sums.by_slot[three[i]];
        c += slow1(i, step);
        w += 0.03 - slow1(i, step) + 0.001;
        rendezvous::Report r;
        r.slot = three[i];
        r.kind = rendezvous::ReportKind::kCommitted;
        r.round = 1;
        r.step = r.version = step + 1;
        r.compute_seconds = c;
        r.wait_seconds = w;
        job.policy->OnReport(r);
      }
      job.clock.Advance(std::chrono::milliseconds(31));
      auto t = job.Take();
      out.insert(out.end(), t.begin(), t.end());
    }
    return out;
  };
  a = rounds(21, 42);
  named = Events(a, "straggler");
  REQUIRE(named.size() == 1);
  CHECK(Said(*named[0], "decision") == "none");
  CHECK_THAT(Said(*named[0], "reason"), Catch::Contains("within 60 s"));
  CHECK(Of(a, Action::kProposeRound).empty());
}

TEST_CASE("policy: --straggler-action drop keeps a job at --min-np, and one that would not be "
          "faster",
          "[unit]") {
  for (int size : {4, 2}) {
    INFO(size);
    // Four at --min-np 4; or two, one 1.6x as slow: alone, the other would take 2x.
    const int min_np = size == 4 ? 4 : 1;
    std::vector<std::string> members(kFour.begin(), kFour.begin() + size);
    DriverOptions d = Static({{"h", size}}, size, min_np);
    d.straggler_action = StragglerAction::kDrop;
    Job job(d);
    job.StartFormed({{"h", size}}, members);
    job.Take();
    Sums sums;
    auto a = Steps(job, sums, members, 0, 21,
                   [&](size_t i, int64_t) { return i == 1 ? (size == 4 ? 0.03 : 0.016) : 0.01; });
    auto named = Events(a, "straggler");
    REQUIRE(named.size() == 1);
    CHECK(Said(*named[0], "decision") == "none");
    CHECK_THAT(Said(*named[0], "reason"),
               Catch::Contains(size == 4 ? "--min-np 4" : "would not be faster"));
    CHECK(Of(a, Action::kProposeRound).empty());
  }
}

TEST_CASE("policy: --straggler-factor 0 names no straggler", "[unit]") {
  DriverOptions d = Static({{"h", 4}}, 4, 4);
  d.straggler_factor = 0;
  Job job(d);
  job.StartFormed({{"h", 4}}, kFour);
  job.Take();
  Sums sums;
  auto a = Steps(job, sums, kFour, 0, 100, [](size_t i, int64_t) { return i == 2 ? 0.05 : 0.01; });
  CHECK(Events(a, "straggler").empty());
}

// Horovod's reset-limit scenario (issue 46): discovery grows a 2-worker job to 4, then shrinks
// it to 3, under --reset-limit 2. The growth is one change from outside, so one reset, however
// its two new processes arrive.
TEST_CASE("policy: the slots one discovery result adds join in one round, one reset",
          "[unit]") {
  DriverOptions d = Discovered(4);
  d.reset_limit = 2;
  Job job(d);
  job.StartFormed({{"a", 2}}, {"a:0", "a:1"});
  job.policy->OnDiscovery(std::vector<HostSlots>{{"a", 4}}, {});
  auto a = job.Take();
  CHECK(Slots(a, Action::kLaunch) == std::vector<std::string>{"a:2", "a:3"});
  // The first ready one waits (--newcomer-window, 3 s) for the other started with it.
  job.policy->OnWaitingForPlace("a:2");
  a = job.Take();
  CHECK(Of(a, Action::kProposeRound).empty());
  CHECK(job.policy->NextDeadline() <= job.clock.Now() + seconds(3));
  job.Advance(seconds(1));
  job.policy->OnWaitingForPlace("a:3");
  a = job.Take();
  auto proposals = Of(a, Action::kProposeRound);
  REQUIRE(proposals.size() == 1);
  CHECK(Members(*proposals[0]) == std::vector<std::string>{"a:0", "a:1", "a:2", "a:3"});
  job.Form(1, {"a:0", "a:1", "a:2", "a:3"});
  CHECK(job.policy->View().resets == 1);
  // The shrink is the second reset: within the limit.
  job.policy->OnDiscovery(std::vector<HostSlots>{{"a", 3}}, {});
  a = job.Take();
  REQUIRE(Of(a, Action::kProposeRound).size() == 1);
  CHECK(job.policy->View().resets == 2);
  CHECK_FALSE(job.policy->shutting_down());
}

TEST_CASE("policy: newcomers of one change that arrive apart still count one reset", "[unit]") {
  DriverOptions d = Discovered(4);
  d.reset_limit = 2;
  SECTION("each joins when ready (--newcomer-window 0)") {
    d.newcomer_window = Duration::zero();
    Job job(d);
    job.StartFormed({{"a", 2}}, {"a:0", "a:1"});
    job.policy->OnDiscovery(std::vector<HostSlots>{{"a", 4}}, {});
    job.Take();
    job.policy->OnWaitingForPlace("a:2");
    auto a = job.Take();
    REQUIRE(Of(a, Action::kProposeRound).size() == 1);
    CHECK(Members(*Of(a, Action::kProposeRound)[0]).size() == 3);
    job.Form(1, {"a:0", "a:1", "a:2"});
    job.Advance(seconds(5));
    job.policy->OnWaitingForPlace("a:3");
    a = job.Take();
    REQUIRE(Of(a, Action::kProposeRound).size() == 1);
    job.Form(2, {"a:0", "a:1", "a:2", "a:3"});
    CHECK(job.policy->View().resets == 1);
    job.policy->OnDiscovery(std::vector<HostSlots>{{"a", 3}}, {});
    job.Take();
    CHECK(job.policy->View().resets == 2);
    CHECK_FALSE(job.policy->shutting_down());
  }
  SECTION("the window ends before the second is ready") {
    Job job(d);
    job.StartFormed({{"a", 2}}, {"a:0", "a:1"});
    job.policy->OnDiscovery(std::vector<HostSlots>{{"a", 4}}, {});
    job.Take();
    job.policy->OnWaitingForPlace("a:2");
    CHECK(Of(job.Take(), Action::kProposeRound).empty());
    job.Advance(seconds(3));  // the window ends: the job re-forms with the one that is ready
    auto a = job.Take();
    REQUIRE(Of(a, Action::kProposeRound).size() == 1);
    CHECK(Members(*Of(a, Action::kProposeRound)[0]) ==
          std::vector<std::string>{"a:0", "a:1", "a:2"});
    job.Form(1, {"a:0", "a:1", "a:2"});
    job.policy->OnWaitingForPlace("a:3");  // its cohort's reset is paid: no second one
    a = job.Take();
    REQUIRE(Of(a, Action::kProposeRound).size() == 1);
    CHECK(job.policy->View().resets == 1);
  }
  SECTION("a second change is a reset of its own") {
    Job job(d);
    job.StartFormed({{"a", 2}}, {"a:0", "a:1"});
    job.policy->OnDiscovery(std::vector<HostSlots>{{"a", 3}}, {});
    job.Take();
    job.policy->OnWaitingForPlace("a:2");
    REQUIRE(Of(job.Take(), Action::kProposeRound).size() == 1);
    job.Form(1, {"a:0", "a:1", "a:2"});
    job.policy->OnDiscovery(std::vector<HostSlots>{{"a", 4}}, {});
    job.Take();
    job.policy->OnWaitingForPlace("a:3");
    REQUIRE(Of(job.Take(), Action::kProposeRound).size() == 1);
    CHECK(job.policy->View().resets == 2);
  }
}

}  // namespace
}  // namespace elastic::driver
