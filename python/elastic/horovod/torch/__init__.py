"""Horovod's PyTorch API (``horovod.torch``) over elastic-run.

    import elastic.horovod.torch as hvd      # instead of: import horovod.torch as hvd

    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.fp16, op=hvd.Average)
    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state): ...

Everything here runs on elastic's collectives; what elastic-run cannot do (Adasum, process
sets, MPI) raises an error that names the alternative. docs/horovod.md lists every difference.
"""
import os
import socket
import warnings

import torch

import elastic as _el
import elastic.torch as _et

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "allreduce", "allreduce_", "grouped_allreduce",
    "grouped_allreduce_", "allgather", "broadcast", "broadcast_", "broadcast_object",
    "allgather_object", "barrier", "join", "DistributedOptimizer", "broadcast_parameters",
    "broadcast_optimizer_state", "Compression", "Average", "Sum", "Min", "Max", "Product",
    "Adasum", "nccl_built", "gloo_built", "mpi_built", "gloo_enabled", "mpi_enabled",
    "cuda_built", "rocm_built", "ddl_built", "ccl_built", "mpi_threads_supported", "elastic",
    "HorovodInternalError", "HostsUpdatedInterrupt",
]

# The exceptions Horovod's elastic scripts catch, under Horovod's names.
HorovodInternalError = _el.WorkerLostError
HostsUpdatedInterrupt = _el.HostsUpdatedInterrupt

# Reduction ops, Horovod's names. Sum, Average, Min and Max are elastic's own; Product is
# computed from an allgather; Adasum is refused.
Sum, Average, Min, Max = _el.Sum, _el.Average, _el.Min, _el.Max
Product = 4
Adasum = 5
_OP_NAMES = {Sum: "Sum", Average: "Average", Min: "Min", Max: "Max", Product: "Product",
             Adasum: "Adasum"}


class _ProcessSetRefused(ValueError):
    pass


global_process_set = None  # Horovod's default process set: the whole job


def _no_process_set(process_set, what):
    if process_set is not None and process_set is not global_process_set:
        raise _ProcessSetRefused(
            f"{what}: process sets are not supported by elastic-run (every collective spans "
            "the whole job); leave process_set at its default")


def _no_adasum(op, what):
    if op == Adasum:
        raise NotImplementedError(
            f"{what}: Adasum is not supported by elastic-run; use op=hvd.Average (the default) "
            "or hvd.Sum")


# --- basics ------------------------------------------------------------------------------------

def _set_env():
    """Horovod's environment variables, for scripts that read them: set at init and after
    every reset (ranks and sizes change with the membership)."""
    a = _el._assignment()
    os.environ.update({
        "HOROVOD_RANK": str(a["rank"]), "HOROVOD_SIZE": str(a["size"]),
        "HOROVOD_LOCAL_RANK": str(a["local_rank"]), "HOROVOD_LOCAL_SIZE": str(a["local_size"]),
        "HOROVOD_CROSS_RANK": str(a["cross_rank"]), "HOROVOD_CROSS_SIZE": str(a["cross_size"]),
        "HOROVOD_HOSTNAME": os.environ.get("ELASTIC_HOSTNAME") or socket.gethostname(),
    })


def init(comm=None, process_sets=None):
    """Joins the job (see elastic.init). `comm` (an MPI communicator) and `process_sets` are
    refused: elastic-run has neither."""
    if comm is not None:
        raise ValueError("hvd.init(comm=...): elastic-run has no MPI; call hvd.init() and run "
                         "the script under elastic-run")
    if process_sets is not None:
        raise _ProcessSetRefused("hvd.init(process_sets=...): process sets are not supported "
                                 "by elastic-run; every collective spans the whole job")
    _el.init()
    _set_env()


def shutdown():
    """Horovod's shutdown. Under elastic-run a worker leaves the job when it exits (or with
    elastic.leave()); this does nothing else."""


def is_initialized():
    return _el.is_initialized()


rank, size = _el.rank, _el.size
local_rank, local_size = _el.local_rank, _el.local_size
cross_rank, cross_size = _el.cross_rank, _el.cross_size


def nccl_built():
    """Whether collectives of CUDA tensors go through NCCL in this job (elastic-run's NCCL
    backend: a visible GPU and a loadable libnccl)."""
    return _el.is_initialized() and _el.backend() == "nccl"


def gloo_built():
    return True


def gloo_enabled():
    return True


def mpi_built():
    return False


def mpi_enabled():
    return False


def mpi_threads_supported():
    return False


def cuda_built():
    return torch.cuda.is_available()


def rocm_built():
    return False


def ddl_built():
    return False


def ccl_built():
    return False


# --- compression -------------------------------------------------------------------------------

class Compressor:
    """Horovod's compressor interface: compress(tensor) -> (tensor, ctx);
    decompress(tensor, ctx) -> tensor."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16 (half the bytes) and come back in their own
    dtype; other tensors travel as they are."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx) if ctx is not None else tensor


class Compression:
    none = NoneCompressor
    fp16 = FP16Compressor


# --- collectives -------------------------------------------------------------------------------

def _resolve_op(average, op, what):
    if op is not None and average is not None:
        raise ValueError(f"{what}: give op= or the older average=, not both")
    if op is None:
        op = Sum if average is False else Average
    if op not in _OP_NAMES:
        raise ValueError(f"{what}: unknown op {op!r} (use hvd.Average, Sum, Min, Max or "
                         "Product)")
    _no_adasum(op, what)
    return op


def _reduce(t, op):
    """`t` reduced over every rank with `op` (a new tensor)."""
    if op == Product:
        return _el.allgather(t.reshape(1, *t.shape)).prod(dim=0).to(t.dtype)
    return _el.allreduce(t, op=op)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """A new tensor: `tensor` reduced over every rank (by default averaged). `name` is
    accepted and unused (elastic's collectives run in program order, not matched by name)."""
    _no_process_set(process_set, "allreduce")
    op = _resolve_op(average, op, "allreduce")
    t, ctx = compression.compress(tensor.detach())
    if prescale_factor != 1.0:
        t = t * prescale_factor
    out = _reduce(t.contiguous(), op)
    if postscale_factor != 1.0:
        out = out * postscale_factor
    return compression.decompress(out, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """`tensor` reduced in place over every rank; returns it."""
    out = allreduce(tensor, average=average, op=op, prescale_factor=prescale_factor,
                    postscale_factor=postscale_factor, process_set=process_set)
    with torch.no_grad():
        tensor.copy_(out)
    return tensor


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """New tensors: each of `tensors` reduced over every rank, in one fused reduction when
    they share a dtype and no compression or scaling is asked for."""
    _no_process_set(process_set, "grouped_allreduce")
    op = _resolve_op(average, op, "grouped_allreduce")
    tensors = list(tensors)
    simple = (compression is Compression.none and prescale_factor == 1.0 and
              postscale_factor == 1.0 and op != Product and
              len({t.dtype for t in tensors}) <= 1)
    if simple and tensors:
        return _el.grouped_allreduce([t.detach() for t in tensors], op=op)
    return [allreduce(t, op=op, compression=compression, prescale_factor=prescale_factor,
                      postscale_factor=postscale_factor) for t in tensors]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    tensors = list(tensors)
    outs = grouped_allreduce(tensors, average=average, op=op, prescale_factor=prescale_factor,
                             postscale_factor=postscale_factor, process_set=process_set)
    with torch.no_grad():
        for t, o in zip(tensors, outs):
            t.copy_(o)
    return tensors


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's `tensor` concatenated along the first dimension (which may differ by
    rank)."""
    _no_process_set(process_set, "allgather")
    return _el.allgather(tensor.detach())


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """A new tensor: root_rank's `tensor`."""
    _no_process_set(process_set, "broadcast")
    return _el.broadcast(tensor.detach(), root_rank)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """`tensor` overwritten with root_rank's; returns it."""
    _no_process_set(process_set, "broadcast_")
    out = _el.broadcast(tensor.detach(), root_rank)
    with torch.no_grad():
        tensor.copy_(out)
    return tensor


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    _no_process_set(process_set, "broadcast_object")
    return _el.broadcast_object(obj, root_rank)


def allgather_object(obj, name=None, process_set=global_process_set):
    _no_process_set(process_set, "allgather_object")
    return _el.allgather_object(obj)


def barrier(process_set=global_process_set):
    _no_process_set(process_set, "barrier")
    _el.barrier()


def join(device=-1):
    """Horovod's join, as a barrier: every rank must call it. (Horovod lets a rank that ran
    out of data join early while the others go on reducing; elastic's ElasticSampler gives
    every rank the same number of steps, so none runs out early.) Returns the highest rank,
    as which rank arrived last is not tracked."""
    _el.barrier()
    return size() - 1


# --- the optimizer -----------------------------------------------------------------------------

class DistributedOptimizer(_et.DistributedOptimizer):
    """Horovod's DistributedOptimizer over elastic's (fused buckets reduced while backward
    runs): `compression` (Compression.fp16 sends gradients as float16),
    `backward_passes_per_step`, `op` (Average or Sum), `gradient_predivide_factor` (with
    Average: gradients are divided by it before the sum and multiplied by it over the size
    after) and `sparse_as_dense` (sparse gradients are reduced as dense ones; without it they
    are refused). `num_groups` and `groups` set Horovod's fusion groups: elastic fuses by
    bucket size instead, and says so once."""

    def __init__(self, optimizer, named_parameters=None, compression=Compression.none,
                 backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                 num_groups=0, groups=None, sparse_as_dense=False,
                 process_set=global_process_set):
        _no_process_set(process_set, "DistributedOptimizer")
        _no_adasum(op, "DistributedOptimizer")
        if op not in (Average, Sum):
            raise ValueError(f"DistributedOptimizer: op must be hvd.Average or hvd.Sum, not "
                             f"{_OP_NAMES.get(op, op)}")
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("DistributedOptimizer: gradient_predivide_factor needs op=hvd.Average")
        if num_groups or groups is not None:
            warnings.warn("DistributedOptimizer: num_groups/groups are Horovod's fusion groups; "
                          "elastic-run fuses gradients into 25 MiB buckets instead", stacklevel=2)
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        self.compression = compression
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.sparse_as_dense = sparse_as_dense
        _et.DistributedOptimizer.__init__(self, optimizer, named_parameters=named_parameters,
                                          backward_passes_per_step=backward_passes_per_step,
                                          op=op)

    def _reduce(self, params):
        params = [p for p in params if p.grad is not None]
        if not params or size() == 1:
            return
        for p in params:
            if p.grad.is_sparse:
                if not self.sparse_as_dense:
                    raise ValueError("DistributedOptimizer: a sparse gradient (e.g. from "
                                     "nn.Embedding(sparse=True)); pass sparse_as_dense=True")
                p.grad = p.grad.to_dense()
        f = self.gradient_predivide_factor
        if self.compression is Compression.none and f == 1.0:
            return _et.DistributedOptimizer._reduce(self, params)  # one fused reduction
        op, pre, post = self.op, 1.0, 1.0
        if f != 1.0:
            op, pre, post = Sum, 1.0 / f, f / size()
        with torch.no_grad():
            for g in (p.grad for p in params):
                g.copy_(allreduce(g, op=op, compression=self.compression, prescale_factor=pre,
                                  postscale_factor=post))


broadcast_parameters = _et.broadcast_parameters
broadcast_optimizer_state = _et.broadcast_optimizer_state

from . import elastic  # noqa: E402  (hvd.elastic: run, State, ObjectState, TorchState, ...)
