"""PowerSGD (Vogels et al. 2019) for hvd_compress.torch.DistributedOptimizer.

Per parameter, viewing its gradient G as a matrix M (rows = first dimension):

    1. If fewer than `start_iter` steps have run, G is 1-D, or the matrix compresses less than
       `min_compression_rate` (rows*cols / ((rows+cols)*rank)): plain allreduce (Horovod fuses
       these into a few collectives).
    2. Error feedback: M = G + E, E the residual this rank kept from its last step. With
       momentum=nesterov in the spec, G is first m = mu*m + G; G = mu*m + G (the optimizer's
       own momentum is then 0), in step 1's plain allreduce too.
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

Every round works on a batch of same-shape matrices: the kernels take the batch in one call and
its P (Q) factors travel stacked in one allreduce. Without `batch_same_shape` a batch is one
matrix, issued as soon as its gradient is ready. With it, the matrices of one shape and dtype
form a batch, issued when the last of them is ready (or in synchronize(), with the ones that
arrived); its state stays per parameter, so checkpoints do not depend on the setting.
"""
from __future__ import annotations

import horovod.torch as hvd
import torch

from ..powersgd import PowerSGDState, matrix_shape
from ..seeds import derive_seed
from ..spec import CompressionConfig
from ..state import StateStore
from . import _C


def initial_q(seed: int, name: str, step: int, rank: int, cols: int,
              dtype: torch.dtype) -> torch.Tensor:
    """Qt (rank x cols) of standard normals drawn from (seed, name, step) by a kernel rather than
    torch's generator: identical on every rank and in any frontend, no broadcast."""
    return _C.powersgd_initial_q(derive_seed(seed, name, step), rank, cols,
                                 dtype == torch.float64)


class PowerSGDReduction:
    """Steps 2-9 for one optimizer; `start` is called from the backward hook."""

    def __init__(self, config: CompressionConfig, store: StateStore, process_set, average: bool):
        self.state = PowerSGDState.from_config(config)
        self.store = store
        self.process_set = process_set
        self.world = process_set.size()
        self.average = average
        self._groups: dict[str, list[str]] = {}
        self._open: dict[tuple[str, ...], _Batch] = {}

    def plan(self, named_tensors) -> None:
        """With batch_same_shape, group the parameters that will be compressed by shape and dtype;
        names sorted, so every rank forms the same batches."""
        if not self.state.batch_same_shape:
            return
        by_key: dict[tuple, list[str]] = {}
        for name, t in sorted(named_tensors, key=lambda nt: nt[0]):
            if self.state.compresses(t.shape):
                by_key.setdefault((tuple(t.shape), t.dtype), []).append(name)
        self._groups = {n: names for names in by_key.values() if len(names) > 1 for n in names}

    def compressed_step(self, name: str, grad: torch.Tensor) -> int | None:
        """Step 1: this parameter's step number when it is compressed now, else None."""
        step = self.store.next_step(name)
        if step < self.state.start_iter or not self.state.compresses(grad.shape):
            return None
        return step

    def start(self, name: str, grad: torch.Tensor, step: int) -> "_Member":
        group = self._groups.get(name)
        key = tuple(group) if group else (name,)
        batch = self._open.get(key)
        if batch is None or batch.issued:
            if batch is not None:
                # A batch already issued this step: this gradient came late (synchronize() found
                # it missing); it goes alone rather than wait for the next step.
                key = (name,)
            batch = _Batch(self, key)
            if len(key) > 1:
                self._open[key] = batch
        member = batch.add(name, grad, step)
        if batch.full:
            batch.issue()
        return member

    def end_step(self) -> None:
        self._open.clear()


class _Batch:
    """Same-shape matrices going through the two rounds together, stacked in the planned
    (name) order whatever order backward produced them in, so all ranks stack alike."""

    def __init__(self, red: PowerSGDReduction, key: tuple[str, ...]):
        self.red, self.key = red, key
        self.arrived: dict[str, tuple[torch.Tensor, int]] = {}
        self.issued = False
        self.q_handle = None
        self.done = False

    @property
    def full(self) -> bool:
        return len(self.arrived) == len(self.key)

    def add(self, name: str, grad: torch.Tensor, step: int) -> "_Member":
        if self.arrived:
            g0 = next(iter(self.arrived.values()))[0]
            if grad.shape != g0.shape or grad.dtype != g0.dtype:
                raise RuntimeError(f"PowerSGD batch_same_shape: gradient of {name} is "
                                   f"{tuple(grad.shape)} {grad.dtype}, its batch expects "
                                   f"{tuple(g0.shape)} {g0.dtype}; the parameter changed shape "
                                   f"or dtype after the optimizer was built")
        self.arrived[name] = (grad, step)
        return _Member(self, name)

    def issue(self) -> None:
        """Steps 2-4."""
        red, st = self.red, self.red.state
        store = red.store
        self.names = [n for n in self.key if n in self.arrived]
        self.grads = [self.arrived[n][0] for n in self.names]
        self.steps = [self.arrived[n][1] for n in self.names]
        ftype = torch.float64 if self.grads[0].dtype == torch.float64 else torch.float32
        dev = self.grads[0].device
        rows, cols = matrix_shape(self.grads[0].shape)
        b = len(self.names)
        self.qts = []
        qt = torch.empty(b, st.rank, cols, dtype=ftype, device=dev)
        mats, res, olds = [], [], []
        for i, (name, grad, step) in enumerate(zip(self.names, self.grads, self.steps)):
            m = grad.reshape(rows, cols)
            if not m.is_contiguous():
                m = m.contiguous()
            first = not store.contains(name, "powersgd_qt")
            mine = store.slot(name, "powersgd_qt",
                              torch.empty(st.rank, cols, dtype=ftype, device=dev))
            if first or not st.warm_start:
                mine.copy_(initial_q(st.seed, name, step, st.rank, cols, ftype))
            qt[i].copy_(mine)
            self.qts.append(mine)
            mats.append(m)
            if st.error_feedback:
                # The kernel writes M into a second buffer; the old residual, left as it was,
                # is the step's backup (StateStore.rewrite), so a skipped step costs no copy.
                old, new = store.rewrite(name, "ef", m)
                olds.append(old)
                res.append(new)
        self.p = torch.empty(b, rows, st.rank, dtype=ftype, device=dev)
        _C.powersgd_project(mats, res, st.error_feedback, qt, self.p, olds)
        # With error feedback M = G + E was written into E, which step 6 turns into the residual.
        self.mats = res if st.error_feedback else mats
        self.qt = qt
        self.name = self.names[0] if b == 1 else f"{self.names[0]}+{b - 1}"
        self.handle = hvd.allreduce_async_(self.p, name=f"{self.name}.powersgd_p", op=hvd.Sum,
                                           process_set=red.process_set)
        self.issued = True

    def prepare(self) -> None:
        """Steps 5-7."""
        if self.q_handle is not None:
            return
        if not self.issued:
            self.issue()
        red = self.red
        hvd.synchronize(self.handle)
        _C.powersgd_orthogonalize(self.p, red.state.orthogonalization_epsilon)
        q_local = self.qt
        _C.powersgd_back_project(self.mats, self.p, q_local)
        if red.state.error_feedback:
            _C.powersgd_reconstruct(self.p, q_local, self.mats, 1.0, True)
        self.q_handle = hvd.allreduce_async_(q_local, name=f"{self.name}.powersgd_q", op=hvd.Sum,
                                             process_set=red.process_set)

    def finish(self) -> None:
        """Steps 8-9."""
        if self.done:
            return
        self.prepare()
        hvd.synchronize(self.q_handle)
        q = self.qt
        if self.red.average:
            q.mul_(1.0 / self.red.world)
        for mine, qi in zip(self.qts, q):
            mine.copy_(qi)
        rows = self.p.shape[1]
        self.outs = [g if g.is_contiguous() else torch.empty_like(g) for g in self.grads]
        _C.powersgd_reconstruct(self.p, q, [o.view(rows, -1) for o in self.outs], 1.0, False)
        self.done = True


class _Member:
    """One parameter's handle into its batch; Horovod's synchronize() calls it for the result."""

    def __init__(self, batch: _Batch, name: str):
        self.batch, self.name = batch, name

    @property
    def sent_elements(self) -> int:
        """P and Q elements this parameter puts on the wire per step."""
        return sum(matrix_shape(self.batch.arrived[self.name][0].shape)) * self.batch.red.state.rank

    def prepare(self) -> None:
        self.batch.prepare()

    def __call__(self) -> torch.Tensor:
        self.batch.finish()
        return self.batch.outs[self.batch.names.index(self.name)]
