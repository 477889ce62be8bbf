"""Compressors following Horovod's TensorFlow Compressor protocol (hashable, since Horovod caches
its allreduce functions keyed on them).

    hvd.DistributedGradientTape(tape, compression=hvd_compress.tensorflow.Compression.fp16)

As in the torch frontend, only codecs whose payloads may be summed work through Horovod's own
tape/optimizer, without ef/momentum; anything else raises at the first compress().
"""
from __future__ import annotations

from typing import Any

from ..registry import codecs
from ..spec import CompressionConfig, parse_spec
from ..state import StateStore
from .codec import TFAdapter, TFCodec


class Compressor:
    def __init__(self, config: CompressionConfig):
        self.config = config
        # Horovod passes no parameter name, so random-k's step counters are keyed by shape: one
        # tf.Variable per shape, advanced once per compress() in program order on every rank.
        self._codec = TFCodec(config, StateStore(TFAdapter()))

    def __call__(self, **params: Any) -> "Compressor":
        spec = {"compressor": self.config.codec, **dict(self.config.params),
                "momentum": self.config.momentum, "seed": self.config.seed}
        if not self.config.info.builtin_ef:
            spec["ef"] = self.config.ef
        if self.config.momentum != "none":
            spec["mu"] = self.config.mu
        spec.update(params)
        return Compressor(parse_spec(spec))

    def __repr__(self) -> str:
        return f"Compressor({self.config.canonical()!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Compressor) and other.config == self.config

    def __hash__(self) -> int:
        return hash(self.config)

    def compress(self, tensor):
        cfg, info = self.config, self.config.info
        if not info.linear:
            why = f" ({info.collective_note})" if info.collective_note else ""
            raise RuntimeError(
                f"{cfg.codec} payloads travel by allgather{why}; Horovod's stock "
                f"DistributedGradientTape/DistributedOptimizer would allreduce them and sum packed "
                f"bits. Use hvd_compress.tensorflow.DistributedGradientTape or "
                f"hvd_compress.tensorflow.keras.DistributedOptimizer")
        if cfg.ef != "none" or cfg.momentum != "none":
            raise RuntimeError(
                f"ef={cfg.ef}, momentum={cfg.momentum}: error feedback and momentum keep state "
                f"per parameter name, which Horovod's stock tape/optimizer does not pass to "
                f"compress(). Use hvd_compress.tensorflow.DistributedGradientTape")
        if cfg.codec == "none":
            return tensor, None
        enc = self._codec.encode(f"shape{tensor.shape.as_list()}:{tensor.dtype.name}", tensor)
        return enc.payload, enc

    def decompress(self, tensor, ctx):
        if ctx is None:
            return tensor
        return self._codec.decode(tensor, ctx, 1.0)


class _Compression:
    """`Compression.<codec>` for every registered codec, plus `Compression.from_spec(spec)`."""

    def from_spec(self, spec: Any) -> Compressor:
        if isinstance(spec, Compressor):
            return spec
        return Compressor(parse_spec(spec))

    def __getattr__(self, name: str) -> Compressor:
        if name.startswith("_"):
            raise AttributeError(name)
        known = [c.name for c in codecs()]
        if name not in known:
            raise AttributeError(f"no codec {name!r}; valid codecs: {', '.join(known)}")
        return Compressor(parse_spec(name))

    def __dir__(self):
        return ["from_spec"] + [c.name for c in codecs()]


Compression = _Compression()
