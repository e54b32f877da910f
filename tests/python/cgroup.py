"""A CPU quota for processes, to make a straggler from outside the product (a slow machine):
cgroup v1's cpu.cfs_quota_us under /sys/fs/cgroup/cpu, else v2's cpu.max. Used by
tests/python/test_stragglers.py and bench/straggler_bench."""
import os

CGROUP_V1 = "/sys/fs/cgroup/cpu"
CGROUP_V2 = "/sys/fs/cgroup"


class Throttle:
    """A cgroup holding processes to `share` of one CPU: v1's cpu.cfs_quota_us, else v2's
    cpu.max. Removed (its processes back in the root group) at the end."""

    def __init__(self, name, share):
        self.path = None
        period = 100000
        quota = int(period * share)
        v1 = os.path.join(CGROUP_V1, "cpu.cfs_quota_us")
        v2 = os.path.join(CGROUP_V2, "cgroup.controllers")
        try:
            if os.path.exists(v1):
                self.root = CGROUP_V1
                self.path = os.path.join(CGROUP_V1, name)
                os.makedirs(self.path, exist_ok=True)
                self._write("cpu.cfs_period_us", str(period))
                self._write("cpu.cfs_quota_us", str(quota))
            elif os.path.exists(v2) and "cpu" in open(v2).read().split():
                self.root = CGROUP_V2
                self.path = os.path.join(CGROUP_V2, name)
                os.makedirs(self.path, exist_ok=True)
                self._write("cpu.max", f"{quota} {period}")
        except OSError as e:
            self.close()
            raise RuntimeError(f"cannot make a CPU cgroup here ({e}): needs root") from e
        if self.path is None:
            raise RuntimeError("no cgroup CPU controller here")

    def _write(self, name, text):
        with open(os.path.join(self.path, name), "w") as f:
            f.write(text)

    def add(self, pid):
        self._write("cgroup.procs", str(pid))

    def close(self):
        if not self.path or not os.path.isdir(self.path):
            return
        try:
            with open(os.path.join(self.path, "cgroup.procs")) as f:
                pids = [p for p in f.read().split() if p]
            for pid in pids:
                try:
                    with open(os.path.join(self.root, "cgroup.procs"), "w") as f:
                        f.write(pid)
                except OSError:
                    pass  # gone meanwhile
            os.rmdir(self.path)
        except OSError:
            pass
