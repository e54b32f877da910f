// --drivers N (docs/high-availability.md): the driver that leads a job in etcd keeps N - 1
// standbys waiting on hosts of the job other than its own, started through the same launcher
// as the workers (ssh, or --launcher-template). A standby it starts is detached from the
// launch (a session of its own, its output in a file of its --state-dir), so it outlives the
// leader that started it, which is the point. Standbys are counted by their listings in etcd
// (driver/leadership.h): one started by hand counts too, and a leader that took over counts
// the others and places what is missing.
#pragma once

#include <condition_variable>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "common/mutex.h"
#include "common/status.h"
#include "driver/leadership.h"

namespace elastic::driver {

inline constexpr int kMaxDrivers = 9;  // --drivers: the leader and up to 8 standbys

// Where to place standbys now: up to `wanted` of `job_hosts` (in their order, each once) that
// are not `own` (this driver's address, without its port), not loopback (a standby beside the
// leader outlives neither its host nor its machine), hold no standby (`standby_addresses`),
// and are not in `skip` (a launch there in flight, or one that failed lately).
std::vector<std::string> ChooseStandbyHosts(const std::vector<std::string>& job_hosts,
                                            const std::string& own,
                                            const std::set<std::string>& standby_addresses,
                                            const std::set<std::string>& skip, int wanted);

// The command line of a standby placed on `host` (without the program's path): the leader's
// own (`argv`, whose last `command_size` words are the worker's command, left alone) with
// --standby and `--driver-address host` first, and without what is this machine's or this
// start's alone: --driver-address, --job-file, --fresh, and the files of etcd's credentials
// (the standby gets those on its stdin, as the workers do).
std::vector<std::string> StandbyArgv(const std::vector<std::string>& argv, size_t command_size,
                                     const std::string& host);

// The file of `state_dir` a standby placed on `host` writes its output to (and, once it leads,
// the workers' lines): STATE_DIR/driver-HOST.log, the host's name made safe for a file name.
std::string StandbyLogPath(const std::string& state_dir, const std::string& host);

// The /bin/sh script the launcher runs on the host: it reads etcd's credentials from its
// stdin's first line (empty: none; ELASTIC_STATE_STORE_TLS, common/tls.h), goes to `cwd`,
// sets `env` (the leader's own settings that are no secret: ELASTIC_LOG_LEVEL, ...),
// makes `state_dir` (0700), starts `program` with `args` in a session of its own (setsid)
// with /dev/null as its stdin and its output appended to the log (StandbyLogPath), waits
// until it is in that session (the launcher's group may be killed once it exits), prints
// "elastic-standby: PID" and exits, leaving it running; one that exited at once is an
// error with the end of its log. Linux hosts (/proc).
std::string StandbyScript(const std::string& cwd, const std::string& program,
                          const std::vector<std::string>& args, const std::string& state_dir,
                          const std::string& log,
                          const std::map<std::string, std::string>& env = {});

// The /bin/sh script that stops a standby a launch started (StandbyScript) on its host: pid
// `pid`, if it still runs elastic-run with --standby (a pid that was reused is left alone).
std::string StopStandbyScript(int64_t pid);

// Whether `host` names this machine: loopback, or a name or address that resolves to an
// address of one of its interfaces. Looks names up (getaddrinfo): not for the driver's loop.
bool IsThisMachine(const std::string& host);

// The standby's pid from the script's output; INVALID_ARGUMENT when no line says it.
StatusOr<int64_t> ParseStandbyPid(const std::string& output);

// Runs a launcher (`argv`, `stdin_data` on its stdin) to its end: its output, stdout and
// stderr together, at most 64 KiB; DEADLINE_EXCEEDED (its group killed) past `deadline` or
// when `stop` says so; UNAVAILABLE with the output when it exits with another code than 0.
StatusOr<std::string> RunLauncher(const std::vector<std::string>& argv,
                                  const std::string& stdin_data, Duration deadline,
                                  const std::function<bool()>& stop);

// The loop that keeps the standbys, on a thread of its own (it waits on etcd and on
// launchers, never on the driver's loop).
class StandbyPlacer {
 public:
  static constexpr std::chrono::seconds kLaunchDeadline{30};  // ssh's own connection included
  struct Options {
    int drivers = 1;               // --drivers: the leader and its standbys
    int ttl_seconds = 5;           // --lease-ttl: how often to look (twice a TTL)
    std::string own_address;       // this driver's, without the port
    std::string log_dir;           // where placed standbys log (--state-dir), for messages
    std::function<StatusOr<std::vector<StandbyView>>()> list;
    // Told what each look found (the standbys that wait), for `elastic-run status`.
    std::function<void(const std::vector<StandbyView>&)> counted;
    // Starts a standby on the host; its pid.
    std::function<StatusOr<int64_t>(const std::string& host, const std::function<bool()>& stop)>
        launch;
    // Stops the standby a launch started on the host (pid there) that never listed itself.
    std::function<Status(const std::string& host, int64_t pid, const std::function<bool()>& stop)>
        stop;
    // Whether a host of the job is this machine (another name or address of it).
    std::function<bool(const std::string& host)> is_this_machine;
    // How long a standby started has to list itself before it is stopped and its host passed
    // over; the first pass-over (doubled at each failure in a row on the host, 16x at most).
    Duration listing_deadline = std::chrono::seconds(30);
    Duration back_off = std::chrono::seconds(60);
  };
  explicit StandbyPlacer(Options options);
  ~StandbyPlacer();  // stops the thread (a launch in flight is killed) and joins it

  // The job's hosts now, in the order to prefer them (called by the driver's loop).
  void SetHosts(std::vector<std::string> hosts);

 private:
  void Run();
  void Turn();
  bool Stopping();

  Options options_;
  Mutex mu_;
  std::condition_variable cv_;
  bool stop_ ELASTIC_GUARDED_BY(mu_) = false;
  std::vector<std::string> hosts_ ELASTIC_GUARDED_BY(mu_);
  // The placer thread's alone: a host's launch waiting for its listing, the hosts passed over
  // after a failure, and what was said last (said once per change).
  struct Launched {
    TimePoint at;
    int64_t pid = 0;
  };
  struct Failed {
    TimePoint until;
    int count = 0;  // in a row
  };
  std::map<std::string, Launched> launched_;
  std::map<std::string, Failed> failed_;
  std::string said_;
  std::thread thread_;
};

}  // namespace elastic::driver
