"""The peers benchmark's task (common.py) on TorchFT 0.2.0: 4 replica groups of one process
each, kept in step by a TorchFT lighthouse. A replica group that dies is dropped from the
quorum and the others go on; one that (re)starts joins the next quorum and heals by fetching
the model and optimizer state (and the step count) from a live replica over TorchFT's HTTP
checkpoint transport.

    torchft_lighthouse --min_replicas 2 --bind 127.0.0.1:29510 \\
        --quorum_tick_ms 100 --join_timeout_ms 10000 &
    for r in 0 1 2 3; do
        TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 REPLICA_GROUP_ID=$r \\
            python bench/peers/train_torchft.py --ledger /tmp/tft/ledger --out /tmp/tft/final.pt &
    done

A supervisor restarts a dead replica with the same command. Each replica group here is one
process, so the script itself runs the group's TCPStore (MASTER_ADDR/MASTER_PORT if set, else
127.0.0.1 and a free port); TorchFT's Manager needs that store to exist before it starts.
Timeouts: TORCHFT_TIMEOUT_SEC / TORCHFT_QUORUM_TIMEOUT_SEC / TORCHFT_CONNECT_TIMEOUT_SEC
override --timeout-s / --quorum-timeout-s / --connect-timeout-s (TorchFT reads them).

The global batch of step s (0-based, the manager's step count) is common.global_batch(s // 32,
s % 32); replica group r trains its fixed quarter common.shard(batch, r, 4). torchft's
allreduce averages the gradients over the k replica groups taking part, so each group's loss is
the sum over its quarter / 16 (loss_of with count = 16*k, scale = k): the averaged gradient is
the mean over the 16*k samples trained. With all 4 groups that is the step's mean over its 64
samples. When a group is missing, its quarter is simply not trained in that step: the step's
effective batch is the 16*k samples of the groups present, and their mean is the loss.

Ledger: one line per committed step (should_commit True); rank is the group's participating
rank in that step's quorum (0..k-1, the manager's participating_rank()), size is k.

Measured behaviour (2-core machine): the first quorum forms as soon as 2 groups heartbeat, so
the first steps may run with 2-3 groups (the others heal in at steps 2-10). A dead group is
dropped after the lighthouse's --heartbeat_timeout_ms (default 5000) or, when a survivor is
left waiting in the allreduce, after --pg-timeout-s. The lighthouse is a single point of
failure: when it dies, each group's next quorum fails, and after --quorum-timeout-s every group
exits 1. With TORCHFT_QUORUM_RETRIES=10 and a restarted lighthouse, training goes on.
"""
import argparse
import logging
import os
import sys
from datetime import timedelta

import torch
from torch.distributed import TCPStore

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from torchft import Manager, Optimizer, ProcessGroupGloo  # noqa: E402

GROUPS = 4  # replica groups the global batch is split into (the fixed quarters)


def allreduce_grads(manager, params):
    """Averages the gradients over the step's participants with one manager.allreduce of a
    flat buffer. A failed allreduce does not raise: the manager records the error, and
    should_commit() then returns False, so the step is not applied anywhere.
    (torchft.DistributedDataParallel is not used: in torchft 0.2.0 its comm hook raises
    AssertionError at `assert fut._fut` when the allreduce fails, e.g. when a peer dies.)"""
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    manager.allreduce(flat).wait()
    offset = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n


def main():
    p = common.add_args(argparse.ArgumentParser())
    p.add_argument("--replica-id", type=int, default=None,
                   help="replica group id 0..3 (default: $REPLICA_GROUP_ID)")
    p.add_argument("--min-replicas", type=int, default=2,
                   help="Manager min_replica_size: fewer groups than this commit no step")
    p.add_argument("--timeout-s", type=float, default=10,
                   help="Manager timeout: allreduce, should_commit, checkpoint transfer")
    p.add_argument("--quorum-timeout-s", type=float, default=60,
                   help="how long a quorum request may wait for the lighthouse")
    p.add_argument("--connect-timeout-s", type=float, default=10)
    p.add_argument("--pg-timeout-s", type=float, default=5,
                   help="Gloo process group timeout: how long a survivor may wait in an "
                        "allreduce whose peer died (TorchFT's examples use 5 s on Gloo)")
    p.add_argument("--verbose", action="store_true", help="log torchft's INFO messages")
    args = p.parse_args()
    rid = args.replica_id if args.replica_id is not None else int(os.environ["REPLICA_GROUP_ID"])
    assert 0 <= rid < GROUPS, f"replica id {rid} not in 0..{GROUPS - 1}"
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format=f"[replica {rid}] %(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    total = args.epochs * common.STEPS_PER_EPOCH

    # This replica group's store (one process per group, so we are its master).
    store_addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    store = TCPStore(store_addr, int(os.environ.get("MASTER_PORT", 0)), is_master=True,
                     wait_for_workers=False)

    x, y = common.dataset()
    model = common.make_model()
    inner_opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    def state_dict():
        return {"model": model.state_dict(), "optim": inner_opt.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner_opt.load_state_dict(sd["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout_s)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=args.min_replicas,
        # Synchronous quorum: a healing replica loads the live state before its forward pass
        # and then trains its quarter in that same step (with the asynchronous default it would
        # only contribute zero gradients in its first step).
        use_async_quorum=False,
        # common.make_model seeds its weights, so every replica starts alike: no sync at step 0.
        init_sync=False,
        timeout=timedelta(seconds=args.timeout_s),
        quorum_timeout=timedelta(seconds=args.quorum_timeout_s),
        connect_timeout=timedelta(seconds=args.connect_timeout_s),
        rank=0, world_size=1,                      # one process per replica group
        store_addr=store_addr, store_port=store.port,
        replica_id=f"train_torchft_{rid}",         # lighthouse from $TORCHFT_LIGHTHOUSE
    )
    opt = Optimizer(manager, inner_opt)  # zero_grad: quorum (and healing); step: should_commit
    ledger = common.Ledger(args.ledger)
    params = list(model.parameters())

    while manager.current_step() < total:
        opt.zero_grad()  # starts the quorum, and (sync quorum) heals from a peer if behind
        s = manager.current_step()
        if s >= total:   # healed to the end: the job is done
            break
        epoch, b = divmod(s, common.STEPS_PER_EPOCH)
        batch = common.global_batch(epoch, b)
        mine = common.shard(batch, rid, GROUPS)
        k = manager.num_participants()
        # Each group: sum over its 16 samples / 16; the allreduce averages over the k groups.
        common.loss_of(model, x, y, mine, count=k * len(mine), scale=k).backward()
        common.pace(args)  # the compute of a larger model, before the gradients are exchanged
        allreduce_grads(manager, params)
        opt.step()  # applied only if should_commit(): no error this step, >= min_replicas groups
        if manager.current_step() == s + 1:  # committed
            rank = manager.participating_rank()  # this group's rank in the step's quorum
            ledger.write(epoch, s + 1, rank if rank is not None else rid, k, mine)

    step = manager.current_step()
    if rid == 0:
        common.save_final(model, args.out, step)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
