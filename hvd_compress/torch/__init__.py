"""PyTorch frontend: codec kernels as torch ops, Horovod-protocol compressors and a
DistributedOptimizer that routes each codec to allreduce or allgather.

horovod.torch is imported only when DistributedOptimizer is first used: the codecs work without
Horovod, and a process that runs Horovod's TensorFlow library must not load its torch library
beside it (each keeps its own global state)."""
from .compression import Compression, Compressor

__all__ = ["Compression", "Compressor", "DistributedOptimizer"]


def __getattr__(name):
    if name == "DistributedOptimizer":
        from .optimizer import DistributedOptimizer
        return DistributedOptimizer
    raise AttributeError(f"module 'hvd_compress.torch' has no attribute {name!r}")
