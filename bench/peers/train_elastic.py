"""The peers benchmark's elastic-run script: bench/peers/common.py's task with the `elastic`
package (elastic.torch): ElasticSampler with a fixed global batch of 64 at any number of
workers (exactly-once data: what a rolled-back step trained is trained again, nothing twice
in the final model's history), DistributedOptimizer summing gradients, TorchState committed
every few steps and at each epoch's end.

    elastic-run -np 4 --min-np 2 python3 bench/peers/train_elastic.py --ledger /tmp/l/book
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import elastic  # noqa: E402
import elastic.torch as et  # noqa: E402


def main():
    p = common.add_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    p.add_argument("--commit-every", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    x, y = common.dataset()
    model = common.make_model()
    elastic.init()
    indices = torch.utils.data.TensorDataset(torch.arange(common.N))
    sampler = et.ElasticSampler(indices, shuffle=True, seed=0,
                                global_batch_size=common.GLOBAL_BATCH)
    optimizer = et.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        named_parameters=model.named_parameters(), op=elastic.Sum)
    state = et.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0)
    ledger = common.Ledger(args.ledger)

    @elastic.run
    def train(state):
        while state.epoch < args.epochs:
            loader = torch.utils.data.DataLoader(indices, batch_size=sampler.batch_size,
                                                 sampler=sampler)
            for i, _ in enumerate(loader):
                mine = [j for j, pad in zip(sampler.batch_indices(i), sampler.padding_mask(i))
                        if not pad]
                count = min(common.GLOBAL_BATCH, common.N - sampler.cursor)
                optimizer.zero_grad()
                common.loss_of(model, x, y, mine, count).backward()
                optimizer.step()
                sampler.record_batch(i)
                state.step += 1
                ledger.write(state.epoch, state.step, elastic.rank(), elastic.size(), mine)
                common.pace(args)
                if state.step % args.commit_every == 0:
                    state.commit()
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    if elastic.rank() == 0:
        common.save_final(model, args.out, state.step)


if __name__ == "__main__":
    main()
