// Plain structs shared by the rendezvous core, its gRPC adapter and the driver.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace elastic::rendezvous {

// Bounds on everything that comes from the wire (docs/architecture.md).
struct Limits {
  size_t max_slot_bytes = 256;
  size_t max_key_bytes = 512;
  size_t max_value_bytes = 16u << 20;
  size_t max_keys_per_call = 64u << 10;
  size_t max_get_response_bytes = 256u << 20;
  size_t max_round_bytes = 1u << 30;  // all values of one round together
  size_t max_round_keys = 1u << 20;
  size_t max_message_bytes = 4096;  // Report messages
  size_t max_watchers_per_slot = 8;
  size_t max_pending_waiters = 1u << 16;
};

struct Assignment {
  int64_t round = -1;
  int rank = -1;
  int size = 0;
  int local_rank = -1;
  int local_size = 0;
  int cross_rank = -1;
  int cross_size = 0;
  bool sync_required = false;
};

// What the core decided when a round formed, from what its members said they hold.
struct FormedRound {
  int64_t round = -1;
  std::vector<std::string> members;  // in rank order
  std::vector<int64_t> versions;     // the version each member said it holds, in rank order
  int64_t version = 0;               // the newest among them; rank 0 holds it
  int64_t newest_committed = 0;      // the newest version any worker ever said or reported
  bool sync_required = false;        // some member holds another version, or none committed
  bool state_lost = false;           // commits were made, but no member holds any
};

struct JoinResult {
  bool removed = false;  // the slot was scaled away; `assignment` is unset
  Assignment assignment;
};

enum class EventKind { kMembershipChanging = 1, kAbort = 2, kShutdown = 3 };

struct Event {
  EventKind kind = EventKind::kMembershipChanging;
  int64_t round = -1;  // the round being fenced
  std::string message;
};

enum class ReportKind {
  kCommitted = 1,
  kLeaving = 2,
  kFailed = 3,
  kFinished = 4,
  kHeartbeat = 5,
  kCheckpointed = 6,
  kCheckpointFailed = 7,
  kRestored = 8,
};

struct Report {
  std::string slot;
  ReportKind kind = ReportKind::kCommitted;
  int64_t round = -1;
  int64_t step = 0;     // kCommitted: the count of commits (the version)
  int64_t epoch = -1;   // kCommitted: of the state's sampler; -1 when it has none
  int64_t cursor = -1;  // kCommitted: samples of the epoch consumed; -1 when unknown
  int64_t samples = -1;  // kCommitted: samples consumed over all epochs; -1 when unknown
  std::string message;
  int64_t version = 0;         // kCommitted: the version this commit made
  double rebuild_seconds = 0;  // kCommitted, first commit of a round: worker-side phases
  double sync_seconds = 0;
  int64_t collectives = 0;     // every kind: collectives started in the current round
  bool in_collective = false;  // every kind: one is running now
  int stack_signal = 0;        // what makes the worker print its stacks (0: none)
  int64_t epoch_size = -1;     // kCommitted: samples in an epoch; -1 when unknown
  double since_collective = -1;  // every kind: seconds since it last started a collective
  double seconds = 0;            // kCheckpointed: how long the write took
  // Every kind: seconds this rank spent between collectives (computing) and in them, in the
  // current round (its host-side communicator); 0 when it measures none.
  double compute_seconds = 0;
  double wait_seconds = 0;
};

// Ranks, local and cross ranks (by host, in rank order) for `members` in rank order; every
// assignment carries `sync_required`. Slots are "host:index".
std::map<std::string, Assignment> AssignRanks(const std::vector<std::string>& members,
                                              bool sync_required);

// A worker's place: the index-th slot of a host. On the wire and in logs it is "host:index".
struct Slot {
  std::string host;
  int index = 0;
  // "host:3" -> {"host", 3}; a name without ":index" is slot 0 of that host.
  static Slot Parse(const std::string& slot);
  std::string ToString() const { return host + ":" + std::to_string(index); }
  bool operator==(const Slot& o) const { return host == o.host && index == o.index; }
};

// Validates a slot name: non-empty, at most `max_bytes`, printable ASCII without spaces.
bool ValidSlotName(const std::string& slot, size_t max_bytes);

}  // namespace elastic::rendezvous
