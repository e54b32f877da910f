// The Driver's internals, shared by driver.cc (start-up, launching, carrying out the policy's
// actions), driver_loop.cc (the event loop) and driver_resume.cc (the journal, adopting a job's
// workers). Membership decisions are the Policy's (driver/policy.h). Private to driver/.
#pragma once

#include <poll.h>
#include <unistd.h>

#include <atomic>
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

#include "common/mutex.h"
#include "common/process.h"
#include "driver/driver.h"
#include "driver/event_log.h"
#include "driver/journal.h"
#include "driver/leadership.h"
#include "driver/launch.h"
#include "driver/metrics_http.h"
#include "driver/monitor.h"
#include "driver/output.h"
#include "driver/placement.h"
#include "driver/policy.h"
#include "rendezvous/rendezvous.h"

namespace elastic::driver::internal {

using discovery::HostSlots;

bool IsLocalHost(const std::string& host);

struct Posted {
  enum Kind {
    kRoundFormed,
    kStateLost,
    kJoinTimeout,
    kMemberLeft,
    kReport,
    kWaitingForPlace,
    kWatchOpened,
    kWatchClosed,
    kDiscovery,
    kStacksDumped  // slots: {slot}; text: what the dump printed
  };
  explicit Posted(Kind k, int64_t r = -1) : kind(k), round(r) {}
  Kind kind;
  int64_t round = -1;
  std::vector<std::string> slots;
  rendezvous::Report report;
  std::optional<StatusOr<std::vector<HostSlots>>> hosts;
  std::vector<std::string> warnings;
  rendezvous::FormedRound formed;
  std::string text;
};

// A stack dump in progress: it runs on a thread of its own (it waits for the worker to print
// its own stacks, then for eu-stack or gdb, up to 15 s) and comes back to the loop as a
// kStacksDumped event, so that no exit, report or abort of any other worker waits for it.
struct StackDump {
  std::thread thread;
  std::atomic<bool> stop{false};  // set by the loop: end the dump now (the job is stopping)
  int held_signal = 0;  // a SIGKILL for the slot that came while the dump ran: sent after it
  pid_t pid = 0;
  TimePoint started{};
};

// The process behind a slot. What the job makes of it is the policy's business.
struct Worker {
  std::string slot, host;
  std::unique_ptr<Process> proc;
  bool local = true;
  uint64_t start_ticks = 0;  // of proc (driver/journal.h): the journal names it by pid and this
  std::string worker_id;     // of its launch (ELASTIC_WORKER_ID)
  // A remote worker that writes to files on its host (driver/launch.h): what the first line
  // of its launch's stderr said; remote.dir is "" until then, and for good when the host
  // could not keep its output (then it does not outlive this driver).
  RemoteWorker remote;
  bool header_done = false;        // that line was read (or the stream is not a launch's)
  std::string header;        // stderr of the line being read before that line
  int header_lines = 0;      // lines of stderr before that line (the launcher's own)
  int64_t relayed[3] = {0, 0, 0};  // bytes of stdout (1) and stderr (2) passed on, remote
  bool attached = false;           // proc is an AttachScript to an adopted remote worker
  std::string exit_note;           // how it ended, when proc's own status does not say
};

class Driver : public rendezvous::Listener {
 public:
  explicit Driver(const DriverOptions& o)
      : opts_(o),
        policy_(std::make_unique<Policy>(
            PolicyOptions{o, RealClock(), static_cast<uint64_t>(getpid()), IsLocalHost})),
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
  void OnWaitingForPlace(const std::string& slot) override {
    Posted p{Posted::kWaitingForPlace};
    p.slots = {slot};
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
      MutexLock g(post_mu_);
      if (p.kind == Posted::kReport && posted_.size() >= kMaxPosted) return;
      posted_.push_back(std::move(p));
    }
    uint64_t one = 1;
    ssize_t ignored = write(wake_fd_, &one, sizeof one);
    (void)ignored;
  }
  static constexpr size_t kMaxPosted = 1 << 16;
  // Opens the event log, the output folders, the state folder (adopting its job when its
  // workers still run), the rendezvous core and server; then starts the job or adopts it.
  Status Start();
  // Start's steps: where workers' output goes (files followed through inotify, else pipes);
  // the rendezvous server, listening where the workers dial; the job file and the metrics
  // endpoint (`host`: the address the workers dial).
  Status SetUpOutput();
  // --state-store: leads the job (a standby: waits until it may); sets standby_ended_ when a
  // standby's job ended under another driver.
  Status TakeLeadership();
  // This driver no longer leads (driver/leadership.h): it ends at once, touching no worker,
  // so that only the driver that leads now acts on the job (exit 3).
  [[noreturn]] void LostLeadership(const std::string& why);
  // The journal's job is this command's (driver/journal.h); INVALID_ARGUMENT saying how not.
  // `say`: log the options that differ from the journal's (a store's job), once.
  Status SameJob(const Journal& journal, bool say) const;
  // The journal goes (the file, and the store's while this driver leads).
  void DropJournal();
  // tls_ for the server about to listen on `bind` (--tls; an adopted job's from its journal).
  Status ChooseTls(const std::string& bind);
  Status StartServer(bool all_local);
  Status PublishJob(const std::string& host);
  // The event loop: carries out the policy's actions, polls the signals, the posted events,
  // the workers' output and exits, and feeds what it saw to the policy; returns once the job
  // is shutting down and every process is reaped.
  void Loop();
  // What Loop polls: the signalfd, the wake eventfd, inotify when there is one, then each
  // running worker's pipes (when its output is not in files) and its pidfd.
  struct PollRef {
    enum : int { kNone = 0, kStdout = 1, kStderr = 2, kExit = 3 };
    Worker* w;
    int what;
  };
  struct PollSet {
    std::vector<pollfd> fds;
    std::vector<PollRef> refs;  // one per fd
    size_t first_worker = 0;
  };
  PollSet MakePollSet();
  // A signal from the signalfd, to the policy.
  void ReadSignal();
  // The events other threads posted (Post), handled in order.
  void TakePosted();
  // A worker's pidfd was readable: reaps it (false when it has not ended after all), drains
  // what it wrote last, and gives its exit code (an adopted one's: what its agent said).
  bool ReapWorker(Worker& w, std::vector<char>& buf, int* code);
  // Reads what a worker's pipe (stream 1 or 2) has; at its end, closes it.
  void ReadPipe(Worker& w, int stream, std::vector<char>& buf);
  void HandlePosted(Posted& p);
  // Carries out the policy's actions until it has none left (an action's result may be an
  // event that makes more).
  void Perform();
  // The policy's kSignal: `signal` to the slot's worker (its process group; a remote one is
  // told on its launch's stdin), held back while its stacks are being dumped.
  void SignalWorker(const std::string& slot, int signal);
  // --state-dir: takes the folder, and adopts the job of the journal in it when its workers
  // still run (resume_ is set then); else starts afresh, saying why.
  Status OpenStateDir();
  // Adopts the journal's workers that still run and tells the policy (resume_ is set).
  void Adopt();
  // How an adopted local worker that is gone ended, from its status keeper's record.
  StatusOr<int> AwaitKeptStatus(const JournalWorker& jw);
  // The status keepers' folder and what is in it (the job has ended).
  void RemoveKeptStatuses();
  // Writes the journal (--state-dir) when a decision was made since the last write, or
  // something was heard and a second passed.
  void MaybeWriteJournal();
  // driver_resumed, once every adopted worker re-opened its Watch or the time is up.
  void CheckReattached(bool time_up);
  void Launch(Worker& w, bool spare);
  // The launcher's command line that runs `script` on a remote host (ssh, or
  // --launcher-template).
  std::vector<std::string> LauncherArgv(const std::string& host, const std::string& script) const;
  // Starts an AttachScript to an adopted remote worker (driver/launch.h); false when it could
  // not be started.
  bool AttachRemote(Worker& w, const JournalWorker& jw);
  // Passes on what a worker's pipe gave: a remote launch's header line is taken out of its
  // stderr (Worker::remote), and a remote worker's bytes are counted (the journal's offsets).
  void FeedPipe(Worker& w, int stream, const char* data, size_t n, const std::string& label);
  // What is left of a header that never ended (the launch died first): passed on as output.
  void FlushHeader(Worker& w, const std::string& label);
  // Starts printing the worker's stacks into its stderr lines (eu-stack or gdb; `signal`
  // first, when the worker prints its own on it) on a thread; the text comes back as a
  // kStacksDumped event (StacksDumped). Bounded: 15 s at most.
  void DumpStacks(Worker& w, int signal);
  void StacksDumped(const std::string& slot, const std::string& text);
  // Ends the dumps still running (the job is over) and joins their threads.
  void StopDumps();
  void DiscoveryLoop();
  // --drivers: starts a standby driver on `host` through the launcher (driver/placement.h);
  // its pid there. Runs on the placer's thread: reads only what does not change after Start.
  StatusOr<int64_t> LaunchStandby(const std::string& host, const std::function<bool()>& stop);
  // Prints what local workers wrote to their output files since the last call.
  void FollowFiles(std::vector<char>& buf);

  DriverOptions opts_;
  std::unique_ptr<Policy> policy_;
  OutputMux out_;
  EventLog log_;
  std::string token_, driver_addr_;
  JobCredentials tls_;  // empty: plain text (--tls)
  std::unique_ptr<rendezvous::Core> core_;
  std::unique_ptr<rendezvous::Server> server_;
  int wake_fd_ = -1, signal_fd_ = -1;
  int inotify_fd_ = -1;    // wakes the loop when a local worker writes its output files
  std::string spool_dir_;  // worker output files without --output-dir; removed at the end

  Mutex post_mu_;
  std::deque<Posted> posted_ ELASTIC_GUARDED_BY(post_mu_);

  std::thread discovery_;
  Mutex disc_mu_;
  std::condition_variable disc_cv_;
  bool disc_stop_ ELASTIC_GUARDED_BY(disc_mu_) = false;

  std::map<std::string, Worker> workers_;  // by slot
  std::map<std::string, std::unique_ptr<StackDump>> dumps_;  // by slot; the loop's alone
  bool warned_loopback_ = false;
  Monitor monitor_;
  std::unique_ptr<MetricsServer> metrics_;
  std::string job_file_;  // written at start, removed at the end

  // --state-dir (driver/journal.h).
  int state_lock_fd_ = -1;
  // Where local workers' status keepers record how they ended (common/process.h): the state
  // folder's exits/; "" without --state-dir (a living driver is their parent and knows).
  std::string exits_dir_;
  // Local workers that ended while no driver ran and whose keepers recorded how: the code
  // and its description, for Policy::OnResumed.
  std::map<std::string, std::pair<int, std::string>> ended_at_resume_;
  std::optional<Journal> resume_;  // the journal of the job this driver adopts
  std::unique_ptr<Leadership> leadership_;  // --state-store: while this driver leads
  std::unique_ptr<StandbyPlacer> placer_;   // --drivers > 1: while this driver leads
  std::vector<std::string> placer_hosts_;   // what the placer was told last (the loop's)
  std::optional<Leadership::Ended> standby_ended_;
  std::string bind_;               // where the server listens (kept in the journal)
  int64_t restarts_ = 0;           // drivers that adopted this job before and with this one
  bool journal_due_ = false;       // a decision since the last write
  bool journal_touched_ = false;   // something heard since the last write
  TimePoint journal_written_{};
  std::string journal_error_;               // the last write's error, said once
  std::set<std::string> reattach_pending_;  // adopted workers whose Watch is not back yet
  // Adopted slots whose process ended before it re-attached: a loss, or sent away by this
  // driver (scaled away, leaving) and so none.
  std::vector<std::string> adopted_, lost_at_resume_, left_at_resume_;
  TimePoint resumed_at_{};  // the adoption, until every adopted worker is back or lost
  double outage_seconds_ = 0;
};

}  // namespace elastic::driver::internal
