"""Compressors following Horovod's TensorFlow Compressor protocol (hashable, since Horovod caches
its allreduce functions keyed on them).

    hvd.DistributedGradientTape(tape, compression=hvd_compress.tensorflow.Compression.fp16)

As in the torch frontend, only codecs whose payloads may be summed work through Horovod's own
tape/optimizer, without ef/momentum; anything else raises at the first compress().
"""
from __future__ import annotations

import tensorflow as tf

from ..compressor import CompressionNamespace, CompressorBase
from ..spec import CompressionConfig
from ..state import StateStore
from .codec import TFAdapter, TFCodec


class Compressor(CompressorBase):
    def __init__(self, config: CompressionConfig):
        super().__init__(config)
        # Horovod passes no parameter name, so random-k's step counters are keyed by shape: one
        # tf.Variable per shape, advanced once per compress() in program order on every rank.
        self._codec = TFCodec(config, StateStore(TFAdapter()))

    def compress(self, tensor):
        self.check_stock_use("hvd_compress.tensorflow.DistributedGradientTape or "
                             "hvd_compress.tensorflow.keras.DistributedOptimizer")
        if self.config.codec == "none":
            if tensor.dtype == tf.bfloat16:  # Horovod 0.28.1 has no bfloat16 allreduce
                return tf.cast(tensor, tf.float32), tf.bfloat16
            return tensor, None
        enc = self._codec.encode(f"shape{tensor.shape.as_list()}:{tensor.dtype.name}", tensor)
        # bfloat16 values travel as float32 (exact) and are decoded from it (TFCodec.decode).
        payload = enc.payload
        return (tf.cast(payload, tf.float32) if payload.dtype == tf.bfloat16 else payload), enc

    def decompress(self, tensor, ctx):
        if ctx is None:
            return tensor
        if isinstance(ctx, tf.DType):
            return tf.cast(tensor, ctx)
        return self._codec.decode(tensor, ctx, 1.0)


Compression = CompressionNamespace(Compressor)
