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

import torch

from ..compressor import CompressionNamespace, CompressorBase
from ..spec import CompressionConfig
from .codec import DTYPE_NAMES, TorchCodec


class Compressor(CompressorBase):
    def __init__(self, config: CompressionConfig):
        super().__init__(config)
        self._codec = TorchCodec(config, store=None)
        self._calls: dict[tuple, int] = {}

    def compress(self, tensor: torch.Tensor):
        self.check_stock_use("hvd_compress.torch.DistributedOptimizer(optimizer, compression=...)")
        if self.config.codec == "none" or tensor.dtype not in DTYPE_NAMES:
            if tensor.dtype == torch.bfloat16:  # Horovod 0.28.1 has no bfloat16 allreduce
                return tensor.float(), torch.bfloat16
            return tensor, None
        # No name reaches us here, so randomk's shared seed is keyed by the tensor's shape and
        # how many tensors of that shape came before it: identical on ranks that run the same
        # model, because autograd visits parameters in the same order there.
        key = (tuple(tensor.shape), tensor.dtype)
        count = self._calls.get(key, 0)
        self._calls[key] = count + 1
        enc = self._codec.encode(f"{list(key[0])}#{count}", tensor)
        # bfloat16 values travel as float32 (exact) and are decoded from it (TorchCodec.decode).
        return (enc.payload.float() if enc.payload.dtype == torch.bfloat16 else enc.payload), enc

    def decompress(self, tensor: torch.Tensor, ctx):
        if ctx is None:
            return tensor
        if isinstance(ctx, torch.dtype):
            return tensor.to(ctx)
        return self._codec.decode(tensor, ctx, 1.0)


Compression = CompressionNamespace(Compressor)
