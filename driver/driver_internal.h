// The driver's internals, shared by driver.cc (start-up, launching, the event loop) and
// policy.cc (membership decisions). Private to driver/.
#pragma once

#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/process.h"
#include "driver/driver.h"
#include "driver/event_log.h"
#include "driver/output.h"
#include "rendezvous/rendezvous.h"

namespace elastic::driver::internal {

using discovery::HostSlots;

double Secs(Duration d);
bool IsLocalHost(const std::string& host);

struct Posted {
  enum Kind {
    kRoundFormed,
    kStateLost,
    kJoinTimeout,
    kMemberLeft,
    kReport,
    kWatchOpened,
    kWatchClosed,
    kDiscovery
  };
  explicit Posted(Kind k, int64_t r = -1) : kind(k), round(r) {}
  Kind kind;
  int64_t round = -1;
  std::vector<std::string> slots;
  rendezvous::Report report;
  std::optional<StatusOr<std::vector<HostSlots>>> hosts;
  std::vector<std::string> warnings;
  rendezvous::FormedRound formed;
};

struct Worker {
  std::string slot, host;
  int index = 0;
  std::unique_ptr<Process> proc;
  bool local = true;
  bool dropped = false;   // the driver gave up on it (failed, lost, removed): exit is expected
  bool removed = false;   // scaled away
  bool finished = false;  // reported FINISHED
  bool leaving = false;   // reported LEAVING: no longer a member, whatever its exit
  TimePoint lost_at = TimePoint::max();  // remote: Watch broke; lost unless it exits by then
};

class Driver : public rendezvous::Listener {
 public:
  explicit Driver(const DriverOptions& o)
      : opts_(o),
        hosts_(discovery::HostTableOptions{RealClock(), o.host_failure_limit, o.cooldown_min,
                                           o.cooldown_max, static_cast<uint64_t>(getpid())}),
        out_(stdout, o.output_dir) {}

  int Run();

  // rendezvous::Listener: called on gRPC / timer threads; only posts.
  void OnRoundFormed(const rendezvous::FormedRound& f) override {
    Posted p{Posted::kRoundFormed, f.round};
    p.formed = f;
    Post(std::move(p));
  }
  void OnStateLost(const rendezvous::FormedRound& f) override {
    Posted p{Posted::kStateLost, f.round};
    p.formed = f;
    Post(std::move(p));
  }
  void OnJoinTimeout(int64_t round, const std::vector<std::string>& missing) override {
    Posted p{Posted::kJoinTimeout, round};
    p.slots = missing;
    Post(std::move(p));
  }
  void OnMemberLeft(int64_t round, const std::string& slot) override {
    Posted p{Posted::kMemberLeft, round};
    p.slots = {slot};
    Post(std::move(p));
  }
  void OnReport(const rendezvous::Report& r) override {
    Posted p{Posted::kReport};
    p.report = r;
    Post(std::move(p));
  }
  void OnWatchOpened(const std::string& slot) override {
    Posted p{Posted::kWatchOpened};
    p.slots = {slot};
    Post(std::move(p));
  }
  void OnWatchClosed(const std::string& slot) override {
    Posted p{Posted::kWatchClosed};
    p.slots = {slot};
    Post(std::move(p));
  }

 private:
  // Reports are the one event a worker can send at will: beyond a bound they are dropped, so
  // a flood cannot grow the queue without limit.
  void Post(Posted p) {
    {
      std::lock_guard<std::mutex> g(post_mu_);
      if (p.kind == Posted::kReport && posted_.size() >= kMaxPosted) return;
      posted_.push_back(std::move(p));
    }
    uint64_t one = 1;
    ssize_t ignored = write(wake_fd_, &one, sizeof one);
    (void)ignored;
  }
  static constexpr size_t kMaxPosted = 1 << 16;
  Status Start();
  void Loop();
  void HandlePosted(Posted& p);
  void HandleDiscovery(Posted& p);
  void HandleExit(Worker& w, int code);
  void HandleReport(const rendezvous::Report& r);
  void HandleFormed(const rendezvous::FormedRound& f);
  void HandleLeaving(Worker& w, const std::string& why);
  void HandleMemberLeft(int64_t round, const std::string& slot);
  // ABORT to every member of the formed round but `gone`, if `gone` is one of them.
  void AbortFormedRound(const std::string& gone, const std::string& why);
  void Replan(const std::string& reason);
  void Launch(Worker& w);
  void Terminate(int code, const std::string& message);
  void CheckFinished();
  void DiscoveryLoop();
  std::string LabelOf(const std::string& slot) const;
  int MemberRank(const std::string& slot) const;

  DriverOptions opts_;
  discovery::HostTable hosts_;
  OutputMux out_;
  EventLog log_;
  std::string token_, driver_addr_;
  std::unique_ptr<rendezvous::Core> core_;
  std::unique_ptr<rendezvous::Server> server_;
  int wake_fd_ = -1, signal_fd_ = -1;

  std::mutex post_mu_;
  std::deque<Posted> posted_;  // guarded by post_mu_

  std::thread discovery_;
  std::mutex disc_mu_;
  std::condition_variable disc_cv_;
  bool disc_stop_ = false;  // guarded by disc_mu_

  std::map<std::string, Worker> workers_;  // by slot
  // Of the newest proposed round, in rank order (as planned; once formed, as the core ranked
  // them).
  std::vector<std::string> members_;
  int64_t round_ = -1;                       // newest proposed round
  int64_t formed_ = -1;                      // newest formed round
  std::vector<std::string> formed_members_;  // of the newest formed round, in rank order
  int64_t aborted_ = -1;                     // newest formed round whose members got ABORT
  int resets_ = 0, failures_ = 0;
  bool finishing_ = false;
  bool shutting_down_ = false;
  int exit_code_ = 0;
  std::string final_message_;
  TimePoint kill_at_ = TimePoint::max();     // SIGKILL after the grace period
  TimePoint wait_until_ = TimePoint::max();  // waiting for --min-np until
  TimePoint recovery_start_{};               // when the current recovery was detected
  bool recovering_ = false;
  bool round_broken_ = false;  // a member of the newest round is gone
  bool warned_loopback_ = false;
  bool first_commit_logged_ = true;
  bool started_ = false;                        // round 0 formed
  std::vector<HostSlots> last_listed_;          // the last good host set, as listed
  std::vector<std::string> last_listed_order_;  // every host ever listed, first-seen order
};

}  // namespace elastic::driver::internal
