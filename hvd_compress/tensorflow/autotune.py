"""hvd_compress.autotune in the step's own ops. A traced step never returns to Python, so the
schedule, the probe's times and the decision live in variables, and the reducer's `enabled`
switch (the one CompressionScheduleCallback turns) carries each step's arm: an uncompressed
step is then the same as one the callback keeps uncompressed.

A step's time runs from the end of the previous step's reduction to the end of its own, not
from its first gradient as in torch: a graph has no hook at the first gradient, and a clock
read at the start of the reduction runs when the executor reaches it, which on a busy rank is
after much of backward. Keras' ResNet-50 (onebit, 2 ranks on 2 cores, loopback) then measured
compressed steps at 143 ms and uncompressed ones at 238 ms per rank and kept compression,
while its whole steps took 380 and 340 ms: encoding shares the cores with backward and
lengthens it, before such a clock. From the previous step's end, the window also holds that
step's update and this step's forward, the same in either arm.

The step's end is the end of every op its reduction made: the residual writes and the finite
check too, which no reduced gradient waits for. Read after the reduced gradients alone, the
clock left that work to the next step's window: at 10 Gbit/s the probe's uncompressed steps,
three in five of which follow a compressed one, measured 406-580 ms a rank where Horovod's
took 395, and most rows kept compression at 0.84-0.98x of Horovod's speed."""
from __future__ import annotations

import horovod.tensorflow as hvd
import tensorflow as tf

from ..autotune import MARGIN, WARMUP, Autotune, compressed_arm
from .codec import state_variable


class GraphAutotune:
    def __init__(self, probes: int, enabled: tf.Variable, process_set, clock=tf.timestamp):
        self.probes, self.enabled, self.process_set = probes, enabled, process_set
        self.clock = clock  # seconds as a float64 tensor; the tests pass a clock of their own
        self._first = None  # the step graph's op count at begin(): the reduction's ops follow
        # each step's arm, warm-up included
        self.arms = tf.constant([compressed_arm(i) for i in range(-WARMUP, 2 * probes)])
        self.step = state_variable(0, tf.int64, name="hvdc_autotune_step")
        self.times = state_variable(tf.zeros([2 * probes], tf.float64),
                                    name="hvdc_autotune_times")
        self.summed = state_variable(tf.zeros([2 * probes], tf.float64),
                                     name="hvdc_autotune_summed")
        self.decided = state_variable(False, name="hvdc_autotune_decided")
        self.ended = state_variable(0.0, tf.float64, name="hvdc_autotune_ended")

    def begin(self) -> None:
        """Before the step's first reduction: its arm into `enabled`."""
        self._first = None if tf.executing_eagerly() else len(_graph().get_operations())
        arm = tf.gather(self.arms, tf.minimum(self.step, WARMUP + 2 * self.probes - 1))
        tf.cond(self.decided, lambda: self.enabled.read_value(),
                lambda: self.enabled.assign(arm).read_value())

    def end(self, reduced: list, counted) -> None:
        """After the reductions; counted: every rank stepped (hvd_compress.autotune)."""
        done = [g.values if isinstance(g, tf.IndexedSlices) else g
                for g in reduced if g is not None]
        if self._first is not None:
            done += _graph().get_operations()[self._first:]
        with tf.control_dependencies(done):
            now = self.clock()

        def count():
            i = self.step - WARMUP
            tf.cond(i >= 0, lambda: self.times.scatter_nd_update(
                tf.reshape(i, [1, 1]), tf.reshape(now - self.ended, [1])).read_value(),
                lambda: self.times.read_value())
            due = tf.equal(self.step.assign_add(1), WARMUP + 2 * self.probes)
            return tf.cond(due, self._decide, lambda: tf.constant(False))
        tf.cond(tf.logical_and(counted, tf.logical_not(self.decided)), count,
                lambda: tf.constant(False))
        self.ended.assign(now)

    def _decide(self):
        ps = self.process_set
        summed = self.times.read_value()
        if ps.size() > 1:
            summed = hvd.allreduce(summed, op=hvd.Sum, process_set=ps,
                                   name="hvd_compress.autotune")
        self.summed.assign(summed)
        probed = self.arms[WARMUP:]
        pays = _median(tf.boolean_mask(summed, probed), self.probes) <= \
            (1 - MARGIN) * _median(tf.boolean_mask(summed, tf.logical_not(probed)), self.probes)
        self.enabled.assign(pays)
        self.decided.assign(True)
        return tf.constant(True)

    def report(self, read) -> dict:
        """As hvd_compress.autotune.Autotune.report(), from the variables (read: a variable's
        value, in a TF1 graph through its session)."""
        tune = Autotune(self.probes)
        if bool(read(self.decided)):
            tune.decide(read(self.summed).tolist())
        return tune.report()


def _graph():
    return tf.compat.v1.get_default_graph()


def _median(x, n: int):
    """statistics.median of n values: the middle one, or the mean of the two middle ones."""
    s = tf.sort(x)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
