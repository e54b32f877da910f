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
// --standby and `--driver-address host` first, and without what names this machine alone:
// --driver-address, --job-file, and the files of etcd's credentials (the standby gets those on
// its stdin, as the workers do).
std::vector<std::string> StandbyArgv(const std::vector<std::string>& argv, size_t command_size,
                                     const std::string& host);

// The file of `state_dir` a standby placed on `host` writes its output to (and, once it leads,
// the workers' lines): STATE_DIR/driver-HOST.log, the host's name made safe for a file name.
std::string StandbyLogPath(const std::string& state_dir, const std::string& host);

// The /bin/sh script the launcher runs on the host: it reads etcd's credentials from its
// stdin's first line (empty: none; ELASTIC_STATE_STORE_TLS, common/tls.h), goes to `cwd`,
// makes `state_dir` (0700), starts `program` with `args` in a session of its own (setsid)
// with /dev/null as its stdin and its output appended to the log (StandbyLogPath), waits
// until it is in that session (the launcher's group may be killed once it exits), prints
// "elastic-standby: PID" and exits, leaving it running. Linux hosts (/proc).
std::string StandbyScript(const std::string& cwd, const std::string& program,
                          const std::vector<std::string>& args, const std::string& state_dir,
                          const std::string& log);

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
  // The placer thread's alone: a host's last launch (to wait for its listing, then back off),
  // and what was said last (said once per change).
  std::map<std::string, TimePoint> launched_;
  std::map<std::string, TimePoint> failed_;
  std::string said_;
  std::thread thread_;
};

}  // namespace elastic::driver
