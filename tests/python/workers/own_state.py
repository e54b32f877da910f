"""Run by tests/python/test_checkpoint.py under elastic-run: a State subclass of the program's
own (a running sum as text) that writes and reads its checkpoint itself. Each step adds the
step's number to the sum on every rank and commits; after STEPS steps rank 0 prints
"own state: total T after S steps"."""
import sys
import time

import elastic

STEPS = int(sys.argv[1])


class Sum(elastic.State):
    def __init__(self):
        elastic.State.__init__(self)
        self.total, self.step = 0, 0
        self.save()

    def save(self):
        self._saved = (self.total, self.step)

    def restore(self):
        self.total, self.step = self._saved

    def sync(self, root_rank=0):
        version, self.total, self.step = elastic.broadcast_object(
            (self.version, self.total, self.step), root_rank)
        self.save()
        self._set_version(version)

    def checkpoint_files(self):
        return {"sum.txt": f"{self._saved[0]} {self._saved[1]}\n".encode()}

    def load_checkpoint(self, files):
        total, step = files["sum.txt"].decode().split()
        self.total, self.step = int(total), int(step)


@elastic.run
def train(state):
    while state.step < STEPS:
        state.step += 1
        state.total += state.step
        time.sleep(0.01)
        state.commit()


s = Sum()
train(s)
if elastic.rank() == 0:
    print(f"own state: total {s.total} after {s.step} steps", flush=True)
