"""Elastic Horovod for the TensorFlow frontend: Horovod's elastic states with the compression
state of our optimizer or tape added.

Horovod's TensorFlow states save `model.variables` and `optimizer.variables()` and broadcast
them from rank 0; the compression state is neither (its variables are made lazily, and the
residuals in it are per rank), so use these in their place (TF2, eager):

    opt = hvd_compress.tensorflow.keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.01),
                                                            compression="topk,k=0.01,ef=vanilla")
    model.compile(optimizer=opt, loss=...)
    state = hvd_compress.tensorflow.elastic.KerasState(model, batch=0, epoch=0)

    @hvd.elastic.run
    def train(state):
        model.fit(...)

A custom loop that reduces with a DistributedGradientTape names it (any tape made with the same
arguments): `TensorFlowKerasState(model, optimizer, compressed=tape)`.
Build the optimizer (`opt.build(model.trainable_variables)`) before making the state: Keras
makes its slots at the first step, and a joining worker must already hold them for the sync's
broadcast of `optimizer.variables()` to match rank 0's (Horovod's own states need the same).

    commit()  saves the compression state with the model (host memory, numpy arrays);
    restore() returns it to the last commit (after a worker failure);
    sync()    (after every reset) makes it identical on every rank, as in the torch frontend:
              step counters and what every rank holds alike are rank 0's, the per-rank
              accumulators start again from zero (why: hvd_compress.elastic);
    reset     the reducer takes up the new rank and size. When Horovod skips the sync (workers
              were only removed), the survivors drop their per-rank state alike here.

A reset replaces state variables and changes the world a trace was made for: the model's train
function is traced again by the next `model.fit`. A `tf.function` of your own that reduces
gradients (a DistributedGradientTape, or our optimizer's apply_gradients) must be made inside the
function `hvd.elastic.run` wraps, so that every reset makes it anew.
"""
from __future__ import annotations

import tensorflow as tf
from horovod.tensorflow import elastic as _tf_elastic
from horovod.tensorflow.keras import elastic as _keras_elastic

from ..elastic import shared_part
from .reducer import Reducer

__all__ = ["KerasState", "TensorFlowKerasState", "TensorFlowState", "reducer_of"]


def reducer_of(compressed) -> Reducer:
    """The reducer of an optimizer from hvd_compress.tensorflow(.keras).DistributedOptimizer
    (also inside a Keras LossScaleOptimizer), of a DistributedGradientTape, or a Reducer."""
    if isinstance(compressed, Reducer):
        return compressed
    reducer = getattr(compressed, "_hvdc_reducer", None)
    if reducer is not None:
        return reducer
    inner = getattr(compressed, "inner_optimizer", None)
    if inner is not None:
        return reducer_of(inner)
    raise ValueError(f"{type(compressed).__name__} has no compression state: pass an optimizer "
                     f"from hvd_compress.tensorflow(.keras).DistributedOptimizer, a "
                     f"DistributedGradientTape or a Reducer (Horovod's own states serve "
                     f"Horovod's own optimizers)")


class _CompressionState:
    """Mixed in ahead of a Horovod state: the compression state of one reducer travels with
    the state Horovod keeps."""

    def _hvdc_track(self, compressed) -> None:
        if not tf.executing_eagerly():
            raise ValueError("elastic training with compression needs TF2 eager execution: the "
                             "compression state is read and written as numpy arrays")
        self._hvdc_reducer = reducer_of(compressed)
        self._hvdc_saved = self._hvdc_reducer.state_dict()

    def save(self):
        super().save()
        self._hvdc_saved = self._hvdc_reducer.state_dict()

    def restore(self):
        super().restore()
        self._hvdc_reducer.load_state_dict(self._hvdc_saved)

    def reset(self):
        super().reset()
        reducer = self._hvdc_reducer
        if reducer.follow_world():
            reducer.load_state_dict(shared_part(reducer.state_dict()))
            self._hvdc_retrace()

    def sync(self):
        super().sync()
        reducer = self._hvdc_reducer
        # Loading rank 0's state also checks the spec (strict): the check a joining worker
        # skipped when it built its optimizer while the others waited here.
        reducer.load_state_dict(self._bcast_object(shared_part(reducer.state_dict())))
        self._hvdc_saved = reducer.state_dict()
        self._hvdc_retrace()

    def _hvdc_retrace(self) -> None:
        """The traces made before no longer hold the store's variables, nor the world."""


class TensorFlowKerasState(_CompressionState, _tf_elastic.TensorFlowKerasState):
    """`horovod.tensorflow.elastic.TensorFlowKerasState` (same arguments) plus the compression
    state of `compressed`: by default the optimizer (or the model's), which is then ours; in a
    custom loop that reduces with a DistributedGradientTape, that tape (any tape made with the
    same arguments: they share one reducer)."""

    def __init__(self, model, optimizer=None, backend=None, *, compressed=None, **kwargs):
        self._hvdc_track(compressed or optimizer or model.optimizer)
        super().__init__(model, optimizer=optimizer, backend=backend, **kwargs)

    def _hvdc_retrace(self) -> None:
        # model.fit makes its train function again when there is none.
        self.model.train_function = None


class KerasState(_CompressionState, _keras_elastic.KerasState):
    """`horovod.tensorflow.keras.elastic.KerasState` (hvd.elastic.KerasState under
    horovod.tensorflow.keras) with the compression state, as TensorFlowKerasState."""

    def __init__(self, model, optimizer=None, *, compressed=None, **kwargs):
        self._hvdc_track(compressed or optimizer or model.optimizer)
        super().__init__(model, optimizer=optimizer, **kwargs)

    _hvdc_retrace = TensorFlowKerasState._hvdc_retrace


class TensorFlowState(_CompressionState, _tf_elastic.TensorFlowState):
    """`horovod.tensorflow.elastic.TensorFlowState` (same arguments) plus `compressed`: the
    optimizer, DistributedGradientTape or Reducer whose compression state is committed,
    restored and synced with the variables. A tape made anew every step shares its reducer
    with every tape of the same arguments: any one of them will do."""

    def __init__(self, variables=None, session=None, *, compressed, **kwargs):
        self._hvdc_track(compressed)
        super().__init__(variables, session=session, **kwargs)
