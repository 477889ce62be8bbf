"""PowerSGD's settings and the decisions both frontends take from them (which matrices are
compressed, how a gradient is viewed as a matrix); the passes themselves are kernels
(csrc/cpu/powersgd.cc), driven by hvd_compress.torch.powersgd and
hvd_compress.tensorflow.powersgd."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .spec import CompressionConfig


@dataclass(frozen=True)
class PowerSGDState:
    """The hyperparameters, named as in PyTorch's PowerSGDState."""

    rank: int
    start_iter: int
    min_compression_rate: float
    error_feedback: bool
    warm_start: bool
    orthogonalization_epsilon: float
    batch_same_shape: bool
    seed: int

    @classmethod
    def from_config(cls, cfg: CompressionConfig) -> "PowerSGDState":
        return cls(seed=cfg.seed, **cfg.param_dict)

    def compresses(self, shape) -> bool:
        if len(shape) < 2 or math.prod(int(d) for d in shape) == 0:  # nothing to factor
            return False
        rows, cols = matrix_shape(shape)
        return rows * cols >= self.min_compression_rate * (rows + cols) * self.rank


def matrix_shape(shape) -> tuple[int, int]:
    """A gradient of this shape as a matrix: its leading dimensions by the rest, split where the
    matrix is closest to square, which makes P and Q smallest. The first dimension alone is the
    split for a 2-D gradient and for PyTorch's (O, I, H, W) kernels, but TensorFlow's (H, W, I, O)
    kernels would become 3 rows, too few to compress: they split before O. Both frontends take
    the view from the shape alone, so a tensor's state is the same in either."""
    dims = [int(d) for d in shape]
    splits = [(math.prod(dims[:k]), math.prod(dims[k:])) for k in range(1, max(len(dims), 2))]
    return min(splits, key=sum)  # the first split on a tie
