"""The peers benchmark's task (common.py) for DLRover's launcher, `dlrover-run`, with DLRover's
own elastic-training API on CPU (DDP on Gloo for the gradients):

- the flash checkpoint, dlrover.trainer.torch.flash_checkpoint.ddp.DdpCheckpointer: after every
  step (--memory-every) the model, optimizer, sampler, epoch and step go to the shared memory
  that dlrover-run's agent holds (StorageType.MEMORY), and at the end of every epoch also to
  disk (StorageType.DISK: the agent writes <checkpoint>/<step>/rank_0.pt asynchronously and
  then the tracker file). At start, load_checkpoint() reads the shared memory first (a restart
  of the workers under a live agent resumes after the last step saved there) and the newest
  disk checkpoint if the memory is empty (a new agent).
- the sampler, dlrover.trainer.torch.elastic.sampler.ElasticDistributedSampler, whose
  state_dict/load_state_dict keep the position within an epoch. Its own order
  (torch.randperm(seed + epoch)) and split (every num_replicas-th sample, padded) are not
  common.py's, so it runs with num_replicas=1 and shuffle=False over the epoch's positions
  0..N-1: batch b of its DataLoader is positions 64b..64b+63, which common.global_batch and
  common.shard turn into this rank's samples.

    dlrover-run --standalone --nnodes=1 --nproc_per_node=4 --max_restarts=3 \\
        bench/peers/train_dlrover.py --ledger /tmp/dl/ledger --checkpoint /tmp/dl/ckpt

--checkpoint is a directory here (the flash checkpoint's checkpoint_dir).
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from dlrover.trainer.torch.elastic.sampler import ElasticDistributedSampler
from dlrover.trainer.torch.flash_checkpoint.checkpointer import StorageType
from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def main():
    p = common.add_args(argparse.ArgumentParser())
    p.add_argument("--checkpoint", default=None,
                   help="flash checkpoint directory (memory every --memory-every steps, "
                        "disk at the end of every epoch)")
    p.add_argument("--memory-every", type=int, default=1,
                   help="steps between flash checkpoints to the agent's shared memory")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # env://, set by dlrover-run as torchrun does
    rank, size = dist.get_rank(), dist.get_world_size()

    x, y = common.dataset()
    model = common.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sampler = ElasticDistributedSampler(list(range(common.N)), num_replicas=1, rank=0,
                                        shuffle=False)
    loader = DataLoader(list(range(common.N)), batch_size=common.GLOBAL_BATCH, sampler=sampler)

    ckpt = DdpCheckpointer(args.checkpoint) if args.checkpoint else None
    epoch, step = 0, 0
    if ckpt:
        state = ckpt.load_checkpoint()  # all ranks: it checks the step agrees across them
        if state:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            sampler.load_state_dict(state["sampler"])
            epoch, step = state["epoch"], state["step"]
            print(f"rank {rank}: resumed at epoch {epoch}, step {step} "
                  f"({state['sampler']['completed_num']} samples of the epoch done)", flush=True)
    ddp = DistributedDataParallel(model)  # broadcasts rank 0's parameters
    ledger = common.Ledger(args.ledger)

    def state_at(e, b):
        """The state after batch b (from 0) of epoch e, with the sampler's position."""
        sampler.set_epoch(e)
        return {"model": model.state_dict(), "opt": opt.state_dict(),
                "sampler": sampler.state_dict(b + 1, common.GLOBAL_BATCH),
                "epoch": e, "step": e * common.STEPS_PER_EPOCH + b + 1}

    while epoch < args.epochs:
        sampler.set_epoch(epoch)
        for positions in loader:
            b = int(positions[0]) // common.GLOBAL_BATCH
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
            if ckpt and b + 1 < common.STEPS_PER_EPOCH and step % args.memory_every == 0:
                ckpt.save_checkpoint(step, state_at(epoch, b), storage_type=StorageType.MEMORY)
        epoch += 1
        if ckpt:  # the epoch's end: the start of the next one, to memory and to disk
            state = state_at(epoch, -1)
            state["step"] = step
            ckpt.save_checkpoint(step, state, storage_type=StorageType.DISK)

    if rank == 0:
        common.save_final(model, args.out, step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
