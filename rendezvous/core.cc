#include "rendezvous/core.h"

#include <algorithm>
#include <future>

#include "common/mutex.h"

namespace elastic::rendezvous {

bool ValidSlotName(const std::string& slot, size_t max_bytes) {
  if (slot.empty() || slot.size() > max_bytes) return false;
  for (unsigned char c : slot) {
    if (c <= 0x20 || c >= 0x7f) return false;
  }
  return true;
}

Slot Slot::Parse(const std::string& slot) {
  size_t colon = slot.rfind(':');
  if (colon == std::string::npos) return {slot, 0};
  return {slot.substr(0, colon), std::atoi(slot.c_str() + colon + 1)};
}

std::map<std::string, Assignment> AssignRanks(const std::vector<std::string>& members,
                                              bool sync_required) {
  std::vector<std::string> hosts;
  std::map<std::string, int> local_count;
  for (const auto& s : members) {
    std::string host = Slot::Parse(s).host;
    if (!local_count.count(host)) hosts.push_back(host);
    ++local_count[host];
  }
  std::map<std::string, int> local_next;
  std::map<std::string, Assignment> out;
  for (size_t r = 0; r < members.size(); ++r) {
    std::string host = Slot::Parse(members[r]).host;
    Assignment a;
    a.rank = static_cast<int>(r);
    a.size = static_cast<int>(members.size());
    a.local_rank = local_next[host]++;
    a.local_size = local_count[host];
    a.cross_rank = static_cast<int>(std::find(hosts.begin(), hosts.end(), host) - hosts.begin());
    a.cross_size = static_cast<int>(hosts.size());
    a.sync_required = sync_required;
    out[members[r]] = a;
  }
  return out;
}

Core::Core(CoreOptions options)
    : options_(std::move(options)), events_(options_.limits.max_watchers_per_slot) {
  timer_ = std::thread([this] { TimerLoop(); });
}

Core::~Core() { Shutdown(); }

void Core::Shutdown() {
  std::vector<Completion> out;
  {
    MutexLock g(mu_);
    if (shutdown_) return;
    shutdown_ = true;
    std::vector<WaiterId> ids;
    for (auto& [id, w] : joins_) ids.push_back(id);
    for (WaiterId id : ids)
      CompleteJoin(id, Unavailable("the rendezvous server is shutting down"), &out);
    ids.clear();
    for (auto& [id, w] : gets_) ids.push_back(id);
    for (WaiterId id : ids)
      CompleteGet(id, Unavailable("the rendezvous server is shutting down"), &out);
    cv_.notify_all();
  }
  for (auto& c : out) c();
  events_.Close();
  if (timer_.joinable()) timer_.join();
}

int64_t Core::formed_round() const {
  MutexLock g(mu_);
  return formed_round_;
}

CoreSnapshot Core::Snapshot() const {
  MutexLock g(mu_);
  CoreSnapshot s;
  s.formed_round = formed_round_;
  s.newest_committed = newest_committed_;
  s.formed_members = formed_members_;
  s.worker_ids = worker_ids_;
  s.known_slots = known_slots_;
  s.removed = removed_;
  return s;
}

Status Core::Restore(const CoreSnapshot& snapshot) {
  MutexLock g(mu_);
  if (latest_proposed_ >= 0 || formed_round_ >= 0 || !joins_.empty() || !gets_.empty()) {
    return InvalidArgument("a core in use cannot take a snapshot");
  }
  formed_round_ = snapshot.formed_round;
  latest_proposed_ = snapshot.formed_round;
  newest_committed_ = snapshot.newest_committed;
  formed_members_ = snapshot.formed_members;
  worker_ids_ = snapshot.worker_ids;
  known_slots_ = snapshot.known_slots;
  removed_ = snapshot.removed;
  return Status::Ok();
}

size_t Core::stored_keys() const {
  MutexLock g(mu_);
  return store_.size();
}

size_t Core::pending_waiters() const {
  MutexLock g(mu_);
  return joins_.size() + gets_.size();
}

void Core::Wake() {
  ++generation_;
  cv_.notify_all();
}

Status Core::ProposeRound(int64_t round, std::map<std::string, Assignment> members,
                          const std::vector<std::string>& removed) {
  std::vector<Completion> out;
  {
    MutexLock g(mu_);
    if (shutdown_) return Unavailable("the rendezvous server is shutting down");
    if (round <= latest_proposed_ || round <= formed_round_) {
      return InvalidArgument("round " + std::to_string(round) + " is not newer than round " +
                             std::to_string(std::max(latest_proposed_, formed_round_)));
    }
    for (auto& [slot, a] : members) {
      a.round = round;
      removed_.erase(slot);
      known_slots_.insert(slot);
    }
    for (const auto& slot : removed) {
      if (members.count(slot) == 0) removed_.insert(slot);
    }
    latest_proposed_ = round;
    proposed_.round = round;
    proposed_.members = std::move(members);
    proposed_.timeout_reported = false;
    // A new proposal is looked at anew: a state-lost report of the one it replaces may have
    // reached a driver that had already moved past it, which drops it as stale; kept, the mark
    // would leave this round unformed, and unreported, with every member waiting.
    proposed_.state_lost_reported = false;
    // A slot's wait runs from when a proposal first expected it, through the proposals that
    // replace one another before a round forms: churn that re-plans every few seconds must not
    // keep a missing member from ever being named (its process restarting starts it anew).
    TimePoint now = options_.clock->Now();
    std::map<std::string, TimePoint> since;
    for (const auto& [slot, a] : proposed_.members) {
      auto old = expected_since_.find(slot);
      since[slot] = old != expected_since_.end() ? old->second : now;
    }
    expected_since_ = std::move(since);
    proposed_.deadline = ProposalDeadline(now);
    // Removed slots that are waiting learn it now.
    std::vector<WaiterId> gone;
    for (auto& [id, w] : joins_) {
      if (removed_.count(w.slot)) gone.push_back(id);
    }
    JoinResult r;
    r.removed = true;
    for (WaiterId id : gone) CompleteJoin(id, r, &out);
    TryForm(&out);
    Wake();
  }
  for (auto& c : out) c();
  return Status::Ok();
}

void Core::WithdrawRound(int64_t round) {
  MutexLock g(mu_);
  if (proposed_.round != round) return;
  proposed_ = Proposal();
  expected_since_.clear();  // waiting for hosts: the next proposal's wait starts afresh
  Wake();
}

void Core::TryForm(std::vector<Completion>* out) {
  if (proposed_.round < 0 || proposed_.state_lost_reported) return;
  // Not every member waits yet: nothing to look at (keeps a Join O(1) until the last ones).
  if (join_by_slot_.size() < proposed_.members.size()) return;
  for (const auto& [slot, a] : proposed_.members) {
    auto it = join_by_slot_.find(slot);
    if (it == join_by_slot_.end()) return;
    if (joins_.at(it->second).last_round >= proposed_.round) return;
  }
  // Every member waits. Rank 0 becomes the first (in planned order) holder of the newest
  // version that the members say they hold.
  FormedRound info;
  info.round = proposed_.round;
  std::vector<std::pair<int, std::string>> planned;
  for (const auto& [slot, a] : proposed_.members) planned.emplace_back(a.rank, slot);
  std::sort(planned.begin(), planned.end());
  for (const auto& p : planned) info.members.push_back(p.second);
  auto version_of = [&](const std::string& slot)
                        ELASTIC_REQUIRES(mu_) { return joins_.at(join_by_slot_.at(slot)).version; };
  size_t holder = 0;
  for (size_t i = 0; i < info.members.size(); ++i) {
    if (version_of(info.members[i]) > version_of(info.members[holder])) holder = i;
  }
  std::rotate(info.members.begin(), info.members.begin() + static_cast<long>(holder),
              info.members.begin() + static_cast<long>(holder) + 1);
  info.version = info.members.empty() ? 0 : version_of(info.members[0]);
  for (const auto& slot : info.members) {
    info.versions.push_back(version_of(slot));
    info.sync_required |= info.versions.back() != info.version;
  }
  info.sync_required |= info.version == 0;  // no commit: everyone takes rank 0's fresh state
  info.newest_committed = newest_committed_;
  info.state_lost = info.version == 0 && newest_committed_ > 0;
  if (info.state_lost && !options_.start_over_if_state_lost) {
    proposed_.state_lost_reported = true;
    if (options_.listener) {
      Listener* l = options_.listener;
      out->push_back([l, info] { l->OnStateLost(info); });
    }
    return;
  }
  if (info.state_lost) newest_committed_ = 0;  // starting over: versions count from 0 again
  formed_round_ = proposed_.round;
  formed_members_ = AssignRanks(info.members, info.sync_required);
  for (auto& [slot, a] : formed_members_) a.round = formed_round_;
  proposed_ = Proposal();
  expected_since_.clear();
  // The old round's scope ends: its keys go and its waiting Gets are told.
  std::vector<WaiterId> stale;
  for (auto& [id, w] : gets_) stale.push_back(id);
  for (WaiterId id : stale) {
    CompleteGet(id,
                Aborted("round " + std::to_string(gets_.at(id).round) +
                        " was superseded by round " + std::to_string(formed_round_)),
                out);
  }
  store_.clear();
  key_waiters_.clear();
  store_bytes_ = 0;
  for (const auto& [slot, a] : formed_members_) {
    JoinResult r;
    r.assignment = a;
    CompleteJoin(join_by_slot_.at(slot), r, out);
  }
  if (options_.listener) {
    Listener* l = options_.listener;
    out->push_back([l, info] { l->OnRoundFormed(info); });
  }
}

void Core::EraseDeadline(TimePoint deadline, WaiterId id) {
  auto range = deadlines_.equal_range(deadline);
  for (auto d = range.first; d != range.second; ++d) {
    if (d->second == id) {
      deadlines_.erase(d);
      return;
    }
  }
}

void Core::CompleteJoin(WaiterId id, StatusOr<JoinResult> result, std::vector<Completion>* out) {
  auto it = joins_.find(id);
  if (it == joins_.end()) return;
  EraseDeadline(it->second.deadline, id);
  auto by_slot = join_by_slot_.find(it->second.slot);
  if (by_slot != join_by_slot_.end() && by_slot->second == id) join_by_slot_.erase(by_slot);
  auto done = std::move(it->second.done);
  joins_.erase(it);
  out->push_back(
      [done = std::move(done), result = std::move(result)]() mutable { done(std::move(result)); });
}

void Core::CompleteGet(WaiterId id, StatusOr<Values> result, std::vector<Completion>* out) {
  auto it = gets_.find(id);
  if (it == gets_.end()) return;
  EraseDeadline(it->second.deadline, id);
  if (it->second.missing > 0) {
    for (const auto& key : it->second.keys) {
      auto kw = key_waiters_.find(key);
      if (kw == key_waiters_.end()) continue;
      auto& v = kw->second;
      for (size_t i = 0; i < v.size(); ++i) {
        if (v[i] == id) {
          v[i] = v.back();
          v.pop_back();
          break;
        }
      }
      if (v.empty()) key_waiters_.erase(kw);
    }
  }
  auto done = std::move(it->second.done);
  gets_.erase(it);
  out->push_back(
      [done = std::move(done), result = std::move(result)]() mutable { done(std::move(result)); });
}

Status Core::CheckWorker(const std::string& slot, const std::string& worker_id) const {
  MutexLock g(mu_);
  return CheckWorkerLocked(slot, worker_id);
}

Status Core::CheckWorkerLocked(const std::string& slot, const std::string& worker_id) const {
  auto it = worker_ids_.find(slot);
  if (it == worker_ids_.end() || it->second == worker_id) return Status::Ok();
  return FailedPrecondition("slot " + slot +
                            " belongs to another process (the one elastic-run started for it "
                            "last); this one is a stray copy or an old launch");
}

void Core::SetWorkerId(const std::string& slot, const std::string& id) {
  MutexLock g(mu_);
  worker_ids_[slot] = id;
  known_slots_.insert(slot);  // a slot the driver started a process for (a warm spare too)
  // A removal was news for the slot's earlier process; the new one (a warm spare, started on
  // a slot an earlier round removed) waits for a round like any other.
  removed_.erase(slot);
  // A new process of a slot the pending proposal expects: its wait starts now.
  auto since = expected_since_.find(slot);
  if (since != expected_since_.end() && proposed_.round >= 0) {
    since->second = options_.clock->Now();
    proposed_.deadline = ProposalDeadline(options_.clock->Now());
    Wake();
  }
}

void Core::RestartWait(const std::vector<std::string>& slots) {
  MutexLock g(mu_);
  TimePoint now = options_.clock->Now();
  for (const auto& slot : slots) {
    auto since = expected_since_.find(slot);
    if (since != expected_since_.end()) since->second = now;
  }
  if (proposed_.round < 0) return;
  proposed_.timeout_reported = false;
  proposed_.deadline = ProposalDeadline(now);
  Wake();
}

TimePoint Core::ProposalDeadline(TimePoint now) const {
  // The earliest member wait still to end; when every member's has, a look each second (a
  // member that waits now may still go away).
  TimePoint next = TimePoint::max();
  for (const auto& [slot, since] : expected_since_) {
    TimePoint due = since + options_.rendezvous_timeout;
    if (due > now) next = std::min(next, due);
  }
  return next != TimePoint::max() ? next : now + std::chrono::seconds(1);
}

void Core::NoteMemberLeft(const std::string& slot, int64_t last_round,
                          std::vector<Completion>* out) {
  if (options_.listener && formed_round_ >= 0 && last_round >= formed_round_ &&
      formed_members_.count(slot)) {
    Listener* l = options_.listener;
    int64_t round = formed_round_;
    out->push_back([l, round, slot] { l->OnMemberLeft(round, slot); });
  }
}

WaiterId Core::JoinAsync(const std::string& slot, int64_t last_round, int64_t version,
                         TimePoint deadline, JoinCallback done, const std::string& worker_id) {
  std::vector<Completion> out;
  WaiterId id = 0;
  {
    MutexLock g(mu_);
    if (shutdown_) {
      out.push_back([done] { done(Unavailable("the rendezvous server is shutting down")); });
    } else if (!ValidSlotName(slot, options_.limits.max_slot_bytes)) {
      out.push_back([done] {
        done(InvalidArgument("slot name is empty, too long or has spaces or control bytes"));
      });
    } else if (version < 0) {
      out.push_back([done] { done(InvalidArgument("a state version cannot be negative")); });
    } else if (Status mine = CheckWorkerLocked(slot, worker_id); !mine.ok()) {
      out.push_back([done, mine] { done(mine); });
    } else if (!known_slots_.count(slot)) {
      out.push_back([done, slot] {
        done(FailedPrecondition("slot " + slot +
                                " is not a slot of this job: no round ever included it (was "
                                "ELASTIC_SLOT set by hand?)"));
      });
    } else if (formed_round_ > last_round && formed_members_.count(slot) && proposed_.round < 0) {
      // The current round already includes the slot (a retried Join). With a newer round
      // pending the slot waits for that one instead: it may be a relaunched process.
      JoinResult r;
      r.assignment = formed_members_.at(slot);
      out.push_back([done, r] { done(r); });
    } else if (removed_.count(slot)) {
      // A member scaled away leaves its round here (at a commit, when it was fenced): its
      // peers are told as for any member that leaves, so that none waits for it in a
      // collective it will never finish (found by the namespace soak, seed 443641197 job 8:
      // two members stuck in the commit agreement with a peer whose link was out waited the
      // rendezvous timeout, 32 s).
      NoteMemberLeft(slot, last_round, &out);
      JoinResult r;
      r.removed = true;
      out.push_back([done, r] { done(r); });
    } else if (joins_.size() + gets_.size() >= options_.limits.max_pending_waiters) {
      out.push_back([done] { done(ResourceExhausted("too many waiting calls")); });
    } else {
      id = next_id_++;
      auto prev = join_by_slot_.find(slot);
      if (prev != join_by_slot_.end()) {
        CompleteJoin(prev->second, Aborted("superseded by a newer Join from slot " + slot), &out);
      }
      newest_committed_ = std::max(newest_committed_, version);
      NoteMemberLeft(slot, last_round, &out);
      joins_.emplace(id, JoinWaiter{slot, last_round, version, deadline, std::move(done)});
      join_by_slot_[slot] = id;
      deadlines_.emplace(deadline, id);
      if (options_.listener && !(proposed_.round >= 0 && proposed_.members.count(slot))) {
        Listener* l = options_.listener;
        out.push_back([l, slot] { l->OnWaitingForPlace(slot); });
      }
      TryForm(&out);
      Wake();
    }
  }
  for (auto& c : out) c();
  return id;
}

StatusOr<JoinResult> Core::Join(const std::string& slot, int64_t last_round, int64_t version,
                                TimePoint deadline) {
  auto promise = std::make_shared<std::promise<StatusOr<JoinResult>>>();
  auto future = promise->get_future();
  JoinAsync(slot, last_round, version, deadline,
            [promise](StatusOr<JoinResult> r) { promise->set_value(std::move(r)); });
  return future.get();
}

Status Core::CheckRound(int64_t round) const {
  if (round == formed_round_ && formed_round_ >= 0) return Status::Ok();
  if (round < formed_round_) {
    return FailedPrecondition("round " + std::to_string(round) + " is stale: round " +
                              std::to_string(formed_round_) + " is current");
  }
  return FailedPrecondition("round " + std::to_string(round) + " is not formed (current round " +
                            std::to_string(formed_round_) + ")");
}

Status Core::Set(int64_t round, const std::string& key, std::string value) {
  const Limits& lim = options_.limits;
  if (key.empty() || key.size() > lim.max_key_bytes) {
    return InvalidArgument("key must be 1.." + std::to_string(lim.max_key_bytes) + " bytes, got " +
                           std::to_string(key.size()));
  }
  if (value.size() > lim.max_value_bytes) {
    return InvalidArgument("value of key '" + key + "' is " + std::to_string(value.size()) +
                           " bytes, over the limit of " + std::to_string(lim.max_value_bytes));
  }
  std::vector<Completion> out;
  {
    MutexLock g(mu_);
    if (shutdown_) return Unavailable("the rendezvous server is shutting down");
    RETURN_IF_ERROR(CheckRound(round));
    auto existing = store_.find(key);
    size_t old_bytes = existing == store_.end() ? 0 : existing->second->size();
    if (existing == store_.end() && store_.size() >= lim.max_round_keys) {
      return ResourceExhausted("round " + std::to_string(round) + " already holds " +
                               std::to_string(store_.size()) + " keys");
    }
    if (store_bytes_ - old_bytes + value.size() > lim.max_round_bytes) {
      return ResourceExhausted("round " + std::to_string(round) + " store is full");
    }
    store_bytes_ = store_bytes_ - old_bytes + value.size();
    auto shared = std::make_shared<const std::string>(std::move(value));
    store_[key] = shared;
    auto kw = key_waiters_.find(key);
    if (kw != key_waiters_.end()) {
      std::vector<WaiterId> waiters = std::move(kw->second);
      key_waiters_.erase(kw);
      for (WaiterId id : waiters) {
        auto& w = gets_.at(id);
        if (--w.missing > 0) continue;
        Values values;
        values.reserve(w.keys.size());
        for (const auto& k : w.keys) values.push_back(store_.at(k));
        CompleteGet(id, std::move(values), &out);
      }
    }
  }
  for (auto& c : out) c();
  return Status::Ok();
}

WaiterId Core::GetAsync(int64_t round, std::vector<std::string> keys, TimePoint deadline,
                        GetCallback done) {
  const Limits& lim = options_.limits;
  std::vector<Completion> out;
  WaiterId id = 0;
  {
    MutexLock g(mu_);
    Status bad;
    if (shutdown_) bad = Unavailable("the rendezvous server is shutting down");
    if (bad.ok() && (keys.empty() || keys.size() > lim.max_keys_per_call)) {
      bad = InvalidArgument("a Get takes 1.." + std::to_string(lim.max_keys_per_call) +
                            " keys, got " + std::to_string(keys.size()));
    }
    for (size_t i = 0; bad.ok() && i < keys.size(); ++i) {
      if (keys[i].empty() || keys[i].size() > lim.max_key_bytes) {
        bad = InvalidArgument("key #" + std::to_string(i) + " must be 1.." +
                              std::to_string(lim.max_key_bytes) + " bytes");
      }
    }
    if (bad.ok()) bad = CheckRound(round);
    if (bad.ok() && joins_.size() + gets_.size() >= lim.max_pending_waiters) {
      bad = ResourceExhausted("too many waiting calls");
    }
    if (!bad.ok()) {
      out.push_back([done, bad] { done(bad); });
    } else {
      size_t missing = 0;
      size_t bytes = 0;
      for (const auto& k : keys) {
        auto it = store_.find(k);
        if (it == store_.end()) {
          ++missing;
        } else {
          bytes += it->second->size();
        }
      }
      if (missing == 0) {
        if (bytes > lim.max_get_response_bytes) {
          Status s = ResourceExhausted("values total " + std::to_string(bytes) + " bytes");
          out.push_back([done, s] { done(s); });
        } else {
          Values values;
          values.reserve(keys.size());
          for (const auto& k : keys) values.push_back(store_.at(k));
          out.push_back([done, values = std::move(values)] { done(values); });
        }
      } else {
        id = next_id_++;
        std::set<std::string> seen;
        for (const auto& k : keys) {
          if (store_.count(k) == 0 && seen.insert(k).second) key_waiters_[k].push_back(id);
        }
        gets_.emplace(id,
                      GetWaiter{round, std::move(keys), seen.size(), deadline, std::move(done)});
        deadlines_.emplace(deadline, id);
        Wake();
      }
    }
  }
  for (auto& c : out) c();
  return id;
}

StatusOr<Values> Core::Get(int64_t round, std::vector<std::string> keys, TimePoint deadline) {
  auto promise = std::make_shared<std::promise<StatusOr<Values>>>();
  auto future = promise->get_future();
  GetAsync(round, std::move(keys), deadline,
           [promise](StatusOr<Values> r) { promise->set_value(std::move(r)); });
  return future.get();
}

void Core::Cancel(WaiterId id) {
  std::vector<Completion> out;
  {
    MutexLock g(mu_);
    if (joins_.count(id)) CompleteJoin(id, Cancelled("the call was cancelled"), &out);
    if (gets_.count(id)) CompleteGet(id, Cancelled("the call was cancelled"), &out);
  }
  for (auto& c : out) c();
}

Status Core::HandleReport(const Report& report) {
  if (!ValidSlotName(report.slot, options_.limits.max_slot_bytes)) {
    return InvalidArgument("report has an invalid slot name");
  }
  if (report.message.size() > options_.limits.max_message_bytes) {
    return InvalidArgument("report message is over " +
                           std::to_string(options_.limits.max_message_bytes) + " bytes");
  }
  if (report.kind == ReportKind::kCommitted) {
    if (report.version < 0) return InvalidArgument("a committed version cannot be negative");
    MutexLock g(mu_);
    newest_committed_ = std::max(newest_committed_, report.version);
  }
  if (options_.listener) options_.listener->OnReport(report);
  return Status::Ok();
}

void Core::ExpireDue(std::vector<Completion>* out, std::vector<std::string>* missing,
                     int64_t* timed_out_round) {
  TimePoint now = options_.clock->Now();
  while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
    WaiterId id = deadlines_.begin()->second;
    if (joins_.count(id)) {
      CompleteJoin(id,
                   DeadlineExceeded("no round including slot " + joins_.at(id).slot +
                                    " was formed before the deadline"),
                   out);
    } else if (gets_.count(id)) {
      CompleteGet(id, DeadlineExceeded("keys did not all appear before the deadline"), out);
    } else {
      deadlines_.erase(deadlines_.begin());
    }
  }
  if (proposed_.round >= 0 && !proposed_.timeout_reported && proposed_.deadline <= now) {
    // Members that have been expected for the whole rendezvous timeout and do not wait.
    for (const auto& [slot, a] : proposed_.members) {
      auto since = expected_since_.find(slot);
      if (since != expected_since_.end() && since->second + options_.rendezvous_timeout > now) {
        continue;
      }
      auto it = join_by_slot_.find(slot);
      if (it == join_by_slot_.end() || joins_.at(it->second).last_round >= proposed_.round) {
        missing->push_back(slot);
      }
    }
    if (!missing->empty()) {
      proposed_.timeout_reported = true;
      *timed_out_round = proposed_.round;
    } else {
      proposed_.deadline = ProposalDeadline(now);
    }
  }
}

void Core::TimerLoop() {
  MutexLock lock(mu_);
  while (!shutdown_) {
    // Bounded so that no wait is computed from TimePoint::max().
    TimePoint next = options_.clock->Now() + std::chrono::hours(1);
    if (!deadlines_.empty()) next = std::min(next, deadlines_.begin()->first);
    if (proposed_.round >= 0 && !proposed_.timeout_reported)
      next = std::min(next, proposed_.deadline);
    uint64_t gen = generation_;
    options_.clock->WaitUntil(lock.native(), cv_, next, [&]() ELASTIC_REQUIRES(mu_) {
      return shutdown_ || generation_ != gen;
    });
    if (shutdown_) break;
    std::vector<Completion> out;
    std::vector<std::string> missing;
    int64_t timed_out = -1;
    ExpireDue(&out, &missing, &timed_out);
    if (out.empty() && timed_out < 0) continue;
    lock.Unlock();
    for (auto& c : out) c();
    if (timed_out >= 0 && options_.listener) options_.listener->OnJoinTimeout(timed_out, missing);
    lock.Lock();
  }
}

}  // namespace elastic::rendezvous
