// Host discovery: parsing host lists, running the discovery script, and the host table with
// blacklist and cooldown (docs/recovery.md).
#pragma once

#include <map>
#include <random>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/process.h"
#include "common/status.h"

namespace elastic::discovery {

struct HostSlots {
  std::string host;
  int slots = 1;
  bool operator==(const HostSlots& o) const { return host == o.host && slots == o.slots; }
};

constexpr int kMaxSlotsPerHost = 4096;
constexpr size_t kMaxHosts = 65536;

// A host name or address: 1..253 bytes of letters, digits, '-', '.', '_' (or an IPv4 address).
bool ValidHostName(const std::string& host);

// Parses discovery output: one `host` or `host:slots` per line; blank lines and `#` comments
// are skipped; `default_slots` applies to a bare host. Duplicates are merged (the last count
// wins) and reported in `warnings`. A bad line is INVALID_ARGUMENT naming its number and text.
StatusOr<std::vector<HostSlots>> ParseHostLines(const std::string& text, int default_slots,
                                                std::vector<std::string>* warnings);
// Parses `-H h1:4,h2:2` (same rules as a line each).
StatusOr<std::vector<HostSlots>> ParseHostList(const std::string& list, int default_slots);

using ScriptResult = Captured;  // common/process.h

// Runs `script` (through /bin/sh -c when it has spaces, else directly) in its own process
// group; kills the whole group at `timeout`; keeps at most `max_output` bytes of stdout.
// Errors are only for failing to start it at all.
StatusOr<ScriptResult> RunScript(const std::string& script, Duration timeout, size_t max_output);

// Runs the script and parses it: a non-zero exit, a timeout, an over-long output or a bad line
// is an error whose message says which, with the script's stderr.
StatusOr<std::vector<HostSlots>> Discover(const std::string& script, Duration timeout,
                                          size_t max_output, int default_slots,
                                          std::vector<std::string>* warnings);

struct HostTableOptions {
  Clock* clock = RealClock();
  int failure_limit = 1;     // failures before a host is blacklisted; 0 disables
  Duration cooldown_min{0};  // both zero: a blacklisted host never comes back
  Duration cooldown_max{0};
  uint64_t seed = 0;  // jitter
};

struct HostChange {
  std::vector<std::string> added, removed, changed;
  bool empty() const { return added.empty() && removed.empty() && changed.empty(); }
};

// The hosts the driver knows, in the order first seen. Not thread-safe.
class HostTable {
 public:
  explicit HostTable(HostTableOptions options);
  // Replaces the listed set; returns what changed.
  HostChange Update(const std::vector<HostSlots>& listed);
  // Counts a failure; returns true when this failure blacklists the host.
  bool RecordFailure(const std::string& host);
  bool Blacklisted(const std::string& host) const;
  // Listed hosts that are not blacklisted (a host whose cooldown ended comes back), in
  // first-seen order.
  std::vector<HostSlots> Available() const;
  // Listed hosts that are not blacklisted for good: those whose cooldown has yet to end too.
  std::vector<HostSlots> AvailableEventually() const;
  // When the next cooldown ends (TimePoint::max() when none).
  TimePoint NextCooldownEnd() const;
  // Whether a cooldown ended since the last call (each end is told once).
  bool TakeEndedCooldowns();
  // Blacklisted hosts now, with when each comes back (TimePoint::max(): never).
  std::vector<std::pair<std::string, TimePoint>> Blacklist() const;
  Duration LastCooldown() const { return last_cooldown_; }

  struct Entry {
    int slots = 0;
    bool listed = false;
    int failures = 0;
    int times_blacklisted = 0;
    bool blacklisted = false;
    TimePoint until;  // blacklisted until; max() = forever
    bool end_told = true;  // TakeEndedCooldowns told of `until`
  };
  // Everything the table knows but its options, as a value (the driver's journal of its
  // decisions saves and loads it whole; driver/policy_state.h).
  struct State {
    std::vector<std::string> order;
    std::map<std::string, Entry> hosts;
    std::string rng;  // the jitter generator's state, as std::mt19937_64 writes it
    Duration last_cooldown{0};
  };
  State state() const;
  // Replaces what the table knows with `state`; INVALID_ARGUMENT when it does not hold
  // together (a host in `order` without an entry or the other way round, a bad generator
  // state), the table then unchanged.
  Status Restore(const State& state);

 private:
  HostTableOptions options_;
  std::vector<std::string> order_;
  std::map<std::string, Entry> hosts_;
  std::mt19937_64 rng_;
  Duration last_cooldown_{0};
};

}  // namespace elastic::discovery
