"""A Horovod elastic PyTorch script, as Horovod users write them, with one change: the import.
An MLP on scikit-learn's digits: hvd.elastic.ElasticSampler with a per-rank batch (the global
batch grows with the size, as in Horovod), hvd.DistributedOptimizer (op=Average, optional fp16
compression), hvd.elastic.TorchState(model, optimizer, train_sampler=..., epoch=..., batch=...),
a reset callback that rescales the learning rate by hvd.size(), a commit every few batches.

Beyond Horovod's API it writes the test's ledger (each step's sample indices, padding left out,
elastic.torch's padding_mask) and checks that HOROVOD_RANK/HOROVOD_SIZE follow the membership.
"""
import argparse
import hashlib
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits

import elastic.horovod.torch as hvd  # the one line a Horovod script changes

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=4)
p.add_argument("--batch-size", type=int, default=16)
p.add_argument("--lr", type=float, default=0.02)
p.add_argument("--batches-per-commit", type=int, default=3)
p.add_argument("--fp16-allreduce", action="store_true")
p.add_argument("--step-ms", type=int, default=0)
p.add_argument("--ledger", default=None)
# Before its last epoch the job waits until this file exists (every rank sees it, agreed by an
# allreduce), committing meanwhile so that membership changes go on: a test's faults then
# land while there is training left, however fast the steps are.
p.add_argument("--hold-file", default=None)
args = p.parse_args()

hvd.init()
torch.manual_seed(0)
torch.set_num_threads(1)

digits = load_digits()
x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
y = torch.tensor(digits.target, dtype=torch.int64)
order = torch.tensor(np.random.default_rng(0).permutation(len(y)))
train_set = torch.utils.data.TensorDataset(x[order[:1500]], y[order[:1500]])
x_test, y_test = x[order[1500:]], y[order[1500:]]

model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression, op=hvd.Average)
train_sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=0)


def check_env():
    got = (os.environ.get("HOROVOD_RANK"), os.environ.get("HOROVOD_SIZE"))
    want = (str(hvd.rank()), str(hvd.size()))
    if got != want:
        raise AssertionError(f"HOROVOD_RANK/SIZE {got}, hvd.rank()/size() {want}")


@hvd.elastic.run
def train(state):
    ledger = None
    if args.ledger:
        import elastic
        ledger = open(f"{args.ledger}.{elastic.slot().replace(':', '_')}.{os.getpid()}", "a")
    while state.epoch < args.epochs:
        check_env()
        while args.hold_file and state.epoch == args.epochs - 1:
            seen = torch.tensor([1.0 if os.path.exists(args.hold_file) else 0.0])
            if hvd.allreduce(seen, name="hold").item() > 0.999:
                break
            time.sleep(0.05)
            state.commit()
        loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size,
                                             sampler=train_sampler)
        for batch_idx, (data, target) in enumerate(loader):
            state.batch = batch_idx
            if ledger:
                import elastic
                pad = train_sampler.padding_mask(batch_idx, args.batch_size)
                idx = [str(j) for j, pd in
                       zip(train_sampler.batch_indices(batch_idx, args.batch_size), pad) if not pd]
                ledger.write(f"{state.epoch} {state.step + 1} {elastic.current_round()} "
                             f"{hvd.rank()} {hvd.size()} {int(time.time() * 1000)} "
                             f"{','.join(idx)}\n")
                ledger.flush()
            state.optimizer.zero_grad()
            loss = F.cross_entropy(state.model(data), target)
            loss.backward()
            state.optimizer.step()
            state.train_sampler.record_batch(batch_idx, args.batch_size)
            state.step += 1
            if args.step_ms:
                time.sleep(args.step_ms / 1000)
            if state.step % args.batches_per_commit == 0:
                state.commit()
        state.epoch += 1
        state.batch = 0
        state.train_sampler.set_epoch(state.epoch)
        state.commit()
        if hvd.rank() == 0:
            print(f"epoch {state.epoch - 1} done: {hvd.size()} workers", flush=True)


def on_state_reset():
    check_env()
    for group in optimizer.param_groups:
        group["lr"] = args.lr * hvd.size()


state = hvd.elastic.TorchState(model, optimizer, train_sampler=train_sampler, epoch=0, batch=0,
                               step=0)
state.register_reset_callbacks([on_state_reset])
train(state)

with torch.no_grad():
    acc = (model(x_test).argmax(1) == y_test).float().mean().item()
digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in model.state_dict().values()))
# Every rank prints its model's hash: they must be the same.
print(f"final rank {hvd.rank()} of {hvd.size()}: {state.step} steps, accuracy {acc:.4f}, "
      f"hash {digest.hexdigest()[:16]}", flush=True)
