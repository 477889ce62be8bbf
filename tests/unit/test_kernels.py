"""Every codec kernel against the numpy reference, bit for bit: payload bytes, decode,
aggregate, error feedback and momentum, over lengths that straddle the packing words and the
SIMD widths, and over every supported gradient dtype. Run twice by `make test`: once on the
AVX2 paths and once with HVDC_FORCE_SCALAR=1."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import numpy_ref as ref
from helpers import params, payload_bytes, random_grad, same_bits, t2n
from hvd_compress.torch import _C

DTYPES = ["float32", "float16", "bfloat16", "float64"]
LENGTHS = [0, 1, 7, 8, 31, 63, 64, 65, 127, 1000, 4097, 20011]
ID = ref.CODEC_ID
CHUNK = 100  # minmax8 in these tests: many chunks, and a short last one


def k_for(codec, n):
    return ref.kept(0.05, n) if codec in ("topk", "randomk") else 0


def encode(codec, x, p):
    payload = _C.new_payload(ID[codec], x, p)
    _C.encode(ID[codec], x, p, payload)
    return payload


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "onebit", "signsgd", "efsignsgd",
                                   "topk", "randomk", "minmax8"])
def test_encode_decode_match_reference(codec, n, dtype):
    x = random_grad(n, dtype, seed=n)
    k = k_for(codec, n)
    p = params(k=k, seed=12345 + n, chunk=CHUNK)
    payload = encode(codec, x, p)
    want = ref.encode(codec, t2n(x), dtype, k=k, seed=12345 + n, chunk=CHUNK)
    assert payload_bytes(payload) == want

    for alpha in (1.0, 0.5, -1.0):
        out = torch.empty_like(x)
        _C.decode(ID[codec], payload, out, p, alpha, False)
        assert same_bits(t2n(out), ref.decode(codec, want, n, dtype, alpha, k=k, seed=12345 + n))

    base = random_grad(n, dtype, seed=n + 1)
    out = base.clone()
    _C.decode(ID[codec], payload, out, p, 0.25, True)
    expect = ref.decode(codec, want, n, dtype, 0.25, out=t2n(base), k=k, seed=12345 + n)
    assert same_bits(t2n(out), expect)


@pytest.mark.parametrize("scaling", [True, False])
@pytest.mark.parametrize("codec", ["onebit", "signsgd"])
def test_sign_scaling_flag(codec, scaling):
    x = random_grad(1000, "float32")
    p = params(scaling=scaling)
    payload = encode(codec, x, p)
    assert payload_bytes(payload) == ref.encode(codec, t2n(x), "float32", scaling=scaling)
    scale = np.frombuffer(payload_bytes(payload)[4:8], np.float32)[0]
    assert (scale == 1.0) != scaling


def test_sign_zero_and_nan_count_as_positive():
    x = torch.tensor([0.0, -0.0, float("nan"), -1.0, 2.0])
    bits = payload_bytes(encode("onebit", x, params(scaling=False)))[8]
    assert bits == 0b01000  # only -1.0 is negative


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ranks", [1, 2, 3, 5])
@pytest.mark.parametrize("codec", ["bf16", "fp16", "onebit", "signsgd", "efsignsgd", "topk",
                                   "minmax8"])
def test_aggregate_matches_reference(codec, ranks, dtype):
    n = 3001
    k = k_for(codec, n)
    p = params(k=k, chunk=CHUNK)
    xs = [random_grad(n, dtype, seed=100 + r) for r in range(ranks)]
    payloads = [encode(codec, x, p) for x in xs]
    gathered = torch.stack([pl.view(torch.uint8).reshape(-1) for pl in payloads])
    for alpha in (1.0 / ranks, 1.0):
        out = torch.empty(n, dtype=xs[0].dtype)
        _C.aggregate(ID[codec], gathered, out, p, alpha)
        want = ref.aggregate(codec, [payload_bytes(pl) for pl in payloads], n, dtype, alpha, k=k)
        assert same_bits(t2n(out), want)


def test_minmax8_large_aggregate_and_error_feedback_match_reference():
    """The default chunk (whole SIMD steps, non-temporal stores into a large output), and error
    feedback in one pass into a second buffer, then in place."""
    n = (9 << 20) // 4 + 5
    p = params(chunk=4096)
    xs = [random_grad(n, "float32", seed=r) for r in range(3)]
    payloads = [encode("minmax8", x, p) for x in xs]
    out = torch.empty(n)
    _C.aggregate(ID["minmax8"], torch.stack([pl.view(torch.uint8).reshape(-1) for pl in payloads]),
                 out, p, 1.0 / 3)
    want = ref.aggregate("minmax8", [payload_bytes(pl) for pl in payloads], n, "float32", 1.0 / 3)
    assert same_bits(t2n(out), want)
    e_in = xs[2] * 0.1
    e_ref, e = t2n(e_in), torch.empty_like(e_in)
    for step in range(2):
        payload = _C.new_payload(ID["minmax8"], xs[step], p)
        _C.ef_encode(ID["minmax8"], xs[step], e, torch.zeros(0), p, payload, e_in=e_in)
        want, e_ref = ref.ef_encode("minmax8", t2n(xs[step]), e_ref, "float32", chunk=4096)
        assert payload_bytes(payload) == want, f"step {step}"
        assert same_bits(t2n(e), e_ref), f"step {step}"
        e_in = e


def summed_words(payloads: list[bytes]) -> torch.Tensor:
    """What Horovod's int32 allreduce of two ranks' words returns: each payload's bytes as
    little-endian words, the last one zero-padded, added with wrap-around."""
    words = [np.frombuffer(p + bytes(-len(p) % 4), np.uint32).astype(np.uint64) for p in payloads]
    return torch.from_numpy((sum(words) % (1 << 32)).astype(np.uint32).view(np.int32).copy())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("chunk", [CHUNK, 4096, 5000, 30])
def test_minmax8_aggregate_pair_equals_aggregate_of_both_payloads(chunk, n, dtype):
    """minmax8 from its own payload and the words' sum, as fp16 below: chunks whose codes
    start on a word (taken off the sum a block of at most 4096 at a time: 5000 is two) and
    chunks of 30 (they do not: the other payload is written out), a NaN chunk in one rank's
    payload. The step's finiteness check, found as the sum is written, agrees with the sum's,
    also for a NaN in the last element only (a tail after the last SIMD step, for most n)."""
    p = params(chunk=chunk)
    for bad in (None, 3, n - 1):
        xs = [random_grad(n, dtype, seed=400 + n + r) for r in range(2)]
        if bad is not None and 0 <= bad < n:
            xs[1][bad] = float("nan")
        payloads = [encode("minmax8", x, p) for x in xs]
        raw = [payload_bytes(pl) for pl in payloads]
        summed = summed_words(raw)
        for alpha in (0.5, -0.25):
            want = ref.aggregate("minmax8", raw, n, dtype, alpha)
            for rank in range(2):
                out = torch.full((n,), 3.0, dtype=xs[0].dtype)
                finite = _C.aggregate_pair(ID["minmax8"], payloads[rank], summed, rank, out, p,
                                           alpha, check_finite=True)
                case = f"rank {rank}, alpha {alpha}, NaN at {bad}"
                assert same_bits(t2n(out), want), case
                assert finite == bool(torch.isfinite(out).all()), case


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("codec", ["fp16", "bf16"])
def test_aggregate_pair_equals_aggregate_of_both_payloads(codec, n, dtype):
    """Two ranks that gather by a sum (collectives.gather_rows) reduce from their own payload
    and the words' sum: each rank gets what aggregate of both payloads in rank order gives (the
    numpy reference), bit for bit, for odd lengths (a last word half filled), NaN, inf and
    values that overflow half precision, and words whose sum wraps or carries between halves.
    The step's finiteness check, found as the sum is written, agrees with the sum's: with
    those values, with none, and with an inf in the last element only (for most n a tail after
    the last SIMD step)."""
    p = params()
    for case in ("special", "finite", "last"):
        xs = [random_grad(n, dtype, seed=200 + n + r) for r in range(2)]
        if case == "special" and n > 8:
            xs[0][:4] = torch.tensor([float("nan"), float("inf"), -1e6, 7e4]).to(xs[0].dtype)
            xs[1][5:8] = torch.tensor([float("-inf"), -0.0, 1e-30]).to(xs[1].dtype)
        if case == "last" and n:
            xs[1][n - 1] = float("inf")
        payloads = [encode(codec, x, p) for x in xs]
        raw = [payload_bytes(pl) for pl in payloads]
        summed = summed_words(raw)
        for alpha in (0.5, 1.0, -0.25):
            want = ref.aggregate(codec, raw, n, dtype, alpha)
            for rank in range(2):
                out = torch.empty(n, dtype=xs[0].dtype)
                finite = _C.aggregate_pair(ID[codec], payloads[rank], summed, rank, out, p,
                                           alpha, check_finite=True)
                where = f"rank {rank} alpha {alpha}, {case}"
                assert same_bits(t2n(out), want), where
                assert finite == bool(torch.isfinite(out).all()), where


# Past 2 MiB (kLaterBytes in csrc/cpu/common.h) a result that is read only later goes around the
# cache; 37 elements more leave a tail after the last whole SIMD step.
LATER_N = (3 << 20) // 4 + 37


@pytest.mark.parametrize("codec", ["fp16", "bf16", "onebit", "efsignsgd"])
def test_results_written_around_the_cache_match_reference(codec):
    """The decoded gradient, the pair's sum and error feedback's residual (into a second buffer,
    then in place) at a size whose stores bypass the cache, against the numpy reference."""
    n = LATER_N
    p = params()
    xs = [random_grad(n, "float32", seed=300 + r) for r in range(2)]
    payloads = [encode(codec, x, p) for x in xs]
    raw = [payload_bytes(pl) for pl in payloads]
    out = torch.empty(n)
    _C.decode(ID[codec], payloads[0], out, p, 0.5, False)
    assert same_bits(t2n(out), ref.decode(codec, raw[0], n, "float32", 0.5))
    if codec in ("fp16", "bf16"):
        want = ref.aggregate(codec, raw, n, "float32", 0.5)
        for rank in range(2):
            out = torch.empty(n)
            _C.aggregate_pair(ID[codec], payloads[rank], summed_words(raw), rank, out, p, 0.5)
            assert same_bits(t2n(out), want), f"rank {rank}"
    e_in = xs[1] * 0.1
    e_ref, e = t2n(e_in), torch.empty_like(e_in)
    carry = torch.zeros(_C.ef_carry_size(ID[codec]))
    for step in range(3):
        x = random_grad(n, "float32", seed=310 + step)
        payload = _C.new_payload(ID[codec], x, p)
        _C.ef_encode(ID[codec], x, e, carry, p, payload, e_in=e_in)
        want, e_ref = ref.ef_encode(codec, t2n(x), e_ref, "float32")
        assert payload_bytes(payload) == want, f"step {step}"
        settled, settled_carry = e.clone(), carry.clone()
        _C.ef_settle(ID[codec], settled, settled_carry)
        assert same_bits(t2n(settled), e_ref), f"step {step}"
        e_in = e  # and from here in place


def test_aggregate_pair_refuses_what_it_cannot_reduce():
    x = random_grad(10, "float32")
    p = params()
    own = encode("fp16", x, p)
    summed = torch.zeros(5, dtype=torch.int32)
    out = torch.empty(10)
    sign = encode("onebit", x, p)
    with pytest.raises(ValueError, match="takes fp16, bf16, minmax8, dithering or natural payloads, not onebit"):
        _C.aggregate_pair(ID["onebit"], sign, torch.zeros(-(-sign.numel() // 4), dtype=torch.int32),
                          0, out, p, 1.0)
    with pytest.raises(ValueError, match="rank must be 0 or 1, got 2"):
        _C.aggregate_pair(ID["fp16"], own, summed, 2, out, p, 1.0)
    with pytest.raises(ValueError, match="int32 vector of 5 elements, got Int\\[4\\]"):
        _C.aggregate_pair(ID["fp16"], own, summed[:4], 0, out, p, 1.0)
    with pytest.raises(ValueError, match="payload has 20 bytes, the codec needs 18"):
        _C.aggregate_pair(ID["fp16"], own, summed, 0, out[:9], p, 1.0)


def test_the_registry_names_the_codecs_that_pair_aggregate():
    from hvd_compress.registry import codecs
    for info in codecs():
        assert info.pair_aggregates == _C.pair_aggregates(info.kernel_id), info.name


def test_signsgd_is_a_majority_vote():
    xs = [torch.tensor([1.0, -1.0, 1.0, -1.0]), torch.tensor([1.0, -1.0, -1.0, 1.0]),
          torch.tensor([-1.0, -1.0, 1.0, 1.0])]
    p = params(scaling=False)
    gathered = torch.stack([encode("signsgd", x, p).view(torch.uint8).reshape(-1) for x in xs])
    out = torch.empty(4)
    _C.aggregate(ID["signsgd"], gathered, out, p, 1.0 / 3)
    assert out.tolist() == [1.0, -1.0, 1.0, 1.0]
    out2 = torch.empty(4)
    _C.aggregate(ID["signsgd"], gathered[:2], out2, p, 0.5)
    assert out2.tolist() == [1.0, -1.0, 0.0, 0.0]  # ties give 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "onebit", "signsgd", "efsignsgd",
                                   "topk", "randomk", "minmax8"])
def test_error_feedback_matches_reference(codec, dtype):
    n = 2050
    k = k_for(codec, n)
    prescale = 0.5 if codec == "fp16" else 1.0
    p = params(k=k, seed=9, prescale=prescale, chunk=CHUNK)
    e = random_grad(n, dtype, seed=1) * 0.1
    carry = torch.zeros(_C.ef_carry_size(ID[codec]))
    e_ref = t2n(e)
    for step in range(3):
        x = random_grad(n, dtype, seed=10 + step)
        payload = _C.new_payload(ID[codec], x, p)
        _C.ef_encode(ID[codec], x, e, carry, p, payload)  # e stays lazy across steps
        want, e_ref = ref.ef_encode(codec, t2n(x), e_ref, dtype, prescale=prescale, k=k, seed=9,
                                    chunk=CHUNK)
        assert payload_bytes(payload) == want
        settled, settled_carry = e.clone(), carry.clone()
        _C.ef_settle(ID[codec], settled, settled_carry)
        assert same_bits(t2n(settled), e_ref)
        assert not settled_carry.any()


@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "onebit", "signsgd", "efsignsgd",
                                   "topk", "randomk", "minmax8"])
def test_error_feedback_invariant_float64(codec):
    """g + e_old == D(C(g + e_old)) + e_new, the defining property of error feedback."""
    n = 5003
    k = k_for(codec, n)
    p = params(k=k, seed=3)
    e = torch.zeros(n, dtype=torch.float64)
    carry = torch.zeros(_C.ef_carry_size(ID[codec]))
    for step in range(4):
        g = random_grad(n, "float64", seed=step)
        before = (g + e).clone()
        payload = _C.new_payload(ID[codec], g, p)
        _C.ef_encode(ID[codec], g, e, carry, p, payload)
        _C.ef_settle(ID[codec], e, carry)
        decoded = torch.empty_like(g)
        _C.decode(ID[codec], payload, decoded, p, 1.0, False)
        np.testing.assert_allclose((decoded + e).numpy(), before.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "onebit", "signsgd", "efsignsgd",
                                   "topk", "randomk", "minmax8", "threshold"])
def test_error_feedback_into_another_buffer_equals_in_place(codec, dtype):
    """With e_in, the old residual is read from e_in and the new one written into e (how a step's
    transaction keeps the old one as its backup, uncopied): the payload and the residual have
    the bits of the update in place, e is written in full and e_in is left as it was. Top-k
    (and threshold but for float32 under AVX2) then add the residual in a pass of its own, not
    in their selection."""
    n = 4097
    k = k_for(codec, n)
    p = params(k=k, seed=9, chunk=CHUNK, **({"threshold": 0.5} if codec == "threshold" else {}))
    in_place = random_grad(n, dtype, seed=1) * 0.1
    src, dst = in_place.clone(), torch.empty_like(in_place)
    carries = [torch.zeros(_C.ef_carry_size(ID[codec])) for _ in range(2)]
    for step in range(3):
        x = random_grad(n, dtype, seed=10 + step)
        if step == 1 and x.is_floating_point():
            x[7] = float("nan")
        pa, pb = _C.new_payload(ID[codec], x, p), _C.new_payload(ID[codec], x, p)
        _C.ef_encode(ID[codec], x, in_place, carries[0], p, pa)
        before = src.clone()
        dst.fill_(12345.0)
        _C.ef_encode(ID[codec], x, dst, carries[1], p, pb, e_in=src)
        used = _C.encoded_bytes(ID[codec], pa, x, p)
        assert used == _C.encoded_bytes(ID[codec], pb, x, p)
        assert payload_bytes(pa)[:used] == payload_bytes(pb)[:used]
        assert same_bits(t2n(dst), t2n(in_place))
        assert same_bits(t2n(src), t2n(before))
        assert same_bits(t2n(carries[0]), t2n(carries[1]))
        src, dst = dst, src  # the store's two buffers swap roles every step


def test_error_feedback_refuses_overlapping_residuals():
    x, buf = torch.ones(10), torch.zeros(12)
    p = params()
    payload = _C.new_payload(ID["onebit"], x, p)
    with pytest.raises(ValueError, match="e_in and e overlap without being the same buffer"):
        _C.ef_encode(ID["onebit"], x, buf[2:], torch.zeros(1), p, payload, e_in=buf[:10])
    with pytest.raises(ValueError, match="e_in must match the gradient"):
        _C.ef_encode(ID["onebit"], x, buf[:10], torch.zeros(1), p, payload, e_in=torch.zeros(9))


def test_efsignsgd_equals_onebit_with_error_feedback():
    x = random_grad(10000, "float32")
    e1, e2 = torch.zeros(10000), torch.zeros(10000)
    c1, c2 = torch.zeros(1), torch.zeros(1)
    p = params()
    for step in range(3):
        pa = _C.new_payload(ID["efsignsgd"], x, p)
        pb = _C.new_payload(ID["onebit"], x, p)
        _C.ef_encode(ID["efsignsgd"], x, e1, c1, p, pa)
        _C.ef_encode(ID["onebit"], x, e2, c2, p, pb)
        assert payload_bytes(pa)[4:] == payload_bytes(pb)[4:]  # all but the codec tag
        assert torch.equal(e1, e2) and torch.equal(c1, c2)


def test_ef_carry_is_required_and_checked():
    x = torch.ones(10)
    e = torch.zeros(10)
    p = params()
    payload = _C.new_payload(ID["onebit"], x, p)
    with pytest.raises(ValueError, match="carry must be a contiguous float32 tensor of 1"):
        _C.ef_encode(ID["onebit"], x, e, torch.zeros(0), p, payload)
    with pytest.raises(ValueError, match="must match the gradient"):
        _C.ef_encode(ID["onebit"], x, torch.zeros(11), torch.zeros(1), p, payload)
    with pytest.raises(ValueError, match="payload has 8 bytes, the codec needs 16"):
        _C.ef_encode(ID["onebit"], x, e, torch.zeros(1), p, payload[:8])


@pytest.mark.parametrize("dtype", DTYPES)
def test_nesterov_matches_reference(dtype):
    n = 777
    x = random_grad(n, dtype, seed=1)
    m = random_grad(n, dtype, seed=2)
    want_x, want_m = ref.nesterov(t2n(x), t2n(m), 0.9, dtype)
    _C.nesterov(x, m, 0.9)
    assert same_bits(t2n(x), want_x) and same_bits(t2n(m), want_m)


@pytest.mark.parametrize("dtype", DTYPES)
def test_heavy_ball_matches_reference(dtype):
    x, m = random_grad(777, dtype, seed=1), random_grad(777, dtype, seed=2)
    _, want = ref.heavy_ball(t2n(x), t2n(m), 0.7, dtype)
    out = torch.empty_like(x)
    _C.heavy_ball(x, m, out, 0.7)
    assert same_bits(t2n(out), want)
    _C.heavy_ball(x, m, x, 0.7)  # in place, on the gradient
    assert same_bits(t2n(x), want)


@pytest.mark.parametrize("n,k", [(200003, 2000), (100000, 1), (50000, 3000), (30, 30), (1, 1)])
def test_topk_selection_large(n, k):
    """Large tensors take the sampled-threshold path; the result must still be the exact top k."""
    x = random_grad(n, "float32", seed=n)
    payload = encode("topk", x, params(k=k))
    assert payload_bytes(payload) == ref.encode("topk", t2n(x), "float32", k=k)


@pytest.mark.parametrize("dtype", ["float64", "float16", "bfloat16"])
def test_topk_selection_large_other_dtypes(dtype):
    """The sampled threshold bins keys by their top bits, which sit differently per dtype."""
    x = random_grad(200003, dtype, seed=7)
    payload = encode("topk", x, params(k=2000))
    assert payload_bytes(payload) == ref.encode("topk", t2n(x), dtype, k=2000)


def topk_sampled(n: int) -> torch.Tensor:
    """The positions whose keys the top-k kernel's threshold sample reads on a tensor of
    n > 65536 elements: 4096 runs of 16, evenly spaced."""
    gap = n // 4096 // 16 * 16
    return (torch.arange(4096)[:, None] * gap + torch.arange(16)).flatten()


def test_topk_sample_that_overrates_the_tail_widens():
    """Every sampled element large, the rest tiny: the first threshold lets through fewer than
    k, so the selection must lower it and still return the exact top k."""
    n, k = 200003, 3000
    x = random_grad(n, "float32", seed=3) * 1e-3
    x[topk_sampled(n)] = torch.arange(1, 65537, dtype=torch.float32)
    payload = encode("topk", x, params(k=k))
    assert payload_bytes(payload) == ref.encode("topk", t2n(x), "float32", k=k)


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("tail", ["random", "overrated"])
def test_topk_error_feedback_on_a_sampled_tensor(dtype, tail):
    """Top-k's error feedback adds the residual and collects candidates in one pass, from a
    sample of the sums; when that sample overrates the tail, the second pass reads the sums
    the first one wrote. Both must equal accumulating first and selecting after."""
    n, k = 200003, 3000
    p = params(k=k)
    e = random_grad(n, dtype, seed=1) * 0.1
    e_ref = t2n(e)
    for step in range(2):
        x = random_grad(n, dtype, seed=10 + step) * 1e-3
        if tail == "overrated":
            x[topk_sampled(n)] = torch.arange(1, 65537, dtype=torch.float64).to(x.dtype)
        payload = _C.new_payload(ID["topk"], x, p)
        _C.ef_encode(ID["topk"], x, e, torch.zeros(0), p, payload)
        want, e_ref = ref.ef_encode("topk", t2n(x), e_ref, dtype, k=k)
        assert payload_bytes(payload) == want
        assert same_bits(t2n(e), e_ref)


def mostly_zeros(n, dtype, where, seed):
    """An embedding's gradient: zeros (some negative) but for the rows a batch used."""
    x = random_grad(n, dtype, seed=seed)
    keep = torch.zeros(n, dtype=torch.bool)
    if where == "start":
        keep[:300] = True
    elif where == "end":
        keep[-300:] = True
    elif where == "scattered":
        keep[torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:300]] = True
    return torch.where(keep, x, torch.where(torch.arange(n) % 5 == 0, -0.0, 0.0).to(x.dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [5000, 200003])
@pytest.mark.parametrize("where", ["start", "end", "scattered", "none"])
@pytest.mark.parametrize("ef", [False, True])
def test_topk_with_fewer_nonzeros_than_k(ef, where, n, dtype):
    """k above the nonzero count (an embedding's unused rows): the nonzeros and then the zeros
    of lowest index, taken without collecting and ranking every zero, exact as the reference,
    in the exact (n under the sample) and the sampled path."""
    k = 1000
    p = params(k=k)
    e = torch.zeros(n, dtype=random_grad(1, dtype).dtype)
    e_ref = t2n(e)
    for step in range(2):
        x = mostly_zeros(n, dtype, where, seed=step)
        if ef:
            payload = _C.new_payload(ID["topk"], x, p)
            _C.ef_encode(ID["topk"], x, e, torch.zeros(0), p, payload)
            want, e_ref = ref.ef_encode("topk", t2n(x), e_ref, dtype, k=k)
            assert same_bits(t2n(e), e_ref)
        else:
            payload = encode("topk", x, p)
            want = ref.encode("topk", t2n(x), dtype, k=k)
        assert payload_bytes(payload) == want


def test_topk_ties_take_lowest_indices():
    x = torch.ones(100000)
    x[5] = 3.0
    payload = payload_bytes(encode("topk", x, params(k=4)))
    idx = np.frombuffer(payload[8:24], "<i4")
    assert idx.tolist() == [0, 1, 2, 5]


def test_topk_adversarial_order():
    """Sorted input defeats a naive strided sample; the retry path must still be exact."""
    x = torch.linspace(-1, 1, 300001)
    for k in (1, 1000, 10000):
        assert payload_bytes(encode("topk", x, params(k=k))) == ref.encode(
            "topk", t2n(x), "float32", k=k)


def test_fp16_prescale_and_overflow():
    x = torch.tensor([70000.0, -70000.0, 65504.0, 1e-8, float("inf"), float("nan")])
    payload = encode("fp16", x, params(prescale=0.5))
    assert payload_bytes(payload) == ref.encode("fp16", t2n(x), "float32", prescale=0.5)
    h = payload.numpy()
    assert h[0] == 35008 and h[1] == -35008  # fp16 spacing is 32 there and np.isinf(h[4]) and np.isnan(h[5])


def test_bf16_rounding_is_nearest_even():
    bits = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x7F7FFFFF, 0x7FC00001], np.uint32)
    x = torch.from_numpy(bits.view(np.float32).copy())
    got = np.frombuffer(payload_bytes(encode("bf16", x, params())), np.uint16)
    assert got.tolist() == [0x3F80, 0x3F82, 0x3F81, 0x7F80, 0x7FC0]


def test_randomk_indices_are_stratified_and_distinct():
    n, k = 10007, 100
    idx, size = ref.randomk_strata(n, k, seed=77)
    assert len(set(idx.tolist())) == k and np.all(np.diff(idx) > 0)
    lo = np.array([(j * n) // k for j in range(k)])
    assert np.all(idx >= lo) and np.all(idx < lo + size)
    x = torch.arange(n, dtype=torch.float64)
    payload = encode("randomk", x, params(k=k, seed=77))
    assert payload.numpy().astype(np.int64).tolist() == idx.tolist()


def test_randomk_unbiased_with_rescale():
    """Mean of rescaled decodes over many seeds approaches x (statistical bound, not exact)."""
    n, k, trials = 1000, 100, 4000
    x = random_grad(n, "float64", seed=5)
    total = torch.zeros(n, dtype=torch.float64)
    for s in range(trials):
        p = params(k=k, seed=s * 7919 + 1, rescale=True)
        out = torch.empty_like(x)
        _C.decode(ID["randomk"], encode("randomk", x, p), out, p, 1.0, False)
        total += out
    mean = total / trials
    # Each element is kept with probability 1/10 and scaled by 10: per-trial variance 9 x^2.
    bound = 5 * torch.sqrt(9 * x * x / trials) + 1e-12
    assert torch.all((mean - x).abs() <= bound)


def test_randomk_indices_uniform_within_stratum():
    n, k, trials = 1000, 10, 5000
    counts = np.zeros(n)
    for s in range(trials):
        idx, _ = ref.randomk_strata(n, k, seed=s)
        counts[idx] += 1
    # 100 positions per stratum, expected 50 hits each; chi-square with 999 dof.
    chi2 = ((counts - trials / 100) ** 2 / (trials / 100)).sum()
    assert chi2 < 999 + 6 * np.sqrt(2 * 999)
    # and the kernel draws exactly those indices
    x = torch.arange(n, dtype=torch.float64)
    got = encode("randomk", x, params(k=k, seed=4242)).numpy().astype(int)
    assert got.tolist() == ref.randomk_strata(n, k, seed=4242)[0].tolist()


@pytest.mark.parametrize("codec", ["fp16", "onebit", "topk", "randomk"])
def test_non_contiguous_input(codec):
    base = random_grad(4000, "float32").view(40, 100)
    x = base[:, ::2]
    assert not x.is_contiguous()
    k = k_for(codec, x.numel())
    p = params(k=k, seed=1)
    assert payload_bytes(encode(codec, x, p)) == payload_bytes(encode(codec, x.contiguous(), p))


def test_scalar_and_simd_paths_agree(tmp_path):
    """The AVX2 and scalar paths give the same bytes (checked in a subprocess, since the path is
    chosen once per process)."""
    import subprocess
    import sys
    script = tmp_path / "dump.py"
    script.write_text(
        "import sys, torch\n"
        f"sys.path.insert(0, {str(__import__('os').path.dirname(__file__) + '/..')!r})\n"
        "from helpers import params, random_grad, payload_bytes\n"
        "from hvd_compress.torch import _C\n"
        "out = []\n"
        "for c in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10):\n"
        "    for n in (1, 65, 4099, 70001):\n"
        "        x = random_grad(n, 'float32', seed=n)\n"
        "        p = params(k=max(1, n // 50), seed=3)\n"
        "        pl = _C.new_payload(c, x, p); _C.encode(c, x, p, pl)\n"
        "        e = random_grad(n, 'float32', seed=1); pe = _C.new_payload(c, x, p)\n"
        "        cr = torch.full((_C.ef_carry_size(c),), 0.3)\n"
        "        _C.ef_encode(c, x, e, cr, p, pe); _C.ef_encode(c, x, e, cr, p, pe)\n"
        "        d = torch.empty(n); _C.decode(c, pl, d, p, 0.5, False)\n"
        "        out.append(payload_bytes(pl) + payload_bytes(pe) + e.numpy().tobytes() + d.numpy().tobytes())\n"
        "sys.stdout.buffer.write(b''.join(out))\n")
    runs = {}
    for mode in ("0", "1"):
        env = dict(__import__("os").environ, HVDC_FORCE_SCALAR=mode)
        runs[mode] = subprocess.run([sys.executable, str(script)], env=env, check=True,
                                    capture_output=True).stdout
    assert runs["0"] == runs["1"] and len(runs["0"]) > 0


def test_isa_reported():
    assert _C.cpu_isa() in ("avx2+f16c", "scalar")


@pytest.mark.parametrize("codec", ["fp16", "bf16"])
def test_special_values_inside_simd_blocks(codec):
    """NaN, infinities, signed zeros, float subnormals and values that overflow half precision,
    placed inside full SIMD blocks (not only in the scalar tail)."""
    x = random_grad(100, "float32", seed=3)
    x[3], x[17], x[18], x[40], x[41] = float("nan"), float("inf"), float("-inf"), 1e-40, -0.0
    x[70], x[71], x[72] = 65520.0, 3.3e38, -5.9e-8
    payload = encode(codec, x, params())
    assert payload_bytes(payload) == ref.encode(codec, t2n(x), "float32")
    out = torch.empty_like(x)
    _C.decode(ID[codec], payload, out, params(), 1.0, False)
    assert torch.isnan(out[3]) and out[17] == float("inf") and out[18] == float("-inf")
    for alpha in (1.0, 0.5):  # 0.5: an average, decoded with its multiply in the SIMD blocks
        _C.decode(ID[codec], payload, out, params(), alpha, False)
        assert same_bits(t2n(out), ref.decode(codec, payload_bytes(payload), 100, "float32", alpha))


def test_minmax8_levels_bounds_and_nan():
    zeros = torch.tensor([-0.0, 0.0, -0.0, 0.0] * 10)  # signed zeros: bounds stored as +0
    assert payload_bytes(encode("minmax8", zeros, params(chunk=20))) == ref.encode(
        "minmax8", t2n(zeros), "float32", chunk=20)
    x = torch.tensor([-1.0, 0.0, 1.0, 0.5, float("nan"), 2.0, 3.0])
    p = params(chunk=4)
    payload = encode("minmax8", x, p)
    assert payload_bytes(payload) == ref.encode("minmax8", t2n(x), "float32", chunk=4)
    out = torch.empty(7)
    _C.decode(ID["minmax8"], payload, out, p, 1.0, False)
    assert out[:4].tolist() == [-1.0, pytest.approx(0.0, abs=1e-2), 1.0, pytest.approx(0.5, abs=1e-2)]
    assert torch.isnan(out[4:]).all()  # the chunk holding a NaN decodes to NaN
    # decoded values lie on the 256 levels of their chunk: error at most half a level
    y = random_grad(5000, "float32", seed=8)
    pl = encode("minmax8", y, params(chunk=500))
    dec = torch.empty(5000)
    _C.decode(ID["minmax8"], pl, dec, params(chunk=500), 1.0, False)
    for s in range(0, 5000, 500):
        seg = y[s:s + 500]
        half = (seg.max() - seg.min()) / 255 / 2
        assert ((dec[s:s + 500] - seg).abs() <= half * 1.001 + 1e-7).all()


def test_powersgd_initial_q_is_a_standard_normal_draw_of_seed_name_and_step():
    """PowerSGD's first Q comes from a kernel, not torch's generator, so any frontend draws the
    same: standard normals, a pure function of (seed, name, step), float32 the rounded float64."""
    from hvd_compress.torch.powersgd import initial_q
    q = initial_q(3, "layer/w", 7, 4, 50000, torch.float64)
    assert abs(q.mean().item()) < 0.01 and abs(q.std().item() - 1.0) < 0.01
    assert abs((q.abs() > 1.96).double().mean().item() - 0.05) < 0.005
    assert torch.equal(q, initial_q(3, "layer/w", 7, 4, 50000, torch.float64))
    assert not torch.equal(q, initial_q(3, "layer/w", 8, 4, 50000, torch.float64))
    assert torch.equal(initial_q(3, "layer/w", 7, 4, 50000, torch.float32), q.float())


@pytest.mark.parametrize("spec", ["powersgd,rank=2,start_iter=1", "powersgd,rank=1,start_iter=0",
                                  "powersgd,rank=3,start_iter=0,error_feedback=false"])
def test_powersgd_kernel_simulation_agrees_with_the_float64_one(spec):
    """The bit-exact oracle of the backward_passes_per_step tests runs the kernels; checked here
    against the independent float64 numpy simulation, over steps with warm start and EF."""
    from simulation import PowerSGDKernelSimulation, PowerSGDSimulation, bpps_pass_grads
    exact, f64 = PowerSGDKernelSimulation(spec, "w", 3), PowerSGDSimulation(spec, "w", 3)
    for step in range(4):
        grads = bpps_pass_grads(step, 0, 3)
        got, want = exact(grads), f64(grads)
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())


# rows around the back-projection's blocks of 4, columns around 8 (project's partial sums) and
# the reconstruction's register blocks (64 float32 or 32 float64 sums), ranks past 8.
POWERSGD_SHAPES = [(1, 1, 1), (3, 7, 2), (4, 8, 4), (5, 65, 3), (9, 200, 4), (6, 33, 9),
                   (13, 129, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols,r", POWERSGD_SHAPES)
def test_powersgd_passes_match_numpy_bit_for_bit(rows, cols, r, dtype):
    """Project (with and without error feedback), back-project and both reconstructions against
    the numpy passes that add in the kernels' order: on the AVX2 path and the scalar one."""
    ftype = torch.float64 if dtype == "float64" else torch.float32
    g = random_grad(rows * cols, dtype, seed=rows).view(rows, cols)
    e = random_grad(rows * cols, dtype, seed=cols).view(rows, cols)
    qt = torch.randn(1, r, cols, dtype=ftype, generator=torch.Generator().manual_seed(r))
    for ef in (True, False):
        e_out = e.clone()
        p = torch.empty(1, rows, r, dtype=ftype)
        _C.powersgd_project([g], [e_out], ef, qt, p)
        want_p, want_m = ref.powersgd_project(t2n(g), t2n(e) if ef else None, t2n(qt[0]), dtype)
        assert same_bits(t2n(p[0]), want_p), f"P, ef={ef}"
        assert same_bits(t2n(e_out), want_m if ef else t2n(e)), f"M, ef={ef}"
    p = p / p.abs().amax()  # orthonormal-sized factors keep the products in half's range
    q = torch.empty(1, r, cols, dtype=ftype)
    _C.powersgd_back_project([g], p, q)
    assert same_bits(t2n(q[0]), ref.powersgd_back_project(t2n(g), t2n(p[0]), dtype))
    for alpha, subtract in ((1.0, True), (0.5, False)):
        out = e.clone()
        _C.powersgd_reconstruct(p, qt, [out], alpha, subtract)
        want = ref.powersgd_reconstruct(t2n(p[0]), t2n(qt[0]), t2n(e), dtype, alpha, subtract)
        assert same_bits(t2n(out), want), f"reconstruct, subtract={subtract}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [3000, 3003])
@pytest.mark.parametrize("bad", [None, 0, 4, 5, 23, 39, "last column"])
def test_powersgd_reconstruct_reports_whether_what_it_wrote_is_finite(dtype, cols, bad):
    """check_finite: the same bits as the unchecked call, and True exactly when every output
    element is finite in the output's dtype, whichever row holds the non-finite one (first,
    last, middle) or when only the last column does (past the vector loop at 3003 columns;
    float32 outputs are checked in registers, the others row by row). Rows of 1e3 factors
    overflow float16 but not the other dtypes; NaN and inf factors are non-finite everywhere."""
    ftype = torch.float64 if dtype == "float64" else torch.float32
    rows, r = 40, 3
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(2, rows, r, dtype=ftype, generator=gen)
    qt = torch.randn(2, r, cols, dtype=ftype, generator=gen)
    if bad == "last column":
        qt[1, :, -1] = float("inf")
    elif bad is not None:
        p[1, bad] = float("nan") if bad % 2 else 1e3
        qt[1, :, bad * 7] = 1e3
    for alpha, subtract in ((0.5, False), (1.0, True)):
        base = random_grad(2 * rows * cols, dtype, seed=3).view(2, rows, cols)
        plain, checked = base.clone(), base.clone()
        assert _C.powersgd_reconstruct(p, qt, list(plain), alpha, subtract)
        finite = _C.powersgd_reconstruct(p, qt, list(checked), alpha, subtract, check_finite=True)
        assert torch.equal(checked.view(-1).view(torch.uint8), plain.view(-1).view(torch.uint8))
        assert finite == numpy_all_finite(checked), (alpha, subtract)
        assert finite == (bad is None or (bad != "last column" and bad % 2 == 0
                                          and dtype != "float16"))


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_powersgd_project_with_es_in_writes_the_new_residual_and_keeps_the_old(dtype):
    """With es_in, M = g + e_in goes into e and e_in is left as it was (a step's backup with no
    copy): P and e the bits of the in-place call, e_in untouched; partial overlap refused."""
    torch_dtype = random_grad(0, dtype).dtype
    ftype = torch.float64 if dtype == "float64" else torch.float32
    rows, cols, r = 37, 53, 3
    gs = [random_grad(rows * cols, dtype, seed=s).view(rows, cols) for s in (1, 2)]
    olds = [random_grad(rows * cols, dtype, seed=s).view(rows, cols) for s in (3, 4)]
    qt = torch.randn(2, r, cols, dtype=ftype)
    kept = [e.clone() for e in olds]
    in_place = [e.clone() for e in olds]
    p_ref = torch.empty(2, rows, r, dtype=ftype)
    _C.powersgd_project(gs, in_place, True, qt, p_ref)
    news = [torch.full_like(e, 7) for e in olds]
    p = torch.empty_like(p_ref)
    _C.powersgd_project(gs, news, True, qt, p, olds)
    assert torch.equal(p, p_ref)
    for new, want, old, k in zip(news, in_place, olds, kept):
        assert torch.equal(new, want) and torch.equal(old, k)
    assert not torch.equal(in_place[0], kept[0])  # the in-place call did write M
    buf = torch.zeros(2 * rows * cols, dtype=torch_dtype)
    with pytest.raises(ValueError, match="e_in and e overlap without being the same buffer"):
        _C.powersgd_project(gs[:1], [buf[1:rows * cols + 1].view(rows, cols)], True, qt[:1],
                            p[:1], [buf[:rows * cols].view(rows, cols)])
    with pytest.raises(ValueError, match="one residual per matrix of the batch"):
        _C.powersgd_project(gs, news, True, qt, p, olds[:1])


def numpy_all_finite(t: torch.Tensor) -> bool:
    a = t2n(t)
    if t.dtype == torch.bfloat16:  # bfloat16 is the high half of a float32
        a = (a.astype(np.uint32) << 16).view(np.float32)
    return bool(np.isfinite(a).all())


FINITE_LENGTHS = [0, 1, 15, 16, 63, 64, 65, 127, 128, 129, 4097, 20011, 40000]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", FINITE_LENGTHS)
def test_all_finite_matches_numpy(n, dtype):
    """Finite extremes (the largest value, a subnormal, -0) pass; one NaN (either sign, any
    payload) or inf anywhere fails: in the first and last 128-byte step, in the tail after the
    SIMD steps, in a later 16 KiB window than the first."""
    torch_dtype = random_grad(0, dtype).dtype
    info = torch.finfo(torch_dtype)
    x = random_grad(n, dtype, seed=n + 1)
    for i, v in zip([0, n // 3, n - 1], [info.max, info.smallest_normal / 4, -0.0]):
        if n:
            x[i] = v
    assert _C.all_finite([x]) is True and numpy_all_finite(x) is True
    width = x.element_size()
    steps = n * width // 128 * 128 // width  # elements the 128-byte SIMD steps cover
    places = sorted({p for p in [0, 1, steps - 1, steps, n // 2, n - 1, 16384 // width + 3]
                     if 0 <= p < n})
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
    # all exponent bits and the lowest mantissa bit: a NaN whose payload is not the default
    payload_nan = {"float16": 0x7C01, "bfloat16": 0x7F81, "float32": 0x7F800001,
                   "float64": 0x7FF0000000000001}[dtype]
    negative_nan = -x.new_tensor(float("nan"))
    for place in places:
        for value in [float("nan"), float("inf"), float("-inf"), "-nan", "payload"]:
            y = x.clone()
            if value == "-nan":
                y[place] = negative_nan
            elif value == "payload":
                y.view(bits)[place] = payload_nan
            else:
                y[place] = value
            assert numpy_all_finite(y) is False, (place, value)
            assert _C.all_finite([y]) is False, (place, value)
            assert _C.all_finite([x, y, x]) is False, (place, value)


def test_all_finite_reads_only_the_elements_of_each_tensor():
    """A strided view counts its own elements only; an empty list is finite; a tensor on a
    device without kernels is refused by name."""
    base = torch.zeros(2000)
    base[1::2] = float("nan")
    assert _C.all_finite([base[0::2]]) is True
    assert _C.all_finite([base[0::2], base[1::2]]) is False
    assert _C.all_finite([]) is True
    with pytest.raises(ValueError, match="gradient is on meta"):
        _C.all_finite([torch.zeros(3), torch.empty(3, device="meta")])
