#!/usr/bin/env python3
"""The peers benchmark: elastic-run beside Horovod Elastic, TorchFT, torchrun and DLRover on
the same job (bench/peers/common.py) and the same faults, 4 workers on this machine. Each
system runs in its own venv (bench/peers/setup.sh); elastic-run in the project's .venv.

Per repeat, for every system in turn (the order alternates from one repeat to the next):
  clean       a fault-free run: command -> first step, steady samples/s, the reference model
  kill        SIGKILL of the highest-ranked of 4 workers at step --kill-at: -> the next step
              of the workers as re-formed, -> 4 workers stepping again; the samples trained
              twice or never (per epoch, from the ledgers) and the final model against clean
  controller  SIGKILL of the system's controller at step --kill-at (elastic-run's driver,
              horovodrun, TorchFT's lighthouse, torchrun's agent, DLRover's master): does
              training go on, the longest stall, how the run ended, what it left running
  grow        (systems with a membership that grows while running) 2 workers, then 2 more
              after step 8: -> 4 workers stepping (twice --epochs, so that the newcomers'
              start fits in the run)
The judge is bench/peers/peerledger.py: only the training scripts' ledgers, the benchmark's own
clock and /proc (processes left behind, found by a marker in their environment).

    bench/peers/run.sh --repeat 3                 # everything; results in bench/peers/results
    bench/peers/run.sh --repeat 1 --systems elastic,torchft --scenarios kill
"""
import argparse
import json
import os
import pathlib
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
import peerledger  # noqa: E402

VENVS = pathlib.Path(os.environ.get("PEERS_VENV_DIR", pathlib.Path.home() / ".cache" /
                                    "elastic-peers"))
SAMPLES, WORKERS = 2048, 4


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def marked(marker):
    """Processes whose environment holds PEERS_MARKER=marker (read from /proc)."""
    out = []
    want = f"PEERS_MARKER={marker}".encode()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if want in f.read().split(b"\0"):
                    with open(f"/proc/{d}/stat") as s:
                        if s.read().rsplit(")", 1)[1].split()[0] != "Z":
                            out.append(int(d))
        except OSError:
            pass
    return out


def children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def descendants(pid):
    out, todo = [], [pid]
    while todo:
        for c in children(todo.pop()):
            out.append(c)
            todo.append(c)
    return out


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class System:
    """One system's way to run the job. `start` launches it (size workers) in folder d."""
    name = ""
    venv = None          # the venv folder name under VENVS, or None for the project's .venv
    grows = False

    def __init__(self, args):
        self.args = args
        self.procs = []
        self.scenario = None

    def python(self):
        if self.venv is None:
            return str(ROOT / ".venv" / "bin" / "python")
        return str(VENVS / self.venv / "bin" / "python")

    def available(self):
        return os.access(self.python(), os.X_OK)

    def env(self, marker):
        env = dict(os.environ, PEERS_MARKER=marker, PYTHONUNBUFFERED="1")
        env.pop("PYTHONPATH", None)
        if self.venv:
            env["PATH"] = str(VENVS / self.venv / "bin") + ":" + env["PATH"]
            env.pop("VIRTUAL_ENV", None)
        return env

    def popen(self, cmd, d, env, name):
        log = open(os.path.join(d, f"{name}.log"), "ab")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True, cwd=d)
        self.procs.append(p)
        return p

    def train_args(self, d):
        a = self.args
        return ["--epochs", str(a.epochs * (2 if self.scenario == "grow" else 1)),
                "--step-ms", str(a.step_ms),
                "--ledger", os.path.join(d, "ledger", "book"),
                "--out", os.path.join(d, "final.pt")]

    # Defaults: the first process started is the command; its exit code is the run's.
    def start(self, d, marker, size):
        raise NotImplementedError

    def done(self):
        return self.procs[0].poll() is not None

    def result(self):
        return self.procs[0].poll()

    def controller(self):
        return self.procs[0].pid

    def services(self):
        """Pids of long-lived services the run started that are meant to outlive a job (not
        counted as left behind)."""
        return []

    def on_worker_killed(self, d, marker, pid):
        pass

    def on_controller_killed(self, d, marker):
        pass

    def grow(self, d, marker):
        raise NotImplementedError


class Elastic(System):
    name = "elastic-run"
    grows = True
    script = "train_elastic.py"
    api = None

    def start(self, d, marker, size):
        self.d = d
        disc = os.path.join(d, "discover.sh")
        with open(disc, "w") as f:
            f.write(f"#!/bin/sh\necho localhost:{size}\n")
        os.chmod(disc, 0o755)
        self.cmd = [str(ROOT / "build" / "driver" / "elastic-run"), "--min-np", "2",
                    "--max-np", str(WORKERS), "--host-discovery-script", disc,
                    "--host-failure-limit", "0", "--state-dir", os.path.join(d, "state"),
                    self.python(), str(HERE / self.script)] + self.train_args(d)
        env = self.env(marker)
        env["PYTHONPATH"] = str(ROOT / "build" / "python")
        if self.api:
            env["PEERS_HOROVOD_API"] = self.api
        self.envs = env
        self.popen(self.cmd, d, env, "driver")

    def done(self):
        return self.procs[-1].poll() is not None

    def result(self):
        return self.procs[-1].poll()

    def controller(self):
        return self.procs[-1].pid

    def on_controller_killed(self, d, marker):
        # As its supervisor (systemd, a Kubernetes Deployment) would: once the killed driver
        # has been reaped, the same command again. (Started before, it can find the state
        # folder's lock still held by the dying process, and refuse to start, exit 1.)
        self.procs[-1].wait(timeout=10)
        self.popen(self.cmd, d, self.envs, "driver2")

    def grow(self, d, marker):
        with open(os.path.join(d, "discover.sh"), "w") as f:
            f.write(f"#!/bin/sh\necho localhost:{WORKERS}\n")


class ElasticHorovod(Elastic):
    name = "elastic-run (Horovod API)"
    script = "train_horovod.py"
    api = "elastic"


class Horovod(System):
    name = "Horovod Elastic"
    venv = "horovod"
    grows = True

    def start(self, d, marker, size):
        # One slot per host name, so that a failure blacklists one worker's "host" as on a
        # cluster: three names for this machine that Horovod runs locally (no ssh).
        self.hosts = ["vm:1" if socket.gethostname() == "vm" else f"{socket.gethostname()}:1",
                      "localhost:1", "127.0.0.1:1"]
        disc = os.path.join(d, "discover.sh")
        self.write_hosts(disc, size)
        bin_ = VENVS / self.venv / "bin"
        cmd = [str(bin_ / "horovodrun"), "-np", str(size), "--min-np", "2", "--max-np",
               str(WORKERS), "--host-discovery-script", disc, self.python(),
               str(HERE / "train_horovod.py")] + self.train_args(d)
        self.popen(cmd, d, self.env(marker), "horovodrun")

    def write_hosts(self, disc, size):
        # Up to 4 slots: the first name twice when all 4 are wanted.
        hosts = self.hosts if size > 2 else self.hosts[:1] + ["localhost:1"]
        lines = list(hosts)
        if size == WORKERS:
            lines[0] = lines[0].split(":")[0] + ":2"
        with open(disc + ".tmp", "w") as f:
            f.write("#!/bin/sh\n" + "".join(f"echo {h}\n" for h in lines))
        os.chmod(disc + ".tmp", 0o755)
        os.replace(disc + ".tmp", disc)

    def grow(self, d, marker):
        self.write_hosts(os.path.join(d, "discover.sh"), WORKERS)


class TorchFT(System):
    """A lighthouse and 4 replica groups of one process each (train_torchft.py). The
    benchmark is their supervisor, as torchx or Kubernetes would be: a killed replica is
    started again at once with the same command, a killed lighthouse too (the replicas run
    with TORCHFT_QUORUM_RETRIES=10, without which a lighthouse restart does not save them)."""
    name = "TorchFT"
    venv = "torchft"
    grows = True

    def start(self, d, marker, size):
        self.d, self.marker = d, marker
        self.port = free_port()
        self.lighthouse = None
        self.start_lighthouse()
        self.replicas = {}
        for r in range(size):
            self.start_replica(r)

    def start_lighthouse(self):
        bin_ = VENVS / self.venv / "bin"
        self.lighthouse = self.popen(
            [str(bin_ / "torchft_lighthouse"), "--min_replicas", "2", "--bind",
             f"127.0.0.1:{self.port}", "--quorum_tick_ms", "100", "--join_timeout_ms",
             "10000"], self.d, self.env(self.marker), "lighthouse")

    def start_replica(self, r):
        env = self.env(self.marker)
        env.update(TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{self.port}", REPLICA_GROUP_ID=str(r),
                   TORCHFT_QUORUM_RETRIES="10")
        self.replicas[r] = self.popen([self.python(), str(HERE / "train_torchft.py")] +
                                      self.train_args(self.d), self.d, env, f"replica{r}")

    def done(self):
        return all(p.poll() is not None for p in self.replicas.values())

    def result(self):
        codes = [p.poll() for p in self.replicas.values()]
        if any(c is None for c in codes):
            return None
        return next((c for c in codes if c != 0), 0)

    def controller(self):
        return self.lighthouse.pid

    def services(self):
        return [self.lighthouse.pid]

    def on_worker_killed(self, d, marker, pid):
        for r, p in self.replicas.items():
            if p.pid == pid:
                p.wait(timeout=10)
                self.start_replica(r)

    def on_controller_killed(self, d, marker):
        self.lighthouse.wait(timeout=10)
        self.start_lighthouse()

    def grow(self, d, marker):
        for r in range(len(self.replicas), WORKERS):
            self.start_replica(r)


class Torchrun(System):
    """torchrun (torch 2.15, the project's .venv) with train_ddp.py: DDP on Gloo, a checkpoint
    at every epoch's end as torchrun's docs advise; every worker restarted after a failure.
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: without it torch 2.15's restarted workers dial the
    Gloo ports of the attempt before (bench/torch_recovery_bench says why)."""
    name = "torchrun"
    venv = None

    def launcher(self, d):
        return [self.python(), "-m", "torch.distributed.run", "--nnodes", "1:1",
                "--nproc_per_node", str(WORKERS), "--max_restarts", "3", "--rdzv_backend",
                "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}"]

    def checkpoint(self, d):
        return ["--checkpoint", os.path.join(d, "ckpt.pt")]

    script = "train_ddp.py"

    def start(self, d, marker, size):
        env = self.env(marker)
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        cmd = self.launcher(d) + [str(HERE / self.script)] + self.train_args(d) + \
            self.checkpoint(d)
        self.popen(cmd, d, env, "launcher")


class DLRover(Torchrun):
    """dlrover-run --standalone (its own master as a child process) with train_dlrover.py:
    DDP, dlrover's flash checkpoint (to memory after every step, to disk at each epoch's end)
    and its ElasticDistributedSampler's position in the checkpoint."""
    name = "DLRover"
    venv = "dlrover"
    script = "train_dlrover.py"

    def launcher(self, d):
        return [str(VENVS / self.venv / "bin" / "dlrover-run"), "--standalone", "--nnodes=1",
                f"--nproc_per_node={WORKERS}", "--max_restarts=3"]

    def checkpoint(self, d):
        return ["--checkpoint", os.path.join(d, "ckpt")]

    def controller(self):
        """Its master, started by dlrover-run --standalone."""
        for pid in descendants(self.procs[0].pid):
            if "dlrover.python.master.main" in cmdline(pid):
                return pid
        return self.procs[0].pid


class NVRx(Torchrun):
    """nvidia-resiliency-ext's ft_launcher (0.4.1: 0.7.0 has no wheel for this machine's
    glibc), torchrun's launcher with its fault-tolerance additions, running train_ddp.py
    unchanged (no rank heartbeats: the script does not use its client API)."""
    name = "NVRx ft_launcher"
    venv = "nvrx"

    def launcher(self, d):
        return [str(VENVS / self.venv / "bin" / "ft_launcher"), "--nnodes", "1:1",
                "--nproc-per-node", str(WORKERS), "--max-restarts", "3", "--rdzv-backend",
                "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]


NAMES = {"elastic": Elastic, "elastic-hvd": ElasticHorovod, "horovod": Horovod,
         "torchft": TorchFT, "torchrun": Torchrun, "dlrover": DLRover, "nvrx": NVRx}


def wait_rows(prefix, pred, deadline, system):
    """The ledger's rows once pred(rows) holds; None at the deadline or when the run ended."""
    while time.monotonic() < deadline:
        rows, _ = peerledger.read(prefix)
        if pred(rows):
            return rows
        if system.done():
            rows, _ = peerledger.read(prefix)
            return rows if pred(rows) else None
        time.sleep(0.02)
    return None


def stop_all(system, marker):
    """Ends what the run left: every process group it started, then anything with its marker.
    Returns the pids that were still running with the marker once the run had ended."""
    left = [p for p in marked(marker) if p not in system.services()]
    system.left_cmds = [cmdline(pid)[:160] for pid in left]
    for p in system.procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    for pid in marked(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def victim(rows):
    """The pid of the highest-ranked worker of the newest step written."""
    last = max(r["step"] for r in rows)
    mine = [r for r in rows if r["step"] == last]
    return max(mine, key=lambda r: r["rank"])["pid"]


def run_one(system, scenario, args, base):
    d = tempfile.mkdtemp(prefix=f"{scenario}-", dir=base)
    os.makedirs(os.path.join(d, "ledger"))
    prefix = os.path.join(d, "ledger", "book")
    marker = uuid.uuid4().hex
    res = {"system": system.name, "scenario": scenario, "dir": d}
    size = 2 if scenario == "grow" else WORKERS
    t0 = time.time()
    deadline = time.monotonic() + args.timeout
    system.procs = []
    system.scenario = scenario
    try:
        system.start(d, marker, size)
        rows = wait_rows(prefix, lambda rs: bool(rs), deadline, system)
        if rows is None:
            res["error"] = "no step before the run ended or timed out"
            return res
        res["first_step"] = peerledger.first_step(rows) - t0
        if scenario in ("kill", "controller"):
            rows = wait_rows(prefix, lambda rs: max(r["step"] for r in rs) >= args.kill_at,
                             deadline, system)
            if rows is None:
                res["error"] = f"step {args.kill_at} never came"
                return res
            t_fault = time.time()
            if scenario == "kill":
                pid = victim(rows)
                os.kill(pid, signal.SIGKILL)
                system.on_worker_killed(d, marker, pid)
            else:
                pid = system.controller()
                os.kill(pid, signal.SIGKILL)
                system.on_controller_killed(d, marker)
            res["t_fault"] = t_fault
            res["victim"] = pid
        if scenario == "grow":
            rows = wait_rows(prefix, lambda rs: max(r["step"] for r in rs) >= 8, deadline,
                             system)
            if rows is None:
                res["error"] = "step 8 never came"
                return res
            res["t_fault"] = time.time()
            system.grow(d, marker)
        # Until the command has ended and, within --grace seconds of that, every process of
        # the run; a run whose workers outlive their command (its controller killed) is
        # watched until they end, or write no step for --stall-limit seconds.
        ended_at = None
        while time.monotonic() < deadline:
            if ended_at is None and system.done():
                ended_at = time.monotonic()
            if ended_at is not None:
                alive = [p for p in marked(marker) if p not in system.services()]
                if not alive:
                    break
                if scenario != "controller" and time.monotonic() - ended_at > args.grace:
                    break
            if scenario == "controller" and "t_fault" in res:
                # No step for --stall-limit: the command or its workers linger (DLRover's
                # agent, once its master is gone, waits minutes at its exit barrier). The
                # script's own end (rank 0 saves the final weights last) tells a run that
                # stopped training from one whose processes linger after it.
                rows, _ = peerledger.read(prefix)
                last = max([r["t"] for r in rows] + [res["t_fault"]])
                if time.time() - last > args.stall_limit:
                    if os.path.exists(os.path.join(d, "final.pt")):
                        res["lingered"] = True
                    else:
                        res["stalled"] = True
                    break
            time.sleep(0.1)
        res["rc"] = system.result()
        if res["rc"] is None:
            res["error"] = f"still running after {args.timeout:.0f} s"
    finally:
        res["left_running"] = len(stop_all(system, marker))
        res["left_cmds"] = system.left_cmds
    rows, bad = peerledger.read(prefix)
    res["bad_lines"] = bad
    res["verdict"] = peerledger.judge(rows, SAMPLES,
                                      args.epochs * (2 if scenario == "grow" else 1))
    res["last_step_at"] = rows[-1]["t"] - t0 if rows else None
    if "t_fault" in res:
        tf = res["t_fault"]
        if scenario == "grow":
            back = next((r["t"] for r in rows if r["t"] > tf and r["size"] >= WORKERS), None)
            res["to_full"] = None if back is None else back - tf
        else:
            reformed, back = peerledger.after_fault(rows, tf, res["victim"], WORKERS)
            res["to_next_step"] = None if reformed is None else reformed - tf
            res["to_full"] = None if back is None else back - tf
            res["stall"] = peerledger.stall(rows, tf)
    if scenario == "clean" and rows:
        start = rows[min(len(rows) - 1, 5 * WORKERS)]["t"]
        res["samples_per_s"] = peerledger.throughput(rows, start, rows[-1]["t"])
    res["final"] = os.path.join(d, "final.pt") if os.path.exists(
        os.path.join(d, "final.pt")) else None
    return res


def compare_models(python, a, b):
    """The largest absolute difference between two saved state_dicts (in the system's venv)."""
    code = ("import sys, torch; a = torch.load(sys.argv[1]); b = torch.load(sys.argv[2]); "
            "print(max((a[k] - b[k]).abs().max().item() for k in a))")
    out = subprocess.run([python, "-c", code, a, b], capture_output=True, text=True,
                         timeout=120)
    try:
        return float(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def progress(i, total, res):
    what = ", ".join(f"{k} {res[k]:.3f} s" for k in ("first_step", "to_next_step", "to_full",
                                                    "stall") if res.get(k) is not None)
    v = res.get("verdict", {})
    print(f"[peers] {i}/{total} {res['system']} {res['scenario']}: rc {res.get('rc')}, {what}"
          f"; twice {v.get('twice')}, never {v.get('never')}, left running "
          f"{res.get('left_running')}" + ("; STALLED" if res.get("stalled") else "") +
          ("; training done, processes lingered" if res.get("lingered") else "") +
          (f"; ERROR {res['error']}" if "error" in res else ""),
          flush=True)


def run_all(args):
    chosen = list(NAMES) if args.systems == "all" else args.systems.split(",")
    systems = []
    for n in chosen:
        if n not in NAMES:
            sys.exit(f"run.py: unknown system {n!r}; known: {', '.join(NAMES)}")
        s = NAMES[n](args)
        if s.available():
            systems.append(s)
        else:
            print(f"[peers] {s.name}: not installed ({s.python()} missing); run "
                  f"bench/peers/setup.sh", flush=True)
    scenarios = args.scenarios.split(",")
    os.makedirs(args.out, exist_ok=True)
    base = tempfile.mkdtemp(prefix="peers-")
    plan = []
    for rep in range(args.repeat):
        order = systems if rep % 2 == 0 else systems[::-1]
        for sc in scenarios:
            for s in order:
                if sc == "grow" and not s.grows:
                    continue
                plan.append((rep, sc, s))
    results = []
    for i, (rep, sc, s) in enumerate(plan, 1):
        res = run_one(s, sc, args, base)
        res["repeat"] = rep
        results.append(res)
        progress(i, len(plan), res)
    # Final models against the same system's fault-free run of the same repeat.
    for r in results:
        # (A grow run trains twice the epochs: no fault-free run to compare it with.)
        if r["scenario"] in ("clean", "grow") or not r.get("final"):
            continue
        ref = next((c for c in results if c["scenario"] == "clean" and
                    c["system"] == r["system"] and c.get("final")), None)
        if ref:
            sys_ = next(s for s in systems if s.name == r["system"])
            r["model_diff"] = compare_models(sys_.python(), ref["final"], r["final"])
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = os.path.join(args.out, f"peers-{stamp}.json")
    with open(path, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)
    print(f"[peers] results: {path}", flush=True)
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--systems", default="all")
    p.add_argument("--scenarios", default="clean,kill,controller,grow")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--step-ms", type=int, default=20)
    p.add_argument("--kill-at", type=int, default=48, help="the step after which a fault is sent")
    p.add_argument("--timeout", type=float, default=240, help="seconds a run may take")
    p.add_argument("--grace", type=float, default=5,
                   help="seconds the processes of a run may take to end after its command")
    p.add_argument("--stall-limit", type=float, default=20,
                   help="a run whose controller was killed is over after this long without a step")
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--keep", action="store_true", help="keep each run's folder")
    args = p.parse_args()
    run_all(args)


if __name__ == "__main__":
    main()
