"""Run by tests/python/test_python_api.py under elastic-run: elastic.torch.DistributedOptimizer
against gradients each rank computes itself and shares (allgather_object), step by step, with
small buckets (several of them, tapered), gradients that are views of their bucket's flat
tensor, gradients set to None and made anew (the fused way, then put back into the views), an
unused parameter and two backward passes per step. Prints "buckets ok rank R of N" when every
step matched on every rank."""
import sys

import torch
import torch.nn as nn

import elastic
import elastic.torch as et

elastic.init()
rank, size = elastic.rank(), elastic.size()
torch.manual_seed(0)  # the same model on every rank
model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                      nn.Linear(64, 3))
unused = nn.Linear(4, 4)  # in the optimizer, never in the loss: its gradient stays None
params = list(model.named_parameters()) + [("unused." + n, p)
                                           for n, p in unused.named_parameters()]
passes = 2
opt = et.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.1),
                              named_parameters=params, backward_passes_per_step=passes,
                              bucket_bytes=20 << 10, last_bucket_bytes=1 << 10)
assert len(opt._buckets) >= 3, [len(b) for b in opt._buckets]

calls = {"flat": 0, "fused": 0}
allreduce_, grouped_ = elastic.allreduce_, elastic.grouped_allreduce_


def flat(*a, **k):
    calls["flat"] += 1
    return allreduce_(*a, **k)


def fused(*a, **k):
    calls["fused"] += 1
    return grouped_(*a, **k)


elastic.allreduce_, elastic.grouped_allreduce_ = flat, fused

for step in range(6):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    batches = [(torch.randn(16, 8, generator=gen), torch.randint(0, 3, (16,), generator=gen))
               for _ in range(passes)]
    # What this rank's gradients are (autograd.grad: .grad is left alone).
    mine = []
    for x, y in batches:
        g = torch.autograd.grad(nn.functional.cross_entropy(model(x), y),
                                list(model.parameters()))
        mine = [a + b for a, b in zip(mine, g)] if mine else list(g)
    everyone = elastic.allgather_object([t.tolist() for t in mine])
    want = [sum(torch.tensor(r[i]) for r in everyone) / size for i in range(len(mine))]

    if step == 3:
        opt.zero_grad(set_to_none=True)  # made anew by backward: not the views
    else:
        opt.zero_grad()
    for x, y in batches:
        nn.functional.cross_entropy(model(x), y).backward()
    opt.synchronize()
    for (name, p), w in zip(params, want):
        if not torch.allclose(p.grad, w, rtol=1e-5, atol=1e-6):
            sys.exit(f"step {step} rank {rank}: {name}'s gradient is not the average")
    for name, p in params[len(want):]:
        if p.grad is not None:
            sys.exit(f"step {step}: the unused {name} got a gradient")
    viewed = all(p.grad.data_ptr() == opt._views[p].data_ptr() for _, p in params[:len(want)])
    if not viewed:
        sys.exit(f"step {step}: a reduced gradient was not put back into its bucket's view")
    opt.optimizer.step()
    # Every rank holds the same model.
    mine_w = [p.detach().clone() for p in model.parameters()]
    theirs = elastic.allgather_object([t.tolist() for t in mine_w])
    if any(not torch.equal(torch.tensor(t[i]), mine_w[i]) for t in theirs
           for i in range(len(mine_w))):
        sys.exit(f"step {step}: the ranks' models differ")

# Steps 0 and 3 began with gradients that were not views (fused); the others reduced the
# flat tensors in place.
buckets = len(opt._buckets)
if size > 1 and (calls["flat"] < 3 * (buckets - 1) or calls["fused"] < 2):
    sys.exit(f"reductions: {calls} over {buckets} buckets")
print(f"buckets ok rank {rank} of {size}", flush=True)
