"""One codec bound to TensorFlow tensors: the same steps as hvd_compress.torch.codec, on the
same kernels (as TF ops). State lives in tf.Variables created outside any tf.function
(init_scope), so compress/decompress trace once and keep updating state on every call.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from ..registry import codecs
from ..seeds import seed_base, seed_name
from ..spec import CompressionConfig
from ..state import StateStore
from .ops import lib

DTYPE_NAMES = {tf.float32: "float32", tf.float16: "float16", tf.bfloat16: "bfloat16",
               tf.float64: "float64"}


def _signed64(u: int) -> int:
    return u - (1 << 64) if u >= (1 << 63) else u


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


class TFCodec:
    def __init__(self, config: CompressionConfig, store: StateStore | None, rank: int = 0):
        if "tensorflow" not in config.info.frontends:
            raise ValueError(f"codec {config.codec!r} is available in the PyTorch frontend only; "
                             f"TensorFlow codecs: " + ", ".join(
                                 c.name for c in codecs() if "tensorflow" in c.frontends))
        self.config = config
        self.info = config.info
        self.store = store
        self.rank = rank

    def attrs(self, name: str, n: int) -> dict:
        """Op attributes (see CompressionConfig.kernel_fields)."""
        key = seed_name(name, self.rank, self.info.seed_per_rank)
        base = _signed64(seed_base(self.config.seed, key)) if self.info.uses_seed else 0
        return {"codec": self.info.kernel_id, "seed_base": base, **self.config.kernel_fields(n)}

    def wire_dtype(self, dtype: tf.DType) -> tf.DType:
        if not self.info.linear:
            return tf.uint8
        return tf.as_dtype(self.info.wire_dtype) if self.info.wire_dtype else dtype

    def encode(self, name: str, grad, *, prescale: float = 1.0) -> Encoded:
        cfg, info = self.config, self.info
        n = check_gradient(grad)
        attrs = self.attrs(name, n)
        wire = self.wire_dtype(grad.dtype)
        flat = tf.reshape(grad, [-1])
        if info.uses_seed and self.store is not None:
            step = tf.cast(self.store.next_step(name), tf.int64)
        else:
            step = tf.constant(0, tf.int64)
        pres = tf.constant(prescale, tf.float64)
        if cfg.momentum == "nesterov":
            m = self._slot(name, "momentum", grad)
            flat, m_new = lib.hvdc_nesterov(flat, tf.reshape(m, [-1]), tf.constant(cfg.mu, tf.float64))
            m.assign(tf.reshape(m_new, grad.shape))
        if cfg.ef == "vanilla":
            e = self._slot(name, "ef", grad)
            carry = (self._slot(name, "ef_carry", tf.zeros([info.ef_carry])) if info.ef_carry
                     else tf.zeros([0]))
            payload, e_new, c_new = lib.hvdc_ef_encode(flat, tf.reshape(e, [-1]), carry, step, pres,
                                                       W=wire, **attrs)
            e.assign(tf.reshape(e_new, grad.shape))
            if info.ef_carry:
                carry.assign(c_new)
        else:
            payload = lib.hvdc_encode(flat, step, pres, W=wire, **attrs)
        if not info.linear:
            payload = tf.reshape(payload, [1, -1])
        return Encoded(payload, step, attrs, n, grad.shape, grad.dtype, wire)

    def _slot(self, name: str, kind: str, like):
        if self.store is None:
            raise ValueError(f"{kind} state needs parameter names: use "
                             f"hvd_compress.tensorflow.DistributedGradientTape or "
                             f"hvd_compress.tensorflow.keras.DistributedOptimizer")
        return self.store.slot(name, kind, like)

    def decode(self, reduced, enc: Encoded, alpha: float):
        out = lib.hvdc_decode(reduced, enc.step, tf.constant(alpha, tf.float64), T=enc.dtype,
                              n=enc.n, **enc.attrs)
        return tf.reshape(out, enc.shape)

    def aggregate(self, gathered, enc: Encoded, alpha: float):
        out = lib.hvdc_aggregate(gathered, tf.constant(alpha, tf.float64), T=enc.dtype, n=enc.n,
                                 **enc.attrs)
        return tf.reshape(out, enc.shape)

    def settle(self) -> None:
        """Lazily kept residuals to their plain form (see csrc ef_settle)."""
        if self.store is None or self.config.ef != "vanilla" or not self.info.ef_carry:
            return
        for name in self.store.names():
            e, carry = self.store.peek(name, "ef"), self.store.peek(name, "ef_carry")
            if e is not None and carry is not None:
                e_new, c_new = lib.hvdc_ef_settle(e, carry, codec=self.info.kernel_id)
                e.assign(e_new)
                carry.assign(c_new)


class TFAdapter:
    """StateStore adapter: tf.Variables <-> numpy arrays."""

    def zeros_like(self, like) -> tf.Variable:
        with tf.init_scope():
            return tf.Variable(tf.zeros(like.shape, like.dtype), trainable=False)

    def describe(self, t) -> tuple[tuple[int, ...], str]:
        return tuple(t.shape.as_list()), DTYPE_NAMES.get(t.dtype, t.dtype.name)

    def to_numpy(self, t) -> np.ndarray:
        if t.dtype == tf.bfloat16:  # numpy has no bfloat16: upcast, exactly
            t = tf.cast(t, tf.float32)
        return np.array(t.numpy())

    def from_numpy(self, a: np.ndarray, like):
        value = tf.cast(tf.constant(a), like.dtype)
        if isinstance(like, tf.Variable):
            like.assign(value)
            return like
        with tf.init_scope():
            return tf.Variable(value, trainable=False)

    def new_counter(self, value: int) -> tf.Variable:
        with tf.init_scope():
            return tf.Variable(value, dtype=tf.int64, trainable=False)

    def advance(self, counter: tf.Variable):
        return counter.assign_add(1) - 1

    def counter_value(self, counter: tf.Variable) -> int:
        return int(counter.numpy())

    def set_counter(self, counter: tf.Variable, value: int) -> None:
        counter.assign(value)
