// The driver: owns membership. It runs discovery, keeps the rendezvous server, launches and watches
// workers, and decides every round (docs/architecture.md, "Policy and driver"; docs/recovery.md).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/status.h"
#include "common/tls.h"
#include "discovery/discovery.h"

namespace elastic::driver {

// What is done with a straggler (--straggler-action; driver/policy_reports.cc).
enum class StragglerAction {
  kWarn,     // named only
  kReplace,  // the next round goes without it, another worker in its place
  kDrop,     // the job shrinks without it
};

inline constexpr StragglerAction kStragglerActions[] = {
    StragglerAction::kWarn, StragglerAction::kReplace, StragglerAction::kDrop};

// Its name on the command line and in the `straggler` event.
inline const char* StragglerActionName(StragglerAction a) {
  switch (a) {
    case StragglerAction::kWarn:
      return "warn";
    case StragglerAction::kReplace:
      return "replace";
    case StragglerAction::kDrop:
      return "drop";
  }
  return "warn";
}

struct DriverOptions {
  bool grpc_bdp_probe = false;  // ELASTIC_GRPC_BDP_PROBE=1 (read by driver/main.cc)
  std::vector<std::string> command;  // the worker program and its arguments
  // Static hosts (-H / --hostfile / localhost), used when there is no discovery script.
  std::vector<discovery::HostSlots> hosts;
  std::string discovery_script;
  Duration discovery_interval = std::chrono::seconds(1);
  Duration discovery_timeout = std::chrono::seconds(10);
  size_t discovery_max_output = 1u << 20;
  int slots_per_host = 1;

  int np = 0;      // size to wait for at start (0: min_np)
  int min_np = 0;  // 0: np
  int max_np = 0;  // 0: no cap beyond the slots
  // Elastic: a failure shrinks the job instead of ending it. On when a discovery script or
  // --min-np is given.
  bool elastic = false;
  Duration elastic_timeout = std::chrono::seconds(600);
  Duration start_timeout = std::chrono::seconds(600);
  Duration rendezvous_timeout = std::chrono::seconds(60);
  // New processes that one change from outside started together (the slots a discovery result
  // added) join together: the first ready one waits up to this long for the others, so the
  // job re-forms once (0: each joins as soon as it is ready). Either way such a change counts
  // as one reset, however many processes it brings (Policy::Replan).
  Duration newcomer_window = std::chrono::seconds(3);
  int reset_limit = -1;   // -1: unlimited
  int max_failures = -1;  // -1: unlimited
  int host_failure_limit = 1;
  Duration cooldown_min{0}, cooldown_max{0};
  // When commits were made but no worker of a new round holds any (every holder died), the
  // job fails with exit 1 ("state lost"), unless this is set: then training starts over from
  // the program's initial state.
  bool start_over_if_state_lost = false;
  // Durable checkpoints (--checkpoint-dir): rank 0 writes the committed state there every
  // `checkpoint_interval`, keeping the `checkpoint_keep` newest; a round in which nobody holds
  // a commit (a new job, or every holder gone) starts from the newest valid one. "": off.
  std::string checkpoint_dir;
  Duration checkpoint_interval = std::chrono::seconds(60);
  int checkpoint_keep = 2;

  int port = 0;
  // --tls: "on" runs mutual TLS on every control connection with the job's own CA
  // (common/tls.h), "off" plain text, "auto" (the default) on when the workers dial the driver
  // beyond loopback. A driver that adopts a job keeps the journal's choice.
  std::string tls = "auto";
  std::string driver_address;  // host workers dial; default: 127.0.0.1 for local jobs
  std::string network_interface;
  std::string backend = "auto";  // ELASTIC_BACKEND: gloo, nccl or auto
  // Ranks of a host allreduce through shared memory (ELASTIC_SHM_ALLREDUCE=0 when off).
  bool shm_allreduce = true;
  // Warm spares (--spares): started, initialised and waiting in Join on free slots; a lost
  // member's place (or a new slot) is taken by one instead of a new process.
  int spares = 0;
  std::string launcher = "ssh";
  int ssh_port = 0;               // 0: ssh's default
  std::string ssh_identity_file;  // "": ssh's default keys
  std::string launcher_template;  // e.g. "ip netns exec {host} sh -c {command}"
  std::string output_dir;
  std::string event_log;
  Duration grace = std::chrono::seconds(5);
  // A formed round that makes no progress (no commit, no collective started) for this long
  // has a hung member: it is named, its
  // stacks dumped, and it is killed. 0: the default, 10x the longest commit interval seen
  // (at least 60 s; 300 s before any is seen); a round's first commit gets twice as long.
  Duration hang_timeout{0};
  // A worker that does not answer the rendezvous server for this long (stopped, hung hard,
  // its host's link gone) is lost: a third goes to the keepalive interval, a third to its
  // timeout, a third to the grace after its Watch stream breaks.
  Duration liveness_timeout = std::chrono::seconds(6);
  // Stragglers (driver/stragglers.h): a member whose compute per step is at least this many
  // times its peers' median throughout a window of `straggler_window` steps (commits) is
  // named (0: no detection). What is done then: `straggler_action`.
  double straggler_factor = 1.5;
  int straggler_window = 20;
  StragglerAction straggler_action = StragglerAction::kWarn;
  // One progress line this often (0: none).
  Duration progress_interval = std::chrono::seconds(30);
  int metrics_port = -1;  // -1: no metrics endpoint; 0: any free port
  // Where the metrics endpoint listens (an IPv4 address): this machine alone by default. It
  // is plain HTTP without the token (docs/security.md).
  std::string metrics_address = "127.0.0.1";
  std::string job_file;   // where `elastic-run status` finds this job ("": the default place)
  // How long a worker whose agent reached this driver trains on without it (the driver was
  // killed, its host lost): it gets this in ELASTIC_DRIVER_TIMEOUT, and exits by itself once
  // the driver has been unreachable for longer. 0: workers exit within seconds of losing the
  // driver, and local ones die with it.
  Duration driver_timeout = std::chrono::seconds(120);
  // A folder of this job's own (--state-dir): the driver keeps its journal there (what it
  // decided, written on every decision) and its workers' output; a driver started again on it
  // while the journal's workers still run adopts them and the job goes on (driver/journal.h).
  // "": no journal.
  std::string state_dir;
  bool fresh = false;  // --fresh: never resume the journal's job; stop its workers, start anew
  // --state-store etcd://HOST:PORT,.../PREFIX: the journal and the job's leadership live in
  // etcd (driver/leadership.h, docs/high-availability.md); "": not.
  std::string state_store;
  // For an etcds:// store (--state-store-ca, -cert, -key, read by driver/main.cc): the CA to
  // trust ("" : the system's) and the client certificate and key etcd asks for.
  TlsIdentity state_store_tls;
  bool standby = false;  // --standby: wait, then take over from the leader when it goes
  int lease_ttl = 5;     // --lease-ttl, seconds: how long a silent leader still leads
  // --drivers: the leader keeps drivers - 1 standbys waiting on other hosts of the job
  // (driver/placement.h); 1: none.
  int drivers = 1;
  // The command line as given, kept in the journal: a driver started on the folder with
  // another command line does not adopt its workers.
  std::vector<std::string> argv;
};

// Runs the job to its end and returns the process exit code: 0 success; the first failing
// worker's code (non-elastic); 1 for job-level failures (reset limit, timeout, no hosts);
// 128+signal when stopped by SIGINT/SIGTERM. The caller must have blocked SIGINT, SIGTERM
// and SIGCHLD in every thread (BlockDriverSignals) before any thread was started.
int RunDriver(const DriverOptions& options);

void BlockDriverSignals();

}  // namespace elastic::driver
