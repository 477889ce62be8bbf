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
    4. Allreduce P, asynchronously, with the other P of its group (below) in one grouped
       allreduce, issued from the backward hook when the group is complete (overlapped with
       backward).
    Once the group's P is reduced: during backward, from a later gradient's hook that finds it
    so (the optimizer polls), else in synchronize(), for all groups before waiting on any Q:
    5. Orthogonalise P (Gram-Schmidt).
    6. Q_i = M^T P, and E = M - P Q_i^T: what this rank's approximation missed.
    7. Allreduce Q, asynchronously, with its group's.
    Then per group, once its Q is reduced (again from backward's hooks if it is by then):
    8. Q = Q_sum / world (op=Average), kept for the next step's warm start.
    9. G = P Q^T; on the CPU, whether G is finite (the optimizer's check that the step is kept)
       is found as it is written.

Steps 2, 3, 5, 6 and 9 are kernels from csrc/cpu/powersgd.cc; P and Q are float32 (float64
for float64 gradients). State (E, Q, step counters) lives in the optimizer's StateStore and is
checkpointed with compression_state_dict().

Every round works on a batch of same-shape matrices: the kernels take the batch in one call and
its P (Q) factors travel stacked. Without `batch_same_shape` a batch is one matrix, projected as
soon as its gradient is ready. With it, the matrices of one shape and dtype form a batch,
projected when the last of them is ready (or in synchronize(), with the ones that arrived).
Batches travel in groups, each group's P in one grouped allreduce and then its Q in another: a
group is one batch, or with the optimizer's `bucket_mb` the matrices of one bucket (consecutive
in backward order, up to bucket_mb of gradient, one dtype), sent when the last of them is
ready. Fewer, larger collectives: each costs the background thread a negotiation and the main
thread a wait. The state stays per parameter, so checkpoints depend on neither setting.
"""
from __future__ import annotations

import horovod.torch as hvd
import torch

from ..powersgd import PowerSGDState, matrix_shape
from ..seeds import derive_seed
from ..spec import CompressionConfig
from ..state import StateStore
from . import _C
from .waiting import wait


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
        self._batches: dict[str, list[str]] = {}  # name -> its batch's names, if more than one
        self._groups: dict[str, list[str]] = {}   # name -> its group's names, if more than one
        self._open: dict[tuple[str, ...], _Batch] = {}
        self._open_groups: dict[tuple[str, ...], _Group] = {}
        self._step_groups: list[_Group] = []  # every group since the last end_step
        self._sent: list[_Group] = []  # groups sent since the optimizer last took them

    def plan(self, named_tensors, bucket_bytes: int = 0) -> None:
        """named_tensors in the order backward is expected to produce them. With bucket_bytes,
        consecutive matrices of one dtype up to that many gradient bytes form a group; with
        batch_same_shape, the matrices of one shape and dtype (in one group, if groups are
        formed) form a batch. Names sorted within either, so every rank forms the same."""
        wanted = [(n, t) for n, t in named_tensors if self.state.compresses(t.shape)]
        groups = [[(n, t) for n, t in wanted]]
        if bucket_bytes:
            groups, size = [], 0
            for n, t in wanted:
                nbytes = t.numel() * t.element_size()
                if not groups or t.dtype != groups[-1][0][1].dtype or size + nbytes > bucket_bytes:
                    groups.append([])
                    size = 0
                groups[-1].append((n, t))
                size += nbytes
            self._groups = {n: sorted(m for m, _ in g) for g in groups if len(g) > 1 for n, _ in g}
        if self.state.batch_same_shape:
            by_key: dict[tuple, list[str]] = {}
            for i, group in enumerate(groups):
                for name, t in sorted(group, key=lambda nt: nt[0]):
                    by_key.setdefault((i, tuple(t.shape), t.dtype), []).append(name)
            self._batches = {n: names for names in by_key.values() if len(names) > 1
                             for n in names}

    def compressed_step(self, name: str, grad: torch.Tensor) -> int | None:
        """Step 1: this parameter's step number when it is compressed now, else None."""
        step = self.store.next_step(name)
        if step < self.state.start_iter or not self.state.compresses(grad.shape):
            return None
        return step

    def start(self, name: str, grad: torch.Tensor, step: int) -> "PowerSGDMember":
        names = self._batches.get(name)
        key = tuple(names) if names else (name,)
        batch = self._open.get(key)
        late = batch is not None and batch.issued
        if batch is None or late:
            # A batch already issued this step: this gradient came late (synchronize() found
            # it missing); it goes alone rather than wait for the next step.
            batch = _Batch(self, (name,) if late else key)
            if len(key) > 1 and not late:
                self._open[key] = batch
            batch.group = self._group_for(name, batch, late)
            if not batch.group.batches:
                self._step_groups.append(batch.group)
            batch.group.batches.append(batch)
        member = batch.add(name, grad, step)
        if batch.full:
            batch.issue()
        batch.group.arrived(name)
        return member

    def _group_for(self, name: str, batch: "_Batch", late: bool) -> "_Group":
        names = self._groups.get(name)
        if names is None or late:
            return _Group(self, batch.key)
        key = tuple(names)
        group = self._open_groups.get(key)
        if group is None:
            group = self._open_groups[key] = _Group(self, key)
        elif group.sent:  # sent without this matrix (synchronize() found it missing)
            return _Group(self, batch.key)
        return group

    def take_sent(self) -> list["_Group"]:
        """The groups whose P went out since the last call: the optimizer moves them on as
        their collectives finish, as it does its other plans."""
        sent, self._sent = self._sent, []
        return sent

    def end_step(self) -> None:
        """After every member's result was taken. A group and its batches refer to each other:
        left to the cycle collector, which runs by object counts, the step's gradients (the
        batches hold them) outlived it, the process grew by their size every step until a
        collection, and each step's new gradients fell on fresh pages."""
        for group in self._step_groups:
            group.batches = []
        self._step_groups, self._sent = [], []
        self._open.clear()
        self._open_groups.clear()


class _Group:
    """Batches whose P travel in one grouped allreduce, then their Q in another. ready(),
    prepare() and done are the optimizer's interface to a plan in flight: prepare() moves the
    group on by one collective."""

    def __init__(self, red: PowerSGDReduction, key: tuple[str, ...]):
        self.red, self.key = red, key
        self.batches: list[_Batch] = []
        self.names: set[str] = set()
        self.sent = False
        self.q_handle = None
        self.done = False

    def arrived(self, name: str) -> None:
        self.names.add(name)
        if len(self.names) == len(self.key):
            self.send()

    def send(self) -> None:
        """Step 4, for every batch of the group (those that have not projected yet do now,
        with the members that arrived)."""
        for batch in self.batches:
            if not batch.issued:
                batch.issue()
        self.batches.sort(key=lambda b: b.key)  # arrival order may differ between ranks
        red = self.red
        names = [n for b in self.batches for n in b.names]
        self.label = names[0] if len(names) == 1 else f"{names[0]}+{len(names) - 1}"
        self.handle = hvd.grouped_allreduce_async_([b.p for b in self.batches],
                                                   name=f"{self.label}.powersgd_p", op=hvd.Sum,
                                                   process_set=red.process_set)
        self.sent = True
        red._sent.append(self)

    def ready(self) -> bool:
        """Whether prepare() would not wait: the collective in flight has finished."""
        return self.done or hvd.poll(self.handle if self.q_handle is None else self.q_handle)

    def prepare(self) -> None:
        """Steps 5-7 once P is in, else steps 8-9."""
        if self.q_handle is None:
            self.second_round()
        else:
            self.finish()

    def second_round(self) -> None:
        """Steps 5-7."""
        if self.q_handle is not None:
            return
        if not self.sent:
            self.send()
        red = self.red
        wait(self.handle)
        for batch in self.batches:
            batch.factor()
        self.q_handle = hvd.grouped_allreduce_async_([b.qt for b in self.batches],
                                                     name=f"{self.label}.powersgd_q", op=hvd.Sum,
                                                     process_set=red.process_set)

    def finish(self) -> None:
        """Steps 8-9."""
        if self.done:
            return
        self.second_round()
        wait(self.q_handle)
        for batch in self.batches:
            batch.finish()
        self.done = True


class _Batch:
    """Same-shape matrices going through the two rounds together, stacked in the planned
    (name) order whatever order backward produced them in, so all ranks stack alike."""

    def __init__(self, red: PowerSGDReduction, key: tuple[str, ...]):
        self.red, self.key = red, key
        self.arrived: dict[str, tuple[torch.Tensor, int]] = {}
        self.issued = False
        self.finite: bool | None = None
        self.group: _Group

    @property
    def full(self) -> bool:
        return len(self.arrived) == len(self.key)

    def add(self, name: str, grad: torch.Tensor, step: int) -> "PowerSGDMember":
        if self.arrived:
            g0 = next(iter(self.arrived.values()))[0]
            if grad.shape != g0.shape or grad.dtype != g0.dtype:
                raise RuntimeError(f"PowerSGD batch_same_shape: gradient of {name} is "
                                   f"{tuple(grad.shape)} {grad.dtype}, its batch expects "
                                   f"{tuple(g0.shape)} {g0.dtype}; the parameter changed shape "
                                   f"or dtype after the optimizer was built")
        self.arrived[name] = (grad, step)
        return PowerSGDMember(self, name)

    def issue(self) -> None:
        """Steps 2-3."""
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
        self.issued = True

    def factor(self) -> None:
        """Steps 5-6, once P is reduced."""
        _C.powersgd_orthogonalize(self.p, self.red.state.orthogonalization_epsilon)
        _C.powersgd_back_project(self.mats, self.p, self.qt)
        if self.red.state.error_feedback:
            _C.powersgd_reconstruct(self.p, self.qt, self.mats, 1.0, True)

    def finish(self) -> None:
        """Steps 8-9, once Q is reduced."""
        q = self.qt
        if self.red.average:
            q.mul_(1.0 / self.red.world)
        for mine, qi in zip(self.qts, q):
            mine.copy_(qi)
        rows = self.p.shape[1]
        self.outs = [g if g.is_contiguous() else torch.empty_like(g) for g in self.grads]
        # On the CPU the step's finiteness check is done here, on each block of G as it is
        # written, rather than in another pass over the gradients after the reduction.
        on_cpu = q.device.type == "cpu"
        finite = _C.powersgd_reconstruct(self.p, q, [o.view(rows, -1) for o in self.outs], 1.0,
                                         False, check_finite=on_cpu)
        self.finite = finite if on_cpu else None


class PowerSGDMember:
    """One parameter's handle into its batch; Horovod's synchronize() calls it for the result."""

    def __init__(self, batch: _Batch, name: str):
        self.batch, self.name = batch, name

    @property
    def sent_elements(self) -> int:
        """P and Q elements this parameter puts on the wire per step."""
        return sum(matrix_shape(self.batch.arrived[self.name][0].shape)) * self.batch.red.state.rank

    def prepare(self) -> None:
        self.batch.group.second_round()

    def __call__(self) -> torch.Tensor:
        self.batch.group.finish()
        return self.batch.outs[self.batch.names.index(self.name)]

    @property
    def finite(self) -> bool | None:
        """Once called: whether its batch's results are all finite; None if not checked (CUDA)."""
        return self.batch.finite
