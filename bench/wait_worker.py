"""wait_worker: what a rank costs while it waits in a collective for a late peer.

Under elastic-run (4 ranks on one host: the shared-memory allreduce): after one allreduce,
rank 3 sleeps --late seconds (default 4) before the next; ranks 0..2 wait in it. Each of them
prints the context switches of all its threads during that wait (voluntary and not, from
/proc/self/task/*/status), per second.

    elastic-run -np 4 /usr/bin/python3 bench/wait_worker.py [LATE_SECONDS]
"""
import os
import sys
import time

import numpy as np

import elastic
from procstat import context_switches  # bench/, this script's folder


def main():
    late = float(sys.argv[1]) if len(sys.argv) > 1 else 4.0
    elastic.init()
    x = np.ones(1024, dtype=np.float32)
    elastic.allreduce_(x)
    if elastic.rank() == elastic.size() - 1:
        time.sleep(late)
    s0, t0 = context_switches(os.getpid()), time.monotonic()
    elastic.allreduce_(x)
    s1, t1 = context_switches(os.getpid()), time.monotonic()
    if elastic.rank() != elastic.size() - 1:
        print(f"rank {elastic.rank()}: waited {t1 - t0:.2f} s, {s1 - s0} context switches, "
              f"{(s1 - s0) / (t1 - t0):.1f} per second", flush=True)


if __name__ == "__main__":
    main()
