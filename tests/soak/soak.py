#!/usr/bin/env python3
"""The chaos soak: elastic jobs under random faults, checked against the product's promise.

Runs one job after another until --minutes have passed, each under
    elastic-run --min-np 2 --max-np N --host-discovery-script <a script printing a file>
and injects at random, with a seeded generator:
  kill          SIGKILL of a member
  kill-on-form  a scale change, then SIGKILL of a member the moment the new round forms
                (while it connects its Gloo mesh or syncs the state; rank 0 when another
                member also holds the newest version: a kill during a state sync)
  add, remove   slots added to or removed from the discovery file
  disc-fail, disc-hang, disc-garbage
                the discovery script exits 3, hangs past --discovery-timeout, or prints
                garbage, for a second or two
  leave         SIGUSR1: the worker reports LEAVING and exits 0
  stop          SIGSTOP of a member, never continued: a hung worker the driver must find
                (--liveness-timeout), name and kill
With --overlap, destructive faults no longer wait for the previous recovery (as long as one
holder of the newest commit is left untouched), and these join the mix:
  kill-many     SIGKILL of two or more members at once
  stop-cont     SIGSTOP, then SIGCONT after 0.3-2 s (before the liveness timeout: nothing may
                change) or after 6-9 s (after it: the worker is lost and replaced)
  spare-kill, spare-stop
                SIGKILL or SIGSTOP of a warm spare (--spares) waiting for a place
  newcomer-kill SIGKILL of a newcomer while it starts (a new process for a lost member's slot
                or an added one, which its peers do not wait for)
With --hosts netns, the hosts are three network namespaces on a bridge (tests/soak/hosts.py)
and host faults join: host-kill (every process of a host), link-flap (its link down for
1-4 s), loss (1-10 % of its packets dropped for 1-4 s), cap (a 1-8 Mbit/s bandwidth cap for
1-4 s), partition (cut off from the other hosts, not from the driver, for 1-4 s); two hosts
may be impaired at once, never all three.
--workload python trains examples/train_digits.py (PyTorch, DataLoader(num_workers=2)).
With --checkpoints, every job writes checkpoints (--checkpoint-dir, an interval of 0.5-2 s) and
these join the mix:
  job-kill      SIGKILL of the driver's process group (the driver and every worker at once),
                then the same command started again: it resumes from the newest checkpoint
  kill-all      SIGKILL of every member at once: the state is lost, and the job goes on from
                the newest checkpoint
Every job keeps a --state-dir and one more fault joins (with --hosts netns too: remote workers
ride out a lost driver, and the driver started again attaches to them through the launcher):
  driver-kill   SIGKILL of the driver alone; 0-10 s later the same command again, which must
                adopt the running workers (no worker lost, none started again: the in-place
                check below), the round going on without a rollback
With --standby (local hosts), every job keeps its journal in an etcd the soak starts
(--state-store) and runs a standby driver beside its leader; nobody starts a driver again:
  driver-kill   SIGKILL of the leader; the standby must adopt the running workers by itself
                (the same checks), and a new standby is started beside it
  driver-pause  SIGSTOP of the leader past its lease: the standby must adopt the workers, and
                the old leader, continued, must end by itself with exit 3 (no longer leads)
                without touching a worker
and a standby must end with the job's exit code when the job ends under another driver
(job-kill is left out: the soak would start a driver while the killed one's lease holds).
With --standby --hosts netns the leader and its standby run on two namespace hosts of their own
(etcd on the bridge), and one more fault joins:
  driver-host-kill  every process of the leader's host killed (a power loss): the standby, on
                the other host, must adopt the workers it launched

After each job it checks, with oracles that do not ask the product: exit 0; every sample index
of every epoch consumed by exactly one committed step (the workers' ledgers); no round resuming
further back than one commit interval; the final model the fault-free one (bit for bit for
the C++ example, within 1e-4 for PyTorch); no process left that carries the job's marker in
its environment (a scan of /proc: workers, launchers, DataLoader workers); nothing of the
job's workers left in /dev/shm; every worker that no fault touched kept its process to the end
(recovery in place: its pid never changed); no stall longer than its fault kind's bound, all
below the rendezvous timeout; and while the discovery script misbehaves alone, no membership
change (no round_proposed, host_removed or worker_exited). With --checkpoints: no job ends in
"state lost" (every state_lost is followed by a state_restored); after a job-kill nothing of
the killed run is left (the /proc scan) before the restart; a run resumed from a checkpoint
rolls back at most the steps of one checkpoint interval; the ledgers of all runs together
consume every sample once (a step trained again by a later run supersedes the earlier run's).

    tests/soak/soak.py --minutes 2                 # a fresh seed, printed at the start
    tests/soak/soak.py --minutes 30 --seed 1234    # replay a seed's fault schedule
    tests/soak/soak.py --weight driver-kill=30     # stress one fault kind
    tests/soak/soak.py --workload python --hosts netns --overlap --minutes 10

A seed replays the same choices of faults and targets; their timing against training varies
from run to run. Exits 0 when every job kept the promise, 1 otherwise (the failing job's folder
is kept and named).
"""
import argparse
import atexit
import collections
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "python"))
sys.path.insert(0, str(ROOT / "tests" / "soak"))

import ledger  # noqa: E402
from etcd_server import start_etcd, stop_etcd  # noqa: E402
from helpers import Job, pid_alive, procs_with_marker, run  # noqa: E402
from hosts import Discovery, LocalHosts, NetnsHosts  # noqa: E402
from workloads import CppWorkload, PythonWorkload  # noqa: E402

MARK = "ELASTIC_SOAK_MARK"
WEIGHTS = {"kill": 24, "kill-on-form": 12, "add": 14, "remove": 12, "disc-fail": 8,
           "disc-hang": 5, "disc-garbage": 8, "leave": 10, "stop": 6}
OVERLAP_WEIGHTS = {"kill-many": 10, "stop-cont": 10, "spare-kill": 6, "spare-stop": 4,
                   "newcomer-kill": 6}
CHECKPOINT_WEIGHTS = {"job-kill": 5, "kill-all": 5}
# Local hosts only: remote workers do not ride out a lost driver (docs/recovery.md).
DRIVER_WEIGHTS = {"driver-kill": 6}
STANDBY_WEIGHTS = {"driver-pause": 3}  # --standby
STANDBY_HOST_WEIGHTS = {"driver-host-kill": 4}  # --standby --hosts netns
LEASE_TTL = 3  # --lease-ttl of the soak's jobs with --standby
RESTARTS = {"job-kill", "kill-all"}  # the state is lost on purpose; a checkpoint takes over
MAX_RESTARTS = 2  # of each kind per job: each costs a restart's time
# Faults that take workers away (or may: a host fault can make its workers lost).
DESTRUCTIVE = {"kill", "kill-on-form", "leave", "stop", "kill-many", "stop-cont", "host-kill",
               "link-flap", "loss", "cap", "partition", "job-kill", "kill-all"}
# Without --overlap, these wait for a commit in a round newer than the last one's: they
# certainly take workers away, so the job must have recovered first.
GATED = {"kill", "kill-on-form", "leave", "stop", "kill-many", "host-kill", "job-kill",
         "kill-all", "driver-kill", "driver-pause", "driver-host-kill"}
HOST_FAULTS = {"host-kill", "link-flap", "loss", "cap", "partition"}
LIVENESS = 4  # --liveness-timeout of the soak's jobs
RENDEZVOUS = 30  # --rendezvous-timeout
# The longest training may pause after a fault of each kind (seconds), all below the
# rendezvous timeout. A crash is seen at once; a silent worker within the liveness timeout;
# a PyTorch newcomer needs 1-2 s to import torch before it can take the state.
STALL = {"crash": 10.0, "silent": LIVENESS + 12.0, "network": RENDEZVOUS - 2.0,
         # A restart: the killed job's processes found gone, a new driver, the workers'
         # start (and torch's import), the rendezvous and the checkpoint's load.
         "restart": 20.0,
         # The driver killed and started again: the workers train on meanwhile, but a
         # membership change under way waits for the new driver (up to 10 s) and the
         # re-attach.
         "driver": 20.0,
         # A member stopped when the driver was killed never re-attaches to the driver that
         # adopts the job: it is lost at the rendezvous timeout (docs/recovery.md, "A driver
         # that comes back"), then its peers re-form (seed 923448539, job 3: 33.5 s). Below
         # its status keeper a stopped local worker is no longer ended by the driver's death
         # (its group is not orphaned): every such case now takes the rendezvous timeout,
         # after the new driver's start (the soak's restart delay) and before the re-form
         # (overlap soak, seed 660049395, job 1: 43.5 s).
         "driver-silent": RENDEZVOUS + 20.0}
# Link, loss, cap and partition faults leave every process alive and its driver connection
# up: no failure is seen, and the stall after one is TCP's (the Gloo pairs' retransmissions
# back off exponentially while the link is out: 24 s after a partition was measured). Their
# bound is the rendezvous timeout's, less a margin.
NETWORK = {"link-flap", "loss", "cap", "partition"}
# The processes of a remote launch itself (driver/launch.h), above the worker program.
LAUNCH_PROGRAMS = {"sh", "dash", "bash", "ip", "env", "setsid", "sleep", "tail", "grep", "mktemp"}
SPARE_WARM = 10.0  # seconds after its start a spare is taken to be initialised and waiting
SILENT = {"stop", "stop-cont", "link-flap", "loss", "cap", "partition", "spare-stop"}


class Events:
    """Reads the driver's event log as it grows."""

    def __init__(self, path):
        self.path = path
        self.offset = 0
        self.all = []

    def poll(self):
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            f.seek(self.offset)
            data = f.read()
        complete = data[:data.rfind("\n") + 1]
        self.offset += len(complete.encode())
        new = [json.loads(l) for l in complete.splitlines() if l.strip()]
        self.all.extend(new)
        return new

    def last(self, kind):
        for e in reversed(self.all):
            if e["event"] == kind:
                return e
        return None


def wait_event(ev, kind, proc, timeout):
    """The first new event of this kind in the log, waiting up to timeout seconds while proc
    runs; None when none came. The log is read once more after proc has ended: a driver that
    wrote the event and ended the job at once (its workers had finished during the outage)
    may end between two reads."""
    deadline = time.monotonic() + timeout
    while True:
        running = proc.poll() is None
        found = next((e for e in ev.poll() if e["event"] == kind), None)
        if found is not None or not running or time.monotonic() >= deadline:
            return found
        time.sleep(0.05)


class Fault:
    def __init__(self, kind, targets, pids, host=None):
        self.kind, self.targets, self.pids, self.host = kind, targets, pids, host
        self.at = time.time()
        self.until = self.at  # lasting faults: when they were healed


class JobRun:
    """One job's bookkeeping: its faults, the processes they touched, its events."""

    def __init__(self, soak, seed, folder):
        self.soak = soak
        self.seed = seed
        self.rng = random.Random(seed)
        self.folder = folder
        self.disc = Discovery(folder, soak.hosts.first_slots)
        self.ev = Events(str(folder / "events.jsonl"))
        self.faults = []
        self.hit = set()  # pids a fault touched
        self.hit_hosts = set()
        self.problems = []  # found while the job ran (reported with the oracle's)
        self.removed = set()  # slots ever removed from the discovery file
        self.counts = collections.Counter()
        self.quiet = []  # (start, end) windows in which only the discovery script misbehaved
        self.interval = round(self.rng.uniform(0.5, 2.0), 2)  # --checkpoint-interval
        self.run_start = 0  # index in ev.all where the current run's events begin
        self.boundaries = []  # ms: each killed run's processes were all gone by then
        self.restarts = []  # (start, end) ms: the state lost on purpose (job-kill, kill-all)
        self.leader_host = 0  # --standby --hosts netns: which driver host the leader is on

    def checkpointed(self):
        """A checkpoint was written in the current run (a restart has something to take)."""
        return any(e["event"] == "checkpoint_written" for e in self.ev.all[self.run_start:])

    def pid_of(self, slot):
        starts = [e for e in self.ev.all if e["event"] == "worker_started" and e["slot"] == slot]
        return starts[-1]["pid"] if starts else None

    def worker_pid(self, slot):
        """The worker program's own process: the launched process itself for local slots; for
        a remote slot, the first process under the launcher that is not part of the launch (a
        SIGSTOP of the launcher's shell would stop no worker, only the driver's view of it)."""
        root = self.pid_of(slot)
        if root is None:
            return None
        children = collections.defaultdict(list)
        names = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    text = f.read()
            except OSError:
                continue
            head, _, tail = text.rpartition(")")
            names[int(entry)] = head.partition("(")[2]
            children[int(tail.split()[1])].append(int(entry))
        queue = [root]
        while queue:
            pid = queue.pop(0)
            if names.get(pid) not in LAUNCH_PROGRAMS:
                return pid
            queue.extend(sorted(children.get(pid, [])))
        return None

    def alive(self, slot):
        pid = self.pid_of(slot)
        return pid is not None and pid_alive(pid)

    def spares(self):
        """Slots whose newest process is a warm spare not yet promoted, started at least
        SPARE_WARM seconds ago: initialised and waiting (a process stopped while it starts,
        before it connected to the driver, is a newcomer that never joins: the driver finds
        it only by the rendezvous timeout, a stall this soak does not bound; see
        docs/testing.md)."""
        state, started = {}, {}
        for e in self.ev.all:
            if e["event"] == "worker_started":
                state[e["slot"]] = bool(e.get("spare"))
                started[e["slot"]] = e["ts"]
            elif e["event"] in ("spare_promoted", "newcomer_placed"):
                state[e["slot"]] = False
        return [s for s, spare in state.items()
                if spare and self.alive(s) and time.time() - started[s] >= SPARE_WARM]

    def newcomers(self):
        """Slots whose newest process is a newcomer still starting: started for a place its
        peers do not wait for (newcomer_started), neither ready nor placed yet."""
        state = {}
        for e in self.ev.all:
            if e["event"] == "newcomer_started":
                state[e["slot"]] = "announced"
            elif e["event"] == "worker_started":
                state[e["slot"]] = "starting" if state.get(e["slot"]) == "announced" else None
            elif e["event"] in ("newcomer_ready", "newcomer_placed", "worker_exited"):
                state[e["slot"]] = None
        return [s for s, st in state.items() if st == "starting" and self.alive(s)]

    def in_round(self):
        """Slots of the newest formed round whose process is the one that joined it."""
        formed_at, formed, started_at = None, None, {}
        for i, e in enumerate(self.ev.all):
            if e["event"] == "round_formed":
                formed_at, formed = i, e
            elif e["event"] == "worker_started":
                started_at[e["slot"]] = i
        if formed is None:
            return set()
        return {s for s in formed["members"] if started_at.get(s, -1) < formed_at}

    def holders(self, exclude=()):
        """Members of the newest formed round that committed in it and that no fault touched:
        each holds the newest commit (ranks commit in lockstep)."""
        formed_at, started_at, committed = None, {}, set()
        for i, e in enumerate(self.ev.all):
            if e["event"] == "round_formed":
                formed_at, formed, committed = i, e, set()
            elif e["event"] == "worker_started":
                started_at[e["slot"]] = i
            elif e["event"] == "committed" and formed_at is not None and \
                    e["round"] == formed["round"]:
                committed.add(e["slot"])
        if formed_at is None:
            return []
        out = []
        for s in formed["members"]:
            pid = self.pid_of(s)
            # A process started after the round formed (a relaunch) is not the one that
            # committed there: it holds nothing yet.
            fresh = started_at.get(s, -1) > formed_at
            if (s in committed and not fresh and s not in exclude and pid not in self.hit
                    and self.alive(s) and self.disc.listed(s)):
                out.append(s)
        return out

    def record(self, kind, targets, host=None):
        pids = [self.pid_of(s) for s in targets]
        self.hit.update(p for p in pids if p)
        if host:
            self.hit_hosts.add(host)
        f = Fault(kind, targets, pids, host)
        self.faults.append(f)
        self.counts[kind] += 1
        with open(self.folder / "faults.jsonl", "a") as log:  # for the post-mortem
            log.write(json.dumps({"ts": f.at, "kind": kind, "targets": targets, "pids": pids,
                                  "host": host}) + "\n")
        return f


class Soak:
    def __init__(self, args):
        self.args = args
        self.build = pathlib.Path(args.build_dir)
        self.elastic_run = str(self.build / "driver" / "elastic-run")
        cls = PythonWorkload if args.workload == "python" else CppWorkload
        self.work = cls(self.build, args.epochs, args.step_ms)
        self.hosts = (NetnsHosts(drivers=2 if args.standby else 0) if args.hosts == "netns"
                      else LocalHosts())
        self.weights = dict(WEIGHTS)
        if args.overlap:
            self.weights.update(OVERLAP_WEIGHTS)
        if args.checkpoints:
            self.weights.update(CHECKPOINT_WEIGHTS)
        self.weights.update(self.hosts.faults)
        self.weights.update(DRIVER_WEIGHTS)
        self.etcd = None  # started with the hosts (soak), on their bridge with --hosts netns
        if args.standby:
            self.weights.update(STANDBY_WEIGHTS)
            if self.hosts.driver_hosts:
                self.weights.update(STANDBY_HOST_WEIGHTS)
            # A job killed whole is taken over by its standby (it starts afresh from the
            # newest checkpoint), not started again by the soak: job-kill is not of this mode.
            self.weights.pop("job-kill", None)
        for kind, weight in args.weight:  # a fault kind stressed, or left out with 0
            if kind not in self.weights:
                raise SystemExit(f"soak: --weight {kind}: not a fault of this mode "
                                 f"(its faults: {', '.join(sorted(self.weights))})")
            self.weights[kind] = weight
        self.faults = collections.Counter()
        self.stalls = collections.defaultdict(float)  # fault kind -> longest stall after one
        self.violations = []
        self.jobs = 0

    def baseline(self):
        folder = pathlib.Path(tempfile.mkdtemp(prefix="elastic-soak-baseline-"))
        self.baseline_dir = folder
        rc, out = run([self.elastic_run, "-np", "2"] + self.work.baseline_command(folder),
                      timeout=600)
        want = self.work.baseline(out, folder)
        if rc != 0 or not want:
            raise SystemExit(f"soak: the fault-free run failed (exit {rc}):\n{out[-3000:]}")
        return want

    def driver_host(self, j, standby=False):
        """--standby --hosts netns: the host of the leader (or of its standby), else None."""
        hosts = self.hosts.driver_hosts
        return hosts[(j.leader_host + (1 if standby else 0)) % len(hosts)] if hosts else None

    def job_args(self, j, spares, standby=False):
        store = []
        if self.etcd:
            store = ["--state-store", f"etcd://{self.hosts.store_address}:{self.etcd[0][1]}/"
                     f"soak/{j.folder.name}", "--lease-ttl", str(LEASE_TTL)]
        where = self.driver_host(j, standby)
        return (self.hosts.driver_command(where) + [self.elastic_run] +
                (["--standby"] if standby else []) + store +
                ["--min-np", str(self.work.min_np), "--max-np",
                 str(self.work.max_np), "--spares", str(spares),
                 "--host-discovery-script", str(j.disc.script), "--discovery-interval", "0.5",
                 "--discovery-timeout", "2", "--host-failure-limit", "0",
                 "--liveness-timeout", str(LIVENESS), "--rendezvous-timeout", str(RENDEZVOUS),
                 "--grace-period", "2", "--event-log", str(j.ev.path)]
                + ["--state-dir", str(j.folder / "state")]
                + (["--checkpoint-dir", str(j.folder / "ckpt"), "--checkpoint-interval",
                    str(j.interval)] if self.args.checkpoints else [])
                + self.hosts.launcher_args(where) + self.work.command(j.folder))

    def run_job(self, seed, want, folder):
        j = JobRun(self, seed, folder)
        rng = j.rng
        marker = uuid.uuid4().hex
        env = dict(os.environ)
        env.pop("ELASTIC_TEST_HOOKS", None)
        env[MARK] = marker
        shm_before = set(os.listdir("/dev/shm"))
        # Some jobs keep warm spares: lost members' places are then taken by them.
        spares = rng.choice([0, 0, 1, 2])
        job = Job(self.job_args(j, spares), env=env)
        j.standby = Job(self.job_args(j, spares, True), env=env) if self.etcd else None
        started = time.monotonic()
        gate_round = -1  # a destructive fault waits for a commit in a round newer than this
        stop_pending = False  # the last destructive fault was a SIGSTOP
        restore_at = None  # the discovery script's misbehaviour ends then
        lasting = []  # (heal at, fault): host impairments and stop-cont
        quiet_until = 0  # while the discovery script misbehaves, and a moment after: no fault
        try:
            while job.proc.poll() is None:
                j.ev.poll()
                now = time.monotonic()
                if restore_at and now >= restore_at:
                    j.disc.set_mode("good")
                    restore_at = None
                    quiet_until = now + 1.5  # the next good run sees the hosts as before
                    if j.quiet and j.quiet[-1][1] is None:
                        j.quiet[-1] = (j.quiet[-1][0], time.time())
                for item in [x for x in lasting if now >= x[0]]:
                    lasting.remove(item)
                    self.heal(item[1])
                if now - started > self.args.job_timeout:
                    self.violations.append(f"job {seed}: still running after "
                                           f"{self.args.job_timeout} s")
                    break
                if self.near_end(job):
                    self.heal_all(lasting)
                    time.sleep(0.1)
                    continue
                time.sleep(rng.uniform(*self.args.fault_gap))
                # Again after the pause: epochs can be shorter than it (seed 75897288 killed
                # a worker while the job was finishing, checked only before the pause).
                if self.near_end(job):
                    continue
                j.ev.poll()
                formed = j.ev.last("round_formed")
                if formed is None or restore_at or time.monotonic() < quiet_until:
                    continue
                recovered = any(e["event"] == "committed" and e["round"] > gate_round
                                for e in j.ev.all)
                action = rng.choices(list(self.weights), weights=list(self.weights.values()))[0]
                destructive = action in DESTRUCTIVE
                overlap_ok = self.args.overlap and action not in HOST_FAULTS
                # A removal takes a worker (and the state it holds) away too: while a stopped
                # worker is not yet found (seconds), removing the other holder would lose the
                # state for real (seed 915124613); it waits for the recovery like the others.
                if ((action in GATED or (action == "remove" and stop_pending)) and not recovered
                        and not overlap_ok):
                    continue
                if action.startswith("disc-"):
                    # Alone, long after the last fault ended (a worker stopped or cut off is
                    # lost only after the liveness timeout), so that any membership change
                    # meanwhile is the discovery's fault.
                    last_end = max((max(f.at, f.until or time.time()) for f in j.faults),
                                   default=0)
                    if restore_at or lasting or not recovered or \
                            time.time() - last_end < LIVENESS + 4:
                        continue
                if action in HOST_FAULTS and len([x for x in lasting if x[1].host]) >= \
                        len(self.hosts.names) - 1:
                    continue  # one host at least is never impaired
                if destructive and lasting and not self.args.overlap:
                    continue
                if action in ("driver-kill", "driver-pause", "driver-host-kill"):
                    if j.standby:
                        job = self.take_over(j, job, env, spares, action)
                    else:
                        job = self.kill_driver(j, job, env, spares)
                    continue
                if action == "job-kill":
                    if j.standby:  # the whole job: its standby too, started again after
                        j.standby.kill()
                        j.standby.wait(timeout=30)
                    restarted = self.kill_job(j, job, marker, env, spares)
                    if j.standby and restarted is not None:
                        j.standby = Job(self.job_args(j, spares, True), env=env)
                    if restarted is None:
                        break  # the violation is recorded; `job` is the killed run
                    if restarted is not job:
                        job, gate_round, stop_pending = restarted, -1, False
                    continue
                fault = self.inject(action, j, job, formed)
                if fault is None:
                    continue
                if action in GATED:
                    gate_round = j.ev.last("round_formed")["round"]
                    stop_pending = action == "stop"
                if action.startswith("disc-"):
                    restore_at = time.monotonic() + rng.uniform(1.0, 2.5)
                    j.quiet.append((time.time(), None))
                if fault.until is None:  # lasting: healed later
                    lasting.append((time.monotonic() + fault.duration, fault))
            self.heal_all(lasting)
            j.disc.set_mode("good")
            rc = job.wait(timeout=max(10, self.args.job_timeout - (time.monotonic() - started)))
            if j.standby:
                # The job ended under its leader: the standby ends with the job's code.
                src = j.standby.wait(timeout=30)
                if src != rc:
                    j.problems.append(f"the standby ended with {src}, the job with {rc}: "
                                      + " | ".join(j.standby.lines[-3:]))
        except AssertionError as e:  # Job.wait's timeout
            rc = None
            self.violations.append(f"job {seed}: {str(e)[:200]}")
        finally:
            self.heal_all(lasting)
            if job.proc.poll() is None:
                self.dump_stacks(marker, folder)
            job.kill()
            if j.standby:
                j.standby.kill()
        j.ev.poll()
        (folder / "output.txt").write_text(job.text() + "\n")
        problems = j.problems + self.check(rc, job, want, j, marker, shm_before)
        for p in problems:
            self.violations.append(f"job {seed}: {p}")
        self.faults.update(j.counts)
        self.jobs += 1
        total = sum(j.counts.values())
        promoted = len([e for e in j.ev.all if e["event"] == "spare_promoted"])
        print(f"soak: job {seed}: --spares {spares} ({promoted} used), "
              f"{total} faults {dict(j.counts)}, "
              f"{len([e for e in j.ev.all if e['event'] == 'round_formed'])} rounds, "
              f"exit {rc}, {'OK' if not problems else 'VIOLATIONS: ' + '; '.join(problems)}",
              flush=True)
        # Not a violation, but worth a look: members stuck in a round, aborted out of it by
        # the driver (their stacks are dumped into the output).
        if not problems and "did not leave round" in job.text():
            kept = pathlib.Path(tempfile.mkdtemp(prefix=f"elastic-soak-stuck-{seed}-"))
            shutil.copytree(folder, kept, dirs_exist_ok=True)
            print(f"soak: job {seed}: note: members were stuck in a round and aborted out of "
                  f"it; output with their stacks kept in {kept}", flush=True)
        return not problems

    def kill_driver(self, j, job, env, spares):
        """driver-kill: SIGKILL of the driver alone (its local workers train on without it),
        0-10 s with no driver, then the same command again on the same --state-dir, which
        must adopt the running workers (driver_resumed). Returns the new Job."""
        if j.counts["driver-kill"] >= MAX_RESTARTS:
            return job
        j.ev.poll()
        formed = j.ev.last("round_formed")
        pids = {e["slot"]: e["pid"] for e in j.ev.all if e["event"] == "worker_started"}
        fault = j.record("driver-kill", [])
        os.kill(job.proc.pid, signal.SIGKILL)
        job.proc.wait(timeout=30)
        (j.folder / f"output-driver-{j.counts['driver-kill']}.txt").write_text(job.text() + "\n")
        time.sleep(j.rng.uniform(0.0, 10.0))
        j.ev.poll()
        job = Job(self.job_args(j, spares), env=env)
        resumed = wait_event(j.ev, "driver_resumed", job.proc, RENDEZVOUS + 30)
        fault.until = time.time()
        if resumed is None or not resumed.get("resumed"):
            j.problems.append(f"the driver started again after a driver-kill did not adopt "
                              f"the job: {resumed}")
        else:
            # A process lost across it is a violation, unless a fault had touched it (a
            # stopped one ends with the driver: its process group is orphaned, and the kernel
            # sends it SIGHUP), or it was not in the round and was still starting (it had not
            # reached the driver: it dies with it, as any program that never joined).
            started = {e["slot"]: e["ts"] for e in j.ev.all if e["event"] == "worker_started"}
            def starting(s):  # a process of the slot that is not the round's, started late
                t = started.get(s, 0)
                return ((s not in formed["members"] or t > formed["ts"]) and
                        fault.at - t <= SPARE_WARM)
            wrong = [s for s in resumed["lost"] if pids.get(s) not in j.hit and not starting(s)]
            if wrong:
                j.problems.append(f"workers lost across a driver-kill that touched none: "
                                  f"{wrong}")
        return job

    def take_over(self, j, job, env, spares, action):
        """--standby: driver-kill (SIGKILL of the leader) or driver-pause (SIGSTOP past its
        lease, then SIGCONT): the standby must adopt the running workers by itself; a paused
        leader must then end with exit 3. A new standby is started. Returns the new leader."""
        if j.counts[action] >= MAX_RESTARTS:
            return job
        j.ev.poll()
        formed = j.ev.last("round_formed")
        pids = {e["slot"]: e["pid"] for e in j.ev.all if e["event"] == "worker_started"}
        fault = j.record(action, [])
        if action == "driver-host-kill":
            self.hosts.kill_host(self.driver_host(j))  # every process of the leader's host
        else:
            os.kill(job.proc.pid, signal.SIGSTOP if action == "driver-pause" else signal.SIGKILL)
        leader, job = job, j.standby
        j.leader_host += 1  # the standby's host; the next standby goes on the other one
        resumed = wait_event(j.ev, "driver_resumed", job.proc, LEASE_TTL + RENDEZVOUS + 30)
        if action == "driver-pause":
            os.kill(leader.proc.pid, signal.SIGCONT)
        try:
            code = leader.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            code = None
            leader.kill()
        (j.folder / f"output-driver-{j.counts[action]}-{action}.txt").write_text(
            leader.text() + "\n")
        if action == "driver-pause" and code != 3:
            j.problems.append(f"the paused leader, continued after the standby took over, "
                              f"ended with {code}, not 3 (no longer leads)")
        j.standby = Job(self.job_args(j, spares, True), env=env)
        fault.until = time.time()
        if resumed is None or not resumed.get("resumed"):
            j.problems.append(f"the standby did not adopt the job after a {action}: {resumed}")
            return job
        started = {e["slot"]: e["ts"] for e in j.ev.all if e["event"] == "worker_started"}
        def starting(s):  # as in kill_driver
            t = started.get(s, 0)
            return ((s not in formed["members"] or t > formed["ts"]) and
                    fault.at - t <= SPARE_WARM)
        wrong = [s for s in resumed["lost"] if pids.get(s) not in j.hit and not starting(s)]
        if wrong:
            j.problems.append(f"workers lost across a {action} that touched none: {wrong}")
        return job

    def kill_job(self, j, job, marker, env, spares):
        """job-kill: SIGKILL of the driver's process group, every process of the job found gone
        in /proc, then the same command again. Returns the new Job (the old one when the fault
        does not apply now), or None when the killed job left processes behind."""
        if j.counts["job-kill"] >= MAX_RESTARTS or not j.checkpointed():
            return job
        fault = j.record("job-kill", [])
        # Every process of this run counts as touched (the driver died with them: none of
        # their exits is in its event log).
        j.hit.update(e["pid"] for e in j.ev.all if e["event"] == "worker_started")
        # The driver's tree, and the groups of the workers a driver adopted (after a
        # driver-kill they are no longer its descendants).
        groups = set()
        for e in j.ev.all:
            if e["event"] == "worker_started" and pid_alive(e["pid"]):
                try:
                    groups.add(os.getpgid(e["pid"]))
                except ProcessLookupError:
                    pass
        groups.discard(os.getpgrp())
        job.kill()
        for g in groups:
            try:
                os.killpg(g, signal.SIGKILL)
            except ProcessLookupError:
                pass
        j.restarts.append((fault.at * 1000, time.time() * 1000 + 1))
        job.wait(timeout=30)
        left = self.leftovers(marker)
        if left:
            self.violations.append(f"job {j.seed}: processes of the killed job left behind "
                                   f"15 s after the driver's process group was killed: "
                                   f"{self.describe(left)}")
            return None
        j.boundaries.append(time.time() * 1000)
        j.ev.poll()
        j.run_start = len(j.ev.all)
        (j.folder / f"output-{j.counts['job-kill']}.txt").write_text(job.text() + "\n")
        job = Job(self.job_args(j, spares), env=env)
        # Faults resume once the new run's first round formed (the old run's events say
        # nothing of the new processes).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and job.proc.poll() is None:
            j.ev.poll()
            if any(e["event"] == "round_formed" for e in j.ev.all[j.run_start:]):
                break
            time.sleep(0.05)
        return job

    def near_end(self, job):
        # A kill while the last workers finish would fail the job by design (a failure while
        # finishing ends a job): the soak stops injecting in the last three epochs.
        return self.work.epoch_done(job.text(), self.args.epochs - 3)

    # --- faults ---

    def inject(self, action, j, job, formed):
        """Injects `action`; returns its Fault, or None when it did not apply now."""
        rng = j.rng
        members = [s for s in formed["members"] if j.alive(s) and j.pid_of(s) not in j.hit]
        holders = j.holders()
        # Processes that are in the formed round (not a newcomer started since it formed): a
        # newcomer stopped before it joins is found only by the rendezvous timeout, a stall
        # of another kind than a member's stop.
        in_round = j.in_round()

        def safe(targets):
            # Some holder of the newest commit must be left untouched.
            return bool(j.holders(exclude=set(targets)))

        if action in ("kill", "stop"):
            pool = members if action == "kill" else [m for m in members if m in in_round]
            if not pool:
                return None
            target = rng.choice(pool)
            if not safe([target]):
                return None
            sig = signal.SIGKILL if action == "kill" else signal.SIGSTOP
            return j.record(action, [target]) if self.signal(j, target, sig) else None
        if action == "kill-all":
            # Every member at once, after a checkpoint of this run: the state is lost for real.
            if j.counts[action] >= MAX_RESTARTS or not j.checkpointed() or not members:
                return None
            # The pids first (each is a /proc scan), then the kills back to back: the first
            # targets' peers re-form in milliseconds and train until their own kill. The
            # restart spans from the first kill to the last (see ledger.check).
            pids = [j.worker_pid(t) for t in members]
            fault = j.record(action, members)
            for pid in pids:
                if pid is not None:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            j.restarts.append((fault.at * 1000, time.time() * 1000 + 1))
            return fault
        if action == "kill-many":
            if len(members) < 3 or len(holders) < 2:
                return None
            k = rng.randint(2, len(members) - 1)
            targets = rng.sample(members, k)
            if not safe(targets):
                return None
            fault = j.record(action, targets)
            for t in targets:
                self.signal(j, t, signal.SIGKILL)
            return fault
        if action == "stop-cont":
            pool = [m for m in members if m in in_round]
            if not pool:
                return None
            target = rng.choice(pool)
            if not safe([target]):
                return None
            # Before the liveness timeout (nothing may change), or after it (lost, replaced).
            pause = rng.uniform(0.3, 2.0) if rng.random() < 0.6 else rng.uniform(6.0, 9.0)
            if not self.signal(j, target, signal.SIGSTOP):
                return None
            fault = j.record(action, [target])
            fault.duration, fault.until = pause, None
            fault.heal = lambda pid=j.worker_pid(target): self.cont(pid)
            return fault
        if action == "newcomer-kill":
            # A new process for a lost member's slot (or a new one), killed while it starts:
            # its peers, who did not wait for it, must not notice; the slot gets another.
            starting = j.newcomers()
            if not starting:
                return None
            target = rng.choice(starting)
            return j.record(action, [target]) if self.signal(j, target, signal.SIGKILL) else None
        if action in ("spare-kill", "spare-stop"):
            spares = j.spares()
            if not spares:
                return None
            target = rng.choice(spares)
            sig = signal.SIGKILL if action == "spare-kill" else signal.SIGSTOP
            return j.record(action, [target]) if self.signal(j, target, sig) else None
        if action == "leave":
            if len(members) < 3:
                return None  # below --min-np the job would wait for a host change
            target = rng.choice(members)
            if not safe([target]):
                return None
            return j.record(action, [target]) if self.signal(j, target, signal.SIGUSR1) else None
        if action in ("add", "remove"):
            return self.resize(action, j)
        if action == "kill-on-form":
            return self.kill_on_form(j, job, formed)
        if action in HOST_FAULTS:
            return self.host_fault(action, j)
        mode = {"disc-fail": "fail", "disc-hang": "hang", "disc-garbage": "garbage"}[action]
        j.disc.set_mode(mode)
        return j.record(action, [])

    def kill_on_form(self, j, job, formed):
        rng = j.rng
        if self.resize(rng.choice(["add", "remove"]), j) is None:
            return None
        before = formed["round"]
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and job.proc.poll() is None:
            for e in j.ev.poll():
                if e["event"] == "round_formed" and e["round"] > before:
                    holders = [s for s, v in zip(e["members"], e["versions"])
                               if v == e["version"] and e["version"] > 0]
                    if len(holders) >= 2 and rng.random() < 0.5:
                        target = e["members"][0]  # rank 0, while it sends the state
                    else:
                        others = e["members"][1:] or e["members"]
                        target = rng.choice(others)
                    if not [h for h in holders if h != target and j.pid_of(h) not in j.hit]:
                        return None
                    fault = j.record("kill-on-form", [target])
                    self.signal(j, target, signal.SIGKILL)
                    return fault
            time.sleep(0.005)
        return None

    def host_fault(self, action, j):
        hosts = self.hosts
        rng = j.rng
        candidates = [h for h in hosts.names
                      if j.disc.slots.get(h, 0) > 0 and h not in hosts.impaired]
        rng.shuffle(candidates)
        for host in candidates:
            formed = j.ev.last("round_formed")
            on_host = [s for s in formed["members"] if s.rpartition(":")[0] == host]
            # Another host must keep a holder of the newest commit.
            if not on_host or not j.holders(exclude=set(on_host)):
                continue
            if action == "host-kill":
                fault = j.record(action, on_host, host)
                hosts.kill_host(host)
                return fault
            fault = j.record(action, on_host, host)
            fault.what = hosts.impair(host, action, rng)
            fault.duration = rng.uniform(1.0, 4.0)
            fault.until = None
            fault.heal = lambda h=host: hosts.heal(h)
            return fault
        return None

    def heal(self, fault):
        fault.heal()
        fault.until = time.time()

    def heal_all(self, lasting):
        for item in list(lasting):
            lasting.remove(item)
            self.heal(item[1])
        self.hosts.heal()

    @staticmethod
    def cont(pid):
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def resize(self, action, j):
        rng, disc = j.rng, j.disc
        host = rng.choice(self.hosts.names)
        if action == "add":
            if disc.total() >= self.work.max_np + 1:
                return None
            disc.slots[host] = disc.slots.get(host, 0) + 1
            disc.write()
            return j.record(action, [])
        if disc.total() <= self.work.min_np or disc.slots.get(host, 0) == 0:
            return None
        gone = f"{host}:{disc.slots[host] - 1}"
        if not j.holders(exclude={gone}):
            return None
        disc.slots[host] -= 1
        disc.write()
        j.removed.add(gone)
        return j.record(action, [])

    def signal(self, j, slot, sig):
        pid = j.worker_pid(slot)
        if pid is None or not pid_alive(pid):
            return False
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
        return True

    # --- the oracle ---

    def check(self, rc, job, want, j, marker, shm_before):
        problems = []
        book = str(j.folder / "ledger")
        if rc != 0:
            problems.append(f"elastic-run exited {rc}: " + " | ".join(job.lines[-5:]))
        if rc == 0:
            problems += self.work.model_problems(job.text(), j.folder, want)
            try:
                problems += ledger.check(book, self.work.samples, self.args.epochs,
                                         max_rollback=self.work.commit_every + 1,
                                         boundaries=j.boundaries, restarts=j.restarts,
                                         restart_window_ms=(j.interval + 3.0) * 1000)
                problems += self.stall_problems(j, book)
            except ValueError as e:  # a whole line that does not parse: a violation, not a crash
                problems.append(f"the ledger: {e}")
        left = self.leftovers(marker)
        if left:
            problems.append(f"processes of the job left behind: {self.describe(left)}")
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        pids = {e["pid"] for e in j.ev.all if e["event"] == "worker_started"}
        shm_left = [n for n in set(os.listdir("/dev/shm")) - shm_before
                    if n.startswith("elastic-") and n.split("-")[1].isdigit()
                    and int(n.split("-")[1]) in pids]
        if shm_left:
            problems.append(f"/dev/shm holds segments of the job's workers: {sorted(shm_left)}")
        problems += self.in_place_problems(j, rc)
        problems += self.stopped_problems(j, rc)
        problems += self.quiet_problems(j)
        # No fault of the soak makes a worker slower than its peers for long: a kill, a stop,
        # a pause, a lost link or a driver outage is not a straggler (issue 29's "no false
        # positive across a soak").
        for e in j.ev.all:
            if e["event"] == "straggler":
                problems.append(f"slot {e['slot']} was named a straggler ({e['ratio']:.2f}x "
                                f"its peers' compute over {e['window']} steps) by a fault that "
                                f"makes none")
        lost = [e for e in j.ev.all if e["event"] == "state_lost"]
        if lost and not self.args.checkpoints:
            problems.append("the driver reported the state lost")
        for i, e in enumerate(j.ev.all):
            # With checkpoints, each loss must be followed by a restore from one, by its round
            # or by a later one that superseded it before the restore (lost_in_round names it).
            if e["event"] == "state_lost" and self.args.checkpoints and not any(
                    r["event"] == "state_restored" and r.get("state_lost")
                    and e["round"] in (r["round"], r.get("lost_in_round"))
                    for r in j.ev.all[i:]):
                problems.append(f"the state was lost in round {e['round']} and no checkpoint "
                                f"was restored")
        return problems

    @staticmethod
    def leftovers(marker, seconds=15):
        """Processes of the job still there after `seconds`, found in /proc by the marker
        every process of the job inherits (not from the driver's events)."""
        deadline = time.monotonic() + seconds
        left = procs_with_marker(marker, MARK)
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = procs_with_marker(marker, MARK)
        return left

    @staticmethod
    def dump_stacks(marker, folder):
        """A job that did not end: the stacks of each of its processes, for the post-mortem."""
        with open(folder / "stacks.txt", "w") as out:
            for pid in procs_with_marker(marker, MARK):
                out.write(f"=== pid {pid}: {' '.join(Soak.describe([pid]))}\n")
                out.flush()
                try:
                    subprocess.run(["eu-stack", "-p", str(pid)], stdout=out,
                                   stderr=subprocess.STDOUT, timeout=20)
                except (OSError, subprocess.TimeoutExpired) as e:
                    out.write(f"eu-stack: {e}\n")

    @staticmethod
    def describe(pids):
        out = []
        for pid in pids[:5]:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
                out.append(f"{pid} {cmdline[:80]}")
            except OSError:
                out.append(str(pid))
        return out

    def stall_problems(self, j, book):
        """The longest pause in training after each fault, against its kind's bound."""
        ts = sorted(l.ts / 1000.0 for l in ledger.read(book))
        faults = sorted(j.faults, key=lambda f: f.at)
        problems = []
        k = 0
        worst = {}
        for a, b in zip(ts, ts[1:]):
            while k < len(faults) and faults[k].at <= a:
                k += 1
            # The gap is the most recent fault's (before the gap began), or the job's own.
            f = faults[k - 1] if k > 0 else None
            if f is None or a > max(f.at, f.until or f.at) + 30:
                continue
            # Its bound: a silent fault's when one was in effect during the gap (its workers
            # are found only after the liveness timeout), a network fault's when one was (a
            # partition begun during a recovery holds up the new round's connections until it
            # heals: seed 84617780 job 5, 11.6 s), else a crash's.
            def in_effect(kinds):
                return f.kind in kinds or any(
                    g.kind in kinds and g.at <= b and a <= (g.until or g.at) + LIVENESS + 6
                    for g in faults)
            # Several in effect: the longest of their bounds.
            kinds = {"crash"}
            for name, which in (("restart", RESTARTS),
                                ("driver", {"driver-kill", "driver-pause",
                                            "driver-host-kill"}),
                                ("network", NETWORK), ("silent", SILENT)):
                if in_effect(which):
                    kinds.add(name)
            if {"driver", "silent"} <= kinds:
                kinds.add("driver-silent")
            bound = max(STALL[k] for k in kinds)
            # A stopped member's rendezvous timeout starts when the driver that adopts the
            # job does, after the kill: the time from the gap's start to the driver's kill
            # comes on top (overlap soak, seed 660049395, job 0: stop, kill, driver killed
            # 2.6 s later, 40.05 s in all).
            kills = [g.at for g in faults
                     if g.kind in ("driver-kill", "driver-pause", "driver-host-kill")
                     and a <= g.at <= b]
            if "driver-silent" in kinds and kills:
                bound = max(bound, STALL["driver-silent"] + (kills[0] - a))
            gap = b - a
            if gap > worst.get(f.kind, (0.0, 0.0))[0]:
                worst[f.kind] = (gap, bound)
        for kind, (gap, bound) in worst.items():
            self.stalls[kind] = max(self.stalls[kind], gap)
            if gap > bound:
                problems.append(f"training stalled for {gap:.1f} s after a {kind} fault "
                                f"(bound {bound:.0f} s)")
        return problems

    def in_place_problems(self, j, rc):
        """A worker no fault touched must keep its process: recovery happens in place."""
        if rc != 0:
            return []
        problems = []
        last_start = {}
        for e in j.ev.all:
            if e["event"] == "worker_started":
                last_start[e["slot"]] = e
            if e["event"] != "worker_exited":
                continue
            s = last_start.get(e["slot"])
            if s is None or s["pid"] in j.hit or e["slot"] in j.removed:
                continue
            if e["slot"].rpartition(":")[0] in j.hit_hosts:
                continue
            if e["code"] == 0 or s.get("spare"):
                continue
            if e["status"].startswith("signal 15"):
                continue  # stopped by the driver at the end: stopped_problems' business
            problems.append(f"slot {e['slot']} (pid {s['pid']}), touched by no fault, ended "
                            f"with {e['status']}: its recovery was not in place")
        return problems

    @staticmethod
    def stopped_problems(j, rc):
        """Workers that trained must end by themselves: the driver stops at the end only
        processes that were never in a formed round (spares, newcomers, a process placed in a
        round that the job's end overtook: found by the PyTorch namespace soak, seed 415459368
        job 8, where a newcomer got ready just as the members finished). Whether a process
        was in a formed round is what the round_formed events after its start say."""
        trained, stopped, last_pid = {}, [], {}
        for e in j.ev.all:
            if e["event"] == "worker_started":
                trained[e["slot"]] = False
            elif e["event"] == "round_formed":
                for s in e["members"]:
                    trained[s] = True
            if (e["event"] == "worker_exited" and e["status"].startswith("signal 15")
                    and trained.get(e["slot"]) and last_pid.get(e["slot"]) not in j.hit):
                stopped.append(e["slot"])
            if e["event"] == "worker_started":
                last_pid[e["slot"]] = e["pid"]
        if rc == 0 and stopped:
            return [f"worker(s) {stopped} never ended by themselves (stopped at the end)"]
        return []

    def quiet_problems(self, j):
        """A discovery script that fails, hangs or prints garbage keeps the last good host set:
        no round is proposed, no host removed and no worker exits for it. The job's own end is
        not such a change: the exits of the last round's members with code 0, after its last
        proposal, when the job then ends with code 0 (seed 31494 flagged them), and what the
        driver stops after that (end_of_job_exits)."""
        problems = []
        ends = self.end_of_job_exits(j.ev.all)
        for start, end in j.quiet:
            end = (end or time.time()) + 1.0  # one more discovery run after the restore
            for i, e in enumerate(j.ev.all):
                if e["event"] not in ("round_proposed", "host_removed", "worker_exited") or \
                        not start <= e["ts"] <= end or i in ends:
                    continue
                what = {"round_proposed": f"round {e.get('round')} proposed",
                        "host_removed": f"host {e.get('host')} removed",
                        "worker_exited": f"slot {e.get('slot')} exited with code "
                                         f"{e.get('code')} ({e.get('status')})"}[e["event"]]
                problems.append(f"{what} at {e['ts']:.3f} while only the discovery script "
                                f"misbehaved ({start:.3f}-{end:.3f}): a failed discovery run "
                                f"must keep the last good host set, changing no membership")
        return problems

    @staticmethod
    def end_of_job_exits(events):
        """Indices of the worker_exited events that are the job's normal end, when it ends with
        a job_ending of code 0: before it, the exits with code 0 of the last formed round's
        members after the last round proposed; after it, every exit (the driver stops what
        was never in that round, warm spares and newcomers, with SIGTERM: netns soak, seed
        573100237, job 0)."""
        ending = next((i for i, e in enumerate(events) if e["event"] == "job_ending"), None)
        if ending is None or events[ending].get("code") != 0:
            return set()
        formed = [e for e in events[:ending] if e["event"] == "round_formed"]
        if not formed:
            return set()
        members, since = set(formed[-1]["members"]), formed[-1]["ts"]
        for e in events[:ending]:
            if e["event"] == "round_proposed":
                since = max(since, e["ts"])
        return {i for i, e in enumerate(events)
                if e["event"] == "worker_exited" and (i > ending or (
                    e.get("code") == 0 and e["slot"] in members and e["ts"] >= since))}

    def main(self):
        seed = self.args.seed if self.args.seed is not None else random.SystemRandom().randrange(
            1, 10**9)
        mode = (f"--workload {self.args.workload} --hosts {self.args.hosts}"
                + (" --overlap" if self.args.overlap else "")
                + (" --checkpoints" if self.args.checkpoints else "")
                + (" --standby" if self.args.standby else "")
                + "".join(f" --weight {k}={n}" for k, n in self.args.weight))
        print(f"soak: seed {seed} (replay: scripts/soak.sh {mode} --seed {seed} --minutes "
              f"{self.args.minutes:g}); {self.args.epochs} epochs a job", flush=True)
        try:
            self.hosts.up()
        except (RuntimeError, OSError) as e:
            self.hosts.down()
            print(f"soak: cannot make the namespace hosts ({e}); --hosts netns needs root, "
                  f"iproute2 and nftables", flush=True)
            return 1
        try:
            return self.soak(seed)
        finally:
            self.hosts.down()
            shutil.rmtree(getattr(self, "baseline_dir", "/nonexistent"), ignore_errors=True)

    def soak(self, seed):
        if self.args.standby:
            self.etcd = start_etcd(pathlib.Path(tempfile.mkdtemp(prefix="elastic-soak-etcd-")),
                                   host=self.hosts.store_address)
            atexit.register(stop_etcd, self.etcd)
        want = self.baseline()
        print(f"soak: fault-free model {want}", flush=True)
        deadline = time.monotonic() + self.args.minutes * 60
        keep = None
        j = 0
        while time.monotonic() < deadline:
            folder = pathlib.Path(tempfile.mkdtemp(prefix="elastic-soak-"))
            ok = self.run_job(seed * 1000 + (j if self.args.job is None else self.args.job),
                              want, folder)
            j += 1
            if ok:
                shutil.rmtree(folder, ignore_errors=True)
            else:
                keep = folder
                break
        total = sum(self.faults.values())
        print(f"soak: {self.jobs} job(s), {total} faults: "
              + ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())), flush=True)
        print("soak: longest stall after a fault, by kind: "
              + ", ".join(f"{k} {v:.2f} s" for k, v in sorted(self.stalls.items())), flush=True)
        if self.violations:
            print(f"soak: FAILED with seed {seed}; {len(self.violations)} violation(s):")
            for v in self.violations:
                print("  " + v)
            if keep:
                print(f"soak: the failing job's event log, ledger and output are in {keep}")
            return 1
        print(f"soak: 0 violations (seed {seed})")
        return 0


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=2.0, help="start jobs for this long")
    p.add_argument("--seed", type=int, default=None, help="replay this seed (printed first)")
    p.add_argument("--job", type=int, default=None,
                   help="run only this job of the seed (its number after the seed), again and "
                        "again")
    p.add_argument("--workload", choices=["cpp", "python"], default="cpp",
                   help="cpp: examples/logistic_regression; python: examples/train_digits.py "
                        "(PyTorch, DataLoader workers)")
    p.add_argument("--hosts", choices=["local", "netns"], default="local",
                   help="local: two names of this machine; netns: three network namespaces "
                        "on a bridge, with host, link and packet faults (root)")
    p.add_argument("--overlap", action="store_true",
                   help="faults do not wait for the previous recovery (one holder of the "
                        "state is always left); adds kill-many, stop-cont, spare-kill/stop, "
                        "newcomer-kill")
    p.add_argument("--standby", action="store_true",
                   help="a standby driver beside each job's leader, its journal in an etcd "
                        "the soak starts; driver-kill and driver-pause then test the takeover")
    p.add_argument("--checkpoints", action="store_true",
                   help="every job writes checkpoints (--checkpoint-dir); adds job-kill (the "
                        "whole job killed and started again) and kill-all (every holder of "
                        "the state killed at once)")
    p.add_argument("--epochs", type=int, default=None,
                   help="epochs of each job (default: 30 for cpp, 24 for python)")
    p.add_argument("--step-ms", type=int, default=5, help="extra time per training step")
    p.add_argument("--fault-gap", type=float, nargs=2, default=[0.2, 1.2],
                   metavar=("MIN", "MAX"), help="seconds between two faults (uniform)")
    p.add_argument("--job-timeout", type=float, default=300.0,
                   help="seconds a job may take (then its stacks go to stacks.txt)")
    p.add_argument("--build-dir", default=os.environ.get("ELASTIC_BUILD_DIR",
                                                         str(ROOT / "build")))
    p.add_argument("--weight", type=weight, action="append", default=[], metavar="KIND=N",
                   help="the weight of a fault kind in the draw (e.g. driver-kill=30 to stress "
                        "it, kill=0 to leave it out); may be given more than once")
    args = p.parse_args()
    if args.epochs is None:
        args.epochs = 24 if args.workload == "python" else 30
    if args.epochs < 4:
        p.error("--epochs must be at least 4 (faults stop three epochs before the end)")
    return args


def weight(text):
    kind, sep, n = text.partition("=")
    if not sep or not n.isdigit() or int(n) > 1000:
        raise argparse.ArgumentTypeError(f"{text!r}: want KIND=N, N a whole number up to 1000")
    return kind, int(n)


def stop_on_sigterm():
    """SIGTERM (a timeout, CI) ends the soak through its cleanup: the namespace hosts and the
    running job go, as at a normal end."""
    def handler(signum, frame):
        raise SystemExit(f"soak: stopped by signal {signum}")
    signal.signal(signal.SIGTERM, handler)


if __name__ == "__main__":
    stop_on_sigterm()
    sys.exit(Soak(parse()).main())
