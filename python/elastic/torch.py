"""elastic.torch: PyTorch helpers (Horovod's names): TorchState, ElasticSampler,
DistributedOptimizer, broadcast_parameters, broadcast_optimizer_state.

    import elastic, elastic.torch as et

    sampler = et.ElasticSampler(dataset, shuffle=True, seed=0, global_batch_size=64)
    optimizer = et.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())
    state = et.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0)
"""
import io
import queue
import struct
import threading

import torch

import elastic
from elastic import _C

__all__ = ["TorchState", "ElasticSampler", "DistributedOptimizer", "broadcast_parameters",
           "broadcast_optimizer_state"]


# --- state ---------------------------------------------------------------------------------------

def _copy_tree(src, keep):
    """A copy of a nest of dicts/lists/tuples of tensors and values, reusing the tensors of
    `keep` (the previous copy) where shape and dtype match: a commit is then one memcpy per
    tensor into host memory kept for the purpose, and nothing is pickled."""
    if isinstance(src, torch.Tensor):
        t = src.detach()
        if (isinstance(keep, torch.Tensor) and keep.shape == t.shape and keep.dtype == t.dtype):
            keep.copy_(t)
            return keep
        return t.to("cpu", copy=True)
    if isinstance(src, dict):
        keep = keep if isinstance(keep, dict) else {}
        return {k: _copy_tree(v, keep.get(k)) for k, v in src.items()}
    if isinstance(src, (list, tuple)):
        keep = keep if isinstance(keep, (list, tuple)) and len(keep) == len(src) else [None] * len(src)
        out = [_copy_tree(v, k) for v, k in zip(src, keep)]
        return type(src)(out) if isinstance(src, tuple) else out
    return src


def _clone_tree(src):
    """A copy of a nest of dicts/lists/tuples with every tensor cloned."""
    if isinstance(src, torch.Tensor):
        return src.clone()
    if isinstance(src, dict):
        return {k: _clone_tree(v) for k, v in src.items()}
    if isinstance(src, (list, tuple)):
        out = [_clone_tree(v) for v in src]
        return type(src)(out) if isinstance(src, tuple) else out
    return src


class TorchState(elastic.ObjectState):
    """A model, its optimizer, an ElasticSampler and any other values (`**attrs`, pickled)
    committed, restored and synced together. A commit copies every tensor of the model's and
    the optimizer's state dicts into host buffers it keeps (a memcpy each); a sync broadcasts
    the model's tensors in place from the holder of the newest commit, and the optimizer's
    state (which a newcomer may not have yet) as an object."""

    def __init__(self, model=None, optimizer=None, sampler=None, **attrs):
        self.model = model
        self.optimizer = optimizer
        self.sampler = sampler
        self._model_saved = None
        self._opt_saved = None
        self._sampler_saved = None
        elastic.ObjectState.__init__(self, **attrs)
        if sampler is not None:
            self.register_reset_callbacks([self._reset_sampler])

    def progress(self):
        if self.sampler is None:
            return None
        s, n = self.sampler, self.sampler.num_samples_total
        return (s.epoch, s.cursor, s.epoch * n + s.cursor, n)

    def _reset_sampler(self):
        self.sampler.set_rank(elastic.rank(), elastic.size())

    def _optimizer(self):
        opt = self.optimizer
        return opt.optimizer if isinstance(opt, DistributedOptimizer) else opt

    def save(self):
        if self.model is not None:
            self._model_saved = _copy_tree(self.model.state_dict(), self._model_saved)
        if self.optimizer is not None:
            self._opt_saved = _copy_tree(self._optimizer().state_dict(), self._opt_saved)
        if self.sampler is not None:
            self._sampler_saved = self.sampler.state_dict()
        elastic.ObjectState.save(self)

    def restore(self):
        if self.model is not None:
            self.model.load_state_dict(self._model_saved)
        if self.optimizer is not None:
            # A copy: torch 2.x's Optimizer.load_state_dict keeps the tensors it is given
            # (1.13 deep-copied them), so the optimizer would train on in the commit's own
            # buffers (momentum, Adam's moments), and the next rollback would restore whatever
            # they had become: a model off the fault-free one after two rollbacks (the soak,
            # seed 510879041).
            self._optimizer().load_state_dict(_clone_tree(self._opt_saved))
        if self.sampler is not None:
            self.sampler.load_state_dict(self._sampler_saved)
        elastic.ObjectState.restore(self)

    def checkpoint_files(self):
        """The committed model, optimizer and sampler state dicts, each a file that
        ``torch.load`` reads (``value.model``, ``value.optimizer``, ``value.sampler``), and the
        other values pickled (``value.values``)."""
        files = elastic.ObjectState.checkpoint_files(self)
        for name, saved in (("model", self._model_saved), ("optimizer", self._opt_saved),
                            ("sampler", self._sampler_saved)):
            if saved is not None:
                buf = io.BytesIO()
                torch.save(saved, buf)
                files[name] = buf.getvalue()
        return files

    def load_checkpoint(self, files):
        want = {"values"} | {n for n, v in (("model", self.model), ("optimizer", self.optimizer),
                                            ("sampler", self.sampler)) if v is not None}
        if set(files) != want:
            raise ValueError(f"the checkpoint holds {sorted(files)}, this state {sorted(want)}")
        load = lambda name: torch.load(io.BytesIO(files[name]), map_location="cpu")  # noqa: E731
        elastic.ObjectState.load_checkpoint(self, files)
        if self.model is not None:
            self.model.load_state_dict(load("model"))
        if self.optimizer is not None:
            self._optimizer().load_state_dict(load("optimizer"))
        if self.sampler is not None:
            self.sampler.load_state_dict(load("sampler"))

    def sync(self, root_rank=0):
        if self.model is not None:
            for t in self.model.state_dict().values():
                if t.numel():
                    elastic.broadcast_(t.data if t.is_contiguous() else t.contiguous(), root_rank)
        extra = elastic.broadcast_object(
            (self.version, self._values(),
             self._optimizer().state_dict() if self.optimizer is not None else None,
             self.sampler.state_dict() if self.sampler is not None else None), root_rank)
        version, values, opt_state, sampler_state = extra
        for k, v in values.items():
            setattr(self, k, v)
        if opt_state is not None and elastic.rank() != root_rank:
            self._optimizer().load_state_dict(opt_state)
        if sampler_state is not None:
            self.sampler.load_state_dict(sampler_state)
        self.save()
        self._set_version(version)


# --- data ------------------------------------------------------------------------------------------

class ElasticSampler(torch.utils.data.Sampler):
    """This rank's share of the epoch's remaining indices, in the exactly-once order of the
    C++ ElasticSampler: a permutation of `seed + epoch` and a cursor that committed steps
    advance. Rank i of n takes the remaining positions strided (i, i+n, ...).

    With `global_batch_size` G, every step consumes exactly G indices at any world size: use
    ``DataLoader(dataset, batch_size=sampler.batch_size, sampler=sampler)`` (re-made after a
    reset, as the size changes); ranks beyond G in a step get padding. Without it, a step of
    batch B consumes B * size indices.

    After each step call ``record_batch(batch_idx, batch_size)`` (or record_indices); commit
    the sampler with TorchState(sampler=...). ``padding_mask(batch_idx, batch_size)`` says which
    of this rank's samples in that batch are repeats that fill the step: give them zero weight.
    """

    def __init__(self, dataset, shuffle=True, seed=0, global_batch_size=None):
        self.dataset = dataset
        self.num_samples_total = len(dataset)
        self.shuffle = shuffle
        self.seed = seed
        self.global_batch_size = global_batch_size
        self._s = _C.ElasticSampler(self.num_samples_total, bool(shuffle), int(seed))
        self.rank, self.size = 0, 1
        if elastic.is_initialized():
            self.rank, self.size = elastic.rank(), elastic.size()
        self._s.set_rank(self.rank, self.size)

    # --- the share --------------------------------------------------------------------------
    def set_rank(self, rank, size):
        self.rank, self.size = rank, size
        self._s.set_rank(rank, size)

    @property
    def batch_size(self):
        """This rank's batch size for a step (with global_batch_size: ceil(G / size))."""
        if not self.global_batch_size:
            raise ValueError("batch_size is defined by global_batch_size; none was given")
        return -(-self.global_batch_size // self.size)

    def _steps(self, per_rank):
        """[(indices, padding)] of this rank's remaining steps, from a copy of the cursor."""
        return self._steps_from(self._s.serialize())

    def _per_rank(self):
        return self.batch_size if self.global_batch_size else 1

    def __iter__(self):
        self._base = self._s.serialize()  # record_batch counts from here
        self._recorded = 0
        for indices, _ in self._steps(self._per_rank()):
            yield from indices

    def __len__(self):
        return sum(len(i) for i, _ in self._steps(self._per_rank()))

    def batch_indices(self, batch_idx, batch_size=None):
        """This rank's indices in batch `batch_idx` of the current iteration (padding
        included: see padding_mask)."""
        per = batch_size or self._per_rank()
        flat = [j for idx, _ in self._steps_from(self._base_or_now()) for j in idx]
        return flat[batch_idx * per:(batch_idx + 1) * per]

    def padding_mask(self, batch_idx, batch_size=None):
        """[bool] for this rank's batch `batch_idx` of the current iteration: True for a
        repeat that fills the step (give it zero weight)."""
        per = batch_size or self._per_rank()
        flat = [p for _, pad in self._steps_from(self._base_or_now()) for p in pad]
        return flat[batch_idx * per:(batch_idx + 1) * per]

    # --- progress ---------------------------------------------------------------------------
    def record_batch(self, batch_idx, batch_size=None):
        """Records that batches 0..batch_idx of the current iteration were trained (as every
        rank does at the same step)."""
        self._advance((batch_idx + 1) * (batch_size or self._per_rank()))

    def record_indices(self, indices):
        """Records that this rank trained its next len(indices) samples."""
        self._advance(self._recorded + len(indices))

    _base = None
    _recorded = 0

    def _base_or_now(self):
        return self._base if self._base is not None else self._s.serialize()

    def _fresh(self, raw):
        s = _C.ElasticSampler(self.num_samples_total, bool(self.shuffle), int(self.seed))
        s.deserialize(raw)
        s.set_rank(self.rank, self.size)
        return s

    def _steps_from(self, raw):
        key = (raw, self.rank, self.size, self._per_rank())
        cached = getattr(self, "_steps_cache", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        copy = self._fresh(raw)
        out = []
        while not copy.epoch_done():
            out.append(copy.next(self._per_rank(), self.global_batch_size or 0))
        self._steps_cache = (key, out)
        return out

    def _advance(self, samples):
        """Moves the cursor past the steps that cover this rank's first `samples` samples of
        the current iteration."""
        per = self._per_rank()
        copy = self._fresh(self._base_or_now())
        for _ in range(-(-samples // per)):
            if copy.epoch_done():
                break
            copy.next(per, self.global_batch_size or 0)
        self._s.deserialize(copy.serialize())
        self._recorded = samples

    def set_epoch(self, epoch):
        """Starts `epoch`: cursor 0, the permutation of seed + epoch."""
        self._s.set_epoch(int(epoch))
        self._base = None

    @property
    def epoch(self):
        return self._s.epoch

    @property
    def cursor(self):
        return self._s.cursor

    def epoch_done(self):
        return self._s.epoch_done()

    def state_dict(self):
        return {"epoch": self._s.epoch, "cursor": self._s.cursor}

    def load_state_dict(self, sd):
        self._s.deserialize(struct.pack("<qq", int(sd["epoch"]), int(sd["cursor"])))
        self._base = None


# --- gradients -------------------------------------------------------------------------------------

def _buckets(params, cap, last_cap):
    """Buckets of `params` in the order their gradients come (roughly the reverse of the
    definition order). Whatever is still being reduced when backward ends is the step's
    exposed communication, and the last bucket (the first layers', ready only at the very end)
    is all exposed: so the buckets are filled from the first layers on, the first ones small
    (`last_cap`), each next one 4x larger, up to `cap`. (bench/torch_step_worker.py --profile
    measured it: with plain 25 MiB buckets, ResNet-18's last bucket held 24 MiB and its whole
    reduction came after backward.)"""
    buckets, cur, cur_bytes = [], [], 0
    size = min(last_cap, cap)
    for p in params:  # definition order: the bucket reduced last first
        nbytes = p.numel() * p.element_size()
        if cur and cur_bytes + nbytes > cap:  # never over `cap` but for a single tensor
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur.append(p)
        cur_bytes += nbytes
        if cur_bytes >= size:
            buckets.append(cur)
            cur, cur_bytes = [], 0
            size = min(size * 4, cap)
    if cur:
        buckets.append(cur)
    return [list(reversed(b)) for b in reversed(buckets)]


def _flat(params):
    """One zeroed tensor as large as `params` together, when they share a dtype and device
    and are dense (else None: that bucket is fused on each reduction)."""
    first = params[0]
    if any(p.dtype != first.dtype or p.device != first.device or p.is_sparse for p in params):
        return None
    return torch.zeros(sum(p.numel() for p in params), dtype=first.dtype, device=first.device)


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps `optimizer` so that step() applies gradients averaged over every rank.

    Gradients are reduced in fused buckets (up to 25 MiB, like DDP's; those of the first
    layers, reduced last, smaller: from `last_bucket_bytes` up, so that little is left to
    reduce when backward ends) that start while backward is still running: a hook on each
    parameter's gradient accumulation marks it ready, and a full bucket goes to a background
    thread whose allreduce releases the GIL, so communication overlaps the rest of the
    backward pass. step() waits for the buckets, then steps the wrapped optimizer. When a
    bucket's reduction fails (a peer is lost), the next gradient hook raises its error, so
    loss.backward() itself ends with WorkerLostError instead of computing the rest of a step
    that cannot complete. With backward_passes_per_step=k, gradients are reduced after every
    k-th backward (accumulate locally in between).
    """

    def __init__(self, optimizer, named_parameters=None, backward_passes_per_step=1,
                 op=elastic.Average, bucket_bytes=25 << 20, last_bucket_bytes=1 << 20):
        self.optimizer = optimizer
        self.op = op
        self.backward_passes_per_step = backward_passes_per_step
        if named_parameters is not None:
            params = [p for _, p in named_parameters]
        else:
            params = [p for g in optimizer.param_groups for p in g["params"]]
        params = [p for p in params if p.requires_grad]
        self._buckets = _buckets(params, bucket_bytes, last_bucket_bytes)
        self._bucket_of = {}
        for b, ps in enumerate(self._buckets):
            for p in ps:
                self._bucket_of[p] = b
        # Each bucket's gradients live in one flat tensor (as DDP's gradient_as_bucket_view):
        # a bucket is reduced in place with no copy into and out of a fusion buffer. A gradient
        # that is not its view (the first step's, or one set to None and made anew) goes the
        # fused way and is put back into its view after the step's reductions.
        self._flat = [_flat(ps) for ps in self._buckets]
        self._views = {}
        for flat, ps in zip(self._flat, self._buckets):
            off = 0
            for p in ps if flat is not None else ():
                self._views[p] = flat[off:off + p.numel()].view_as(p)
                off += p.numel()
        self._passes = {p: 0 for p in params}
        self._ready = [0] * len(self._buckets)
        self._launched = [False] * len(self._buckets)
        self._pending = 0
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._error = None
        self._queue = queue.Queue()
        self._thread = threading.Thread(target=self._worker, daemon=True)
        self._thread.start()
        self._hooks = []
        for p in params:
            # Called once p.grad holds this backward's gradient (torch 2.1 and newer); before
            # that, a hook on the parameter's AccumulateGrad node.
            if hasattr(p, "register_post_accumulate_grad_hook"):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))
            else:
                acc = p.expand_as(p).grad_fn.next_functions[0][0]
                self._hooks.append((acc, acc.register_hook(self._make_hook(p))))

    # torch.optim.Optimizer's interface, forwarded
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, sd):
        self.optimizer.load_state_dict(sd)

    def zero_grad(self, set_to_none=False):
        """Zeroes the gradients, after any reduction still running from a step that failed
        (so a retried step starts clean)."""
        self._finish(launch=False)
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __repr__(self):
        return f"DistributedOptimizer({self.optimizer!r})"

    def _make_hook(self, p):
        def hook(*_):
            if self._error is not None:
                # A bucket's reduction already failed (a peer is gone): the step cannot
                # complete, so the rest of backward would be computed for nothing. Raising here
                # ends loss.backward() at once with that error; @elastic.run rolls back and
                # re-forms while the survivors would otherwise still be computing.
                error = self._finish(launch=False)
                if error is not None:
                    raise error
            self._passes[p] += 1
            if self._passes[p] < self.backward_passes_per_step:
                return
            b = self._bucket_of[p]
            with self._lock:
                self._ready[b] += 1
                if self._ready[b] == len(self._buckets[b]) and not self._launched[b]:
                    self._launch(b)
        return hook

    def _launch(self, b):  # with self._lock held
        self._launched[b] = True
        self._pending += 1
        self._queue.put(b)

    def _worker(self):
        while True:
            b = self._queue.get()
            try:
                self._reduce(self._buckets[b])
            except BaseException as e:  # raised again on the training thread, in step()
                with self._lock:
                    self._error = self._error or e
            with self._lock:
                self._pending -= 1
                self._done.notify_all()

    def _reduce(self, params):
        """Reduces the gradients of `params` (one bucket) in place over every rank; runs on
        the background thread."""
        if elastic.size() <= 1:
            return
        b = self._bucket_of.get(params[0]) if params else None
        flat = self._flat[b] if b is not None else None
        if (flat is not None and len(params) == len(self._buckets[b])
                and all(p.grad is not None and p.grad.data_ptr() == self._views[p].data_ptr()
                        for p in params)):
            elastic.allreduce_(flat, op=self.op)
            return
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            elastic.grouped_allreduce_(grads, op=self.op)

    def _attach_views(self):
        """Puts each reduced gradient that is not its bucket's view into it (values kept; a
        gradient that is None stays None: an optimizer skips those)."""
        with torch.no_grad():
            for p, view in self._views.items():
                g = p.grad
                if g is None or g.data_ptr() == view.data_ptr() or g.is_sparse:
                    continue
                if g.shape != view.shape or g.dtype != view.dtype or g.device != view.device:
                    continue
                view.copy_(g)
                p.grad = view

    def synchronize(self):
        """Waits until every bucket of this step is reduced (launching those whose gradients
        never came, e.g. unused parameters). Raises the reduction's error (WorkerLostError)."""
        error = self._finish(launch=True)
        if error is not None:
            raise error
        self._attach_views()

    def _finish(self, launch):
        """Waits for the buckets in flight (launching the rest first if `launch`), resets the
        step's bookkeeping and returns the reductions' error, if any."""
        with self._lock:
            if launch:
                for b in range(len(self._buckets)):
                    if not self._launched[b]:
                        self._launch(b)
            while self._pending:
                self._done.wait()
            error, self._error = self._error, None
            self._ready = [0] * len(self._buckets)
            self._launched = [False] * len(self._buckets)
        for p in self._passes:
            self._passes[p] = 0
        return error

    def step(self, closure=None):
        self.synchronize()
        return self.optimizer.step(closure)


def broadcast_parameters(params, root_rank=0):
    """Overwrites every rank's tensors with root_rank's: `params` is a state_dict or an
    iterable of (name, tensor) pairs."""
    items = params.items() if hasattr(params, "items") else params
    for _, t in items:
        if isinstance(t, torch.Tensor) and t.numel():
            elastic.broadcast_(t.data, root_rank)


def broadcast_optimizer_state(optimizer, root_rank=0):
    """Makes every rank's optimizer state root_rank's."""
    opt = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
    sd = elastic.broadcast_object(opt.state_dict(), root_rank)
    if elastic.rank() != root_rank:
        opt.load_state_dict(sd)
