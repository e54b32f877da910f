// Leadership of a job whose journal lives in etcd (--state-store, docs/high-availability.md).
//
// PREFIX/leader names the driver that leads: "ADDRESS\nPID\nHOST\nNONCE", written with a lease
// of --lease-ttl seconds that the leader keeps alive. It is created only when it does not exist
// (a transaction), so one driver leads at a time; etcd's consensus decides, not ours. Every
// write of the leader (PREFIX/journal, the job's end) is a transaction that runs only while
// PREFIX/leader still holds the leader's own value: a driver whose lease expired (paused,
// partitioned from etcd) can never write again, whatever it believes.
//
// A standby (--standby) never starts a job: it waits until a journal exists and no driver
// leads, then leads and adopts the journal's workers. It ends, with the job's code, when the
// job under the prefix has ended (PREFIX/done, written by the job's last leader with the
// journal's removal; a driver that takes the lead removes it in the same transaction).
//
// While it waits, a standby is listed under PREFIX/standbys/ (HOST-PID-NONCE: its address,
// host and pid, as JSON) with a lease of its own that it renews: the key goes when it leads,
// ends or dies (after a TTL). The leader counts them (--drivers, driver/placement.h).
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/etcd.h"
#include "common/mutex.h"

namespace elastic::driver {

struct LeadershipOptions {
  EtcdUrl store;
  int ttl_seconds = 5;
  bool standby = false;
  // The address a standby will announce when it leads (--driver-address); it lists it.
  std::string address;
  // A standby's check of the journal of the job it would adopt, before it takes the lease:
  // an error ends Take with it (a job this driver cannot adopt).
  std::function<Status(const std::string& journal)> check_journal;
};

class Leadership {
 public:
  // How Take ended for a standby whose job ended under another driver.
  struct Ended {
    int code = 0;
    std::string message;
  };

  // Leads the job (a standby: once it may). FAILED_PRECONDITION naming the leader when
  // another driver leads and this is no standby; UNAVAILABLE when etcd does not answer;
  // CANCELLED when `stop` said so while waiting. `ended` is set (and nullptr returned) when a
  // standby's job ended under another driver.
  static StatusOr<std::unique_ptr<Leadership>> Take(const LeadershipOptions& options,
                                                    const std::function<bool()>& stop,
                                                    std::optional<Ended>* ended);
  ~Leadership();

  // Keeps the lease alive from now on; `lost` runs (once, on that thread) when it is lost:
  // etcd said the lease or the leader key is gone, or no renewal got through for a whole TTL.
  void KeepAlive(std::function<void(const std::string& why)> lost);
  // Whether this driver surely still leads: no loss seen, and a renewal got through less than
  // a TTL ago (less a margin). A driver that was paused past its lease sees false at once,
  // before its keeper thread has run. `why` (if given) gets the reason when false.
  bool Leads(std::string* why = nullptr);
  // The leader key says where this driver's workers dial it.
  Status Announce(const std::string& address);
  // The journal's text, nullopt when there is none.
  StatusOr<std::optional<std::string>> ReadJournal();
  // Fenced writes: FAILED_PRECONDITION when this driver no longer leads.
  Status WriteJournal(const std::string& text);
  Status RemoveJournal();
  // The job ended: PREFIX/done says how, the journal goes, the lease is revoked.
  Status Finish(int code, const std::string& message);

  Etcd& store() { return store_; }
  const std::string& value() const { return value_; }

 private:
  Leadership(const LeadershipOptions& options, int64_t lease, std::string value);
  Status Fenced(const std::vector<Etcd::Write>& writes, const char* what);

  LeadershipOptions options_;
  Etcd store_;
  int64_t lease_;
  std::string value_;  // the leader key's value while this driver leads
  std::string host_pid_;
  Mutex mu_;
  std::condition_variable cv_;
  bool stop_ ELASTIC_GUARDED_BY(mu_) = false;
  std::string lost_ ELASTIC_GUARDED_BY(mu_);  // why the lease was lost ("" while it holds)
  std::atomic<int64_t> renewed_ns_{0};  // steady clock of the newest renewal that got through
  std::thread keeper_;
};

// A standby that waits (its PREFIX/standbys/ key).
struct StandbyView {
  std::string address, host;
  int64_t pid = 0;
};
// The standbys that wait for the job (at most 1000).
StatusOr<std::vector<StandbyView>> ListStandbys(Etcd& store);

// "ADDRESS\nPID\nHOST\nNONCE" -> "ADDRESS (pid PID on HOST)".
std::string DescribeLeader(const std::string& value);

}  // namespace elastic::driver
