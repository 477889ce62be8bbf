"""Keras (TF 2.15, Keras 2): a DistributedOptimizer with compression, and callbacks.

    import hvd_compress.tensorflow.keras as hvdk
    opt = hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression="efsignsgd")
    model.compile(optimizer=opt, loss=...)
    model.fit(..., callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                              hvdk.CompressionScheduleCallback(start_epoch=1),
                              hvdk.CompressionStatsCallback(),
                              hvdk.CompressionCheckpointCallback("ckpt/compression")])

The optimizer is Horovod's own Keras DistributedOptimizer with its gradient reduction replaced
by the hvd_compress reducer, so everything else (model.fit, Horovod's callbacks) is Horovod's.
"""
from __future__ import annotations

import os
import pickle
from typing import Any

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import tensorflow as tf

from .reducer import DEFAULT_MIN_COMPRESS_BYTES, Reducer, check_ranks_agree, to_config


def DistributedOptimizer(optimizer, compression: Any = "none", op=hvd.Average,
                         min_compress_bytes: int = DEFAULT_MIN_COMPRESS_BYTES, name=None,
                         process_set=hvd.global_process_set, **horovod_kwargs):
    """Wrap a Keras optimizer like `horovod.tensorflow.keras.DistributedOptimizer`.

    The result also has `compression_state_dict()`, `load_compression_state_dict(state)` and
    `compression_stats`. Horovod keyword arguments other than local gradient accumulation pass
    through; `backward_passes_per_step` > 1 is refused (the accumulation helper would bypass the
    compressed reduction)."""
    if horovod_kwargs.get("backward_passes_per_step", 1) != 1:
        raise ValueError("backward_passes_per_step > 1 is not supported with compression in "
                         "Keras; accumulate gradients before calling the optimizer instead")
    for key in ("compression", "groups", "num_groups"):
        if horovod_kwargs.get(key):
            raise ValueError(f"{key} is set by hvd_compress; leave it out")
    config = to_config(compression)
    reducer = Reducer(config, min_compress_bytes, op, process_set)
    if process_set.included() and process_set.size() > 1:
        check_ranks_agree(config, min_compress_bytes, process_set)
    opt = hvd_keras.DistributedOptimizer(optimizer, name=name, op=op, process_set=process_set,
                                         **horovod_kwargs)
    opt._allreduce_grads = reducer.reduce
    opt._hvdc_reducer = reducer
    opt.compression_state_dict = reducer.state_dict
    opt.load_compression_state_dict = reducer.load_state_dict
    opt.compression_stats = reducer.stats
    return opt


def _reducer_of(model) -> Reducer:
    reducer = getattr(model.optimizer, "_hvdc_reducer", None)
    if reducer is None:
        raise ValueError("this callback needs a model compiled with "
                         "hvd_compress.tensorflow.keras.DistributedOptimizer")
    return reducer


class CompressionScheduleCallback(tf.keras.callbacks.Callback):
    """Plain allreduce until `start_epoch` (or `start_step`, counted in batches), compression
    from then on. Every rank switches at the same point, so collectives stay matched."""

    def __init__(self, start_epoch: int | None = None, start_step: int | None = None):
        super().__init__()
        if (start_epoch is None) == (start_step is None):
            raise ValueError("give exactly one of start_epoch or start_step")
        if (start_epoch or 0) < 0 or (start_step or 0) < 0:
            raise ValueError("start_epoch/start_step must be >= 0")
        self.start_epoch, self.start_step = start_epoch, start_step
        self._step = 0

    def on_train_begin(self, logs=None):
        self._step = 0
        self._set(False if (self.start_epoch or self.start_step) else True)

    def on_epoch_begin(self, epoch, logs=None):
        if self.start_epoch is not None:
            self._set(epoch >= self.start_epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if self.start_step is not None:
            self._set(self._step >= self.start_step)
            self._step += 1

    def _set(self, on: bool) -> None:
        _reducer_of(self.model).enabled.assign(on)


class CompressionStatsCallback(tf.keras.callbacks.Callback):
    """Adds per-step gradient bytes, bytes sent and their ratio to the epoch logs, so they reach
    History, CSVLogger and TensorBoard."""

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        reducer = _reducer_of(self.model)
        compressing = bool(reducer.enabled.numpy())
        raw = sum(t.raw_bytes for t in reducer.stats.tensors.values())
        sent = sum(t.sent_bytes if compressing else t.raw_bytes
                   for t in reducer.stats.tensors.values())
        logs["compression_raw_bytes_per_step"] = float(raw)
        logs["compression_sent_bytes_per_step"] = float(sent)
        logs["compression_ratio"] = float(raw / sent) if sent else 1.0


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
