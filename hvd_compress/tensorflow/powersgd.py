"""PowerSGD for the TensorFlow reducer: the steps of hvd_compress.torch.powersgd (which see),
on the same kernels as TF ops and under the same state kinds ("ef" per matrix [rows, cols],
"powersgd_qt" [rank, cols], and "momentum" under momentum=nesterov, which the reducer applies
first), so a checkpoint continues in either frontend.

A step's compressed gradients are reduced together: with batch_same_shape, the matrices of one
shape and dtype (by name, so every rank stacks alike) share each kernel call. Every batch's P
travels in one grouped allreduce, then every Q in another. A batch compresses from its step
`start_iter` on: eagerly a Python choice; in a graph, until start_iter is 0, a tf.cond on the
step counter per batch (every rank takes the same branch), each with its own two rounds. Its first Q is drawn
by a kernel from (seed, name, step) at that step, or at every step without warm_start.
"""
from __future__ import annotations

from dataclasses import dataclass

import horovod.tensorflow as hvd
import tensorflow as tf

from ..powersgd import PowerSGDState, matrix_shape
from ..seeds import seed_base
from ..spec import CompressionConfig
from ..state import StateStore
from .codec import _signed64
from .ops import lib


class PowerSGDReduction:
    def __init__(self, config: CompressionConfig, store: StateStore, process_set, average: bool):
        self.state = PowerSGDState.from_config(config)
        self.store = store
        self.process_set = process_set
        self.average = average

    def reduce(self, items: list, plain, record) -> dict:
        """The reduced gradient of every (name, opname, grad) in `items`, by name. plain(grad,
        opname) is the uncompressed reduction; record(name, grad, sent elements or None) the
        statistics."""
        st = self.state
        steps = {name: self.store.next_step(name) for name, _, _ in items}
        out, batches = {}, {}
        for name, opname, grad in sorted(items, key=lambda item: item[0]):
            if not st.compresses(grad.shape):
                out[name] = plain(grad, opname)
                record(name, grad, None)
                continue
            key = (tuple(grad.shape), grad.dtype) if st.batch_same_shape else (name,)
            batches.setdefault(key, []).append((name, opname, grad))
        chosen, plain_batches, undecided = [], [], []
        for batch in batches.values():
            step = steps[batch[0][0]]
            if st.start_iter == 0 or (tf.executing_eagerly() and int(step) >= st.start_iter):
                chosen.append(batch)
            elif tf.executing_eagerly():
                plain_batches.append(batch)
            else:
                undecided.append(batch)

        def uncompressed(batch):
            return [plain(grad, opname + ".plain") for _, opname, grad in batch]

        reduced = [(batch, outs, True) for batch, outs in zip(chosen, self._run(chosen, steps))]
        reduced += [(batch, uncompressed(batch), False) for batch in plain_batches]
        for batch in undecided:  # every rank takes the same branch: the counts agree
            outs = tf.cond(steps[batch[0][0]] >= st.start_iter,
                           lambda batch=batch: self._run([batch], steps)[0],
                           lambda batch=batch: uncompressed(batch))
            reduced.append((batch, outs, True))
        for batch, outs, compressed in reduced:
            for (name, _, grad), g in zip(batch, outs):
                out[name] = g
                rows, cols = matrix_shape(grad.shape)
                record(name, grad, (rows + cols) * st.rank if compressed else None)
        return out

    def _run(self, batches: list, steps: dict) -> list:
        """The reduced gradients of these batches: every batch's P in one grouped allreduce,
        then every Q in another, so no tensor waits on another's rounds."""
        if not batches:
            return []
        work = [self._project(batch, [steps[name] for name, _, _ in batch]) for batch in batches]
        ps = self._allreduce([w.p for w in work], work, "p")
        qs = self._allreduce([self._back_project(w, p) for w, p in zip(work, ps)], work, "q")
        return [self._reconstruct(w, q) for w, q in zip(work, qs)]

    def _allreduce(self, tensors: list, work: list, factor: str) -> list:
        # (graph op names allow no "+", which torch's batch names use)
        more = f"_with_{len(work) - 1}" if len(work) > 1 else ""
        return hvd.grouped_allreduce(tensors, op=hvd.Sum, process_set=self.process_set,
                                     name=f"{work[0].label}{more}.powersgd_{factor}")

    def _project(self, batch: list, steps: list) -> "_Batch":
        """Steps 2-3 of hvd_compress.torch.powersgd: M = G + E, P = M Q."""
        st, store = self.state, self.store
        grads = [grad for _, _, grad in batch]
        rows, cols = matrix_shape(grads[0].shape)
        ftype = tf.float64 if grads[0].dtype == tf.float64 else tf.float32
        mats = [tf.reshape(g, [rows, cols]) for g in grads]
        qvars, qts = [], []
        for (name, _, _), step in zip(batch, steps):
            qvar = store.slot(name, "powersgd_qt", tf.zeros([st.rank, cols], ftype))
            draw = lib.hvdc_powersgd_initial_q(step, F=ftype, r=st.rank, cols=cols,
                                               seed_base=_signed64(seed_base(st.seed, name)))
            # A matrix's first compressed step is its step start_iter (steps are counted from
            # the first, compressed or not), when torch finds no Q kept yet.
            qts.append(tf.where(tf.equal(step, st.start_iter), draw, qvar) if st.warm_start
                       else draw)
            qvars.append(qvar)
        evars = ([store.slot(name, "ef", m) for (name, _, _), m in zip(batch, mats)]
                 if st.error_feedback else [])
        p, summed = lib.hvdc_powersgd_project(mats, [tf.convert_to_tensor(v) for v in evars],
                                              tf.stack(qts))
        label = batch[0][1] if len(batch) == 1 else f"{batch[0][1]}_and_{len(batch) - 1}"
        # With error feedback M = G + E came back from the projection.
        return _Batch(grads, mats, summed if st.error_feedback else mats, qvars, evars, p, label,
                      ftype)

    def _back_project(self, work: "_Batch", p):
        """Steps 5-6: P orthogonalised, Q = M^T P, and the residual: what this rank's
        approximation misses of M."""
        st = self.state
        work.p = lib.hvdc_powersgd_orthogonalize(p, tf.constant(st.orthogonalization_epsilon,
                                                                tf.float64))
        q = lib.hvdc_powersgd_back_project(work.m, work.p)
        if st.error_feedback:
            one = tf.constant(1.0, tf.float64)
            for v, e in zip(work.evars, lib.hvdc_powersgd_reconstruct(work.m, work.p, q, one,
                                                                      subtract=True)):
                v.assign(e)
        return q

    def _reconstruct(self, work: "_Batch", q) -> list:
        """Steps 8-9: Q averaged and kept for the warm start, G = P Q^T."""
        if self.average:
            q = q * tf.constant(1.0 / self.process_set.size(), work.ftype)
        for v, qi in zip(work.qvars, tf.unstack(q)):
            v.assign(qi)
        outs = lib.hvdc_powersgd_reconstruct(work.mats, work.p, q, tf.constant(1.0, tf.float64),
                                             subtract=False)
        return [tf.reshape(o, g.shape) for o, g in zip(outs, work.grads)]


@dataclass
class _Batch:
    """One batch between its rounds."""
    grads: list
    mats: list  # the gradients as [rows, cols] matrices
    m: list  # M: the matrices plus the residuals with error feedback
    qvars: list
    evars: list
    p: object
    label: str
    ftype: object
