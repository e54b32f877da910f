"""The peers benchmark's task (common.py) as plain PyTorch DDP on Gloo for torchrun, made fault
tolerant the way torchrun's documentation advises: torchrun restarts every worker after a
failure, and the program checkpoints (rank 0, at the end of every epoch: model, optimizer, epoch,
step; written to a temporary file and moved into place) and loads that checkpoint at start,
resuming at the start of the epoch after the one saved.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 python -m torch.distributed.run --nnodes 1:1 \\
        --nproc_per_node 4 --max_restarts 3 --rdzv_backend c10d --rdzv_endpoint 127.0.0.1:29400 \\
        bench/peers/train_ddp.py --ledger /tmp/ddp/ledger --checkpoint /tmp/ddp/ckpt.pt

TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is needed with torch 2.15 and the c10d rendezvous: without
it the store torchrun shares with its workers outlives a restart with the keys of the attempt
before, and the restarted workers dial that attempt's Gloo addresses (connection refused).
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def save_checkpoint(path, model, opt, epoch, step):
    tmp = path + ".tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "epoch": epoch, "step": step}, tmp)
    os.replace(tmp, path)


def main():
    p = common.add_args(argparse.ArgumentParser())
    p.add_argument("--checkpoint", default=None,
                   help="checkpoint file: saved by rank 0 after every epoch, loaded at start")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR/PORT from torchrun
    rank, size = dist.get_rank(), dist.get_world_size()

    x, y = common.dataset()
    model = common.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    epoch, step = 0, 0
    if args.checkpoint and os.path.exists(args.checkpoint):
        ck = torch.load(args.checkpoint)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        epoch, step = ck["epoch"], ck["step"]
        print(f"rank {rank}: resumed from {args.checkpoint} at epoch {epoch}, step {step}",
              flush=True)
    # DDP broadcasts rank 0's parameters at construction, so every rank starts alike.
    ddp = DistributedDataParallel(model)
    ledger = common.Ledger(args.ledger)

    while epoch < args.epochs:
        for b in range(common.STEPS_PER_EPOCH):
            batch = common.global_batch(epoch, b)
            mine = common.shard(batch, rank, size)
            common.pace(args)  # the compute of a larger model, before DDP exchanges gradients
            opt.zero_grad()
            # DDP averages the gradients over the ranks (in backward): scale by size so that the
            # mean is the step's
            common.loss_of(ddp, x, y, mine, count=len(batch), scale=size).backward()
            opt.step()
            step = epoch * common.STEPS_PER_EPOCH + b + 1
            ledger.write(epoch, step, rank, size, mine)
        epoch += 1
        if rank == 0 and args.checkpoint:
            save_checkpoint(args.checkpoint, model, opt, epoch, step)

    if rank == 0:
        common.save_final(model, args.out, step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
