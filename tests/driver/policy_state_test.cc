// The policy's state as a value (driver/policy_state.h): saved and loaded whole, a restored
// policy makes the same decisions as the original. The property runs random event sequences
// on a fake clock; each case prints its seed (ELASTIC_POLICY_SEED=N replays one).
#include "driver/policy_state.h"

#include <signal.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <cstdlib>
#include <random>
#include <sstream>

#include "driver/policy.h"

namespace elastic::driver {
namespace {

using discovery::HostSlots;
using rendezvous::ReportKind;

std::string Text(const JsonValue& v) {
  struct V {
    std::string operator()(std::monostate) const { return "null"; }
    std::string operator()(int64_t x) const { return std::to_string(x); }
    std::string operator()(double x) const {
      std::ostringstream o;
      o.precision(17);
      o << x;
      return o.str();
    }
    std::string operator()(bool x) const { return x ? "true" : "false"; }
    std::string operator()(const std::string& x) const { return "'" + x + "'"; }
    std::string operator()(const std::vector<std::string>& x) const {
      std::string out = "[";
      for (const auto& s : x) out += s + ",";
      return out + "]";
    }
    std::string operator()(const std::vector<int64_t>& x) const {
      std::string out = "[";
      for (auto s : x) out += std::to_string(s) + ",";
      return out + "]";
    }
  };
  return std::visit(V{}, v);
}

// Everything an action says, as one line.
std::string Text(const Action& a) {
  std::ostringstream o;
  o << "kind=" << a.kind << " round=" << a.round << " slot=" << a.slot << " signal=" << a.signal
    << " spare=" << a.spare << " name=" << a.name << " level=" << a.level
    << " message=" << a.message << " event=" << static_cast<int>(a.event.kind) << "/"
    << a.event.round << "/" << a.event.message << " assignments=";
  for (const auto& [slot, x] : a.assignments) {
    o << slot << ":" << x.round << "," << x.rank << "," << x.size << "," << x.local_rank << ","
      << x.local_size << "," << x.cross_rank << "," << x.cross_size << "," << x.sync_required
      << ";";
  }
  o << " removed=";
  for (const auto& s : a.removed) o << s << ",";
  o << " slots=";
  for (const auto& s : a.slots) o << s << ",";
  o << " fields=";
  for (const auto& [k, v] : a.fields) o << k << "=" << Text(v) << ";";
  return o.str();
}

std::string Text(const std::vector<Action>& actions) {
  std::string out;
  for (const auto& a : actions) out += Text(a) + "\n";
  return out;
}

std::string Text(const JobView& v) {
  std::ostringstream o;
  o << v.phase << " " << v.round << " " << v.formed_round << " " << v.resets << " " << v.failures
    << " " << v.since_recovery << " " << v.checkpoint_version << " members:";
  for (const auto& m : v.members) {
    o << m.rank << "," << m.slot << "," << m.pid << "," << m.step << "," << m.since_commit << ","
      << m.steps_per_second << ";";
  }
  o << " blacklisted:";
  for (const auto& [h, s] : v.blacklisted) o << h << "," << s << ";";
  o << " spares:";
  for (const auto& [s, p] : v.spares) o << s << "," << p << ";";
  return o.str();
}

// Drives a policy (and, once restored, its copy) with random, mostly plausible events: the
// launches it asks for start (or fail), the rounds it proposes form, members commit, beat,
// finish, fail, leave, exit or are killed, their streams break, discovery changes the hosts,
// the clock moves.
class Sim {
 public:
  Sim(uint64_t seed, DriverOptions d) : rng_(seed) {
    opts_.driver = std::move(d);
    opts_.clock = &clock_;
    opts_.seed = seed;
    opts_.is_local = [](const std::string& h) { return h != "h3"; };
    a_ = std::make_unique<Policy>(opts_);
  }

  // One random event into the policies; returns the actions of each (equal when restored).
  void Step() {
    int pick = Uniform(0, 99);
    const std::vector<std::string> slots = KnownSlots();
    auto any_slot = [&]() -> std::string {
      if (slots.empty()) return "h1:0";
      return slots[Uniform(0, static_cast<int>(slots.size()) - 1)];
    };
    if (!launches_.empty() && pick < 25) {
      size_t i = Uniform(0, static_cast<int>(launches_.size()) - 1);
      std::string slot = launches_[i];
      launches_.erase(launches_.begin() + static_cast<std::ptrdiff_t>(i));
      if (Uniform(0, 9) == 0) {
        Both([&](Policy& p) { p.OnLaunchFailed(slot, Unavailable("ssh: connection refused")); });
      } else {
        int64_t pid = ++pid_;
        Both([&](Policy& p) { p.OnLaunched(slot, pid); });
      }
    } else if (pick < 37) {
      // The newest proposed round forms with its members, holding what they said they hold.
      int64_t round = a_->proposed_round();
      std::vector<std::string> members = a_->members();
      if (round < 0 || members.empty() || round == a_->formed_round()) return Advance();
      rendezvous::FormedRound f;
      f.round = round;
      f.members = members;
      for (const auto& m : members) f.versions.push_back(versions_[m]);
      f.version = *std::max_element(f.versions.begin(), f.versions.end());
      f.newest_committed = std::max(f.version, newest_);
      f.sync_required = std::any_of(f.versions.begin(), f.versions.end(),
                                    [&](int64_t v) { return v != f.version; });
      f.state_lost = f.version == 0 && newest_ > 0;
      if (f.state_lost && Uniform(0, 1) == 0) {
        Both([&](Policy& p) { p.OnStateLost(f); });
      } else {
        Both([&](Policy& p) { p.OnRoundFormed(f); });
      }
    } else if (pick < 62) {
      // A report from a member of the formed round (or any slot).
      std::vector<std::string> members = a_->members();
      std::string slot = members.empty() || Uniform(0, 9) == 0
                             ? any_slot()
                             : members[Uniform(0, static_cast<int>(members.size()) - 1)];
      rendezvous::Report r;
      r.slot = slot;
      r.round = a_->formed_round();
      int kind = Uniform(0, 99);
      if (kind < 40) {
        r.kind = ReportKind::kCommitted;
        r.step = r.version = ++newest_;
        versions_[slot] = r.version;
        r.epoch = r.step / 10;
        r.cursor = r.step % 10;
        r.samples = r.step * 8;
        r.epoch_size = 80;
        // The compute and wait sums its agent sends: the slots of index 1 compute three
        // times as long as the others (stragglers to name, and to clear when a round
        // without them forms), with some noise.
        auto& [compute, wait] = sums_[slot];
        bool slow = slot.size() > 2 && slot.compare(slot.size() - 2, 2, ":1") == 0;
        compute += (slow ? 0.03 : 0.01) * Uniform(90, 110) / 100.0;
        wait += 0.001 * Uniform(1, 20);
        r.compute_seconds = compute;
        r.wait_seconds = wait;
      } else if (kind < 85) {
        r.kind = ReportKind::kHeartbeat;
        r.collectives = Uniform(0, 50);
        r.in_collective = Uniform(0, 1) == 1;
        r.stack_signal = Uniform(0, 1) ? SIGUSR1 : 0;
      } else if (kind < 89) {
        r.kind = ReportKind::kFinished;
        r.version = versions_[slot];
      } else if (kind < 93) {
        r.kind = ReportKind::kFailed;
        r.message = "Traceback: ValueError in step " + std::to_string(newest_);
      } else if (kind < 96) {
        r.kind = ReportKind::kLeaving;
        r.message = "preempted";
      } else {
        const ReportKind kinds[] = {ReportKind::kCheckpointFailed, ReportKind::kCheckpointed,
                                    ReportKind::kRestored};
        r.kind = kinds[Uniform(0, 2)];
        r.step = r.version = versions_[slot];
        r.message = r.kind == ReportKind::kCheckpointed ? "/ckpt/v1" : "No space left on device";
        r.seconds = 0.25;
      }
      Both([&](Policy& p) { p.OnReport(r); });
    } else if (pick < 70) {
      std::string slot = any_slot();
      int codes[] = {0, 1, 137, 143};
      int code = codes[Uniform(0, 3)];
      Both([&](Policy& p) { p.OnExit(slot, code, "exit " + std::to_string(code)); });
    } else if (pick < 76) {
      std::string slot = any_slot();
      bool open = Uniform(0, 1) == 1;
      Both([&](Policy& p) { p.OnWatch(slot, open); });
    } else if (pick < 79) {
      std::vector<std::string> members = a_->members();
      if (members.empty()) return Advance();
      std::vector<std::string> missing = {
          members[Uniform(0, static_cast<int>(members.size()) - 1)]};
      int64_t round = a_->proposed_round();
      Both([&](Policy& p) { p.OnJoinTimeout(round, missing); });
    } else if (pick < 81) {
      std::string slot = any_slot();
      int64_t round = a_->formed_round();
      Both([&](Policy& p) { p.OnMemberLeft(round, slot); });
    } else if (pick < 88) {
      if (Uniform(0, 9) == 0) {
        Both([&](Policy& p) { p.OnDiscovery(Unavailable("discover.sh exited 1"), {}); });
      } else {
        std::vector<HostSlots> hosts;
        for (const char* h : {"h1", "h2", "h3", "h4"}) {
          if (Uniform(0, 3) != 0) hosts.push_back({h, Uniform(1, 2)});
        }
        Both([&](Policy& p) { p.OnDiscovery(hosts, {}); });
      }
    } else if (pick < 92 && pick >= 89) {
      // A process waits in Join for a place (a spare, a newcomer that is ready, or any slot).
      std::string slot = any_slot();
      for (const auto& [sl, w] : a_->state().workers) {
        if (w.joiner && !w.ready && Uniform(0, 1) == 0) slot = sl;
      }
      Both([&](Policy& p) { p.OnWaitingForPlace(slot); });
    } else if (pick < 89 && Uniform(0, 4) == 0) {
      Both([&](Policy& p) { p.OnSignal(SIGTERM, "SIGTERM"); });
    } else {
      Advance();
    }
  }

  // Replaces nothing: makes the copy, from the original's state saved as text.
  void Restore() {
    PolicyState st = a_->state();
    std::string text = SavePolicyState(st, clock_.Now());
    auto loaded = LoadPolicyState(text, clock_.Now());
    REQUIRE(loaded.ok());
    // Saved again, the loaded state is the same text.
    REQUIRE(SavePolicyState(*loaded, clock_.Now()) == text);
    auto restored = Policy::Restore(opts_, *loaded);
    REQUIRE(restored.ok());
    b_ = std::move(*restored);
    saved_bytes_ = text.size();
  }

  void Start(std::vector<HostSlots> hosts) {
    Both([&](Policy& p) { p.Start(hosts); });
  }

  Policy& a() { return *a_; }
  Policy* b() { return b_.get(); }
  size_t saved_bytes() const { return saved_bytes_; }
  TimePoint now() const { return clock_.Now(); }

 private:
  int Uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }

  void Advance() {
    int ms = Uniform(0, 9) == 0 ? Uniform(5000, 90000) : Uniform(0, 1500);
    clock_.Advance(std::chrono::milliseconds(ms));
    Both([](Policy& p) { p.OnTimer(); });
  }

  std::vector<std::string> KnownSlots() const {
    std::vector<std::string> out;
    for (const char* h : {"h1", "h2", "h3", "h4"}) {
      for (int i = 0; i < 2; ++i) out.push_back(std::string(h) + ":" + std::to_string(i));
    }
    return out;
  }

  // The event into the original and (once made) the copy; their actions must be the same.
  template <typename F>
  void Both(F&& f) {
    f(*a_);
    std::vector<Action> actions = a_->TakeActions();
    if (b_) {
      f(*b_);
      std::vector<Action> other = b_->TakeActions();
      REQUIRE(Text(other) == Text(actions));
      REQUIRE(Text(b_->View()) == Text(a_->View()));
      REQUIRE(b_->NextDeadline() == a_->NextDeadline());
      REQUIRE(b_->shutting_down() == a_->shutting_down());
      REQUIRE(b_->exit_code() == a_->exit_code());
    }
    for (const auto& x : actions) {
      if (x.kind == Action::kLaunch) launches_.push_back(x.slot);
      if (b_) ++compared_[x.kind == Action::kWriteEvent ? x.name : std::to_string(x.kind)];
    }
  }

  FakeClock clock_;
  std::mt19937_64 rng_;
  PolicyOptions opts_;
  std::unique_ptr<Policy> a_, b_;
  std::vector<std::string> launches_;
  std::map<std::string, int64_t> versions_;
  std::map<std::string, std::pair<double, double>> sums_;
  int64_t newest_ = 0;
  int64_t pid_ = 1000;
  size_t saved_bytes_ = 0;

 public:
  // Actions compared after the copy was made, by kind (events by name).
  std::map<std::string, int> compared_;
};

DriverOptions Elastic() {
  DriverOptions d;
  d.discovery_script = "discover.sh";
  d.np = d.min_np = 2;
  d.max_np = 6;
  d.elastic = true;
  d.host_failure_limit = 2;
  d.cooldown_min = std::chrono::seconds(5);
  d.cooldown_max = std::chrono::seconds(40);
  d.spares = 1;
  d.checkpoint_dir = "/ckpt";
  d.hang_timeout = std::chrono::seconds(20);
  return d;
}

std::vector<uint64_t> Seeds(uint64_t first, int n) {
  if (const char* s = std::getenv("ELASTIC_POLICY_SEED")) return {std::strtoull(s, nullptr, 10)};
  std::vector<uint64_t> out;
  for (int i = 0; i < n; ++i) out.push_back(first + static_cast<uint64_t>(i));
  return out;
}

TEST_CASE("a policy restored from its saved state decides as the original", "[policy_state]") {
  std::map<std::string, int> compared;
  for (uint64_t seed : Seeds(1, 150)) {
    INFO("seed " << seed << " (replay: ELASTIC_POLICY_SEED=" << seed << ")");
    std::mt19937_64 pick(seed * 7919);
    DriverOptions d = Elastic();
    if (seed % 3 == 0) {  // a static job without discovery
      d = DriverOptions();
      d.hosts = {{"h1", 2}, {"h2", 2}};
      d.np = 4;
      d.min_np = 2;
      d.elastic = true;
    }
    d.straggler_window = 4;  // a sub-window a commit: rounds here are short
    Sim sim(seed, d);
    sim.Start({{"h1", 2}, {"h2", 1}});
    const int events = 400;
    const int restore_at = std::uniform_int_distribution<int>(0, events - 50)(pick);
    for (int i = 0; i < events; ++i) {
      if (i == restore_at) sim.Restore();
      sim.Step();
    }
    REQUIRE(sim.b() != nullptr);
    REQUIRE(SavePolicyState(sim.b()->state(), sim.now()) ==
            SavePolicyState(sim.a().state(), sim.now()));
    for (const auto& [k, n] : sim.compared_) compared[k] += n;
  }
  // The sequences reach what matters after the copy is made: rounds proposed and formed,
  // aborts and fences, launches and kills, failures, hangs, the blacklist, the job's end.
  std::string seen;
  for (const auto& [k, n] : compared) seen += k + "=" + std::to_string(n) + " ";
  INFO("compared after the restore: " << seen);
  if (std::getenv("ELASTIC_POLICY_SEED") == nullptr) {
    for (const char* kind :
         {"0", "3", "4", "5", "round_proposed", "round_formed", "worker_exited", "worker_lost",
          "worker_hung", "host_blacklisted", "job_ending", "spare_promoted", "state_restored",
          "newcomer_started", "newcomer_ready", "newcomer_placed"}) {
      INFO(kind);
      CHECK(compared[kind] > 0);
    }
  }
}

TEST_CASE("a saved state keeps time points at their distance from now", "[policy_state]") {
  PolicyState s;
  s.hosts = discovery::HostTable(discovery::HostTableOptions{}).state();
  WorkerState w;
  w.slot = "h1:0";
  TimePoint then = TimePoint() + std::chrono::hours(5);
  w.heard_at = then - std::chrono::milliseconds(1500);
  w.lost_at = TimePoint::max();
  w.commit_at = TimePoint{};
  s.workers["h1:0"] = w;
  s.kill_at = then + std::chrono::seconds(3);
  s.longest_interval = std::chrono::milliseconds(250);
  std::string text = SavePolicyState(s, then);
  // Loaded in another process whose steady clock reads something else entirely.
  TimePoint later = TimePoint() + std::chrono::hours(77);
  auto loaded = LoadPolicyState(text, later);
  INFO(loaded.status().ToString());
  REQUIRE(loaded.ok());
  const WorkerState& l = loaded->workers.at("h1:0");
  CHECK(later - l.heard_at == std::chrono::milliseconds(1500));
  CHECK(l.lost_at == TimePoint::max());
  CHECK(l.commit_at == TimePoint{});
  CHECK(loaded->kill_at - later == std::chrono::seconds(3));
  CHECK(loaded->longest_interval == std::chrono::milliseconds(250));
}

TEST_CASE("every field of the state survives a save and a load", "[policy_state]") {
  // Each field set to something other than its default, then compared one by one: a field
  // the saved text leaves out comes back as its default and fails here.
  TimePoint now = TimePoint() + std::chrono::hours(3);
  auto at = [&](int ms) { return now - std::chrono::milliseconds(ms); };
  WorkerState w;
  w.slot = "h2:1";
  w.host = "h2";
  w.local = false;
  w.running = w.dropped = w.removed = w.finished = w.leaving = w.spare = w.rescued = true;
  w.joiner = w.ready = w.paid = true;
  w.lost_at = at(-700);
  w.watches = 2;
  w.stale_closes = 3;
  w.round = 11;
  w.rank = 4;
  w.pid = 4242;
  w.step = 77;
  w.version = 76;
  w.commit_at = at(10);
  w.logged_round = 9;
  w.heard_at = at(20);
  w.launched_at = at(30);
  w.moved_at = at(40);
  w.heard_round = 10;
  w.collectives = 555;
  w.in_collective = true;
  w.stack_signal = SIGUSR1;
  w.epoch = 3;
  w.cursor = 17;
  w.samples = 1234;
  w.epoch_size = 640;
  w.rate = 12.5;
  w.failed_round = 8;
  w.failure = "ValueError";
  w.exit_hung = true;
  w.start_failed = true;
  w.window_round = 11;
  w.window_step = 70;
  w.window_compute = 2.5;
  w.window_wait = 1.25;
  w.step_compute = 0.03;
  w.step_wait = 0.01;
  w.slow_windows = 3;
  w.fast_windows = 1;
  w.straggler = true;
  w.evicted_until = at(-800);

  discovery::HostTable table(discovery::HostTableOptions{nullptr, 1, std::chrono::seconds(1),
                                                         std::chrono::seconds(2), 99});
  PolicyState s;
  s.hosts = table.state();
  s.hosts.order = {"h2"};
  discovery::HostTable::Entry e;
  e.slots = 3;
  e.listed = e.blacklisted = true;
  e.failures = 2;
  e.times_blacklisted = 1;
  e.until = at(-5000);
  e.end_told = false;
  s.hosts.hosts["h2"] = e;
  s.hosts.last_cooldown = std::chrono::seconds(4);
  s.workers["h2:1"] = w;
  s.members = {"h2:1", "h1:0"};
  s.round = 12;
  s.formed = 11;
  s.formed_members = {"h2:1"};
  s.failure_order = {"h1:0"};
  s.kept = {"h2:1"};
  s.aborted = 10;
  s.withdrawn = 9;
  s.incident_round = {{"h2", 8}};
  s.resets = 5;
  s.failures = 6;
  s.spare_failures = 7;
  s.formed_at = at(100);
  s.next_progress = at(-200);
  s.progress_samples = 99;
  s.progress_step = 98;
  s.progress_at = at(300);
  s.longest_interval = std::chrono::milliseconds(321);
  s.finishing = true;
  s.finisher = "h2:1";
  s.finishing_at = at(400);
  s.shutting_down = true;
  s.exit_code = 3;
  s.final_message = "bye";
  s.kill_at = at(-500);
  s.wait_until = at(-600);
  s.recovery_start = at(700);
  s.recovering = s.round_broken = true;
  s.first_commit_logged = false;
  s.started = true;
  s.restore_round = 4;
  s.lost_committed = 3;
  s.lost_round = 2;
  s.checkpoint_version = 70;
  s.checkpoint_step = 71;
  s.checkpoint_failures = 2;
  s.checkpoint_seconds = 1.5;
  s.checkpoint_path = "/ckpt/v70";
  s.checkpoint_error = "disk full";
  s.last_listed = {{"h2", 3}};
  s.last_listed_order = {"h2"};
  s.stragglers = 4;
  s.evicted_at = at(900);

  // Loaded an hour later on another clock: times keep their distance from now.
  TimePoint later = now + std::chrono::hours(1);
  auto shift = [&](TimePoint t) { return t + std::chrono::hours(1); };
  auto loaded = LoadPolicyState(SavePolicyState(s, now), later);
  INFO(loaded.status().ToString());
  REQUIRE(loaded.ok());
  const PolicyState& l = *loaded;
  const WorkerState& x = l.workers.at("h2:1");
  CHECK(x.slot == w.slot);
  CHECK(x.host == w.host);
  CHECK(x.local == w.local);
  CHECK((x.running && x.dropped && x.removed && x.finished && x.leaving && x.spare && x.rescued));
  CHECK((x.joiner && x.ready && x.paid));
  CHECK(x.lost_at == shift(w.lost_at));
  CHECK(x.watches == w.watches);
  CHECK(x.stale_closes == w.stale_closes);
  CHECK(x.round == w.round);
  CHECK(x.rank == w.rank);
  CHECK(x.pid == w.pid);
  CHECK(x.step == w.step);
  CHECK(x.version == w.version);
  CHECK(x.commit_at == shift(w.commit_at));
  CHECK(x.logged_round == w.logged_round);
  CHECK(x.heard_at == shift(w.heard_at));
  CHECK(x.launched_at == shift(w.launched_at));
  CHECK(x.moved_at == shift(w.moved_at));
  CHECK(x.heard_round == w.heard_round);
  CHECK(x.collectives == w.collectives);
  CHECK(x.in_collective == w.in_collective);
  CHECK(x.stack_signal == w.stack_signal);
  CHECK(x.epoch == w.epoch);
  CHECK(x.cursor == w.cursor);
  CHECK(x.samples == w.samples);
  CHECK(x.epoch_size == w.epoch_size);
  CHECK(x.rate == w.rate);
  CHECK(x.window_round == w.window_round);
  CHECK(x.window_step == w.window_step);
  CHECK(x.window_compute == w.window_compute);
  CHECK(x.window_wait == w.window_wait);
  CHECK(x.step_compute == w.step_compute);
  CHECK(x.step_wait == w.step_wait);
  CHECK(x.slow_windows == w.slow_windows);
  CHECK(x.fast_windows == w.fast_windows);
  CHECK(x.straggler == w.straggler);
  CHECK(x.evicted_until == shift(w.evicted_until));
  CHECK(x.failed_round == w.failed_round);
  CHECK(x.failure == w.failure);
  CHECK(x.exit_hung == w.exit_hung);
  CHECK(x.start_failed == w.start_failed);

  CHECK(l.hosts.order == s.hosts.order);
  CHECK(l.hosts.rng == s.hosts.rng);
  CHECK(l.hosts.last_cooldown == s.hosts.last_cooldown);
  const auto& le = l.hosts.hosts.at("h2");
  CHECK(le.slots == e.slots);
  CHECK(le.listed == e.listed);
  CHECK(le.failures == e.failures);
  CHECK(le.times_blacklisted == e.times_blacklisted);
  CHECK(le.blacklisted == e.blacklisted);
  CHECK(le.until == shift(e.until));
  CHECK(le.end_told == e.end_told);
  CHECK(l.members == s.members);
  CHECK(l.round == s.round);
  CHECK(l.formed == s.formed);
  CHECK(l.formed_members == s.formed_members);
  CHECK(l.failure_order == s.failure_order);
  CHECK(l.kept == s.kept);
  CHECK(l.aborted == s.aborted);
  CHECK(l.withdrawn == s.withdrawn);
  CHECK(l.incident_round == s.incident_round);
  CHECK(l.resets == s.resets);
  CHECK(l.failures == s.failures);
  CHECK(l.spare_failures == s.spare_failures);
  CHECK(l.formed_at == shift(s.formed_at));
  CHECK(l.next_progress == shift(s.next_progress));
  CHECK(l.progress_samples == s.progress_samples);
  CHECK(l.progress_step == s.progress_step);
  CHECK(l.progress_at == shift(s.progress_at));
  CHECK(l.longest_interval == s.longest_interval);
  CHECK(l.finishing == s.finishing);
  CHECK(l.finisher == s.finisher);
  CHECK(l.finishing_at == shift(s.finishing_at));
  CHECK(l.shutting_down == s.shutting_down);
  CHECK(l.exit_code == s.exit_code);
  CHECK(l.final_message == s.final_message);
  CHECK(l.kill_at == shift(s.kill_at));
  CHECK(l.wait_until == shift(s.wait_until));
  CHECK(l.recovery_start == shift(s.recovery_start));
  CHECK(l.recovering == s.recovering);
  CHECK(l.round_broken == s.round_broken);
  CHECK(l.first_commit_logged == s.first_commit_logged);
  CHECK(l.started == s.started);
  CHECK(l.restore_round == s.restore_round);
  CHECK(l.lost_committed == s.lost_committed);
  CHECK(l.lost_round == s.lost_round);
  CHECK(l.checkpoint_version == s.checkpoint_version);
  CHECK(l.checkpoint_step == s.checkpoint_step);
  CHECK(l.checkpoint_failures == s.checkpoint_failures);
  CHECK(l.checkpoint_seconds == s.checkpoint_seconds);
  CHECK(l.checkpoint_path == s.checkpoint_path);
  CHECK(l.checkpoint_error == s.checkpoint_error);
  CHECK(l.last_listed == s.last_listed);
  CHECK(l.last_listed_order == s.last_listed_order);
  CHECK(l.stragglers == s.stragglers);
  CHECK(l.evicted_at == shift(s.evicted_at));
}

TEST_CASE("a damaged saved state is refused with the field it is about", "[policy_state]") {
  FakeClock clock;
  PolicyOptions o;
  o.driver = Elastic();
  o.clock = &clock;
  Policy p(o);
  p.Start({{"h1", 2}});
  p.TakeActions();
  std::string text = SavePolicyState(p.state(), clock.Now());
  REQUIRE(LoadPolicyState(text, clock.Now()).ok());

  auto refused = [&](const std::string& bad, const std::string& says) {
    auto s = LoadPolicyState(bad, clock.Now());
    INFO(bad.substr(0, 200));
    REQUIRE_FALSE(s.ok());
    CHECK(s.status().code() == Code::kInvalidArgument);
    CHECK_THAT(s.status().message(), Catch::Contains(says));
  };
  refused("", "not valid JSON");
  refused(text.substr(0, text.size() / 2), "not valid JSON");
  refused("[1,2]", "state is not an object");
  refused("{\"format\": 9}", "format 9");
  auto edit = [&](const std::string& from, const std::string& to) {
    std::string t = text;
    size_t at = t.find(from);
    REQUIRE(at != std::string::npos);
    t.replace(at, from.size(), to);
    return t;
  };
  refused(edit("\"round\":", "\"rund\":"), "state.round is missing");
  refused(edit("\"resets\":0", "\"resets\":\"zero\""), "state.resets is not an integer");
  refused(edit("\"resets\":0", "\"resets\":99999999999"), "state.resets is out of range");
  refused(edit("\"kill_at\":\"max\"", "\"kill_at\":\"soon\""), "state.kill_at is not a time");
  refused(edit("\"rng\":\"", "\"rng\":\"x"), "random generator state");
  refused(edit("\"order\":[\"h1\"]", "\"order\":[\"h9\"]"), "host 'h9' has no entry");
  // A worker filed under another slot than it names.
  std::string t = text;
  size_t at = t.find("\"slot\":\"h1:");
  REQUIRE(at != std::string::npos);
  t.replace(at, 11, "\"slot\":\"h7:");
  refused(t, "names slot 'h7:");
  // Format 2's fields are required in a state of format 2.
  refused(edit("\"stragglers\":0", "\"stragglrs\":0"), "state.stragglers is missing");
}

TEST_CASE("a saved state of format 1 (an older elastic-run's journal) loads without the "
          "fields added since",
          "[policy_state]") {
  FakeClock clock;
  PolicyOptions o;
  o.driver = Elastic();
  o.clock = &clock;
  Policy p(o);
  p.Start({{"h1", 2}});
  p.TakeActions();
  nlohmann::json j = nlohmann::json::parse(SavePolicyState(p.state(), clock.Now()));
  REQUIRE(j["format"] == 2);
  j["format"] = 1;
  for (const char* f : {"stragglers", "evicted_at"}) j.erase(f);
  for (auto& [slot, w] : j["workers"].items()) {
    for (const char* f : {"window_round", "window_step", "window_compute", "window_wait",
                          "step_compute", "step_wait", "slow_windows", "fast_windows",
                          "straggler", "evicted_until"}) {
      w.erase(f);
    }
  }
  auto loaded = LoadPolicyState(j.dump(), clock.Now());
  INFO(loaded.status().ToString());
  REQUIRE(loaded.ok());
  CHECK(loaded->stragglers == 0);
  CHECK(loaded->workers.at("h1:0").step_compute == -1);
  CHECK(loaded->workers.at("h1:0").evicted_until == TimePoint{});
  j["format"] = 2;  // the same text claiming format 2: a field is missing
  auto refused = LoadPolicyState(j.dump(), clock.Now());
  REQUIRE_FALSE(refused.ok());
  CHECK_THAT(refused.status().message(), Catch::Contains("is missing"));
}

}  // namespace
}  // namespace elastic::driver
