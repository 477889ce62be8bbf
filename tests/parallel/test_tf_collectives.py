"""The collective strategies at any rank count in the TensorFlow frontend, the twin of
test_torch_collectives.py: `make test` runs this module at 2, 3, 4 and 8 ranks, at 8 each test
once, in one job per count with test_tf_buckets.py and none of the torch modules (Horovod's torch
and TF libraries are not initialised side by side).

The expected result is the same numpy simulation the torch tests compare with, so TF and
PyTorch deliver the same bits, chunks and residuals for the same inputs. The reductions run
eagerly and inside tf.function, where the plan becomes one graph with Horovod's ops in it.
"""
from __future__ import annotations

import horovod.tensorflow as hvd
import numpy as np
import pytest
import tensorflow as tf

from helpers import ranks_marker, same_bits
from simulation import Simulation, grads_for_step
from hvd_compress import collectives as col
import hvd_compress as hc
from hvd_compress.tensorflow.codec import TFCodec
from hvd_compress.tensorflow.reducer import Reducer, to_config

hvd.init()
WORLD, RANK = hvd.size(), hvd.rank()
pytestmark = ranks_marker(WORLD)
TF_DTYPES = {"float32": tf.float32, "float16": tf.float16, "float64": tf.float64}

# Every codec the TF frontend runs whose payloads can be decoded, summed and encoded again.
COMPRESSED = ["fp16", "bf16", "onebit", "signsgd", "efsignsgd", "topk,k=0.05", "minmax8,chunk=64",
              "dithering", "qsgd", "terngrad", "natural", "threshold,threshold=1.0", "dgc,k=0.05"]
# Lengths: one element, fewer elements than ranks, not divisible by the rank count (nor by the
# 64-element chunk alignment), and enough for every rank to own a chunk.
SIZES = [1, max(1, WORLD - 1), 64 * WORLD + 37]
LARGE = SIZES[-1]
# Large enough that the compressed allreduce beats the homomorphic one for every quantiser.
RESIDUAL_N = 512 * WORLD + 37


class Case:
    """One variable's gradient reduced by a reducer of its own (fresh state), beside the
    simulation of the same spec under the same name (the name seeds derive from)."""

    def __init__(self, spec, n, dtype="float32", name="w"):
        self.spec, self.n, self.dtype, self.name = spec, n, dtype, name
        self.reducer = Reducer(to_config(spec), 0, hvd.Average, hvd.global_process_set)
        # a row, as the torch tests' parameter: DGC compresses tensors of two dimensions or more
        self.var = tf.Variable(tf.zeros([1, n], TF_DTYPES[dtype]), name=name)
        self.sim = Simulation(spec, n, dtype, WORLD, name=name)

    def reduce(self, g):
        row = self.reducer.reduce([tf.reshape(g, self.var.shape)], [self.var])[0]
        return tf.reshape(row, [-1])

    @property
    def stats(self):
        return self.reducer.stats.tensors[self.name]


def check_against_simulation(cases, steps=3, graph=False):
    """Every case reduced once per step, all in one tf.function when `graph` (one trace, and the
    cases' collectives in flight together as a model's would be), each compared bit for bit
    with its simulation."""
    def step_fn(gs):
        return [c.reduce(g) for c, g in zip(cases, gs)]
    fn = tf.function(step_fn) if graph else step_fn
    for step in range(steps):
        grads = [grads_for_step(c.n, c.dtype, step, WORLD) for c in cases]
        got = fn([tf.constant(g[RANK]) for g in grads])
        for c, g, out in zip(cases, grads, got):
            assert same_bits(np.asarray(out.numpy()), c.sim(g)), f"{c.spec} n={c.n} step {step}"


def check_one(spec, n, dtype="float32", steps=3):
    case = Case(spec, n, dtype)
    check_against_simulation([case], steps)
    return case


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("codec", COMPRESSED)
def test_compressed_allreduce_equals_simulation(codec, n):
    case = check_one(codec + ",collective=allreduce", n)
    # allreduce admits both of ours for the quantisers; on tensors this small the chunk headers
    # can make the homomorphic one cheaper
    assert case.sim.strategy in ({col.COMPRESSED_ALLREDUCE, col.HOMOMORPHIC}
                                 & set(hc.get_codec(case.sim.cfg.codec).strategies))
    assert case.stats.collective == case.sim.strategy


# Quantisers with evenly spaced levels, summed as integer codes by Horovod's allreduce.
HOMOMORPHIC = ["minmax8,chunk=64", "dithering,s=4", "qsgd", "terngrad", "minmax8,ef=vanilla",
               "dithering,ef=vanilla,momentum=nesterov,seed=3"]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("codec", HOMOMORPHIC)
def test_homomorphic_allreduce_equals_simulation(codec, n):
    case = check_one(codec + ",collective=homomorphic", n)
    assert case.sim.strategy == col.HOMOMORPHIC == case.stats.collective


def test_homomorphic_allreduce_in_a_graph_equals_simulation():
    cases = [Case(codec + ",collective=homomorphic", LARGE, name=f"h{i}")
             for i, codec in enumerate(HOMOMORPHIC)]
    check_against_simulation(cases, graph=True)


def test_compressed_allreduce_in_a_graph_equals_simulation():
    # Each codec at one of the sizes in turn: every codec and every size, in one short trace.
    cases = [Case(codec + ",collective=allreduce", SIZES[i % len(SIZES)], name=f"w{i}")
             for i, codec in enumerate(COMPRESSED)]
    check_against_simulation(cases, graph=True)
    assert all(c.stats.collective == c.sim.strategy for c in cases)


RESIDUAL_SPECS = ["onebit,ef=vanilla", "topk,k=0.05,ef=vanilla,momentum=nesterov", "efsignsgd",
                  "minmax8,ef=vanilla,momentum=nesterov", "dithering,s=4,ef=vanilla",
                  "dgc,k=0.05,warmup_steps=2", "threshold,threshold=0.5,ef=vanilla",
                  "bf16,ef=vanilla"]


def check_residuals(case):
    """Both residuals (each rank's for every chunk, each owner's for its own chunk) as the
    simulation has them, under the names the torch frontend checkpoints them by."""
    state = case.reducer.state_dict()["slots"][case.name]
    owner = [k for k in state if k.startswith("owner_ef")]
    bounds = col.chunk_bounds(case.n, WORLD)
    assert owner == [f"owner_ef[{bounds[RANK]}:{bounds[RANK + 1]}]"], case.spec
    assert np.array_equal(state[owner[0]], case.sim.owner_e[RANK]), case.spec
    worker = state["ef" if "ef" in state else "dgc_accumulator"]
    assert same_bits(worker.reshape(-1), case.sim.e[RANK]), case.spec
    if "dgc_velocity" in state:
        assert same_bits(state["dgc_velocity"].reshape(-1), case.sim.u[RANK]), case.spec
    if "momentum" in state:  # top-k's masked where each chunk's worker residual is zero
        assert same_bits(state["momentum"].reshape(-1), case.sim.m[RANK]), case.spec


@pytest.mark.parametrize("spec", RESIDUAL_SPECS)
def test_worker_and_owner_residuals_over_steps_equal_simulation(spec):
    check_residuals(check_one(spec + ",collective=allreduce", RESIDUAL_N, steps=4))


def test_worker_and_owner_residuals_in_a_graph_equal_simulation():
    # The three ways state is kept: a sign codec's lazy carry, a plain residual, and momentum
    # beside the residual (each trace costs seconds at 8 ranks on 2 cores).
    specs = ["onebit,ef=vanilla", "topk,k=0.05,ef=vanilla", "minmax8,ef=vanilla,momentum=nesterov"]
    cases = [Case(spec + ",collective=allreduce", RESIDUAL_N, name=f"w{i}")
             for i, spec in enumerate(specs)]
    check_against_simulation(cases, steps=4, graph=True)
    for case in cases:
        check_residuals(case)


def test_float64_and_float16_gradients():
    for spec, dtype in [("onebit,ef=vanilla", "float64"), ("topk,k=0.1,ef=vanilla", "float64"),
                        ("minmax8", "float16"), ("bf16", "float16")]:
        check_one(spec + ",collective=allreduce", 64 * WORLD + 5, dtype, steps=2)


@pytest.mark.parametrize("codec", ["onebit", "topk,k=0.05", "minmax8", "bf16"])
def test_auto_picks_by_bytes(codec):
    """auto: allgather at two ranks (a tie goes to one compression), the compressed allreduce
    from three ranks on for a tensor large enough that headers do not decide; forced
    allgather still gathers."""
    n = 4096 * WORLD
    auto = check_one(codec, n, steps=1)
    assert auto.stats.collective == (col.ALLGATHER if WORLD == 2 else col.COMPRESSED_ALLREDUCE)
    forced = check_one(codec + ",collective=allgather", n, steps=1)
    assert forced.stats.collective == col.ALLGATHER
    if WORLD > 2:
        assert auto.stats.wire_bytes < forced.stats.wire_bytes


def test_linear_codecs_keep_horovods_allreduce():
    """Except fp16 between two ranks over Gloo (as in test_torch_collectives)."""
    pair = hvd.gloo_enabled() and WORLD == 2
    for spec in ["fp16", "randomk,k=0.1"]:
        case = Case(spec, 1000)
        case.reduce(tf.ones([1000]))
        want = col.ALLGATHER if pair and spec == "fp16" else col.ALLREDUCE
        assert case.stats.collective == want


@pytest.mark.parametrize("graph", [False, True])
def test_cast_codecs_reduce_from_the_sum_of_both_payloads(graph, monkeypatch):
    """As in test_torch_collectives: between two ranks over Gloo, fp16 and bf16 are reduced
    straight from the words' sum (pair_rows is not called), the simulation's bits for every
    dtype and for lengths with a half-filled last word or not, eagerly and in one graph."""
    if hvd.gloo_enabled() and WORLD == 2:
        def refuse(*args, **kwargs):
            raise AssertionError("the pair's payloads were gathered, not reduced from the sum")
        monkeypatch.setattr(TFCodec, "pair_rows", staticmethod(refuse))
    cases = [Case(spec, n, dtype, name=f"c{i}") for i, (spec, n, dtype) in enumerate(
        (spec, n, dtype) for spec in ("fp16,collective=allgather", "bf16,collective=allgather")
        for n in (1, LARGE, LARGE + 1) for dtype in TF_DTYPES)]
    check_against_simulation(cases, steps=2, graph=graph)
    assert all(c.stats.collective == col.ALLGATHER for c in cases)


@pytest.mark.parametrize("nbytes", [1, 3, 4, 1001])
def test_gathered_rows_equal_horovods_allgather(nbytes):
    """collectives.gather_rows with the TF ops, eager and traced: what Horovod's allgather of
    the same payloads returns, bit for bit (by a sum between two ranks over Gloo)."""
    payload = tf.constant(np.random.default_rng(RANK + 7 * nbytes).integers(0, 256, nbytes),
                          tf.uint8)
    job = col.Job(name="rows", n=nbytes, itemsize=1, config=hc.parse_spec("bf16"), rank=RANK,
                  world=WORLD, average=True, opname=f"tfrows.{nbytes}", gloo=hvd.gloo_enabled())
    asked = []

    def perform(request):
        asked.append(type(request))
        if isinstance(request, col.Allreduce):
            return hvd.allreduce(request.tensor, op=hvd.Sum, name=request.name)
        return hvd.allgather(tf.reshape(request.tensor, [1, -1]), name=request.name)

    def gathered(p):
        return col.run_now(col.gather_rows(job, TFCodec, p, job.opname), perform)
    want = tf.reshape(hvd.allgather(tf.reshape(payload, [1, -1]), name=f"tfrows_check.{nbytes}"),
                      [-1])
    assert np.array_equal(tf.reshape(gathered(payload), [-1]).numpy(), want.numpy())
    assert np.array_equal(tf.reshape(tf.function(gathered)(payload), [-1]).numpy(), want.numpy())
    pair = hvd.gloo_enabled() and WORLD == 2
    assert asked == [col.Allreduce if pair else col.Allgather] * 2


@pytest.mark.parametrize("base", [1, 4, 1001])
def test_sized_gathers_equal_horovods_allgather(base):
    """collectives.gather_sized with the TF ops, eager and traced with the size unknown to the
    graph: payloads of a size that differs by rank, as Horovod's allgather returns them."""
    nbytes = base + 3 * RANK
    payload = tf.constant(np.random.default_rng(RANK + 7 * base).integers(0, 256, nbytes),
                          tf.uint8)
    job = col.Job(name="sized", n=nbytes, itemsize=1, config=hc.parse_spec("threshold"),
                  rank=RANK, world=WORLD, average=True, opname=f"tfsized.{base}",
                  gloo=hvd.gloo_enabled())
    asked = []

    def perform(request):
        asked.append(type(request))
        if isinstance(request, col.Allreduce):
            return hvd.allreduce(request.tensor, op=hvd.Sum, name=request.name)
        return hvd.allgather(request.tensor, name=request.name)

    def gathered(p):
        return col.run_now(col.gather_sized(job, TFCodec, p, job.opname), perform)
    want = hvd.allgather(payload, name=f"tfsized_check.{base}").numpy()
    assert np.array_equal(gathered(payload).numpy(), want)
    traced = tf.function(gathered, input_signature=[tf.TensorSpec([None], tf.uint8)])
    assert np.array_equal(traced(payload).numpy(), want)
    pair = hvd.gloo_enabled() and WORLD == 2
    assert asked == ([col.Allreduce, col.Allreduce] if pair else [col.Allgather]) * 2


def test_all_ranks_hold_identical_results():
    case = Case("onebit,ef=vanilla,collective=allreduce", 1000)
    got = case.reduce(tf.random.stateless_normal([1000], seed=[RANK, 0]))
    every = hvd.allgather(tf.expand_dims(got, 0), name="identical_check").numpy()
    assert all(np.array_equal(every[0], every[r]) for r in range(WORLD))


@pytest.mark.parametrize("spec", ["onebit,ef=vanilla,collective=allreduce",
                                  "topk,k=0.05,ef=vanilla,collective=allreduce",
                                  "minmax8,ef=vanilla,collective=homomorphic",
                                  "dgc,k=0.05,warmup_steps=3", "dgc,k=0.05,collective=allreduce",
                                  "threshold,threshold=0.5,ef=vanilla,collective=allreduce"])
def test_checkpointed_state_continues_bit_exactly(spec):
    """The TF twin: state_dict() into a fresh reducer, which carries on as the uninterrupted
    simulation (and so as the torch frontend, which matches the same simulation)."""
    case = Case(spec, RESIDUAL_N)
    for step in range(4):
        if step == 2:
            saved = case.reducer.state_dict()
            case.reducer = Reducer(to_config(spec), 0, hvd.Average, hvd.global_process_set)
            case.reducer.load_state_dict(saved)
        grads = grads_for_step(case.n, "float32", step, WORLD)
        got = case.reduce(tf.constant(grads[RANK]))
        assert same_bits(np.asarray(got.numpy()), case.sim(grads)), f"step {step}"
