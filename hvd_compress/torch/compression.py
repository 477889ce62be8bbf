"""Compressors that follow Horovod's torch Compressor protocol
(`compress(tensor) -> (tensor, ctx)`, `decompress(tensor, ctx) -> tensor`).

    from hvd_compress.torch import Compression
    opt = hvd.DistributedOptimizer(opt, compression=Compression.fp16)          # stock optimizer
    opt = hvd_compress.torch.DistributedOptimizer(opt, compression=Compression.topk(k=0.01))

Horovod's stock optimizer allreduces whatever compress() returns and never passes a parameter
name, so through it only codecs whose payloads may be summed work, without ef/momentum. Every
other use raises at the first compress() with the way out, instead of summing bit patterns.
"""
from __future__ import annotations

from typing import Any

import torch

from ..registry import codecs
from ..spec import CompressionConfig, parse_spec
from .codec import TorchCodec


class Compressor:
    """A parsed compression spec. Call it with parameters to get a variant:
    `Compression.topk(k=0.001, ef="vanilla")`."""

    def __init__(self, config: CompressionConfig):
        self.config = config
        self._codec = TorchCodec(config, store=None)
        self._calls: dict[tuple, int] = {}

    def __call__(self, **params: Any) -> "Compressor":
        spec = {"compressor": self.config.codec, **dict(self.config.params), "ef": self.config.ef,
                "momentum": self.config.momentum, "seed": self.config.seed}
        if self.config.momentum != "none":
            spec["mu"] = self.config.mu
        if self.config.info.builtin_ef:
            spec.pop("ef")
        spec.update(params)
        return Compressor(parse_spec(spec))

    def __repr__(self) -> str:
        return f"Compressor({self.config.canonical()!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Compressor) and other.config == self.config

    def __hash__(self) -> int:
        return hash(self.config)

    # Horovod's Compressor protocol, for hvd.DistributedOptimizer / hvd.allreduce users.
    def compress(self, tensor: torch.Tensor):
        cfg, info = self.config, self.config.info
        if not info.linear:
            why = f" ({info.collective_note})" if info.collective_note else ""
            raise RuntimeError(
                f"{cfg.codec} payloads travel by allgather{why}; Horovod's stock "
                f"DistributedOptimizer would allreduce them and sum packed bits. Use "
                f"hvd_compress.torch.DistributedOptimizer(optimizer, compression=...)")
        if cfg.ef != "none" or cfg.momentum != "none":
            raise RuntimeError(
                f"ef={cfg.ef}, momentum={cfg.momentum}: error feedback and momentum keep state "
                f"per parameter name, which Horovod's stock DistributedOptimizer does not pass "
                f"to compress(). Use hvd_compress.torch.DistributedOptimizer")
        if cfg.codec == "none" or tensor.dtype not in (torch.float32, torch.float64,
                                                       torch.float16, torch.bfloat16):
            return tensor, None
        # No name reaches us here, so randomk's shared seed is keyed by the tensor's shape and
        # how many tensors of that shape came before it: identical on ranks that run the same
        # model, because autograd visits parameters in the same order there.
        key = (tuple(tensor.shape), tensor.dtype)
        count = self._calls.get(key, 0)
        self._calls[key] = count + 1
        enc = self._codec.encode(f"{list(key[0])}#{count}", tensor)
        return enc.payload, enc

    def decompress(self, tensor: torch.Tensor, ctx):
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
