"""Homomorphic quantisation (THC) against the numpy reference, bit for bit: block maxima, packed
words and decoded values over lengths that straddle words, SIMD steps and blocks, every gradient
dtype and several lane layouts. Then what the scheme promises: the int32 sum of every rank's
words (wrapping as Horovod's allreduce does) decodes to the sum of the ranks' decodes, because
lane sums never carry; the decode is unbiased; a non-finite gradient is never hidden. Run twice
by `make test`: once on the AVX2 paths and once with HVDC_FORCE_SCALAR=1."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import hvd_compress as hc
import numpy_ref as ref
from helpers import n2t, random_grad, same_bits, t2n
from hvd_compress.torch import _C

DTYPES = ["float32", "float16", "bfloat16", "float64"]
LENGTHS = [0, 1, 31, 32, 33, 1000, 4097, 100003]
# (levels, lane_ranks) -> lane width w and lanes per word: 1/32, 2/16, 3/10, 4/8, 5/6, 6/5,
# 7/4, 8/4, 9/3, 11/2, 14/2 and 32/1 (whose sums wrap int32 to negative). Every lane count has
# its own packing loop; 2 and 4 also have AVX2 ones.
LAYOUTS = [(1, 1), (2, 1), (7, 1), (15, 1), (31, 1), (16, 3), (127, 1), (255, 1), (254, 2),
           (255, 8), (255, 64), (65535, 65537)]
LONG = {(16, 3), (127, 1), (254, 2), (255, 8)}  # also run on 100003 elements
BLOCKS = [1, 7, 32, 1000, 4096, 1 << 20]


def rng(seed):
    return np.random.default_rng(seed)


def scales_of(x: torch.Tensor, block: int) -> torch.Tensor:
    return _C.homo_block_absmax(x, block)


def decoded(words, scales, like, block, levels, lane_ranks, summands, alpha=1.0):
    out = torch.empty_like(like)
    _C.homo_decode(words, scales, out, block, levels, lane_ranks, summands, alpha, False)
    return out


def check_against_reference(dtype, n, levels, lane_ranks, block):
    seed = 1000 + n
    x = random_grad(n, dtype, seed=n)
    scales = scales_of(x, block)
    want_scales = ref.homo_block_absmax(t2n(x), dtype, block)
    assert same_bits(t2n(scales), want_scales)

    words = _C.homo_encode(x, scales, block, levels, lane_ranks, seed)
    want = ref.homo_encode(t2n(x), dtype, want_scales, block, levels, lane_ranks, seed)
    assert words.dtype == torch.int32 and words.numel() == _C.homo_words(n, levels, lane_ranks)
    assert same_bits(t2n(words), want)

    for summands, alpha in ((1, 1.0), (1, -0.5), (lane_ranks, 0.125)):
        out = decoded(words, scales, x, block, levels, lane_ranks, summands, alpha)
        expect = ref.homo_decode(want, n, dtype, want_scales, block, levels, lane_ranks, summands,
                                 alpha)
        assert same_bits(t2n(out), expect), (summands, alpha)
    base = random_grad(n, dtype, seed=n + 1)
    out = base.clone()
    _C.homo_decode(words, scales, out, block, levels, lane_ranks, 1, 0.25, True)
    expect = ref.homo_decode(want, n, dtype, want_scales, block, levels, lane_ranks, 1, 0.25,
                             out=t2n(base))
    assert same_bits(t2n(out), expect)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda t: f"L{t[0]}xR{t[1]}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_match_reference(dtype, layout):
    levels, lane_ranks = layout
    for n in LENGTHS if layout in LONG else LENGTHS[:-1]:
        for block in (BLOCKS[(n + levels) % len(BLOCKS)], BLOCKS[(n + levels + 3) % len(BLOCKS)]):
            check_against_reference(dtype, n, levels, lane_ranks, block)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [5, 64, 1000])
def test_scales_other_than_the_block_max(dtype, block):
    """Scales below |x| clamp the codes; zero, negative, NaN and inf scales, and NaN / inf
    inputs, follow the documented rules on every path."""
    n = 5003
    x = t2n(random_grad(n, dtype, seed=3))
    x[[10, 700, 2222]] = ref.from_acc(np.array([np.nan, np.inf, -np.inf]), dtype)
    blocks = _C.homo_blocks(n, block)
    s = ref.homo_block_absmax(x, dtype, block) * rng(0).uniform(0.2, 1.5, blocks).astype(np.float32)
    s[::7] = 0.0
    s[1::7] = -1.0
    s[2::7] = np.nan
    s[3::7] = np.inf
    s[4::7] = np.float32(1e-40)  # subnormal: v / M overflows to inf for most v
    for levels, lane_ranks in ((255, 8), (16, 3), (3, 1)):
        words = _C.homo_encode(n2t(x, dtype), torch.from_numpy(s), block, levels, lane_ranks, 9)
        want = ref.homo_encode(x, dtype, s, block, levels, lane_ranks, 9)
        assert same_bits(t2n(words), want)
        out = decoded(words, torch.from_numpy(s), n2t(x, dtype), block, levels, lane_ranks, 1)
        assert same_bits(t2n(out), ref.homo_decode(want, n, dtype, s, block, levels, lane_ranks, 1))


@pytest.mark.parametrize("layout", [(2, 64), (16, 3), (254, 2), (255, 8), (255, 1), (15, 17)],
                         ids=lambda t: f"L{t[0]}xR{t[1]}")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_summed_words_decode_to_the_sum_of_decodes(layout, dtype):
    levels, ranks = layout
    n, block = 4097, 500
    xs = [random_grad(n, dtype, seed=40 + r) for r in range(ranks)]
    scales = torch.stack([scales_of(x, block) for x in xs]).max(0).values  # the Max allreduce
    payloads = [t2n(_C.homo_encode(x, scales, block, levels, ranks, 7 + r))
                for r, x in enumerate(xs)]
    summed = np.sum(payloads, axis=0, dtype=np.int32)  # int32 allreduce: wraps, never widens
    lanes = [ref.homo_unpack(p, n, levels, ranks) for p in payloads]
    assert np.array_equal(ref.homo_unpack(summed, n, levels, ranks), np.sum(lanes, axis=0))

    out = decoded(torch.from_numpy(summed), scales, xs[0], block, levels, ranks, ranks)
    assert same_bits(t2n(out), ref.homo_decode(summed, n, dtype, t2n(scales), block, levels,
                                               ranks, ranks))
    each = sum(decoded(torch.from_numpy(p), scales, xs[0], block, levels, ranks, 1).double()
               for p in payloads)
    m = scales.double().repeat_interleave(block)[:n]
    tol = (1e-12 if dtype == "float64" else 1e-6) * ranks * m
    assert torch.all((out.double() - each).abs() <= tol)


@pytest.mark.parametrize("layout", [(255, 8), (2, 64), (16, 3), (1, 1), (65535, 65537),
                                    (65535, 1)], ids=lambda t: f"L{t[0]}xR{t[1]}")
def test_worst_case_every_code_at_the_top(layout):
    """x = +M everywhere codes every element L on every rank: the lane sums reach
    lane_ranks * L, the most a lane must hold, without touching the next lane."""
    levels, ranks = layout
    n, block = 1001, 100
    x = torch.full((n,), 0.75, dtype=torch.float64)
    scales = scales_of(x, block)
    words = t2n(_C.homo_encode(x, scales, block, levels, ranks, 5))
    assert np.all(ref.homo_unpack(words, n, levels, ranks) == levels)
    with np.errstate(over="ignore"):
        summed = words * np.int32(ranks % (1 << 32))  # the int32 sum of `ranks` equal payloads
    assert summed.dtype == np.int32
    assert np.all(ref.homo_unpack(summed, n, levels, ranks) == levels * ranks)
    out = decoded(torch.from_numpy(summed), scales, x, block, levels, ranks, ranks)
    assert torch.equal(out, torch.full((n,), 0.75 * ranks, dtype=torch.float64))
    assert torch.equal(decoded(torch.from_numpy(words), scales, x, block, levels, ranks, 1), x)


def test_lane_layout():
    assert _C.homo_lane_bits(255, 8) == 11 and _C.homo_words(5, 255, 8) == 3
    assert _C.homo_lane_bits(255, 1) == 8 and _C.homo_words(5, 255, 1) == 2
    assert _C.homo_lane_bits(256, 1) == 9 and _C.homo_words(7, 256, 1) == 3
    assert _C.homo_lane_bits(1, 1) == 1 and _C.homo_words(33, 1, 1) == 2
    assert _C.homo_lane_bits(65535, 65537) == 32 and _C.homo_words(3, 65535, 65537) == 3
    assert _C.homo_blocks(0, 4) == 0 and _C.homo_blocks(9, 4) == 3 and _C.homo_blocks(8, 4) == 2
    # codes 0 and L at known places: element i at bit (i % lanes) * w of word i / lanes
    x = torch.tensor([-1.0, 1.0, 1.0, 1.0, 1.0])
    words = _C.homo_encode(x, torch.tensor([1.0]), 8, 255, 8, 0)
    assert t2n(words).view(np.uint32).tolist() == [255 << 11, 255 | 255 << 11, 255]


def test_unbiased_in_expectation():
    """The mean of many decodes (one seed each) approaches x. One draw is one of the two
    levels around x, gap = 2M / L apart, so its standard deviation is at most gap / 2; every
    element's mean must lie within 6 standard errors (plus the 2^-16 grid of the draws).
    Rounding to the nearest level instead, biased by up to gap / 2, fails the same bound."""
    n, trials, levels, block = 500, 2000, 16, 128
    x = random_grad(n, "float32", seed=4)
    scales = scales_of(x, block)
    draws = torch.stack([
        decoded(_C.homo_encode(x, scales, block, levels, 1, hc.derive_seed(0, "w", t)), scales,
                x.double(), block, levels, 1, 1)
        for t in range(trials)])
    m = scales.double().repeat_interleave(block)[:n]
    gap = 2 * m / levels
    bound = 6 * (gap / 2) / trials ** 0.5 + gap * 2.0 ** -16 + 1e-6 * m
    assert torch.all((draws.mean(0) - x.double()).abs() <= bound)
    assert (draws.std(0) > 0).sum() > n // 2  # the draws really are random

    t = (x.double() / m + 1) * (levels / 2)
    nearest = m * (2 * torch.round(t) / levels - 1)
    assert (nearest - x.double()).abs().gt(bound).sum() > n // 4


def test_same_seed_same_words():
    x = random_grad(3000, "float32", seed=2)
    s = scales_of(x, 256)
    a, b, c = (_C.homo_encode(x, s, 256, 255, 4, seed) for seed in (11, 11, 12))
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_gradient_decodes_to_nan_in_its_block(bad):
    """The block max carries the NaN (inf for inf) into the agreed scale; a non-finite scale
    decodes to NaN in its whole block. Other blocks are untouched."""
    n, block = 1000, 100
    x = random_grad(n, "float32", seed=1)
    x[250] = bad
    scales = scales_of(x, block)
    expect = float("nan") if bad != bad else float("inf")
    assert scales[2].item() != scales[2].item() if bad != bad else scales[2].item() == expect
    other = torch.stack([scales, scales_of(random_grad(n, "float32", seed=2), block)]).max(0).values
    for agreed in (scales, other):
        words = _C.homo_encode(x, agreed, block, 255, 8, 3)
        out = decoded(words, agreed, x, block, 255, 8, 1)
        assert torch.isnan(out[200:300]).all()
        assert torch.isfinite(torch.cat([out[:200], out[300:]])).all()


def test_zero_scale_decodes_to_exact_zero():
    x = torch.zeros(300)
    x[:100] = -0.0
    scales = scales_of(x, 64)
    assert torch.equal(scales, torch.zeros(5)) and not torch.signbit(scales).any()
    words = _C.homo_encode(x, scales, 64, 255, 8, 1)
    assert not words.any()
    for summands in (1, 8):
        out = decoded(words, scales, x, 64, 255, 8, summands)
        assert torch.equal(out, torch.zeros(300)) and not torch.signbit(out).any()


def test_lane_sums_beyond_the_summands_decode_to_nan():
    """Words that hold more codes than `summands` says cannot be decoded: NaN, not a guess."""
    n, block, levels = 64, 64, 255
    x = torch.full((n,), 1.0)
    s = scales_of(x, block)
    words = _C.homo_encode(x, s, block, levels, 3, 0)  # every code L
    summed = words * 3
    assert torch.isnan(decoded(summed, s, x, block, levels, 3, 2)).all()
    assert torch.equal(decoded(summed, s, x, block, levels, 3, 3), torch.full((n,), 3.0))


def test_non_contiguous_input_is_read_in_order():
    x = random_grad(4000, "float32", seed=5).view(40, 100).t()
    s = scales_of(x, 128)
    assert torch.equal(s, scales_of(x.contiguous(), 128))
    assert torch.equal(_C.homo_encode(x, s, 128, 255, 8, 4),
                       _C.homo_encode(x.contiguous(), s, 128, 255, 8, 4))


def test_encode_into_a_reused_tensor():
    x = random_grad(1000, "float32", seed=6)
    s = scales_of(x, 128)
    words = torch.full((_C.homo_words(1000, 255, 8),), -1, dtype=torch.int32)
    got = _C.homo_encode(x, s, 128, 255, 8, 3, words=words)
    assert got.data_ptr() == words.data_ptr()
    assert torch.equal(words, _C.homo_encode(x, s, 128, 255, 8, 3))
    with pytest.raises(ValueError, match=r"words must be a contiguous int32 tensor of 500 "):
        _C.homo_encode(x, s, 128, 255, 8, 3, words=words[:10])


def test_bad_arguments_are_refused():
    x = torch.ones(10)
    s = scales_of(x, 4)
    w = _C.homo_encode(x, s, 4, 255, 8, 0)
    out = torch.empty(10)
    with pytest.raises(ValueError, match=r"levels=65535 with lane_ranks=65538 needs lanes of "
                                         r"w=33 bits .* more than an int32 word holds \(32\)"):
        _C.homo_encode(x, s, 4, 65535, 65538, 0)
    with pytest.raises(ValueError, match=r"levels=255 with lane_ranks=4294967296 needs lanes of "
                                         r"w=40 bits"):
        _C.homo_lane_bits(255, 1 << 32)
    with pytest.raises(ValueError, match=r"levels must be in \[1, 65535\], got 0"):
        _C.homo_encode(x, s, 4, 0, 8, 0)
    with pytest.raises(ValueError, match=r"levels must be in \[1, 65535\], got 65536"):
        _C.homo_words(10, 65536, 1)
    with pytest.raises(ValueError, match=r"lane_ranks must be >= 1, got 0"):
        _C.homo_lane_bits(255, 0)
    with pytest.raises(ValueError, match=r"summands must be in \[1, lane_ranks\] = \[1, 8\], "
                                         r"got 9"):
        _C.homo_decode(w, s, out, 4, 255, 8, 9, 1.0, False)
    with pytest.raises(ValueError, match=r"summands must be in \[1, lane_ranks\] = \[1, 8\], "
                                         r"got 0"):
        _C.homo_decode(w, s, out, 4, 255, 8, 0, 1.0, False)
    with pytest.raises(ValueError, match=r"block must be >= 1, got 0"):
        _C.homo_block_absmax(x, 0)
    with pytest.raises(ValueError, match=r"element count must be >= 0, got -1"):
        _C.homo_words(-1, 255, 8)
    with pytest.raises(ValueError, match=r"scales must be a contiguous float32 tensor of 3 "
                                         r"element\(s\)"):
        _C.homo_encode(x, torch.ones(2), 4, 255, 8, 0)
    with pytest.raises(ValueError, match=r"scales must be a contiguous float32 tensor"):
        _C.homo_encode(x, s.double(), 4, 255, 8, 0)
    with pytest.raises(ValueError, match=r"words must be a contiguous int32 tensor of 5 "
                                         r"element\(s\)"):
        _C.homo_decode(w[:4], s, out, 4, 255, 8, 8, 1.0, False)
    with pytest.raises(ValueError, match=r"gradient has dtype Int; valid: float32"):
        _C.homo_block_absmax(torch.ones(10, dtype=torch.int32), 4)
