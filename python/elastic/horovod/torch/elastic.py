"""hvd.elastic: Horovod's elastic API (``horovod.torch.elastic``) over elastic-run's recovery
loop: run, State, ObjectState, TorchState (Horovod's signature) and ElasticSampler."""

import elastic as _el
import elastic.torch as _et

from . import _set_env

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler"]

# The exactly-once sampler. Horovod's record_batch(batch_idx, batch_size) records one batch;
# this one records batches 0..batch_idx of the iteration, which is the same when it is called
# after every batch, as Horovod's examples do (docs/horovod.md).
ElasticSampler = _et.ElasticSampler


def run(func):
    """Horovod's ``@hvd.elastic.run``: ``func(state, ...)`` under the recovery loop (a lost
    peer rolls the state back to its last commit, a membership change re-forms at a commit,
    the reset callbacks run after every new round)."""
    return _el.run(func)


class State(_el.State):
    """Horovod's State: subclasses define save(), restore() and sync(). `bcast_object` and
    `get_rank` (Horovod's hooks) are accepted and unused: elastic's own are used."""

    def __init__(self, bcast_object=None, get_rank=None):
        _el.State.__init__(self)
        self.register_reset_callbacks([_set_env])


class ObjectState(_el.ObjectState):
    """Horovod's ObjectState: named values (pickled), ``ObjectState(epoch=0, batch=0)``."""

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        _el.ObjectState.__init__(self, **kwargs)
        self.register_reset_callbacks([_set_env])


class TorchState(_et.TorchState):
    """Horovod's TorchState: ``TorchState(model, optimizer, **kwargs)``. An ElasticSampler
    among `kwargs` (``train_sampler=sampler``) is committed and synced as the state's sampler
    and stays readable under its name; the other values are pickled (as Horovod's are)."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        samplers = {k: v for k, v in kwargs.items() if isinstance(v, _et.ElasticSampler)}
        if len(samplers) > 1:
            raise ValueError(f"TorchState: one ElasticSampler per state, got {sorted(samplers)}")
        for k in samplers:
            del kwargs[k]
        sampler = next(iter(samplers.values()), None)
        _et.TorchState.__init__(self, model=model, optimizer=optimizer, sampler=sampler,
                                **kwargs)
        for k, v in samplers.items():
            object.__setattr__(self, k, v)
        # Horovod's variables first, so that the script's own callbacks see the new ranks.
        self.register_reset_callbacks([_set_env])
