"""PowerSGD (Vogels et al. 2019) for hvd_compress.torch.DistributedOptimizer.

Per parameter, viewing its gradient G as a matrix M (rows = first dimension):

    1. If fewer than `start_iter` steps have run, G is 1-D, or the matrix compresses less than
       `min_compression_rate` (rows*cols / ((rows+cols)*rank)): plain allreduce (Horovod fuses
       these into a few collectives).
    2. Error feedback: M = G + E, E the residual this rank kept from its last step.
    3. P = M Q, with Q from the previous step (warm start) or, on a parameter's first
       compressed step or with warm_start off, drawn from the spec's seed: the same on all ranks.
    4. Allreduce P, asynchronously (issued from the backward hook, overlapped with backward).
    In synchronize(), for all parameters before waiting on any second round:
    5. Orthogonalise P (Gram-Schmidt).
    6. Q_i = M^T P, and E = M - P Q_i^T: what this rank's approximation missed.
    7. Allreduce Q, asynchronously.
    Then per parameter:
    8. Q = Q_sum / world (op=Average), kept for the next step's warm start.
    9. G = P Q^T.

Steps 2, 3, 5, 6 and 9 are kernels from csrc/cpu/powersgd.cc; P and Q are float32 (float64
for float64 gradients). State (E, Q, step counters) lives in the optimizer's StateStore and is
checkpointed with compression_state_dict().
"""
from __future__ import annotations

from dataclasses import dataclass

import horovod.torch as hvd
import torch

from ..seeds import derive_seed
from ..spec import CompressionConfig
from ..state import StateStore
from . import _C


@dataclass(frozen=True)
class PowerSGDState:
    """The hyperparameters, named as in PyTorch's PowerSGDState."""

    rank: int
    start_iter: int
    min_compression_rate: float
    error_feedback: bool
    warm_start: bool
    orthogonalization_epsilon: float
    seed: int

    @classmethod
    def from_config(cls, cfg: CompressionConfig) -> "PowerSGDState":
        return cls(seed=cfg.seed, **cfg.param_dict)

    def compresses(self, shape: torch.Size) -> bool:
        if len(shape) < 2:
            return False
        rows = shape[0]
        cols = shape.numel() // rows
        return rows * cols >= self.min_compression_rate * (rows + cols) * self.rank


def initial_q(seed: int, name: str, step: int, rank: int, cols: int,
              dtype: torch.dtype) -> torch.Tensor:
    """Qt (rank x cols) drawn from (seed, name, step): identical on every rank, no broadcast."""
    g = torch.Generator().manual_seed(derive_seed(seed, name, step) & 0x7FFFFFFFFFFFFFFF)
    return torch.randn(rank, cols, generator=g, dtype=torch.float64).to(dtype)


class PowerSGDReduction:
    """Steps 2-9 for one optimizer; `start` is called from the backward hook."""

    def __init__(self, config: CompressionConfig, store: StateStore, process_set, average: bool):
        self.state = PowerSGDState.from_config(config)
        self.store = store
        self.process_set = process_set
        self.world = process_set.size()
        self.average = average

    def compressed_step(self, name: str, grad: torch.Tensor) -> int | None:
        """Step 1: this parameter's step number when it is compressed now, else None."""
        step = self.store.next_step(name)
        if step < self.state.start_iter or not self.state.compresses(grad.shape):
            return None
        return step

    def start(self, name: str, grad: torch.Tensor, step: int) -> "_Pending":
        st = self.state
        m = grad.reshape(grad.shape[0], -1)
        if not m.is_contiguous():
            m = m.contiguous()
        ftype = torch.float64 if grad.dtype == torch.float64 else torch.float32
        rows, cols = m.shape
        first = not self.store.contains(name, "powersgd_qt")
        qt = self.store.slot(name, "powersgd_qt", torch.empty(st.rank, cols, dtype=ftype))
        if first or not st.warm_start:
            qt.copy_(initial_q(st.seed, name, step, st.rank, cols, ftype))
        if st.error_feedback:
            e = self.store.slot(name, "ef", m)
        else:
            e = torch.empty(0, dtype=m.dtype)
        p = torch.empty(rows, st.rank, dtype=ftype)
        _C.powersgd_project(m, e, st.error_feedback, qt, p)
        handle = hvd.allreduce_async_(p, name=f"{name}.powersgd_p", op=hvd.Sum,
                                      process_set=self.process_set)
        return _Pending(self, name, grad, e if st.error_feedback else m, p, qt, handle)


class _Pending:
    """One parameter between its two rounds; Horovod's synchronize() calls it for the result."""

    def __init__(self, red: PowerSGDReduction, name, grad, mat, p, qt, handle):
        self.red, self.name, self.grad, self.mat = red, name, grad, mat
        self.p, self.qt, self.handle = p, qt, handle
        self.q_handle = None

    def prepare(self) -> None:
        """Steps 5-7."""
        if self.q_handle is not None:
            return
        red = self.red
        hvd.synchronize(self.handle)
        _C.powersgd_orthogonalize(self.p, red.state.orthogonalization_epsilon)
        q_local = torch.empty_like(self.qt)
        _C.powersgd_back_project(self.mat, self.p, q_local)
        if red.state.error_feedback:
            _C.powersgd_reconstruct(self.p, q_local, self.mat, 1.0, True)
        self.q_sum = q_local
        self.q_handle = hvd.allreduce_async_(q_local, name=f"{self.name}.powersgd_q", op=hvd.Sum,
                                             process_set=red.process_set)

    def __call__(self) -> torch.Tensor:
        """Steps 8-9."""
        self.prepare()
        hvd.synchronize(self.q_handle)
        q = self.q_sum
        if self.red.average:
            q.mul_(1.0 / self.red.world)
        self.qt.copy_(q)
        out = self.grad if self.grad.is_contiguous() else torch.empty_like(self.grad)
        _C.powersgd_reconstruct(self.p, q, out.view(self.p.shape[0], -1), 1.0, False)
        return out
