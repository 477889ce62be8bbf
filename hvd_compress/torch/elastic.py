"""Elastic Horovod: the compression state of our DistributedOptimizer in `hvd.elastic.TorchState`.

Nothing to register: importing the optimizer puts a handler for it in Horovod's handler registry,
so `hvd.elastic.TorchState(model=model, optimizer=opt)` tracks the compression state with the
optimizer's own state:

    commit()  saves it with the optimizer state (host memory, numpy arrays);
    restore() returns it to the last commit (after a worker failure);
    sync()    (after every reset) makes it identical on every rank: step counters and the state
              every rank holds alike (PowerSGD's Q, the loss-scale units) are rank 0's, and the
              per-rank accumulators (error-feedback residuals, momenta, DGC velocities, owner
              residuals of the compressed allreduce) start again from zero on every rank.

Why the per-rank accumulators are dropped: hvd_compress.elastic.
"""
from __future__ import annotations

from horovod.torch.elastic import state as _state
from horovod.torch.functions import broadcast_object

from ..elastic import shared_part


class CompressedOptimizer:
    """Base of every optimizer hvd_compress.torch.DistributedOptimizer builds: what Horovod's
    handler registry recognizes them by."""


class CompressedOptimizerStateHandler(_state.OptimizerStateHandler):
    def __init__(self, optimizer):
        super().__init__(optimizer)
        self._saved_compression = optimizer.compression_state_dict()

    def save(self):
        super().save()
        self._saved_compression = self.value.compression_state_dict()

    def restore(self):
        super().restore()
        self.value.load_compression_state_dict(self._saved_compression)

    def sync(self):
        super().sync()
        # The world may have changed: rank and size must be the new ones before any state is
        # used again.
        self.value._hvdc_follow_world()
        self.value.load_compression_state_dict(
            broadcast_object(shared_part(self.value.compression_state_dict())))


# Ahead of Horovod's own optimizer handler, which would also match (our optimizers are
# torch.optim.Optimizer subclasses) and knows nothing of the compression state.
if not any(cls is CompressedOptimizer for cls, _ in _state.get_handler_registry()):
    _state.set_handler_registry([(CompressedOptimizer, CompressedOptimizerStateHandler)]
                                + _state.get_handler_registry())
