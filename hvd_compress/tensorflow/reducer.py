"""The per-gradient reduction shared by DistributedGradientTape and the Keras optimizer: the
strategy hvd_compress.collectives chooses for each tensor (allreduce, allgather or the
compressed allreduce), its plan driven to the end at once with Horovod's TF collectives, state
keyed by variable name."""
from __future__ import annotations

import os
import re
import warnings
from typing import Any

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_util_v2

from .. import buckets, collectives, stats
from ..autotune import WARMUP, compressed_arm
from ..compressor import CompressorBase
from ..spec import (CompressionConfig, momentum_advice, parse_spec, sparse_momentum_error,
                    spec_momentum)
from ..state import StateStore
from ..stats import CompressionStats
from .autotune import GraphAutotune
from .codec import (DTYPE_NAMES, TFAdapter, TFCodec, concat_pieces, fields_step, flat_range,
                    split_pieces, state_variable, warmup_attrs)
from .handoff import MomentumHandoff
from .ops import lib
from .powersgd import PowerSGDReduction

DEFAULT_MIN_COMPRESS_BYTES = 65536
_OP_NAME = re.compile(r"[^A-Za-z0-9_.\-/]")
_OPS = {"sum": hvd.Sum, "max": hvd.Max}
# The traces of a step Reducer.next_trace names.
COMPRESSING, PROBE_UNCOMPRESSED, UNCOMPRESSED = "compressing", "probe-uncompressed", "uncompressed"


def parameter_name(var, index: int = 0) -> str:
    """A variable's name without the ':0' output suffix ("dense/kernel:0" -> "dense/kernel"). An
    eager tensor a tape watched has no name: it is known by its position among the sources."""
    try:
        name = var.name
    except AttributeError:
        return f"source_{index}"
    return name[:-2] if name.endswith(":0") else name


def check_unique(names: list[str]) -> None:
    """State is kept by name: two variables of one name (TF names an unnamed tf.Variable
    "Variable" every time) would share, and overwrite, one residual."""
    first: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in first:
            raise ValueError(
                f"the variables at positions {first[name]} and {i} share the name {name!r}: "
                f"hvd_compress keeps each one's compression state by name; give them distinct "
                f"names (tf.Variable(..., name=...)), or key them by position with "
                f"tape.gradient(..., use_generic_names=True)")
        first[name] = i


def in_plain_graph() -> bool:
    """TF1 graph mode: eager execution disabled and no tf.function being traced."""
    return not tf.executing_eagerly() and not tf.compat.v1.get_default_graph().building_function


def evaluate(make):
    """The numpy values of the tensors `make()` builds, now. In a TF1 graph, which has no value
    until a session runs it, they run in a private graph and session of their own (Horovod's
    collectives keep no state in a session, so every rank still meets the others)."""
    with tf.init_scope():
        if tf.executing_eagerly():
            return tf.nest.map_structure(lambda t: t.numpy(), make())
        with tf.Graph().as_default(), tf.compat.v1.Session() as session:
            return session.run(make())


def current(variable) -> np.ndarray:
    """A variable's value now: eagerly, or in a TF1 graph in the session that trains it (the
    default session, else Keras')."""
    with tf.init_scope():
        if tf.executing_eagerly():
            return variable.numpy()
    session = tf.compat.v1.get_default_session() or tf.compat.v1.keras.backend.get_session()
    return session.run(variable)


def to_config(compression: Any) -> CompressionConfig:
    if isinstance(compression, CompressorBase):
        return compression.config
    if compression is hvd.Compression.none:
        return parse_spec("none")
    if compression is hvd.Compression.fp16:
        return parse_spec("fp16")
    return parse_spec(compression)


def check_horovod_arguments(device_dense="", device_sparse="", gradient_predivide_factor=1.0,
                            num_groups=0, groups=None) -> None:
    """Horovod's tape and optimizer arguments that the compressed reduction cannot honour: they
    raise here rather than being dropped silently when the reduction replaces Horovod's."""
    if device_dense or device_sparse:
        raise ValueError("device_dense/device_sparse are not supported by hvd_compress: the codec "
                         "kernels run where the gradient is; leave them unset")
    if num_groups or groups is not None:
        raise ValueError("groups/num_groups are not supported by hvd_compress: each compressed "
                         "gradient is its own collective; leave them unset")
    if gradient_predivide_factor != 1.0:
        raise ValueError("gradient_predivide_factor is not supported by hvd_compress on "
                         "TensorFlow; leave it at 1.0 (op=hvd.Average averages after the sum)")


def pop_horovod_arguments(kwargs: dict) -> None:
    """Check, then remove, the arguments of Horovod's optimizers that the compressed reduction
    takes over (it replaces Horovod's, which would otherwise drop them silently)."""
    check_horovod_arguments(**{key: kwargs.pop(key) for key in (
        "device_dense", "device_sparse", "gradient_predivide_factor", "num_groups", "groups")
        if key in kwargs})


class Reducer:
    def __init__(self, config: CompressionConfig, min_compress_bytes: int, op, process_set,
                 sparse_as_dense: bool = False, bucket_bytes: int = 0):
        if op not in (hvd.Average, hvd.Sum):
            raise ValueError(f"op={op} is not supported with compression; valid: hvd.Average, "
                             f"hvd.Sum")
        if not isinstance(min_compress_bytes, int) or min_compress_bytes < 0:
            raise ValueError(f"min_compress_bytes must be an integer >= 0, got "
                             f"{min_compress_bytes!r}")
        self.config = config
        self.min_bytes = min_compress_bytes
        self.op = op
        self.process_set = process_set
        self.sparse_as_dense = sparse_as_dense
        # PowerSGD keeps its per-matrix batches (as in the torch frontend).
        self.bucket_bytes = bucket_bytes if config.info.rounds == 1 else 0
        if bucket_bytes and config.hierarchical:
            raise ValueError("bucket_mb is not supported with hierarchical=true yet: the "
                             "two-level strategy shards each gradient itself; pass bucket_mb=0")
        self._layouts: dict[tuple, list] = {}
        self.store = StateStore(TFAdapter(), spec=config.canonical())
        self.codec = TFCodec(config, self.store, rank=self._rank(), world=self._world())
        self.powersgd = self._powersgd(config)
        self.stats = CompressionStats()
        self.enabled = state_variable(True, name="hvdc_compression_enabled")
        # A traced step never returns to Python: steps are counted in the graph.
        self.steps = state_variable(0, tf.int64, name="hvdc_steps")
        # Dynamic loss scaling: where the gradients' scale is read (track_loss_scale), and the
        # scale the state in gradient units is kept at (0: none seen yet).
        self._loss_scale = None
        self.units = state_variable(0.0, tf.float64, name="hvdc_loss_scale_units")
        self._codec_ns = int(evaluate(lib.hvdc_codec_time))
        self._writer = None
        # name -> [sent bytes, wire bytes] of a variable-size payload, written by traced steps
        self._measured: dict[str, tf.Variable] = {}
        self._all_stepping = None  # this step's count of stepping ranks, once made
        # This step's gradients that went through a compressing arm (_either_arm), and
        # whether each arm's results were finite: where it compressed, or in either arm where
        # the step's state moves in every step (_verdict_in_both_arms).
        self._in_arms: set[str] = set()
        self._arms_finite: list = []
        self.autotune = self._autotune()
        self._settled = None  # autotune's decision as next_trace() read it: a trace's name
        self._trace = COMPRESSING  # what a step traced now holds (next_trace)
        # The optimizer that may hold the spec's momentum once settled uncompressed (attach),
        # and the (name, variable) pairs of the last traced step, whose momentum it would hold.
        self.handoff: MomentumHandoff | None = None
        self._named: list = []
        self._moved = False  # whether the step being traced leaves momentum to the optimizer
        self._checked: list = []  # the trace's check of that, which its collectives wait for
        self.nodes, self.groups = None, {None: process_set}
        self.gloo = hvd.gloo_enabled()
        if config.hierarchical:
            self.nodes, local, cross = node_process_sets(process_set)
            self.groups.update({collectives.LOCAL: local, collectives.CROSS: cross})

    def _rank(self) -> int:
        return self.process_set.rank() if self.process_set.included() else 0

    def _world(self) -> int:
        return self.process_set.size() if self.process_set.included() else 1

    def follow_world(self) -> bool:
        """After an elastic reset Horovod re-initializes with another rank and size: the codec
        takes them up (PowerSGD and the plans read them when traced, so any function traced
        before must be traced again). True when they changed."""
        if not self.process_set.included():
            return False
        rank, world = self._rank(), self._world()
        if (rank, world) == (self.codec.rank, self.codec.world):
            return False
        if self.nodes is not None:
            raise RuntimeError("hierarchical compression cannot follow an elastic resize: its "
                               "node process sets belong to the old world")
        self._give_momentum_back()
        self.codec = TFCodec(self.config, self.store, rank=rank, world=world)
        self.autotune = self._autotune()  # another job: measured again
        self._settled = None
        return True

    def _autotune(self) -> GraphAutotune | None:
        if not self.config.autotune or not self.process_set.included():
            return None
        return GraphAutotune(self.config.autotune, self.enabled, self.process_set)

    def next_trace(self, per_arm: bool = True) -> str:
        """Which trace of the step function the next step runs, for a caller that keeps one
        tf.function per answer and asks before each step (Keras: AutotuneCallback; a loop of
        your own: a dict of tf.functions keyed by the answer). A step traced then takes that
        shape:
        - COMPRESSING: both arms, `enabled` choosing between them; always, without autotune.
        - PROBE_UNCOMPRESSED: the probe's uncompressed steps (warm-up included): each
          gradient's Horovod allreduce after the spec's momentum, and the probe's clock.
        - UNCOMPRESSED: every step once autotune has settled on uncompressed steps, without
          the clock; COMPRESSING once it has settled on compression.
        At two ranks a graph that holds a compressing branch ran 4-9% slower than Horovod's,
        even where that branch never ran (docs/benchmarks.md, "Keras: what an uncompressed
        arm costs at two ranks"): with one trace for both arms, the probe's uncompressed steps
        paid that, tilting the decision toward compression, and a run settled on uncompressed
        steps went on paying it. Any trace gives correct gradients and state in any step: one
        run in the other arm's steps only misleads the probe. per_arm=False (one call runs
        several steps: Keras' steps_per_execution > 1): COMPRESSING until settled. Reads two
        variables a call until autotune has decided, none after.

        Settling on UNCOMPRESSED under a spec's momentum with a Keras SGD hands the momentum to
        the optimizer (tensorflow/handoff.py): a collective, in this call, on every rank alike.
        From then on only the UNCOMPRESSED trace may run, and traces made before that call
        stop with an error that says so."""
        tune, trace = self.autotune, COMPRESSING
        if tune is not None:
            if self._settled is None and bool(current(tune.decided)):
                self._settled = COMPRESSING if bool(current(self.enabled)) else UNCOMPRESSED
                if (self._settled == UNCOMPRESSED and self.handoff is not None
                        and self._loss_scale is None and self._named):
                    # Under loss scaling the velocity is in scaled units: it stays ours.
                    self.handoff.take(self.store, self._named)
            if self._settled is not None:
                trace = self._settled
            elif per_arm and not compressed_arm(
                    min(int(current(tune.step)), WARMUP + 2 * tune.probes - 1) - WARMUP):
                trace = PROBE_UNCOMPRESSED
        self._trace = trace
        return trace

    def _powersgd(self, config: CompressionConfig) -> PowerSGDReduction | None:
        """Two-round codecs run their own pipeline over all of a step's gradients."""
        if config.info.rounds != 2:
            return None
        return PowerSGDReduction(config, self.store, self.process_set,
                                 average=self.op == hvd.Average)

    # Nothing here branches on a tensor's value (tf.cond is explicit), and autograph would
    # otherwise transpile every function the plans call, seconds per trace.
    @tf.autograph.experimental.do_not_convert
    def reduce(self, grads, variables, names=None):
        """The reduced gradients of `variables`. State is keyed by `names`, by default the
        variables' names (Horovod's use_generic_names: positions)."""
        if not self.process_set.included():
            return list(grads)  # as Horovod: a rank outside the process set keeps its own
        if in_plain_graph():
            # A TF1 graph runs an assignment only if the train op depends on it: as a
            # tf.function, the step's state updates are ordered by automatic control
            # dependencies, as they are in every other mode.
            return tf.function(lambda g: self.reduce(g, variables, names),
                               autograph=False)(list(grads))
        if self.sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                     for g in grads]
        names = names or [parameter_name(v, i) for i, v in enumerate(variables)]
        check_unique(names)
        self._all_stepping = None
        self._in_arms, self._arms_finite = set(), []
        self.store.begin()
        trace = COMPRESSING if self.autotune is None else self._trace
        if self.handoff is not None:
            self._named = [(n, v) for g, n, v in zip(grads, names, variables) if g is not None]
            self._moved = trace == UNCOMPRESSED and self.handoff.holding
            self._checked = [self.handoff.check(self._moved)]
            with tf.control_dependencies(self._checked):
                grads = [None if g is None else tf.identity(g) for g in grads]
        probing = self.autotune is not None and trace != UNCOMPRESSED
        if probing:
            self.autotune.begin()
        try:
            units = self._rescale()
            if trace != COMPRESSING:
                reduced = [self._uncompressed(g, name) for g, name in zip(grads, names)]
            elif self.powersgd is not None:
                reduced = self._reduce_powersgd(grads, names)
            elif self.bucket_bytes and self.config.codec != "none":
                reduced = self._reduce_in_buckets(grads, variables, names)
            else:
                reduced = [self._reduce_one(g, name) for g, name in zip(grads, names)]
        except BaseException:
            self.store.rollback()
            raise
        self._end_step(reduced, names, units)
        if probing:
            self.autotune.end(reduced, self._no_rank_joined())
        self.steps.assign_add(1)
        if self._writer is not None:
            self._write_step(reduced, [n for g, n in zip(grads, names) if g is not None])
        return reduced

    def _gather_under_warmup(self, job) -> None:
        """A traced warm-up step's k is known to the ops only (warmup_attrs): the allgather
        sends whole payloads of that k, where the other strategies share k out between chunks
        when the plan is built."""
        cfg = self.config
        if cfg.collective != "auto" or cfg.hierarchical:
            raise ValueError(f"{cfg.codec} with warmup_steps in a traced step travels by "
                             f"allgather only (collective=auto or allgather, not hierarchical); "
                             f"run the warm-up eagerly for collective={cfg.collective}"
                             f"{', hierarchical' if cfg.hierarchical else ''}")
        job.strategy = collectives.ALLGATHER
        job.wire_bytes = collectives.wire_bytes(collectives.ALLGATHER, job.info, job.itemsize,
                                                collectives.whole(job), [], job.world)

    def track_loss_scale(self, source) -> None:
        """Gradients arrive multiplied by a dynamic loss scale: `source` (a Keras
        LossScaleOptimizer, a variable, or a callable returning the scale) is read at each
        step, and state in gradient units is rescaled when the scale has changed."""
        if hasattr(source, "loss_scale"):
            self._loss_scale = lambda: source.loss_scale
        elif callable(source):
            self._loss_scale = source
        elif isinstance(source, tf.Variable):
            self._loss_scale = source.read_value
        else:
            raise ValueError(f"track_loss_scale takes a LossScaleOptimizer, a variable or a "
                             f"callable, got {type(source).__name__}")

    def _rescale(self):
        """State kept at another loss scale than this step's gradients carry, multiplied by
        the ratio (the torch frontend's StateStore.rescale, with the scale a tensor). Returns
        the scale the state was at, for a rollback, or None without loss scaling."""
        if self._loss_scale is None:
            return None
        scale = tf.cast(self._loss_scale(), tf.float64)
        before = self.units.read_value()
        factor = tf.where(before > 0, scale / tf.where(before > 0, before, 1.0),
                          tf.constant(1.0, tf.float64))
        # touched (backed up) outside the branch, so that a rollback has what it restores
        slots = self.store.touch_scaled(self.config.info.scale_free_slots)

        def multiply():
            for t in slots:
                t.assign(t * tf.cast(factor, t.dtype))
            return tf.constant(True)

        if slots:
            tf.cond(tf.not_equal(factor, 1.0), multiply, lambda: tf.constant(False))
        self.units.assign(scale)
        return before

    def _end_step(self, reduced, names, units=None) -> None:
        """The step's state stays unless a reduced gradient is not finite: then every slot and
        counter it touched is put back (all ranks hold the same reduced gradients, so all
        decide alike), as a skipped step must leave no trace. A step where a rank is joined
        touches none."""
        store = self.store
        if not store.touched():
            store.commit()
            return
        # What the compressing branch touched was backed up only where it ran (state.py).
        ran = (tf.logical_and(self.enabled, self._no_rank_joined())
               if store.touched_in_branches() else None)

        def roll_back():
            store.rollback(ran)
            if units is not None:
                self.units.assign(units)
            return tf.constant(False)

        def check(flags, grads):
            finite = tf.reduce_all(tf.stack(flags + [_all_finite(grads)]))
            return tf.cond(finite, lambda: tf.constant(True), roll_back)

        rest = [g for g, name in zip(reduced, names) if name not in self._in_arms]
        if units is None and store.touched_only_in_branches():
            # A step that did not compress changed no state: the check, 16 ms a step over
            # ResNet-50's gradients on one thread, would guard nothing. Run as a call, as a
            # compressing arm: lowered, its 214 checks and the rollback's writes were walked
            # as dead in each uncompressed step. It takes the compressing arms' own verdicts,
            # not their gradients: a call holds every input until it runs, and 102 MB of
            # gradients held to the end of the step made Keras' ResNet-50 step (one rank,
            # one thread) 8-10% slower with an EF codec's arm off than without the check.
            with tf.name_scope("finite_check"):
                _run_as_a_call([tf.cond(ran, lambda: check(self._arms_finite, rest),
                                        lambda: tf.constant(True))])
        elif self._verdict_in_both_arms():
            check(self._arms_finite, rest)
        else:
            check([], reduced)
        store.commit()

    def refresh_stats(self) -> CompressionStats:
        """The statistics, with the last traced step's bytes of variable-size payloads."""
        for name, measured in self._measured.items():
            sent, wire = current(measured).tolist()
            t = self.stats.tensors[name]
            t.sent_bytes, t.wire_bytes = int(sent), wire
        return self.stats

    def compression_report(self) -> dict:
        """Bytes per step, ratio and codec-kernel time since this reducer was built, with the
        per-tensor statistics (what `python -m hvd_compress` prints and writes). In a TF1
        graph the variables are read in the default session, else in Keras'."""
        self.refresh_stats()
        rep = stats.report(self.stats, str(self.config), int(current(self.steps)),
                           int(evaluate(lib.hvdc_codec_time)) - self._codec_ns,
                           compressing=bool(current(self.enabled)))
        if self.autotune is not None:
            rep["autotune"] = self.autotune.report(current)
        return rep

    def write_compression_summaries(self, logdir: str) -> None:
        """Write each step's statistics (hvd_compress.stats.SCALARS) as TensorBoard scalars to
        `logdir`, from the next trace or eager step on (the summary ops are part of the step).
        Call it on one rank: every rank would write the same files."""
        with tf.init_scope():
            self._writer = tf.summary.create_file_writer(logdir)
            self._writer_ns = state_variable(lib.hvdc_codec_time, name="hvdc_summary_codec_ns")

    def _write_step(self, reduced, names):
        tensors = [self.stats.tensors[n] for n in names if n in self.stats.tensors]
        raw = tf.constant(sum(t.raw_bytes for t in tensors), tf.float64)
        known = [t for n, t in zip(names, tensors) if n not in self._measured]
        sent = tf.constant(sum(t.sent_bytes for t in known), tf.float64)
        for n in names:
            if n in self._measured:
                sent += self._measured[n][0]
        sent = tf.where(self.enabled, sent, raw)
        # The clock is read once this step's codec ops have run.
        with tf.control_dependencies([t for t in reduced if isinstance(t, tf.Tensor)]):
            now = lib.hvdc_codec_time()
        spent = tf.cast(now - self._writer_ns, tf.float64) / 1e6
        with tf.control_dependencies([spent]):
            self._writer_ns.assign(now)
        with self._writer.as_default(step=self.steps):
            for tag, value in zip(stats.SCALARS, (raw, sent, raw / sent, spent)):
                tf.summary.scalar(tag, value)
        # Flushed every step: a run that ends without closing the writer keeps its last steps.
        self._writer.flush()

    def set_config(self, config: CompressionConfig) -> None:
        """Switch codec or parameters (a warm-up schedule). Residuals, momentum and step counters
        carry over by name; callers retrace any tf.function that reduces gradients."""
        if config.autotune or self.config.autotune:
            raise ValueError("set_config switches codecs on a schedule, and autotune decides "
                             "when to compress: use one of them")
        self.codec.settle()
        self.config = config
        self.codec = TFCodec(config, self.store, rank=self._rank(), world=self._world())
        self.powersgd = self._powersgd(config)
        self.store.spec = config.canonical()

    def _plain(self, grad, opname):
        if isinstance(grad, tf.IndexedSlices) or grad.dtype != tf.bfloat16:
            return hvd.allreduce(grad, op=self.op, name=opname, process_set=self.process_set)
        # Horovod 0.28.1 has no bfloat16 allreduce: as float32 (exact), rounded back once.
        return tf.cast(hvd.allreduce(tf.cast(grad, tf.float32), op=self.op, name=opname,
                                     process_set=self.process_set), tf.bfloat16)

    def _perform(self, request):
        """One collective a plan asks for. A graph runs Horovod's ops asynchronously itself, so
        the plan resumes at once with the symbolic result."""
        ps = self.groups[request.group]
        if isinstance(request, collectives.Allreduce):
            t = request.tensor
            if t.dtype == tf.bfloat16:  # no bfloat16 in Horovod's allreduce: float32, exact
                t = tf.cast(t, tf.float32)
            return hvd.allreduce(t, op=_OPS[request.op], name=request.name, process_set=ps)
        if isinstance(request, collectives.Allgather):
            # As [1, bytes] rows, Horovod refuses ranks whose payload sizes differ.
            t = tf.reshape(request.tensor, [1, -1]) if request.rows else request.tensor
            return hvd.allgather(t, name=request.name, process_set=ps)
        # Variable-size payloads (threshold) have sizes known only in the graph.
        splits = tf.stack([tf.cast(s, tf.int32) for s in request.splits])
        received, _ = hvd.alltoall(request.tensor, splits=splits, name=request.name,
                                   process_set=ps)
        return received

    def _kept_plain(self, grad, name: str) -> bool:
        """Whether the gradient travels uncompressed whatever the codec (recorded so)."""
        nbytes = (grad.shape.num_elements() or 0) * grad.dtype.size
        if (isinstance(grad, tf.IndexedSlices) or self.config.codec == "none"
                or grad.dtype not in DTYPE_NAMES or grad.shape.num_elements() is None
                or nbytes < self.min_bytes or grad.shape.rank < self.codec.info.min_dim):
            if not isinstance(grad, tf.IndexedSlices):
                self._record_plain(name, grad)
            return True
        return False

    def _record_plain(self, name: str, grad) -> None:
        nbytes = grad.shape.num_elements() * grad.dtype.size
        self.stats.record(name, "none", nbytes, nbytes, collectives.ALLREDUCE,
                          _ring_allreduce_bytes(nbytes, self.process_set.size()))

    def _reduce_powersgd(self, grads, names) -> list:
        out, items = [None] * len(grads), []
        for i, (grad, name) in enumerate(zip(grads, names)):
            if grad is None:
                continue
            opname = "hvdc." + _OP_NAME.sub("_", name)
            if self._kept_plain(grad, name):
                out[i] = self._plain(self._plain_momentum(grad, name), opname)
            else:
                items.append((name, opname, grad))
        if not items:
            return out
        # The spec's momentum goes before PowerSGD's error feedback, and with its plain
        # allreduce before start_iter and while compression is off.
        taken = spec_momentum(self.config)
        off = [self._plain_momentum(grad, name, off_only=True) for name, _, grad in items]

        def record(name, grad, sent_elements):
            if sent_elements is None:
                self._record_plain(name, grad)
                return
            nbytes = grad.shape.num_elements() * grad.dtype.size
            sent = sent_elements * (8 if grad.dtype == tf.float64 else 4)
            self.stats.record(name, "powersgd", nbytes, sent, collectives.ALLREDUCE,
                              _ring_allreduce_bytes(sent, self.process_set.size()))

        # CompressionScheduleCallback flips `enabled`, and hvd.join() leaves ranks out of the
        # step; every rank takes the same branch.
        def compressed():
            moved = [(name, opname, self.codec.plain_momentum(name, grad) if taken else grad)
                     for name, opname, grad in items]
            return self._by_name(self.powersgd.reduce(moved, self._plain, record), moved)

        reduced = self._either_arm(
            [name for name, _, _ in items], compressed,
            lambda: [self._plain(g, opname + ".off") for (_, opname, _), g in zip(items, off)],
            [grad.dtype for _, _, grad in items])
        reduced = [tf.reshape(g, tf.shape(grad)) for g, (_, _, grad) in zip(reduced, items)]
        position = {name: i for i, name in enumerate(names)}
        for (name, _, _), g in zip(items, reduced):
            out[position[name]] = g
        return out

    @staticmethod
    def _by_name(reduced: dict, items: list) -> list:
        return [reduced[name] for name, _, _ in items]

    def _layout(self, variables, names) -> list:
        """hvd_compress.buckets.layout over the variables this reducer compresses, in the
        reverse of their order (backward's), as the torch frontend lays out its parameters."""
        key = tuple(names)
        if key not in self._layouts:
            order = [(name, v.shape.num_elements(), DTYPE_NAMES[v.dtype.base_dtype],
                      v.dtype.size)
                     for v, name in reversed(list(zip(variables, names)))
                     if v.dtype.base_dtype in DTYPE_NAMES and v.shape.is_fully_defined()
                     and v.shape.rank >= self.codec.info.min_dim]
            self._layouts[key] = buckets.layout(order, self.bucket_bytes, self.min_bytes)
        return self._layouts[key]

    def _reduce_in_buckets(self, grads, variables, names) -> list:
        """Each bucket's dense gradients as one tensor through _reduce_bucket, with its members'
        state (TFCodec.view); a member without a dense gradient (None, IndexedSlices) is left
        out of its bucket, as on every rank, and reduced alone."""
        layout = self._layout(variables, names)
        dense = {name: g for g, name in zip(grads, names)
                 if g is not None and not isinstance(g, tf.IndexedSlices)}
        inside = {m.name for b in layout for m in b.members}
        steps = self._member_steps([n for n in dense if n in inside])
        off = ({n: self._plain_momentum(g, n, off_only=True) for n, g in dense.items()
                if n in inside} if spec_momentum(self.config) is not None else None)
        # (bucket name, its members present in this step). A bucket that some members miss
        # is compressed without them, however small, as the torch frontend sends it: the
        # layout kept it for its full size, and sent plain it would need momentum of its own.
        plan = [(bucket.named(present), present) for bucket in layout
                for present in [[m for m in bucket.members if m.name in dense]] if present]
        whole = self._sent_whole(plan)
        pieces: dict[str, list] = {}
        for name, present in plan:
            self.codec.view(name, [(m.name, dense[m.name], m.start, m.stop) for m in present])
            reduced = self._reduce_bucket(name, present, dense, off or dense,
                                          steps.get(present[0].name), whole)
            for m, piece in zip(present, reduced):
                pieces.setdefault(m.name, []).append(piece)
        out = []
        for g, name in zip(grads, names):
            if name not in pieces:
                out.append(self._reduce_one(g, name))
            elif name in whole:  # whole in its last bucket's output while compression is off
                out.append(tf.reshape(tf.cond(
                    tf.logical_and(self.enabled, self._no_rank_joined()),
                    lambda got=pieces[name]: tf.concat(got, 0), lambda got=pieces[name]: got[-1]),
                    g.shape))
            else:
                out.append(tf.reshape(concat_pieces(pieces[name]), g.shape))
        return out

    @staticmethod
    def _sent_whole(plan: list) -> dict:
        """Parameter -> the bucket that sends it whole while compression is off: each one cut
        between buckets that compress, in the last of them. Sent piece by piece, ResNet-50's
        five tensors over 4 MiB (11M of its 25.6M elements) would be sliced and joined again
        in every uncompressed step."""
        holders: dict[str, list] = {}
        for name, present in plan:
            for m in present:
                holders.setdefault(m.name, []).append(name)
        return {param: held[-1] for param, held in holders.items() if len(held) > 1}

    def _counted(self) -> bool:
        """Only codecs that read the step keep a counter variable: seeded ones (and the
        homomorphic strategy, which rounds stochastically whatever the codec), and those whose
        kernel fields change with the step (DGC's warm-up)."""
        info = self.codec.info
        return (info.uses_seed or collectives.HOMOMORPHIC in info.strategies
                or self.config.stepwise)

    def _member_steps(self, names: list) -> dict:
        """Each bucketed parameter's counter, advanced once per step however many buckets hold
        its pieces, and only in a step that compresses (as _reduce_one advances its own). All
        in one cond, run as a call: a cond per member put 214 more conds in each of ResNet-50's
        uncompressed steps."""
        if not self._counted() or not names:
            return {}
        active = tf.logical_and(self.enabled, self._no_rank_joined())
        steps = tf.cond(active, lambda: [self.store.next_step(n) for n in names],
                        lambda: [tf.constant(0, tf.int64) for _ in names])
        _run_as_a_call(steps)
        return dict(zip(names, steps))

    def _reduce_bucket(self, name: str, present: list, dense: dict, off: dict, step,
                       whole: dict) -> list:
        """A bucket's members reduced, each as a flat piece. Compressed, the bucket travels as
        one tensor. While compression is off, each member (`off`: with the spec's momentum) goes
        to Horovod's allreduce as it is, for Horovod to fuse, as its own optimizer sends them,
        a member cut between buckets whole in the one `whole` names (an empty piece in the
        others): the bucket is built only in the branch that compresses, since a tensor made
        outside a tf.cond is made whichever branch runs. Keras' ResNet-50 with compression off
        (2 ranks on 2 cores, loopback) took 370-413 ms a step while each bucket was
        concatenated, sent whole and split again (and the ranks counted), 330-343 ms with each
        piece sent alone; Horovod's own optimizer 325-348 ms."""
        opname = "hvdc." + _OP_NAME.sub("_", name)
        sizes = [m.n for m in present]

        members = tuple((m.name, m.n) for m in present)

        def compressed():
            flat = concat_pieces([flat_range(dense[m.name], m.start, m.stop) for m in present])
            return split_pieces(self._compressed(flat, name, opname, step, members), sizes)

        def plain():
            out = []
            for i, m in enumerate(present):
                if m.name not in whole:
                    out.append(self._plain(flat_range(off[m.name], m.start, m.stop),
                                           f"{opname}.{i}.plain"))
                elif whole[m.name] == name:
                    out.append(tf.reshape(self._plain(
                        off[m.name], "hvdc." + _OP_NAME.sub("_", m.name) + ".plain"), [-1]))
                else:
                    out.append(tf.zeros([0], off[m.name].dtype))
            return out
        # Each arm in a cond of its own: TF runs a cond that writes a variable after every
        # earlier op that uses it, and a member cut between buckets has its residual written in
        # both buckets' compressing branches. One cond for both arms made each bucket's
        # uncompressed allreduces wait until the previous bucket's had completed.
        return self._either_arm([m.name for m in present], compressed, plain,
                                [dense[m.name].dtype for m in present])

    def _either_arm(self, names: list, compressed, plain, dtypes: list) -> list:
        """compressed() in a step that compresses, else plain(): the gradients of `names` as
        lists of tensors of `dtypes`. Each arm in a cond of its own (_reduce_bucket says why):
        the compressing one run as a call, the uncompressed one lowered, touching no state, so
        that each tensor goes to Horovod as soon as it is ready. Where compressing, the second
        cond passes the first's results on, and the first tells _end_step whether they are
        finite."""
        active = tf.logical_and(self.enabled, self._no_rank_joined())
        traced = not tf.executing_eagerly()  # eagerly, _end_step checks every gradient

        def compressing():
            out = compressed()
            return out + [_all_finite(out) if traced else tf.constant(True)]
        done = tf.cond(active, compressing,
                       lambda: [tf.zeros([0], d) for d in dtypes] + [tf.constant(True)])
        _run_as_a_call(done)
        self._in_arms.update(names)
        if not self._verdict_in_both_arms():
            self._arms_finite.append(done[-1])
            return tf.cond(active, lambda: done[:-1], plain)

        def sent_plain():
            out = plain()
            return out + [_all_finite(out)]
        reduced = tf.cond(active, lambda: done, sent_plain)
        self._arms_finite.append(reduced[-1])
        return reduced[:-1]

    def _verdict_in_both_arms(self) -> bool:
        """Whether the uncompressed arm also says whether its results are finite: in a traced
        step whose state moves in uncompressed steps too (the spec's momentum, a loss scale),
        so that the step's check is made in each step. Checked over the reduced gradients
        instead, the check held all of them until backward's last one had been reduced (DGC's
        arm on Keras' ResNet-50, one rank: 1.25x Horovod's step, 1.22x without)."""
        return not tf.executing_eagerly() and (spec_momentum(self.config) is not None
                                               or self._loss_scale is not None)

    def _reduce_one(self, grad, name: str):
        """A gradient alone: compressed, or (compression off, a rank joined) Horovod's."""
        if grad is None:
            return None
        opname = "hvdc." + _OP_NAME.sub("_", name)
        if self._kept_plain(grad, name):
            return self._plain(self._plain_momentum(grad, name), opname)
        off = self._plain_momentum(grad, name, off_only=True)
        # CompressionScheduleCallback flips `enabled`, and hvd.join() leaves ranks out of the
        # step; every rank takes the same branch.
        reduced = self._either_arm([name], lambda: [self._compressed(grad, name, opname)],
                                   lambda: [self._plain(off, opname + ".plain")], [grad.dtype])
        return tf.reshape(reduced[0], tf.shape(grad))

    def _uncompressed(self, grad, name: str):
        """A gradient in a trace of uncompressed steps (next_trace): as a step with `enabled`
        off sends it, with no cond around it."""
        if grad is None:
            return None
        opname = "hvdc." + _OP_NAME.sub("_", name)
        if not self._kept_plain(grad, name):
            opname += ".plain"
        return self._plain(grad if self._moved else self._plain_momentum(grad, name), opname)

    def _compressed(self, grad, name: str, opname: str, step=None, members: tuple = ()):
        """`members`: a bucket's, as collectives.Job takes them; empty for a gradient alone.
        `step`: a bucket's counter (its first member's); a gradient alone advances its own."""
        nbytes = (grad.shape.num_elements() or 0) * grad.dtype.size
        info, ps = self.codec.info, self.process_set
        if step is None:
            step = self.store.next_step(name) if self._counted() else tf.constant(0, tf.int64)
        job = collectives.Job(name=name, n=grad.shape.num_elements(),
                              itemsize=grad.dtype.size, config=self.config,
                              rank=self._rank(), world=ps.size(),
                              average=self.op == hvd.Average, opname=opname,
                              step=step, fields_step=fields_step(self.config, step),
                              nodes=self.nodes, gloo=self.gloo, extra={"grad": grad},
                              members=members)
        collectives.choose(job)
        if warmup_attrs(self.config) and job.strategy != collectives.ALLGATHER:
            self._gather_under_warmup(job)
        capacity = job.wire_bytes
        reduced = collectives.run_now(collectives.plan(job, self.codec), self._perform)
        sent, wire = job.payload_bytes, job.wire_bytes
        if isinstance(sent, tf.Tensor):
            # Variable-size payloads: the bytes of this step where it runs eagerly; a traced
            # step writes them to a variable that refresh_stats() reads, and is recorded by
            # the capacity the cost model counts until then.
            if tf.executing_eagerly():
                sent, wire = int(sent), float(wire)
            else:
                if name not in self._measured:
                    self._measured[name] = state_variable(lambda: tf.zeros([2], tf.float64))
                self._measured[name].assign(tf.stack([tf.cast(sent, tf.float64),
                                                      tf.cast(wire, tf.float64)]))
                sent = info.payload_bytes(job.itemsize, job.n,
                                          collectives.whole(job).field_dict)
                wire = capacity
        self.stats.record(name, info.name, nbytes, sent, job.strategy, wire)
        return reduced

    def _plain_momentum(self, grad, name: str, off_only: bool = False):
        """grad with the spec's momentum where it travels uncompressed. The optimizer's own
        momentum is 0 under such a spec, so steps that CompressionScheduleCallback keeps
        uncompressed take it too; a step where a rank is joined touches no state. off_only:
        only while compression is off, for a gradient whose codec applies the momentum when
        compressing."""
        taken = spec_momentum(self.config)
        if taken is None or grad.dtype not in DTYPE_NAMES:
            return grad
        if isinstance(grad, tf.IndexedSlices):
            raise ValueError(sparse_momentum_error(self.config, name))
        # Touched here, the slot's backup for a rolled-back step is taken outside the branch.
        self.store.slot(name, taken[2], grad)
        when = self._no_rank_joined()
        if off_only:
            when = tf.logical_and(tf.logical_not(self.enabled), when)
        return tf.cond(when, lambda: self.codec.plain_momentum(name, grad), lambda: grad)

    def _no_rank_joined(self):
        """Whether every rank of the set takes part in this step: none waits in hvd.join().

        A joined rank takes part in allreduces only, adding zeros: Horovod refuses allgather
        and alltoall once a rank has joined (the others hang or raise), and a joined rank's
        zeros would corrupt the homomorphic sum (code 0 is the lowest level, not zero). So
        each stepping rank counts itself once per step, by an allreduce of a one; every rank
        gets the same count and takes the same branch. While a rank is joined, compressed
        gradients go by Horovod's plain allreduce, as Horovod's own optimizer sends them, and
        no compression state is read or written, step counters included: the joined rank's
        state cannot move, and seeds drawn from the counters must still agree between ranks
        when all of them step again."""
        if self._all_stepping is None:
            ps = self.process_set
            self._all_stepping = tf.constant(True)
            if ps.size() > 1:
                # A one read from a variable: Horovod's ops are not stateful, so in a
                # tf.function grappler would fold an allreduce of a constant into the count of
                # the trace's first run.
                with tf.control_dependencies(self._checked):
                    one = tf.cast(tf.not_equal(tf.reshape(self.steps, [1]), -1), tf.int32)

                def count():
                    ones = hvd.allreduce(one, op=hvd.Sum, process_set=ps,
                                         name="hvdc.stepping_ranks")
                    return tf.equal(ones[0], ps.size())
                needed = self._count_needed()
                self._all_stepping = (count() if needed is None else
                                      tf.cond(needed, count, lambda: tf.constant(True)))
        return self._all_stepping

    def _count_needed(self):
        """Whether this step counts its stepping ranks (None: always). Settled on uncompressed
        steps (`enabled` off, autotune decided), a spec without momentum reads and writes no
        state, and every gradient goes to Horovod's allreduce, where a joined rank adds zeros
        as it does under Horovod's optimizer: the count would be one more collective each step,
        for no branch to read. Every rank agrees on `enabled`: the schedule and autotune's
        decision are the same on all."""
        if spec_momentum(self.config) is not None:
            return None
        needed = self.enabled.read_value()
        if self.autotune is not None:
            needed = tf.logical_or(needed, tf.logical_not(self.autotune.decided))
        return needed

    def _give_momentum_back(self) -> None:
        """The optimizer's momentum as the spec's velocity again (another world measures
        autotune anew)."""
        if self.handoff is not None and self.handoff.holding:
            self.handoff.write_back(self.store, self._named)
            self.handoff.release()

    def state_dict(self) -> dict:
        self.codec.settle()
        if self.handoff is not None and self.handoff.holding:
            # the velocity the optimizer holds, as every frontend keeps it
            self.handoff.write_back(self.store, self._named)
        state = self.store.state_dict()
        units = float(self.units.numpy())
        state["loss_scale"] = units if units > 0 else None
        return state

    def load_state_dict(self, state: dict, strict_spec: bool = True) -> None:
        if self.handoff is not None and self.handoff.holding:
            # The loaded velocity is the momentum now: handed over again by the next
            # next_trace(), which reads the decision anew.
            self.handoff.release()
            self._settled = None
        self.store.load_state_dict(state, strict_spec=strict_spec)
        self.units.assign(state.get("loss_scale") or 0.0)


_node_sets: dict[tuple, object] = {}


def _all_finite(grads: list):
    """Whether every element of `grads` is finite: our kernel's one read of each tensor, where
    IsFinite and All wrote and read a bool per element (Keras' ResNet-50, one thread: 12.2 ms a
    step, 8.9 ms as the kernel). A check per tensor, so that each runs when its tensor is ready
    and none is held for the others."""
    checks = []
    for g in grads:
        if g is None:
            continue
        x = g.values if isinstance(g, tf.IndexedSlices) else g
        checks.append(lib.hvdc_all_finite([x]) if x.dtype in DTYPE_NAMES
                      else tf.reduce_all(tf.math.is_finite(x)))
    return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)


def _run_as_a_call(outputs: list) -> None:
    """The traced tf.cond that made `outputs` kept as one If op, which runs only the branch it
    takes, where TF would lower it to switches that walk every op of the branch not taken as
    dead: a compressing branch has thousands (efsignsgd's over ResNet-50: 5181), walked in each
    uncompressed step. The cond waits for all its inputs, which compressing reads anyway."""
    if tf.executing_eagerly():
        return
    op = outputs[0].op
    while op.type not in ("If", "StatelessIf"):
        op = op.inputs[0].op
    control_flow_util_v2.maybe_set_lowering_attr(op, lower_using_switch_merge=False)


def node_process_sets(process_set):
    """The two-level strategy's process sets (collectives.node_groups), registered once per job
    as Horovod dynamic process sets, every rank registering every set in the same order."""
    collectives.check_node_sets_possible(process_set is hvd.global_process_set)
    mine = [hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()]
    layout = evaluate(lambda: hvd.allgather(tf.constant([mine], tf.int32),
                                            name="hvdc.node_layout")).tolist()
    return collectives.register_node_sets(layout, hvd.rank(), hvd.add_process_set,
                                          hvd.global_process_set, _node_sets)


def _ring_allreduce_bytes(nbytes: int, world: int) -> float:
    return 2.0 * (world - 1) / world * nbytes


def new_reducer(compression: Any, min_compress_bytes: int, op, process_set,
                sparse_as_dense: bool = False, bucket_mb: float | None = None) -> Reducer:
    config = to_config(compression)
    max_bytes = buckets.bucket_bytes(bucket_mb, config)
    reducer = Reducer(config, min_compress_bytes, op, process_set, sparse_as_dense, max_bytes)
    if process_set.included() and process_set.size() > 1:
        check_ranks_agree(config, min_compress_bytes, process_set, max_bytes)
    return reducer


def optimizer_momentum(optimizer) -> tuple[str | None, float]:
    """(attribute, value) of an optimizer's own momentum (Keras: `momentum`, a number or, once
    its hyperparameters are made, a variable; tf.compat.v1's MomentumOptimizer: `_momentum`),
    or (None, 0.0) without one."""
    for attr in ("momentum", "_momentum"):
        value = getattr(optimizer, attr, None)
        if isinstance(value, (tf.Variable, tf.Tensor)):
            value = tf.keras.backend.get_value(value)  # in a TF1 graph, through Keras' session
        if isinstance(value, (int, float, np.floating, np.integer)):
            return attr, float(value)
    return None, 0.0


def warn_about_momentum(optimizer, config: CompressionConfig) -> None:
    """The optimizer's own momentum around the codec: spec.momentum_advice's warning when the
    two train badly together, then drop_optimizer_momentum."""
    advice = momentum_advice(config, optimizer_momentum(optimizer)[1])
    if advice:
        warnings.warn(advice)
    drop_optimizer_momentum(optimizer, config)


def drop_optimizer_momentum(optimizer, config: CompressionConfig) -> None:
    """A codec that applies momentum itself (DGC's momentum correction) or momentum=nesterov
    would have it applied twice by an optimizer with its own: that one is set to 0 with a
    warning, as the torch optimizer does."""
    if not (config.momentum == "nesterov" or config.info.replaces_momentum):
        return
    what = config.codec if config.info.replaces_momentum else "momentum=nesterov"
    attr, value = optimizer_momentum(optimizer)
    if value:
        warnings.warn(f"{what} in the compression spec replaces the optimizer's own "
                      f"momentum ({value}); setting it to 0")
        setattr(optimizer, attr, 0.0)


def attach(opt, reducer: Reducer):
    """Make a Horovod-wrapped optimizer reduce through `reducer`: Horovod's optimizers call
    self._allreduce_grads(grads, vars) for the whole reduction."""
    opt._allreduce_grads = reducer.reduce
    helper = getattr(opt, "_agg_helper", None)
    if helper is not None:  # backward_passes_per_step > 1: it holds the function it was given
        if not hasattr(helper, "allreduce_grads"):
            raise ValueError("backward_passes_per_step > 1 with compression needs the optimizer "
                             "built eagerly (TF2 behaviour), not in a TF1 graph")
        helper.allreduce_grads = reducer.reduce
    opt._hvdc_reducer = reducer
    if MomentumHandoff.possible(opt, reducer.config):
        reducer.handoff = MomentumHandoff(opt, reducer.config, reducer.op, reducer.process_set)
    opt.compression_report = reducer.compression_report
    opt.compression_next_trace = reducer.next_trace
    opt.write_compression_summaries = reducer.write_compression_summaries
    opt.compression_state_dict = reducer.state_dict
    opt.load_compression_state_dict = reducer.load_state_dict
    opt.compression_stats = reducer.stats
    return opt


_reducers: dict[tuple, Reducer] = {}


def reducer_for(compression: Any, min_compress_bytes: int, op, process_set,
                sparse_as_dense: bool = False, bucket_mb: float | None = None) -> Reducer:
    """One reducer, and so one state store, per configuration: a tape built anew every step
    finds the state of the steps before."""
    config = to_config(compression)
    max_bytes = buckets.bucket_bytes(bucket_mb, config)
    key = (config, min_compress_bytes, op, process_set.process_set_id, sparse_as_dense,
           max_bytes)
    if key not in _reducers:
        _reducers[key] = Reducer(config, min_compress_bytes, op, process_set, sparse_as_dense,
                                 max_bytes)
        if process_set.included() and process_set.size() > 1:
            check_ranks_agree(config, min_compress_bytes, process_set, max_bytes)
    return _reducers[key]


def check_ranks_agree(config: CompressionConfig, min_bytes: int, process_set,
                      max_bucket_bytes: int = 0) -> None:
    # Under elastic Horovod a worker that joins builds its optimizer while the others wait in
    # the reset's sync: no collective may run here, and the sync checks the spec instead
    # (hvd_compress.tensorflow.elastic).
    if os.environ.get("HOROVOD_ELASTIC") == "1":
        return
    # The same string as the torch frontend's, so that the two say the same.
    mine = (f"{config.canonical()};min_compress_bytes={min_bytes};"
            f"bucket_bytes={max_bucket_bytes}").encode()
    blob, sizes = evaluate(lambda: (
        hvd.allgather(tf.constant(list(mine), dtype=tf.uint8), name="hvdc.spec_check",
                      process_set=process_set),
        hvd.allgather(tf.constant([len(mine)], tf.int64), name="hvdc.spec_check.sizes",
                      process_set=process_set)))
    theirs = [bytes(b.tolist()).decode() for b in np.split(blob, np.cumsum(sizes)[:-1])]
    if len(set(theirs)) > 1:
        detail = "; ".join(f"rank {r}: {s}" for r, s in enumerate(theirs))
        raise ValueError(f"ranks disagree on the compression spec ({detail}); every rank must "
                         f"pass the same compression, min_compress_bytes and bucket_mb")
