"""What every training script of the peers benchmark shares, so that the systems train the
same thing and one checker (peerledger.py) judges them all: the data, the model, the order
of the samples, the global batch, the loss, the ledger line and the final weights.

Needs torch only (each peer's venv has its own torch: 2.15, 2.8 or 2.0.1), so no numpy and no
scikit-learn: the data is made by torch's own generator, the sample order by Python's.

The task: 2048 samples of 32 features, labels from a fixed random linear teacher with noise
(10 classes), an MLP 32-64-10, SGD with momentum, a global batch of 64 samples (32 steps per
epoch), the loss of a step the mean over its global batch at any number of workers.

The ledger: every process appends one JSON line per training step it applied to its model
(after the optimizer step) to `<prefix>.<pid>`:

    {"t": unix time, "pid": ..., "epoch": e, "step": s, "rank": r, "size": k, "idx": [...]}

`step` counts the job's steps from 1 (a step redone after a rollback has the number it had),
`idx` are the samples this process trained in it, `size` is how many processes took part.
"""
import hashlib
import json
import os
import random
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

N, D, CLASSES, GLOBAL_BATCH = 2048, 32, 10, 64
STEPS_PER_EPOCH = (N + GLOBAL_BATCH - 1) // GLOBAL_BATCH


def add_args(p, epochs=6):
    p.add_argument("--epochs", type=int, default=epochs)
    p.add_argument("--step-ms", type=int, default=20,
                   help="extra time per step, as a larger model's compute would take")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--ledger", required=True, help="prefix of the per-process ledger files")
    p.add_argument("--out", default=None, help="where rank 0 saves the final weights")
    return p


def dataset():
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N, D, generator=g)
    teacher = torch.randn(D, CLASSES, generator=g)
    y = (x @ teacher + 0.5 * torch.randn(N, CLASSES, generator=g)).argmax(1)
    return x, y


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 64), nn.ReLU(), nn.Linear(64, CLASSES))


def epoch_order(epoch):
    order = list(range(N))
    random.Random(1000003 * (epoch + 1)).shuffle(order)
    return order


def global_batch(epoch, b):
    """The samples of step b (from 0) of `epoch`."""
    return epoch_order(epoch)[b * GLOBAL_BATCH:(b + 1) * GLOBAL_BATCH]


def shard(indices, rank, size):
    """Rank `rank`'s contiguous part of a global batch split among `size` processes."""
    per, extra = divmod(len(indices), size)
    start = rank * per + min(rank, extra)
    return indices[start:start + per + (1 if rank < extra else 0)]


def loss_of(model, x, y, idx, count, scale=1.0):
    """This process's part of a step's loss: the sum over its samples / `count` (the step's
    global number of samples), times `scale` (the world size under an averaging allreduce
    such as DDP's, so that the averaged gradient is the step's mean)."""
    if not idx:
        return sum(p.sum() * 0.0 for p in model.parameters())
    i = torch.tensor(idx)
    return F.cross_entropy(model(x[i]), y[i], reduction="sum") * (scale / count)


def pace(args):
    if args.step_ms:
        time.sleep(args.step_ms / 1000)


class Ledger:
    def __init__(self, prefix):
        self.f = open(f"{prefix}.{os.getpid()}", "a")

    def write(self, epoch, step, rank, size, idx):
        self.f.write(json.dumps({"t": time.time(), "pid": os.getpid(), "epoch": int(epoch),
                                 "step": int(step), "rank": int(rank), "size": int(size),
                                 "idx": [int(i) for i in idx]}) + "\n")
        self.f.flush()


def weights_hash(model):
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(bytes(t.detach().contiguous().cpu().flatten().view(torch.uint8).tolist()))
    return h.hexdigest()[:16]


def save_final(model, path, steps):
    h = weights_hash(model)
    print(f"final: {steps} steps, hash {h}", flush=True)
    if path:
        tmp = path + ".tmp"
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, tmp)
        os.replace(tmp, path)
