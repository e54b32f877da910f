#!/usr/bin/env python3
"""A torchvision ResNet (18 or 50, random weights) on synthetic images, trained data-parallel
under elastic-run with the `elastic` package: ElasticSampler (exactly-once data, a fixed global
batch at any world size), TorchState (model with its batch-norm buffers, optimizer, sampler,
counters), DistributedOptimizer (gradients averaged in buckets that overlap backward), a commit
every few steps. Needs torchvision (Debian: python3-torchvision); the data are random images
and labels from a seeded generator, so nothing is downloaded.

    elastic-run -np 2 python3 examples/train_vision.py --model resnet18
    elastic-run --min-np 2 --max-np 4 --host-discovery-script discover.sh \\
        python3 examples/train_vision.py --model resnet50 --image 96 --epochs 3

Options: --model resnet18|resnet50 (resnet18)  --image S (64: S x S pixels)
         --images N (1024)  --epochs E (2)  --global-batch G (32)  --lr X (0.05)
         --commit-every K (5)  --seed S (0)  --threads T (1)  --ledger PREFIX (none)
         --progress (a JSON line per step on rank 0 and each rank's pid, for benchmarks)

Batch norm keeps running statistics per rank, as under Horovod: each rank's come from its own
samples, and a newcomer gets rank 0's with the rest of the state.
"""
import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
import torchvision

import elastic
import elastic.torch as et


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["resnet18", "resnet50"], default="resnet18")
    p.add_argument("--image", type=int, default=64)
    p.add_argument("--images", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--commit-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ledger", default=None, help="write each step's indices (tests)")
    p.add_argument("--progress", action="store_true",
                   help="print a JSON line per step (rank 0) and each rank's pid (benchmarks)")
    args = p.parse_args()
    for name in ("image", "images", "epochs", "global_batch", "commit_every", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def synthetic(n, size, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, size, size, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def main():
    args = parse()
    torch.set_num_threads(args.threads)  # workers share the machine's cores
    torch.manual_seed(args.seed)  # the same start everywhere (rank 0's is synced anyway)
    train_set = synthetic(args.images, args.image, args.seed)
    model = getattr(torchvision.models, args.model)(num_classes=10)
    elastic.init()
    sampler = et.ElasticSampler(train_set, shuffle=True, seed=args.seed,
                                global_batch_size=args.global_batch)
    optimizer = et.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        named_parameters=model.named_parameters(), op=elastic.Sum)
    state = et.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0)
    if args.progress:
        print(json.dumps({"rank": elastic.rank(), "pid": os.getpid()}), flush=True)

    @elastic.run
    def train(state):
        ledger = None
        if args.ledger:
            ledger = open(f"{args.ledger}.{elastic.slot().replace(':', '_')}.{os.getpid()}", "a")
        model.train()
        last_loss = float("nan")
        while state.epoch < args.epochs:
            loader = torch.utils.data.DataLoader(train_set, batch_size=sampler.batch_size,
                                                 sampler=sampler)
            for i, (xb, yb) in enumerate(loader):
                weight = torch.tensor([0.0 if pad else 1.0 for pad in sampler.padding_mask(i)])
                count = min(args.global_batch, len(train_set) - sampler.cursor)
                if ledger:
                    idx = [str(j) for j, w in zip(sampler.batch_indices(i), weight) if w]
                    ledger.write(f"{state.epoch} {state.step + 1} {elastic.current_round()} "
                                 f"{elastic.rank()} {elastic.size()} "
                                 f"{int(time.time() * 1000)} {','.join(idx)}\n")
                    ledger.flush()
                optimizer.zero_grad()
                # Each rank's loss is its samples' sum / the step's sample count, so the summed
                # gradient is the step's mean at any world size.
                loss = (F.cross_entropy(model(xb), yb, reduction="none") * weight).sum() / count
                loss.backward()
                optimizer.step()
                last_loss = loss.item()
                sampler.record_batch(i)
                state.step += 1
                if args.progress and elastic.rank() == 0:
                    print(json.dumps({"t": time.time(), "step": state.step,
                                      "images": count}), flush=True)
                if state.step % args.commit_every == 0:
                    state.commit()
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()
            if elastic.rank() == 0:
                print(f"epoch {state.epoch - 1} done: step {state.step}, {elastic.size()} "
                      f"workers, last loss {last_loss:.4f}", flush=True)

    train(state)
    if elastic.rank() == 0:
        print(f"final: {args.model}, {state.step} steps, {state.epoch} epochs", flush=True)


if __name__ == "__main__":
    main()
