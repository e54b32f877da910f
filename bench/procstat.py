"""What /proc says of a process, for the benchmarks (idle_bench, wait_worker.py)."""
import os


def context_switches(pid):
    """Context switches of all the threads of `pid` so far, voluntary and not (each is one
    wake-up or more)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        total += int(line.split()[1])
        except FileNotFoundError:
            pass  # a thread that ended meanwhile
    return total
