#!/usr/bin/env python3
"""Turns a results file of bench/peers/run.py into the comparison's tables (markdown, on
stdout) and a chart of the recovery times (PNG).

    bench/peers/report.py bench/peers/results/peers-YYYYMMDD-HHMMSS.json [--png docs/comparison.png]
    bench/peers/report.py all.json row-again.json     # the second file's rows replace the first's

Figures are medians over the repeats, with the range (min-max) beside them where there was
more than one; ratios are to elastic-run's median on the same row. A run that never reached
a figure (a job that stalled, a worker count never regained) shows why instead.
"""
import argparse
import json
import statistics
import sys

ORDER = ["elastic-run", "elastic-run (Horovod API)", "Horovod Elastic", "TorchFT", "torchrun",
         "DLRover", "NVRx ft_launcher"]
ANCHOR = "elastic-run"


def med(xs):
    return statistics.median(xs) if xs else None


def cell(xs, unit="s", digits=3, total=None, none="never"):
    """'median (min-max)' of the figures; with `total`, how many runs had none."""
    if not xs:
        return none if total else "–"
    m = med(xs)
    text = f"{m:.{digits}f} {unit}".strip()
    if len(xs) > 1:
        text += f" ({min(xs):.{digits}f}–{max(xs):.{digits}f})"
    if total and len(xs) < total:
        text += f", {none} in {total - len(xs)} of {total}"
    return text


def ratio(xs, anchor):
    if not xs or not anchor:
        return ""
    return f"{med(xs) / anchor:.0f}×" if med(xs) / anchor >= 10 else f"{med(xs) / anchor:.1f}×"


def figures(results, system, scenario, key):
    runs = [r for r in results if r["system"] == system and r["scenario"] == scenario]
    # A pause is only a pause when training went on to its end (the script saved its final
    # weights); a run whose training stopped for good has none.
    vals = [r[key] for r in runs if r.get(key) is not None and
            (key != "stall" or r.get("final"))]
    return vals, len(runs)


def systems_in(results):
    seen = {r["system"] for r in results}
    return [s for s in ORDER if s in seen] + sorted(seen - set(ORDER))


def timing_table(results):
    rows = [("command → first step", "clean", "first_step"),
            ("SIGKILL of 1 of 4 workers → the next step of the re-formed job", "kill",
             "to_next_step"),
            ("SIGKILL of 1 of 4 workers → 4 workers stepping again", "kill", "to_full"),
            ("2 workers, 2 more added → 4 workers stepping", "grow", "to_full"),
            ("controller SIGKILLed → longest pause in training", "controller", "stall")]
    systems = systems_in(results)
    out = ["| | " + " | ".join(systems) + " |", "| --- |" + " ---: |" * len(systems)]
    for label, sc, key in rows:
        anchor = med(figures(results, ANCHOR, sc, key)[0])
        cells = []
        for s in systems:
            vals, n = figures(results, s, sc, key)
            if n == 0:
                cells.append("not run")
                continue
            c = cell(vals, total=n,
                     none="training stopped" if sc == "controller" else "never")
            r = ratio(vals, anchor) if s != ANCHOR else ""
            cells.append(c + (f" **{r}**" if r else ""))
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    cells = []
    anchor = med(figures(results, ANCHOR, "clean", "samples_per_s")[0])
    for s in systems:
        vals, n = figures(results, s, "clean", "samples_per_s")
        c = cell(vals, unit="", digits=0, total=n) if n else "not run"
        if vals and anchor and s != ANCHOR:
            c += f" **{med(vals) / anchor:.2f}×**"
        cells.append(c)
    out.append("| steady training, samples/s (higher is better) | " + " | ".join(cells) + " |")
    return "\n".join(out)


def ended(r):
    """How a run ended, in a few words: the training script's own end (its final weights
    saved) and the command's exit status."""
    if r.get("stalled"):
        return "stalled"
    code = r.get("rc")
    cmd = ("exit 0" if code == 0 else "command killed" if code == -9 else
           "command still running" if code is None else f"exit {code}")
    if not r.get("final"):
        return f"failed ({cmd})"
    if r.get("lingered"):
        return f"trained; {r.get('left_running')} processes hung ({cmd})"
    return "exit 0" if code == 0 else f"trained ({cmd})"


def correctness_table(results):
    systems = systems_in(results)
    out = ["| | " + " | ".join(systems) + " |", "| --- |" + " --- |" * len(systems)]
    for sc, label in (("clean", "no fault"), ("kill", "worker SIGKILLed"),
                      ("controller", "controller SIGKILLed"), ("grow", "2 → 4 workers")):
        for what in ("ended", "twice", "never", "model", "left"):
            if sc == "clean" and what == "model":
                continue
            cells = []
            for s in systems:
                runs = [r for r in results if r["system"] == s and r["scenario"] == sc]
                if not runs:
                    cells.append("not run")
                    continue
                if what == "ended":
                    cells.append(", ".join(ended(r) for r in runs))
                elif what in ("twice", "never"):
                    cells.append(", ".join(str(r["verdict"][what]) for r in runs
                                           if "verdict" in r))
                elif what == "model" and sc == "grow":
                    cells.append("– (twice the epochs)")
                elif what == "model":
                    cells.append(", ".join(
                        "–" if r.get("model_diff") is None else
                        ("equal" if r["model_diff"] == 0 else f"{r['model_diff']:.1e}")
                        for r in runs))
                else:
                    cells.append(", ".join(str(r.get("left_running", "?")) for r in runs))
            name = {"ended": "how the run ended", "twice": "samples trained twice (all epochs)",
                    "never": "samples never trained (all epochs)",
                    "model": "final model: largest difference to its own fault-free run",
                    "left": "processes left running after the run"}[what]
            out.append(f"| {label}: {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def chart(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    systems = systems_in(results)
    metrics = [("kill", "to_next_step", "worker killed → next step"),
               ("kill", "to_full", "worker killed → 4 stepping again"),
               ("controller", "stall", "controller killed → longest pause")]
    fig, ax = plt.subplots(figsize=(10, 4.8))
    width = 0.8 / len(metrics)
    for j, (sc, key, label) in enumerate(metrics):
        xs, ys, lo, hi = [], [], [], []
        for i, s in enumerate(systems):
            vals, n = figures(results, s, sc, key)
            if not vals:
                continue
            m = med(vals)
            xs.append(i + (j - 1) * width)
            ys.append(m)
            lo.append(m - min(vals))
            hi.append(max(vals) - m)
        ax.bar(xs, ys, width, yerr=[lo, hi], label=label, capsize=3)
    ax.set_yscale("log")
    bottom = ax.get_ylim()[0]
    for j, (sc, key, label) in enumerate(metrics):
        for i, s in enumerate(systems):
            vals, n = figures(results, s, sc, key)
            if n and not vals:
                ax.text(i + (j - 1) * width, bottom * 1.3,
                        "stopped" if sc == "controller" else "never", rotation=90,
                        ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(systems)))
    ax.set_xticklabels([s.replace(" (", "\n(") for s in systems], fontsize=8)
    ax.set_ylabel("seconds (log scale; median, bars: range)")
    ax.set_title("Recovery, 4 workers on one 2-core machine (lower is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+",
                   help="results files of run.py; the runs of a later file replace those of "
                        "the same system and fault in the earlier ones (a row measured again)")
    p.add_argument("--png", default=None)
    args = p.parse_args()
    results = []
    for path in args.results:
        with open(path) as f:
            newer = json.load(f)["results"]
        again = {(r["system"], r["scenario"]) for r in newer}
        results = [r for r in results if (r["system"], r["scenario"]) not in again] + newer
    print(timing_table(results))
    print()
    print(correctness_table(results))
    # A run stopped by the benchmark once its training was over and its processes only
    # lingered has no error of its own ("still running" is what the table says).
    errors = [r for r in results if r.get("error") and not r.get("lingered")]
    for r in errors:
        print(f"\n- {r['system']} {r['scenario']} (repeat {r.get('repeat')}): {r['error']}")
    if args.png:
        chart(results, args.png)
        print(f"\nchart: {args.png}", file=sys.stderr)


if __name__ == "__main__":
    main()
