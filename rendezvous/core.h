// The rendezvous core: rounds, the per-round key-value store and event fan-out. No gRPC here;
// the gRPC service (service.h) is a thin adapter over it, and tests drive it directly.
//
// Rounds. The driver proposes round r (members with their planned assignments, and slots that
// are removed). A Join(slot, last_round, version) completes when a formed round newer than
// last_round includes the slot, with REMOVED if the slot was removed, or with
// DEADLINE_EXCEEDED at its deadline. A proposed round is formed once every member has an
// outstanding Join; members still missing after the rendezvous timeout are reported through
// Listener::OnJoinTimeout, and the driver re-plans by proposing a newer round. A member's wait
// counts from the first proposal that expected it, across proposals that replace one another
// before a round forms (a new process for the slot, SetWorkerId, starts it anew; a withdrawn
// round ends every wait).
//
// Versions. Each Join says which version of the committed state the worker holds (the count
// of commits that made it; 0: none). When a round forms, rank 0 becomes a holder of the
// newest version among the members (the planned order is kept otherwise), and every member's
// assignment says sync_required when any member holds another version or none holds a
// commit. What a worker holds is only ever what it says: the core keeps no other record.
// If commits were made (a Join or a COMMITTED report said so) but no member holds any, the
// state is lost: the round does not form and Listener::OnStateLost is called once, unless
// CoreOptions::start_over_if_state_lost, in which case it forms, synced from rank 0's fresh
// state, and the listener hears of it through FormedRound::state_lost.
//
// Store. Keys live in the scope of the formed round; Set and Get for any other round fail
// with FAILED_PRECONDITION. When a newer round forms, the old round's keys are dropped and
// its waiting Gets end with ABORTED.
//
// Every waiter (Join or Get) completes exactly once, through its callback, from some thread
// other than the caller's or from within the call itself; never with the core's lock held.
// All methods are thread-safe.
#pragma once

#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/clock.h"
#include "common/mutex.h"
#include "common/status.h"
#include "rendezvous/event_hub.h"
#include "rendezvous/types.h"

namespace elastic::rendezvous {

// Driver-side callbacks. Called without the core's lock held, from the core's timer thread or
// from a caller's thread; implementations must be thread-safe and must not block for long.
class Listener {
 public:
  virtual ~Listener() = default;
  virtual void OnRoundFormed(const FormedRound& /*round*/) {}
  // The proposed round's members hold no commit although commits were made; it stays unformed.
  virtual void OnStateLost(const FormedRound& /*round*/) {}
  virtual void OnJoinTimeout(int64_t /*round*/, const std::vector<std::string>& /*missing*/) {}
  // A member of the formed `round` joins again (it left the round: fenced, failed to connect,
  // rolled back, or scaled away and told so): its peers there cannot complete a collective
  // without it.
  virtual void OnMemberLeft(int64_t /*round*/, const std::string& /*slot*/) {}
  virtual void OnReport(const Report& /*report*/) {}
  // The slot's process waits in Join, and no pending proposal includes it (a warm spare, a
  // newcomer, a member that left its round).
  virtual void OnWaitingForPlace(const std::string& /*slot*/) {}
  virtual void OnWatchOpened(const std::string& /*slot*/) {}
  virtual void OnWatchClosed(const std::string& /*slot*/) {}
};

struct CoreOptions {
  Clock* clock = RealClock();
  Duration rendezvous_timeout = std::chrono::seconds(30);
  Limits limits;
  Listener* listener = nullptr;  // not owned; may be null
  bool start_over_if_state_lost = false;
};

// What the core holds that outlives one driver process (driver/journal.h): the formed round
// and its members, who may claim each slot, the newest version committed. A pending proposal,
// the waiters and the round's store are not in it: a driver that adopts the job proposes
// again, and the workers' calls come again.
struct CoreSnapshot {
  int64_t formed_round = -1;
  int64_t newest_committed = 0;
  std::map<std::string, Assignment> formed_members;
  std::map<std::string, std::string> worker_ids;
  std::set<std::string> known_slots, removed;
};

using WaiterId = uint64_t;
using JoinCallback = std::function<void(StatusOr<JoinResult>)>;
using Values = std::vector<std::shared_ptr<const std::string>>;
using GetCallback = std::function<void(StatusOr<Values>)>;

class Core {
 public:
  explicit Core(CoreOptions options);
  ~Core();  // calls Shutdown()
  Core(const Core&) = delete;
  Core& operator=(const Core&) = delete;

  // --- driver side ---
  // Proposes `round` (must be newer than every earlier proposal: else INVALID_ARGUMENT).
  // Replaces a pending proposal. Slots in `removed` get REMOVED on their Joins until a later
  // proposal includes them again.
  Status ProposeRound(int64_t round, std::map<std::string, Assignment> members,
                      const std::vector<std::string>& removed);
  // Withdraws the pending proposal of `round` (a no-op when another is pending or it formed):
  // it will not form and its rendezvous timeout does not fire; its members' Joins go on
  // waiting for a later round.
  void WithdrawRound(int64_t round);
  // The pending proposal's wait for these slots starts again now, and they can be reported
  // missing again (the driver aborted the old round they are still in).
  void RestartWait(const std::vector<std::string>& slots);
  // The driver launched the slot's process with this id (ELASTIC_WORKER_ID).
  void SetWorkerId(const std::string& slot, const std::string& id);
  int64_t formed_round() const;
  EventHub& events() { return events_; }
  CoreSnapshot Snapshot() const;
  // Takes a snapshot of another core (the driver before this one) as this one's: its formed
  // round goes on. Only before any proposal or worker call; INVALID_ARGUMENT after.
  Status Restore(const CoreSnapshot& snapshot);

  // --- worker side ---
  // `version`: the version of the committed state the worker holds (0: none).
  // `worker_id`: which launch of the slot the caller is; once the driver set the slot's
  // (SetWorkerId), a Join with another id is refused with FAILED_PRECONDITION.
  WaiterId JoinAsync(const std::string& slot, int64_t last_round, int64_t version,
                     TimePoint deadline, JoinCallback done, const std::string& worker_id = "");
  StatusOr<JoinResult> Join(const std::string& slot, int64_t last_round, int64_t version,
                            TimePoint deadline);
  // FAILED_PRECONDITION when the driver set the slot's worker id and `worker_id` is another:
  // the caller is not the process the driver started (or adopted) for the slot.
  Status CheckWorker(const std::string& slot, const std::string& worker_id) const;
  Status Set(int64_t round, const std::string& key, std::string value);
  WaiterId GetAsync(int64_t round, std::vector<std::string> keys, TimePoint deadline,
                    GetCallback done);
  StatusOr<Values> Get(int64_t round, std::vector<std::string> keys, TimePoint deadline);
  // Ends a waiting Join or Get with CANCELLED; a no-op when it has completed already.
  void Cancel(WaiterId id);
  // Validates and forwards a report to the listener; a COMMITTED report's version counts
  // towards the newest version committed.
  Status HandleReport(const Report& report);

  // Ends every waiter with UNAVAILABLE, sends SHUTDOWN to every watcher and stops the timer.
  // Later calls fail with UNAVAILABLE. Idempotent.
  void Shutdown();

  const CoreOptions& options() const { return options_; }
  Clock* clock() const { return options_.clock; }
  // Number of keys currently stored (all rounds). For tests and the benchmark.
  size_t stored_keys() const;
  // Number of Joins and Gets waiting. For tests.
  size_t pending_waiters() const;

 private:
  struct JoinWaiter {
    std::string slot;
    int64_t last_round;
    int64_t version;
    TimePoint deadline;
    JoinCallback done;
  };
  struct GetWaiter {
    int64_t round;
    std::vector<std::string> keys;
    size_t missing;
    TimePoint deadline;
    GetCallback done;
  };
  struct Proposal {
    int64_t round = -1;
    std::map<std::string, Assignment> members;
    TimePoint deadline;
    bool timeout_reported = false;
    bool state_lost_reported = false;
  };
  using Completion = std::function<void()>;

  void TimerLoop();
  // The helpers below run with mu_ held and append callbacks to run after it is released.
  void TryForm(std::vector<Completion>* out) ELASTIC_REQUIRES(mu_);
  // When `slot`, a member of the formed round, joins again from it (`last_round`): tells the
  // listener that it left (OnMemberLeft, queued on `out`).
  void NoteMemberLeft(const std::string& slot, int64_t last_round, std::vector<Completion>* out)
      ELASTIC_REQUIRES(mu_);
  void EraseDeadline(TimePoint deadline, WaiterId id) ELASTIC_REQUIRES(mu_);
  void CompleteJoin(WaiterId id, StatusOr<JoinResult> result, std::vector<Completion>* out)
      ELASTIC_REQUIRES(mu_);
  void CompleteGet(WaiterId id, StatusOr<Values> result, std::vector<Completion>* out)
      ELASTIC_REQUIRES(mu_);
  void ExpireDue(std::vector<Completion>* out, std::vector<std::string>* missing,
                 int64_t* timed_out_round) ELASTIC_REQUIRES(mu_);
  Status CheckRound(int64_t round) const ELASTIC_REQUIRES(mu_);
  Status CheckWorkerLocked(const std::string& slot, const std::string& worker_id) const
      ELASTIC_REQUIRES(mu_);
  // When the pending proposal next looks for members that waited too long.
  TimePoint ProposalDeadline(TimePoint now) const ELASTIC_REQUIRES(mu_);
  // Tells the timer thread that deadlines changed.
  void Wake() ELASTIC_REQUIRES(mu_);

  CoreOptions options_;
  EventHub events_;

  mutable Mutex mu_;
  std::condition_variable cv_;            // wakes the timer thread
  bool shutdown_ ELASTIC_GUARDED_BY(mu_) = false;
  uint64_t generation_ ELASTIC_GUARDED_BY(mu_) = 0;  // bumped when deadlines change
  WaiterId next_id_ ELASTIC_GUARDED_BY(mu_) = 1;
  std::map<WaiterId, JoinWaiter> joins_ ELASTIC_GUARDED_BY(mu_);
  std::unordered_map<std::string, WaiterId> join_by_slot_ ELASTIC_GUARDED_BY(mu_);
  std::map<WaiterId, GetWaiter> gets_ ELASTIC_GUARDED_BY(mu_);
  std::multimap<TimePoint, WaiterId> deadlines_ ELASTIC_GUARDED_BY(mu_);
  Proposal proposed_ ELASTIC_GUARDED_BY(mu_);  // (round -1: none)
  int64_t latest_proposed_ ELASTIC_GUARDED_BY(mu_) = -1;
  int64_t formed_round_ ELASTIC_GUARDED_BY(mu_) = -1;
  int64_t newest_committed_ ELASTIC_GUARDED_BY(mu_) = 0;
  std::map<std::string, Assignment> formed_members_ ELASTIC_GUARDED_BY(mu_);
  std::set<std::string> removed_ ELASTIC_GUARDED_BY(mu_);
  // Since when each member of the pending proposal has been expected (proposals that replace
  // one another before a round forms carry it over).
  std::map<std::string, TimePoint> expected_since_ ELASTIC_GUARDED_BY(mu_);
  std::set<std::string> known_slots_ ELASTIC_GUARDED_BY(mu_);  // every slot ever proposed
  std::map<std::string, std::string> worker_ids_ ELASTIC_GUARDED_BY(mu_);  // slot -> current launch
  // The formed round's store, and who waits on which key.
  std::unordered_map<std::string, std::shared_ptr<const std::string>> store_
      ELASTIC_GUARDED_BY(mu_);
  size_t store_bytes_ ELASTIC_GUARDED_BY(mu_) = 0;
  std::unordered_map<std::string, std::vector<WaiterId>> key_waiters_ ELASTIC_GUARDED_BY(mu_);
  std::thread timer_;
};

}  // namespace elastic::rendezvous
