#!/usr/bin/env python3
"""An MLP on scikit-learn's digits (8x8 images, 10 classes; shipped with python3-sklearn, no
download), trained data-parallel under elastic-run with the `elastic` package: ElasticSampler
(exactly-once data, a fixed global batch at any world size), TorchState (model, optimizer,
sampler, counters), DistributedOptimizer (gradients summed in buckets that overlap backward),
a commit every few steps. Rank 0 prints loss and test accuracy after every epoch.

    elastic-run -np 2 python3 examples/train_digits.py
    elastic-run --min-np 2 --max-np 4 --host-discovery-script discover.sh \\
        python3 examples/train_digits.py --epochs 30
    python3 examples/train_digits.py          # a single process (a job of size 1)

Options: --epochs E (20)  --global-batch G (64)  --lr X (0.05)  --hidden H (64)
         --commit-every K (5)  --seed S (0)  --loader-workers N (0)  --step-ms MS (0)
         --ledger PREFIX (none)  --save PATH (rank 0 saves the final state_dict)
         --hold-file PATH (tests: the last epoch waits until PATH exists)
"""
import argparse
import hashlib
import json
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits

import elastic
import elastic.torch as et


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--commit-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loader-workers", type=int, default=0)
    p.add_argument("--step-ms", type=int, default=0, help="extra time per step (for demos)")
    p.add_argument("--ledger", default=None, help="write each step's indices (tests)")
    p.add_argument("--save", default=None, help="rank 0 saves the final state_dict here")
    p.add_argument("--hold-file", default=None,
                   help="before its last epoch the job waits until this file exists (every "
                        "rank sees it, agreed by an allreduce), committing meanwhile so that "
                        "membership changes go on: tests land their faults while training "
                        "is left, however fast the steps are")
    p.add_argument("--progress", action="store_true",
                   help="print a JSON line per step (rank 0) and each rank's pid (benchmarks)")
    return p.parse_args()


def data():
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.tensor(np.random.default_rng(0).permutation(len(y)))
    train, test = order[:1500], order[1500:]
    return (torch.utils.data.TensorDataset(x[train], y[train]), x[test], y[test])


def main():
    args = parse()
    torch.set_num_threads(1)  # workers share the machine's cores
    torch.manual_seed(args.seed)  # the same start everywhere (rank 0's is synced anyway)
    train_set, x_test, y_test = data()
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))
    elastic.init()
    sampler = et.ElasticSampler(train_set, shuffle=True, seed=args.seed,
                                global_batch_size=args.global_batch)
    # Each rank's loss is its samples' sum / the step's sample count, so the summed gradient
    # is the step's mean at any world size.
    optimizer = et.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        named_parameters=model.named_parameters(), op=elastic.Sum)
    state = et.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0)

    def evaluate():
        with torch.no_grad():
            out = model(x_test)
            return (F.cross_entropy(out, y_test).item(),
                    (out.argmax(1) == y_test).float().mean().item())

    if args.progress:
        print(json.dumps({"rank": elastic.rank(), "pid": os.getpid()}), flush=True)

    @elastic.run
    def train(state):
        ledger = None
        if args.ledger:
            ledger = open(f"{args.ledger}.{elastic.slot().replace(':', '_')}.{os.getpid()}", "a")
        while state.epoch < args.epochs:
            while args.hold_file and state.epoch == args.epochs - 1:
                seen = torch.tensor([1.0 if os.path.exists(args.hold_file) else 0.0])
                if elastic.allreduce(seen, op=elastic.Min).item() > 0.5:
                    break
                time.sleep(0.05)
                state.commit()
            loader = torch.utils.data.DataLoader(train_set, batch_size=sampler.batch_size,
                                                 sampler=sampler,
                                                 num_workers=args.loader_workers)
            for i, (xb, yb) in enumerate(loader):
                weight = torch.tensor([0.0 if pad else 1.0 for pad in sampler.padding_mask(i)])
                count = min(args.global_batch, len(train_set) - sampler.cursor)
                if ledger:
                    idx = [str(j) for j, w in zip(sampler.batch_indices(i), weight) if w]
                    ledger.write(f"{state.epoch} {state.step + 1} {elastic.current_round()} "
                                 f"{elastic.rank()} "
                                 f"{elastic.size()} {int(time.time() * 1000)} "
                                 f"{','.join(idx)}\n")
                    ledger.flush()
                optimizer.zero_grad()
                loss = (F.cross_entropy(model(xb), yb, reduction="none") * weight).sum() / count
                loss.backward()
                optimizer.step()
                sampler.record_batch(i)
                state.step += 1
                if args.progress and elastic.rank() == 0:
                    print(json.dumps({"t": time.time(), "step": state.step}), flush=True)
                if args.step_ms:
                    time.sleep(args.step_ms / 1000)
                if state.step % args.commit_every == 0:
                    state.commit()
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()
            if elastic.rank() == 0:
                test_loss, acc = evaluate()
                print(f"epoch {state.epoch - 1} done: step {state.step}, {elastic.size()} "
                      f"workers, test loss {test_loss:.4f}, test accuracy {acc:.4f}", flush=True)

    train(state)
    if elastic.rank() == 0:
        test_loss, acc = evaluate()
        h = hashlib.sha256(b"".join(t.numpy().tobytes() for t in model.state_dict().values()))
        print(f"final: {state.step} steps, test loss {test_loss:.4f}, test accuracy {acc:.4f}, "
              f"hash {h.hexdigest()[:16]}", flush=True)
        if args.save:
            torch.save(model.state_dict(), args.save)


if __name__ == "__main__":
    main()
