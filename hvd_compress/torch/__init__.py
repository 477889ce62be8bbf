"""PyTorch frontend: codec kernels as torch ops, Horovod-protocol compressors and a
DistributedOptimizer that routes each codec to allreduce or allgather."""
from .compression import Compression, Compressor
from .optimizer import DistributedOptimizer

__all__ = ["Compression", "Compressor", "DistributedOptimizer"]
