"""A small elastic training under @elastic.run with an ObjectState: a linear model on fixed
data, gradients summed in exact fixed point (int64 allreduce), so the final weights are bit for
bit the same at any size and under any faults. Each rank writes a ledger like the C++
example's. Prints "final weights HASH steps S" on rank 0.

    train_state.py EPOCHS LEDGER_PREFIX [--fail-at STEP] [--fail-all-at STEP] [--leave-at STEP]
                   [--hang-at STEP --hang-how sleep|stop] [--progress ok|raise]
                   [--print-steps]

--hang-at: the last rank of round 0 hangs before that step (sleeps forever inside the training
loop, or stops itself with SIGSTOP). --progress: the state defines progress() (its epoch and
cursor), or one that raises. --print-steps: every rank prints "step S rank R" after each step.
"""
import hashlib
import os
import signal
import sys
import time

import numpy as np

import elastic

EPOCHS = int(sys.argv[1])
LEDGER = sys.argv[2]
FAIL_AT = int(sys.argv[sys.argv.index("--fail-at") + 1]) if "--fail-at" in sys.argv else -1
FAIL_ALL_AT = int(sys.argv[sys.argv.index("--fail-all-at") + 1]) if "--fail-all-at" in sys.argv else -1
LEAVE_AT = int(sys.argv[sys.argv.index("--leave-at") + 1]) if "--leave-at" in sys.argv else -1
HANG_AT = int(sys.argv[sys.argv.index("--hang-at") + 1]) if "--hang-at" in sys.argv else -1
HANG_HOW = sys.argv[sys.argv.index("--hang-how") + 1] if "--hang-how" in sys.argv else "sleep"
PRINT_STEPS = "--print-steps" in sys.argv
N, D, GLOBAL = 512, 8, 32
rng = np.random.default_rng(5)
X = rng.normal(size=(N, D))
Y = X @ np.arange(1, D + 1) * 0.1 + rng.normal(size=N) * 0.01
FIXED = 2.0 ** 32

PROGRESS = sys.argv[sys.argv.index("--progress") + 1] if "--progress" in sys.argv else None


class Progressing(elastic.ObjectState):
    def progress(self):
        if PROGRESS == "raise":
            raise ValueError("no progress today")
        return (self.epoch, self.cursor, self.epoch * N + self.cursor, N)


state = (Progressing if PROGRESS else elastic.ObjectState)(w=np.zeros(D), epoch=0, cursor=0,
                                                             step=0)


@elastic.run
def train(state):
    ledger = open(f"{LEDGER}.{os.getpid()}", "a")
    while state.epoch < EPOCHS:
        r, n = elastic.rank(), elastic.size()
        order = np.random.default_rng(state.epoch).permutation(N)
        while state.cursor < N:
            take = order[state.cursor:state.cursor + GLOBAL]
            mine = take[r::n]
            ledger.write(f"{state.epoch} {state.step + 1} {_round()} {r} {n} "
                         f"{int(time.time() * 1000)} {','.join(map(str, mine))}\n")
            ledger.flush()
            if state.step + 1 == FAIL_AT and r == n - 1:
                raise RuntimeError("a bug in the user's training code")
            if state.step + 1 == FAIL_ALL_AT:
                raise ValueError(f"the same bug on every rank (rank {r} at step {state.step + 1})")
            if state.step + 1 == LEAVE_AT and r == n - 1 and elastic.current_round() == 0:
                elastic.leave("the test asked")
            if state.step + 1 == HANG_AT and r == n - 1 and elastic.current_round() == 0:
                print(f"hanging pid {os.getpid()}", flush=True)
                if HANG_HOW == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                time.sleep(3600)  # a deadlock, a stuck data loader...
            err = X[mine] @ state.w - Y[mine]
            grad = np.round(err[:, None] * X[mine] * FIXED).astype(np.int64).sum(0)
            elastic.allreduce_(grad, op=elastic.Sum)
            state.w = state.w - 0.05 * (grad / FIXED) / len(take)
            state.cursor += len(take)
            state.step += 1
            if PRINT_STEPS:
                print(f"step {state.step} rank {r}")  # PYTHONUNBUFFERED: one write per line
            time.sleep(0.01)
            if state.step % 3 == 0 or state.cursor >= N:
                state.commit()
        state.epoch += 1
        state.cursor = 0
        state.commit()
    return state.w


def _round():
    return elastic._C.assignment()["round"] if not elastic._local else 0


w = train(state)
if elastic.rank() == 0:
    print(f"final weights {hashlib.sha256(w.tobytes()).hexdigest()[:16]} steps {state.step}",
          flush=True)
