"""Horovod's collective API (elastic.horovod.torch) checked on every rank against values each
rank computes itself from what all ranks contribute. Run under elastic-run -np N; prints
"horovod api ok: rank R of N" at the end, raises on the first difference."""
import os
import warnings

import torch

import elastic.horovod.torch as hvd

hvd.init()
r, n = hvd.rank(), hvd.size()
assert hvd.is_initialized()
assert os.environ["HOROVOD_RANK"] == str(r) and os.environ["HOROVOD_SIZE"] == str(n)
assert os.environ["HOROVOD_LOCAL_SIZE"] == str(hvd.local_size())
assert hvd.gloo_built() and hvd.gloo_enabled() and not hvd.mpi_built() and not hvd.mpi_enabled()
assert hvd.nccl_built() is False  # no GPU on the test machine

# What every rank holds: rank k holds (k + 1) * base.
base = torch.tensor([1.0, -2.0, 0.5, 3.25])
mine = (r + 1) * base
each = [(k + 1) * base for k in range(n)]


def same(a, b, tol=0.0):
    assert a.shape == b.shape and a.dtype == b.dtype, (a, b)
    assert (a - b).abs().max().item() <= tol, (a, b)


same(hvd.allreduce(mine), sum(each) / n)
same(hvd.allreduce(mine, average=False), sum(each))
same(hvd.allreduce(mine, op=hvd.Sum), sum(each))
same(hvd.allreduce(mine, op=hvd.Min), torch.stack(each).min(0).values)
same(hvd.allreduce(mine, op=hvd.Max), torch.stack(each).max(0).values)
same(hvd.allreduce(mine, op=hvd.Product), torch.stack(each).prod(0))
same(hvd.allreduce(mine, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0),
     3.0 * sum(0.5 * e for e in each))
# fp16 compression: the tensor travels as float16 and comes back float32; these values are
# exact in float16.
out = hvd.allreduce(mine, op=hvd.Sum, compression=hvd.Compression.fp16)
same(out, sum(each))
c, ctx = hvd.Compression.fp16.compress(mine)
assert c.dtype == torch.float16 and hvd.Compression.fp16.decompress(c, ctx).dtype == torch.float32
# A value that float16 cannot hold exactly comes back rounded to float16's precision.
fine = torch.tensor([1.0 + 1e-4]) * (r + 1)
out = hvd.allreduce(fine, op=hvd.Sum, compression=hvd.Compression.fp16)
exact = sum(torch.tensor([1.0 + 1e-4]) * (k + 1) for k in range(n))
assert 0 < (out - exact).abs().item() < 1e-2 * n, (out, exact)
# In place, grouped, and integers.
t = mine.clone()
assert hvd.allreduce_(t, op=hvd.Sum) is t
same(t, sum(each))
a, b = hvd.grouped_allreduce([mine, 2 * mine], op=hvd.Sum)
same(a, sum(each))
same(b, 2 * sum(each))
g = [mine.clone(), mine.clone()]
hvd.grouped_allreduce_(g, op=hvd.Max)
same(g[1], torch.stack(each).max(0).values)
ints = torch.tensor([r + 1, 10 * (r + 1)], dtype=torch.int64)
same(hvd.allreduce(ints, op=hvd.Sum), torch.tensor([sum(range(1, n + 1)),
                                                   10 * sum(range(1, n + 1))]))
# Gather (first dimensions differ by rank), broadcast, objects.
gathered = hvd.allgather(torch.full((r + 1, 2), float(r)))
same(gathered, torch.cat([torch.full((k + 1, 2), float(k)) for k in range(n)]))
same(hvd.broadcast(mine, root_rank=n - 1), each[n - 1])
t = mine.clone()
hvd.broadcast_(t, root_rank=1 % n)
same(t, each[1 % n])
assert hvd.broadcast_object({"from": r}, root_rank=0) == {"from": 0}
assert hvd.allgather_object(r * r) == [k * k for k in range(n)]
hvd.barrier()
assert hvd.join() == n - 1

# What elastic-run cannot do is refused, saying what to use.
for call, says in [
        (lambda: hvd.allreduce(mine, op=hvd.Adasum), "Adasum is not supported"),
        (lambda: hvd.allreduce(mine, op=hvd.Sum, average=True), "not both"),
        (lambda: hvd.allreduce(mine, process_set=object()), "process sets"),
        (lambda: hvd.init(comm=[0, 1]), "no MPI"),
        (lambda: hvd.DistributedOptimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)],
                                                          lr=1), op=hvd.Adasum), "Adasum"),
        (lambda: hvd.DistributedOptimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)],
                                                          lr=1), op=hvd.Min), "hvd.Average or hvd.Sum")]:
    try:
        call()
    except (ValueError, NotImplementedError) as e:
        assert says in str(e), (says, str(e))
    else:
        raise AssertionError(f"not refused: {says}")

# The optimizer: gradients averaged over ranks, with and without fp16 compression and a
# predivide factor; sparse gradients as dense.
def grads_after(**kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(), **kw)
    x = torch.full((3, 4), float(r + 1))
    model(x).sum().backward()
    opt.synchronize()
    return [p.grad.clone() for p in model.parameters()]


def local_grads(k):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    model(torch.full((3, 4), float(k + 1))).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


want = [sum(gs) / n for gs in zip(*[local_grads(k) for k in range(n)])]
for got, w in zip(grads_after(), want):
    same(got, w, 1e-6)
for got, w in zip(grads_after(gradient_predivide_factor=2.0), want):
    same(got, w, 1e-5)
for got, w in zip(grads_after(compression=hvd.Compression.fp16), want):
    same(got, w, 1e-2)  # float16 rounding of the summed gradients
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    grads_after(num_groups=2)
assert any("fusion groups" in str(w.message) for w in caught)

emb = torch.nn.Embedding(5, 3, sparse=True)
torch.nn.init.constant_(emb.weight, 1.0)
opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.0),
                               named_parameters=emb.named_parameters(), sparse_as_dense=True)
emb(torch.tensor([r % 5])).sum().backward()
opt.synchronize()
dense = torch.zeros(5, 3)
for k in range(n):
    dense[k % 5] += 1.0 / n
same(emb.weight.grad, dense, 1e-6)

print(f"horovod api ok: rank {r} of {n}", flush=True)
