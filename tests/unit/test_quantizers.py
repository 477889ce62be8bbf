"""The stochastic quantisers (dithering, qsgd, terngrad, natural) against the numpy reference,
bit for bit for a given seed, and their statistical promises: unbiased in expectation, values
only on the declared levels, the same seed giving the same codes."""
from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

import hvd_compress as hc
import numpy_ref as ref
from helpers import params, payload_bytes, random_grad, same_bits, t2n
from hvd_compress.torch import _C

DTYPES = ["float32", "float16", "bfloat16", "float64"]
LENGTHS = [0, 1, 7, 8, 9, 31, 32, 33, 63, 65, 1000, 4097, 20011]
SPECS = ["dithering", "dithering,s=3,partition=natural", "dithering,s=127,normalize=l2",
         "dithering,s=1", "qsgd", "qsgd,s=4", "terngrad", "terngrad,clip=1.5", "natural"]


def setup(spec, n, seed):
    cfg = hc.parse_spec(spec)
    fields = cfg.kernel_fields(n)
    return cfg.codec, cfg.info.kernel_id, fields, params(seed=seed, **fields)


def encode(cid, x, p):
    payload = _C.new_payload(cid, x, p)
    _C.encode(cid, x, p, payload)
    return payload


def decoded(cid, payload, like, p):
    out = torch.empty_like(like)
    _C.decode(cid, payload, out, p, 1.0, False)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("spec", SPECS)
def test_encode_decode_match_reference(spec, n, dtype):
    codec, cid, fields, p = setup(spec, n, seed=12345 + n)
    x = random_grad(n, dtype, seed=n)
    payload = encode(cid, x, p)
    want = ref.encode(codec, t2n(x), dtype, seed=12345 + n, **fields)
    assert payload_bytes(payload) == want
    for alpha in (1.0, -0.5):
        out = torch.empty_like(x)
        _C.decode(cid, payload, out, p, alpha, False)
        assert same_bits(t2n(out), ref.decode(codec, want, n, dtype, alpha))
    base = random_grad(n, dtype, seed=n + 1)
    out = base.clone()
    _C.decode(cid, payload, out, p, 0.25, True)
    assert same_bits(t2n(out), ref.decode(codec, want, n, dtype, 0.25, out=t2n(base)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("spec", SPECS)
def test_aggregate_matches_reference(spec, ranks, dtype):
    n = 3001
    codec, cid, fields, _ = setup(spec, n, 0)
    payloads = []
    for r in range(ranks):
        p = params(seed=50 + r, **fields)
        payloads.append(encode(cid, random_grad(n, dtype, seed=100 + r), p))
    gathered = torch.stack([pl.view(torch.uint8).reshape(-1) for pl in payloads])
    out = torch.empty(n, dtype=random_grad(1, dtype).dtype)
    _C.aggregate(cid, gathered, out, p, 1.0 / ranks)
    want = ref.aggregate(codec, [payload_bytes(pl) for pl in payloads], n, dtype, 1.0 / ranks)
    assert same_bits(t2n(out), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", SPECS + ["minmax8"])
def test_aggregate_finds_whether_the_sum_is_finite(spec, dtype):
    """The step's finiteness check of three gathered payloads, found as the sum is written:
    the unchecked call's bits, and True exactly when every element of the sum is finite. With
    a NaN, and with the dtype's largest values on every rank, whose sum at alpha 1 overflows
    (where the codec keeps them: terngrad clips them), in a SIMD step or in the tail."""
    n = 3001
    codec, cid, fields, _ = setup(spec, n, 0)
    seen = set()
    for bad, at in ((None, 0), ("nan", n // 2), ("big", n // 2), ("big", n - 1)):
        xs = [random_grad(n, dtype, seed=700 + r) for r in range(3)]
        for x in xs:
            if bad == "big":
                x[at] = 0.9 * torch.finfo(x.dtype).max
        if bad == "nan":
            xs[2][at] = float("nan")
        payloads = [encode(cid, x, params(seed=80 + r, **fields)) for r, x in enumerate(xs)]
        gathered = torch.stack([pl.view(torch.uint8).reshape(-1) for pl in payloads])
        p = params(**fields)
        out, unchecked = torch.empty_like(xs[0]), torch.empty_like(xs[0])
        finite = _C.aggregate(cid, gathered, out, p, 1.0, check_finite=True)
        _C.aggregate(cid, gathered, unchecked, p, 1.0)
        assert same_bits(t2n(out), t2n(unchecked)), f"{bad} at {at}"
        assert finite == bool(torch.isfinite(out).all()), f"{bad} at {at}"
        seen.add(finite)
    assert seen == {True, False}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", SPECS)
def test_error_feedback_matches_reference(spec, dtype):
    n = 2050
    codec, cid, fields, p = setup(spec, n, seed=9)
    e = random_grad(n, dtype, seed=1) * 0.1
    e_ref = t2n(e)
    for step in range(3):
        x = random_grad(n, dtype, seed=10 + step)
        payload = _C.new_payload(cid, x, p)
        _C.ef_encode(cid, x, e, torch.zeros(0), p, payload)
        want, e_ref = ref.ef_encode(codec, t2n(x), e_ref, dtype, seed=9, **fields)
        assert payload_bytes(payload) == want
        assert same_bits(t2n(e), e_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", SPECS)
def test_error_feedback_edge_steps_match_reference(spec, dtype):
    """Dithering takes its residual in the coding pass: a zero gradient (zero norm), a NaN (a
    NaN norm: all NaN), a prescale, a tail past the vectorised blocks, and the residual written
    into a second buffer, all to the oracle's bits."""
    n = 1000 + 37
    codec, cid, fields, p = setup(spec, n, seed=5)
    p.prescale = 0.5
    src, dst = torch.zeros(n, dtype=random_grad(1, dtype).dtype), None
    dst = torch.full_like(src, 7.0)
    e_ref = t2n(src)
    for step in range(4):
        x = torch.zeros_like(src) if step == 0 else random_grad(n, dtype, seed=20 + step)
        if step == 3:
            x[n - 3] = float("nan")
        payload = _C.new_payload(cid, x, p)
        _C.ef_encode(cid, x, dst, torch.zeros(0), p, payload, e_in=src)
        want, e_ref = ref.ef_encode(codec, t2n(x), e_ref, dtype, prescale=0.5, seed=5, **fields)
        assert payload_bytes(payload) == want, f"step {step}"
        assert same_bits(t2n(dst), e_ref), f"step {step}"
        src, dst = dst, src


@pytest.mark.parametrize("spec", SPECS)
def test_unbiased_in_expectation(spec):
    """Mean of decodes over many seeds approaches the input. Each draw is one of the two levels
    around |x|, gap apart, so its variance is at most gap^2 / 4; every element's mean must lie
    within 6 such standard errors. Rounding to the nearest level instead (biased by up to half
    a gap) fails this by far."""
    n, trials = 500, 3000
    x = random_grad(n, "float32", seed=4)
    codec, cid, fields, _ = setup(spec, n, 0)
    seeds = [hc.derive_seed(0, "w", t) for t in range(trials)]  # as the frontends draw them
    draws = torch.stack([decoded(cid, encode(cid, x, params(seed=s, **fields)), x,
                                 params(**fields)).double() for s in seeds])
    norm = struct.unpack("<f", payload_bytes(encode(cid, x, params(**fields)))[8:12])[0]
    expect, mag = x.double(), x.double().abs()
    if codec == "natural":
        gap = mag  # between 2^e and 2^(e+1) around |x| >= 2^e
    elif fields["partition"] == 1:
        gap = torch.maximum(mag, torch.tensor(norm * 2.0 ** (1 - fields["s"])))
    else:
        gap = torch.full_like(mag, norm / fields["s"])
    if codec == "terngrad":  # unbiased for the gradient clipped at the codec's norm
        expect = expect.clamp(-norm, norm)
    err = (draws.mean(0) - expect).abs()
    assert torch.all(err <= 6 * gap / 2 / trials ** 0.5 + 1e-6 * mag)
    assert (draws.std(0) > 0).sum() > n // 10  # the draws really are random


@pytest.mark.parametrize("spec", SPECS)
def test_values_only_on_declared_levels(spec):
    n = 4000
    codec, cid, fields, p = setup(spec, n, seed=3)
    x = random_grad(n, "float32", seed=6)
    payload = payload_bytes(encode(cid, x, p))
    v = decoded(cid, torch.frombuffer(bytearray(payload), dtype=torch.uint8), x, p).double().abs()
    if codec == "natural":
        nz = v[v > 0]
        assert torch.equal(torch.exp2(torch.round(torch.log2(nz))), nz)  # powers of two only
        return
    s, norm = fields["s"], struct.unpack("<f", payload[8:12])[0]
    if fields["partition"] == 0:
        q = v / (np.float32(norm) / np.float32(s))
        assert torch.all((q - q.round()).abs() < 1e-4) and q.max() <= s + 1e-4
        assert len(torch.unique(q.round())) > 1
    else:
        levels = torch.tensor([0.0] + [2.0 ** (l - s) for l in range(1, s + 1)]) * norm
        assert torch.all(torch.isclose(v[:, None], levels[None].double(), rtol=1e-6).any(1))


@pytest.mark.parametrize("spec", SPECS)
def test_same_seed_same_codes(spec):
    n = 3000
    codec, cid, fields, _ = setup(spec, n, 0)
    x = random_grad(n, "float32", seed=2)
    a = payload_bytes(encode(cid, x, params(seed=11, **fields)))
    b = payload_bytes(encode(cid, x, params(seed=11, **fields)))
    c = payload_bytes(encode(cid, x, params(seed=12, **fields)))
    assert a == b and a != c


@pytest.mark.parametrize("spec,bits", [("dithering,s=1", 2), ("dithering,s=2", 3),
                                       ("dithering,s=3", 3), ("dithering", 5), ("qsgd", 8),
                                       ("terngrad", 2), ("natural", 8)])
def test_codes_use_the_fewest_bits(spec, bits):
    n = 64000  # whole 8-byte words of codes: no padding
    _, cid, _, p = setup(spec, n, 0)
    header = 8 if spec == "natural" else 16
    assert _C.new_payload(cid, torch.zeros(n), p).numel() == header + n * bits // 8


@pytest.mark.parametrize("spec", SPECS)
def test_non_finite_input_decodes_to_nan_and_zero_to_zero(spec):
    _, cid, _, p = setup(spec, 100, 1)
    x = random_grad(100, "float32", seed=1)
    x[40] = float("inf")
    assert torch.isnan(decoded(cid, encode(cid, x, p), x, p)).all()
    x[40] = float("nan")
    assert torch.isnan(decoded(cid, encode(cid, x, p), x, p)).all()
    z = torch.zeros(100)
    assert torch.equal(decoded(cid, encode(cid, z, p), z, p), z)


def test_terngrad_clips_at_clip_times_std():
    x = torch.cat([torch.randn(10000, generator=torch.Generator().manual_seed(0)),
                   torch.tensor([1000.0])])
    _, cid, _, p = setup("terngrad", x.numel(), 1)
    norm = struct.unpack("<f", payload_bytes(encode(cid, x, p))[8:12])[0]
    assert norm == pytest.approx(2.5 * x.double().std(unbiased=False).item(), rel=1e-5)
    assert norm < 1000.0


def test_ranks_with_other_settings_are_refused():
    x = random_grad(100, "float32")
    _, cid, fields, p = setup("dithering,s=4", 100, 0)
    theirs = encode(cid, x, params(**{**fields, "s": 5}))  # same payload size: 4-bit codes
    gathered = torch.stack([encode(cid, x, p).view(torch.uint8), theirs.view(torch.uint8)])
    with pytest.raises(ValueError, match="payload from rank 1 has s=5 .* this rank s=4"):
        _C.aggregate(cid, gathered, torch.empty(100), p, 0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("spec", SPECS)
def test_aggregate_pair_equals_aggregate_of_both_payloads(spec, n, dtype):
    """Two Gloo ranks gather these payloads by the int32 sum of their words: each rank
    reduces from its own payload and that sum what aggregate of both payloads in rank order
    gives (the numpy reference), bit for bit; one rank's NaN decodes to NaN everywhere. The
    step's finiteness check, found as the sum is written, is the reference's: for a NaN, and
    for the largest values of the dtype on both ranks, whose sum at alpha 1 overflows, in a
    SIMD step or in the tail after the last."""
    from test_kernels import summed_words
    codec, cid, fields, p = setup(spec, n, 0)
    for bad, at in ((None, 0), ("nan", n // 2), ("big", n // 2), ("big", n - 1)):
        xs = [random_grad(n, dtype, seed=300 + n + r) for r in range(2)]
        if bad == "nan" and n:
            xs[1][at] = float("nan")
        if bad == "big" and n:
            for x in xs:
                x[at] = 0.9 * torch.finfo(x.dtype).max
        payloads = [encode(cid, x, params(seed=60 + r, **fields)) for r, x in enumerate(xs)]
        raw = [payload_bytes(pl) for pl in payloads]
        summed = summed_words(raw)
        for alpha in (0.5, -0.25, 1.0):
            with np.errstate(over="ignore"):  # the overflow cases are meant
                want = ref.aggregate(codec, raw, n, dtype, alpha)
            for rank in range(2):
                out = torch.full((n,), 3.0, dtype=xs[0].dtype)
                finite = _C.aggregate_pair(cid, payloads[rank], summed, rank, out, p, alpha,
                                           check_finite=True)
                case = f"rank {rank}, alpha {alpha}, {bad} at {at}"
                assert same_bits(t2n(out), want), case
                assert finite == bool(torch.isfinite(out).all()), case


def test_large_error_feedback_matches_reference():
    """A residual large enough for non-temporal stores, written into a second buffer and then
    in place."""
    n = (9 << 20) // 4 + 5
    codec, cid, fields, p = setup("dithering", n, seed=2)
    e_in = random_grad(n, "float32", seed=1) * 0.1
    e_ref = t2n(e_in)
    e = torch.empty_like(e_in)
    for step in range(2):
        x = random_grad(n, "float32", seed=10 + step)
        payload = _C.new_payload(cid, x, p)
        _C.ef_encode(cid, x, e, torch.zeros(0), p, payload, e_in=e_in)
        want, e_ref = ref.ef_encode(codec, t2n(x), e_ref, "float32", seed=2, **fields)
        assert payload_bytes(payload) == want, f"step {step}"
        assert same_bits(t2n(e), e_ref), f"step {step}"
        e_in = e


def test_code_above_2s_decodes_to_nan():
    """No encoder makes a code above 2s, but the bit width holds one (s=3: 3 bits, codes 0..7):
    a damaged payload decodes to NaN there instead of reading past its decode table."""
    n = 1000
    _, cid, fields, p = setup("dithering,s=3", n, 0)
    payload = encode(cid, random_grad(n, "float32", seed=4), p).view(torch.uint8).reshape(-1)
    for j in (5, 500, n - 1):  # in a vectorised block and in the tail
        bit = 16 * 8 + 3 * j  # codes start after the 16-byte header
        for k in range(3):
            payload[(bit + k) // 8] |= 1 << ((bit + k) % 8)
    out = torch.zeros(n)
    _C.aggregate(cid, torch.stack([payload, payload]), out, p, 0.5)
    assert out.isnan().nonzero().flatten().tolist() == [5, 500, n - 1]


def test_large_aggregate_matches_reference():
    """An output large enough for non-temporal stores, three ranks."""
    n = (9 << 20) // 4 + 5
    codec, cid, fields, _ = setup("dithering", n, 0)
    payloads = [encode(cid, random_grad(n, "float32", seed=r), params(seed=r, **fields))
                for r in range(3)]
    out = torch.empty(n)
    _C.aggregate(cid, torch.stack([pl.view(torch.uint8).reshape(-1) for pl in payloads]), out,
                 params(**fields), 1.0 / 3)
    want = ref.aggregate(codec, [payload_bytes(pl) for pl in payloads], n, "float32", 1.0 / 3)
    assert same_bits(t2n(out), want)


# ---- natural: special values in every position, for the float32 SIMD path -------------------
# Run in-process against the reference (so once per path under HVDC_FORCE_SCALAR=0/1) and in
# two subprocesses against each other.
NATURAL_LENGTHS = list(range(1, 41)) + [100, 1000, 4097, 12291, 40001]
NATURAL_CASES = ["small", "unit", "large", "huge", "subnormal", "rising"]


def natural_input(n: int, case: str, seed: int) -> np.ndarray:
    """float32 values whose maximum sets top by `case` (small: lowest binade below the normal
    floats; huge: max float, so lowest = 2; rising: top grows along x, so early chunks are
    coded with a stale top), salted everywhere but at the maximum with zeros of both signs,
    values just below and at the lowest binade, float subnormals and mixed signs."""
    rng = np.random.default_rng(seed)
    if case == "subnormal":
        bits = rng.integers(0, 1 << 23, n).astype(np.uint32) | (rng.integers(0, 2, n).astype(np.uint32) << 31)
        return bits.view(np.float32)
    if case == "rising":
        x = rng.standard_normal(n) * np.exp2(np.arange(n) // 3000 * 3.0)
    else:
        scale = {"small": 2.0 ** -100, "unit": 1.0, "large": 2.0 ** 60, "huge": 2.0 ** 120}[case]
        x = rng.standard_normal(n) * scale
    x = x.astype(np.float32)
    keep = int(np.argmax(np.abs(x)))
    if case == "huge":
        x[keep] = np.float32(3.4e38)
    lowest = int(np.frexp(np.abs(x).max().astype(np.float64))[1]) - 126
    specials = np.array([0.0, -0.0, 2.0 ** lowest, -(2.0 ** lowest), 0.75 * 2.0 ** lowest,
                         -0.3 * 2.0 ** lowest, 0.999 * 2.0 ** lowest, 1e-3 * 2.0 ** lowest,
                         1e-40, -1e-45, 1.17e-38, -3.0, 2.0 ** -126]).astype(np.float32)
    salt = rng.random(n) < 0.3
    salt[keep] = False
    x[salt] = rng.choice(specials, int(salt.sum()))
    return x


def natural_roundtrip(x: np.ndarray, seed: int):
    """Payload, decode with alpha -0.5, and accumulate with alpha 0.25 into a fixed base."""
    n = x.size
    cid = ref.CODEC_ID["natural"]
    p = params(seed=seed)
    t = torch.from_numpy(x.copy())
    payload = encode(cid, t, p)
    out = torch.empty_like(t)
    _C.decode(cid, payload, out, p, -0.5, False)
    base = random_grad(n, "float32", seed=n + 3)
    acc = base.clone()
    _C.decode(cid, payload, acc, p, 0.25, True)
    return payload_bytes(payload), t2n(out), t2n(acc), t2n(base)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # 2^128 decodes to inf
@pytest.mark.parametrize("case", NATURAL_CASES)
@pytest.mark.parametrize("n", NATURAL_LENGTHS)
def test_natural_special_values_match_reference(n, case):
    x = natural_input(n, case, seed=n)
    payload, out, acc, base = natural_roundtrip(x, seed=77 + n)
    want = ref.encode("natural", x, "float32", seed=77 + n)
    assert payload == want
    assert same_bits(out, ref.decode("natural", want, n, "float32", -0.5))
    assert same_bits(acc, ref.decode("natural", want, n, "float32", 0.25, out=base))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 17, 33, 40, 4097, 12291])
def test_natural_non_finite_anywhere(n, bad):
    for pos in sorted({0, n // 2, n - 1, min(n - 1, 4096), min(n - 1, 8200)}):
        x = natural_input(n, "unit", seed=n)
        x[pos] = bad
        payload, out, acc, _ = natural_roundtrip(x, seed=5)
        assert payload == ref.encode("natural", x, "float32", seed=5)
        assert struct.unpack("<i", payload[4:8])[0] == ref.INT32_MIN
        assert np.isnan(out).all() and np.isnan(acc).all()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
@pytest.mark.parametrize("n", [1, 13, 40, 4097, 40001])
def test_natural_aggregate_special_values(n):
    cid = ref.CODEC_ID["natural"]
    payloads = [encode(cid, torch.from_numpy(natural_input(n, case, seed=r)), params(seed=r))
                for r, case in enumerate(["unit", "large", "small", "huge", "rising"])]
    gathered = torch.stack([pl.view(torch.uint8).reshape(-1) for pl in payloads])
    out = torch.empty(n)
    _C.aggregate(cid, gathered, out, params(), -0.3)
    want = ref.aggregate("natural", [payload_bytes(pl) for pl in payloads], n, "float32", -0.3)
    assert same_bits(t2n(out), want)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
@pytest.mark.parametrize("top", [-1001, -1000, -300, -150, -126, -104, -60, -6, 0, 1, 60, 127,
                                 128, 129, 1 << 20])
def test_natural_every_code_under_every_kind_of_top(top):
    """Every one of the 256 codes, in SIMD blocks and the tail, under tops whose values are
    normal, subnormal, zero or inf as floats, and tops no encoder makes (outside the range the
    AVX2 sum builds values from bits in, where it looks them up): decode, accumulate and a
    two-rank aggregate match the reference bit for bit."""
    cid = ref.CODEC_ID["natural"]
    n = 256 * 3 + 21
    codes = (np.arange(n) * 37 % 256).astype(np.uint8)
    tag = bytes(encode(cid, torch.zeros(1), params()).view(torch.uint8)[:4].tolist())
    pad = bytes((-n) % 8)
    payload = tag + struct.pack("<i", top) + codes.tobytes() + pad
    other = tag + struct.pack("<i", 3) + codes[::-1].tobytes() + pad
    as_tensor = [torch.frombuffer(bytearray(pl), dtype=torch.uint8) for pl in (payload, other)]
    out = torch.empty(n)
    _C.decode(cid, as_tensor[0], out, params(), -0.5, False)
    assert same_bits(t2n(out), ref.decode("natural", payload, n, "float32", -0.5))
    base = random_grad(n, "float32", seed=3)
    acc = base.clone()
    _C.decode(cid, as_tensor[0], acc, params(), 0.25, True)
    assert same_bits(t2n(acc), ref.decode("natural", payload, n, "float32", 0.25, out=t2n(base)))
    _C.aggregate(cid, torch.stack(as_tensor), out, params(), 0.7)
    assert same_bits(t2n(out), ref.aggregate("natural", [payload, other], n, "float32", 0.7))


def test_natural_simd_and_scalar_paths_agree(tmp_path):
    """Encode, decode, accumulate and a 4-rank aggregate give the same bytes on the AVX2 and
    the scalar path (subprocesses, since the path is chosen once per process)."""
    import os
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    script = tmp_path / "dump.py"
    script.write_text(
        "import sys, torch\n"
        f"sys.path[:0] = [{here!r}, {os.path.dirname(here)!r}]\n"
        "from helpers import params, payload_bytes\n"
        "from hvd_compress.torch import _C\n"
        "from test_quantizers import NATURAL_CASES, NATURAL_LENGTHS, natural_input, natural_roundtrip\n"
        "out = []\n"
        "for n in NATURAL_LENGTHS:\n"
        "    pls = []\n"
        "    for case in NATURAL_CASES:\n"
        "        x = natural_input(n, case, seed=n)\n"
        "        for bad in (None, float('nan'), float('inf')):\n"
        "            if bad is not None:\n"
        "                x = x.copy(); x[n // 3] = bad\n"
        "            pl, d, a, _ = natural_roundtrip(x, seed=n)\n"
        "            out += [pl, d.tobytes(), a.tobytes()]\n"
        "        pls.append(torch.frombuffer(bytearray(pl), dtype=torch.uint8))\n"
        "    agg = torch.empty(n)\n"
        "    _C.aggregate(10, torch.stack(pls[:4]), agg, params(), 0.7)\n"
        "    out.append(agg.numpy().tobytes())\n"
        "sys.stdout.buffer.write(b''.join(out))\n")
    runs = {}
    for mode in ("0", "1"):
        env = dict(os.environ, HVDC_FORCE_SCALAR=mode)
        runs[mode] = subprocess.run([sys.executable, str(script)], env=env, check=True,
                                    capture_output=True).stdout
    assert runs["0"] == runs["1"] and len(runs["0"]) > 0
