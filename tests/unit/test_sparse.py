"""threshold (variable-size payloads) and DGC (stateful: momentum correction, sampled
threshold, masking) against the numpy reference, bit for bit, plus DGC's density promise."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import hvd_compress as hc
import numpy_ref as ref
from helpers import params, payload_bytes, random_grad, same_bits, t2n
from hvd_compress.torch import _C

DTYPES = ["float32", "float16", "bfloat16", "float64"]
THR, DGC = ref.CODEC_ID["threshold"], ref.CODEC_ID["dgc"]


def threshold_encode(x, t):
    p = params(threshold=t)
    payload = _C.new_payload(THR, x, p)
    _C.encode(THR, x, p, payload)
    return payload[:_C.encoded_bytes(THR, payload, x, p)], p


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 7, 64, 1000, 20011])
@pytest.mark.parametrize("t", [0.0, 0.5, 3.0, 1e9])
def test_threshold_matches_reference(t, n, dtype):
    x = random_grad(n, dtype, seed=n)
    payload, p = threshold_encode(x, t)
    want = ref.encode("threshold", t2n(x), dtype, threshold=t)
    assert payload_bytes(payload) == want
    full = _C.new_payload(THR, x, p)
    full[:payload.numel()] = payload
    out = torch.empty_like(x)
    _C.decode(THR, full, out, p, 0.5, False)
    assert same_bits(t2n(out), ref.decode("threshold", want, n, dtype, 0.5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_threshold_aggregates_payloads_of_any_size_including_empty(dtype):
    n = 5000
    xs = [random_grad(n, dtype, seed=1), torch.zeros(n, dtype=random_grad(1, dtype).dtype),
          random_grad(n, dtype, seed=2) * 10]
    payloads = [threshold_encode(x, 2.0)[0] for x in xs]
    assert payloads[1].numel() == 8  # nothing above the threshold: the header still travels
    assert len({pl.numel() for pl in payloads}) == 3
    out = torch.empty_like(xs[0])
    _C.aggregate_concat(THR, torch.cat(payloads), 3, out, params(threshold=2.0), 1 / 3)
    want = ref.aggregate("threshold", [payload_bytes(pl) for pl in payloads], n, dtype, 1 / 3)
    assert same_bits(t2n(out), want)
    with pytest.raises(ValueError, match="their headers add up to"):
        _C.aggregate_concat(THR, torch.cat(payloads)[:-1], 3, out, params(threshold=2.0), 1.0)
    with pytest.raises(ValueError, match="gathered payloads end after 3 of 4 ranks"):
        _C.aggregate_concat(THR, torch.cat(payloads), 4, out, params(threshold=2.0), 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [33, 3000, 20011, 600_001])
@pytest.mark.parametrize("t,prescale", [(0.0, 1.0), (1.5, 1.0), (1.5, 0.5)])
@pytest.mark.parametrize("offset", [0, 3])
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the reference sums NaN and inf
def test_threshold_error_feedback_matches_reference(offset, t, prescale, n, dtype):
    """Error feedback adds the residual in the selecting pass (float32 under AVX2: 16 elements a
    step, the sent ones' residual kept in the same sweep, e written around the cache from 2 MiB
    and its first 32-byte boundary, then a scalar tail); NaN and inf in the sum are sent, as
    |x| <= t fails for them. offset: e starts that many elements into its buffer."""
    e = torch.zeros(n + offset, dtype=random_grad(1, dtype).dtype)[offset:]
    e_ref = t2n(e)
    p = params(threshold=t, prescale=prescale)
    for step in range(4):
        x = random_grad(n, dtype, seed=step)
        if step == 2:
            x[[5, n - 1]] = torch.tensor([float("nan"), float("-inf")], dtype=x.dtype)
        payload = _C.new_payload(THR, x, p)
        _C.ef_encode(THR, x, e, torch.zeros(0), p, payload)
        want, e_ref = ref.ef_encode("threshold", t2n(x), e_ref, dtype, prescale=prescale,
                                    threshold=t)
        assert payload_bytes(payload)[:len(want)] == want
        assert same_bits(t2n(e), e_ref)


def dgc_step(x, u, v, k, **kw):
    p = params(k=k, **kw)
    payload = _C.new_payload(DGC, x, p)
    _C.encode_with_state(DGC, x, [u, v], p, payload)
    return payload, p


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(0, 0), (1, 1), (50, 3), (3000, 30), (200003, 200)])
@pytest.mark.parametrize("kw", [{}, {"momentum_factor": 0.5, "clip_norm": 5.0}])
def test_dgc_matches_reference(kw, n, k, dtype):
    u = torch.zeros(n, dtype=random_grad(1, dtype).dtype)
    v = u.clone()
    u_ref, v_ref = t2n(u), t2n(v)
    for step in range(3):
        x = random_grad(n, dtype, seed=10 * n + step)
        payload, p = dgc_step(x, u, v, k, **kw)
        want, u_ref, v_ref = ref.dgc_encode(t2n(x), u_ref, v_ref, dtype, k, **kw)
        assert payload_bytes(payload) == want, f"step {step}"
        assert same_bits(t2n(u), u_ref) and same_bits(t2n(v), v_ref)
        out = torch.empty_like(x)
        _C.decode(DGC, payload, out, p, 1.0, False)
        assert same_bits(t2n(out), ref.decode("dgc", want, n, dtype, 1.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(1, 1), (3000, 30), (600001, 600)])
@pytest.mark.parametrize("kw", [{}, {"momentum_factor": 0.5, "clip_norm": 5.0}])
def test_dgc_reads_state_in_and_writes_all_of_the_new_state_elsewhere(kw, n, k, dtype):
    """How a step keeps its backup without copying the state: state_in is only read, and every
    element of the state written (NaN before, one element into its buffer) is the new state.
    600,001 float32 elements are written around the cache after a head up to a boundary."""
    like = random_grad(1, dtype).dtype
    u_in, v_in = torch.zeros(n, dtype=like), torch.zeros(n, dtype=like)
    u_ref, v_ref = t2n(u_in), t2n(v_in)
    for step in range(3):
        x = random_grad(n, dtype, seed=7 * n + step)
        before = [t.clone() for t in (u_in, v_in)]
        u, v = (torch.full((n + 1,), float("nan"), dtype=like)[1:] for _ in range(2))
        p = params(k=k, **kw)
        payload = _C.new_payload(DGC, x, p)
        _C.encode_with_state(DGC, x, [u, v], p, payload, state_in=[u_in, v_in])
        want, u_ref, v_ref = ref.dgc_encode(t2n(x), u_ref, v_ref, dtype, k, **kw)
        assert payload_bytes(payload) == want, f"step {step}"
        assert same_bits(t2n(u), u_ref) and same_bits(t2n(v), v_ref), f"step {step}"
        assert same_bits(t2n(u_in), t2n(before[0])) and same_bits(t2n(v_in), t2n(before[1]))
        u_in, v_in = u, v


def test_dgc_refuses_state_in_that_overlaps_the_state_or_does_not_match_it():
    x, p = torch.ones(100), params(k=5)
    payload = _C.new_payload(DGC, x, p)
    buf = torch.zeros(250)
    with pytest.raises(ValueError, match="state_in and state overlap"):
        _C.encode_with_state(DGC, x, [buf[:100], buf[150:]], p, payload,
                             state_in=[buf[50:150], buf[150:]])
    with pytest.raises(ValueError, match="state_in has 1 tensor"):
        _C.encode_with_state(DGC, x, [buf[:100], buf[150:]], p, payload,
                             state_in=[torch.zeros(100)])
    with pytest.raises(ValueError, match="codec state_in"):
        _C.encode_with_state(DGC, x, [buf[:100], buf[150:]], p, payload,
                             state_in=[torch.zeros(99), torch.zeros(100)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nonzero", [0, 40, 2000])
def test_dgc_with_fewer_nonzeros_than_k(nonzero, dtype):
    """A velocity of mostly zeros (an embedding's unused rows): with fewer nonzeros than k the
    sample's threshold is 0, and DGC sends the nonzeros and the zeros of lowest index, as the
    reference does, without ranking every zero."""
    n, k = 200003, 1000
    u = torch.zeros(n, dtype=random_grad(1, dtype).dtype)
    v = u.clone()
    u_ref, v_ref = t2n(u), t2n(v)
    rows = torch.randperm(n, generator=torch.Generator().manual_seed(nonzero))[:nonzero]
    for step in range(3):
        x = torch.zeros(n, dtype=u.dtype)
        x[rows] = random_grad(nonzero, dtype, seed=step) + 1
        payload, p = dgc_step(x, u, v, k, momentum_factor=0.5)
        want, u_ref, v_ref = ref.dgc_encode(t2n(x), u_ref, v_ref, dtype, k, momentum_factor=0.5)
        assert payload_bytes(payload) == want, f"step {step}"
        assert same_bits(t2n(u), u_ref) and same_bits(t2n(v), v_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [(float("nan"),), (float("inf"), float("-inf")),
                                 (float("nan"), float("inf"))])
def test_dgc_sends_non_finite_velocities(bad, dtype):
    """NaN ranks above inf, as in top-k: whatever the sample's threshold, a non-finite element
    is sent rather than left waiting in the velocity."""
    n, k = 3000, 5
    x = random_grad(n, dtype, seed=4)
    at = [17 + 401 * j for j in range(len(bad))]  # off the 1% sample's stride of 30
    for i, b in zip(at, bad):
        x[i] = b
    u, v = torch.zeros_like(x), torch.zeros_like(x)
    payload, p = dgc_step(x, u, v, k)
    want, _, _ = ref.dgc_encode(t2n(x), t2n(torch.zeros_like(x)), t2n(torch.zeros_like(x)),
                                dtype, k)
    assert payload_bytes(payload) == want
    out = torch.empty_like(x)
    _C.decode(DGC, payload, out, p, 1.0, False)
    assert not torch.isfinite(out[at]).any()


@pytest.mark.parametrize("density", [0.001, 0.01, 0.05])
def test_dgc_density_within_bounds_after_adaptation(density):
    n = 300000
    k = hc.parse_spec(f"dgc,k={density}").kernel_fields(n)["k"]
    u, v = torch.zeros(n), torch.zeros(n)
    for step in range(10):
        g = torch.randn(n, generator=torch.Generator().manual_seed(step)) * torch.exp(
            torch.randn(n, generator=torch.Generator().manual_seed(100 + step)))
        payload, _ = dgc_step(g, u, v, k)
        count = int(np.frombuffer(payload_bytes(payload)[8:12], np.uint32)[0])
        assert 0.8 * k <= count <= 1.3 * k, (step, count, k)


def test_dgc_masking_zeroes_exactly_the_sent_entries():
    n, k = 10000, 50
    u = torch.randn(n, generator=torch.Generator().manual_seed(1))
    v = torch.randn(n, generator=torch.Generator().manual_seed(2))
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    u_exp = 0.9 * u + x
    v_exp = v + u_exp
    payload, _ = dgc_step(x, u, v, k)
    raw = payload_bytes(payload)
    count = int(np.frombuffer(raw[8:12], np.uint32)[0])
    idx = np.frombuffer(raw[16:16 + 4 * count], np.int32)
    sent = np.frombuffer(raw[16 + 4 * k:16 + 4 * k + 4 * count], np.float32)
    mask = np.zeros(n, bool)
    mask[idx] = True
    assert np.array_equal(sent, v_exp.numpy()[idx])  # the accumulated values are what is sent
    assert (u.numpy()[mask] == 0).all() and (v.numpy()[mask] == 0).all()
    assert np.array_equal(u.numpy()[~mask], u_exp.numpy()[~mask])
    assert np.array_equal(v.numpy()[~mask], v_exp.numpy()[~mask])
    # the sent ones are the largest accumulations
    assert np.abs(v_exp.numpy()[mask]).min() >= np.sort(np.abs(v_exp.numpy()))[-count]


def test_dgc_warmup_density_falls_geometrically_to_k():
    cfg = hc.parse_spec("dgc,k=0.001,warmup_steps=4")
    n = 1_000_000
    ks = [cfg.kernel_fields(n, step)["k"] for step in range(6)]
    assert ks[0] == 250000 and ks[4] == ks[5] == 1000
    assert all(a > b for a, b in zip(ks[:4], ks[1:5]))
    assert ks[2] == pytest.approx(np.sqrt(250000 * 1000), rel=1e-3)
    assert "warmup_steps" not in cfg.kernel_fields(n)  # a schedule, not a kernel argument


def test_dgc_needs_its_state_and_refuses_other_ranks_capacity():
    x = torch.ones(100)
    p = params(k=5)
    payload = _C.new_payload(DGC, x, p)
    with pytest.raises(ValueError, match="dgc keeps momentum and accumulation state"):
        _C.encode(DGC, x, p, payload)
    with pytest.raises(ValueError, match="dgc keeps 2 state tensor"):
        _C.encode_with_state(DGC, x, [torch.zeros(100)], p, payload)
    theirs = dgc_step(x, torch.zeros(100), torch.zeros(100), 6)[0]
    ours = dgc_step(x, torch.zeros(100), torch.zeros(100), 5)[0]
    gathered = torch.stack([ours.view(torch.uint8), theirs.view(torch.uint8)[:ours.numel()]])
    with pytest.raises(ValueError, match="dgc payload from rank 1 has capacity 6, this rank k=5"):
        _C.aggregate(DGC, gathered, torch.empty(100), p, 0.5)


def numpy_all_finite(t: torch.Tensor) -> bool:
    a = t2n(t)
    if t.dtype == torch.bfloat16:  # bfloat16 is the high half of a float32
        a = (a.astype(np.uint32) << 16).view(np.float32)
    return bool(np.isfinite(a).all())


def sparse_payload(codec: str, x: torch.Tensor) -> tuple[torch.Tensor, object]:
    """x's payload, every rank's of one size for top-k and DGC (1% of n kept), its size for
    threshold (|x| above 2)."""
    if codec == "threshold":
        return threshold_encode(x, 2.0)
    k = max(1, x.numel() // 100)
    if codec == "dgc":
        return dgc_step(x, torch.zeros_like(x), torch.zeros_like(x), k)
    p = params(k=k)
    payload = _C.new_payload(ref.CODEC_ID["topk"], x, p)
    _C.encode(ref.CODEC_ID["topk"], x, p, payload)
    return payload, p


@pytest.mark.filterwarnings("ignore:overflow encountered")  # the reference making its inf
@pytest.mark.parametrize("bad", [None, "nan", "overflow"])
@pytest.mark.parametrize("n", [3000, 6144, 600_001])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", ["topk", "threshold", "dgc"])
def test_sparse_sums_report_whether_what_they_wrote_is_finite(codec, dtype, n, bad):
    """Top-k, threshold and DGC sum their payloads a block of 2048 elements at a time (whole
    blocks at 6144; 600001 float32 or float64 elements go out by non-temporal stores, from the
    first 32-byte boundary of an output that starts off one): the numpy reference's bits with
    check_finite or not, and True exactly when every element of the sum is
    finite in the output's dtype. A NaN sits in the last element (past the last whole block); an
    overflow is three finite values at one index that sum past the dtype's largest."""
    xs = [random_grad(n, dtype, seed=500 + r) for r in range(3)]
    if bad == "nan":
        xs[1][n - 1] = float("nan")
    elif bad == "overflow":
        big = 0.75 * torch.finfo(xs[0].dtype).max
        for x in xs:
            x[n // 2] = big
    made = [sparse_payload(codec, x) for x in xs]
    p = made[0][1]
    payloads = [pl for pl, _ in made]
    raw = [payload_bytes(pl) for pl in payloads]
    cid = ref.CODEC_ID[codec]
    for alpha in (0.5, 1.0):
        want = ref.aggregate(codec, raw, n, dtype, alpha, k=p.k)
        outs = []
        for check in (False, True):
            # the checked sum lands one element into its buffer: not on a 32-byte boundary
            buf = torch.full((n + 1,), 3.0, dtype=xs[0].dtype)
            out = buf[1:] if check else buf[:n]
            if codec == "threshold":
                finite = _C.aggregate_concat(cid, torch.cat(payloads), 3, out, p, alpha,
                                             check_finite=check)
            else:
                finite = _C.aggregate(cid, torch.stack([pl.view(torch.uint8) for pl in payloads]),
                                      out, p, alpha, check_finite=check)
            assert same_bits(t2n(out), want), (alpha, check)
            assert float(buf[0 if check else n]) == 3.0
            outs.append(finite)
        assert outs[0] is True  # not asked
        assert outs[1] == numpy_all_finite(out) == (bad is None), alpha


def test_sparse_sums_refuse_indices_outside_the_tensor_or_out_of_order():
    """A corrupt payload is an error that says what is wrong, not a sum with entries lost."""
    n = 10000
    x = random_grad(n, "float32", seed=9)
    payload, p = threshold_encode(x, 1.0)
    count = int(payload[4:8].view(torch.int32))
    idx = payload[8:8 + 4 * count].view(torch.int32)
    assert count > 10 and bool((idx[1:] > idx[:-1]).all())
    out = torch.empty(n)
    for i, value, message in [(count - 1, n, f"index {n} outside a tensor of {n} elements"),
                              (0, -4, f"index -4 outside a tensor of {n} elements"),
                              (count - 1, 5, "indices are not ascending")]:
        corrupt = payload.clone()
        corrupt[8:8 + 4 * count].view(torch.int32)[i] = value
        with pytest.raises(ValueError, match=f"threshold payload {message}"):
            _C.aggregate_concat(THR, corrupt, 1, out, p, 1.0)
    gathered = torch.stack([sparse_payload("topk", x)[0].view(torch.uint8)])
    k = n // 100
    gathered[0, 8:8 + 4 * k].view(torch.int32)[k - 1] = n + 7
    with pytest.raises(ValueError, match=f"topk payload index {n + 7} outside a tensor of {n}"):
        _C.aggregate(ref.CODEC_ID["topk"], gathered, out, params(k=k), 1.0)
