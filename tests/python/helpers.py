"""Helpers for the end-to-end tests: run elastic-run, wait for output lines, check processes."""
import os
import re
import signal
import subprocess
import sys
import threading
import time

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
