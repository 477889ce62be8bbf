"""The spec's momentum handed to a Keras SGD's own while autotune keeps a run uncompressed.

A spec that applies momentum itself (DGC's momentum correction, momentum=nesterov) sets the
optimizer's to 0 (reducer.drop_optimizer_momentum) and applies its own to every gradient that
travels uncompressed: one more pass over the gradients that reads and writes the velocity, and
a finite check over the reduced gradients so that a skipped step can roll the velocity back.
Keras 2's SGD runs its momentum pass anyway, at 0 (m = -lr*g + 0*m; w += m). Keras' ResNet-50,
one thread: 21 ms of our momentum and 9 ms of check a step that Horovod's step does not have.

Once autotune settles on uncompressed steps, the velocity moves into the optimizer's momentum
slots and its momentum is set back, so that the settled step is Horovod's: allreduces, then SGD
with momentum. The two forms agree. Uncompressed, each rank's velocity follows
u_i = mu*u_i + g_i (Nesterov sends g_i + mu*u_i), and the reduced velocity U = mean(u_i) (or the
sum, under op=hvd.Sum) follows U = mu*U + mean(g); Keras keeps m = mu*m - lr*g, that is
m = -lr*U. So the hand-over writes m = -lr*U with the next step's learning rate and the way back
u_i = -m/lr, the same on every rank. Under a learning-rate schedule the forms then differ as
Keras' SGD differs from torch's: the run trains as Horovod's would with the user's optimizer.
"""
from __future__ import annotations

import horovod.tensorflow as hvd
import tensorflow as tf

from ..spec import CompressionConfig, spec_momentum
from .codec import state_variable

WRONG_TRACE = ("hvd_compress: this step runs a trace made for the other side of autotune's "
               "momentum hand-over (the optimizer holds the spec's momentum once autotune has "
               "settled on uncompressed steps); run the trace Reducer.next_trace() names before "
               "each step (Keras: hvd_compress.tensorflow.keras.AutotuneCallback)")


class MomentumHandoff:
    """The spec's momentum slots of one reducer and the Keras SGD it reduces for. `held`: a
    variable, whether the optimizer holds the momentum now; each trace checks it against what
    it was traced for, as a trace can only do one or the other."""

    def __init__(self, optimizer, config: CompressionConfig, op, process_set):
        self.optimizer = optimizer
        self.kind, self.factor, self.slot = spec_momentum(config)
        self.op, self.process_set = op, process_set
        self.nesterov = optimizer.nesterov
        self.held = state_variable(False, name="hvdc_momentum_in_optimizer")
        self.holding = False  # `held`, for Python

    @staticmethod
    def possible(optimizer, config: CompressionConfig) -> bool:
        """A spec whose momentum autotune can leave to a Keras 2 SGD (tf.keras.optimizers.SGD,
        whose momentum is read when a step is traced); not its legacy class, whose slots exist
        only where momentum was set at construction."""
        return (bool(config.autotune) and spec_momentum(config) is not None
                and isinstance(optimizer, tf.keras.optimizers.SGD))

    def _learning_rate(self):
        """The learning rate of the optimizer's next step."""
        opt = self.optimizer
        lr = opt._learning_rate
        if isinstance(lr, tf.keras.optimizers.schedules.LearningRateSchedule):
            return lr(opt.iterations)
        return tf.convert_to_tensor(lr)

    def _momenta(self, variables: list):
        opt = self.optimizer
        return [opt.momentums[opt._index_dict[opt._var_key(v)]] for v in variables]

    def take(self, store, named: list) -> None:
        """Write the reduced velocity of `named` ([(name, variable)] of the traced step) into
        the optimizer's momentum slots, and turn its momentum on. A collective: every rank
        calls it before the same step."""
        # A gradient that never took the spec's momentum (a dtype its kernels lack) has no
        # velocity: its optimizer momentum starts from zero.
        kept = [(name, v) for name, v in named if store.contains(name, self.slot)]
        with tf.init_scope():
            velocities = [tf.identity(store.slot(name, self.slot, v)) for name, v in kept]
            reduced = dict(zip([name for name, _ in kept], hvd.grouped_allreduce(
                velocities, op=self.op, process_set=self.process_set) if kept else []))
            lr = self._learning_rate()
            for (name, _), m in zip(named, self._momenta([v for _, v in named])):
                u = reduced.get(name)
                m.assign(tf.zeros_like(m) if u is None else
                         tf.cast(-tf.cast(lr, u.dtype) * u, m.dtype))
        self.optimizer.momentum = self.factor
        self.optimizer.nesterov = self.kind == "nesterov"
        self.held.assign(True)
        self.holding = True

    def write_back(self, store, named: list) -> None:
        """The optimizer's momentum as the spec's velocity, into the store (u = -m/lr, or zero
        if the learning rate is zero, where -m/lr has no value)."""
        with tf.init_scope():
            lr = self._learning_rate()
            for (name, v), m in zip(named, self._momenta([v for _, v in named])):
                if not store.contains(name, self.slot):
                    continue
                u = store.slot(name, self.slot, v)
                scale = tf.cast(lr, u.dtype)
                u.assign(tf.math.divide_no_nan(-tf.cast(m, u.dtype), scale))

    def release(self) -> None:
        """The optimizer's momentum off again: the spec's applies from the next trace on."""
        self.optimizer.momentum = 0.0
        self.optimizer.nesterov = self.nesterov
        self.held.assign(False)
        self.holding = False

    def check(self, held: bool):
        """The op a trace runs to check that the momentum is where it was traced for. What
        the step sends waits for it, so that a step that stops issues no collective: the other
        ranks, which stop alike, would wait for it, or meet it in the next step."""
        # A message of strings only: Assert then needs no cond around it (an If in the graph).
        return tf.debugging.Assert(tf.equal(self.held, held), [WRONG_TRACE])
