"""The anchor side of torch_recovery_bench: examples/train_digits.py's model, data and global
batch (or, with --model resnet18|resnet50, examples/train_vision.py's), as a plain
torch.distributed (DDP, Gloo) program for torchrun. torchrun restarts every
worker after a failure, so this program checkpoints (rank 0, every --commit-every steps) and
resumes from the checkpoint at start. Prints its pid per rank, then a JSON line per step on
rank 0. It initializes its process group the way torchrun's documentation says
(`init_process_group("gloo")`: env://, from the RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT that
torchrun sets for each attempt). With torch 2.15 and the c10d rendezvous, run torchrun with
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the store torchrun shares with its workers by default
outlives a restart and keeps the keys of the attempt before, whose Gloo addresses the restarted
workers then dial (connection refused; see bench/torch_recovery_bench).

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:1 --nproc_per_node 4 \\
        --max_restarts 3 --rdzv_backend c10d --rdzv_endpoint 127.0.0.1:29400 --redirects 1 --tee 1 \\
        bench/torch_digits_torchrun.py --checkpoint /tmp/ckpt.pt
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from train_digits import data  # noqa: E402  (the same split)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--commit-every", type=int, default=5)
    p.add_argument("--step-ms", type=int, default=0)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--model", choices=["mlp", "resnet18", "resnet50"], default="mlp")
    p.add_argument("--image", type=int, default=64)
    p.add_argument("--images", type=int, default=1024)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    print(json.dumps({"rank": rank, "pid": os.getpid()}), flush=True)
    torch.manual_seed(0)
    if args.model == "mlp":
        train_set, _, _ = data()
        model = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))
    else:
        import torchvision
        from train_vision import synthetic  # the same images and labels
        train_set = synthetic(args.images, args.image, 0)
        model = getattr(torchvision.models, args.model)(num_classes=10)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    epoch, step, start = 0, 0, 0
    if os.path.exists(args.checkpoint):
        ck = torch.load(args.checkpoint)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        epoch, step, start = ck["epoch"], ck["step"], ck["batch"]
    per = args.global_batch // size
    while epoch < args.epochs:
        order = torch.tensor(np.random.default_rng(epoch).permutation(len(train_set)))
        batches = [order[i:i + args.global_batch]
                   for i in range(0, len(order), args.global_batch)]
        for b in range(start, len(batches)):
            mine = batches[b][rank * per:(rank + 1) * per]
            xb, yb = train_set[mine]
            opt.zero_grad()
            (F.cross_entropy(ddp(xb), yb, reduction="sum") * size / len(batches[b])).backward()
            opt.step()
            step += 1
            if args.step_ms:
                time.sleep(args.step_ms / 1000)
            if rank == 0:
                print(json.dumps({"t": time.time(), "step": step}), flush=True)
                if step % args.commit_every == 0:
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                                "epoch": epoch, "step": step, "batch": b + 1},
                               args.checkpoint + ".tmp")
                    os.replace(args.checkpoint + ".tmp", args.checkpoint)
        start = 0
        epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
