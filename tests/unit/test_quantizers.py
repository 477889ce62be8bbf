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
