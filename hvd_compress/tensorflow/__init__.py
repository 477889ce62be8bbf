"""TensorFlow 2 frontend: the csrc kernels as TF ops, Horovod-protocol compressors, and a
DistributedGradientTape that routes each codec to allreduce or allgather. Keras users:
hvd_compress.tensorflow.keras."""
from __future__ import annotations

import inspect
from typing import Any

import horovod.tensorflow as hvd
import tensorflow as tf

from .compression import Compression, Compressor
from .reducer import (DEFAULT_MIN_COMPRESS_BYTES, Reducer, attach, check_horovod_arguments,
                      new_reducer, pop_horovod_arguments, reducer_for, warn_about_momentum)

__all__ = ["Compression", "Compressor", "DistributedGradientTape", "DistributedOptimizer",
           "PartialDistributedGradientTape", "Reducer", "reducer_for"]


class _CompressedTape(tf.GradientTape):
    """Methods copied into a class made from the user's tape class, as Horovod does."""

    def __init__(self, tape, persistent, watch_accessed_variables, reducer,
                 scale_local_gradients):
        super(self.__class__, self).__init__(persistent, watch_accessed_variables)
        self._tape = tape
        self._hvdc_reducer = reducer
        self._hvdc_scale_local = scale_local_gradients
        self._hvdc_local = set()

    def register_local_source(self, source):
        """As Horovod's: this source's gradient is not reduced but stays the rank's own (divided
        by the process set's size when scale_local_gradients, as Horovod does)."""
        self._hvdc_local.add(source.ref())

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False,
                 **kwargs):
        grads = super(self.__class__, self).gradient(target, sources, output_gradients, **kwargs)
        flat_sources, out = tf.nest.flatten(sources), list(tf.nest.flatten(grads))
        shared = [i for i, s in enumerate(flat_sources) if s.ref() not in self._hvdc_local]
        names = [f"source_{i}" for i in shared] if use_generic_names else None
        reduced = self._hvdc_reducer.reduce([out[i] for i in shared],
                                            [flat_sources[i] for i in shared], names)
        for i, g in zip(shared, reduced):
            out[i] = g
        if self._hvdc_scale_local and self._hvdc_local:
            size = self._hvdc_reducer.process_set.size()
            for i, s in enumerate(flat_sources):
                if s.ref() in self._hvdc_local and out[i] is not None:
                    g = out[i]
                    out[i] = (tf.IndexedSlices(g.values / size, g.indices, g.dense_shape)
                              if isinstance(g, tf.IndexedSlices) else g / size)
        return tf.nest.pack_sequence_as(grads, out)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None,
                                       use_generic_names=False):
        """([(local source, gradient)], [(reduced source, gradient)]), as Horovod's."""
        grads = self.gradient(target, sources, output_gradients, use_generic_names)
        pairs = list(zip(sources, grads))
        return ([(s, g) for s, g in pairs if s.ref() in self._hvdc_local],
                [(s, g) for s, g in pairs if s.ref() not in self._hvdc_local])

    def compression_state_dict(self) -> dict:
        return self._hvdc_reducer.state_dict()

    def load_compression_state_dict(self, state: dict, strict_spec: bool = True) -> None:
        self._hvdc_reducer.load_state_dict(state, strict_spec=strict_spec)

    @property
    def compression_stats(self):
        return self._hvdc_reducer.refresh_stats()

    def compression_report(self) -> dict:
        return self._hvdc_reducer.compression_report()

    def compression_next_trace(self, per_arm: bool = True) -> str:
        """Reducer.next_trace: which trace of your step function to run next. With autotune,
        ask before each step and keep a tf.function per answer, so that uncompressed steps run
        a graph without the compression."""
        return self._hvdc_reducer.next_trace(per_arm)

    def write_compression_summaries(self, logdir: str) -> None:
        self._hvdc_reducer.write_compression_summaries(logdir)


def DistributedGradientTape(gradtape, device_dense="", device_sparse="",
                            compression: Any = "none", sparse_as_dense=False, op=hvd.Average,
                            gradient_predivide_factor=1.0, num_groups=0, groups=None,
                            process_set=hvd.global_process_set, scale_local_gradients=True,
                            min_compress_bytes: int = DEFAULT_MIN_COMPRESS_BYTES,
                            bucket_mb: float | None = None):
    """Wrap a tf.GradientTape like `horovod.tensorflow.DistributedGradientTape` (same arguments,
    in the same order, plus `min_compress_bytes` and `bucket_mb`, as in the torch optimizer),
    compressing gradients. Error-feedback, momentum and step state is kept per variable name and
    shared by every tape built with the same arguments, so a new tape each step carries it over.
    `register_local_source` and `get_local_and_global_gradients` behave as Horovod's."""
    check_horovod_arguments(device_dense, device_sparse, gradient_predivide_factor, num_groups,
                            groups)
    reducer = reducer_for(compression, min_compress_bytes, op, process_set, sparse_as_dense,
                          bucket_mb)
    cls = type(gradtape.__class__.__name__, (gradtape.__class__,),
               dict(_CompressedTape.__dict__))
    return cls(gradtape._tape, gradtape._persistent, gradtape._watch_accessed_variables, reducer,
               scale_local_gradients)


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="",
                                   compression: Any = "none", sparse_as_dense=False,
                                   op=hvd.Average, gradient_predivide_factor=1.0, num_groups=0,
                                   groups=None, process_set=hvd.global_process_set,
                                   local_layers=None, scale_local_gradients=True,
                                   min_compress_bytes: int = DEFAULT_MIN_COMPRESS_BYTES,
                                   bucket_mb: float | None = None):
    """Like `horovod.tensorflow.PartialDistributedGradientTape`: the trainable weights of
    `local_layers` (a Keras layer or a list of them) stay local, the rest are compressed."""
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, tf.keras.layers.Layer):
        local_layers = [local_layers]
    if not all(isinstance(layer, tf.keras.layers.Layer) for layer in local_layers):
        raise ValueError("local_layers must be tf.keras.layers.Layer objects")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients, min_compress_bytes,
                                   bucket_mb)
    for layer in local_layers:
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape


def DistributedOptimizer(optimizer, compression: Any = "none", op=hvd.Average,
                         min_compress_bytes: int = DEFAULT_MIN_COMPRESS_BYTES, name=None,
                         process_set=hvd.global_process_set, bucket_mb: float | None = None,
                         **horovod_kwargs):
    """Like `horovod.tensorflow.DistributedOptimizer`: TF1-style `tf.compat.v1.train`
    optimizers are wrapped here, Keras optimizers by hvd_compress.tensorflow.keras."""
    if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
        from .keras import DistributedOptimizer as keras_optimizer
        return keras_optimizer(optimizer, compression=compression, op=op,
                               min_compress_bytes=min_compress_bytes, name=name,
                               process_set=process_set, bucket_mb=bucket_mb, **horovod_kwargs)
    if horovod_kwargs.get("backward_passes_per_step", 1) != 1:
        raise ValueError("backward_passes_per_step > 1 is not supported with compression")
    pop_horovod_arguments(horovod_kwargs)
    reducer = new_reducer(compression, min_compress_bytes, op, process_set,
                          horovod_kwargs.get("sparse_as_dense", False), bucket_mb)
    warn_about_momentum(optimizer, reducer.config)
    # Horovod's own, also when `python -m hvd_compress` has put ours in its place.
    opt = inspect.unwrap(hvd.DistributedOptimizer)(optimizer, name=name, op=op,
                                                   process_set=process_set, **horovod_kwargs)
    return attach(opt, reducer)
