"""PowerSGD for the TensorFlow reducer: the steps of hvd_compress.torch.powersgd (which see),
on the same kernels as TF ops and under the same state kinds ("ef" per matrix [rows, cols],
"powersgd_qt" [rank, cols]), so a checkpoint continues in either frontend.

A step's compressed gradients are reduced together: with batch_same_shape, the matrices of one
shape and dtype (by name, so every rank stacks alike) share each kernel call and each of the two
allreduces. A batch compresses from its step `start_iter` on: eagerly a Python choice, in a
graph a tf.cond on the step counter (every rank takes the same branch). Its first Q is drawn
by a kernel from (seed, name, step) at that step, or at every step without warm_start.
"""
from __future__ import annotations

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
        for batch in batches.values():
            step = steps[batch[0][0]]

            def compressed(batch=batch):
                return self._compressed(batch, [steps[name] for name, _, _ in batch])

            def uncompressed(batch=batch):
                return [plain(grad, opname + ".plain") for _, opname, grad in batch]

            if st.start_iter == 0:
                reduced = compressed()
            elif tf.executing_eagerly():
                reduced = compressed() if int(step) >= st.start_iter else uncompressed()
            else:
                reduced = tf.cond(step >= st.start_iter, compressed, uncompressed)
            for (name, _, grad), g in zip(batch, reduced):
                out[name] = g
                rows, cols = matrix_shape(grad.shape)
                record(name, grad, (rows + cols) * st.rank)
        return out

    def _compressed(self, batch: list, steps: list) -> list:
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
        # (graph op names allow no "+", which torch's batch names use)
        label = batch[0][1] if len(batch) == 1 else f"{batch[0][1]}_and_{len(batch) - 1}"
        p = hvd.allreduce(p, op=hvd.Sum, name=f"{label}.powersgd_p",
                          process_set=self.process_set)
        p = lib.hvdc_powersgd_orthogonalize(p, tf.constant(st.orthogonalization_epsilon,
                                                           tf.float64))
        # With error feedback M = G + E came back from the projection; the residual is what
        # this rank's approximation misses of it.
        m = summed if st.error_feedback else mats
        q = lib.hvdc_powersgd_back_project(m, p)
        if st.error_feedback:
            one = tf.constant(1.0, tf.float64)
            for v, e in zip(evars, lib.hvdc_powersgd_reconstruct(m, p, q, one, subtract=True)):
                v.assign(e)
        q = hvd.allreduce(q, op=hvd.Sum, name=f"{label}.powersgd_q",
                          process_set=self.process_set)
        if self.average:
            q = q * tf.constant(1.0 / self.process_set.size(), ftype)
        for v, qi in zip(qvars, tf.unstack(q)):
            v.assign(qi)
        outs = lib.hvdc_powersgd_reconstruct(mats, p, q, tf.constant(1.0, tf.float64),
                                             subtract=False)
        return [tf.reshape(o, g.shape) for o, g in zip(outs, grads)]
