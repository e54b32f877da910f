"""The Python/torch CUDA path under elastic-run --backend nccl (tests/gpu/run.sh): every
collective on CUDA tensors of every dtype against a CPU reference, a DistributedOptimizer step
on a CUDA model, and a TorchState commit/restore of CUDA tensors. Prints "torch gpu: ok"."""
import sys

import torch

import elastic
import elastic.torch as et

elastic.init()
assert elastic.backend() == "nccl", elastic.backend()
torch.cuda.set_device(elastic.local_rank())
dev = torch.device("cuda", elastic.local_rank())
r, n = elastic.rank(), elastic.size()

for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
              torch.int64):
    for op, ref in ((elastic.Sum, lambda xs: sum(xs)),
                    (elastic.Min, lambda xs: torch.stack(xs).min(0).values),
                    (elastic.Max, lambda xs: torch.stack(xs).max(0).values)):
        mine = (torch.arange(64) % 7 + 1 + r).to(dtype)
        want = ref([(torch.arange(64) % 7 + 1 + k).to(dtype) for k in range(n)])
        got = elastic.allreduce(mine.to(dev), op=op).cpu()
        assert torch.equal(got, want), (dtype, op, got, want)

x = torch.full((1000,), float(r), device=dev)
elastic.broadcast_(x, root_rank=n - 1)
assert torch.all(x == n - 1)
parts = elastic.allgather(torch.full((r + 1, 3), float(r), device=dev))
assert parts.device == dev and parts.shape == (n * (n + 1) // 2, 3)
ts = [torch.ones(100 + k, device=dev) for k in range(30)]
elastic.grouped_allreduce_(ts, op=elastic.Sum)
assert all(torch.all(t == n) for t in ts)

torch.manual_seed(0)
model = torch.nn.Linear(16, 4).to(dev)
opt = et.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                              named_parameters=model.named_parameters())
et.broadcast_parameters(model.state_dict(), root_rank=0)
loss = model(torch.randn(8, 16, device=dev) * (r + 1)).pow(2).sum()
loss.backward()
opt.step()
w = model.weight.detach().clone()
elastic.broadcast_(w, root_rank=0)
assert torch.allclose(w, model.weight), "ranks disagree after a step"

state = et.TorchState(model=model, optimizer=opt)
state.commit()
before = model.weight.detach().clone()
with torch.no_grad():
    model.weight.add_(1.0)
state.restore()
assert torch.equal(model.weight, before) and model.weight.device == dev
print(f"rank {r}: torch gpu: ok", flush=True)
