"""One side of torch_step_bench: a training step of a large MLP, gradients averaged either by
elastic.torch.DistributedOptimizer (under elastic-run) or by torch's DistributedDataParallel
on the Gloo backend (under torch.multiprocessing), or not at all ("compute": the same step in
--size processes at once, no reduction: what the step costs without communication, on the
same cores). Prints one JSON line per measured step on rank 0: {"impl", "size", "step",
"seconds"}.

    elastic-run -np 2 python3 bench/torch_step_worker.py elastic --steps 10
    elastic-run -np 2 python3 bench/torch_step_worker.py elastic --steps 10 --profile
    python3 bench/torch_step_worker.py ddp --size 2 --steps 10 --port 29500
    python3 bench/torch_step_worker.py compute --size 2 --steps 10
"""
import argparse
import json
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


class Profile:
    """Where a step of ours goes, timed on the worker itself (--profile): forward, backward
    (with the gradient hooks' own time apart), each bucket's reduction on the background thread
    (the C++ call, inside which the GIL is released), the wait for the buckets in step(), and
    the wrapped optimizer's step. Exposed communication is the wait in step(): what backward
    did not hide."""

    def __init__(self, opt):
        import elastic.torch as et
        self.opt, self.rows, self.t = opt, [], {}
        self.hooks = 0.0
        self.spans = []  # (start, end, bytes) of each bucket's reduction, perf_counter
        reduce, make_hook = opt._reduce, opt._make_hook

        def timed_reduce(params):
            t0 = time.perf_counter()
            reduce(params)
            nbytes = sum(p.grad.numel() * p.grad.element_size() for p in params
                         if p.grad is not None)
            self.spans.append((t0, time.perf_counter(), nbytes))
        opt._reduce = timed_reduce

        assert isinstance(opt, et.DistributedOptimizer)
        for acc, handle in opt._hooks:  # re-register the hooks, timed
            handle.remove()
        opt._hooks = []
        for group in opt.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                inner = make_hook(p)

                def hook(*a, inner=inner):
                    t0 = time.perf_counter()
                    inner(*a)
                    self.hooks += time.perf_counter() - t0
                acc = p.expand_as(p).grad_fn.next_functions[0][0]
                opt._hooks.append((acc, acc.register_hook(hook)))

    def step(self, m, opt, x, y):
        self.hooks, self.spans = 0.0, []
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = nn.functional.cross_entropy(m(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.synchronize()
        t3 = time.perf_counter()
        opt.optimizer.step()
        t4 = time.perf_counter()
        spans = sorted(self.spans)
        self.last = {
            "forward": t1 - t0, "backward": t2 - t1, "hooks": self.hooks, "wait": t3 - t2,
            "optimizer": t4 - t3, "buckets": len(spans),
            "reduce_busy": sum(e - s for s, e, _ in spans),
            "reduce_after_backward": sum(max(0.0, e - max(s, t2)) for s, e, _ in spans),
            "first_bucket_start": (spans[0][0] - t1) if spans else 0.0,
            "last_bucket": ((spans[-1][1] - spans[-1][0]), spans[-1][2]) if spans else (0, 0)}


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
            row = {"impl": impl, "size": size, "step": i, "seconds": dt}
            if getattr(step, "__self__", None) is not None and hasattr(step.__self__, "last"):
                row["profile"] = step.__self__.last
            print(json.dumps(row), flush=True)


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
                                      named_parameters=m.named_parameters(), bucket_bytes=bucket,
                                      last_bucket_bytes=bucket if args.impl == "elastic-one-bucket"
                                      else args.last_bucket)
        if args.profile:
            return opt, Profile(opt).step
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
    p.add_argument("--last-bucket", type=int, default=1 << 20,
                   help="elastic: DistributedOptimizer's last_bucket_bytes")
    p.add_argument("--profile", action="store_true",
                   help="elastic only: each step's parts (forward, backward, hooks, bucket "
                        "reductions, the wait in step(), the optimizer) in its JSON line")
    args = p.parse_args()
    if args.impl.startswith("elastic"):
        run_elastic(args)
    else:
        import torch.multiprocessing as mp
        mp.spawn(run_ddp if args.impl == "ddp" else run_compute, args=(args,), nprocs=args.size,
                 join=True)


if __name__ == "__main__":
    main()
