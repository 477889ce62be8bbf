"""Numpy reference implementations of every codec: the oracle the kernels must match bit for
bit. Written from the codec definitions (README's codec table), not from the C++.

Arrays are numpy in their own dtype; bfloat16 data is held as uint16 bit patterns.
Arithmetic follows the kernels' documented order: float32 accumulation for 32-bit and narrower
gradients, float64 for float64, every product and sum rounded separately.
"""
from __future__ import annotations

import struct

import numpy as np

DTYPE_CODE = {"float32": 0, "float16": 1, "bfloat16": 2, "float64": 3}
CODEC_ID = {"none": 0, "fp16": 1, "bf16": 2, "onebit": 3, "signsgd": 4, "efsignsgd": 5,
            "topk": 6, "randomk": 7, "minmax8": 8}
MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def tag(codec: str, dtype: str) -> int:
    return 0x48430000 | (CODEC_ID[codec] << 8) | DTYPE_CODE[dtype]


# ---- element conversions -------------------------------------------------------------------
def bf16_bits(x32: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x32, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    return np.where(nan, (u >> 16) | 0x40, rounded).astype(np.uint16)


def bf16_value(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32)


def bf16_bits_from_f64(d: np.ndarray) -> np.ndarray:
    """Round float64 to bfloat16 once (nearest even) through frexp; normal range only."""
    m, e = np.frexp(d)
    r = np.ldexp(np.rint(np.ldexp(m, 8)), e - 8)
    return bf16_bits(r.astype(np.float32))


def acc_type(dtype: str):
    return np.float64 if dtype == "float64" else np.float32


def to_acc(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return bf16_value(a)
    return np.asarray(a).astype(acc_type(dtype))


def from_acc(v: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return bf16_bits(np.asarray(v, dtype=np.float32))
    return np.asarray(v).astype({"float32": np.float32, "float16": np.float16,
                                 "float64": np.float64}[dtype])


def zeros(n: int, dtype: str) -> np.ndarray:
    return from_acc(np.zeros(n, acc_type(dtype)), dtype)


# ---- randomk indices -----------------------------------------------------------------------
def mix64(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def randomk_strata(n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    j = np.arange(k, dtype=np.uint64)
    lo = np.array([(int(i) * n) // k for i in range(k)], dtype=np.int64)
    hi = np.array([((int(i) + 1) * n) // k for i in range(k)], dtype=np.int64)
    with np.errstate(over="ignore"):
        h = mix64(np.uint64(seed) + (j + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15))
    size = (hi - lo).astype(np.uint64)
    offset = ((h >> np.uint64(32)) * size) >> np.uint64(32)
    return lo + offset.astype(np.int64), (hi - lo)


# ---- codecs --------------------------------------------------------------------------------
def kept(k_param: float, n: int) -> int:
    if k_param < 1:
        return min(n, max(1, int(np.ceil(k_param * n)))) if n else 0
    return min(n, int(k_param))


def encode(codec: str, x: np.ndarray, dtype: str, *, k: int = 0, seed: int = 0,
           scaling: bool = True, prescale: float = 1.0, chunk: int = 4096) -> bytes:
    n = x.size
    if codec == "none":
        return x.tobytes()
    if codec in ("fp16", "bf16"):
        with np.errstate(over="ignore"):  # overflow to inf is the defined result of the cast
            if dtype == "float64":
                v = x * prescale
                return (v.astype(np.float16) if codec == "fp16" else bf16_bits_from_f64(v)).tobytes()
            v = to_acc(x, dtype) * np.float32(prescale)
            return (v.astype(np.float16) if codec == "fp16" else bf16_bits(v)).tobytes()
    if codec in ("onebit", "signsgd", "efsignsgd"):
        xv = to_acc(x, dtype)
        bits = xv < 0
        if codec == "efsignsgd" or scaling:
            scale = np.float32(np.abs(xv.astype(np.float64)).sum() / n) if n else np.float32(0)
        else:
            scale = np.float32(1.0)
        packed = np.packbits(bits, bitorder="little").tobytes()
        packed += b"\0" * (8 * ((n + 63) // 64) - len(packed))
        return struct.pack("<If", tag(codec, dtype), float(scale)) + packed
    if codec == "topk":
        mags = np.abs(to_acc(x, dtype).astype(np.float64))
        order = np.lexsort((np.arange(n), -mags))[:k]
        idx = np.sort(order).astype("<i4")
        ib = idx.tobytes()
        ib += b"\0" * ((k * 4 + 7) // 8 * 8 - len(ib))
        return struct.pack("<II", tag(codec, dtype), k) + ib + x[idx].tobytes()
    if codec == "randomk":
        idx, _ = randomk_strata(n, k, seed)
        return x[idx].tobytes()
    if codec == "minmax8":
        xv = to_acc(x, dtype).astype(np.float32)
        bounds, codes = [], np.zeros(n, np.uint8)
        for s in range(0, n, chunk):
            seg = xv[s:s + chunk]
            lo, hi = (np.float32(np.nan),) * 2 if np.isnan(seg).any() else (seg.min(), seg.max())
            lo, hi = lo + np.float32(0), hi + np.float32(0)  # -0 bounds are stored as +0
            bounds += [lo, hi]
            rng = np.float32(hi - lo)
            if rng > 0:
                q = (seg - lo) * (np.float32(255.0) / rng)
                codes[s:s + chunk] = np.clip(np.floor(q + np.float32(0.5)), 0, 255).astype(np.uint8)
        pad = b"\0" * ((n + 7) // 8 * 8 - n)
        return (struct.pack("<II", tag(codec, dtype), chunk) +
                np.array(bounds, np.float32).tobytes() + codes.tobytes() + pad)
    raise KeyError(codec)


def _np_dtype(dtype: str):
    return {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16,
            "float64": np.float64}[dtype]


def _sign_parts(payload: bytes, n: int):
    t, scale = struct.unpack("<If", payload[:8])
    bits = np.unpackbits(np.frombuffer(payload[8:], np.uint8), bitorder="little")[:n].astype(bool)
    return t, np.float32(scale), bits


def _topk_parts(payload: bytes, dtype: str):
    t, k = struct.unpack("<II", payload[:8])
    off = 8 + (k * 4 + 7) // 8 * 8
    idx = np.frombuffer(payload[8:8 + 4 * k], "<i4")
    vals = np.frombuffer(payload[off:], _np_dtype(dtype))[:k]
    return t, idx, vals


def decoded_terms(codec: str, payload: bytes, n: int, dtype: str, alpha: float, *, k: int = 0,
                  seed: int = 0, rescale: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(indices, alpha * D(payload) at those indices) in the accumulator type."""
    A = acc_type(dtype)
    a = A(alpha)
    if codec == "none":
        return np.arange(n), a * to_acc(np.frombuffer(payload, _np_dtype(dtype)), dtype)
    if codec in ("fp16", "bf16"):
        h = np.frombuffer(payload, np.float16 if codec == "fp16" else np.uint16)
        v = h.astype(np.float32) if codec == "fp16" else bf16_value(h)
        return np.arange(n), a * v.astype(A)
    if codec in ("onebit", "signsgd", "efsignsgd"):
        _, scale, bits = _sign_parts(payload, n)
        v = a * A(scale)
        return np.arange(n), np.where(bits, -v, v).astype(A)
    if codec == "topk":
        _, idx, vals = _topk_parts(payload, dtype)
        return idx.astype(np.int64), a * to_acc(vals, dtype)
    if codec == "minmax8":
        _, c = struct.unpack("<II", payload[:8])
        nch = (n + c - 1) // c
        bounds = np.frombuffer(payload[8:8 + 8 * nch], np.float32).reshape(nch, 2)
        codes = np.frombuffer(payload[8 + 8 * nch:8 + 8 * nch + n], np.uint8)
        vals = np.empty(n, np.float32)
        for j, (lo, hi) in enumerate(bounds):
            rng = np.float32(hi - lo)
            step = rng / np.float32(255.0) if rng > 0 else np.float32(0)
            seg = codes[j * c:(j + 1) * c].astype(np.float32)
            vals[j * c:(j + 1) * c] = lo + seg * step
        return np.arange(n), a * vals.astype(A)
    if codec == "randomk":
        idx, size = randomk_strata(n, k, seed)
        v = to_acc(np.frombuffer(payload, _np_dtype(dtype)), dtype)
        if rescale:
            v = v * size.astype(A)
        return idx, a * v
    raise KeyError(codec)


def decode(codec: str, payload: bytes, n: int, dtype: str, alpha: float = 1.0,
           out: np.ndarray | None = None, **kw) -> np.ndarray:
    """out = alpha * D(payload), or out + alpha * D(payload) when out is given."""
    idx, terms = decoded_terms(codec, payload, n, dtype, alpha, **kw)
    if out is None and codec not in ("topk", "randomk", "minmax8"):
        return from_acc(terms, dtype)  # dense codecs write alpha * D directly
    base = zeros(n, dtype) if out is None else out
    acc = to_acc(base, dtype).copy()
    acc[idx] = acc[idx] + terms
    res = base.copy()
    res[idx] = from_acc(acc[idx], dtype)
    return res


def aggregate(codec: str, payloads: list[bytes], n: int, dtype: str, alpha: float,
              **kw) -> np.ndarray:
    A = acc_type(dtype)
    if codec == "signsgd":
        votes = np.zeros(n, np.int64)
        scales = []
        for p in payloads:
            _, scale, bits = _sign_parts(p, n)
            votes += np.where(bits, -1, 1)
            scales.append(float(scale))
        mean_scale = np.float32(sum(scales) / len(payloads))
        v = A(mean_scale) * A(alpha * len(payloads))
        return from_acc(np.where(votes > 0, v, np.where(votes < 0, -v, A(0))).astype(A), dtype)
    acc = np.zeros(n, A)
    for p in payloads:
        idx, terms = decoded_terms(codec, p, n, dtype, alpha, **kw)
        acc[idx] = acc[idx] + terms
    return from_acc(acc, dtype)


def nesterov(x: np.ndarray, m: np.ndarray, mu: float, dtype: str):
    A = acc_type(dtype)
    m2 = from_acc(A(mu) * to_acc(m, dtype) + to_acc(x, dtype), dtype)
    x2 = from_acc(A(mu) * to_acc(m2, dtype) + to_acc(x, dtype), dtype)
    return x2, m2


def ef_encode(codec: str, x: np.ndarray, e: np.ndarray, dtype: str, prescale: float = 1.0, **kw):
    """Vanilla error feedback: p = x + e; c = C(p); e = p - D(c). Returns (payload, new e)."""
    p = from_acc(to_acc(x, dtype) + to_acc(e, dtype), dtype)
    enc_kw = {k: v for k, v in kw.items() if k in ("k", "seed", "scaling", "chunk")}
    payload = encode(codec, p, dtype, prescale=prescale, **enc_kw)
    dec_kw = {k: v for k, v in kw.items() if k in ("k", "seed", "rescale")}
    return payload, decode(codec, payload, x.size, dtype, -1.0 / prescale, out=p, **dec_kw)
