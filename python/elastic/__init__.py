"""elastic: elastic data-parallel training under elastic-run.

The API follows Horovod's (``import elastic as hvd`` ports most scripts); docs/python.md lists
every difference. Under ``elastic-run`` each worker joins the job on ``init()``; run under
plain ``python3``, ``init()`` gives a job of size 1 and says so once on stderr.

    import elastic

    state = elastic.ObjectState(epoch=0, step=0)

    @elastic.run
    def train(state):
        while state.epoch < 5:
            ...
            elastic.allreduce_(grads, op=elastic.Average)
            state.step += 1
            state.commit()

    train(state)
"""
import functools
import os
import pickle
import sys

from . import _elastic as _C

__all__ = [
    "init", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
    "cross_size", "current_round", "slot", "backend", "allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_",
    "broadcast", "broadcast_", "allgather", "barrier", "broadcast_object", "allgather_object",
    "run", "State", "ObjectState", "WorkerLostError", "HostsUpdatedInterrupt", "leave",
    "Sum", "Average", "Min", "Max",
]


class WorkerLostError(RuntimeError):
    """A peer of this round is gone: the collective failed. @elastic.run rolls the state back
    to its last commit and re-forms the job."""


class HostsUpdatedInterrupt(RuntimeError):
    """The driver announced a membership change; raised by State.commit() at the same commit on
    every rank, right after the save, so no committed work is lost."""


_C._set_exceptions(WorkerLostError, HostsUpdatedInterrupt)


def _wheel_library_paths():
    """The libnccl.so.2 and libcudart of PyPI's wheels in this environment (nvidia-nccl-cu12 or
    -cu13, nvidia-cuda-runtime), which torch's wheels install: the NCCL backend loads them when
    the process has none loaded yet (see LoadNcclApi in worker_agent/nccl_api.h)."""
    import importlib.util
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    roots = list(spec.submodule_search_locations or []) if spec else []
    nccl = [os.path.join(r, "nccl", "lib", "libnccl.so.2") for r in roots]
    cudart = [os.path.join(r, sub, "lib", name) for r in roots
              for sub, name in (("cu13", "libcudart.so.13"), ("cuda_runtime", "libcudart.so.12"))]
    return [p for p in nccl if os.path.exists(p)], [p for p in cudart if os.path.exists(p)]


_C._set_wheel_library_paths(*_wheel_library_paths())


def _register_stack_dump():
    # When elastic-run finds this worker hung it sends SIGUSR2 first: every thread's Python
    # stack goes to stderr (into the job's log) before the worker is killed. Left alone when
    # the program handles SIGUSR2 itself.
    import faulthandler
    import signal
    if "ELASTIC_DRIVER_ADDR" not in os.environ or not hasattr(signal, "SIGUSR2"):
        return
    if signal.getsignal(signal.SIGUSR2) not in (signal.SIG_DFL, None):
        return
    try:
        faulthandler.register(signal.SIGUSR2, all_threads=True, chain=False)
    except (RuntimeError, ValueError):  # not the main thread
        return
    _C._set_stack_signal(int(signal.SIGUSR2))


_register_stack_dump()

# Reduction ops (Horovod's names).
Sum, Average, Min, Max = (_C.REDUCE_OPS[n] for n in ("sum", "avg", "min", "max"))
_OPS = {Sum: "Sum", Average: "Average", Min: "Min", Max: "Max"}

_initialized = False
_local = False  # True: not under elastic-run, a job of size 1


def _warm_up_torch():
    """Before this process reaches the driver: what the program's first use of torch.optim
    would import, if the program imported torch. A process that joins a running job (a new
    worker for a lost one's slot, a new host's, a warm spare) counts as ready once init()
    reaches the driver; its peers then take it in at their next commit and wait, in the state
    sync, for it to get from init() to its training loop. torch 2.x's first optimizer imports
    torch._dynamo there: 0.93 s of that wait on a 2-core machine with torch 2.15 (measured by
    bench/peers, docs/comparison.md). Made here it is part of the process's start, which nobody
    waits for. ELASTIC_WARM_UP=0 leaves it out. Any error is left to the program's own use."""
    torch = sys.modules.get("torch")
    if torch is None or os.environ.get("ELASTIC_WARM_UP", "1").strip().lower() in (
            "0", "false", "no", "off"):
        return
    try:
        import torch.optim  # noqa: F401  (a submodule: torch may not have loaded it yet)
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    except Exception:  # noqa: BLE001  (a warm-up only)
        pass


def init():
    """Joins the job (round 0) and builds the communicator. Idempotent. Outside elastic-run,
    a job of size 1 (said once on stderr)."""
    global _initialized, _local
    if _initialized:
        return
    if not os.environ.get("ELASTIC_DRIVER_ADDR"):
        _local = True
        print("elastic: not started by elastic-run; running as a job of size 1",
              file=sys.stderr, flush=True)
    else:
        _warm_up_torch()
        _C.init()
    _initialized = True


def is_initialized():
    return _initialized


def _assignment():
    if not _initialized:
        raise ValueError("elastic is not initialized: call elastic.init() first")
    if _local:
        return {"rank": 0, "size": 1, "local_rank": 0, "local_size": 1, "cross_rank": 0,
                "cross_size": 1, "round": 0}
    return _C.assignment()


def rank():
    return _assignment()["rank"]


def size():
    return _assignment()["size"]


def local_rank():
    return _assignment()["local_rank"]


def local_size():
    return _assignment()["local_size"]


def cross_rank():
    return _assignment()["cross_rank"]


def cross_size():
    return _assignment()["cross_size"]


def current_round():
    """The membership round this worker is in (it changes after every reset)."""
    return _assignment()["round"]


def slot():
    """This worker's slot, "host:index": its identity across rounds (ranks change)."""
    return _C.slot() if not _local else "local:0"


# --- buffers: numpy arrays and CPU torch tensors, by pointer (never copied) -----------------

# The codes are the C++ enum's (common/communicator.h), from the binding.
_NUMPY_CODES = {n: _C.DTYPES[c] for n, c in (("float32", "f32"), ("float64", "f64"),
                                              ("float16", "f16"), ("int32", "i32"),
                                              ("int64", "i64"))}
_TORCH_CODES = {"torch." + n: c for n, c in _NUMPY_CODES.items()}
_TORCH_CODES["torch.bfloat16"] = _C.DTYPES["bf16"]


def _is_torch(x):
    return type(x).__module__.startswith("torch")


def backend():
    """Which communicator carries collectives on CUDA tensors: "nccl", or "gloo" (CPU tensors
    and numpy arrays always go through Gloo). Set by elastic-run --backend (auto by default:
    NCCL where the worker sees a CUDA device)."""
    init()
    return "gloo" if _local else _C.backend()


def _is_cuda(x):
    return _is_torch(x) and x.device.type == "cuda"


def _cuda_view(x, what):
    """(pointer, element count, dtype code, stream) of a contiguous CUDA tensor for the NCCL
    communicator; ValueError naming what is wrong otherwise."""
    code = _TORCH_CODES.get(str(x.dtype))
    if code is None:
        raise ValueError(f"{what}: dtype {x.dtype} is not supported (float32, float64, "
                         "float16, bfloat16, int32, int64)")
    if not x.is_contiguous():
        raise ValueError(f"{what}: the tensor is not contiguous (call .contiguous())")
    if _local:
        return x.data_ptr(), x.numel(), code, 0
    if _C.backend() != "nccl":
        raise ValueError(f"{what}: the tensor is on {x.device} but this worker's backend is "
                         f"{_C.backend()}: start the job with `elastic-run --backend nccl` (or "
                         "auto, the default, on a machine with GPUs), or move it to the CPU")
    if x.device.index != _C.device():
        raise ValueError(f"{what}: the tensor is on {x.device} but this worker's NCCL "
                         f"communicator is on cuda:{_C.device()} (local rank "
                         f"{local_rank()}); use torch.cuda.set_device(elastic.local_rank())")
    import torch
    return x.data_ptr(), x.numel(), code, torch.cuda.current_stream(x.device).cuda_stream


def _view(x, what, writable=True):
    """(pointer, element count, dtype code) of a contiguous numpy array or CPU torch tensor;
    ValueError naming what is wrong otherwise."""
    if _is_torch(x):
        code = _TORCH_CODES.get(str(x.dtype))
        if code is None:
            raise ValueError(f"{what}: dtype {x.dtype} is not supported (float32, float64, "
                             "float16, bfloat16, int32, int64)")
        if x.device.type != "cpu":
            raise ValueError(f"{what}: the tensor is on {x.device}; the Gloo backend takes CPU "
                             "tensors")
        if not x.is_contiguous():
            raise ValueError(f"{what}: the tensor is not contiguous (call .contiguous())")
        return x.data_ptr(), x.numel(), code
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        np = None
    if np is not None and isinstance(x, np.ndarray):
        code = _NUMPY_CODES.get(str(x.dtype))
        if code is None:
            raise ValueError(f"{what}: dtype {x.dtype} is not supported (float32, float64, "
                             "float16, int32, int64)")
        if not x.flags["C_CONTIGUOUS"]:
            raise ValueError(f"{what}: the array is not C-contiguous (np.ascontiguousarray)")
        if writable and not x.flags["WRITEABLE"]:
            raise ValueError(f"{what}: the array is read-only")
        return x.ctypes.data, x.size, code
    raise ValueError(f"{what}: expected a numpy array or a CPU torch tensor, got "
                     f"{type(x).__name__}")


def _copy(x):
    return x.clone() if _is_torch(x) else x.copy()


def _check_op(op):
    if op not in _OPS:
        raise ValueError(f"unknown reduction op {op!r}: use elastic.Sum, Average, Min or Max")


def allreduce_(x, op=Average):
    """Reduces `x` in place across all ranks; returns `x`. A CUDA tensor is reduced by NCCL
    on the current stream (the call returns when it is done)."""
    _check_op(op)
    if _is_cuda(x):
        ptr, count, code, stream = _cuda_view(x, "allreduce_")
        if not _local and count:
            _C.allreduce_cuda(ptr, count, code, op, stream)
        return x
    ptr, count, code = _view(x, "allreduce_")
    if not _local and count:
        _C.allreduce(ptr, count, code, op)
    return x


def allreduce(x, op=Average):
    """The reduction of `x` across all ranks, as a new array or tensor."""
    _check_op(op)
    if not _is_cuda(x):
        _view(x, "allreduce", writable=False)
    return allreduce_(_copy(x), op)


def grouped_allreduce_(xs, op=Average):
    """Reduces every array or tensor of `xs` in place, fused into few collectives."""
    _check_op(op)
    xs = list(xs)
    if xs and all(_is_cuda(x) for x in xs):
        views = [_cuda_view(x, f"grouped_allreduce_[{i}]") for i, x in enumerate(xs)]
        if not _local:
            _C.allreduce_many_cuda([v[:3] for v in views], op, views[0][3])
        return xs
    views = [_view(x, f"grouped_allreduce_[{i}]") for i, x in enumerate(xs)]
    if not _local and views:
        _C.allreduce_many(views, op)
    return xs


def grouped_allreduce(xs, op=Average):
    for i, x in enumerate(xs):
        if not _is_cuda(x):
            _view(x, f"grouped_allreduce[{i}]", writable=False)
    return grouped_allreduce_([_copy(x) for x in xs], op)


def _check_root(root_rank):
    n = size()
    if not isinstance(root_rank, int) or not 0 <= root_rank < n:
        raise ValueError(f"root_rank {root_rank!r} is not a rank of this job (0..{n - 1})")


def broadcast_(x, root_rank=0):
    """Overwrites `x` with root_rank's `x` on every rank; returns `x`."""
    _check_root(root_rank)
    if _is_cuda(x):
        ptr, count, code, stream = _cuda_view(x, "broadcast_")
        if not _local and count:
            _C.broadcast_cuda(ptr, count * _itemsize(code), root_rank, stream)
        return x
    ptr, count, code = _view(x, "broadcast_")
    if not _local and count:
        _C.broadcast(ptr, count * _itemsize(code), root_rank)
    return x


def broadcast(x, root_rank=0):
    """root_rank's `x`, as a new array or tensor on every rank."""
    if not _is_cuda(x):
        _view(x, "broadcast", writable=False)
    return broadcast_(_copy(x), root_rank)


def _itemsize(code):
    return {0: 4, 1: 8, 2: 2, 3: 2, 4: 4, 5: 8}[code]


def allgather(x):
    """Concatenates every rank's `x` along the first dimension (which may differ by rank; the
    others must match). A CUDA tensor goes through the CPU (Gloo) and comes back on its
    device."""
    if _is_cuda(x):
        return allgather(x.detach().cpu()).to(x.device)
    ptr, count, code = _view(x, "allgather", writable=False)
    shape = tuple(x.shape)
    if len(shape) == 0:
        raise ValueError("allgather: a 0-dimensional value has no first dimension to gather "
                         "along (reshape it to (1,))")
    if _local:
        return _copy(x)
    header = pickle.dumps((shape[1:], code))
    data = _as_bytes(x)
    parts = [pickle.loads(p) for p in _C.allgather(pickle.dumps((header, data)))]
    heads = [pickle.loads(h) for h, _ in parts]
    if any(h != heads[0] for h in heads):
        raise ValueError(f"allgather: ranks differ beyond the first dimension or in dtype: "
                         f"{[h for h in heads]}")
    return _concat(x, [d for _, d in parts], shape[1:])


def _as_bytes(x):
    if _is_torch(x):
        import torch
        return x.contiguous().view(torch.uint8).numpy().tobytes() if x.numel() else b""
    return x.tobytes()


def _concat(like, chunks, rest):
    if _is_torch(like):
        import torch
        pieces = [torch.frombuffer(bytearray(c), dtype=like.dtype) if c else
                  torch.empty(0, dtype=like.dtype) for c in chunks]
        return torch.cat([p.reshape(-1, *rest) for p in pieces])
    import numpy as np
    return np.concatenate([np.frombuffer(c, dtype=like.dtype).reshape(-1, *rest)
                           for c in chunks])


def barrier():
    """Waits until every rank got here."""
    if not _local:
        _C.barrier()


def broadcast_object(obj, root_rank=0):
    """root_rank's `obj` (pickled) on every rank."""
    _check_root(root_rank)
    if _local:
        return obj
    import numpy as np
    data = pickle.dumps(obj) if rank() == root_rank else b""
    n = np.array([len(data)], dtype=np.int64)
    _C.broadcast(n.ctypes.data, 8, root_rank)
    buf = np.frombuffer(bytearray(data) if data else bytearray(int(n[0])), dtype=np.uint8)
    if n[0]:
        _C.broadcast(buf.ctypes.data, int(n[0]), root_rank)
    return obj if rank() == root_rank else pickle.loads(buf.tobytes())


def allgather_object(obj):
    """Every rank's `obj` (pickled), as a list in rank order."""
    if _local:
        return [obj]
    return [pickle.loads(p) for p in _C.allgather(pickle.dumps(obj))]


def leave(reason=""):
    """Tells the driver that this worker leaves the job of its own accord (the job re-forms
    without it at once), then exits 0."""
    if _initialized and not _local:
        _C.report_leaving(str(reason))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --- state and the recovery loop --------------------------------------------------------------

class State(_C.State):
    """What training commits, restores and syncs. Subclasses define save(), restore() and
    sync(root_rank)."""

    def __init__(self):
        _C.State.__init__(self)

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync(self, root_rank=0):
        raise NotImplementedError

    def commit(self):
        """Saves the state as the next version, then raises HostsUpdatedInterrupt (on every
        rank at the same commit) when the driver announced a membership change."""
        _C.State.commit(self)

    def checkpoint_files(self):
        """Optional, for --checkpoint-dir: the committed state (what the last save() made) as
        ``{name: bytes}``, one file each in the checkpoint's folder (``value.<name>``). Called
        on the training thread right after a commit, when a checkpoint is due; the files are
        then written off it. None (the default): this state is not checkpointed."""
        return None

    def load_checkpoint(self, files):
        """Optional, for --checkpoint-dir: set the values from ``{name: bytes}``, what
        checkpoint_files() gave. The state is then committed (save()) as the checkpoint's
        version. Raise to refuse a checkpoint (the one before it is tried)."""
        raise NotImplementedError(f"{type(self).__name__} defines no load_checkpoint()")

    def progress(self):
        """Optional: ``(epoch, cursor, samples, epoch_size)`` of the training at the last
        commit (samples: consumed over all epochs), for the driver's status, progress lines and
        event log; None (the default) reports the step only. TorchState defines it from its
        sampler."""
        return None

    def check_host_updates(self):
        """Raises HostsUpdatedInterrupt when the driver announced a membership change (agreed
        by every rank)."""
        if _initialized and not _local:
            _C.check_host_updates()

    def register_reset_callbacks(self, callbacks):
        """Functions called after every reset (a new round), e.g. to rescale a learning rate."""
        for fn in callbacks:
            self._on_reset(fn)


class ObjectState(State):
    """Named Python values (pickled) committed, restored and synced from rank 0:
    ``ObjectState(epoch=0, batch=0)``; read and write them as attributes."""

    def __init__(self, **attrs):
        State.__init__(self)
        self._names = list(attrs)
        for k, v in attrs.items():
            setattr(self, k, v)
        self.save()

    def _values(self):
        return {k: getattr(self, k) for k in self._names}

    def save(self):
        self._saved = pickle.dumps(self._values())

    def restore(self):
        for k, v in pickle.loads(self._saved).items():
            setattr(self, k, v)

    def checkpoint_files(self):
        return {"values": self._saved}

    def load_checkpoint(self, files):
        values = pickle.loads(files["values"])
        if sorted(values) != sorted(self._names):
            raise ValueError(f"the checkpoint holds {sorted(values)}, this state "
                             f"{sorted(self._names)}")
        for k, v in values.items():
            setattr(self, k, v)

    def sync(self, root_rank=0):
        version, values = broadcast_object((self.version, self._values()), root_rank)
        for k, v in values.items():
            setattr(self, k, v)
        self.save()
        self._set_version(version)


def run(func):
    """Decorates ``train(state, *args, **kwargs)`` with the recovery loop: a lost peer
    (WorkerLostError) rolls `state` back to its last commit, an announced change
    (HostsUpdatedInterrupt) re-forms at the commit, the state is synced from a holder of the
    newest commit when the driver says a member lacks it, reset callbacks run after every new
    round, and a worker scaled away exits 0. Any other exception propagates."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        init()
        if _local:
            return func(state, *args, **kwargs)
        result = []

        def train():
            result.append(func(state, *args, **kwargs))

        _C.run(state, train)
        return result[-1] if result else None

    return wrapper
