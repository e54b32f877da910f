"""The torch.distributed (ProcessGroupGloo) side of allreduce_bench: N local processes; rank 0
prints one JSON line per measurement, like allreduce_worker."""
import json
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def iters_for(nbytes):
    return 50 if nbytes <= 1 << 20 else 10 if nbytes <= 16 << 20 else 5


def time_it(iters, op):
    op()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        op()
    dist.barrier()
    t = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def worker(rank, size, port, sizes):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    for nbytes in sizes:
        buf = torch.ones(nbytes // 4, dtype=torch.float32)
        s = time_it(iters_for(nbytes), lambda: dist.all_reduce(buf))
        b = time_it(iters_for(nbytes), lambda: dist.broadcast(buf, 0))
        if rank == 0:
            print(json.dumps({"impl": "torch", "what": "allreduce", "bytes": nbytes,
                              "seconds": s}), flush=True)
            print(json.dumps({"impl": "torch", "what": "broadcast", "bytes": nbytes,
                              "seconds": b}), flush=True)
    tensors = [torch.ones(1024, dtype=torch.float32) for _ in range(1000)]

    def per_tensor():
        for t in tensors:
            dist.all_reduce(t)

    s = time_it(3, per_tensor)
    if rank == 0:
        print(json.dumps({"impl": "torch", "what": "1000x4KiB", "bytes": 1000 * 4096,
                          "seconds": s}), flush=True)
    # torch's own coalescing: one flattened collective for the list (what DDP's buckets do).
    s = time_it(20, lambda: dist.all_reduce_coalesced(tensors))
    if rank == 0:
        print(json.dumps({"impl": "torch", "what": "1000x4KiB-coalesced", "bytes": 1000 * 4096,
                          "seconds": s}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    size, port = int(sys.argv[1]), int(sys.argv[2])
    sizes = [int(x) for x in sys.argv[3:]]
    mp.start_processes(worker, args=(size, port, sizes), nprocs=size, start_method="spawn")
