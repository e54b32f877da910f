#!/usr/bin/env python3
"""The chaos soak: elastic jobs under random faults, checked against the product's promise.

Runs the C++ example (examples/logistic_regression) under
    elastic-run --min-np 2 --max-np 6 --host-discovery-script <a script printing a file>
one job after another until --minutes have passed, and injects at random, with a seeded
generator:
  kill          SIGKILL of a member
  kill-on-form  a scale change, then SIGKILL of a member the moment the new round forms
                (while it connects its Gloo mesh or syncs the state; rank 0 when another
                member also holds the newest version)
  add, remove   slots added to or removed from the discovery file
  disc-fail, disc-hang, disc-garbage
                the discovery script exits 3, hangs past --discovery-timeout, or prints
                garbage, for a second or two
  leave         SIGUSR1: the worker reports LEAVING and exits 0
  stop          SIGSTOP of a member, never continued: a hung worker the driver must find
                (--liveness-timeout), name and kill
Faults that take a worker away wait until the job has recovered from the previous one (a
commit in a newer round), and so do removals after a stop (a stopped worker is found only
after seconds), so that some worker always holds the committed state: losing every
holder at once is a real loss, which the driver reports (state_lost), not one the soak should
provoke.

After each job it checks: exit 0; every sample index of every epoch consumed by exactly one
committed step (the example's ledger); no round resuming further back than one commit interval
(no silent restart); the final model bit for bit the fault-free one (its hash); no worker
process left behind; no stall (no two consecutive ledger lines further apart than --stall).

    tests/soak/soak.py --minutes 2                 # a fresh seed, printed at the start
    tests/soak/soak.py --minutes 30 --seed 1234    # replay a seed's fault schedule

A seed replays the same choices of faults and targets; their timing against training varies
from run to run. Exits 0 when every job kept the promise, 1 otherwise (the failing job's folder
is kept and named).
"""
import argparse
import collections
import json
import os
import pathlib
import random
import shutil
import signal
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "python"))

import ledger  # noqa: E402
from helpers import Job, pid_alive, run, wait_gone  # noqa: E402

SAMPLES = 4096
COMMIT_EVERY = 4
HOSTS = ["localhost", "127.0.0.1"]  # two host names, both this machine
MIN_NP, MAX_NP = 2, 6
WEIGHTS = {"kill": 24, "kill-on-form": 12, "add": 14, "remove": 12, "disc-fail": 8,
           "disc-hang": 5, "disc-garbage": 8, "leave": 10, "stop": 6}


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


class Discovery:
    """A discovery script that prints a host file, or misbehaves as its mode file says."""

    def __init__(self, folder):
        self.hosts = folder / "hosts.txt"
        self.mode = folder / "mode"
        self.script = folder / "discover.sh"
        self.script.write_text(
            "#!/bin/sh\n"
            f"case $(cat {self.mode} 2>/dev/null) in\n"
            "  fail) echo 'cloud API down' >&2; exit 3 ;;\n"
            "  hang) sleep 30 ;;\n"
            "  garbage) echo '%% not a host list %%' ;;\n"
            f"  *) cat {self.hosts} ;;\n"
            "esac\n")
        self.script.chmod(0o755)
        self.slots = {"localhost": 2, "127.0.0.1": 1}
        self.write()
        self.set_mode("good")

    def write(self):
        tmp = self.hosts.with_suffix(".tmp")
        tmp.write_text("".join(f"{h}:{n}\n" for h, n in self.slots.items() if n > 0))
        os.replace(tmp, self.hosts)

    def set_mode(self, mode):
        tmp = self.mode.with_suffix(".tmp")
        tmp.write_text(mode)
        os.replace(tmp, self.mode)

    def total(self):
        return sum(self.slots.values())


class Soak:
    def __init__(self, args):
        self.args = args
        self.build = pathlib.Path(args.build_dir)
        self.elastic_run = str(self.build / "driver" / "elastic-run")
        self.example = str(self.build / "examples" / "logistic_regression")
        self.train_args = ["--samples", str(SAMPLES), "--epochs", str(args.epochs),
                           "--step-ms", str(args.step_ms), "--commit-every", str(COMMIT_EVERY)]
        self.faults = collections.Counter()
        self.violations = []
        self.jobs = 0

    def baseline(self):
        rc, out = run([self.elastic_run, "-np", "2", self.example] + self.train_args,
                      timeout=600)
        if rc != 0 or not ledger.final_hash(out):
            raise SystemExit(f"soak: the fault-free run failed (exit {rc}):\n{out[-3000:]}")
        return ledger.final_hash(out)

    def run_job(self, seed, want, folder):
        rng = random.Random(seed)
        disc = Discovery(folder)
        log = folder / "events.jsonl"
        book = str(folder / "ledger")
        ev = Events(str(log))
        env = dict(os.environ)
        env.pop("ELASTIC_TEST_HOOKS", None)
        # Some jobs keep warm spares: lost members' places are then taken by them.
        spares = rng.choice([0, 0, 1, 2])
        job = Job([self.elastic_run, "--min-np", str(MIN_NP), "--max-np", str(MAX_NP),
                   "--spares", str(spares),
                   "--host-discovery-script", str(disc.script), "--discovery-interval", "0.5",
                   "--discovery-timeout", "2", "--host-failure-limit", "0",
                   "--rendezvous-timeout", "10", "--event-log", str(log), self.example]
                  + self.train_args + ["--ledger", book], env=env)
        faults = collections.Counter()
        started = time.monotonic()
        gate_round = -1  # a destructive fault waits for a commit in a round newer than this
        stop_pending = False  # the last destructive fault was a SIGSTOP
        restore_at = None
        try:
            while job.proc.poll() is None:
                ev.poll()
                if restore_at and time.monotonic() >= restore_at:
                    disc.set_mode("good")
                    restore_at = None
                if time.monotonic() - started > self.args.job_timeout:
                    self.violations.append(f"job {seed}: still running after "
                                           f"{self.args.job_timeout} s")
                    break
                if self.near_end(job):
                    time.sleep(0.1)
                    continue
                time.sleep(rng.uniform(0.2, 1.2))
                # Again after the pause: epochs can be shorter than it (seed 75897288 killed
                # a worker while the job was finishing, checked only before the pause).
                if self.near_end(job):
                    continue
                ev.poll()
                formed = ev.last("round_formed")
                if formed is None:
                    continue
                recovered = any(e["event"] == "committed" and e["round"] > gate_round
                                for e in ev.all)
                action = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
                destructive = action in ("kill", "kill-on-form", "leave", "stop")
                # A removal takes a worker (and the state it holds) away too: while a stopped
                # worker is not yet found (seconds), removing the other holder would lose the
                # state for real (seed 915124613); it waits for the recovery like the others.
                if (destructive or (action == "remove" and stop_pending)) and not recovered:
                    continue
                if action.startswith("disc-") and restore_at:
                    continue
                done = self.inject(action, rng, disc, ev, job, formed)
                if done:
                    faults[action] += 1
                    if destructive:
                        gate_round = ev.last("round_formed")["round"]
                        stop_pending = action == "stop"
                    if action.startswith("disc-"):
                        restore_at = time.monotonic() + rng.uniform(1.0, 2.5)
            disc.set_mode("good")
            rc = job.wait(timeout=max(10, self.args.job_timeout - (time.monotonic() - started)))
        except AssertionError as e:  # Job.wait's timeout
            rc = None
            self.violations.append(f"job {seed}: {str(e)[:200]}")
        finally:
            job.kill()
        ev.poll()
        (folder / "output.txt").write_text(job.text() + "\n")
        problems = self.check(rc, job, want, book, ev)
        for p in problems:
            self.violations.append(f"job {seed}: {p}")
        self.faults.update(faults)
        self.jobs += 1
        total = sum(faults.values())
        promoted = len([e for e in ev.all if e["event"] == "spare_promoted"])
        print(f"soak: job {seed}: --spares {spares} ({promoted} used), "
              f"{total} faults {dict(faults)}, "
              f"{len([e for e in ev.all if e['event'] == 'round_formed'])} rounds, "
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

    def near_end(self, job):
        # A kill while the last workers finish would fail the job by design (a failure while
        # finishing ends a job): the soak stops injecting in the last two epochs.
        return f"epoch {self.args.epochs - 3} done" in job.text()

    def inject(self, action, rng, disc, ev, job, formed):
        members = [s for s in formed["members"] if self.alive(ev, s)]
        if action == "kill":
            if len(members) < 1:
                return False
            return self.kill(ev, rng.choice(members), signal.SIGKILL)
        if action == "stop":  # a hung worker (SIGSTOP, never continued): found and killed
            if len(members) < 1:
                return False
            return self.kill(ev, rng.choice(members), signal.SIGSTOP)
        if action == "leave":
            if len(members) < 3:
                return False  # below --min-np the job would wait for a host change
            return self.kill(ev, rng.choice(members), signal.SIGUSR1)
        if action == "add" or action == "remove":
            return self.resize(action, rng, disc)
        if action == "kill-on-form":
            if not self.resize(rng.choice(["add", "remove"]), rng, disc):
                return False
            before = formed["round"]
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and job.proc.poll() is None:
                for e in ev.poll():
                    if e["event"] == "round_formed" and e["round"] > before:
                        holders = [s for s, v in zip(e["members"], e["versions"])
                                   if v == e["version"] and e["version"] > 0]
                        if len(holders) >= 2 and rng.random() < 0.5:
                            target = e["members"][0]  # rank 0, while it sends the state
                        else:
                            others = e["members"][1:] or e["members"]
                            target = rng.choice(others)
                        return self.kill(ev, target, signal.SIGKILL)
                time.sleep(0.005)
            return False
        mode = {"disc-fail": "fail", "disc-hang": "hang", "disc-garbage": "garbage"}[action]
        disc.set_mode(mode)
        return True

    def resize(self, action, rng, disc):
        host = rng.choice(HOSTS)
        if action == "add":
            if disc.total() >= MAX_NP + 1:
                return False
            disc.slots[host] += 1
        else:
            if disc.total() <= MIN_NP or disc.slots[host] == 0:
                return False
            disc.slots[host] -= 1
        disc.write()
        return True

    @staticmethod
    def pid_of(ev, slot):
        starts = [e for e in ev.all if e["event"] == "worker_started" and e["slot"] == slot]
        return starts[-1]["pid"] if starts else None

    def alive(self, ev, slot):
        pid = self.pid_of(ev, slot)
        return pid is not None and pid_alive(pid)

    def kill(self, ev, slot, sig):
        pid = self.pid_of(ev, slot)
        if pid is None or not pid_alive(pid):
            return False
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
        return True

    def check(self, rc, job, want, book, ev):
        problems = []
        if rc != 0:
            problems.append(f"elastic-run exited {rc}: " + " | ".join(job.lines[-5:]))
        got = ledger.final_hash(job.text())
        if got != want:
            problems.append(f"final model hash {got}, fault-free {want}")
        if rc == 0:
            problems += ledger.check(book, SAMPLES, self.args.epochs,
                                     max_rollback=COMMIT_EVERY + 1)
            gap = ledger.longest_gap(book)
            if gap > self.args.stall:
                problems.append(f"training stalled for {gap:.1f} s (bound {self.args.stall} s)")
        pids = [e["pid"] for e in ev.all if e["event"] == "worker_started"]
        left = wait_gone(pids, timeout=10)
        if left:
            problems.append(f"worker processes left behind: {left}")
        # A spare not used (yet) is stopped by design: at the end, or when its slot is no
        # longer listed. Whether an exit was a spare's is what the slot was at that moment.
        spare_now, stopped = {}, []
        for e in ev.all:
            if e["event"] == "worker_started":
                spare_now[e["slot"]] = bool(e.get("spare"))
            elif e["event"] == "spare_promoted":
                spare_now[e["slot"]] = False
            elif (e["event"] == "worker_exited" and e["status"].startswith("signal 15")
                  and not spare_now.get(e["slot"])):
                stopped.append(e["slot"])
        if rc == 0 and stopped:
            problems.append(f"worker(s) {stopped} never ended by themselves (stopped at the end)")
        if [e for e in ev.all if e["event"] == "state_lost"]:
            problems.append("the driver reported the state lost")
        return problems

    def main(self):
        seed = self.args.seed if self.args.seed is not None else random.SystemRandom().randrange(
            1, 10**9)
        print(f"soak: seed {seed} (replay: scripts/soak.sh --seed {seed} --minutes "
              f"{self.args.minutes:g}); {self.args.epochs} epochs a job", flush=True)
        want = self.baseline()
        print(f"soak: fault-free model hash {want}", flush=True)
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
    p.add_argument("--epochs", type=int, default=30, help="epochs of each job")
    p.add_argument("--step-ms", type=int, default=5, help="extra time per training step")
    p.add_argument("--stall", type=float, default=20.0,
                   help="longest allowed pause in training, seconds")
    p.add_argument("--job-timeout", type=float, default=600.0, help="seconds a job may take")
    p.add_argument("--build-dir", default=os.environ.get("ELASTIC_BUILD_DIR",
                                                         str(ROOT / "build")))
    return p.parse_args()


if __name__ == "__main__":
    sys.exit(Soak(parse()).main())
