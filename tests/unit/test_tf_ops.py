"""The TensorFlow ops are the same kernels as the torch extension: identical bytes for every
codec, dtype, error feedback and momentum; the state round-trips torch -> TF -> torch."""
import numpy as np
import pytest
import tensorflow as tf
import torch

from helpers import random_grad, same_bits, t2n
import numpy_ref as ref
import hvd_compress as hc
from hvd_compress.seeds import seed_base
from hvd_compress.tensorflow import Compression
from hvd_compress.tensorflow.codec import TFAdapter, TFCodec, _signed64
from hvd_compress.tensorflow.ops import lib
from hvd_compress.torch import _C
from hvd_compress.torch.codec import TorchAdapter, TorchCodec

TF_DTYPES = {"float32": tf.float32, "float16": tf.float16, "bfloat16": tf.bfloat16,
             "float64": tf.float64}
SPECS = ["none", "fp16", "bf16", "onebit,ef=vanilla", "signsgd,momentum=nesterov", "efsignsgd",
         "topk,k=0.05,ef=vanilla,momentum=nesterov", "randomk,k=0.1,ef=vanilla,seed=4",
         "minmax8,chunk=300,ef=vanilla", "threshold,threshold=0.7,ef=vanilla",
         "dgc,k=0.05,momentum_factor=0.7,clip_norm=3.3"]


def to_tf(t: torch.Tensor, dtype: str) -> tf.Tensor:
    # Through float64 the values are exact; the cast back is exact since they came from dtype.
    return tf.cast(tf.constant(t.double().numpy()), TF_DTYPES[dtype])


def tf_bytes(t) -> bytes:
    return np.asarray(t.numpy()).tobytes()


def torch_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("spec", SPECS)
def test_tf_and_torch_give_identical_bytes(spec, dtype):
    cfg = hc.parse_spec(spec)
    # two ranks: threshold's payloads are gathered back to back, and the codec says how many
    tfc = TFCodec(cfg, hc.StateStore(TFAdapter()), world=2)
    thc = TorchCodec(cfg, hc.StateStore(TorchAdapter()), world=2)
    for step in range(3):
        g = random_grad(1000, dtype, seed=step).view(20, 50)
        a = tfc.encode("layer/w", to_tf(g, dtype), prescale=0.5)
        b = thc.encode("layer/w", g.clone(), prescale=0.5)
        assert tf_bytes(a.payload) == torch_bytes(b.payload), f"payload, step {step}"
        if cfg.info.linear:
            da, db = tfc.decode(a.payload, a, 0.25), thc.decode(b.payload, b, 0.25)
        else:
            # a second rank's payload, from fresh state on each side
            other = random_grad(1000, dtype, seed=50 + step).view(20, 50)
            a2 = TFCodec(cfg, hc.StateStore(TFAdapter()), world=2).encode("x", to_tf(other, dtype))
            b2 = TorchCodec(cfg, hc.StateStore(TorchAdapter()), world=2).encode("x", other)
            da = tfc.aggregate(tf.concat([a.payload, a2.payload], 0), a, 0.5)
            db = thc.aggregate(torch.cat([b.payload, b2.payload]), b, 0.5)
        assert tf_bytes(da) == torch_bytes(db), f"decoded, step {step}"
    # and the state later steps would send from, which three payloads need not show
    for kind in ("ef", "momentum"):
        want = thc.store.peek("layer/w", kind)
        if want is not None:
            got = TFAdapter().to_numpy(tfc.store.peek("layer/w", kind)).astype(np.float64)
            assert np.array_equal(got, want.double().numpy(), equal_nan=True), kind


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "function"])
def test_masked_momentum_is_the_same_state_in_tf_and_torch(graph):
    """Top-k under momentum=nesterov clears the momentum of what it sends (DGC's momentum
    factor masking) in both frontends, traced or not, to the same bits as the oracle."""
    cfg = hc.parse_spec("topk,k=0.05,ef=vanilla,momentum=nesterov,mu=0.9")
    tfc = TFCodec(cfg, hc.StateStore(TFAdapter()))
    thc = TorchCodec(cfg, hc.StateStore(TorchAdapter()))
    encode = tf.function(lambda g: tfc.encode("w", g).payload) if graph else (
        lambda g: tfc.encode("w", g).payload)
    m_ref, e_ref = np.zeros(1000, np.float32), np.zeros(1000, np.float32)
    for step in range(3):
        g = random_grad(1000, "float32", seed=step)
        x, m_ref = ref.nesterov(g.numpy(), m_ref, 0.9, "float32")
        want, e_ref = ref.ef_encode("topk", x, e_ref, "float32", k=50)
        cleared = (e_ref == 0) & (m_ref != 0)
        m_ref[e_ref == 0] = 0
        assert tf_bytes(encode(tf.constant(g.numpy()))) == want
        assert torch_bytes(thc.encode("w", g.clone()).payload) == want
        assert cleared.sum() >= 50 if step == 0 else cleared.any()
    for frontend in (TFAdapter().to_numpy(tfc.store.peek("w", "momentum")),
                     thc.store.peek("w", "momentum").numpy()):
        assert same_bits(frontend.ravel(), m_ref)


def test_tf_codec_traces_once_and_keeps_stepping():
    cfg = hc.parse_spec("randomk,k=0.1,ef=vanilla")
    codec = TFCodec(cfg, hc.StateStore(TFAdapter()))
    traces = []

    @tf.function
    def step(x):
        traces.append(1)
        return codec.encode("v", x).payload

    x = tf.range(100, dtype=tf.float32)
    picks = [step(x).numpy() for _ in range(3)]
    first = len(traces)  # TF traces a variable-creating function twice on its first call
    step(x)
    assert first <= 2 and len(traces) == first
    assert codec.store.state_dict()["steps"] == {"v": 4}
    # the indices move from step to step (seeded by the step counter variable)
    assert not (np.array_equal(picks[0], picks[1]) and np.array_equal(picks[1], picks[2]))


def test_state_round_trips_torch_to_tf_to_torch():
    cfg = hc.parse_spec("onebit,ef=vanilla,momentum=nesterov")
    th = TorchCodec(cfg, hc.StateStore(TorchAdapter(), spec=cfg.canonical()))
    grads = [random_grad(600, "float32", seed=s).view(30, 20) for s in range(4)]
    for g in grads[:2]:
        th.encode("w", g.clone())
    th.settle()
    saved = th.store.state_dict()

    tfc = TFCodec(cfg, hc.StateStore(TFAdapter(), spec=cfg.canonical()))
    tfc.store.load_state_dict(saved)
    a = tfc.encode("w", tf.constant(grads[2].numpy()))
    b = th.encode("w", grads[2].clone())
    assert tf_bytes(a.payload) == torch_bytes(b.payload)

    tfc.settle()
    th.settle()
    back = hc.StateStore(TorchAdapter(), spec=cfg.canonical())
    back.load_state_dict(tfc.store.state_dict())
    for kind in ("ef", "momentum", "ef_carry"):
        want = th.store.peek("w", kind)
        got = back.slot("w", kind, want)
        assert torch.equal(got, want), kind


@pytest.mark.parametrize("spec", ["dgc,k=0.05,momentum_factor=0.8,clip_norm=4.1,warmup_steps=3",
                                  "threshold,threshold=0.9,ef=vanilla"])
def test_codec_state_round_trips_torch_to_tf_to_torch(spec):
    """DGC's velocity and accumulator (and its step count, which the warm-up reads), and
    threshold's residual: saved by torch, continued by TF with the same bytes, and back."""
    cfg = hc.parse_spec(spec)
    th = TorchCodec(cfg, hc.StateStore(TorchAdapter(), spec=cfg.canonical()))
    grads = [random_grad(600, "float64", seed=s).view(30, 20) for s in range(5)]
    for g in grads[:2]:
        th.encode("w", g.clone())
    tfc = TFCodec(cfg, hc.StateStore(TFAdapter(), spec=cfg.canonical()))
    tfc.store.load_state_dict(th.store.state_dict())
    for g in grads[2:4]:
        a = tfc.encode("w", tf.constant(g.numpy()))
        b = th.encode("w", g.clone())
        assert tf_bytes(a.payload) == torch_bytes(b.payload)
    back = TorchCodec(cfg, hc.StateStore(TorchAdapter(), spec=cfg.canonical()))
    back.store.load_state_dict(tfc.store.state_dict())
    if cfg.stepwise:  # TF counts the steps of codecs that read them (the warm-up) only
        assert back.store.state_dict()["steps"] == th.store.state_dict()["steps"]
    a, b = back.encode("w", grads[4].clone()), th.encode("w", grads[4].clone())
    assert torch_bytes(a.payload) == torch_bytes(b.payload)
    kinds = cfg.info.state_slots or ("ef",)
    for kind in kinds:
        assert torch.equal(back.store.peek("w", kind), th.store.peek("w", kind)), kind


def test_tf_compressor_protocol():
    x = tf.constant(random_grad(1000, "float32").numpy())
    payload, ctx = Compression.fp16.compress(x)
    assert payload.dtype == tf.float16
    assert np.array_equal(Compression.fp16.decompress(payload, ctx).numpy(),
                          tf.cast(tf.cast(x, tf.float16), tf.float32).numpy())
    payload, ctx = Compression.randomk(k=0.1).compress(x)
    assert payload.shape == (100,)
    assert hash(Compression.topk(k=0.5)) == hash(Compression.topk(k=0.5))
    with pytest.raises(RuntimeError, match="onebit payloads travel by allgather"):
        Compression.onebit.compress(x)
    with pytest.raises(RuntimeError, match="error feedback and momentum keep state"):
        Compression.fp16(ef="vanilla").compress(x)


def test_tf_bad_inputs():
    codec = TFCodec(hc.parse_spec("onebit"), None)
    with pytest.raises(ValueError, match="gradient has dtype int32; compression supports"):
        codec.encode("w", tf.constant([1, 2, 3]))
    topk = TFCodec(hc.parse_spec("topk,k=2"), None)
    enc = topk.encode("w", tf.constant([1.0, 2.0, 3.0]))
    onebit = TFCodec(hc.parse_spec("onebit"), None).encode("w", tf.ones([100]))  # also 24 bytes
    bad = tf.concat([enc.payload, onebit.payload], 0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="ranks must use the same compression"):
        topk.aggregate(bad, enc, 0.5)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_powersgd_ops_are_the_torch_kernels(dtype):
    """Every PowerSGD pass as a TF op gives the torch binding's bytes, on a batch of two."""
    f64 = dtype == "float64"
    ftf, fth = (tf.float64, torch.float64) if f64 else (tf.float32, torch.float32)
    rows, cols, r = 9, 7, 2
    gs = [random_grad(rows * cols, dtype, seed=s).view(rows, cols) for s in range(2)]
    es = [random_grad(rows * cols, dtype, seed=10 + s).view(rows, cols) for s in range(2)]
    qt_th = torch.stack([_C.powersgd_initial_q(hc.derive_seed(4, f"w{i}", 3), r, cols, f64)
                         for i in range(2)])
    qt_tf = tf.stack([lib.hvdc_powersgd_initial_q(tf.constant(3, tf.int64), F=ftf, r=r, cols=cols,
                                                  seed_base=_signed64(seed_base(4, f"w{i}")))
                      for i in range(2)])
    assert tf_bytes(qt_tf) == torch_bytes(qt_th)
    p_tf, m_tf = lib.hvdc_powersgd_project([to_tf(g, dtype) for g in gs],
                                           [to_tf(e, dtype) for e in es], qt_tf)
    m_th = [e.clone() for e in es]
    p_th = torch.empty(2, rows, r, dtype=fth)
    _C.powersgd_project(gs, m_th, True, qt_th, p_th)
    assert tf_bytes(p_tf) == torch_bytes(p_th)
    assert [tf_bytes(m) for m in m_tf] == [torch_bytes(m) for m in m_th]
    p_tf = lib.hvdc_powersgd_orthogonalize(p_tf, tf.constant(1e-8, tf.float64))
    _C.powersgd_orthogonalize(p_th, 1e-8)
    assert tf_bytes(p_tf) == torch_bytes(p_th)
    q_tf = lib.hvdc_powersgd_back_project(m_tf, p_tf)
    q_th = torch.empty(2, r, cols, dtype=fth)
    _C.powersgd_back_project(m_th, p_th, q_th)
    assert tf_bytes(q_tf) == torch_bytes(q_th)
    for subtract, alpha in [(True, 1.0), (False, 0.5)]:
        out_tf = lib.hvdc_powersgd_reconstruct(m_tf, p_tf, q_tf, tf.constant(alpha, tf.float64),
                                               subtract=subtract)
        out_th = [m.clone() for m in m_th]
        _C.powersgd_reconstruct(p_th, q_th, out_th, alpha, subtract)
        assert [tf_bytes(o) for o in out_tf] == [torch_bytes(o) for o in out_th], subtract



@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("codec", ["fp16", "bf16"])
def test_tf_aggregate_pair_gives_the_torch_kernels_bytes(codec, dtype):
    """The op that reduces two ranks' payloads from their words' sum (hvdc_aggregate_pair)
    returns the torch kernel's bytes on both ranks, for an odd length (half a last word)."""
    n, kid = 1001, hc.get_codec(codec).kernel_id
    p = _C.Params()
    payloads = []
    for r in range(2):
        pl = _C.new_payload(kid, random_grad(n, dtype, seed=r), p)
        _C.encode(kid, random_grad(n, dtype, seed=r), p, pl)
        payloads.append(pl)
    padded = [np.frombuffer(torch_bytes(pl) + bytes(2), np.uint32).astype(np.uint64)
              for pl in payloads]
    summed = ((padded[0] + padded[1]) % (1 << 32)).astype(np.uint32).view(np.int32)
    for rank in range(2):
        want = torch.empty(n, dtype=random_grad(1, dtype).dtype)
        _C.aggregate_pair(kid, payloads[rank], torch.from_numpy(summed.copy()), rank, want, p, 0.5)
        raw = torch_bytes(payloads[rank])
        own = (tf.constant(np.frombuffer(raw, np.float16)) if codec == "fp16"
               else tf.constant(np.frombuffer(raw, np.uint8)))
        got = lib.hvdc_aggregate_pair(own, tf.constant(summed), tf.constant(0.5, tf.float64),
                                      T=TF_DTYPES[dtype], n=n, rank=rank, codec=kid)
        assert tf_bytes(got) == torch_bytes(want)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_heavy_ball_op_rounds_as_the_reference(dtype):
    """DGC's momentum on a gradient it leaves uncompressed, in one kernel: m*factor, then
    + grad, each rounded to the dtype, bit for bit as torch.optim.SGD's buffer."""
    g, m = random_grad(1003, dtype, seed=1), random_grad(1003, dtype, seed=2)
    _, want = ref.heavy_ball(t2n(g), t2n(m), 0.7, dtype)  # bfloat16: bits, as TF's bytes
    got = lib.hvdc_heavy_ball(to_tf(g, dtype), to_tf(m, dtype), tf.constant(0.7, tf.float64))
    assert tf_bytes(got) == np.asarray(want).tobytes()
    with pytest.raises(tf.errors.InvalidArgumentError, match="momentum buffer must match"):
        lib.hvdc_heavy_ball(to_tf(g, dtype), to_tf(m, dtype)[:5], tf.constant(0.7, tf.float64))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_all_finite_op_finds_any_inf_or_nan(dtype):
    """The finite check of a traced step: every position (the vector loop's body, its
    16 KiB blocks and the scalar tail), inf and NaN, in any of the tensors given."""
    n = 20011
    ok = to_tf(random_grad(n, dtype, seed=3), dtype)
    assert bool(lib.hvdc_all_finite([ok, ok[:7]]))
    for at in (0, 63, 8191, n - 5, n - 1):
        for bad in (np.inf, -np.inf, np.nan):
            hit = tf.tensor_scatter_nd_update(ok, [[at]], tf.constant([bad], ok.dtype))
            assert not bool(lib.hvdc_all_finite([ok, hit])), (at, bad)
    big = tf.constant(np.finfo(np.float16).max if dtype == "float16" else 3.0e38, ok.dtype)
    assert bool(lib.hvdc_all_finite([tf.fill([9], big)]))  # largest finite values pass
