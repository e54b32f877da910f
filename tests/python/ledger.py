"""Checks of the promise that the example's ledger and final line make checkable: every sample
index of every epoch consumed by exactly one committed step, no silent restart, and the final
model bit for bit the fault-free one. Shared by the end-to-end tests and the chaos soak.

The example writes, per rank and step, before the step's allreduce:
    epoch step round rank size time_ms indices
A step that was rolled back and trained again appears again with a newer round; the lines of
a step's newest round are the ones its committed version consumed.
"""
import bisect
import collections
import glob
import re

FINAL = re.compile(r"final: (\d+) steps, loss ([\d.]+), w\[0..3\] = (.*), hash ([0-9a-f]{16})$",
                   re.M)

Line = collections.namedtuple("Line", "epoch step round rank size ts indices")


def final_hash(output):
    """The final model's hash printed by rank 0, or None."""
    m = FINAL.search(output)
    return m.group(4) if m else None


# Runs of one job (the same command started again after the whole job was killed, resuming
# from a checkpoint) count their rounds from 0 again: a later run's round supersedes any
# earlier run's, so each run's rounds are numbered after the ones before it.
RUN_ROUNDS = 1_000_000


def read(prefix, boundaries=()):
    """The ledger lines of `prefix`, or of a list of prefixes: the runs of one job, in order.
    A step a later run trained again (after resuming from a checkpoint older than the kill)
    supersedes the earlier run's lines of it, as a newer round does within a run. With one
    prefix that several runs wrote, `boundaries` (ms since the epoch, when each run's processes
    were all gone) says which run a line is from."""
    if isinstance(prefix, (list, tuple)):
        out = []
        for run, p in enumerate(prefix):
            out += [l._replace(round=run * RUN_ROUNDS + l.round) for l in read(p)]
        return out
    if boundaries:
        cuts = sorted(boundaries)
        return [l._replace(round=bisect.bisect(cuts, l.ts) * RUN_ROUNDS + l.round)
                for l in read(prefix)]
    lines = []
    for path in sorted(glob.glob(prefix + ".*")):
        lines += read_file(path)
    return lines


def read_file(path):
    """The lines of one process's ledger file."""
    with open(path) as f:
        texts = f.read().split("\n")
    # The last piece is what follows the last newline: empty for a file whose every line
    # ended, or a line whose write was cut short (a SIGKILL during a write that crossed a
    # page boundary stores its first part; a worker still writing it). Each file is one
    # process's, so only its last line can be cut: any other line must parse whole.
    return [parse(text, f"{path}:{number}") for number, text in enumerate(texts[:-1], 1)]


def parse(text, where):
    """One whole ledger line; a ValueError naming `where` for anything else."""
    parts = text.split(" ")
    try:
        if len(parts) != 7:
            raise ValueError(f"{len(parts)} fields, not 7")
        numbers = [int(x) for x in parts[:6]]
        idx = [int(x) for x in parts[6].split(",")] if parts[6] else []
    except ValueError as e:
        raise ValueError(f"{where}: not a ledger line ({e}): {text!r}") from None
    return Line(*numbers, idx)


def check(prefix, samples, epochs, max_rollback, boundaries=(), restarts=(),
          restart_window_ms=0):
    """Returns a list of violations (empty: the promise held). `prefix`: one run's ledger, or
    the list of a job's runs (see read(), and `boundaries` for one ledger of several runs).
    `restarts`: when the state was lost on purpose (the whole job, or every holder, killed;
    training goes on from a checkpoint), each a time or a (start, end) pair of times (ms since
    the epoch): the kill began at start and every target had been signalled by end. The first
    round whose first line is after end may resume further back, by at most the steps trained
    from `restart_window_ms` before start (the checkpoint interval and its write) to end, plus
    `max_rollback`. Rounds whose first line falls between start and end are the doomed
    processes' own: the kills are one after another, and the first targets' peers re-form in
    milliseconds (a soak's kill-all, seed 593144367) before their own kill.

    * every (epoch, step) has, in its newest round, exactly one line from every rank of that
      round (a step re-run inside one round, or committed without some rank, is a violation);
    * per epoch, the newest-round lines consume every index exactly once;
    * steps are numbered 1..N without gaps;
    * when a round starts, it resumes at most `max_rollback` steps behind the furthest step
      any earlier round reached (more is training silently restarted or state thrown away).
    """
    problems = []
    lines = read(prefix, boundaries)
    if not lines:
        return ["the ledger is empty"]
    by_step = collections.defaultdict(list)
    for l in lines:
        by_step[(l.epoch, l.step)].append(l)
    consumed = collections.defaultdict(list)
    for (epoch, step), entries in sorted(by_step.items()):
        newest = max(e.round for e in entries)
        mine = [e for e in entries if e.round == newest]
        ranks = sorted(e.rank for e in mine)
        if ranks != list(range(mine[0].size)):
            problems.append(f"epoch {epoch} step {step} round {newest}: lines from ranks "
                            f"{ranks}, wanted 0..{mine[0].size - 1} once each")
        for e in mine:
            consumed[epoch].extend(e.indices)
    if sorted(consumed) != list(range(epochs)):
        problems.append(f"epochs in the ledger: {sorted(consumed)}, wanted 0..{epochs - 1}")
    for epoch in range(epochs):
        counts = collections.Counter(consumed.get(epoch, []))
        twice = sorted(i for i, c in counts.items() if c > 1)
        missing = sorted(set(range(samples)) - set(counts))
        if twice or missing:
            problems.append(f"epoch {epoch}: {len(twice)} indices trained twice {twice[:5]}, "
                            f"{len(missing)} never {missing[:5]}")
    steps = sorted({s for (_, s) in by_step})
    if steps != list(range(1, len(steps) + 1)):
        problems.append(f"steps are not 1..{len(steps)} without gaps")
    first = {}
    last = {}
    for l in lines:
        first[l.round] = min(first.get(l.round, l.step), l.step)
        last[l.round] = max(last.get(l.round, l.step), l.step)
    first_ts = {}
    for l in lines:
        first_ts[l.round] = min(first_ts.get(l.round, l.ts), l.ts)
    allowance = {}  # round -> extra rollback allowed (the first round after a restart)
    for t in restarts:
        start, end = t if isinstance(t, (list, tuple)) else (t, t)
        after = [r for r in first_ts if first_ts[r] > end]
        if after:
            r = min(after, key=lambda x: first_ts[x])
            recent = {l.step for l in lines if start - restart_window_ms <= l.ts <= end}
            allowance[r] = max(allowance.get(r, 0), len(recent))
    furthest = 0
    for r in sorted(first):
        rollback = furthest - (first[r] - 1)
        if rollback > max_rollback + allowance.get(r, 0):
            problems.append(f"round {r} resumed at step {first[r]} after step {furthest} had "
                            f"been reached: {rollback} steps thrown away (at most "
                            f"{max_rollback + allowance.get(r, 0)} may be)")
        # After a restart the lineage is the checkpoint's: the lost steps are no longer ahead.
        furthest = last[r] if r in allowance else max(furthest, last[r])
    return problems


def longest_gap(prefix):
    """The longest time (s) between two consecutive ledger lines of the whole job."""
    ts = sorted(l.ts for l in read(prefix))
    gaps = [(b - a) / 1000.0 for a, b in zip(ts, ts[1:])]
    return max(gaps) if gaps else 0.0
