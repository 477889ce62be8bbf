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
            "topk": 6, "randomk": 7, "minmax8": 8, "dithering": 9, "qsgd": 9, "terngrad": 9,
            "natural": 10, "threshold": 11, "dgc": 12}
# qsgd and terngrad are dithering with these settings (QSGD: L2 norm; TernGrad: one level of
# the max after clipping at clip * std).
DITHER_FIXED = {"dithering": {}, "qsgd": {"partition": 0, "normalize": 1},
                "terngrad": {"s": 1, "partition": 0, "normalize": 2}}
DITHER_DEFAULTS = {"s": 8, "partition": 0, "normalize": 0, "clip": 2.5}
INT32_MIN = -2**31
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


def magnitude_keys(a: np.ndarray, dtype: str) -> np.ndarray:
    """|x| as the kernels' selection keys (key_of): the ordering of |x|, NaN above inf."""
    v = to_acc(a, dtype)
    wide = v.dtype == np.float64
    bits = v.view(np.uint64 if wide else np.uint32)
    return (bits & bits.dtype.type(2 ** (63 if wide else 31) - 1)).astype(np.int64)


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


# ---- stochastic rounding ------------------------------------------------------------------
def uniform(seed: int, n: int) -> np.ndarray:
    """Per-element uniforms in [0, 1) on a 2^-16 grid: murmur3's finaliser of
    (h * 0x9e3779b1 + low32(seed)) ^ high32(seed), all in uint32, with h = (i // 16) * 8 + i % 8;
    elements with i % 16 < 8 take the low 16 bits, the others the high 16."""
    i = np.arange(n, dtype=np.uint64)
    h_idx = (((i >> np.uint64(4)) << np.uint64(3)) | (i & np.uint64(7))) & np.uint64(0xFFFFFFFF)
    with np.errstate(over="ignore"):
        h = (h_idx.astype(np.uint32) * np.uint32(0x9E3779B1) + np.uint32(seed & 0xFFFFFFFF)) \
            ^ np.uint32(seed >> 32)
        h ^= h >> np.uint32(16)
        h *= np.uint32(0x85EBCA6B)
        h ^= h >> np.uint32(13)
        h *= np.uint32(0xC2B2AE35)
        h ^= h >> np.uint32(16)
    high = (i & np.uint64(8)).astype(bool)
    bits = np.where(high, h >> np.uint32(16), h & np.uint32(0xFFFF))
    return bits.astype(np.float32) * np.float32(2.0 ** -16)


def lane_sums(v: np.ndarray) -> float:
    """Sum in float64 over 16 lanes (lane = index mod 16), each in index order, then pairwise."""
    rows = np.zeros(((v.size + 15) // 16) * 16, np.float64)
    rows[:v.size] = v
    lanes = np.cumsum(rows.reshape(-1, 16), axis=0)[-1] if v.size else np.zeros(16)
    while lanes.size > 1:
        lanes = lanes[0::2] + lanes[1::2]
    return float(lanes[0])


def dither_norm(xv: np.ndarray, normalize: int, clip: float) -> np.float32:
    if not np.isfinite(xv).all():
        return np.float32(np.nan)
    mx = np.abs(xv).max() if xv.size else np.float32(0)
    if normalize == 0 or xv.size == 0:
        return np.float32(mx)
    d = xv.astype(np.float64)
    sumsq = lane_sums(d * d)
    if normalize == 1:
        return np.float32(np.sqrt(sumsq))
    mean = lane_sums(d) / xv.size
    var = max(0.0, sumsq / xv.size - mean * mean)
    bound = np.float32(float(np.float32(clip)) * np.sqrt(var))
    return min(np.float32(mx), bound) if bound > 0 else np.float32(mx)


def dither_bits(s: int) -> int:
    return (2 * s).bit_length()


def dither_codes(xv: np.ndarray, norm: np.float32, s: int, partition: int, seed: int):
    n = xv.size
    if not (norm > 0) or not np.isfinite(norm):
        return np.full(n, s, np.int64)
    u = uniform(seed, n)
    if partition == 0:  # t = min(|x| * (s / norm), s)
        t = np.minimum(np.abs(xv) * (np.float32(s) / norm), np.float32(s))
        f = np.floor(t)
        lev = f.astype(np.int64) + (u < t - f)
    else:
        a = np.minimum(np.abs(xv) * (np.float32(1) / norm), np.float32(1))
        m, e = np.frexp(a)  # a = m * 2^e, m in [0.5, 1): a's exponent is e - 1
        frac = m * np.float32(2) - np.float32(1)
        main = (e - 1).astype(np.int64) + s + (u < frac)
        tail = (u < a * np.float32(2.0 ** (s - 1))).astype(np.int64)
        lev = np.where(a < np.float32(2.0 ** (1 - s)), tail, main)
    return np.where(xv < 0, s - lev, s + lev)


def pack_codes(codes: np.ndarray, b: int) -> bytes:
    groups = (codes.size + 7) // 8
    padded = np.zeros(groups * 8, np.uint64)
    padded[:codes.size] = codes
    shifts = (np.arange(8, dtype=np.uint64) * np.uint64(b))
    w = np.bitwise_or.reduce(padded.reshape(-1, 8) << shifts, axis=1) if groups else padded
    out = w.astype("<u8").view(np.uint8).reshape(-1, 8)[:, :b].tobytes()
    return out + b"\0" * ((len(out) + 7) // 8 * 8 - len(out))


def unpack_codes(data: bytes, n: int, b: int) -> np.ndarray:
    groups = (n + 7) // 8
    raw = np.frombuffer(data[:groups * b], np.uint8).reshape(groups, b)
    words = np.zeros((groups, 8), np.uint8)
    words[:, :b] = raw
    w = words.view("<u8").reshape(-1)
    shifts = np.arange(8, dtype=np.uint64) * np.uint64(b)
    return ((w[:, None] >> shifts) & np.uint64((1 << b) - 1)).reshape(-1)[:n].astype(np.int64)


def natural_parts(xv: np.ndarray, seed: int) -> tuple[int, np.ndarray]:
    a = np.abs(xv.astype(np.float64))
    if not np.isfinite(a).all():
        return INT32_MIN, np.zeros(xv.size, np.int64)
    mx = a.max() if a.size else 0.0
    if mx == 0:
        return 0, np.zeros(xv.size, np.int64)
    top = int(np.frexp(mx)[1])  # one above the exponent of mx
    lowest = max(top - 126, -1022)
    u = uniform(seed, xv.size).astype(np.float64)
    m, e = np.frexp(a)
    main = (e - 1).astype(np.int64) - (top - 127) + (u < 2 * m - 1)
    tail = np.where(u < np.ldexp(a, -lowest), lowest - (top - 127), 0)
    c = np.where(a == 0, 0, np.where(a < np.ldexp(1.0, lowest), tail, main))
    return top, np.where(xv < 0, 0x80, 0) | c


# ---- codecs --------------------------------------------------------------------------------
def kept(k_param: float, n: int) -> int:
    if k_param < 1:
        return min(n, max(1, int(np.ceil(k_param * n)))) if n else 0
    return min(n, int(k_param))


def encode(codec: str, x: np.ndarray, dtype: str, *, k: int = 0, seed: int = 0,
           scaling: bool = True, prescale: float = 1.0, chunk: int = 4096, **dither) -> bytes:
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
        order = np.lexsort((np.arange(n), -magnitude_keys(x, dtype)))[:k]
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
    if codec in DITHER_FIXED:
        f = {**DITHER_DEFAULTS, **dither, **DITHER_FIXED[codec]}
        xv = to_acc(x, dtype).astype(np.float32)
        norm = dither_norm(xv, f["normalize"], f["clip"])
        codes = dither_codes(xv, norm, f["s"], f["partition"], seed)
        return (struct.pack("<IBBBBfI", tag(codec, dtype), f["s"], f["partition"], f["normalize"], 0,
                            float(norm), 0) + pack_codes(codes, dither_bits(f["s"])))
    if codec == "threshold":
        t = acc_type(dtype)(dither.get("threshold", 0.01))
        idx = np.nonzero(~(np.abs(to_acc(x, dtype)) <= t))[0].astype("<i4")
        ib = idx.tobytes() + b"\0" * ((idx.size * 4 + 7) // 8 * 8 - idx.size * 4)
        return struct.pack("<II", tag(codec, dtype), idx.size) + ib + x[idx].tobytes()
    if codec == "natural":
        top, codes = natural_parts(to_acc(x, dtype), seed)
        pad = b"\0" * ((n + 7) // 8 * 8 - n)
        return struct.pack("<Ii", tag(codec, dtype), top) + codes.astype(np.uint8).tobytes() + pad
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


def _topk_terms(payload: bytes, dtype: str, a):
    _, idx, vals = _topk_parts(payload, dtype)
    return idx.astype(np.int64), a * to_acc(vals, dtype)


def dgc_encode(x: np.ndarray, u: np.ndarray, v: np.ndarray, dtype: str, k: int,
               momentum_factor: float = 0.9, clip_norm: float = 0.0):
    """One DGC step: clip, momentum correction, threshold selection from a 1% strided sample,
    momentum factor masking. Returns (payload, new u, new v)."""
    A = acc_type(dtype)
    n = x.size
    g = to_acc(x, dtype)
    scale = A(1)
    if clip_norm > 0 and n:
        g64 = g.astype(np.float64)
        norm = np.sqrt(np.cumsum(g64 * g64)[-1])
        if A is np.float64:  # at float precision, so that the order of the sum cannot matter
            norm = float(np.float32(norm))
        if norm > clip_norm:
            scale = A(clip_norm / norm)
    with np.errstate(invalid="ignore", over="ignore"):  # inf gradients give NaN, as in C++
        u2 = from_acc(A(momentum_factor) * to_acc(u, dtype) + g * scale, dtype)
        v2 = from_acc(to_acc(v, dtype) + to_acc(u2, dtype), dtype)
    mag = magnitude_keys(v2, dtype)
    sel = np.zeros(0, np.int64)
    if k and n:
        stride = max(1, n // max(1, n // 100))
        sample = np.sort(mag[::stride])[::-1]
        m = sample.size
        r = max(1, (k * m + n // 2) // n)
        for _ in range(5):
            sel = np.nonzero(mag >= sample[min(r, m) - 1])[0]
            if sel.size * 5 >= k * 4 or r >= m:
                break
            r *= 2
        if sel.size > k:
            sel = np.sort(sel[np.lexsort((sel, -mag[sel]))[:k]])
    idx = np.zeros(k, "<i4")
    idx[:sel.size] = sel
    vals = zeros(k, dtype)
    vals[:sel.size] = v2[sel]
    ib = idx.tobytes() + b"\0" * ((k * 4 + 7) // 8 * 8 - k * 4)
    payload = struct.pack("<IIII", tag("dgc", dtype), k, sel.size, 0) + ib + vals.tobytes()
    u2[sel] = zeros(1, dtype)[0]
    v2[sel] = zeros(1, dtype)[0]
    return payload, u2, v2


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
    if codec in DITHER_FIXED:
        _, s, part, _, norm = struct.unpack("<IBBBxf", payload[:12])
        codes = unpack_codes(payload[16:], n, dither_bits(s))
        lev = np.abs(codes - s)
        if part == 0:
            mag = lev.astype(np.float32) * (np.float32(norm) / np.float32(s))
        else:
            mag = np.where(lev == 0, np.float32(0),
                           np.ldexp(np.float32(1), (lev - s).astype(np.int32))) * np.float32(norm)
        v = np.where(codes < s, -mag, mag).astype(np.float32)
        return np.arange(n), a * v.astype(A)
    if codec == "threshold":
        return _topk_terms(payload, dtype, a)
    if codec == "dgc":
        _, cap, count, _ = struct.unpack("<IIII", payload[:16])
        off = 16 + (cap * 4 + 7) // 8 * 8
        idx = np.frombuffer(payload[16:16 + 4 * count], "<i4").astype(np.int64)
        vals = np.frombuffer(payload[off:], _np_dtype(dtype))[:count]
        return idx, a * to_acc(vals, dtype)
    if codec == "natural":
        _, top = struct.unpack("<Ii", payload[:8])
        codes = np.frombuffer(payload[8:8 + n], np.uint8).astype(np.int64)
        mag_code = codes & 0x7F
        if top == INT32_MIN:
            mag = np.full(n, np.nan, A)
        else:
            mag = np.where(mag_code == 0, 0.0, np.ldexp(1.0, top - 127 + mag_code)).astype(A)
        return np.arange(n), a * np.where(codes & 0x80, -mag, mag)
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
    if out is None and codec not in ("topk", "randomk", "minmax8", "natural", "threshold", "dgc",
                                     *DITHER_FIXED):
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


def heavy_ball(x: np.ndarray, m: np.ndarray, factor: float, dtype: str):
    """torch.optim.SGD's momentum buffer (m = m*factor + x, each operation rounded to the
    dtype): what DGC's momentum correction is for a gradient it leaves uncompressed."""
    A = acc_type(dtype)
    scaled = from_acc(to_acc(m, dtype) * A(factor), dtype)
    m2 = from_acc(to_acc(scaled, dtype) + to_acc(x, dtype), dtype)
    return m2.copy(), m2


def ef_encode(codec: str, x: np.ndarray, e: np.ndarray, dtype: str, prescale: float = 1.0, **kw):
    """Vanilla error feedback: p = x + e; c = C(p); e = p - D(c). Returns (payload, new e)."""
    p = from_acc(to_acc(x, dtype) + to_acc(e, dtype), dtype)
    enc_kw = {k: v for k, v in kw.items()
              if k in ("k", "seed", "scaling", "chunk", "s", "partition", "normalize", "clip",
                       "threshold")}
    payload = encode(codec, p, dtype, prescale=prescale, **enc_kw)
    dec_kw = {k: v for k, v in kw.items() if k in ("k", "seed", "rescale")}
    return payload, decode(codec, payload, x.size, dtype, -1.0 / prescale, out=p, **dec_kw)


# ---- PowerSGD passes (csrc/cpu/powersgd.cc), every operation rounded where the kernels round --
def powersgd_project(g: np.ndarray, e_in: np.ndarray | None, qt: np.ndarray, dtype: str):
    """(P, M): M = ef_sum(g, e_in) in the gradient's dtype (g itself without e_in), and
    P[i, c] = sum_j M[i, j] * Qt[c, j] as eight partial sums, element j into partial j % 8 in
    ascending j, combined ((0+1)+(2+3))+((4+5)+(6+7))."""
    m = g if e_in is None else from_acc(to_acc(g, dtype) + to_acc(e_in, dtype), dtype)
    mv = to_acc(m, dtype)
    rows, cols = mv.shape
    prod = mv[:, None, :] * qt[None, :, :]  # rows x r x cols, each product rounded
    pad = -cols % 8
    prod = np.concatenate([prod, np.zeros(prod.shape[:2] + (pad,), prod.dtype)], axis=2)
    s = np.zeros(prod.shape[:2] + (8,), prod.dtype)
    for j in range(0, cols + pad, 8):  # in order: numpy's own sum would add pairwise
        s = s + prod[:, :, j:j + 8]
    return ((s[..., 0] + s[..., 1]) + (s[..., 2] + s[..., 3])) + \
        ((s[..., 4] + s[..., 5]) + (s[..., 6] + s[..., 7])), m


def powersgd_back_project(m: np.ndarray, p: np.ndarray, dtype: str) -> np.ndarray:
    """Qt[c, j] = sum over rows i, in order, of M[i, j] * P[i, c]."""
    mv = to_acc(m, dtype)
    qt = np.zeros((p.shape[1], mv.shape[1]), p.dtype)
    for i in range(mv.shape[0]):
        qt = qt + mv[i][None, :] * p[i][:, None]
    return qt


def powersgd_reconstruct(p: np.ndarray, qt: np.ndarray, out: np.ndarray, dtype: str,
                         alpha: float, subtract: bool) -> np.ndarray:
    """alpha * P Qt, or out - P Qt, each element's sum over c in order from 0."""
    acc = np.zeros((p.shape[0], qt.shape[1]), p.dtype)
    for c in range(p.shape[1]):
        acc = acc + p[:, c:c + 1] * qt[c][None, :]
    if subtract:
        return from_acc(to_acc(out, dtype) - acc, dtype)
    return from_acc(p.dtype.type(alpha) * acc, dtype)


# ---- homomorphic quantisation (THC) --------------------------------------------------------
def homo_lane_bits(levels: int, lane_ranks: int) -> int:
    """Smallest w with 2^w > levels * lane_ranks."""
    return (levels * lane_ranks).bit_length()


def homo_lanes(levels: int, lane_ranks: int) -> int:
    return 32 // homo_lane_bits(levels, lane_ranks)


def homo_words(n: int, levels: int, lane_ranks: int) -> int:
    return -(-n // homo_lanes(levels, lane_ranks))


def _block_of(n: int, block: int) -> np.ndarray:
    return np.arange(n, dtype=np.int64) // block


def homo_block_absmax(x: np.ndarray, dtype: str, block: int) -> np.ndarray:
    """max |x| per block of the float32 view of x; NaN (0x7fc00000) for a block holding a NaN."""
    xv = to_acc(x, dtype).astype(np.float32)
    nb = -(-xv.size // block)
    out = np.zeros(nb, np.float32)
    if xv.size:
        with np.errstate(invalid="ignore"):
            np.maximum.at(out, _block_of(xv.size, block), np.abs(xv))
        bad = np.zeros(nb, bool)
        np.logical_or.at(bad, _block_of(xv.size, block), np.isnan(xv))
        out[bad] = np.uint32(0x7FC00000).view(np.float32)
    return out


def homo_codes(x: np.ndarray, dtype: str, scales: np.ndarray, block: int, levels: int,
               seed: int) -> np.ndarray:
    """c in [0, levels]: t = (v / M + 1) * (levels / 2) in float32, clamped to [0, levels]
    (NaN to 0), rounded up when u < t - floor(t); 0 where M is not in (0, inf)."""
    xv = to_acc(x, dtype).astype(np.float32)
    n = xv.size
    m = np.asarray(scales, np.float32)[_block_of(n, block)]
    usable = (m > 0) & np.isfinite(m)
    lf = np.float32(levels)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        t = (xv / np.where(usable, m, np.float32(1)) + np.float32(1)) * (lf * np.float32(0.5))
    t = np.where(t > 0, t, np.float32(0))
    t = np.where(t < lf, t, lf)
    f = np.floor(t)
    c = f.astype(np.int64) + (uniform(seed, n) < t - f)
    return np.where(usable, c, 0)


def homo_pack(codes: np.ndarray, levels: int, lane_ranks: int) -> np.ndarray:
    w, lanes = homo_lane_bits(levels, lane_ranks), homo_lanes(levels, lane_ranks)
    nw = -(-codes.size // lanes)
    padded = np.zeros(nw * lanes, np.uint64)
    padded[:codes.size] = codes
    shifts = np.arange(lanes, dtype=np.uint64) * np.uint64(w)
    words = (padded.reshape(nw, lanes) << shifts).sum(axis=1, dtype=np.uint64)
    return words.astype(np.uint32).view(np.int32)


def homo_unpack(words: np.ndarray, n: int, levels: int, lane_ranks: int) -> np.ndarray:
    w, lanes = homo_lane_bits(levels, lane_ranks), homo_lanes(levels, lane_ranks)
    u = np.asarray(words, np.int32).view(np.uint32).astype(np.uint64)
    shifts = np.arange(lanes, dtype=np.uint64) * np.uint64(w)
    return ((u[:, None] >> shifts) & np.uint64((1 << w) - 1)).reshape(-1)[:n].astype(np.int64)


def homo_encode(x: np.ndarray, dtype: str, scales: np.ndarray, block: int, levels: int,
                lane_ranks: int, seed: int) -> np.ndarray:
    return homo_pack(homo_codes(x, dtype, scales, block, levels, seed), levels, lane_ranks)


def homo_values(words: np.ndarray, n: int, scales: np.ndarray, block: int, levels: int,
                lane_ranks: int, summands: int) -> np.ndarray:
    """float64 vd per element: M * ((2S - sL) / L); +0 where M == 0; NaN where M is NaN, inf
    or negative, or the lane sum S exceeds sL = summands * levels."""
    s = homo_unpack(words, n, levels, lane_ranks)
    sl = summands * levels
    m = np.asarray(scales, np.float32)[_block_of(n, block)].astype(np.float64)
    vd = m * ((2 * s - sl).astype(np.float64) / np.float64(levels))
    vd = np.where(m == 0, 0.0, vd)
    bad = ~(m >= 0) | ~np.isfinite(m) | (s > sl)
    return np.where(bad, np.float64(np.nan), vd)


def homo_decode(words: np.ndarray, n: int, dtype: str, scales: np.ndarray, block: int,
                levels: int, lane_ranks: int, summands: int, alpha: float = 1.0,
                out: np.ndarray | None = None) -> np.ndarray:
    """alpha * vd in the accumulator type (vd rounded to it first), or out + that."""
    A = acc_type(dtype)
    vd = homo_values(words, n, scales, block, levels, lane_ranks, summands)
    with np.errstate(over="ignore"):  # float16 overflows to inf, as the kernels' cast does
        terms = A(alpha) * vd.astype(A)
        if out is None:
            return from_acc(terms, dtype)
        return from_acc(to_acc(out, dtype) + terms, dtype)
