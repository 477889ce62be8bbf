"""Keras (TF 2.15, Keras 2): a DistributedOptimizer with compression, and callbacks.

    import hvd_compress.tensorflow.keras as hvdk
    opt = hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression="efsignsgd")
    model.compile(optimizer=opt, loss=...)
    model.fit(..., callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                              hvdk.CompressionScheduleCallback(start_epoch=1),
                              # with autotune=K in the spec, instead of the schedule:
                              # hvdk.AutotuneCallback(),
                              hvdk.CompressionStatsCallback(),
                              hvdk.CompressionCheckpointCallback("ckpt/compression")])

The optimizer is Horovod's own Keras DistributedOptimizer with its gradient reduction replaced
by the hvd_compress reducer, so everything else (model.fit, Horovod's callbacks) is Horovod's.
"""
from __future__ import annotations

import inspect
import os
import pickle
from typing import Any

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import tensorflow as tf

from .ops import lib
from .reducer import (DEFAULT_MIN_COMPRESS_BYTES, Reducer, attach, new_reducer,
                      pop_horovod_arguments, to_config, warn_about_momentum)


def DistributedOptimizer(optimizer, compression: Any = "none", op=hvd.Average,
                         min_compress_bytes: int = DEFAULT_MIN_COMPRESS_BYTES, name=None,
                         process_set=hvd.global_process_set, bucket_mb: float | None = None,
                         **horovod_kwargs):
    """Wrap a Keras optimizer like `horovod.tensorflow.keras.DistributedOptimizer`; bucket_mb
    as in the torch optimizer (hvd_compress.buckets).

    The result also has `compression_state_dict()`, `load_compression_state_dict(state)` and
    `compression_stats`. Horovod's keyword arguments pass through, except those the compressed
    reduction cannot honour, which raise: device placement, groups and
    `gradient_predivide_factor`. With `backward_passes_per_step` > 1 Horovod's helper sums the
    gradients of the passes locally and the sum is compressed once per update."""
    pop_horovod_arguments(horovod_kwargs)
    reducer = new_reducer(compression, min_compress_bytes, op, process_set,
                          horovod_kwargs.get("sparse_as_dense", False), bucket_mb)
    warn_about_momentum(optimizer, reducer.config)
    # Horovod's own, also when `python -m hvd_compress` has put ours in its place.
    opt = inspect.unwrap(hvd_keras.DistributedOptimizer)(
        optimizer, name=name, op=op, process_set=process_set, **horovod_kwargs)
    return attach(opt, reducer)


def LossScaleOptimizer(optimizer, **kwargs):
    """`tf.keras.mixed_precision.LossScaleOptimizer(optimizer, **kwargs)` around an optimizer
    from `DistributedOptimizer` above, whose compression state then follows the loss scale:
    the gradients reach the codec multiplied by it, and state in gradient units (residuals,
    momenta) is rescaled whenever it changes. The result is Keras' own class."""
    reducer = getattr(optimizer, "_hvdc_reducer", None)
    if reducer is None:
        raise ValueError("LossScaleOptimizer wraps an optimizer made by "
                         "hvd_compress.tensorflow.keras.DistributedOptimizer; use "
                         "tf.keras.mixed_precision.LossScaleOptimizer for any other")
    lso = tf.keras.mixed_precision.LossScaleOptimizer(optimizer, **kwargs)
    reducer.track_loss_scale(lso)
    return lso


def _reducer_of(model) -> Reducer:
    reducer = getattr(model.optimizer, "_hvdc_reducer", None)
    if reducer is None:
        raise ValueError("this callback needs a model compiled with "
                         "hvd_compress.tensorflow.keras.DistributedOptimizer")
    return reducer


class CompressionScheduleCallback(tf.keras.callbacks.Callback):
    """When to compress, and how hard.

    start_epoch / start_step: plain allreduce before it (counted in epochs, or in batches from
    the start of training), the optimizer's compression from then on.
    warmup: {epoch: spec}, a sparsity warm-up as in DGC, e.g.
    {0: "topk,k=0.25,ef=vanilla", 1: "topk,k=0.0625,ef=vanilla", 2: "topk,k=0.01,ef=vanilla"}:
    from each listed epoch on, that spec. Error-feedback residuals carry over; the train function
    is retraced at each switch. Every rank runs the same callback, so they switch together."""

    def __init__(self, start_epoch: int | None = None, start_step: int | None = None,
                 warmup: dict | None = None):
        super().__init__()
        if start_epoch is not None and start_step is not None:
            raise ValueError("give start_epoch or start_step, not both")
        if (start_epoch or 0) < 0 or (start_step or 0) < 0:
            raise ValueError("start_epoch/start_step must be >= 0")
        self.start_epoch, self.start_step = start_epoch, start_step
        self.warmup = {int(e): to_config(s) for e, s in (warmup or {}).items()}
        if any(e < 0 for e in self.warmup):
            raise ValueError("warmup epochs must be >= 0")
        self._step = 0

    def on_train_begin(self, logs=None):
        self._step = 0
        self._set(not (self.start_epoch or self.start_step))

    def on_epoch_begin(self, epoch, logs=None):
        if self.start_epoch is not None:
            self._set(epoch >= self.start_epoch)
        if epoch in self.warmup:
            reducer = _reducer_of(self.model)
            if reducer.config != self.warmup[epoch]:
                reducer.set_config(self.warmup[epoch])
                self.model.train_function = self.model.make_train_function(force=True)

    def on_train_batch_begin(self, batch, logs=None):
        if self.start_step is not None:
            self._set(self._step >= self.start_step)
            self._step += 1

    def _set(self, on: bool) -> None:
        reducer = _reducer_of(self.model)
        if reducer.autotune is not None:
            raise ValueError("CompressionScheduleCallback and the spec's autotune both decide "
                             "when to compress: drop one of them")
        reducer.enabled.assign(on)


class AutotuneCallback(tf.keras.callbacks.Callback):
    """With `autotune=K` in the spec: each batch runs the train function traced for it
    (Reducer.next_trace says which and why), each traced once in a `fit`. The probe's
    uncompressed steps and, once it has settled on them, every step then run a graph without
    the compression. Every rank reads the same variables before the same batch, so all run the
    same trace."""

    def on_train_begin(self, logs=None):
        reducer = _reducer_of(self.model)
        if not reducer.config.autotune:
            raise ValueError(f"AutotuneCallback needs autotune=K in the compression spec, got "
                             f"{reducer.config}")
        # Traced anew in each fit: an elastic reset changes the world a trace was made for.
        self._functions = {}
        every = getattr(self.model, "_steps_per_execution", None)
        self._per_arm = every is None or int(every.numpy()) == 1

    def on_train_batch_begin(self, batch, logs=None):
        trace = _reducer_of(self.model).next_trace(self._per_arm)
        if trace not in self._functions:
            self._functions[trace] = self.model.make_train_function(force=True)
        self.model.train_function = self._functions[trace]


class CompressionStatsCallback(tf.keras.callbacks.Callback):
    """Adds per-step gradient bytes, bytes sent, their ratio and the time spent in codec kernels
    during the epoch to the epoch logs, so they reach History, CSVLogger and TensorBoard.

    tensorboard: a directory to which the same statistics are also written per step as
    TensorBoard scalars (hvd_compress.stats.SCALARS), from rank 0 only."""

    def __init__(self, tensorboard: str | None = None):
        super().__init__()
        self.tensorboard = tensorboard

    def on_train_begin(self, logs=None):
        if self.tensorboard and hvd.rank() == 0:
            reducer = _reducer_of(self.model)
            if reducer._writer is None:
                reducer.write_compression_summaries(self.tensorboard)
                # The summary ops join the step at its next trace.
                self.model.train_function = self.model.make_train_function(force=True)

    def on_epoch_begin(self, epoch, logs=None):
        self._codec_ns = int(lib.hvdc_codec_time().numpy())

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        reducer = _reducer_of(self.model)
        reducer.refresh_stats()
        compressing = bool(reducer.enabled.numpy())
        raw = sum(t.raw_bytes for t in reducer.stats.tensors.values())
        sent = sum(t.sent_bytes if compressing else t.raw_bytes
                   for t in reducer.stats.tensors.values())
        logs["compression_raw_bytes_per_step"] = float(raw)
        logs["compression_sent_bytes_per_step"] = float(sent)
        logs["compression_ratio"] = float(raw / sent) if sent else 1.0
        spent = int(lib.hvdc_codec_time().numpy()) - getattr(self, "_codec_ns", 0)
        logs["compression_codec_ms"] = spent / 1e6


class CompressionCheckpointCallback(tf.keras.callbacks.Callback):
    """Saves the compression state (error-feedback residuals, momentum, step counters) every
    epoch to `<filepath>.rank<r>.pkl` and restores it at the start of training when the file
    exists. Residuals are per rank, so every rank saves its own (unlike ModelCheckpoint, which
    Horovod scripts run on rank 0 only)."""

    def __init__(self, filepath: str):
        super().__init__()
        self.filepath = filepath

    def path(self) -> str:
        return f"{self.filepath}.rank{hvd.rank()}.pkl"

    def on_train_begin(self, logs=None):
        if os.path.exists(self.path()):
            with open(self.path(), "rb") as f:
                _reducer_of(self.model).load_state_dict(pickle.load(f))

    def on_epoch_end(self, epoch, logs=None):
        os.makedirs(os.path.dirname(os.path.abspath(self.path())), exist_ok=True)
        tmp = self.path() + ".tmp"
        with open(tmp, "wb") as f:
            pickle.dump(_reducer_of(self.model).state_dict(), f)
        os.replace(tmp, self.path())
