"""The peers benchmark's judge: reads the ledgers every training script of bench/peers writes
(bench/peers/common.py: one JSON line per applied step per process) and says, for any of the
systems alike, what the final model was trained on and how long a fault kept training
stopped. It trusts nothing a system reports about itself: only the lines the training
scripts wrote, and the time the benchmark sent its fault.

What the final model was trained on (`lineage`): a step that was rolled back (its effect
lost when the workers went back to a checkpoint or a commit) and trained again is written
again, with its old step number, later. So, per step number, the lines written are split into
attempts (in time order, a new attempt begins where a rank that already wrote this step in
the current attempt writes it again, or after a pause longer than `gap` seconds), and only the
last attempt counts. Per epoch, the samples of the counted lines are compared with the data
set: trained twice (or more) and never trained.

Plain Python, no torch: it runs in the project's CI (tests/python/test_peer_ledger.py).
"""
import collections
import glob
import json
import os


def read(prefix):
    """Every line of the files `<prefix>.<pid>`, sorted by time, and how many lines could not
    be read (a line cut short by a kill)."""
    rows, bad = [], 0
    for path in sorted(glob.glob(glob.escape(prefix) + ".*")):
        if path.endswith((".tmp", ".pt")) or not os.path.isfile(path):
            continue
        with open(path, errors="replace") as f:
            for line in f:
                try:
                    r = json.loads(line)
                    row = {"t": float(r["t"]), "pid": int(r["pid"]), "epoch": int(r["epoch"]),
                           "step": int(r["step"]), "rank": int(r["rank"]),
                           "size": int(r["size"]), "idx": [int(i) for i in r["idx"]]}
                except (ValueError, KeyError, TypeError):
                    bad += 1
                    continue
                rows.append(row)
    rows.sort(key=lambda r: r["t"])
    return rows, bad


def lineage(rows, gap=0.25):
    """The lines of the last attempt of every step (see the module's docstring), by step."""
    by_step = collections.defaultdict(list)
    for r in rows:
        by_step[r["step"]].append(r)
    out = {}
    for step, lines in by_step.items():
        lines.sort(key=lambda r: r["t"])
        attempt, ranks = [], set()
        for r in lines:
            if attempt and (r["rank"] in ranks or r["t"] - attempt[-1]["t"] > gap):
                attempt, ranks = [], set()
            attempt.append(r)
            ranks.add(r["rank"])
        out[step] = attempt
    return dict(sorted(out.items()))


def judge(rows, samples, epochs, gap=0.25):
    """Per epoch: samples trained twice or more in the final model's history (`twice`: how
    many samples, `extra`: how many trainings beyond the first), never trained (`never`), and
    sample-trainings lost to rollbacks (`redone`). Also: steps whose last attempt is not one
    line from each rank 0..size-1 (`incomplete`), and the number of steps."""
    kept = lineage(rows, gap)
    counted = {id(r) for lines in kept.values() for r in lines}
    per = {e: collections.Counter() for e in range(epochs)}
    redone = collections.Counter()
    for r in rows:
        if id(r) in counted:
            per.setdefault(r["epoch"], collections.Counter()).update(r["idx"])
        else:
            redone[r["epoch"]] += len(r["idx"])
    incomplete = []
    for step, lines in kept.items():
        size = lines[-1]["size"]
        if sorted(r["rank"] for r in lines) != list(range(size)):
            incomplete.append(step)
    result = {"steps": len(kept), "incomplete": incomplete, "epochs": []}
    for e in sorted(per):
        c = per[e]
        result["epochs"].append({
            "epoch": e,
            "twice": sum(1 for n in c.values() if n > 1),
            "extra": sum(n - 1 for n in c.values() if n > 1),
            "never": sum(1 for i in range(samples) if c[i] == 0),
            "outside": sum(1 for i in c if not 0 <= i < samples),
            "redone": redone[e]})
    for key in ("twice", "extra", "never", "redone"):
        result[key] = sum(x[key] for x in result["epochs"])
    return result


def first_step(rows):
    """The time of the first line (any process's first applied step), or None."""
    return rows[0]["t"] if rows else None


def after_fault(rows, t_fault, victim_pid, full_size):
    """What followed a fault sent at `t_fault` that took out the process `victim_pid`:
    (the time of the first step completed by the workers as re-formed, the time from which
    `full_size` processes stepped together again), None where it never happened.

    A line after the fault counts as the re-formed job's when it is not the completion of a
    step that was already under way: a survivor's line for the step after the last one
    written before the fault (or a late line for that last one) at the old size, from a
    process that was running before, is not; a line at another size, from a process started
    after the fault, or for a step number written before (a rollback) is."""
    before = [r for r in rows if r["t"] <= t_fault]
    after = [r for r in rows if r["t"] > t_fault]
    if not before:
        return None, None
    old_pids = {r["pid"] for r in before}
    last = max(r["step"] for r in before)
    old_size = max(r["size"] for r in before if r["step"] == last)
    written = {(r["step"], r["rank"]) for r in before}
    reformed = None
    for r in after:
        in_flight = (r["pid"] in old_pids and r["pid"] != victim_pid and r["size"] == old_size
                     and r["step"] in (last, last + 1) and (r["step"], r["rank"]) not in written)
        if not in_flight:
            reformed = r["t"]
            break
    back = None
    if reformed is not None:
        for r in after:
            if r["t"] >= reformed and r["size"] >= full_size:
                back = r["t"]
                break
    return reformed, back


def throughput(rows, start, end):
    """Samples trained per second between times start and end: every line's samples (the
    whole job's), rolled-back steps included, so it is the rate of the machine's work."""
    n = sum(len(r["idx"]) for r in rows if start < r["t"] <= end)
    return n / (end - start) if end > start else None


def stall(rows, t_fault):
    """The longest time without any step line from `t_fault` to the last line (seconds), and
    whether any line came after the fault at all."""
    times = [t_fault] + [r["t"] for r in rows if r["t"] > t_fault]
    if len(times) == 1:
        return None
    return max(b - a for a, b in zip(times, times[1:]))
