"""The peers benchmark's Horovod elastic script: bench/peers/common.py's task written as a
Horovod user writes an elastic PyTorch job (Horovod's elastic docs: hvd.elastic.run,
hvd.elastic.TorchState, hvd.elastic.ElasticSampler, hvd.DistributedOptimizer, commits). The
same file runs under elastic-run with one change, the import, made here by an environment
variable:

    PEERS_HOROVOD_API=horovod  (default)   import horovod.torch as hvd          # horovodrun
    PEERS_HOROVOD_API=elastic              import elastic.horovod.torch as hvd  # elastic-run

As in Horovod, the batch is per rank (16 samples), so the global batch is 16 x the number of
workers (64 at 4) and Horovod's ElasticSampler splits what is left of an epoch among the
workers of the moment, padding the split to equal parts with repeated samples (the ledger
records what was trained, repeats included).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

if os.environ.get("PEERS_HOROVOD_API", "horovod") == "elastic":
    import elastic.horovod.torch as hvd  # noqa: E402
else:
    import horovod.torch as hvd  # noqa: E402

p = common.add_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
p.add_argument("--batch-size", type=int, default=16, help="samples per rank and step")
p.add_argument("--batches-per-commit", type=int, default=5)
args = p.parse_args()

hvd.init()
torch.set_num_threads(1)
x, y = common.dataset()
model = common.make_model()
indices = torch.utils.data.TensorDataset(torch.arange(common.N))
optimizer = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
    named_parameters=model.named_parameters(), op=hvd.Average)
sampler = hvd.elastic.ElasticSampler(indices, shuffle=True, seed=0)
ledger = common.Ledger(args.ledger)


@hvd.elastic.run
def train(state):
    while state.epoch < args.epochs:
        loader = torch.utils.data.DataLoader(indices, batch_size=args.batch_size,
                                             sampler=state.sampler)
        for batch_idx, (idx,) in enumerate(loader):
            state.batch = batch_idx
            mine = idx.tolist()
            state.optimizer.zero_grad()
            common.loss_of(state.model, x, y, mine, len(mine)).backward()
            state.optimizer.step()
            state.sampler.record_batch(batch_idx, args.batch_size)
            state.step += 1
            ledger.write(state.epoch, state.step, hvd.rank(), hvd.size(), mine)
            common.pace(args)
            if state.step % args.batches_per_commit == 0:
                state.commit()
        state.epoch += 1
        state.batch = 0
        state.sampler.set_epoch(state.epoch)
        state.commit()


state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0, step=0)
train(state)
if hvd.rank() == 0:
    common.save_final(model, args.out, state.step)
