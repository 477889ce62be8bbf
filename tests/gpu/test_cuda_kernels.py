"""The CUDA kernels against the CPU kernels (themselves proven against numpy in tests/unit):
payloads, decoding, aggregation, error feedback, DGC's state and PowerSGD's passes, bit for bit,
on the sizes and dtypes that straddle warps, words and tiles. Skipped on machines without a GPU
or without the CUDA build of the extension; tests/unit/test_cuda_compile.py is what runs there.

Sums over a whole tensor (the sign scale, the L2 / sigma norms, DGC's clipping norm) are added
in another order on the GPU, in double, then rounded to float once: the float results agree
unless a double sum falls within ~1e-16 of a rounding boundary, which these fixed inputs do not.
PowerSGD's orthogonalisation adds float32 in another order and is compared to a tolerance.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import device_bits, params, random_grad
from hvd_compress.torch import _C

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: make test-gpu runs these on a GPU machine; CPU-only CI "
                "compiles the kernels in tests/unit/test_cuda_compile.py", allow_module_level=True)
if not _C.built_with_cuda():
    pytest.skip("the extension was built without CUDA (CPU torch or no nvcc); make test-gpu "
                "refuses to run then", allow_module_level=True)

DEV = torch.device("cuda")
SIZES = [0, 1, 31, 32, 33, 1_000_007]
DTYPES = ["float32", "float16", "bfloat16"]
K = {"none": 0, "fp16": 1, "bf16": 2, "onebit": 3, "signsgd": 4, "efsignsgd": 5, "topk": 6,
     "randomk": 7, "minmax8": 8, "dither": 9, "natural": 10, "threshold": 11, "dgc": 12}

# (label, kernel, params fields); k given as a fraction of n.
CODECS = [
    ("none", "none", {}), ("none-prescaled", "none", {"prescale": 0.5}),
    ("fp16", "fp16", {}), ("fp16-prescaled", "fp16", {"prescale": 64.0}), ("bf16", "bf16", {}),
    ("onebit", "onebit", {}), ("onebit-unscaled", "onebit", {"scaling": False}),
    ("signsgd", "signsgd", {}), ("efsignsgd", "efsignsgd", {}),
    ("topk", "topk", {"k": 0.01}), ("topk-all", "topk", {"k": 1.0}),
    ("randomk", "randomk", {"k": 0.01, "seed": 99, "rescale": True}),
    ("minmax8", "minmax8", {"chunk": 4096}), ("minmax8-small-chunks", "minmax8", {"chunk": 100}),
    ("dithering", "dither", {"s": 8, "seed": 7}),
    ("dithering-natural", "dither", {"s": 3, "partition": 1, "seed": 8}),
    ("qsgd", "dither", {"s": 127, "normalize": 1, "seed": 9}),
    ("terngrad", "dither", {"s": 1, "normalize": 2, "clip": 2.5, "seed": 10}),
    ("natural", "natural", {"seed": 11}),
    ("threshold", "threshold", {"threshold": 0.5}),
]
IDS = [c[0] for c in CODECS]


def make_params(fields, n):
    f = dict(fields)
    if "k" in f:
        f["k"] = max(1, min(n, round(f["k"] * n))) if n else 0
    return params(**f)


def payload_of(kernel, x, p):
    payload = _C.new_payload(K[kernel], x, p)
    _C.encode(K[kernel], x, p, payload)
    if kernel == "threshold":
        payload = payload[:_C.encoded_bytes(K[kernel], payload, x, p)]
    return payload


def assert_same(gpu: torch.Tensor, cpu: torch.Tensor, what: str):
    g, c = device_bits(gpu), device_bits(cpu)
    if g != c:
        a, b = np.frombuffer(g, np.uint8), np.frombuffer(c, np.uint8)
        if a.size != b.size:
            raise AssertionError(f"{what}: {a.size} bytes on the GPU, {b.size} on the CPU")
        diff = np.nonzero(a != b)[0]
        raise AssertionError(f"{what}: {diff.size} of {a.size} bytes differ, first at byte {diff[0]}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("label,kernel,fields", CODECS, ids=IDS)
def test_payload_and_decode_equal_cpu(label, kernel, fields, n, dtype):
    x = random_grad(n, dtype, seed=n + 3)
    p = make_params(fields, n)
    cpu = payload_of(kernel, x, p)
    gpu = payload_of(kernel, x.to(DEV), p)
    assert_same(gpu, cpu, f"{label} payload")

    base = random_grad(n, dtype, seed=n + 4)
    for alpha, acc in ((1.0, False), (-0.5, True)):
        out_c, out_g = base.clone(), base.to(DEV)
        if kernel == "threshold":  # variable size: decoded through the concatenated form
            _C.aggregate_concat(K[kernel], cpu, 1, out_c, p, alpha)
            _C.aggregate_concat(K[kernel], gpu, 1, out_g, p, alpha)
        else:
            _C.decode(K[kernel], cpu, out_c, p, alpha, acc)
            _C.decode(K[kernel], gpu, out_g, p, alpha, acc)
        assert_same(out_g, out_c, f"{label} decode alpha={alpha} accumulate={acc}")


ALLGATHER = [c for c in CODECS if c[1] not in ("none", "randomk")]


@pytest.mark.parametrize("dtype", DTYPES + ["float64"])
@pytest.mark.parametrize("n", [33, 1_000_007])
@pytest.mark.parametrize("label,kernel,fields", ALLGATHER, ids=[c[0] for c in ALLGATHER])
def test_aggregate_equals_cpu(label, kernel, fields, n, dtype):
    p = make_params(fields, n)
    payloads = [payload_of(kernel, random_grad(n, dtype, seed=r), p) for r in range(3)]
    out_c = random_grad(n, dtype, seed=99)  # overwritten: aggregate never accumulates
    out_g = out_c.to(DEV)
    if kernel == "threshold":
        cat = torch.cat(payloads)
        _C.aggregate_concat(K[kernel], cat, 3, out_c, p, 1 / 3)
        _C.aggregate_concat(K[kernel], cat.to(DEV), 3, out_g, p, 1 / 3)
    else:
        stacked = torch.stack([pl.view(torch.uint8) for pl in payloads])
        _C.aggregate(K[kernel], stacked, out_c, p, 1 / 3)
        _C.aggregate(K[kernel], stacked.to(DEV), out_g, p, 1 / 3)
    assert_same(out_g, out_c, f"{label} aggregate")


@pytest.mark.parametrize("dtype", DTYPES + ["float64"])
@pytest.mark.parametrize("n", [1, 33, 1_000_007])
@pytest.mark.parametrize("kernel", ["fp16", "bf16"])
def test_aggregate_pair_equals_cpu(kernel, n, dtype):
    """Two ranks' payloads reduced from the wrapping sum of their words, on both ranks."""
    p = params()
    payloads = [payload_of(kernel, random_grad(n, dtype, seed=r), p) for r in range(2)]
    raw = [pl.view(torch.uint8) for pl in payloads]
    words = [torch.cat([b, torch.zeros(-b.numel() % 4, dtype=torch.uint8)]).view(torch.int32)
             for b in raw]
    summed = words[0] + words[1]  # int32 addition wraps, as Horovod's sum does
    for rank in range(2):
        out_c = torch.empty(n, dtype=random_grad(1, dtype).dtype)
        out_g = out_c.to(DEV)
        _C.aggregate_pair(K[kernel], payloads[rank], summed, rank, out_c, p, 0.5)
        _C.aggregate_pair(K[kernel], payloads[rank].to(DEV), summed.to(DEV), rank, out_g, p, 0.5)
        assert_same(out_g, out_c, f"{kernel} aggregate_pair rank {rank}")


@pytest.mark.parametrize("shift", [1, 2, 4])
@pytest.mark.parametrize("label,kernel,fields", ALLGATHER, ids=[c[0] for c in ALLGATHER])
def test_payloads_off_an_8_byte_boundary_equal_cpu(label, kernel, fields, shift):
    """A payload split out of a concatenation (buckets, the node share) starts where the one
    before it ended, and 16-bit values with an odd k give gathered rows of an odd length: the
    GPU reads them where they lie, as the CPU does, instead of faulting on a misaligned load."""
    n, dtype = 33, "float16"
    p = make_params(fields, n)
    payloads = [payload_of(kernel, random_grad(n, dtype, seed=r), p).view(torch.uint8)
                for r in range(3)]
    size = payloads[0].numel()
    buf_c = torch.cat([torch.zeros(shift, dtype=torch.uint8)] + payloads)
    buf_g = buf_c.to(DEV)
    base = random_grad(n, dtype, seed=7)
    out_c, out_g = base.clone(), base.to(DEV)
    if kernel == "threshold":
        _C.aggregate_concat(K[kernel], buf_c[shift:], 3, out_c, p, 0.5)
        _C.aggregate_concat(K[kernel], buf_g[shift:], 3, out_g, p, 0.5)
    else:
        _C.aggregate(K[kernel], buf_c[shift:].view(3, size), out_c, p, 0.5)
        _C.aggregate(K[kernel], buf_g[shift:].view(3, size), out_g, p, 0.5)
        assert_same(out_g, out_c, f"{label} aggregate at +{shift}")
        _C.decode(K[kernel], buf_c[shift:shift + size], out_c, p, -1.0, True)
        _C.decode(K[kernel], buf_g[shift:shift + size], out_g, p, -1.0, True)
    assert_same(out_g, out_c, f"{label} at +{shift}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 33, 1_000_007])
@pytest.mark.parametrize("label,kernel,fields", CODECS, ids=IDS)
def test_error_feedback_equals_cpu_over_steps(label, kernel, fields, n, dtype):
    """Odd steps on the GPU write the new residual into a second buffer (e_in: the old one),
    as the state store's transactions have it; the CPU updates in place throughout."""
    p = make_params(fields, n)
    carry_n = _C.ef_carry_size(K[kernel])
    e_c = torch.zeros(n, dtype=random_grad(1, dtype).dtype)
    e_g, spare_g = e_c.to(DEV), torch.full_like(e_c, 12345.0).to(DEV)
    carry_c, carry_g = torch.zeros(carry_n), torch.zeros(carry_n, device=DEV)
    for step in range(4):
        x = random_grad(n, dtype, seed=100 + step)
        pl_c = _C.new_payload(K[kernel], x, p)
        pl_g = _C.new_payload(K[kernel], x.to(DEV), p)
        _C.ef_encode(K[kernel], x, e_c, carry_c, p, pl_c)
        if step % 2:
            before = e_g.clone()
            _C.ef_encode(K[kernel], x.to(DEV), spare_g, carry_g, p, pl_g, e_in=e_g)
            assert_same(e_g, before, f"{label} step {step} e_in left as it was")
            e_g, spare_g = spare_g, e_g
        else:
            _C.ef_encode(K[kernel], x.to(DEV), e_g, carry_g, p, pl_g)
        if kernel == "threshold":
            pl_c = pl_c[:_C.encoded_bytes(K[kernel], pl_c, x, p)]
            pl_g = pl_g[:_C.encoded_bytes(K[kernel], pl_g, x.to(DEV), p)]
        assert_same(pl_g, pl_c, f"{label} step {step} payload")
        assert_same(e_g, e_c, f"{label} step {step} residual")
        assert_same(carry_g, carry_c, f"{label} step {step} carry")
    _C.ef_settle(K[kernel], e_c, carry_c)
    _C.ef_settle(K[kernel], e_g, carry_g)
    assert_same(e_g, e_c, f"{label} settled residual")


@pytest.mark.parametrize("dtype", DTYPES + ["float64"])
@pytest.mark.parametrize("n", [1, 31, 33, 5000, 1_000_007])
@pytest.mark.parametrize("clip_norm", [0.0, 10.0])
@pytest.mark.parametrize("density", [0.001, 0.01, 0.5])
@pytest.mark.parametrize("apart", [False, True], ids=["in_place", "state_in_apart"])
def test_dgc_state_and_payload_equal_cpu(apart, density, clip_norm, n, dtype):
    """apart: the GPU reads the state from state_in and writes it into other buffers (NaN
    before), as a step that keeps its backup does; the CPU updates in place."""
    k = max(1, round(density * n))
    p = params(k=k, momentum_factor=0.9, clip_norm=clip_norm)
    like = random_grad(n, dtype)
    st_c = [torch.zeros_like(like), torch.zeros_like(like)]
    st_g = [s.to(DEV) for s in st_c]
    for step in range(3):
        x = random_grad(n, dtype, seed=200 + step)
        pl_c, pl_g = _C.new_payload(K["dgc"], x, p), _C.new_payload(K["dgc"], x.to(DEV), p)
        _C.encode_with_state(K["dgc"], x, st_c, p, pl_c)
        if apart:
            old = st_g
            st_g = [torch.full_like(s, float("nan")) for s in old]
            _C.encode_with_state(K["dgc"], x.to(DEV), st_g, p, pl_g, state_in=old)
        else:
            _C.encode_with_state(K["dgc"], x.to(DEV), st_g, p, pl_g)
        assert_same(pl_g, pl_c, f"dgc step {step} payload")
        assert_same(st_g[0], st_c[0], f"dgc step {step} velocity")
        assert_same(st_g[1], st_c[1], f"dgc step {step} accumulator")
    stacked = torch.stack([pl_c.view(torch.uint8)] * 2)
    out_c = random_grad(n, dtype, seed=5)
    out_g = out_c.to(DEV)
    _C.aggregate(K["dgc"], stacked, out_c, p, 0.5)
    _C.aggregate(K["dgc"], stacked.to(DEV), out_g, p, 0.5)
    assert_same(out_g, out_c, "dgc aggregate")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("shape,rank", [((1, 1), 1), ((31, 33), 2), ((512, 1000), 4),
                                        ((3000, 257), 12), ((40000, 32), 4)])
@pytest.mark.parametrize("batch", [1, 3])
def test_powersgd_passes_equal_cpu(dtype, shape, rank, batch):
    rows, cols = shape
    ftype = torch.float64 if dtype == "float64" else torch.float32
    g = torch.Generator().manual_seed(rows + cols)
    grads = [random_grad(rows * cols, dtype, seed=b).view(rows, cols) for b in range(batch)]
    res = [random_grad(rows * cols, dtype, seed=10 + b).view(rows, cols) for b in range(batch)]
    qt = torch.randn(batch, rank, cols, generator=g, dtype=ftype)
    p_c = torch.empty(batch, rows, rank, dtype=ftype)
    p_g = p_c.to(DEV)
    res_g = [r.to(DEV) for r in res]
    _C.powersgd_project(grads, res, True, qt, p_c)
    _C.powersgd_project([m.to(DEV) for m in grads], res_g, True, qt.to(DEV), p_g)
    assert_same(p_g, p_c, "project P")
    for b in range(batch):
        assert_same(res_g[b], res[b], "project M = g + e")

    ortho_c, ortho_g = p_c.clone(), p_c.to(DEV)
    _C.powersgd_orthogonalize(ortho_c, 1e-8)
    _C.powersgd_orthogonalize(ortho_g, 1e-8)
    tol = 1e-12 if dtype == "float64" else 2e-5
    torch.testing.assert_close(ortho_g.cpu(), ortho_c, rtol=tol, atol=tol)

    q_c = torch.empty(batch, rank, cols, dtype=ftype)
    q_g = q_c.to(DEV)
    _C.powersgd_back_project(res, ortho_c, q_c)
    _C.powersgd_back_project(res_g, ortho_c.to(DEV), q_g)
    assert_same(q_g, q_c, "back_project Q")

    outs_c = [r.clone() for r in res]
    outs_g = [r.to(DEV) for r in res]
    for subtract in (True, False):
        _C.powersgd_reconstruct(ortho_c, q_c, outs_c, 0.5, subtract)
        _C.powersgd_reconstruct(ortho_c.to(DEV), q_c.to(DEV), outs_g, 0.5, subtract)
        for b in range(batch):
            assert_same(outs_g[b], outs_c[b], f"reconstruct subtract={subtract}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_nesterov_equals_cpu(dtype):
    x, m = random_grad(100_003, dtype, seed=1), random_grad(100_003, dtype, seed=2)
    xg, mg = x.to(DEV), m.to(DEV)
    _C.nesterov(x, m, 0.9)
    _C.nesterov(xg, mg, 0.9)
    assert_same(xg, x, "nesterov x")
    assert_same(mg, m, "nesterov m")


@pytest.mark.parametrize("dtype", DTYPES)
def test_heavy_ball_equals_cpu(dtype):
    x, m = random_grad(100_003, dtype, seed=1), random_grad(100_003, dtype, seed=2)
    xg, mg = x.to(DEV), m.to(DEV)
    _C.heavy_ball(x, m, m, 0.9)
    _C.heavy_ball(xg, mg, mg, 0.9)
    assert_same(mg, m, "heavy-ball m")


def test_stochastic_rounding_is_unbiased_on_the_gpu():
    """E[D(C(x))] = x for dithering: the mean over 400 seeds is within 5 standard errors."""
    n, seeds = 4096, 400
    x = random_grad(n, "float32", seed=1).clamp(-3, 3).to(DEV)
    acc = torch.zeros(n, dtype=torch.float64, device=DEV)
    for seed in range(seeds):
        p = params(s=4, seed=seed * 7919 + 1)
        pl = payload_of("dither", x, p)
        out = torch.empty_like(x)
        _C.decode(K["dither"], pl, out, p, 1.0, False)
        acc += out.double()
    gap = x.abs().max().item() / 4  # one level; each draw's error is within a gap
    se = gap / 2 / seeds ** 0.5
    assert (acc / seeds - x.double()).abs().max().item() < 5 * se + 2 ** -16 * gap


def test_gpu_aggregate_refuses_payloads_of_other_codecs():
    x = random_grad(1000, "float32").to(DEV)
    p = params(k=10)
    a, b = payload_of("topk", x, p), payload_of("onebit", x, p)
    stacked = torch.stack([a.view(torch.uint8), a.view(torch.uint8)])
    stacked[1, :8] = b.view(torch.uint8)[:8]
    with pytest.raises(ValueError, match="rank 1.*same compression spec|codec id 3"):
        _C.aggregate(K["topk"], stacked, torch.empty_like(x), p, 1.0)


def test_tensors_on_two_devices_are_refused():
    x = random_grad(1000, "float32")
    payload = _C.new_payload(K["fp16"], x, params())
    with pytest.raises(ValueError, match="one device"):
        _C.encode(K["fp16"], x.to(DEV), params(), payload)


@pytest.mark.parametrize("dtype", DTYPES + ["float64"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("levels,lane_ranks,block", [(255, 8, 4096), (16, 3, 7), (1, 1, 1000),
                                                     (255, 1, 256), (65535, 65537, 300)])
def test_homomorphic_equals_cpu(levels, lane_ranks, block, n, dtype):
    """Block maxima (a CUDA block per long block, a thread per short one), words and decodes."""
    x = random_grad(n, dtype, seed=n + 5)
    s_c, s_g = _C.homo_block_absmax(x, block), _C.homo_block_absmax(x.to(DEV), block)
    assert_same(s_g, s_c, "homomorphic block max")
    w_c = _C.homo_encode(x, s_c, block, levels, lane_ranks, 17)
    w_g = _C.homo_encode(x.to(DEV), s_g, block, levels, lane_ranks, 17)
    assert_same(w_g, w_c, "homomorphic words")
    base = random_grad(n, dtype, seed=n + 6)
    for summands, alpha, acc in ((1, 1.0, False), (lane_ranks, -0.5, True)):
        out_c, out_g = base.clone(), base.to(DEV)
        _C.homo_decode(w_c, s_c, out_c, block, levels, lane_ranks, summands, alpha, acc)
        _C.homo_decode(w_g, s_g, out_g, block, levels, lane_ranks, summands, alpha, acc)
        assert_same(out_g, out_c, f"homomorphic decode summands={summands} accumulate={acc}")


@pytest.mark.parametrize("dtype", DTYPES + ["float64"])
@pytest.mark.parametrize("n", SIZES)
def test_all_finite_equals_cpu(n, dtype):
    """One flag per device for any number of tensors: a non-finite element in any of them, at
    its first, middle or last place, is seen; CPU and CUDA tensors may be mixed in one call."""
    x = random_grad(n, dtype, seed=n)
    assert _C.all_finite([x.to(DEV), x.to(DEV)]) is True is _C.all_finite([x])
    for place in sorted({0, n // 2, n - 1}) if n else []:
        for value in [float("nan"), float("inf"), float("-inf")]:
            y = x.clone()
            y[place] = value
            assert _C.all_finite([x.to(DEV), y.to(DEV)]) is False is _C.all_finite([y])
            assert _C.all_finite([x, y.to(DEV)]) is False
