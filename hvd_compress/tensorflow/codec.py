"""One codec bound to TensorFlow tensors: the same steps as hvd_compress.torch.codec, on the
same kernels (as TF ops), for the stock-protocol compressors (encode/decode) and for the
reduction plans of hvd_compress.collectives (the `Ops` methods below). State lives in
tf.Variables created outside any tf.function (init_scope), so compress/decompress trace once
and keep updating state on every call.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf

from ..collectives import (ALLREDUCE, Job, Part, carry_kind, carry_parts, chunk_bounds,
                           part_bounds)
from ..registry import CodecInfo
from ..seeds import seed_base, seed_name
from ..spec import CompressionConfig, masks_momentum, spec_momentum
from ..state import StateStore
from .ops import lib

DTYPE_NAMES = {tf.float32: "float32", tf.float16: "float16", tf.bfloat16: "bfloat16",
               tf.float64: "float64"}


def state_variable(initial, dtype=None, name=None) -> tf.Variable:
    """A variable of the compression state, made outside any trace from `initial` (a value, or
    a function making the value there). In a TF1 graph it is also made known to Keras, whose
    session initialises only the variables it tracks (a user's own session initialises it with
    the global variables).

    Not lifted: a tf.function whose first trace lifts a variable traces the function a second
    time, and this one is already made eagerly, with its value, so one trace is enough."""
    with tf.init_scope():
        v = tf.Variable(initial() if callable(initial) else initial, dtype=dtype,
                        trainable=False, name=name, experimental_enable_variable_lifting=False)
        tf.keras.__internal__.backend.track_variable(v)
    return v


def _signed64(u: int) -> int:
    return u - (1 << 64) if u >= (1 << 63) else u


# Kernel fields the kernels take as doubles: TF's float attributes are 32-bit, so the ops take
# their IEEE-754 bits (csrc/tensorflow/ops.cc read_params), and float64 gradients see the same
# threshold and momentum factor as in torch.
_DOUBLE_FIELDS = ("threshold", "momentum_factor", "clip_norm")


def _double_bits(v: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(v)))[0]


def fields_step(config: CompressionConfig, step) -> int:
    """The step that kernel fields are computed from (DGC's warm-up), as a Python int: the
    counter's value when running eagerly. A traced function runs one graph for every step: its
    fields are those of step 0, the largest k (the payload's capacity), and the ops compute
    each step's k from the step input (warmup_attrs)."""
    if not config.stepwise or not tf.executing_eagerly():
        return 0
    return int(step)


def warmup_attrs(config: CompressionConfig) -> dict:
    """In a traced step under a warm-up, the op attributes that let the kernels' k follow the
    step (csrc/tensorflow/ops.cc warmup_kept); none otherwise."""
    if not config.stepwise or tf.executing_eagerly():
        return {}
    params = config.param_dict
    return {"warmup_steps": params["warmup_steps"], "k_fraction": _double_bits(params["k"])}


def check_gradient(t, what: str = "gradient") -> int:
    if t.dtype not in DTYPE_NAMES:
        raise ValueError(f"{what} has dtype {t.dtype.name}; compression supports "
                         f"{', '.join(DTYPE_NAMES.values())}")
    n = t.shape.num_elements()
    if n is None:
        raise ValueError(f"{what} has shape {t.shape}: compression needs a static shape")
    return n


@dataclass
class Encoded:
    payload: tf.Tensor
    step: tf.Tensor
    attrs: dict
    n: int
    shape: tf.TensorShape
    dtype: tf.DType
    wire: tf.DType


@dataclass
class _CodecState:
    """A tensor's codec state (DGC's velocity and accumulator) while a plan encodes its parts:
    each variable read once and written once in finish(), as _Residual."""
    variables: list
    parts: dict  # (start, stop) -> [each variable's elements there, as read]
    pieces: list = field(default_factory=list)  # per part, the new values of every variable


@dataclass
class _Residual:
    """A tensor's worker residual while a plan encodes its parts: read once, written once in
    finish(), so a graph holds one read and one assignment of the variable however many chunks
    the plan encodes."""
    var: tf.Variable
    parts: dict  # (start, stop) -> the residual of those elements, as read
    carry_var: tf.Variable | None
    carries: list  # each part's lazy scale, as read (empty tensors for codecs without one)
    pieces: list = field(default_factory=list)
    new_carries: list = field(default_factory=list)
    settle: int | None = None  # a bucket's codec: scales settled into the residual, not kept


def _decode(payload, step, alpha, dtype, n: int, attrs: dict):
    """alpha * D(payload) in `dtype`. A bfloat16 payload that Horovod reduced as float32 (it has
    no bfloat16 allreduce) is decoded in float32 and rounded once, so the result is the float32
    computation's, rounded."""
    wide = payload.dtype == tf.float32 and dtype == tf.bfloat16
    out = lib.hvdc_decode(payload, step, alpha, T=tf.float32 if wide else dtype, n=n, **attrs)
    return tf.cast(out, dtype) if wide else out


# Each op costs about a millisecond to trace, for every gradient of a model: a whole tensor
# is neither split into nor joined from one piece.
def concat_pieces(pieces: list):
    return pieces[0] if len(pieces) == 1 else tf.concat(pieces, 0)


def split_pieces(flat, sizes: list) -> list:
    return [flat] if len(sizes) == 1 else tf.split(flat, sizes)


def flat_range(t, start: int, stop: int):
    """Elements [start, stop) of t, flattened: no slice where that is all of them."""
    flat = tf.reshape(t, [-1])
    return flat if (start, stop) == (0, t.shape.num_elements()) else flat[start:stop]


class BucketSlot:
    """A bucket's elementwise state (hvd_compress.buckets) over its members' own variables: read
    as the concatenation of their elements, assigned back to each member's elements. Stands where
    a codec reads and assigns one tensor's slot variable."""

    def __init__(self, members: list):
        self._members = members  # (variable, start, stop)
        self.shape = tf.TensorShape([sum(b - a for _, a, b in members)])
        self.dtype = members[0][0].dtype

    def value(self):
        return concat_pieces([flat_range(v, a, b) for v, a, b in self._members])

    def assign(self, value):
        pieces = split_pieces(tf.reshape(value, [-1]), [b - a for _, a, b in self._members])
        for (v, a, b), piece in zip(self._members, pieces):
            n = v.shape.num_elements()
            if (a, b) != (0, n):
                whole = tf.reshape(v, [-1])
                piece = tf.concat([whole[:a], piece, whole[b:]], 0)
            v.assign(tf.reshape(piece, v.shape))


tf.register_tensor_conversion_function(
    BucketSlot, lambda slot, dtype=None, name=None, as_ref=False: slot.value())


class TFCodec:
    def __init__(self, config: CompressionConfig, store: StateStore | None, rank: int = 0,
                 world: int = 1):
        self.config = config
        self.info = config.info
        self.store = store
        self.rank, self.world = rank, world
        # Buckets being reduced: job name -> members as (parameter name, gradient, start, stop).
        self._views: dict[str, list] = {}
        self._elementwise = {"ef", "momentum", *self.info.state_slots}

    def view(self, name: str, members: list) -> None:
        """Job `name` is a bucket of `members`: its elementwise state is theirs (BucketSlot),
        and its lazy residual scales are settled into them at the end of the step."""
        self._views[name] = members

    def attrs(self, name: str, n: int, step: int = 0) -> dict:
        """Op attributes (see CompressionConfig.kernel_fields)."""
        return self._attrs(self.info, seed_name(name, self.rank, self.info.seed_per_rank),
                           self.config.kernel_fields(n, step))

    def _attrs(self, info: CodecInfo, seed_key: str, fields: dict) -> dict:
        # The op derives each step's seed from seed_base and its step input, as derive_seed does.
        base = _signed64(seed_base(self.config.seed, seed_key)) if info.uses_seed else 0
        fields = {k: _double_bits(v) if k in _DOUBLE_FIELDS else v for k, v in fields.items()}
        return {"codec": info.kernel_id, "seed_base": base, **fields,
                **warmup_attrs(self.config)}

    def wire_dtype(self, dtype: tf.DType) -> tf.DType:
        if not self.info.linear:
            return tf.uint8
        return tf.as_dtype(self.info.wire_dtype) if self.info.wire_dtype else dtype

    def encode(self, name: str, grad, *, prescale: float = 1.0) -> Encoded:
        cfg, info = self.config, self.info
        n = check_gradient(grad)
        wire = self.wire_dtype(grad.dtype)
        flat = tf.reshape(grad, [-1])
        if (info.uses_seed or cfg.stepwise) and self.store is not None:
            step = tf.cast(self.store.next_step(name), tf.int64)
        else:
            step = tf.constant(0, tf.int64)
        attrs = self.attrs(name, n, fields_step(cfg, step))
        pres = tf.constant(prescale, tf.float64)
        held = {}
        flat = self._momentum(name, grad, flat, held)
        if info.state_slots:  # the codec's own state stands in for error feedback
            slots = [self._slot(name, kind, grad) for kind in info.state_slots]
            payload, new = lib.hvdc_encode_with_state(flat, [tf.reshape(v, [-1]) for v in slots],
                                                       step, W=wire, **attrs)
            for v, t in zip(slots, new):
                v.assign(tf.reshape(t, grad.shape))
        elif cfg.ef == "vanilla":
            e = self._slot(name, "ef", grad)
            carry = self._carry(name)
            payload, e_new, c_new = lib.hvdc_ef_encode(flat, tf.reshape(e, [-1]), carry, step, pres,
                                                       W=wire, **attrs)
            e.assign(tf.reshape(e_new, grad.shape))
            if info.ef_carry:
                carry.assign(c_new)
            self._mask_momentum(held, e_new)
        else:
            payload = lib.hvdc_encode(flat, step, pres, W=wire, **attrs)
        if info.samples:
            payload = self.mark_nonfinite(None, flat, payload)
        if info.variable_size:  # 1-D: Horovod gathers payloads of any length back to back
            payload = self.filled(payload, info, grad.dtype.size)
        elif not info.linear:
            payload = tf.reshape(payload, [1, -1])
        return Encoded(payload, step, attrs, n, grad.shape, grad.dtype, wire)

    def plain_momentum(self, name: str, grad):
        """grad with the spec's momentum (spec.spec_momentum) applied, for a dense gradient
        that travels uncompressed; the slot is updated. Heavy-ball momentum rounds as the torch
        frontend's (and torch.optim.SGD's buffer): m*factor, then + grad, each rounded to the
        gradient's dtype from float32 (float64 for float64), in one kernel's pass: as TF ops
        (casts, a multiply, an add) it read and wrote DGC's 102 MB on Keras' ResNet-50 twice."""
        kind, factor, slot = spec_momentum(self.config)
        if kind == "nesterov":
            return tf.reshape(self._momentum(name, grad, tf.reshape(grad, [-1])), grad.shape)
        m = self._slot(name, slot, grad)
        u = lib.hvdc_heavy_ball(grad, m, tf.constant(factor, tf.float64))
        m.assign(u)
        return u

    def _momentum(self, name: str, grad, flat, held: dict | None = None):
        """flat with Nesterov momentum applied when configured. The buffer is updated, or under
        spec.masks_momentum, where `held` is given, left to _mask_momentum: one assignment,
        which a TF1 graph cannot order against a second."""
        if self.config.momentum != "nesterov":
            return flat
        m = self._slot(name, "momentum", grad)
        flat, m_new = lib.hvdc_nesterov(flat, tf.reshape(m, [-1]),
                                        tf.constant(self.config.mu, tf.float64))
        if held is not None and masks_momentum(self.config):
            held["momentum"] = (m, m_new, grad.shape)
        else:
            m.assign(tf.reshape(m_new, grad.shape))
        return flat

    @staticmethod
    def _mask_momentum(held: dict, e) -> None:
        """The momentum _momentum held back, written cleared where the new residual e is zero
        (spec.masks_momentum)."""
        pending = held.pop("momentum", None)
        if pending is None:
            return
        m, m_new, shape = pending
        kept = tf.where(tf.equal(tf.reshape(e, [-1]), 0), tf.zeros_like(m_new), m_new)
        m.assign(tf.reshape(kept, shape))

    def _carry(self, name: str, parts: int = 1):
        """The sign codecs' lazy residual scales, one per part (a variable), or the empty input
        other codecs take."""
        if not self.info.ef_carry:
            return tf.zeros([0])
        if name in self._views:  # settled into the members' residuals by finish()
            return tf.zeros([self.info.ef_carry * parts])
        return self._slot(name, carry_kind(parts), tf.zeros([self.info.ef_carry * parts]))

    def _slot(self, name: str, kind: str, like):
        if self.store is None:
            raise ValueError(f"{kind} state needs parameter names: use "
                             f"hvd_compress.tensorflow.DistributedGradientTape or "
                             f"hvd_compress.tensorflow.keras.DistributedOptimizer")
        members = self._views.get(name)
        if members is None or kind not in self._elementwise:
            return self.store.slot(name, kind, like)
        return BucketSlot([(self.store.slot(m, kind, g), a, b) for m, g, a, b in members])

    def decode(self, reduced, enc: Encoded, alpha: float):
        out = _decode(reduced, enc.step, tf.constant(alpha, tf.float64), enc.dtype, enc.n,
                      enc.attrs)
        return tf.reshape(out, enc.shape)

    def aggregate(self, gathered, enc: Encoded, alpha: float):
        """Reduce the [ranks, bytes] allgather result of a non-linear codec (variable-size
        payloads: every rank's, back to back)."""
        alpha = tf.constant(alpha, tf.float64)
        if self.info.variable_size:
            out = lib.hvdc_aggregate_concat(gathered, alpha, T=enc.dtype, n=enc.n, ranks=self.world,
                                            **enc.attrs)
        else:
            out = lib.hvdc_aggregate(gathered, alpha, T=enc.dtype, n=enc.n, **enc.attrs)
        return tf.reshape(out, enc.shape)

    @staticmethod
    def filled(payload, info: CodecInfo, itemsize: int):
        """A variable-size payload cut to what its header says was filled (the op allocates the
        capacity), as torch's encoded_bytes cut."""
        return payload[:TFCodec._payload_size(payload, 0, info, itemsize)]

    @staticmethod
    def _payload_size(payloads, offset, info: CodecInfo, itemsize: int):
        """Bytes of the variable-size payload at `offset`, from the count in its header
        ([u32 tag][u32 count]...) and the registry's size formula, as int64 tensors."""
        count = tf.bitcast(payloads[offset + 4:offset + 8], tf.uint32)
        return info.payload_bytes(itemsize, tf.cast(count, tf.int64), {})

    def settle(self) -> None:
        """Lazily kept residuals to their plain form (see csrc ef_settle)."""
        if self.store is None or self.config.ef != "vanilla" or not self.info.ef_carry:
            return
        for name in self.store.names():
            e = self.store.peek(name, "ef")
            if e is None:
                continue
            for kind in self.store.kinds(name):
                parts = carry_parts(kind)
                if not parts:
                    continue
                carry = self.store.peek(name, kind)
                bounds = chunk_bounds(e.shape.num_elements(), parts)
                regions = tf.split(tf.reshape(e, [-1]), np.diff(bounds).tolist())
                settled = [lib.hvdc_ef_settle(r, c, codec=self.info.kernel_id)
                           for r, c in zip(regions, tf.split(carry, parts))]
                e.assign(tf.reshape(tf.concat([r for r, _ in settled], 0), e.shape))
                carry.assign(tf.concat([c for _, c in settled], 0))

    # ---- the reduction plans' operations (hvd_compress.collectives.Ops) -------------------------
    def prepare(self, job: Job):
        grad = job.extra["grad"]
        check_gradient(grad)
        return self._momentum(job.name, grad, tf.reshape(grad, [-1]), job.extra)

    def encode_part(self, job: Job, x, part: Part, info: CodecInfo, state: str | None):
        payload = self._encode_part(job, x, part, info, state)
        if info.variable_size:
            payload = self.filled(payload, info, job.itemsize)
        return payload

    def _encode_part(self, job: Job, x, part: Part, info: CodecInfo, state: str | None):
        attrs = self._part_attrs(part, info)
        # Horovod sums an allreduced payload in its element type; every other collective only
        # moves bytes, so the op writes them as bytes.
        wire = self.wire_dtype(x.dtype) if job.strategy == ALLREDUCE else tf.uint8
        pres = self._scalar(job, job.extra.get("prescale", 1.0))
        if state == "worker" and info.state_slots:
            return self._worker_state_encode(job, x, part, info, attrs)
        if state == "worker" and self.config.ef == "vanilla":
            return self._worker_ef_encode(job, x, part, info, attrs, wire, pres)
        if state == "owner" and self.config.ef == "vanilla":
            e = self._slot(job.name, f"owner_ef[{part.start}:{part.stop}]", x)
            payload, e_new, carry = lib.hvdc_ef_encode(x, e, tf.zeros([info.ef_carry]), job.step,
                                                       pres, W=wire, **attrs)
            if info.ef_carry:  # no carry outlives the chunk: the owner residual is kept plain
                e_new, _ = lib.hvdc_ef_settle(e_new, carry, codec=info.kernel_id)
            e.assign(e_new)
            return payload
        return lib.hvdc_encode(x, job.step, pres, W=wire, **attrs)

    def _worker_state_encode(self, job: Job, x, part: Part, info: CodecInfo, attrs: dict):
        held = job.extra.get("codec_state")
        if held is None:
            grad = job.extra["grad"]
            variables = [self._slot(job.name, kind, grad) for kind in info.state_slots]
            bounds = part_bounds(job)
            cuts = [split_pieces(tf.reshape(v, [-1]), np.diff(bounds).tolist())
                    for v in variables]
            held = job.extra["codec_state"] = _CodecState(
                variables, {(a, b): [c[j] for c in cuts]
                            for j, (a, b) in enumerate(zip(bounds, bounds[1:]))})
        payload, new = lib.hvdc_encode_with_state(x, held.parts[part.start, part.stop], job.step,
                                                   W=tf.uint8, **attrs)
        held.pieces.append(new)
        return payload

    @staticmethod
    def mark_nonfinite(job: Job | None, x, payload):
        if payload.shape.num_elements() == 0:
            return payload
        head = tf.where(tf.reduce_all(tf.math.is_finite(x)), payload[:1],
                        tf.constant(np.nan, payload.dtype))
        return tf.concat([head, payload[1:]], 0)

    def _worker_ef_encode(self, job: Job, x, part: Part, info: CodecInfo, attrs: dict, wire,
                          pres):
        res = job.extra.get("residual")
        if res is None:
            var = self._slot(job.name, "ef", job.extra["grad"])
            # Cut at the part bounds by one op rather than a slice (and its constants) per part.
            bounds = part_bounds(job)
            parts = len(bounds) - 1
            cuts = split_pieces(tf.reshape(var, [-1]), np.diff(bounds).tolist())
            carry = self._carry(job.name, parts)
            bucket = job.name in self._views
            res = job.extra["residual"] = _Residual(
                var, dict(zip(zip(bounds, bounds[1:]), cuts)),
                carry if self.info.ef_carry and not bucket else None,
                split_pieces(carry, [self.info.ef_carry] * parts) if self.info.ef_carry
                else [carry] * parts,
                settle=self.info.kernel_id if self.info.ef_carry and bucket else None)
        payload, e_new, carry = lib.hvdc_ef_encode(x, res.parts[part.start, part.stop],
                                                   res.carries[part.index], job.step, pres,
                                                   W=wire, **attrs)
        res.pieces.append(e_new)
        res.new_carries.append(carry)
        return payload

    def _part_attrs(self, part: Part, info: CodecInfo) -> dict:
        return self._attrs(info, part.seed_key, part.field_dict)

    @staticmethod
    def _scalar(job: Job, value: float):
        """A float64 op input, one constant per value and tensor (a plan passes the same scale
        to every part; in a graph each constant is an op)."""
        cache = job.extra.setdefault("scalars", {})
        if value not in cache:
            cache[value] = tf.constant(value, tf.float64)
        return cache[value]

    @staticmethod
    def size(payload):
        """Bytes of a payload: an int, or in a graph a tensor where the size depends on the data
        (threshold), in float64 so that the plans' cost model can take fractions of it."""
        n = payload.shape.num_elements()
        if n is None:
            return tf.cast(tf.size(payload, tf.int64) * payload.dtype.size, tf.float64)
        return n * payload.dtype.size

    @staticmethod
    def concat(tensors: list):
        return tf.concat(tensors, 0)

    @staticmethod
    def split(t, sizes: list) -> list:
        return tf.split(tf.reshape(t, [-1]), sizes, num=len(sizes))

    @staticmethod
    def columns(gathered, ranks: int, start, stop):
        # under a traced warm-up the payload sizes, so the bounds, are float64 tensors (size())
        start, stop = (tf.cast(b, tf.int64) if tf.is_tensor(b) else b for b in (start, stop))
        return tf.reshape(gathered, [ranks, -1])[:, start:stop]

    def walk(self, job: Job, gathered, parts: list[Part], info: CodecInfo) -> list:
        sizes, offset = [], 0
        for _ in parts:
            sizes.append(self._payload_size(gathered, offset, info, job.itemsize))
            offset = offset + sizes[-1]
        return sizes

    def reduce(self, job: Job, payloads, part: Part, info: CodecInfo, ranks: int, alpha: float):
        if info.variable_size:
            return lib.hvdc_aggregate_concat(tf.reshape(payloads, [-1]), self._scalar(job, alpha),
                                             T=job.extra["grad"].dtype, n=part.n, ranks=ranks,
                                             **self._part_attrs(part, info))
        # Payload sizes are static, so the rows are known in a graph too, and empty payloads
        # (bf16 chunks past the end of a small tensor) need no size inferred; under a traced
        # warm-up the size is the step's (every rank's alike), known to the graph only.
        per_rank = (-1 if warmup_attrs(self.config)
                    else info.payload_bytes(job.itemsize, part.n, part.field_dict))
        return lib.hvdc_aggregate(tf.reshape(payloads, [ranks, per_rank]),
                                  self._scalar(job, alpha), T=job.extra["grad"].dtype,
                                  n=part.n, **self._part_attrs(part, info))

    reduce_into = reduce  # TF ops allocate their outputs

    def reduce_pair(self, job: Job, payload, summed, part: Part, info: CodecInfo, alpha: float):
        return lib.hvdc_aggregate_pair(tf.reshape(payload, [-1]), summed,
                                       self._scalar(job, alpha), T=job.extra["grad"].dtype,
                                       n=part.n, rank=job.rank, **self._part_attrs(part, info))

    def decode_part(self, job: Job, payload, part: Part, info: CodecInfo, alpha: float):
        if info.variable_size:
            return self.reduce(job, payload, part, info, 1, alpha)
        return _decode(payload, job.step, self._scalar(job, alpha), job.extra["grad"].dtype,
                       part.n, self._part_attrs(part, info))

    # two-level
    @staticmethod
    def flat(job: Job):
        grad = job.extra["grad"]
        check_gradient(grad)
        return tf.reshape(grad, [-1])

    @staticmethod
    def as_bytes(t):
        return tf.reshape(tf.bitcast(t, tf.uint8), [-1])

    @staticmethod
    def from_bytes(b, job: Job, half: bool = False):
        dtype = tf.float16 if half else job.extra["grad"].dtype
        return tf.bitcast(tf.reshape(b, [-1, dtype.size]), dtype)

    @staticmethod
    def own_size(payload, rank: int):
        return tf.scatter_nd([[rank]], tf.reshape(tf.size(payload), [1]), [2])

    @staticmethod
    def words(job: Job, payload, sizes=None):
        b = tf.reshape(payload, [-1])
        n = b.shape.num_elements()
        if sizes is None and n is not None:  # the padding known, as a trace's constant
            if n % 4:
                b = tf.pad(b, [[0, -n % 4]])
        else:
            nbytes = tf.size(b) if sizes is None else tf.reduce_max(sizes)
            b = tf.pad(b, [[0, nbytes - tf.size(b) + -nbytes % 4]])
        return tf.bitcast(tf.reshape(b, [-1, 4]), tf.int32)

    @staticmethod
    def pair_rows(job: Job, payload, sent, summed, rank: int, sizes=None):
        own = tf.reshape(payload, [-1])
        other = tf.reshape(tf.bitcast(summed - sent, tf.uint8), [-1])
        n = own.shape.num_elements()
        if sizes is not None or n is None:
            other = other[:tf.size(own) if sizes is None else sizes[1 - rank]]
        elif n % 4:
            other = other[:n]
        return tf.concat([own, other] if rank == 0 else [other, own], 0)

    @staticmethod
    def to_half(t):
        return tf.cast(t, tf.float16)

    @staticmethod
    def widen(t, job: Job):
        return tf.cast(t, job.extra["grad"].dtype)

    @staticmethod
    def sum_rows(job: Job, rows, ranks: int, n: int, alpha: float):
        acc = tf.float64 if rows.dtype == tf.float64 else tf.float32
        # a graph's alltoall result has no static length; the plan knows it
        rows = tf.cast(tf.reshape(rows, [ranks, n]), acc)
        total = rows[0]
        for r in range(1, ranks):  # rank order, as the torch frontend and the simulation add
            total = total + rows[r]
        return tf.cast(total * tf.constant(alpha, acc), job.extra["grad"].dtype)

    # homomorphic
    def homo_source(self, job: Job, x):
        if self.config.ef != "vanilla":
            return x
        var = self._slot(job.name, "ef", job.extra["grad"])
        job.extra["homo_residual"] = var
        return x + tf.reshape(var, [-1])

    @staticmethod
    def homo_absmax(job: Job, p, block: int):
        m = lib.hvdc_homo_block_absmax(p, block=block)
        # A NaN block becomes inf: Horovod's max would not carry a NaN to every rank.
        return tf.where(tf.math.is_nan(m), tf.constant(np.inf, tf.float32), m)

    def homo_encode(self, job: Job, p, scales, block: int, levels: int, seed_key: str):
        base = _signed64(seed_base(self.config.seed, seed_key))
        words = lib.hvdc_homo_encode(p, scales, job.step, block=block, levels=levels,
                                     lane_ranks=job.world, seed_base=base)
        var = job.extra.pop("homo_residual", None)
        if var is not None:
            # e = p - D(own codes), added in the accumulator type as the torch kernel does
            acc = tf.float64 if p.dtype == tf.float64 else tf.float32
            own = lib.hvdc_homo_decode(words, scales, self._scalar(job, -1.0), T=acc, n=job.n,
                                       block=block, levels=levels, lane_ranks=job.world,
                                       summands=1)
            var.assign(tf.reshape(tf.cast(tf.cast(p, acc) + own, p.dtype), var.shape))
        return words

    def homo_decode(self, job: Job, words, scales, block: int, levels: int, alpha: float):
        return lib.hvdc_homo_decode(words, scales, self._scalar(job, alpha),
                                    T=job.extra["grad"].dtype, n=job.n, block=block,
                                    levels=levels, lane_ranks=job.world, summands=job.world)

    def finish(self, job: Job, pieces: list):
        self._views.pop(job.name, None)
        held = job.extra.pop("codec_state", None)
        if held is not None:
            for v, new in zip(held.variables, zip(*held.pieces)):
                v.assign(tf.reshape(concat_pieces(list(new)), v.shape))
        res = job.extra.pop("residual", None)
        if res is not None:
            if res.settle is not None:
                res.pieces = [lib.hvdc_ef_settle(e, c, codec=res.settle)[0]
                              for e, c in zip(res.pieces, res.new_carries)]
            e = concat_pieces(res.pieces)
            res.var.assign(tf.reshape(e, res.var.shape))
            self._mask_momentum(job.extra, e)
            if res.carry_var is not None:
                res.carry_var.assign(concat_pieces(res.new_carries))
        grad = job.extra["grad"]
        return tf.reshape(concat_pieces(pieces), grad.shape)


class TFAdapter:
    """StateStore adapter: tf.Variables <-> numpy arrays. A step's backups are variables too,
    made once (outside any trace) and written in the step, so a rollback built in another
    branch of the graph than the step's compression (tf.cond) can read them."""

    traced = True

    def zeros_like(self, like) -> tf.Variable:
        return state_variable(lambda: tf.zeros(like.shape, like.dtype))

    def describe(self, t) -> tuple[tuple[int, ...], str]:
        return tuple(t.shape.as_list()), DTYPE_NAMES.get(t.dtype, t.dtype.name)

    def to_numpy(self, t) -> np.ndarray:
        if t.dtype == tf.bfloat16:  # numpy has no bfloat16: upcast, exactly
            t = tf.cast(t, tf.float32)
        return np.array(t.numpy())

    def from_numpy(self, a: np.ndarray, like):
        if isinstance(like, tf.Variable):
            like.assign(tf.cast(tf.constant(a), like.dtype))
            return like
        # A checkpointed slot first used inside a trace: its value is made where it is kept.
        return state_variable(lambda: tf.cast(tf.constant(a), like.dtype))

    def new_counter(self, value: int) -> tf.Variable:
        return state_variable(value, tf.int64)

    def advance(self, counter: tf.Variable):
        return counter.assign_add(1) - 1

    def counter_value(self, counter: tf.Variable) -> int:
        return int(counter.numpy())

    def set_counter(self, counter: tf.Variable, value: int) -> None:
        counter.assign(value)

    def backup(self, t: tf.Variable, spare: tf.Variable | None) -> tf.Variable:
        if spare is None:
            spare = state_variable(lambda: tf.zeros(t.shape, t.dtype))
        spare.assign(t)
        return spare

    def restore(self, t: tf.Variable, saved: tf.Variable) -> None:
        t.assign(saved)

    backup_counter = backup
    restore_counter = restore

    def scope(self):
        return tf.compat.v1.get_default_graph()

    def restore_if(self, ran, t: tf.Variable, saved: tf.Variable) -> None:
        # A select, where a tf.cond would skip the copy: this runs only in a step being rolled
        # back, and a cond per slot, nested in the rollback's, took 50 ms each to trace.
        t.assign(tf.where(ran, saved, t))
