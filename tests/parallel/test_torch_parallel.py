"""Two-rank tests, run by `make test` in full under `mpirun -np 2` and each test once
under `horovodrun --gloo -np 2`.

Each rank can compute every rank's gradient (they come from seeds), so the expected aggregate
is a numpy simulation of the codec over both ranks, checked bit for bit against what the real
collective delivered.
"""
from __future__ import annotations

import copy
import gc
import time
import warnings
import weakref

import horovod.torch as hvd
import numpy as np
import pytest
import torch

import numpy_ref as ref
from helpers import (TORCH_DTYPES, codec_strategies, join_specs, n2t, owner_sums_rounded_to,
                     same_bits, t2n, two_rank_marker)
from simulation import (BPPS_SHAPE, BPPS_SPECS, PowerSGDKernelSimulation, Simulation,
                        bpps_pass_grads, bpps_weights, grads_for_step, rank_sum)
import hvd_compress as hc
import hvd_compress.torch as hvdc
import hvd_compress.torch.optimizer as optimizer_module
from hvd_compress.torch import Compression

# A set without rank 1: rank 1 must then step on its own gradients, as with Horovod.
FIRST = hvd.ProcessSet([0])
hvd.init(process_sets=[FIRST])
WORLD = hvd.size()
RANK = hvd.rank()
pytestmark = two_rank_marker(WORLD)

CODECS = ["none", "fp16", "bf16", "onebit", "signsgd", "efsignsgd", "topk", "randomk",
          "minmax8", "dithering", "qsgd", "terngrad", "natural", "threshold,threshold=1.0"]


def single_param_optimizer(spec, n, dtype=torch.float32, **kw):
    p = torch.nn.Parameter(torch.zeros(n, dtype=dtype))
    opt = hvdc.DistributedOptimizer(torch.optim.SGD([p], lr=0.0), named_parameters=[("w", p)],
                                    compression=spec, min_compress_bytes=0, **kw)
    return p, opt


def reduce_step(p, opt, g):
    opt.zero_grad()
    (p * g).sum().backward()
    opt.synchronize()
    out = p.grad.detach().clone()
    with opt.skip_synchronize():
        opt.step()
    return out


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("codec", CODECS)
def test_aggregate_equals_simulation(codec, dtype):
    n = 6007
    p, opt = single_param_optimizer(codec, n, TORCH_DTYPES[dtype])
    sim = Simulation(codec, n, dtype, WORLD)
    for step in range(3):
        grads = grads_for_step(n, dtype, step, WORLD)
        got = reduce_step(p, opt, n2t(grads[RANK], dtype))
        assert same_bits(t2n(got), sim(grads)), f"step {step}"


@pytest.mark.parametrize("spec", ["topk,k=0.02,ef=vanilla", "onebit,ef=vanilla,momentum=nesterov",
                                  "randomk,k=0.1,ef=vanilla,seed=11", "fp16,ef=vanilla",
                                  "signsgd,momentum=nesterov,mu=0.5", "bf16,ef=vanilla",
                                  "dithering,s=2,partition=natural,ef=vanilla,seed=3",
                                  "terngrad,momentum=nesterov", "fp16,collective=allgather"])
def test_error_feedback_and_momentum_equal_simulation(spec):
    n = 4099
    p, opt = single_param_optimizer(spec, n)
    sim = Simulation(spec, n, "float32", WORLD)
    for step in range(4):
        grads = grads_for_step(n, "float32", step, WORLD)
        got = reduce_step(p, opt, n2t(grads[RANK], "float32"))
        assert same_bits(t2n(got), sim(grads)), f"step {step}"


def test_threshold_with_a_rank_sending_nothing():
    """GRACE issue #16: a rank with no element above the threshold must not hang the job."""
    n = 3000
    p, opt = single_param_optimizer("threshold,threshold=1.0", n)
    sim = Simulation("threshold,threshold=1.0", n, "float32", WORLD)
    grads = grads_for_step(n, "float32", 0, WORLD)
    grads[0] = grads[0] * np.float32(1e-6)  # rank 0: nothing above 1.0
    got = reduce_step(p, opt, n2t(grads[RANK], "float32"))
    assert same_bits(t2n(got), sim(grads))


@pytest.mark.parametrize("spec", ["dgc,k=0.01", "dgc,k=0.05,momentum_factor=0.5,clip_norm=20",
                                  "dgc,k=0.01,warmup_steps=3"])
def test_dgc_equals_simulation_and_leaves_biases_uncompressed_with_its_momentum(spec):
    w = torch.nn.Parameter(torch.zeros(60, 70))
    b = torch.nn.Parameter(torch.zeros(70))
    with pytest.warns(UserWarning, match="dgc in the compression spec replaces the optimizer"):
        opt = hvdc.DistributedOptimizer(torch.optim.SGD([w, b], lr=0.0, momentum=0.9),
                                        named_parameters=[("w", w), ("b", b)], compression=spec,
                                        min_compress_bytes=0)
    assert opt.param_groups[0]["momentum"] == 0  # DGC's momentum correction replaces it
    n = w.numel()
    sim = Simulation(spec, n, "float32", WORLD)
    bias_sim = Simulation(spec, 70, "float32", WORLD, plain=True)
    for step in range(4):
        grads = grads_for_step(n, "float32", step, WORLD)
        bias = grads_for_step(70, "float32", 50 + step, WORLD)
        opt.zero_grad()
        ((w * n2t(grads[RANK], "float32").view(60, 70)).sum() +
         (b * n2t(bias[RANK], "float32")).sum()).backward()
        opt.synchronize()
        assert same_bits(t2n(w.grad.reshape(-1)), sim(grads)), f"step {step}"
        # with DGC's momentum as heavy-ball momentum: the optimizer's own is 0
        assert same_bits(t2n(b.grad), bias_sim(bias)), f"bias, step {step}"
        with opt.skip_synchronize():
            opt.step()
    assert opt.compression_stats.tensors["b"].codec == "none"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("spec", ["topk,k=0.1,ef=vanilla,momentum=nesterov,mu=0.9",
                                  "none,momentum=nesterov,mu=0.5",
                                  "dgc,k=0.01,momentum_factor=0.6", "onebit,ef=vanilla",
                                  "powersgd,momentum=nesterov,mu=0.5"])
def test_spec_momentum_reaches_gradients_that_travel_uncompressed(spec, dtype):
    """The spec's momentum replaces the optimizer's (set to 0): a gradient under
    min_compress_bytes still gets it before Horovod's allreduce (onebit: no spec momentum, the
    gradient as it is)."""
    n = 300
    p = torch.nn.Parameter(torch.zeros(n, dtype=TORCH_DTYPES[dtype]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the notes that the optimizer's momentum is replaced
        opt = hvdc.DistributedOptimizer(torch.optim.SGD([p], lr=0.0, momentum=0.9),
                                        named_parameters=[("w", p)], compression=spec,
                                        min_compress_bytes=10 ** 6)
    sim = Simulation(spec, n, dtype, WORLD, plain=True)
    for step in range(4):
        grads = grads_for_step(n, dtype, step, WORLD)
        got = reduce_step(p, opt, n2t(grads[RANK], dtype))
        assert same_bits(t2n(got), sim(grads)), f"step {step}"
    assert opt.compression_stats.tensors["w"].codec == "none"


@pytest.mark.parametrize("spec,nesterov", [("topk,k=0.1,ef=vanilla,momentum=nesterov,mu=0.9", True),
                                           ("dgc,k=0.01", False)])
def test_uncompressed_model_trains_as_with_the_optimizers_own_momentum(spec, nesterov):
    """Every tensor under min_compress_bytes: the run follows Horovod's optimizer with SGD's
    own momentum (nesterov for momentum=nesterov, heavy-ball for DGC's correction), to the
    rounding of averaging before rather than after the momentum."""
    xs, ys = regression_data(RANK, 6)
    models = [make_model(), make_model()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = hvdc.DistributedOptimizer(
            torch.optim.SGD(models[0].parameters(), lr=0.05, momentum=0.9),
            named_parameters=models[0].named_parameters(), compression=spec,
            min_compress_bytes=10 ** 6)
    stock = hvd.DistributedOptimizer(
        torch.optim.SGD(models[1].parameters(), lr=0.05, momentum=0.9, nesterov=nesterov),
        named_parameters=[("stock." + k, v) for k, v in models[1].named_parameters()])
    for x, y in zip(xs, ys):
        for model, opt in zip(models, (ours, stock)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    moved = [(a - b).abs().max() for a, b in zip(models[0].parameters(),
                                                  make_model().parameters())]
    assert min(moved) > 1e-3  # momentum or not, the run has moved the weights
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def embedding_run(spec, sparse, bucket_mb, steps=3, dense=True):
    """An embedding and a linear layer trained `steps` steps; each rank looks up other rows.
    dense: sparse_as_dense. Returns the reduced gradients of every step, the compression state
    and statistics."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(500, 8, sparse=sparse),
                                torch.nn.Linear(8, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = hvdc.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            named_parameters=model.named_parameters(), compression=spec, sparse_as_dense=dense,
            min_compress_bytes=0, bucket_mb=bucket_mb)
    grads = []
    for step in range(steps):
        opt.zero_grad()
        ids = torch.tensor([[RANK, 3 + step, 7 * (RANK + 1)]])
        model(ids).sum().backward()
        opt.synchronize()
        grads.append([q.grad.clone() for q in model.parameters()])
        with opt.skip_synchronize():
            opt.step()
    return grads, opt.compression_state_dict(), opt.compression_stats


@pytest.mark.parametrize("spec,bucket_mb", [("topk,k=0.1,ef=vanilla", 0), ("topk,k=0.1,ef=vanilla", 1),
                                            ("dgc,k=0.1", 0),
                                            ("onebit,ef=vanilla,momentum=nesterov", 1)])
def test_sparse_as_dense_compresses_embedding_gradients_as_dense_ones(spec, bucket_mb):
    """sparse_as_dense=True: a sparse embedding gradient is densified first and goes through
    the codec, its buckets and its state like the same layer's dense gradient, bit for bit (as
    in the TF frontend)."""
    got, state, stats = embedding_run(spec, True, bucket_mb)
    want, want_state, _ = embedding_run(spec, False, bucket_mb)
    for step, (g, w) in enumerate(zip(got, want)):
        for a, b in zip(g, w):
            assert not a.is_sparse and same_bits(t2n(a), t2n(b)), f"step {step}"
    assert_same_state(state, want_state)
    assert "0.weight" in state["slots"]
    sent = {t.codec for t in stats.tensors.values()}
    assert sent - {"none"}, sent  # the codec carried them, not Horovod's plain allreduce


@pytest.mark.parametrize("spec", ["topk,k=0.1,ef=vanilla,momentum=nesterov", "dgc,k=0.1"])
def test_sparse_gradient_under_spec_momentum_is_refused_with_the_fix(spec):
    """Horovod gathers a sparse gradient uncompressed, where the spec's momentum (which replaced
    the optimizer's) cannot reach it: an error on every rank that names sparse_as_dense."""
    with pytest.raises(ValueError, match="'0.weight' has a sparse gradient.*sparse_as_dense=True"):
        embedding_run(spec, sparse=True, bucket_mb=0, dense=False)
    grads, _, _ = embedding_run("topk,k=0.1,ef=vanilla", sparse=True, bucket_mb=0, dense=False)
    assert grads[0][0].is_sparse  # without the spec's momentum, Horovod's sparse allreduce


def test_float16_gradients():
    n = 3000
    for codec in ["onebit", "topk", "fp16"]:
        p, opt = single_param_optimizer(codec, n, torch.float16)
        sim = Simulation(codec, n, "float16", WORLD)
        grads = grads_for_step(n, "float16", 0, WORLD)
        got = reduce_step(p, opt, n2t(grads[RANK], "float16"))
        assert same_bits(t2n(got), sim(grads)), codec


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def regression_data(rank, steps, batch=32, seed=7):
    """Batch i is the same whatever `steps` is, so shorter runs replay longer ones."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(32, 1, generator=g)
    xs, ys = [], []
    for i in range(steps):
        gr = torch.Generator().manual_seed(seed * 100003 + rank * 1009 + i)
        x = torch.randn(batch, 32, generator=gr)
        xs.append(x)
        ys.append(torch.tanh(x @ w) + 0.1 * torch.randn(batch, 1, generator=gr))
    return torch.stack(xs), torch.stack(ys)


def train(spec, steps=200, lr=0.05, min_bytes=0):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvdc.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                    compression=spec, min_compress_bytes=min_bytes)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    xs, ys = regression_data(RANK, steps)
    losses = []
    for i in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xs[i]), ys[i])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, opt, losses


def eval_loss(model):
    xs, ys = regression_data(rank=99, steps=1, batch=2048)
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(xs[0]), ys[0]).item()


def same_on_all_ranks(model):
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0), name="param_check")
    return torch.equal(gathered[0], gathered[1])


_baseline = {}


@pytest.mark.parametrize("spec", ["fp16", "bf16", "efsignsgd", "onebit,ef=vanilla",
                                  "signsgd,ef=vanilla", "topk,k=0.05,ef=vanilla",
                                  "randomk,k=0.05,ef=vanilla", "minmax8,ef=vanilla",
                                  "dithering,ef=vanilla", "qsgd,ef=vanilla", "terngrad,ef=vanilla",
                                  "natural,ef=vanilla", "threshold,threshold=0.002,ef=vanilla",
                                  "dgc,k=0.05", "powersgd,rank=2,start_iter=10",
                                  "topk,k=0.05,ef=vanilla,"
                                  "momentum=nesterov,mu=0.5"])
def test_training_reaches_uncompressed_loss(spec):
    if "none" not in _baseline:
        model, _, _ = train("none")
        _baseline["none"] = eval_loss(model)
    model, opt, losses = train(spec)
    assert same_on_all_ranks(model), "ranks ended with different parameters"
    final = eval_loss(model)
    assert final <= 1.10 * _baseline["none"], (spec, final, _baseline["none"])
    stats = opt.compression_stats.summary()
    assert stats["steps"] == 200 and stats["total_sent_bytes"] > 0


def test_compression_saves_bytes_and_threshold_routes_small_tensors():
    _, opt, _ = train("onebit,ef=vanilla", steps=3)
    s = opt.compression_stats
    assert s.tensors["0.weight"].sent_bytes < s.tensors["0.weight"].raw_bytes / 20
    _, opt, _ = train("onebit,ef=vanilla", steps=3, min_bytes=65536)  # all layers are smaller
    assert all(t.codec == "none" and t.sent_bytes == t.raw_bytes
               for t in opt.compression_stats.tensors.values())


def test_gradient_clipping_with_synchronize_and_skip_synchronize():
    model = make_model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvdc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(),
                                    compression="topk,k=0.1,ef=vanilla", min_compress_bytes=0)
    xs, ys = regression_data(RANK, 3)
    for i in range(3):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xs[i]), ys[i]).backward()
        opt.synchronize()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        assert torch.isfinite(norm)
        with opt.skip_synchronize():
            opt.step()
    assert same_on_all_ranks(model)


def test_backward_passes_per_step_accumulates_before_compressing():
    n = 2000
    p, opt = single_param_optimizer("topk,k=0.05", n, backward_passes_per_step=2)
    sim = Simulation("topk,k=0.05", n, "float32", WORLD)
    a = grads_for_step(n, "float32", 0, WORLD)
    b = grads_for_step(n, "float32", 1, WORLD)
    opt.zero_grad()
    (p * n2t(a[RANK], "float32")).sum().backward()
    (p * n2t(b[RANK], "float32")).sum().backward()
    opt.synchronize()
    want = sim([x + y for x, y in zip(a, b)])
    assert same_bits(t2n(p.grad), want)


@pytest.mark.parametrize("spec", BPPS_SPECS)
def test_backward_passes_per_step_weights_equal_simulation(spec):
    """The same weights as the Keras optimizer's test in test_tf_parallel.py: both frontends
    agree bit for bit."""
    steps, passes = 3, 4
    p = torch.nn.Parameter(torch.zeros(BPPS_SHAPE))
    opt = hvdc.DistributedOptimizer(torch.optim.SGD([p], lr=0.5), named_parameters=[("w", p)],
                                    compression=spec, min_compress_bytes=0,
                                    backward_passes_per_step=passes)
    for step in range(steps):
        opt.zero_grad()
        for k in range(passes):
            (p * n2t(bpps_pass_grads(step, k, WORLD)[RANK], "float32")).sum().backward()
        opt.step()
    assert same_bits(t2n(p.detach()), bpps_weights(spec, steps, passes, 0.5, WORLD))


@pytest.mark.parametrize("spec", ["topk,k=0.1,ef=vanilla,momentum=nesterov", "efsignsgd",
                                  "dgc,k=0.05,warmup_steps=4", "dithering,ef=vanilla,seed=5",
                                  "powersgd,rank=2,start_iter=3"])
def test_compression_state_checkpoint_restart_is_bit_exact(spec):
    full_model, _, _ = train(spec, steps=20)
    model, opt, _ = train(spec, steps=10)
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
             opt.compression_state_dict())
    model2 = make_model(seed=123)
    model2.load_state_dict(saved[0])
    opt2 = hvdc.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.05),
                                     named_parameters=model2.named_parameters(),
                                     compression=spec, min_compress_bytes=0)
    opt2.load_state_dict(saved[1])
    opt2.load_compression_state_dict(saved[2])
    xs, ys = regression_data(RANK, 20)
    for i in range(10, 20):
        opt2.zero_grad()
        torch.nn.functional.mse_loss(model2(xs[i]), ys[i]).backward()
        opt2.step()
    for a, b in zip(full_model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("codec", ["onebit", "topk", "signsgd", "efsignsgd", "bf16"])
def test_stock_optimizer_rejects_allgather_codecs(codec):
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=getattr(Compression, codec))
    xs, ys = regression_data(RANK, 1)
    with pytest.raises(RuntimeError, match="travel by allgather"):
        torch.nn.functional.mse_loss(model(xs[0]), ys[0]).backward()


@pytest.mark.parametrize("codec", ["fp16", "randomk"])
def test_stock_optimizer_with_linear_codecs_equals_simulation(codec):
    n = 5000
    p = torch.nn.Parameter(torch.zeros(n))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=0.0), named_parameters=[("w", p)],
                                   compression=getattr(Compression, codec))
    grads = grads_for_step(n, "float32", 0, WORLD)
    opt.zero_grad()
    (p * n2t(grads[RANK], "float32")).sum().backward()
    opt.synchronize()
    if codec == "fp16":  # Horovod's Average on halves: half sum, then times 1/2
        hs = [g.astype(np.float16).astype(np.float32) for g in grads]
        want = (rank_sum(hs).astype(np.float16).astype(np.float32) * np.float32(0.5))
        want = want.astype(np.float16).astype(np.float32)
    else:
        k = ref.kept(0.01, n)
        seed = hc.derive_seed(0, f"[{n}]#0", 0)
        vals = [g[ref.randomk_strata(n, k, seed)[0]] for g in grads]
        want = ref.decode("randomk", ((vals[0] + vals[1]) * np.float32(0.5)).tobytes(), n,
                          "float32", 1.0, k=k, seed=seed)
    np.testing.assert_array_equal(t2n(p.grad), want)


@pytest.mark.parametrize("codec", ["none", "fp16", "randomk"])
def test_stock_optimizer_takes_bfloat16_gradients(codec):
    """Horovod's own allreduce refuses bfloat16; our compressors send it as float32, so the
    result is a float32 twin's (fed the same values) rounded to bfloat16."""
    def reduced(dtype):
        p = torch.nn.Parameter(torch.zeros(7, 300, dtype=dtype))
        opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=0.0), named_parameters=[("w", p)],
                                       compression=getattr(Compression, codec))
        g = _kind_grad((7, 300), torch.bfloat16, 0, RANK)
        opt.zero_grad()
        (p * g.to(dtype)).sum().backward()
        opt.synchronize()
        return p.grad

    got = reduced(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, reduced(torch.float32).to(torch.bfloat16))


def test_ranks_with_different_specs_get_an_error():
    spec = "topk,k=0.01" if RANK == 0 else "topk,k=0.02"
    with pytest.raises(ValueError, match="ranks disagree on the compression spec"):
        single_param_optimizer(spec, 100)


@pytest.mark.parametrize("spec", ["onebit,ef=vanilla", "topk,k=0.01,ef=vanilla", "efsignsgd",
                                  "powersgd"])
def test_optimizer_momentum_after_error_feedback_warns_with_the_fix(spec):
    model = make_model()
    with pytest.warns(UserWarning, match=r"move it into the compression spec: compression=\".*"
                                         r"momentum=nesterov,mu=0.9\""):
        hvdc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=model.named_parameters(), compression=spec)


@pytest.mark.parametrize("spec", ["onebit", "topk,k=0.01", "dgc,k=0.01",
                                  "powersgd,error_feedback=false",
                                  "onebit,ef=vanilla,momentum=nesterov,mu=0.9",
                                  "powersgd,momentum=nesterov,mu=0.9"])
def test_no_momentum_warning_without_error_feedback_or_with_the_fix(spec, recwarn):
    model = make_model()
    hvdc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                              named_parameters=model.named_parameters(), compression=spec)
    assert not [w for w in recwarn if "after" in str(w.message)]


def test_mismatched_codec_payloads_are_refused():
    """Same payload size, different codec: the tag check refuses instead of decoding garbage."""
    from hvd_compress.torch.codec import TorchCodec
    codec = TorchCodec(hc.parse_spec("onebit" if RANK == 0 else "signsgd"), None)
    enc = codec.encode("w", torch.randn(1000))
    gathered = hvd.allgather(enc.payload, name="tag_check")
    with pytest.raises(ValueError, match="ranks must use the same compression spec"):
        codec.aggregate(gathered, enc, 0.5)


def test_mismatched_payload_sizes_raise_not_hang():
    payload = torch.zeros(1, 16 if RANK == 0 else 24, dtype=torch.uint8)
    with pytest.raises(Exception, match="(?i)mismatch"):
        hvd.allgather(payload, name="size_check")


def test_bad_optimizer_arguments():
    p = torch.nn.Parameter(torch.zeros(4))
    sgd = torch.optim.SGD([p], lr=0.1)
    with pytest.raises(ValueError, match="op=.* is not supported with compression; valid"):
        hvdc.DistributedOptimizer(sgd, compression="topk", op=hvd.Adasum)
    with pytest.raises(ValueError, match="groups/num_groups are not supported"):
        hvdc.DistributedOptimizer(sgd, compression="topk", num_groups=2)
    with pytest.raises(ValueError, match="min_compress_bytes must be an integer >= 0"):
        hvdc.DistributedOptimizer(sgd, compression="topk", min_compress_bytes=-1)
    with pytest.raises(ValueError, match="unknown codec"):
        hvdc.DistributedOptimizer(sgd, compression="topkk")


# ---- PowerSGD -------------------------------------------------------------------------------
def powersgd_optimizer(spec, shapes, dtype=torch.float32, bucket_mb=0):
    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(s, dtype=dtype))) for i, s in enumerate(shapes)]
    opt = hvdc.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.0),
                                    named_parameters=params, compression=spec, min_compress_bytes=0,
                                    bucket_mb=bucket_mb)
    return params, opt


def powersgd_step(params, opt, grads):
    opt.zero_grad()
    sum((p * torch.from_numpy(g[RANK]).to(p.dtype)).sum() for (_, p), g in zip(params, grads)).backward()
    opt.synchronize()
    out = [p.grad.detach().clone() for _, p in params]
    with opt.skip_synchronize():
        opt.step()
    return out


# the TF test's cases too (test_tf_parallel.py POWERSGD): both frontends equal one simulation
@pytest.mark.parametrize("spec,dtype", [
    ("powersgd,rank=1,start_iter=0", torch.float32),
    ("powersgd,rank=2,start_iter=2,seed=5", torch.float64),
    ("powersgd,rank=3,start_iter=0,error_feedback=false", torch.float64),
    ("powersgd,rank=2,start_iter=0,warm_start=false,orthogonalization_epsilon=1e-8",
     torch.float64),
    ("powersgd,rank=2,start_iter=2,momentum=nesterov,mu=0.9", torch.float32)])
def test_powersgd_equals_simulation(spec, dtype):
    """Bit for bit, the reduced gradients and then the state a checkpoint holds (this rank's
    residual, the shared Q): what TF's reducer also gives and keeps."""
    shapes = [(40, 6, 5), (70,), (3, 4)]
    params, opt = powersgd_optimizer(spec, shapes, dtype)
    sims = [PowerSGDKernelSimulation(spec, f"p{i}", WORLD) for i in range(len(shapes))]
    rng = np.random.default_rng(0)
    np_dtype = t2n(torch.zeros(1, dtype=dtype)).dtype
    for step in range(5):
        grads = [[rng.standard_normal(s) for _ in range(WORLD)] for s in shapes]
        got = powersgd_step(params, opt, grads)
        for g, sim, gs in zip(got, sims, grads):
            assert same_bits(t2n(g), sim([x.astype(np_dtype) for x in gs])), f"step {step}"
    codecs = {n: t.codec for n, t in opt.compression_stats.tensors.items()}
    assert codecs == {"p0": "powersgd", "p1": "none", "p2": "none"}  # 1-D and 12/(7*r) < 2
    slots = opt.compression_state_dict()["slots"]
    assert same_bits(slots["p0"]["powersgd_qt"], t2n(sims[0].qt))
    if sims[0].st.error_feedback:
        assert same_bits(slots["p0"]["ef"].reshape(40, 30), t2n(sims[0].e[RANK]))
    if sims[0].cfg.momentum == "nesterov":  # the compressed gradient's and a plain one's
        for i in (0, 1):
            assert same_bits(slots[f"p{i}"]["momentum"], sims[i].m[RANK])


# TensorFlow's (H, W, I, O) and PyTorch's (O, I, H, W); test_tf_parallel.py has the same case
CONV_KERNELS = [(3, 3, 8, 16), (16, 8, 3, 3)]


def test_powersgd_factors_a_conv_kernel_in_either_layout():
    """Each layout is viewed as its output channels against the rest (72 x 16 and 16 x 72), so
    both are compressed, bit for bit as the simulation; the TF layout's first dimension alone
    (3 x 384) would not be worth compressing at rank 2."""
    spec = "powersgd,rank=2,start_iter=0"
    params, opt = powersgd_optimizer(spec, CONV_KERNELS)
    sims = [PowerSGDKernelSimulation(spec, f"p{i}", WORLD) for i in range(len(CONV_KERNELS))]
    rng = np.random.default_rng(0)
    for step in range(3):
        grads = [[rng.standard_normal(s) for _ in range(WORLD)] for s in CONV_KERNELS]
        got = powersgd_step(params, opt, grads)
        for g, sim, gs in zip(got, sims, grads):
            assert same_bits(t2n(g), sim([x.astype(np.float32) for x in gs])), f"step {step}"
    stats = opt.compression_stats.tensors
    assert {n: t.codec for n, t in stats.items()} == {"p0": "powersgd", "p1": "powersgd"}
    slots = opt.compression_state_dict()["slots"]
    assert slots["p0"]["powersgd_qt"].shape == (2, 16)
    assert slots["p1"]["powersgd_qt"].shape == (2, 72)
    assert same_bits(slots["p0"]["ef"].reshape(72, 16), t2n(sims[0].e[RANK]))


# What travels per variant (batch_same_shape, bucket_mb): on steps 1 and 2, then on step 3.
# Backward produces p4, p3, p2, p1, p0; a bucket of 3 matrices' bytes groups p4-p2 and p1-p0.
PSGD_BUCKET_MB = 3 * 240 * 8 / 2 ** 20
PSGD_SENT = {
    ("true", 0): ([("p0+2.powersgd_p", ((3, 20, 2),)), ("p0+2.powersgd_q", ((3, 2, 12),)),
                   ("p2+1.powersgd_p", ((2, 12, 2),)), ("p2+1.powersgd_q", ((2, 2, 20),))],
                  ["p0+1.powersgd_p", "p0+1.powersgd_q", "p2+1.powersgd_p", "p2+1.powersgd_q"]),
    ("false", PSGD_BUCKET_MB): (
        [("p0+1.powersgd_p", ((1, 20, 2), (1, 20, 2))),
         ("p0+1.powersgd_q", ((1, 2, 12), (1, 2, 12))),
         ("p2+2.powersgd_p", ((1, 12, 2), (1, 20, 2), (1, 12, 2))),
         ("p2+2.powersgd_q", ((1, 2, 20), (1, 2, 12), (1, 2, 20)))],
        ["p0+1.powersgd_p", "p0+1.powersgd_q", "p2+1.powersgd_p", "p2+1.powersgd_q"]),
    ("true", PSGD_BUCKET_MB): (
        [("p0+1.powersgd_p", ((2, 20, 2),)), ("p0+1.powersgd_q", ((2, 2, 12),)),
         ("p2+2.powersgd_p", ((2, 12, 2), (1, 20, 2))),
         ("p2+2.powersgd_q", ((2, 2, 20), (1, 2, 12)))],
        ["p0+1.powersgd_p", "p0+1.powersgd_q", "p2+1.powersgd_p", "p2+1.powersgd_q"]),
}


@pytest.mark.parametrize("batch,bucket_mb", list(PSGD_SENT), ids=["batched", "bucketed",
                                                                  "batched-and-bucketed"])
def test_powersgd_batches_and_buckets_match_unbatched(monkeypatch, batch, bucket_mb):
    """Stacking same-shape matrices (batch_same_shape) and sending a bucket's factors in one
    grouped allreduce (bucket_mb) change how P and Q travel, not the arithmetic: results and
    state equal the unbatched run bit for bit. On step 2 one matrix gets no gradient on rank 1:
    that rank puts zeros in its place, so the batches agree. On step 3 it gets none anywhere:
    its batch and bucket go without it."""
    shapes = [(20, 12), (20, 12), (12, 20), (20, 12), (12, 20), (50,)]
    rng = np.random.default_rng(4)
    grads = [[[rng.standard_normal(s) for _ in range(WORLD)] for s in shapes] for _ in range(4)]
    sent = []
    original = hvd.grouped_allreduce_async_

    def recording(tensors, *args, **kwargs):
        sent.append((kwargs.get("name"), tuple(tuple(t.shape) for t in tensors)))
        return original(tensors, *args, **kwargs)

    monkeypatch.setattr(hvd, "grouped_allreduce_async_", recording)
    results, states = {}, {}
    for variant in (("false", 0), (batch, bucket_mb)):
        spec = f"powersgd,rank=2,start_iter=1,batch_same_shape={variant[0]}"
        params, opt = powersgd_optimizer(spec, shapes, torch.float64, bucket_mb=variant[1])
        got = []
        for step, g in enumerate(grads):
            sent.clear()
            opt.zero_grad()
            lacking = (step == 2 and RANK == 1) or step == 3
            used = [i for i in range(len(shapes)) if not (lacking and i == 3)]
            sum((params[i][1] * torch.from_numpy(g[i][RANK])).sum() for i in used).backward()
            opt.synchronize()
            got.append([p.grad if p.grad is None else p.grad.detach().clone()
                        for _, p in params])
            with opt.skip_synchronize():
                opt.step()
            if variant == ("false", 0) and step > 0:  # one matrix per grouped allreduce
                assert sorted(sent) == sorted(
                    (f"p{i}.powersgd_{f}", ((1,) + (s if f == "p" else s[::-1]),))
                    for i in range(5) if not (step == 3 and i == 3) for f in "pq"
                    for s in [(shapes[i][0], 2) if f == "p" else (shapes[i][1], 2)])
            elif variant != ("false", 0) and step in (1, 2):
                assert sorted(sent) == PSGD_SENT[variant][0]
            elif variant != ("false", 0) and step == 3:
                assert sorted(x[0] for x in sent) == PSGD_SENT[variant][1]
            if step == 3:
                assert params[3][1].grad is None
        results[variant] = got
        states[variant] = opt.compression_state_dict()["slots"]
    plain, other = ("false", 0), (batch, bucket_mb)
    for a, b in zip(results[plain], results[other]):
        for x, y in zip(a, b):
            assert (x is None and y is None) or torch.equal(x, y)
    assert states[plain].keys() == states[other].keys()
    for name, slots in states[plain].items():
        for slot, value in slots.items():
            np.testing.assert_array_equal(value, states[other][name][slot])


def test_powersgd_groups_whose_collective_finished_move_on_at_the_next_gradient():
    """A group whose P is reduced takes steps 5-7 (its Q leaves) at the first gradient after,
    and once Q is in, steps 8-9 at the next: during backward, not left to synchronize(). The
    results and the state are the simulation's, bit for bit."""
    spec = "powersgd,rank=2,start_iter=0"
    shapes = [(20, 12), (12, 20), (16, 10), (30,)]
    params, opt = powersgd_optimizer(spec, shapes)
    sims = [PowerSGDKernelSimulation(spec, f"p{i}", WORLD) for i in range(3)]
    rng = np.random.default_rng(7)

    def settled():
        deadline = time.monotonic() + 60
        while not all(plan.ready() for plan in opt._hvdc_moving):
            assert time.monotonic() < deadline, "the groups' collectives did not finish"
            time.sleep(0.001)

    for step in range(2):
        grads = [[rng.standard_normal(s) for _ in range(WORLD)] for s in shapes]

        def backward(i):
            (params[i][1] * torch.from_numpy(grads[i][RANK]).float()).sum().backward()
        opt.zero_grad()
        backward(0)
        opt._hvdc_counted(block=True)  # the next gradient routes one that waited for the count
        backward(1)
        groups = [opt._handles[params[i][1]][0].batch.group for i in (0, 1)]
        assert all(g.sent for g in groups)
        settled()
        backward(2)  # a group whose P was in at backward(1) may be finished by now
        assert all(g.q_handle is not None for g in groups)
        settled()
        backward(3)
        assert all(g.done for g in groups)
        opt.synchronize()
        for i, sim in enumerate(sims):
            want = sim([x.astype(np.float32) for x in grads[i]])
            assert same_bits(t2n(params[i][1].grad), want), f"p{i}, step {step}"
        with opt.skip_synchronize():
            opt.step()
    slots = opt.compression_state_dict()["slots"]
    for i, sim in enumerate(sims):
        assert same_bits(slots[f"p{i}"]["powersgd_qt"], t2n(sim.qt))
        assert same_bits(slots[f"p{i}"]["ef"].reshape(shapes[i]), t2n(sim.e[RANK]))


def test_powersgd_on_low_rank_gradients_equals_plain_allreduce():
    rng = np.random.default_rng(1)
    u = rng.standard_normal((50, 2))  # shared column space, rank 2
    params, opt = powersgd_optimizer("powersgd,rank=2,start_iter=0", [(50, 30)], torch.float64)
    for step in range(3):
        grads = [[u @ np.random.default_rng(10 * step + r).standard_normal((2, 30))
                  for r in range(WORLD)]]
        got = powersgd_step(params, opt, grads)[0].numpy()
        np.testing.assert_allclose(got, sum(grads[0]) / WORLD, rtol=1e-9, atol=1e-9)


def test_powersgd_error_feedback_invariant_float64():
    """sum of applied updates + mean residual == sum of mean gradients, at every step."""
    params, opt = powersgd_optimizer("powersgd,rank=1,start_iter=0", [(30, 20)], torch.float64)
    applied = np.zeros((30, 20))
    true = np.zeros((30, 20))
    rng = np.random.default_rng(2)
    for step in range(6):
        grads = [[rng.standard_normal((30, 20)) for _ in range(WORLD)]]
        applied += powersgd_step(params, opt, grads)[0].numpy()
        true += sum(grads[0]) / WORLD
        e = opt.compression_state_dict()["slots"]["p0"]["ef"]
        mean_e = hvd.allreduce(torch.from_numpy(e), op=hvd.Average, name=f"e{step}").numpy()
        np.testing.assert_allclose(applied + mean_e, true, rtol=1e-10, atol=1e-10)


def test_powersgd_warm_start_keeps_q_and_cold_start_redraws_it():
    from hvd_compress.torch.powersgd import initial_q
    rng = np.random.default_rng(3)
    grads = [[[rng.standard_normal((40, 25)) for _ in range(WORLD)]] for _ in range(3)]
    qts = {}
    for warm in ("true", "false"):
        params, opt = powersgd_optimizer(f"powersgd,start_iter=0,warm_start={warm}", [(40, 25)],
                                         torch.float64)
        seen = []
        for g in grads:
            powersgd_step(params, opt, g)
            seen.append(opt.compression_state_dict()["slots"]["p0"]["powersgd_qt"].copy())
        qts[warm] = seen
    assert not np.allclose(qts["true"][0], qts["true"][1])  # Q moves with the gradients
    first = initial_q(0, "p0", 0, 1, 25, torch.float64).numpy()
    assert not np.allclose(qts["true"][0], first)
    # cold start: every step begins from a fresh draw, so step 1's result differs from warm
    assert not np.allclose(qts["true"][1], qts["false"][1])


def test_powersgd_residual_alternates_buffers_and_a_skipped_step_puts_the_old_one_back():
    """From a matrix's second compressed step, M = G + E is written into a second buffer and the
    old residual, left as it was, is the step's backup: a non-finite step points the slot back
    at it, and the steps after it alternate again and match the kernel simulation."""
    spec = "powersgd,rank=2,start_iter=0"
    params, opt = powersgd_optimizer(spec, [(30, 20)])
    store = opt._hvdc_store
    oracle = PowerSGDKernelSimulation(spec, "p0", WORLD)
    rng = np.random.default_rng(4)

    def grads():
        return [[rng.standard_normal((30, 20)).astype(np.float32) for _ in range(WORLD)]]

    for _ in range(2):
        g = grads()
        np.testing.assert_array_equal(powersgd_step(params, opt, g)[0].numpy(), oracle(g[0]))
    held, before = store.peek("p0", "ef"), opt.compression_state_dict()
    bad = grads()
    bad[0][WORLD - 1][3, 4] = np.nan
    powersgd_step(params, opt, bad)
    assert store.peek("p0", "ef") is held
    assert_same_state(opt.compression_state_dict(), before)
    for _ in range(2):
        g = grads()
        np.testing.assert_array_equal(powersgd_step(params, opt, g)[0].numpy(), oracle(g[0]))
        moved = store.peek("p0", "ef")
        assert moved.data_ptr() != held.data_ptr()
        held = moved


@pytest.mark.parametrize("bucket_mb", [0, 1])
def test_powersgd_lets_a_steps_gradients_go_when_the_user_does(bucket_mb):
    """Once zero_grad() drops them, a step's gradients are freed at once (reference counts,
    with the cycle collector off): PowerSGD's batches, which hold them, do not outlive the step.
    Before, a group and its batches referred to each other and kept every step's gradients
    until a collection."""
    params, opt = powersgd_optimizer("powersgd,rank=2,start_iter=0", [(30, 20), (40, 20)],
                                     bucket_mb=bucket_mb)
    rng = np.random.default_rng(6)
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            g = [[rng.standard_normal(s).astype(np.float32) for _ in range(WORLD)]
                 for s in ((30, 20), (40, 20))]
            powersgd_step(params, opt, g)
            grads = [weakref.ref(p.grad) for _, p in params]
            opt.zero_grad()
            assert all(r() is None for r in grads)
    finally:
        gc.enable()


@pytest.mark.parametrize("bad", ["p0", "p1"])
def test_powersgd_step_with_a_non_finite_gradient_is_rolled_back_wherever_it_is(bad):
    """PowerSGD checks the matrices it reconstructs as it writes them; the gradients it does not
    compress (here a 1-D one) are still checked after the reduction: a NaN in either rolls the
    step's state back."""
    params, opt = powersgd_optimizer("powersgd,rank=2,start_iter=0", [(30, 20), (7,)])
    store = opt._hvdc_store
    rng = np.random.default_rng(5)

    def grads():
        return [[rng.standard_normal(s).astype(np.float32) for _ in range(WORLD)]
                for s in ((30, 20), (7,))]

    for _ in range(2):
        powersgd_step(params, opt, grads())
    held, before = store.peek("p0", "ef"), opt.compression_state_dict()
    g = grads()
    g[int(bad[1])][WORLD - 1].flat[3] = np.nan
    out = powersgd_step(params, opt, g)
    assert not torch.isfinite(out[int(bad[1])]).all()
    assert store.peek("p0", "ef") is held
    assert_same_state(opt.compression_state_dict(), before)


@pytest.mark.parametrize("spec", ["topk,k=0.01,ef=vanilla", "threshold,threshold=0.002,ef=vanilla",
                                  "dgc,k=0.01", "minmax8,ef=vanilla", "onebit,ef=vanilla"])
def test_the_step_reads_for_non_finite_values_only_what_no_aggregation_checked(spec, monkeypatch):
    """On the CPU each aggregation of gathered payloads reports whether the sum it wrote is
    finite, and the optimizer's pass after the reduction reads only the other gradients: those
    sent uncompressed or by another strategy (DGC's biases, minmax8's one-element bias). A NaN
    that only the aggregations see still skips the step (the pass is not even called then)."""
    read = []
    real = optimizer_module._C.all_finite

    def counting(tensors):
        read.append(sum(t.numel() for t in tensors))
        return real(tensors)

    monkeypatch.setattr(optimizer_module._C, "all_finite", counting)
    model, opt, skipped = skip_probe(spec, bad_step=3)
    assert skipped == [3]
    tensors = opt.compression_report()["tensors"].values()
    others = sum(t["raw_bytes"] // 4 for t in tensors if t["collective"] != "allgather")
    assert others < sum(t["raw_bytes"] // 4 for t in tensors)
    assert read == [others] * 7  # every step but the poisoned one


# ---- a skipped step leaves no trace in the compression state --------------------------------
# Every codec that keeps state (residuals, momentum, DGC's velocity, PowerSGD's Q and error,
# step counters that seed draws), and collective=allreduce where the compressed allreduce's
# owners keep residuals of their own.
STATEFUL = ["onebit,ef=vanilla", "signsgd,ef=vanilla", "efsignsgd", "topk,k=0.01,ef=vanilla",
            "randomk,k=0.01,ef=vanilla", "fp16,ef=vanilla", "minmax8,ef=vanilla",
            "dithering,ef=vanilla", "dgc,k=0.01", "powersgd,rank=2,start_iter=2",
            "threshold,threshold=0.002,ef=vanilla", "onebit,ef=vanilla,momentum=nesterov,mu=0.9",
            "signsgd,momentum=nesterov,mu=0.5", "onebit,ef=vanilla,collective=allreduce",
            "topk,k=0.05,ef=vanilla,collective=allreduce",
            "minmax8,ef=vanilla,collective=allreduce", "fp16,ef=vanilla,collective=allreduce",
            "dgc,k=0.05,collective=allreduce",
            "threshold,threshold=0.002,ef=vanilla,collective=allreduce"]
POISONED = 5  # the element of rank 1's first-layer weight gradient that becomes non-finite


def skip_probe(spec, bad_step=None, value=float("nan"), left_out=None, user_skip=None,
               clear=True, steps=8):
    """The recovery loop of GradScaler / LossScaleOptimizer on the small MLP: synchronize, skip
    the step when a reduced gradient is not finite. bad_step: rank 1's gradient gets `value` in
    one element (inside backward, before the optimizer's hook sees it). left_out: that batch is
    never run. user_skip: that step is skipped though finite. clear: opt.zero_grad() before each
    backward, else the gradients are set to None by hand. Returns (model, optimizer, skipped)."""
    model = make_model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvdc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                    named_parameters=model.named_parameters(), compression=spec,
                                    min_compress_bytes=0)
    xs, ys = regression_data(RANK, steps)
    skipped = []

    def poison(g):
        g = g.clone()
        g.view(-1)[POISONED] = value
        return g

    for i in range(steps):
        if i == left_out:
            continue
        if clear:
            opt.zero_grad()
        else:
            for q in model.parameters():
                q.grad = None
        hook = model[0].weight.register_hook(poison) if i == bad_step and RANK == 1 else None
        torch.nn.functional.mse_loss(model(xs[i]), ys[i]).backward()
        if hook is not None:
            hook.remove()
        opt.synchronize()
        finite = all(bool(torch.isfinite(q.grad).all()) for q in model.parameters())
        if finite and i != user_skip:
            with opt.skip_synchronize():
                opt.step()
        else:
            skipped.append(i)
    return model, opt, skipped


def assert_same_state(got, want):
    assert got["steps"] == want["steps"]
    assert got["slots"].keys() == want["slots"].keys()
    for name, kinds in want["slots"].items():
        assert got["slots"][name].keys() == kinds.keys(), name
        for kind, arr in kinds.items():
            assert same_bits(got["slots"][name][kind], arr), (name, kind)


def assert_as_if_never_run(model, opt, spec, left_out):
    """Weights finite and equal on both ranks, and weights and compression state equal bit for
    bit to a run in which that step's batch never ran."""
    assert all(bool(torch.isfinite(q).all()) for q in model.parameters())
    assert same_on_all_ranks(model)
    model_b, opt_b, skipped_b = skip_probe(spec, left_out=left_out)
    assert skipped_b == []
    for a, b in zip(model.parameters(), model_b.parameters()):
        assert torch.equal(a, b)
    assert_same_state(opt.compression_state_dict(), opt_b.compression_state_dict())


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("spec", STATEFUL)
def test_non_finite_step_is_skipped_once_and_leaves_no_trace(spec, value):
    model, opt, skipped = skip_probe(spec, bad_step=3, value=value)
    assert skipped == [3]
    state = opt.compression_state_dict()
    if "collective=allreduce" in spec:  # the owner residuals are part of what is compared
        assert any(k.startswith("owner_ef[") or k.startswith("dgc_")
                   for kinds in state["slots"].values() for k in kinds)
    assert_as_if_never_run(model, opt, spec, left_out=3)


@pytest.mark.parametrize("spec", ["topk,k=0.01,ef=vanilla", "powersgd,rank=2,start_iter=0",
                                  "dgc,k=0.01", "randomk,k=0.01,ef=vanilla"])
def test_non_finite_first_step_leaves_no_slot_behind(spec):
    """The state a first step creates is removed with it: PowerSGD draws its first Q again."""
    model, opt, skipped = skip_probe(spec, bad_step=0)
    assert skipped == [0]
    assert_as_if_never_run(model, opt, spec, left_out=0)


@pytest.mark.parametrize("clear", [True, False], ids=["zero_grad", "grad_none"])
@pytest.mark.parametrize("spec", ["topk,k=0.01,ef=vanilla", "onebit,ef=vanilla,momentum=nesterov",
                                  "powersgd,rank=2,start_iter=2", "dgc,k=0.05,collective=allreduce"])
def test_step_the_user_skips_leaves_no_trace(spec, clear):
    """Synchronized, finite, but never stepped: undone at zero_grad() or, without it, when the
    next step's first gradient is reduced."""
    model, opt, skipped = skip_probe(spec, user_skip=3, clear=clear)
    assert skipped == [3]
    assert_as_if_never_run(model, opt, spec, left_out=3)


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("spec", ["randomk,k=0.01", "randomk,k=0.01,ef=vanilla", "topk,k=0.001",
                                  "dgc,k=0.001", "threshold,threshold=100",
                                  "topk,k=0.001,collective=allreduce",
                                  "dgc,k=0.001,collective=allreduce",
                                  "threshold,threshold=100,collective=allreduce"])
def test_sparse_codecs_show_a_non_finite_element_on_every_rank(spec, value):
    """An element that sampling or selection leaves out would otherwise go unseen this step
    and wait in the residual or DGC's velocity."""
    from helpers import row_optimizer
    n = 6000
    p, opt = row_optimizer(spec, n)
    g = grads_for_step(n, "float32", 0, WORLD)[RANK] * np.float32(1e-3)
    if RANK == 1:
        g[4321] = value
    out = reduce_step(p, opt, n2t(g, "float32").view(1, n)).reshape(-1)
    assert not bool(torch.isfinite(out).all())
    flags = hvd.allgather(torch.tensor([[int(bool(torch.isfinite(out).all()))]]), name="vis")
    assert flags.sum().item() == 0


@pytest.mark.parametrize("spec", ["none", "onebit,ef=vanilla", "topk,k=0.01,ef=vanilla",
                                  "powersgd,rank=1", "onebit,ef=vanilla,collective=allreduce"])
def test_a_rank_outside_the_process_set_steps_on_its_own_gradient(spec):
    """As Horovod's optimizer: rank 1, outside the set, applies its local gradient; rank 0,
    alone in it, gets its own gradient back from Horovod (spec none: bit for bit)."""
    def train(make):
        torch.manual_seed(3)
        model = torch.nn.Linear(300, 100)
        opt = make(torch.optim.SGD(model.parameters(), lr=0.1), model)
        x = torch.randn(8, 300, generator=torch.Generator().manual_seed(RANK))
        for _ in range(3):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    want = train(lambda o, m: hvd.DistributedOptimizer(o, named_parameters=m.named_parameters(),
                                                       process_set=FIRST))
    got = train(lambda o, m: hvdc.DistributedOptimizer(o, named_parameters=m.named_parameters(),
                                                       process_set=FIRST, compression=spec,
                                                       min_compress_bytes=0))
    if RANK == 1 or spec == "none":
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("kind", ["transposed", "channels_last"])
@pytest.mark.parametrize("spec", ["none", "powersgd,rank=1", "onebit,ef=vanilla",
                                  "topk,k=0.1,ef=vanilla"])
def test_non_contiguous_gradients_reduce_like_a_contiguous_twin(spec, kind):
    """Horovod's own optimizer refuses these ("Tensor is required to be contiguous")."""
    def reduced(layout):
        shape = (6, 4, 5, 5) if kind == "channels_last" else (40, 30)
        p = torch.nn.Parameter(torch.zeros(shape))
        opt = hvdc.DistributedOptimizer(torch.optim.SGD([p], lr=0.0), named_parameters=[("w", p)],
                                        compression=spec, min_compress_bytes=0)
        out = []
        for step in range(3):
            g = torch.randn(shape, generator=torch.Generator().manual_seed(10 * step + RANK))
            opt.zero_grad()
            p.grad = layout(g)
            opt.synchronize()
            out.append(p.grad.contiguous().clone())
            with opt.skip_synchronize():
                opt.step()
        return out

    odd = ((lambda g: g.contiguous(memory_format=torch.channels_last)) if kind == "channels_last"
           else (lambda g: g.t().contiguous().t()))
    for got, want in zip(reduced(odd), reduced(lambda g: g)):
        assert torch.equal(got, want)


# ---- every codec takes every gradient a model can produce -----------------------------------
def _matrix_spec(codec, stateless, collective=None):
    """The codec at settings that compress this test's small tensors (PowerSGD from step 0),
    with error feedback wherever the codec takes it, so that state is compared too. stateless:
    no state that carries one step's rounding into the next (see test_every_codec_...)."""
    spec = {"powersgd": "powersgd,rank=1,start_iter=0", "dgc": "dgc,k=0.05",
            "threshold": "threshold,threshold=0.5"}.get(codec, codec)
    if collective:
        spec += f",collective={collective}"
    info = hc.get_codec(codec)
    if stateless:
        return spec + (",error_feedback=false" if codec == "powersgd" else "")
    return spec if info.builtin_ef or info.rounds == 2 else spec + ",ef=vanilla"


# kind: (parameter shape, dtype, how the parameter is laid out)
KINDS = {
    "zero_size": ((0, 5), torch.float32, None),
    "one_element": ((1, 1), torch.float32, None),
    "transposed": ((30, 20), torch.float32, "transposed"),
    "channels_last": ((6, 4, 5, 5), torch.float32, "channels_last"),
    "float16": ((6, 100), torch.float16, None),
    "bfloat16": ((6, 100), torch.bfloat16, None),
    "float64": ((6, 100), torch.float64, None),
    "no_grad_on_rank_1": ((6, 100), torch.float32, None),
    "no_grad_anywhere": ((6, 100), torch.float32, None),
}
LOW_PRECISION = ("float16", "bfloat16", "float64")
ABSENT_STEP = 1  # the step of the two no_grad kinds without the gradient


def _kind_param(shape, dtype, layout):
    if layout == "transposed":  # a parameter stored transposed: its gradient is too
        return torch.nn.Parameter(torch.zeros(shape[::-1], dtype=dtype).t())
    t = torch.zeros(shape, dtype=dtype)
    if layout == "channels_last":
        t = t.contiguous(memory_format=torch.channels_last)
    return torch.nn.Parameter(t)


def _kind_grad(shape, dtype, step, rank):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(100 * step + rank))
    return g.to(dtype)


def _run_kind(spec, shape, dtype, layout, steps, lacking=()):
    """Steps of SGD on one parameter "w" of that layout and dtype; `lacking`: (step, rank)
    pairs in which that rank computes no gradient (a twin gets zeros there). Returns the
    reduced gradient after each synchronize() (None where there is none), the weights and
    the compression state at the end."""
    p = _kind_param(shape, dtype, layout)
    opt = hvdc.DistributedOptimizer(torch.optim.SGD([p], lr=0.5), named_parameters=[("w", p)],
                                    compression=spec, min_compress_bytes=0)
    out = []
    for step in steps:
        opt.zero_grad()
        g = _kind_grad(shape, dtype, step, RANK)
        if (step, RANK) not in lacking:
            (p * g).sum().backward()
        opt.synchronize()
        out.append(None if p.grad is None else p.grad.detach().contiguous().clone())
        with opt.skip_synchronize():
            opt.step()
    return out, p.detach().contiguous().clone(), opt.compression_state_dict()


def _kind_twin(spec, kind, steps):
    """The same run on a contiguous float32 parameter, fed the kind's gradients as float32
    (so a low-precision kind and its twin start from identical values)."""
    shape, dtype, _ = KINDS[kind]
    if kind == "no_grad_on_rank_1":  # Horovod's choice: a rank without a gradient sends zeros
        def grad(step, rank):
            g = _kind_grad(shape, dtype, step, rank)
            return torch.zeros_like(g) if (step, rank) == (ABSENT_STEP, 1) else g
    else:
        def grad(step, rank):
            return _kind_grad(shape, dtype, step, rank)
    p = torch.nn.Parameter(torch.zeros(shape))
    opt = hvdc.DistributedOptimizer(torch.optim.SGD([p], lr=0.5), named_parameters=[("w", p)],
                                    compression=spec, min_compress_bytes=0)
    out = []
    for step in steps:
        opt.zero_grad()
        (p * grad(step, RANK).float()).sum().backward()
        opt.synchronize()
        out.append(p.grad.detach().clone())
        with opt.skip_synchronize():
            opt.step()
    return out, p.detach().clone(), opt.compression_state_dict()


# A layout is undone before any strategy sees the gradient: the other strategies are run on
# the kinds that reach them.
MATRIX = [(codec, collective, kind) for codec, collective in codec_strategies()
          for kind in KINDS if not (collective and kind in ("transposed", "channels_last"))]


@pytest.mark.parametrize("codec,collective,kind", MATRIX)
def test_every_codec_takes_every_gradient_kind(codec, collective, kind, monkeypatch):
    """Each gradient kind against a contiguous float32 twin through the same codec.

    Layouts, sizes and missing gradients change nothing in the arithmetic: the reduced
    gradients, weights and compression state equal the twin's bit for bit. A rank without a
    gradient takes part with zeros, as in Horovod's optimizer, its state moving as for a zero
    gradient; where no rank has one, the step does not exist for that parameter: no gradient,
    no update, no state touched (the twin simply skips that step).

    float16, bfloat16 and float64 gradients are fed values their dtype holds exactly, and the
    kernels compute in float32 (float64 for float64) as they do for the twin, so a float16 or
    bfloat16 result is the twin's rounded once to its dtype, bit for bit. Here the codecs run
    without error feedback (its residual would be kept in the gradient's dtype, a different
    computation from the second step on); efsignsgd and dgc, whose state is built in, are
    compared on their first step only. float64 adds no rounding of its own but computes in
    double where the twin rounds each operation to float32: within 4 float32 ulps of the
    largest value (deterministic codecs, and the stochastic ones with these seeds). Under the
    compressed allreduce a 16-bit gradient's chunk sums are rounded to its dtype before the
    owners encode them again; the twin rounds them alike (owner_sums_rounded_to)."""
    shape, dtype, layout = KINDS[kind]
    low = kind in LOW_PRECISION
    spec = _matrix_spec(codec, stateless=low, collective=collective)
    steps = [0, 1, 2] if kind.startswith("no_grad") else [0, 1]
    if low and hc.get_codec(codec).builtin_ef and codec != "powersgd":
        steps = [0]
    lacking = {"no_grad_on_rank_1": {(ABSENT_STEP, 1)},
               "no_grad_anywhere": {(ABSENT_STEP, 0), (ABSENT_STEP, 1)}}.get(kind, set())
    got, weights, state = _run_kind(spec, shape, dtype, layout, steps, lacking)
    twin_steps = [s for s in steps if not (kind == "no_grad_anywhere" and s == ABSENT_STEP)]
    if collective == "allreduce" and dtype in (torch.float16, torch.bfloat16):
        from hvd_compress.torch.codec import TorchCodec
        owner_sums_rounded_to(dtype, monkeypatch,
                              (TorchCodec, lambda t, d: t.to(d).to(torch.float32)))
    want, twin_weights, twin_state = _kind_twin(spec, kind, twin_steps)
    if kind == "no_grad_anywhere":
        assert got[ABSENT_STEP] is None  # no gradient: the optimizer leaves the weights alone
        got = got[:ABSENT_STEP] + got[ABSENT_STEP + 1:]
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == dtype and g.shape == w.shape, (step, g.dtype, g.shape)
        if kind == "float64":
            tol = 4 * float(np.finfo(np.float32).eps) * max(1.0, float(w.abs().max()))
            torch.testing.assert_close(g.float(), w, rtol=0, atol=tol, msg=f"step {step}")
        elif low:
            assert torch.equal(g, w.to(dtype)), f"step {step}"
        else:
            assert same_bits(t2n(g), t2n(w)), f"step {step}"
    if not low:
        assert torch.equal(weights, twin_weights)
        assert_same_state(state, twin_state)
    assert same_on_all_ranks_t(weights)


def same_on_all_ranks_t(t):
    gathered = hvd.allgather(t.reshape(1, -1).float(), name="kind_param_check")
    return torch.equal(gathered[0], gathered[1])


@pytest.mark.parametrize("codec", [c.name for c in hc.codecs()])
def test_every_codec_on_a_rank_outside_the_process_set(codec):
    """Rank 1, outside the set, steps on its own gradient as with Horovod's optimizer."""
    p = torch.nn.Parameter(torch.zeros(6, 100))
    opt = hvdc.DistributedOptimizer(torch.optim.SGD([p], lr=0.5), named_parameters=[("w", p)],
                                    compression=_matrix_spec(codec, False), process_set=FIRST,
                                    min_compress_bytes=0)
    for step in range(2):
        opt.zero_grad()
        g = _kind_grad((6, 100), torch.float32, step, RANK)
        (p * g).sum().backward()
        opt.synchronize()
        assert bool(torch.isfinite(p.grad).all())
        if RANK == 1:
            assert torch.equal(p.grad, g)
        with opt.skip_synchronize():
            opt.step()

@pytest.mark.parametrize("spec", join_specs())
def test_join_with_uneven_batches(spec):
    """Rank 1 runs out of data after one step and joins; rank 0 takes two more steps alone.
    Those steps reduce as Horovod's own optimizer does under join (rank 1 adds zeros, the
    average divides by the set's size), and no rank's compression state moves, so that once
    both have joined they step together again and agree."""
    lr, shape = 0.1, (20, 30)
    w = torch.nn.Parameter(torch.zeros(shape))
    opt = hvdc.DistributedOptimizer(torch.optim.SGD([w], lr=lr), named_parameters=[("w", w)],
                                    compression=spec, min_compress_bytes=0)

    def batch(step):
        return torch.randn(shape, generator=torch.Generator().manual_seed(100 * step + RANK))

    def step(i):
        opt.zero_grad()
        (w * batch(i)).sum().backward()
        opt.step()

    step(0)
    before = opt.compression_state_dict()
    alone = w.detach().clone()
    if RANK == 0:
        for i in (1, 2):
            step(i)
            alone.add_(batch(i) * 0.5, alpha=-lr)
        assert torch.equal(w.detach(), alone)
    assert hvd.join() == 0
    assert_same_state(opt.compression_state_dict(), before)
    # Rank 1 missed rank 0's updates, as under Horovod's own optimizer: the weights are
    # broadcast, and the ranks' states (step counters, PowerSGD's Q) must still agree.
    hvd.broadcast_parameters({"w": w}, root_rank=0)
    step(3)
    rows = hvd.allgather(w.detach().view(1, -1), name="join.weights")
    assert torch.equal(rows[0], rows[1])
