// elastic-run: the command line. All CLI11 parsing lives in this one translation unit.
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <tuple>
#include <set>
#include <sstream>

#include "common/etcd.h"
#include "common/logging.h"
#include "common/process.h"
#include "driver/driver.h"
#include "driver/launch.h"
#include "driver/monitor.h"
#include "driver/placement.h"
#include "state/checkpoint.h"

namespace {

constexpr const char* kVersion = "0.1.0";

constexpr const char* kExamples = R"(
Subcommands:
  elastic-run status [--job-file F] [--json]   what a running job is doing
  elastic-run credentials --out DIR            a running job's token and TLS client files

Examples:
  # 4 workers on this machine
  elastic-run -np 4 python3 train.py

  # a fixed job on two hosts (over ssh), 4 slots each
  elastic-run -np 8 -H node1:4,node2:4 ./train

  # elastic: between 2 and 8 workers, on whatever hosts discover.sh prints (host:slots lines)
  elastic-run --min-np 2 --max-np 8 --host-discovery-script ./discover.sh python3 train.py

  # hosts in network namespaces (or kubectl exec, srun ...) instead of ssh
  elastic-run -np 2 -H ns1:1,ns2:1 --launcher-template 'ip netns exec {host} sh -c {command}' ./train

Exit status: 0 when every worker finished; a failed worker's status when the job is not
elastic; 1 when the job failed (reset limit, --min-np timeout, no hosts); 2 for bad arguments;
127 when the command cannot be found; 128+N when stopped by signal N.
)";

// CLI11's own range checks print the whole range of a double; these say what is wanted.
CLI::Validator NumberCheck(bool zero_ok) {
  return CLI::Validator(
      [zero_ok](std::string& value) -> std::string {
        char* end = nullptr;
        double v = std::strtod(value.c_str(), &end);
        if (value.empty() || *end != '\0') return "'" + value + "' is not a number";
        if (v < 0 || (!zero_ok && v == 0)) {
          return std::string("must be ") + (zero_ok ? "0 or more" : "above 0") + " (got " +
                 value + ")";
        }
        return "";
      },
      zero_ok ? "NUMBER>=0" : "NUMBER>0");
}
const CLI::Validator kPositive = NumberCheck(false);
const CLI::Validator kNonNegative = NumberCheck(true);

}  // namespace

// A subcommand's command line: its options and --job-file (the job it asks about) parsed from
// argv after the subcommand's name, then `run`. The exit code: `run`'s, 0 after --help, 2 for
// bad arguments.
int RunSubcommand(CLI::App& app, std::string& job_file, int argc, char** argv,
                  const std::function<int()>& run) {
  app.add_option("--job-file", job_file,
                 "The job file the driver wrote (default: the only running job's, under "
                 "$XDG_RUNTIME_DIR/elastic-run/ or /tmp/elastic-run-<uid>/)");
  try {
    app.parse(argc - 1, argv + 1);
  } catch (const CLI::ParseError& e) {
    int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  return run();
}

// `elastic-run status [--job-file F] [--json]`
int StatusMain(int argc, char** argv) {
  CLI::App app{
      "elastic-run status: what a running elastic-run job is doing (round, members, their\n"
      "steps, blacklisted hosts, recent recoveries), asked from its driver."};
  std::string job_file;
  bool json = false;
  app.add_flag("--json", json, "Print the driver's JSON document instead of a table");
  return RunSubcommand(app, job_file, argc, argv,
                       [&] { return elastic::driver::RunStatusCommand(job_file, json); });
}

// `elastic-run credentials [--job-file F] --out DIR`
int CredentialsMain(int argc, char** argv) {
  CLI::App app{
      "elastic-run credentials: writes what a client of a running job's driver presents (the\n"
      "job token; with TLS the job's CA, a client certificate and its key), e.g. for a\n"
      "Prometheus that scrapes a --metrics-address beyond loopback."};
  std::string job_file, out;
  app.add_option("--out", out, "Folder to write token, ca.pem, client.pem, client.key to")
      ->required();
  return RunSubcommand(app, job_file, argc, argv, [&] {
    return elastic::driver::RunCredentialsCommand(job_file, out);
  });
}

namespace {

using elastic::FromSeconds;
using elastic::Status;
using elastic::driver::DriverOptions;
using elastic::driver::StragglerAction;
using elastic::driver::StragglerActionName;

// The command line: DriverOptions, and what is checked or converted before it goes there (the
// sizes, the host sources, seconds as numbers).
struct CommandLine {
  DriverOptions o;
  int np = 0, min_np = 0, max_np = 0;
  std::string host_list, hostfile, log_level;
  std::string store_ca, store_cert, store_key;  // --state-store-ca, -cert, -key (paths)
  std::string straggler_action = "warn";        // o.straggler_action by its name
  bool verbose = false, no_shm = false;
  double discovery_interval = 1, discovery_timeout = 10, elastic_timeout = 600, start_timeout = 600,
         rendezvous_timeout = 60, grace = 5, hang_timeout = 0, liveness_timeout = 6,
         progress_interval = 30, driver_timeout = 120, checkpoint_interval = 60,
         newcomer_window = 3;
  std::vector<double> cooldown;
  std::vector<std::string> command_help;  // only for --help: the command is split off first
  bool raise_priority = true;             // ELASTIC_DRIVER_NICE (1)
};

Status Refuse(const std::string& message) { return elastic::InvalidArgument(message); }

// How many workers, and on which hosts.
void AddSizeAndHostOptions(CLI::App& app, CommandLine& c) {
  DriverOptions& o = c.o;
  app.add_option("-n,--np,--num-proc", c.np, "Number of workers to start (and wait for at start)");
  app.add_option("--min-np", c.min_np,
                 "Fewest workers to keep training with (makes the job elastic)");
  app.add_option("--max-np", c.max_np, "Most workers to run at once");
  app.add_option("-H,--hosts", c.host_list, "Static hosts: host[:slots],... (default localhost)");
  app.add_option("--hostfile", c.hostfile, "File of host[:slots] lines, like discovery output");
  app.add_option("--host-discovery-script", o.discovery_script,
                 "Script printing the current hosts, one host[:slots] per line (elastic)");
  app.add_option("--discovery-interval", c.discovery_interval, "Seconds between discovery runs")
      ->check(kPositive);
  app.add_option("--discovery-timeout", c.discovery_timeout,
                 "Seconds before a discovery run is killed")
      ->check(kPositive);
  app.add_option("--slots-per-host", o.slots_per_host, "Slots of a host listed without a count")
      ->check(CLI::Range(1, 4096));
  app.add_option("--elastic-timeout", c.elastic_timeout,
                 "Seconds to wait for hosts when below --min-np before failing")
      ->check(kPositive);
  app.add_option("--start-timeout", c.start_timeout, "Seconds to wait for -np workers at start")
      ->check(kPositive);
  app.add_option("--rendezvous-timeout", c.rendezvous_timeout,
                 "Seconds a round waits for its members to join before dropping the missing")
      ->check(kPositive);
  app.add_option("--newcomer-window", c.newcomer_window,
                 "Seconds the first ready one of the new workers that one change started "
                 "together (slots a discovery result added) waits for the others, so that the "
                 "job re-forms once with all of them (3; 0: each joins when ready; at most 60). "
                 "One such change is one reset for --reset-limit either way")
      ->check(CLI::Range(0.0, 60.0));
}

// Failure budgets, the blacklist, stragglers, hangs, liveness.
void AddFailureOptions(CLI::App& app, CommandLine& c) {
  DriverOptions& o = c.o;
  app.add_option("--reset-limit", o.reset_limit, "Most membership changes (resets) allowed")
      ->check(kNonNegative);
  app.add_option("--max-failures", o.max_failures, "Most worker failures allowed")
      ->check(kNonNegative);
  app.add_option("--host-failure-limit", o.host_failure_limit,
                 "Failures after which a host is blacklisted (0: never)")
      ->check(kNonNegative);
  app.add_option("--blacklist-cooldown-range", c.cooldown,
                 "MIN MAX seconds a blacklisted host is kept out (permanent if absent)")
      ->expected(2);
  app.add_option("--straggler-factor", o.straggler_factor,
                 "A member whose compute per step (its time between collectives) is at least "
                 "this many times its peers' median throughout --straggler-window steps is named "
                 "a straggler: a warning, a `straggler` event, `elastic-run status` (1.5; 0: "
                 "off)")
      ->check(CLI::Range(0.0, 1000.0));
  app.add_option("--straggler-window", o.straggler_window,
                 "Steps (commits) a member must be slow throughout to be named a straggler "
                 "(20): one slow step, a pause or a fault is not one")
      ->check(CLI::Range(4, 1000000));
  app.add_option("--straggler-action", c.straggler_action,
                 "What is done with a straggler: warn (name it: the default), replace (the "
                 "next round goes without it, a warm spare or a new worker on a free slot in "
                 "its place; its host counts a failure toward the blacklist) or drop (the job "
                 "shrinks without it, down to --min-np); either only when its estimated gain "
                 "pays for a round change, and at most once a minute")
      ->check(CLI::IsMember([] {
        std::vector<std::string> names;
        for (StragglerAction a : elastic::driver::kStragglerActions) {
          names.push_back(StragglerActionName(a));
        }
        return names;
      }()));
  app.add_option("--hang-timeout", c.hang_timeout,
                 "Seconds a formed round may go without progress (a commit or a collective) "
                 "before the worker holding it up is named, its stacks dumped, and killed "
                 "(default: 10x the longest commit interval seen, at least 60; 300 until one "
                 "is seen)")
      ->check(kPositive);
  app.add_option("--liveness-timeout", c.liveness_timeout,
                 "Seconds a worker may not answer the driver (stopped, link down) before it is "
                 "lost (6; at least 1.5)")
      ->check(kPositive);
  app.add_option("--driver-timeout", c.driver_timeout,
                 "Seconds workers train on while this driver is unreachable (killed, its host "
                 "lost): collectives and commits need no driver, membership changes wait for "
                 "it; past this, every worker exits by itself (120; 0: workers exit within "
                 "seconds of losing the driver, and local ones die with it)")
      ->check(CLI::Range(0.0, 86400.0));
}

// What the job keeps: progress, metrics, the job file, the journal, checkpoints.
void AddStateOptions(CLI::App& app, CommandLine& c) {
  DriverOptions& o = c.o;
  app.add_option("--progress-interval", c.progress_interval,
                 "Seconds between progress lines (world size, step, epoch, samples/s); 0: none")
      ->check(kNonNegative);
  app.add_option("--metrics-port", o.metrics_port,
                 "Serve Prometheus metrics on this port at /metrics (0: any free port; off by "
                 "default)")
      ->check(CLI::Range(0, 65535));
  app.add_option("--metrics-address", o.metrics_address,
                 "IPv4 address the metrics endpoint listens on (default 127.0.0.1: this "
                 "machine alone, plain HTTP; 0.0.0.0: every interface). Beyond loopback it "
                 "is HTTPS with the job's certificate, and asks for a client certificate of "
                 "the job's CA and the job token (needs TLS: `elastic-run credentials` writes "
                 "them; docs/security.md)")
      ->check(CLI::ValidIPV4);
  app.add_option("--job-file", o.job_file,
                 "Where to write the job file `elastic-run status` reads (default: "
                 "$XDG_RUNTIME_DIR/elastic-run/<pid>.json or /tmp/elastic-run-<uid>/<pid>.json)");
  app.add_option("--state-dir", o.state_dir,
                 "A folder of this job's own (created 0700) where the driver keeps a journal of "
                 "what it decided and the workers' output: started again with the same command "
                 "line and folder (by systemd, a Kubernetes Deployment, a Slurm requeue) while "
                 "its workers still train (--driver-timeout), elastic-run adopts them and the "
                 "job goes on where it was; when they are all gone it starts afresh");
  app.add_option("--state-store", o.state_store,
                 "etcd://HOST:PORT[,HOST:PORT...]/PREFIX: keep the journal and the job's "
                 "leadership in etcd (v3) under PREFIX, so that a standby driver on another "
                 "machine (--standby) takes the job over by itself when this one or its machine "
                 "dies; needs --state-dir for this machine's worker output "
                 "(docs/high-availability.md). etcds://...: etcd over TLS");
  app.add_option("--state-store-ca", c.store_ca,
                 "With an etcds:// --state-store: the PEM file of the CA that signed etcd's "
                 "certificate (default: the system's CAs)");
  app.add_option("--state-store-cert", c.store_cert,
                 "With an etcds:// --state-store: the PEM file of the client certificate etcd "
                 "asks for (its --client-cert-auth); with --state-store-key");
  app.add_option("--state-store-key", c.store_key,
                 "With an etcds:// --state-store: the PEM file of that certificate's private key "
                 "(no passphrase); the workers get it as they get the job token");
  app.add_flag("--standby", o.standby,
               "With --state-store: start no job; wait until the driver that leads the job is "
               "gone (its lease runs out), then adopt its workers and lead; exit with the "
               "job's code when it ends under another driver");
  app.add_option("--drivers", o.drivers,
                 "With --state-store: drivers to keep for the job, this one and N-1 standbys "
                 "that it starts (--standby) through the launcher on other hosts of the job, "
                 "one per host, and starts again when one goes; each logs to "
                 "STATE_DIR/driver-HOST.log there (default 1: none; standbys started by hand "
                 "count too)")
      ->check(CLI::Range(1, elastic::driver::kMaxDrivers));
  app.add_option("--lease-ttl", o.lease_ttl,
                 "With --state-store: seconds a leading driver that stopped renewing its lease "
                 "(dead, paused, cut off from etcd) still leads; a standby takes over after it")
      ->check(CLI::Range(2, 300));
  app.add_flag("--fresh", o.fresh,
               "With --state-dir: do not resume the journal's job; its workers still running "
               "are stopped and the job starts afresh");
  app.add_flag("--start-over-if-state-lost", o.start_over_if_state_lost,
               "When every worker holding a commit is gone, train again from the initial state "
               "instead of failing the job (exit 1)");
  app.add_option("--checkpoint-dir", o.checkpoint_dir,
                 "Write durable checkpoints of the committed state here (rank 0, off the "
                 "training thread) and start from the newest valid one when no worker holds a "
                 "commit: a restarted job, or every holder lost. One job per folder (a lock); "
                 "on several hosts, a folder every host mounts. Layout: docs/checkpoints.md");
  app.add_option("--checkpoint-interval", c.checkpoint_interval,
                 "Seconds between two checkpoints (60); one due while the last is still being "
                 "written is skipped")
      ->check(CLI::Range(0.001, 1e7));
  app.add_option("--checkpoint-keep", o.checkpoint_keep,
                 "How many of the newest checkpoints to keep (2)")
      ->check(CLI::Range(1, 1000));
}

// How workers start and reach the driver and one another; output and logs.
void AddLaunchOptions(CLI::App& app, CommandLine& c) {
  DriverOptions& o = c.o;
  app.add_option("--port", o.port, "Port of the rendezvous server (0: any free port)")
      ->check(CLI::Range(0, 65535));
  app.add_option("--driver-address", o.driver_address,
                 "Address workers use to reach this driver (default: 127.0.0.1 for local jobs)");
  app.add_option("--tls", o.tls,
                 "Mutual TLS on every connection between the workers and the driver, with a CA "
                 "made for this job alone (workers get its credentials as they get the job "
                 "token, never on a command line): on, off, or auto (default: on when the "
                 "workers dial the driver beyond loopback)")
      ->check(CLI::IsMember({"auto", "on", "off"}));
  app.add_option("--network-interface", o.network_interface,
                 "Interface the workers' collectives bind to (ELASTIC_IFACE)");
  app.add_option("--backend", o.backend,
                 "Collectives on CUDA tensors: nccl, gloo, or auto (default: NCCL in workers "
                 "that see a CUDA device, else Gloo). Gloo always carries the CPU traffic "
                 "(ELASTIC_BACKEND)")
      ->check(CLI::IsMember({"auto", "gloo", "nccl"}));
  app.add_option("--spares", o.spares,
                 "Warm spares: start K more workers on free slots that initialise and wait; "
                 "a lost worker's place (or a new slot) is taken by a spare instead of a new "
                 "process, and another spare starts. Spares count against the hosts' slots "
                 "(the default localhost gets -np + K). Elastic jobs only")
      ->check(CLI::Range(0, 1024));
  app.add_flag("--no-shm-allreduce", c.no_shm,
               "Allreduce over Gloo's TCP ring alone, even between ranks of one host (default: "
               "the ranks of a host reduce through shared memory and one rank per host joins "
               "the cross-host ring; also $ELASTIC_SHM_ALLREDUCE=0)");
  app.add_option("--launcher", o.launcher, "How remote workers start: ssh")
      ->check(CLI::IsMember({"ssh"}));
  app.add_option("--ssh-port", o.ssh_port, "Port of the hosts' sshd (ssh launcher)")
      ->check(CLI::Range(1, 65535));
  app.add_option("--ssh-identity-file", o.ssh_identity_file, "Private key for ssh (ssh launcher)")
      ->check(CLI::ExistingFile);
  app.add_option(
      "--launcher-template", o.launcher_template,
      "Command that runs {command} on {host}, passing stdin through (the job token comes on "
      "it), e.g. 'kubectl exec -i {host} -- sh -c {command}'");
  app.add_option("--output-dir", o.output_dir,
                 "Keep each slot's stdout/stderr under this folder (<slot>/stdout, "
                 "<slot>/stderr; local workers write them, and go on when the driver is gone). "
                 "Default: a spool folder beside the job file, removed when the job ends");
  app.add_option("--event-log", o.event_log, "Append one JSON line per driver event to this file");
  app.add_option("--grace-period", c.grace, "Seconds between SIGTERM and SIGKILL when stopping")
      ->check(kNonNegative);
  app.add_option("--log-level", c.log_level,
                 "trace, debug, info, warn, error (or $ELASTIC_LOG_LEVEL)");
  app.add_flag("-v,--verbose", c.verbose, "Same as --log-level debug");
  app.add_option("command", c.command_help,
                 "The worker program and its arguments (everything after the options)");
}

// Splits argv into our options (returned, reversed as CLI11 parses them) and the worker
// command. The command starts at the first word that is neither an option nor an option's
// value (or after `--`), so the command's own flags are never mistaken for ours. CLI11 takes
// no multi-letter single-dash names, so mpirun's `-np` is spelled `--np` for it.
std::vector<std::string> SplitCommand(const CLI::App& app, int argc, char** argv,
                                      std::vector<std::string>* command) {
  static const std::set<std::string> kFlags = {"-h", "--help", "--version"};
  std::vector<std::string> args;
  int i = 1;
  for (; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--") {
      ++i;
      break;
    }
    if (a.empty() || a[0] != '-') break;
    args.push_back(a == "-np" ? "--np" : a);
    if (kFlags.count(a) || a.find('=') != std::string::npos) continue;
    const CLI::Option* opt = app.get_option_no_throw(a == "-np" ? "--np" : a);
    if (opt == nullptr) continue;                // CLI11 reports it
    int values = opt->get_items_expected_max();  // 0 for a flag
    for (int k = 0; k < values && i + 1 < argc; ++k) args.push_back(argv[++i]);
  }
  for (; i < argc; ++i) command->push_back(argv[i]);
  std::reverse(args.begin(), args.end());
  return args;
}

// The driver's own environment, read here and nowhere else (the workers' is read by
// worker_agent/worker_options.cc). --log-level and -v come before ELASTIC_LOG_LEVEL.
void ReadDriverEnvironment(CommandLine& c) {
  if (c.no_shm || elastic::Env("ELASTIC_SHM_ALLREDUCE") == "0") c.o.shm_allreduce = false;
  c.o.grpc_bdp_probe = elastic::Env("ELASTIC_GRPC_BDP_PROBE") == "1";
  if (c.log_level.empty()) c.log_level = c.verbose ? "debug" : elastic::Env("ELASTIC_LOG_LEVEL");
  c.raise_priority = elastic::Env("ELASTIC_DRIVER_NICE") != "0";
}

// The driver runs 10 nice levels above its workers where it may, so that its reaction to a
// failure does not wait behind them for a time slice on a machine they keep busy. Before any
// thread starts (they inherit it).
void RaisePriority() {
  auto raised = elastic::RaiseOwnPriority(10);
  if (raised.ok()) {
    spdlog::debug("driver nice value {} (workers keep the one it was started with)", *raised);
  } else {
    spdlog::debug("driver priority unchanged: {}", raised.status().message());
  }
}

// The host source (-H, --hostfile, a discovery script, or localhost), and the hosts of the
// static ones.
Status ResolveHosts(const CLI::App& app, CommandLine& c) {
  DriverOptions& o = c.o;
  int sources = !c.host_list.empty() + !c.hostfile.empty() + !o.discovery_script.empty();
  if (sources > 1) return Refuse("give only one of -H, --hostfile and --host-discovery-script");
  if (app.count("--hosts") && c.host_list.empty()) return Refuse("-H: the host list is empty");
  if (app.count("--host-discovery-script") && o.discovery_script.empty())
    return Refuse("--host-discovery-script: no script given");
  if (!o.discovery_script.empty() &&
      o.discovery_script.find_first_of(" \t;|&$<>") == std::string::npos &&
      access(o.discovery_script.c_str(), X_OK) != 0) {
    return Refuse("--host-discovery-script " + o.discovery_script + ": " + strerror(errno) +
                  " (give the path of an executable script, or a shell command with arguments)");
  }
  if (!c.host_list.empty()) {
    auto hosts = elastic::discovery::ParseHostList(c.host_list, o.slots_per_host);
    if (!hosts.ok()) return Refuse("-H: " + hosts.status().message());
    o.hosts = *hosts;
  } else if (!c.hostfile.empty()) {
    std::ifstream f(c.hostfile);
    if (!f) return Refuse("cannot read --hostfile '" + c.hostfile + "'");
    std::stringstream ss;
    ss << f.rdbuf();
    auto hosts = elastic::discovery::ParseHostLines(ss.str(), o.slots_per_host, nullptr);
    if (!hosts.ok()) return Refuse("--hostfile " + c.hostfile + ": " + hosts.status().message());
    if (hosts->empty()) return Refuse("--hostfile " + c.hostfile + " lists no hosts");
    o.hosts = *hosts;
  } else if (o.discovery_script.empty()) {
    const int np = c.np > 0 ? c.np : (c.max_np > 0 ? c.max_np : (c.min_np > 0 ? c.min_np : 1));
    o.hosts = {{"localhost", np + o.spares}};
  }
  return Status::Ok();
}

// -np, --min-np and --max-np against one another and the hosts' slots; what needs an elastic
// job.
Status ResolveSizes(const CLI::App& app, CommandLine& c) {
  DriverOptions& o = c.o;
  o.elastic = !o.discovery_script.empty() || app.count("--min-np") > 0;
  if (o.spares > 0 && !o.elastic) {
    return Refuse(
        "--spares needs an elastic job (--min-np or --host-discovery-script): a "
        "fixed-size job ends at its first failure, so a spare would never be used");
  }
  for (StragglerAction a : elastic::driver::kStragglerActions) {
    if (c.straggler_action == StragglerActionName(a)) o.straggler_action = a;
  }
  if (o.straggler_action != StragglerAction::kWarn && !o.elastic) {
    return Refuse(std::string("--straggler-action ") + StragglerActionName(o.straggler_action) +
                  " needs an elastic job (--min-np or --host-discovery-script): a fixed-size "
                  "job cannot go on without a worker");
  }
  int total = 0;
  for (const auto& h : o.hosts) total += h.slots;
  o.np = c.np > 0 ? c.np : (c.min_np > 0 ? c.min_np : total);
  o.min_np = c.min_np > 0 ? c.min_np : o.np;
  o.max_np = c.max_np > 0 ? c.max_np : (o.elastic ? 0 : o.np);
  if (o.np < 1) return Refuse("nothing to run: give -np or --min-np with a discovery script");
  if (o.min_np > o.np) {
    return Refuse("--min-np (" + std::to_string(o.min_np) + ") is above -np (" +
                  std::to_string(o.np) + "): the job would start below its minimum");
  }
  // Checked before -np against --max-np: without -np, -np is --min-np, and the user should
  // hear about the two numbers they gave.
  if (o.max_np > 0 && o.min_np > o.max_np) {
    return Refuse("--min-np (" + std::to_string(o.min_np) + ") is above --max-np (" +
                  std::to_string(o.max_np) + ")");
  }
  if (o.max_np > 0 && o.np > o.max_np) {
    return Refuse("-np (" + std::to_string(o.np) + ") is above --max-np (" +
                  std::to_string(o.max_np) + ")");
  }
  if (o.discovery_script.empty() && total < o.np) {
    return Refuse("-np " + std::to_string(o.np) + " needs more slots than the " +
                  std::to_string(total) + " the hosts give");
  }
  return Status::Ok();
}

// The blacklist's cooldown, the addresses and template, and every number of seconds.
Status ResolveTimes(const CLI::App& app, CommandLine& c) {
  DriverOptions& o = c.o;
  if (!c.cooldown.empty()) {
    if (c.cooldown[0] < 0 || c.cooldown[1] < c.cooldown[0]) {
      return Refuse("--blacklist-cooldown-range needs 0 <= MIN <= MAX");
    }
    o.cooldown_min = FromSeconds(c.cooldown[0]);
    o.cooldown_max = FromSeconds(c.cooldown[1]);
  }
  if (app.count("--driver-address")) {
    RETURN_IF_ERROR(elastic::driver::CheckDriverAddress(o.driver_address));
  }
  if (app.count("--launcher-template")) {
    RETURN_IF_ERROR(elastic::driver::CheckTemplate(o.launcher_template));
  }
  o.discovery_interval = FromSeconds(c.discovery_interval);
  o.discovery_timeout = FromSeconds(c.discovery_timeout);
  o.elastic_timeout = FromSeconds(c.elastic_timeout);
  o.start_timeout = FromSeconds(c.start_timeout);
  o.rendezvous_timeout = FromSeconds(c.rendezvous_timeout);
  o.newcomer_window = FromSeconds(c.newcomer_window);
  o.grace = FromSeconds(c.grace);
  if (c.liveness_timeout < 1.5) return Refuse("--liveness-timeout must be at least 1.5 s");
  if (o.straggler_factor > 0 && o.straggler_factor <= 1) {
    return Refuse(
        "--straggler-factor must be above 1 (or 0: off); 1.5 names a member that "
        "computes half again as long as its peers");
  }
  o.liveness_timeout = FromSeconds(c.liveness_timeout);
  o.hang_timeout = FromSeconds(c.hang_timeout);
  o.progress_interval = FromSeconds(c.progress_interval);
  o.driver_timeout = FromSeconds(c.driver_timeout);
  o.checkpoint_interval = FromSeconds(c.checkpoint_interval);
  return Status::Ok();
}

// --state-store-ca, -cert and -key: read (bounded), for an etcds:// store only.
Status ReadStoreCredentials(const elastic::EtcdUrl& url, CommandLine& c) {
  const bool any = !c.store_ca.empty() || !c.store_cert.empty() || !c.store_key.empty();
  if (any && !url.secure) {
    return Refuse("--state-store-ca, --state-store-cert and --state-store-key are for etcd over "
                  "TLS: give an etcds:// --state-store");
  }
  if (c.store_cert.empty() != c.store_key.empty()) {
    return Refuse("--state-store-cert and --state-store-key go together");
  }
  // A standby that a leader started (--drivers) gets them in its environment instead, from
  // its launcher's stdin (driver/placement.h), as the workers do: never on a command line.
  // Read once and gone from the environment, whoever this driver is: its children (a
  // launcher template, the discovery script) never inherit a private key.
  const std::string given = elastic::Env("ELASTIC_STATE_STORE_TLS");
  unsetenv("ELASTIC_STATE_STORE_TLS");
  if (!given.empty() && !any && c.o.standby) {
    if (!url.secure) return elastic::Status::Ok();
    auto id = elastic::DecodeTlsIdentity(given);
    if (!id.ok()) return Refuse("ELASTIC_STATE_STORE_TLS: " + id.status().message());
    c.o.state_store_tls = *id;
    return elastic::Status::Ok();
  }
  constexpr size_t kMaxPem = 64 << 10;
  for (auto [option, path, out] :
       {std::tuple<const char*, const std::string*, std::string*>{
            "--state-store-ca", &c.store_ca, &c.o.state_store_tls.ca},
        {"--state-store-cert", &c.store_cert, &c.o.state_store_tls.cert},
        {"--state-store-key", &c.store_key, &c.o.state_store_tls.key}}) {
    if (path->empty()) continue;
    std::ifstream f(*path, std::ios::binary);
    if (!f) return Refuse(std::string(option) + " " + *path + ": " + strerror(errno));
    std::string text(kMaxPem + 1, '\0');
    f.read(text.data(), static_cast<std::streamsize>(text.size()));
    text.resize(static_cast<size_t>(f.gcount()));
    if (text.size() > kMaxPem) {
      return Refuse(std::string(option) + " " + *path + ": larger than 64 KiB, not a PEM file");
    }
    if (text.find("-----BEGIN ") == std::string::npos) {
      return Refuse(std::string(option) + " " + *path + ": not a PEM file");
    }
    *out = text;
  }
  return elastic::Status::Ok();
}

// --state-dir and --checkpoint-dir: made, locked, and given as full paths (workers elsewhere,
// another cwd or host, get the same folder).
Status PrepareFolders(const CLI::App& app, CommandLine& c) {
  DriverOptions& o = c.o;
  char real[PATH_MAX];
  if (o.fresh && o.state_dir.empty()) return Refuse("--fresh needs --state-dir");
  if ((o.standby || app.count("--lease-ttl") || app.count("--drivers")) &&
      o.state_store.empty()) {
    return Refuse("--standby, --lease-ttl and --drivers need --state-store "
                  "etcd://HOST:PORT/PREFIX");
  }
  if (!o.state_store.empty()) {
    auto url = elastic::ParseEtcdUrl(o.state_store);
    if (!url.ok()) return Refuse(url.status().message());
    RETURN_IF_ERROR(ReadStoreCredentials(*url, c));
    if (o.state_dir.empty()) {
      return Refuse("--state-store needs --state-dir: a folder on this machine for its "
                    "workers' output and exit statuses, which a standby here reads too");
    }
    if (o.standby && o.fresh) return Refuse("--standby adopts a job: it cannot take --fresh");
  }
  if (app.count("--state-dir")) {
    if (o.state_dir.empty()) return Refuse("--state-dir: no folder given");
    if (mkdir(o.state_dir.c_str(), 0700) != 0 && errno != EEXIST) {
      return Refuse("--state-dir " + o.state_dir + ": " + strerror(errno));
    }
    if (realpath(o.state_dir.c_str(), real) == nullptr) {
      return Refuse("--state-dir " + o.state_dir + ": " + strerror(errno));
    }
    o.state_dir = real;
  }
  if ((app.count("--checkpoint-interval") || app.count("--checkpoint-keep")) &&
      o.checkpoint_dir.empty()) {
    return Refuse("--checkpoint-interval and --checkpoint-keep need --checkpoint-dir");
  }
  if (app.count("--checkpoint-dir")) {
    if (o.checkpoint_dir.empty()) return Refuse("--checkpoint-dir: no folder given");
    // Held until this process ends: a second job on the folder is refused. Not by a standby:
    // the folder is its job's, whose leader holds it (one leads at a time, by the store).
    if (!o.standby) {
      auto lock = elastic::LockCheckpointDir(o.checkpoint_dir);
      if (!lock.ok()) return Refuse("--checkpoint-dir: " + lock.status().message());
    }
    if (realpath(o.checkpoint_dir.c_str(), real) == nullptr) {
      return Refuse("--checkpoint-dir " + o.checkpoint_dir + ": " + strerror(errno));
    }
    o.checkpoint_dir = real;
    if (!o.standby) elastic::RemoveUnfinishedCheckpoints(o.checkpoint_dir);
  }
  return Status::Ok();
}

// A local command that does not exist is caught before anything starts.
bool LocalCommandFound(const DriverOptions& o) {
  bool any_local = o.hosts.empty();
  for (const auto& h : o.hosts) {
    if (h.host == "localhost" || h.host == "127.0.0.1") any_local = true;
  }
  if (!any_local || !o.launcher_template.empty()) return true;
  const std::string& prog = o.command[0];
  if (prog.find('/') != std::string::npos) return access(prog.c_str(), X_OK) == 0;
  std::stringstream dirs(elastic::Env("PATH"));
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    if (access((dir + "/" + prog).c_str(), X_OK) == 0) return true;
  }
  return false;
}

int Fail(const std::string& m) {
  std::fprintf(stderr, "elastic-run: %s\nRun with --help for usage.\n", m.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  // A local worker's status keeper (common/process.h): this program, started again by the
  // driver below the worker, with an empty environment.
  if (argc > 1 && std::string(argv[1]) == elastic::kStatusKeeperFlag) {
    return elastic::RunStatusKeeper(argc, argv);
  }
  if (argc > 1 && std::string(argv[1]) == "status") return StatusMain(argc, argv);
  if (argc > 1 && std::string(argv[1]) == "credentials") return CredentialsMain(argc, argv);
  // Before any thread exists: the driver receives these through a signalfd.
  elastic::driver::BlockDriverSignals();

  CLI::App app{
      "elastic-run: an elastic launcher for distributed training.\n"
      "Starts and watches worker processes, re-forms the job when hosts come and go,\n"
      "and keeps training going at whatever size the cluster allows."};
  app.footer(kExamples);
  app.set_version_flag("--version", std::string("elastic-run ") + kVersion);
  app.allow_extras(false);
  CommandLine c;
  AddSizeAndHostOptions(app, c);
  AddFailureOptions(app, c);
  AddStateOptions(app, c);
  AddLaunchOptions(app, c);
  std::vector<std::string> args = SplitCommand(app, argc, argv, &c.o.command);
  try {
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    int code = app.exit(e);  // prints help, version, or the error
    return code == 0 ? 0 : 2;
  }
  if (c.o.command.empty())
    return Fail("no worker command given (e.g. `elastic-run -np 2 ./train`)");
  ReadDriverEnvironment(c);
  auto logging = elastic::InitLogging(c.log_level, "driver");
  if (!logging.ok()) return Fail(logging.message());
  if (c.raise_priority) RaisePriority();
  if (app.count("--np") && c.np < 1)
    return Fail("-np must be at least 1 (got " + std::to_string(c.np) + ")");
  if (app.count("--min-np") && c.min_np < 1) return Fail("--min-np must be at least 1");
  if (app.count("--max-np") && c.max_np < 1) return Fail("--max-np must be at least 1");
  for (auto step : {ResolveHosts, ResolveSizes, ResolveTimes}) {
    if (Status s = step(app, c); !s.ok()) return Fail(s.message());
  }
  if (Status s = PrepareFolders(app, c); !s.ok()) return Fail(s.message());
  // The journal's command line: a standby's is its leader's, less --standby (an option of
  // elastic-run's, before the program's own arguments).
  const int program = argc - static_cast<int>(c.o.command.size());
  for (int i = 1; i < argc; ++i) {
    if (i < program && std::string(argv[i]) == "--standby") continue;
    c.o.argv.push_back(argv[i]);
  }
  if (!LocalCommandFound(c.o)) {
    std::fprintf(stderr, "elastic-run: command not found: %s\n", c.o.command[0].c_str());
    return 127;
  }
  return elastic::driver::RunDriver(c.o);
}
