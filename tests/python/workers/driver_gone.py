"""A worker that trains until its agent ends (its driver killed, --driver-timeout passed) and
writes down, in MARKS.<rank>, how the end reached it: "SystemExit CODE" from @elastic.run,
"finally" from its finally block, "atexit" from its atexit handler.

    driver_gone.py MARKS [--carry-on]

--carry-on: the program catches the SystemExit and goes on (sleeps), as a program that ignores
the end would; the agent's last resort must end it.
"""
import atexit
import os
import sys
import time

import numpy as np

import elastic

MARKS = sys.argv[1]
CARRY_ON = "--carry-on" in sys.argv
elastic.init()
RANK = elastic.rank()


def mark(what):
    with open(f"{MARKS}.{RANK}", "a") as f:
        f.write(what + "\n")


atexit.register(mark, "atexit")
state = elastic.ObjectState(w=np.zeros(4), step=0)


@elastic.run
def train(state):
    while True:
        state.w = state.w + elastic.allreduce(np.ones(4))
        state.step += 1
        if state.step == 20:
            print(f"rank {elastic.rank()} trains", flush=True)
        time.sleep(0.005)
        state.commit()


try:
    train(state)
except SystemExit as e:
    mark(f"SystemExit {e.code}")
    if not CARRY_ON:
        raise
    mark("carrying on")
    time.sleep(600)
finally:
    mark("finally")
