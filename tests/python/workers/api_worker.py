"""Run by tests/python/test_python_api.py under elastic-run (or plain python3): every call of
the elastic package's API against numpy's answer; prints "api ok rank R of N" when all pass."""
import sys

import numpy as np

import elastic

WITH_TORCH = "--torch" in sys.argv

elastic.init()
assert elastic.is_initialized()
r, n = elastic.rank(), elastic.size()
assert 0 <= elastic.local_rank() < elastic.local_size() and 0 <= elastic.cross_rank() < elastic.cross_size()

DTYPES = ["float32", "float64", "float16", "int32", "int64"]
OPS = {elastic.Sum: "sum", elastic.Average: "avg", elastic.Min: "min", elastic.Max: "max"}


def want(values_by_rank, op, dtype):
    stack = np.stack(values_by_rank).astype(np.float64)
    out = {"sum": stack.sum(0), "min": stack.min(0), "max": stack.max(0),
           "avg": stack.sum(0) / n}[OPS[op]]
    if dtype.startswith("int") and OPS[op] == "avg":
        out = np.floor_divide(stack.sum(0), n)
    return out


def mine(rank, dtype):
    return (np.arange(7) % 3 + rank + 1).astype(dtype)


def check(got, expect, what):
    got = np.asarray(got, dtype=np.float64)
    if not np.allclose(got, expect, rtol=1e-2):
        raise AssertionError(f"{what}: got {got}, want {expect}")


for dtype in DTYPES:
    for op in OPS:
        x = mine(r, dtype)
        expect = want([mine(k, dtype) for k in range(n)], op, dtype)
        before = x.copy()
        y = elastic.allreduce(x, op=op)
        check(y, expect, f"allreduce {dtype} {OPS[op]}")
        assert np.array_equal(x, before), "allreduce changed its input"
        z = elastic.allreduce_(x, op=op)
        assert z is x
        check(x, expect, f"allreduce_ {dtype} {OPS[op]}")

xs = [mine(r, d) for d in DTYPES]
outs = elastic.grouped_allreduce(xs, op=elastic.Sum)
for d, o in zip(DTYPES, outs):
    check(o, want([mine(k, d) for k in range(n)], elastic.Sum, d), f"grouped {d}")

b = elastic.broadcast(np.full(4, r, dtype=np.float64), root_rank=n - 1)
check(b, np.full(4, n - 1), "broadcast")
g = elastic.allgather(np.full((r + 1, 2), r, dtype=np.int32))
assert g.shape == (n * (n + 1) // 2, 2), g.shape
check(g[:, 0], np.concatenate([np.full(k + 1, k) for k in range(n)]), "allgather")
assert elastic.broadcast_object({"from": r, "big": "x" * 100000}, root_rank=0)["from"] == 0
assert elastic.allgather_object(("r", r)) == [("r", k) for k in range(n)]
elastic.barrier()

if WITH_TORCH:
    import torch
    for dt in [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
               torch.int64]:
        t = torch.arange(6, dtype=dt) + r
        out = elastic.allreduce(t, op=elastic.Sum)
        expect = sum(torch.arange(6, dtype=torch.float64) + k for k in range(n))
        assert torch.allclose(out.double(), expect, rtol=1e-2), (dt, out, expect)
        assert torch.equal(t, torch.arange(6, dtype=dt) + r), "input changed"
    t = torch.full((r + 1, 3), float(r), dtype=torch.bfloat16)
    g = elastic.allgather(t)
    assert g.shape == (n * (n + 1) // 2, 3) and g.dtype == torch.bfloat16, g
    t = torch.zeros(5)
    elastic.broadcast_(t, root_rank=0) if r else elastic.broadcast_(t.fill_(3.0), root_rank=0)
    assert torch.all(t == 3.0)

# Waiting calls release the GIL: a Python thread runs while this rank waits in a barrier for
# a rank that is still busy.
import threading
import time

ticks = [0]
stop = threading.Event()


def tick():
    while not stop.is_set():
        ticks[0] += 1
        time.sleep(0.001)


if n > 1:
    t = threading.Thread(target=tick)
    t.start()
    if r == n - 1:
        time.sleep(0.5)
    before = ticks[0]
    elastic.barrier()
    during = ticks[0] - before
    stop.set()
    t.join()
    if r == 0:
        assert during > 50, f"the barrier held the GIL: {during} ticks while it waited"

# State: commit makes versions, restore rolls back, reset callbacks are registered.
st = elastic.ObjectState(a=1, b=[1, 2])
assert st.version == 0
st.a = 2
st.commit()
assert st.version == 1
st.a = 3
st.b.append(3)
st.restore()
assert st.a == 2 and st.b == [1, 2] and st.version == 1
st.register_reset_callbacks([lambda: None])
st.check_host_updates()  # no change announced: returns
st.sync(0)
assert st.version == elastic.broadcast_object(st.version, 0)

if WITH_TORCH:
    import torch
    import elastic.torch as et
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(r))
    et.broadcast_parameters(model.state_dict(), root_rank=0)
    assert all(torch.all(p == 0) for p in model.parameters())
    opt = torch.optim.Adam(model.parameters())
    if r == 0:
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
    et.broadcast_optimizer_state(opt, root_rank=0)
    assert len(opt.state) == 2, opt.state  # Adam's state came from rank 0

# Bad arguments are ValueErrors that name what is wrong, never a crash.
bad = [
    (lambda: elastic.allreduce(np.zeros((4, 4))[:, 1]), "contiguous"),
    (lambda: elastic.allreduce(np.zeros(3, dtype=np.complex64)), "complex64"),
    (lambda: elastic.allreduce([1, 2, 3]), "list"),
    (lambda: elastic.allreduce(np.zeros(3), op=7), "op"),
    (lambda: elastic.broadcast(np.zeros(3), root_rank=n), "root_rank"),
    (lambda: elastic.allgather(np.array(3.0)), "0-dimensional"),
]
if WITH_TORCH:
    import torch
    bad.append((lambda: elastic.allreduce(torch.zeros(4, 4).t()), "contiguous"))
    bad.append((lambda: elastic.allreduce(torch.zeros(3, dtype=torch.complex64)), "complex64"))
for fn, word in bad:
    try:
        fn()
    except ValueError as e:
        assert word in str(e), (word, str(e))
    else:
        raise AssertionError(f"no ValueError for {word}")

print(f"api ok rank {r} of {n}", flush=True)
