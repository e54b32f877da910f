"""One side of torch_step_bench: a training step of a large MLP, gradients averaged either by
elastic.torch.DistributedOptimizer (under elastic-run) or by torch's DistributedDataParallel
on the Gloo backend (under torch.multiprocessing), or not at all ("compute": the same step in
--size processes at once, no reduction: what the step costs without communication, on the
same cores). Prints one JSON line per measured step on rank 0: {"impl", "size", "step",
"seconds"}.

    elastic-run -np 2 python3 bench/torch_step_worker.py elastic --steps 10
    python3 bench/torch_step_worker.py ddp --size 2 --steps 10 --port 29500
    python3 bench/torch_step_worker.py compute --size 2 --steps 10
"""
import argparse
import json
import os
import time

import torch
import torch.nn as nn


def model(args):
    if args.model != "mlp":  # a torchvision ResNet, random weights
        import torchvision
        return getattr(torchvision.models, args.model)(num_classes=10)
    mods = []
    for _ in range(args.layers):
        mods += [nn.Linear(args.width, args.width), nn.ReLU()]
    return nn.Sequential(*mods, nn.Linear(args.width, 10))


def train(impl, rank, size, args, step_fn_setup):
    torch.manual_seed(0)
    torch.set_num_threads(max(1, 2 // size) if args.threads == 0 else args.threads)
    m = model(args)
    opt, step = step_fn_setup(m)
    shape = (args.batch, args.width) if args.model == "mlp" else (args.batch, 3, args.image,
                                                                 args.image)
    x = torch.randn(*shape)
    y = torch.randint(0, 10, (args.batch,))
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        step(m, opt, x, y)
        dt = time.perf_counter() - t0
        if rank == 0 and i >= args.warmup:
            print(json.dumps({"impl": impl, "size": size, "step": i, "seconds": dt}), flush=True)


def sgd_step(m, opt, x, y):
    """One step of `m` (the model, or the DDP module that wraps it) with `opt`."""
    opt.zero_grad()
    nn.functional.cross_entropy(m(x), y).backward()
    opt.step()


def run_elastic(args):
    import elastic
    import elastic.torch as et
    elastic.init()
    # "elastic-one-bucket": every gradient in one bucket, reduced after backward: no overlap.
    bucket = (1 << 40) if args.impl == "elastic-one-bucket" else (25 << 20)

    def setup(m):
        opt = et.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.01),
                                      named_parameters=m.named_parameters(), bucket_bytes=bucket)
        return opt, sgd_step
    train(args.impl, elastic.rank(), elastic.size(), args, setup)


def run_ddp(rank, args):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank,
                            world_size=args.size)

    def setup(m):
        ddp = nn.parallel.DistributedDataParallel(m)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

        return opt, lambda _, opt, x, y: sgd_step(ddp, opt, x, y)
    train("ddp", rank, args.size, args, setup)
    dist.destroy_process_group()


def run_compute(rank, args):
    train("compute", rank, args.size, args,
          lambda m: (torch.optim.SGD(m.parameters(), lr=0.01), sgd_step))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("impl", choices=["elastic", "elastic-one-bucket", "ddp", "compute"])
    p.add_argument("--size", type=int, default=2)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--model", choices=["mlp", "resnet18", "resnet50"], default="mlp")
    p.add_argument("--image", type=int, default=64, help="ResNet input: S x S pixels")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    if args.impl.startswith("elastic"):
        run_elastic(args)
    else:
        import torch.multiprocessing as mp
        mp.spawn(run_ddp if args.impl == "ddp" else run_compute, args=(args,), nprocs=args.size,
                 join=True)


if __name__ == "__main__":
    main()
