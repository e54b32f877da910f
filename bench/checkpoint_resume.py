#!/usr/bin/env python3
"""Resume from a checkpoint against a start without one: the time from `elastic-run` starting
to rank 0's first step, at 4 workers, for a tracked state of --mib MiB (bench/recovery_worker,
a commit after every step). Alternating repeats, medians.

    bench/checkpoint_resume.py [--build build] [--mib 1024] [--np 4] [--repeats 3]

"without": a fresh --checkpoint-dir (nothing to load: rank 0's initial state is synced).
"with": the folder holds a checkpoint of that state (written by a first job, kept), which rank
0 loads (reading and checking every byte) before the same sync.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time


def first_step(args, ckpt, stop):
    """Seconds from the start of elastic-run to rank 0's first step, and its output."""
    if os.path.exists(stop):
        os.unlink(stop)
    floats = args.mib * (1 << 20) // 4
    cmd = [args.elastic_run, "-np", str(args.np), "--checkpoint-dir", ckpt,
           "--checkpoint-interval", "3600", args.worker, stop, str(floats)]
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = None
    out = []
    for line in p.stdout:
        out.append(line)
        if first is None and '"event": "step"' in line:
            first = json.loads(line.split(":", 1)[1] if line.startswith("[") else line)["ts"] - t0
            open(stop, "w").close()
    p.wait(timeout=600)
    if first is None or p.returncode != 0:
        raise SystemExit(f"the job failed (exit {p.returncode}):\n" + "".join(out[-20:]))
    return first, "".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(os.path.dirname(__file__), "..", "build"))
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    args.elastic_run = os.path.join(args.build, "driver", "elastic-run")
    args.worker = os.path.join(args.build, "bench", "recovery_worker")
    tmp = tempfile.mkdtemp(prefix="elastic-resume-bench-", dir="/var/tmp")
    stop = os.path.join(tmp, "stop")
    try:
        kept = os.path.join(tmp, "kept")
        first_step(args, kept, stop)  # the first commit writes the checkpoint this bench loads
        versions = [n for n in os.listdir(kept) if n.startswith("v")]
        if not versions:
            raise SystemExit("the first job wrote no checkpoint")
        print(f"checkpoint_resume: {args.mib} MiB tracked state, {args.np} workers, "
              f"{args.repeats} alternating repeats")
        without, with_ = [], []
        for r in range(args.repeats):
            fresh = os.path.join(tmp, f"fresh-{r}")
            t, _ = first_step(args, fresh, stop)
            without.append(t)
            print(f"  run {r}: without a checkpoint {t:.2f} s", flush=True)
            t, out = first_step(args, kept, stop)
            if "resuming from checkpoint version" not in out:
                raise SystemExit("the job did not resume:\n" + out[-2000:])
            with_.append(t)
            print(f"  run {r}: from a checkpoint   {t:.2f} s", flush=True)
            shutil.rmtree(fresh, ignore_errors=True)
        a, b = statistics.median(with_), statistics.median(without)
        print(f"start to first step: from a checkpoint {a:.2f} s, without {b:.2f} s: "
              f"{a / b:.2f}x ({a - b:+.2f} s)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
