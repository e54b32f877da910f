"""Helpers for the end-to-end tests: run elastic-run, wait for output lines, check processes."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import ledger

PY = sys.executable  # the environment scripts/test.sh installs the package into


def py_env():
    """The environment of a Python worker: this one's, with ELASTIC_PYTHONPATH (a build tree
    instead of the install) as PYTHONPATH when it is set."""
    env = dict(os.environ)
    extra = os.environ.get("ELASTIC_PYTHONPATH")
    if extra:
        env["PYTHONPATH"] = extra
    return env


def max_diff(a_path, b_path):
    """The largest difference between two saved torch state_dicts' tensors."""
    import torch
    a, b = torch.load(a_path), torch.load(b_path)
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


class Job:
    """elastic-run in the background; its output lines are collected as they come."""

    def __init__(self, args, env=None, cwd=None):
        self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=env, cwd=cwd, start_new_session=True)
        self.lines = []
        self.cond = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            with self.cond:
                self.lines.append(line.rstrip("\n"))
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait_for(self, pattern, count=1, timeout=60):
        """Waits until `count` lines match `pattern`; returns the matches."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                found = [m for m in (rx.search(l) for l in self.lines) if m]
                if len(found) >= count:
                    return found
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self.reader.is_alive()):
                    raise AssertionError(
                        f"wanted {count} line(s) matching {pattern!r}; output:\n" + self.text())
                self.cond.wait(min(left, 0.5))

    def wait(self, timeout=120):
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
            self.proc.wait()
            raise AssertionError("elastic-run did not finish in time; output:\n" + self.text())
        self.reader.join(10)
        return rc

    def text(self):
        return "\n".join(self.lines)

    def kill(self):
        """SIGKILL of the whole job: the driver's process group and its local workers' (each
        in a group of its own, and riding out a driver that dies alone, --driver-timeout)."""
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)
            self.proc.wait()


def descendants(pid):
    """Pids of every live descendant of `pid`, from /proc's parent links."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_tree(leader):
    """SIGKILL of the process group `leader` leads and of every group its descendants lead or
    belong to (never this process's own). The group is stopped first, so that it starts
    nothing new while its descendants are found."""
    try:
        os.killpg(leader, signal.SIGSTOP)
    except ProcessLookupError:
        return
    groups = {leader}
    for p in descendants(leader):
        try:
            groups.add(os.getpgid(p))
        except ProcessLookupError:
            pass
    groups.discard(os.getpgrp())
    for g in groups:
        try:
            os.killpg(g, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run(args, timeout=120, env=None):
    """Runs elastic-run to its end; returns (exit code, output)."""
    p = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=timeout, env=env)
    return p.returncode, p.stdout


def pid_alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone, or going while read
        return False


def wait_gone(pids, timeout=15):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if pid_alive(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return [p for p in pids if pid_alive(p)]


def procs_with_marker(marker, name="ELASTIC_TEST_MARK"):
    """Pids of the live processes whose environment holds name=marker, found by scanning
    /proc (the oracle for leftover processes: it does not ask the driver)."""
    want = f"{name}={marker}".encode()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:  # gone meanwhile, or a kernel thread
            continue
        if want in env and pid_alive(int(entry)):
            out.append(int(entry))
    return out


def wait_no_marker(marker, timeout=30):
    """Waits until no process carries the marker; returns those still there at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = procs_with_marker(marker)
        if not left:
            return []
        time.sleep(0.1)
    return procs_with_marker(marker)


def token_on_a_command_line(token):
    """Pids whose command line holds `token` (any process of this machine; `ps` shows command
    lines to every user, so a secret must never be on one)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if token in f.read():
                    out.append(int(entry))
        except OSError:
            continue
    return out


def job_token_of(pid, name=b"ELASTIC_JOB_TOKEN"):
    """The job token in a worker's environment (read from /proc, as any local root could);
    with `name`, another of its secrets (ELASTIC_JOB_TLS)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    token = env[name]
    assert len(token) >= 32, token
    return token


def end_jobs(marker, *jobs):
    """Every process of a test gone: its drivers (Jobs, None ones skipped), and every process
    with its marker in the environment (the workers of a killed driver, which would otherwise
    wait --driver-timeout for one); asserts that none is left 15 s later."""
    for job in jobs:
        if job:
            job.kill()
    for pid in procs_with_marker(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not wait_no_marker(marker, timeout=15)


# The event log (moved from test_elastic.py).
class Discovery:
    """A discovery script that prints a file; the test rewrites the file."""

    def __init__(self, tmp_path, hosts):
        self.file = tmp_path / "hosts.txt"
        self.script = tmp_path / "discover.sh"
        self.script.write_text(f"#!/bin/sh\ncat {self.file}\n")
        self.script.chmod(0o755)
        self.set(hosts)

    def set(self, hosts):
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(hosts + "\n")
        os.replace(tmp, self.file)


def events(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


def wait_event(path, pred, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in events(path):
            if pred(e):
                return e
        time.sleep(0.05)
    raise AssertionError(f"no matching event in {path}: {events(path)[-10:]}")


def worker_pid(log, slot):
    starts = [e for e in events(log) if e["event"] == "worker_started" and e["slot"] == slot]
    return starts[-1]["pid"]


# The event log's schema as the README documents it: event -> {field: type or tuple of types}.
INT, NUM, STR, BOOL, NULL, LIST = int, (int, float), str, bool, type(None), list
EVENT_SCHEMA = {
    "discovery": {"ok": BOOL},
    "host_added": {"host": STR}, "host_removed": {"host": STR},
    "host_changed": {"host": STR, "slots": INT},
    "host_blacklisted": {"host": STR, "cooldown": (int, float, NULL)},
    "waiting_for_hosts": {"available": INT, "needed": INT},
    "round_proposed": {"round": INT, "members": LIST, "removed": LIST, "reason": STR},
    "round_withdrawn": {"round": INT, "reason": STR},
    "fence": {"round": INT, "reason": STR},
    "round_formed": {"round": INT, "members": LIST, "versions": LIST, "version": INT,
                     "sync_required": BOOL},
    "worker_started": {"slot": STR, "pid": INT, "spare": BOOL},
    "spare_promoted": {"slot": STR, "round": INT},
    "worker_start_failed": {"slot": STR, "error": STR},
    "committed": {"slot": STR, "round": INT, "version": INT, "step": INT,
                  "epoch": (int, NULL), "cursor": (int, NULL), "samples": (int, NULL)},
    "worker_lost": {"slot": STR, "rank": (int, NULL)},
    "worker_leaving": {"slot": STR, "rank": (int, NULL), "reason": STR},
    "member_left": {"slot": STR, "round": INT},
    "worker_exited": {"slot": STR, "rank": (int, NULL), "round": INT, "code": INT,
                      "status": STR},
    "recovery_phase": {"phase": STR, "seconds": NUM},
    "holder_kept": {"slot": STR, "version": INT},
    "state_lost": {"round": INT, "newest_committed": INT, "members": LIST, "start_over": BOOL},
    "job_ending": {"code": INT, "message": STR}, "job_ended": {"code": INT, "message": STR},
    "worker_hung": {"slot": STR, "rank": (int, NULL), "host": STR, "pid": INT, "step": INT,
                    "reason": STR},
    "round_hung": {"round": INT, "seconds": NUM},
    "round_failed": {"round": INT, "size": INT, "slot": STR, "message": STR},
    "checkpoint_written": {"slot": STR, "version": INT, "step": INT, "epoch": (int, NULL),
                           "path": STR, "seconds": NUM},
    "checkpoint_failed": {"slot": STR, "version": INT, "message": STR},
    "state_restored": {"round": INT, "slot": STR, "version": INT, "step": INT,
                       "epoch": (int, NULL), "cursor": (int, NULL), "path": STR,
                       "state_lost": BOOL, "steps_lost": INT},
    "driver_resumed": {"resumed": BOOL, "outage_seconds": NUM},
    "stacks_dumped": {"slot": STR, "pid": INT, "seconds": NUM},
    "leading": {"store": STR, "standby": BOOL},
    "leadership_lost": {"reason": STR},
    "newcomer_started": {"slot": STR, "reason": STR},
    "newcomer_ready": {"slot": STR, "seconds": NUM},
    "newcomer_placed": {"slot": STR, "round": INT},
    "straggler": {"slot": STR, "rank": INT, "host": STR, "compute_seconds": NUM,
                  "wait_seconds": NUM, "median_seconds": NUM, "ratio": NUM, "window": INT,
                  "action": STR, "decision": STR, "reason": STR,
                  "steps_per_second_now": NUM, "steps_per_second_after": NUM},
    "straggler_cleared": {"slot": STR, "rank": INT, "host": STR, "compute_seconds": NUM,
                          "wait_seconds": NUM, "median_seconds": NUM, "ratio": NUM,
                          "window": INT},
    "progress": {"round": INT, "size": INT, "step": (int, NULL), "epoch": (int, NULL),
                 "samples": (int, NULL), "samples_per_second": (int, float, NULL),
                 "steps_per_second": (int, float, NULL)},
}


def check_event_schema(log, stragglers=False):
    """Every event of the log has its fields, of their types. Unless the test made one, no
    worker was named a straggler: a kill, a stop, a scale-up or a restart is not one."""
    for e in events(log):
        assert stragglers or e["event"] != "straggler", e
        assert isinstance(e["ts"], float) and e["event"] in EVENT_SCHEMA, e
        for field, kind in EVENT_SCHEMA[e["event"]].items():
            assert field in e and isinstance(e[field], kind), (field, e)
            if kind is INT or kind == (int, NULL):
                assert not isinstance(e[field], bool), (field, e)
        if "slot" in e:
            assert re.fullmatch(r"[^\s:]+:\d+", e["slot"]), e


# Python workers (moved from test_python_api.py).
HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(HERE, "workers")


# Workers that outlive their driver (moved from test_driver_outage.py).
def marked_env(marker, **extra):
    env = dict(os.environ)
    env["ELASTIC_TEST_MARK"] = marker
    env.update(extra)
    return env


def workers(marker, slot=None):
    """The live worker processes of the test (the marker, and a slot, in their environment:
    the driver has the marker alone), found in /proc."""
    want = b"ELASTIC_SLOT=" + (slot.encode() + b"\0" if slot else b"")
    out = []
    for pid in procs_with_marker(marker):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read()
        except OSError:
            continue
        if (b"\0" + want) in env or env.startswith(want):
            out.append(pid)
    return sorted(out)


def wait_workers(marker, n, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = workers(marker)
        if len(pids) >= n:
            return sorted(pids)
        time.sleep(0.1)
    raise AssertionError(f"{n} workers never started: {workers(marker)}")


def kill_driver(job):
    """SIGKILL of elastic-run alone (its workers are in process groups of their own)."""
    os.kill(job.proc.pid, signal.SIGKILL)
    job.proc.wait(10)
    return time.time()


# `elastic-run status` and the Prometheus endpoint (moved from test_operations.py).
METRIC_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (-?[0-9.e+-]+|\+Inf|NaN)$')


def scrape(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            assert line.startswith("# HELP ") or line.startswith("# TYPE ") or not line, line
            continue
        m = METRIC_LINE.match(line)
        assert m, f"not Prometheus text: {line!r}"
        values[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return values


def status(elastic_run, job_file, *extra):
    return subprocess.run([elastic_run, "status", "--job-file", job_file, *extra],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=30)


def cpp_fault_free(elastic_run, example, *args):
    """The hash of the C++ example's fault-free model (bit for bit the same at any number of
    workers), as "hash HEX"."""
    rc, out = run([elastic_run, "-np", "2", example] + list(args))
    assert rc == 0, out
    return "hash " + ledger.final_hash(out)


def py_fault_free(elastic_run, tmp_path, epochs):
    """The final weights of workers/train_state.py's fault-free run of `epochs` epochs."""
    rc, out = run([elastic_run, "-np", "2", PY, os.path.join(WORKERS, "train_state.py"),
                   str(epochs), str(tmp_path / "ff")], env=py_env(), timeout=180)
    assert rc == 0, out
    return out.split("final weights ")[1].split()[0]
