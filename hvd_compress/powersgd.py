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
    """A gradient of this shape as a matrix: its first dimension by the rest."""
    return int(shape[0]), math.prod(int(d) for d in shape[1:])
