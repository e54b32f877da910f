"""Prints how many modules the program's first torch optimizer imports after elastic.init():
none when init() warmed torch up before it reached the driver (elastic/__init__.py,
_warm_up_torch), which is what a new process's peers would otherwise wait for."""
import sys

import torch

import elastic

elastic.init()
before = set(sys.modules)
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
new = sorted(set(sys.modules) - before)
print(f"rank {elastic.rank()}: the first optimizer imported {len(new)} modules after init "
      f"{new[:3]}", flush=True)
