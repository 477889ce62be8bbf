"""The collective strategies at any rank count: `make test` runs this module at 2, 3, 4 and 8
ranks, in one job per count with test_torch_buckets.py (`horovodrun --gloo` at 2 and 3, `mpirun`
at 4 and 8: Makefile).

Each rank computes every rank's gradient from seeds, so the expected result is a numpy
simulation of the whole scheme (tests/simulation.py), compared bit for bit with what the real
collectives delivered: the compressed allreduce's chunks, both residuals over several steps,
and tensors smaller than the rank count or not divisible by it.
"""
from __future__ import annotations

import time

import horovod.torch as hvd
import numpy as np
import pytest
import torch

from helpers import TORCH_DTYPES, n2t, ranks_marker, reduce_step, row_optimizer, same_bits, t2n
from simulation import GLOO, Simulation, grads_for_step
from hvd_compress import collectives as col
from hvd_compress.torch.codec import TorchCodec
from hvd_compress.torch.optimizer import PendingPlan
import hvd_compress as hc
import hvd_compress.torch as hvdc

hvd.init()
WORLD, RANK = hvd.size(), hvd.rank()
pytestmark = ranks_marker(WORLD)

# Every codec whose payloads can be decoded, summed and encoded again.
COMPRESSED = ["fp16", "bf16", "onebit", "signsgd", "efsignsgd", "topk,k=0.05", "minmax8,chunk=64",
              "dithering", "qsgd", "terngrad", "natural", "threshold,threshold=1.0", "dgc,k=0.05"]
# Lengths: one element, fewer elements than ranks, not divisible by the rank count (nor by the
# 64-element chunk alignment), and enough for every rank to own a chunk.
SIZES = [1, max(1, WORLD - 1), 64 * WORLD + 37]


def check_against_simulation(spec, n, dtype="float32", steps=3):
    p, opt = row_optimizer(spec, n, TORCH_DTYPES[dtype])
    sim = Simulation(spec, n, dtype, WORLD)
    for step in range(steps):
        grads = grads_for_step(n, dtype, step, WORLD)
        got = reduce_step(p, opt, n2t(grads[RANK], dtype))
        want = sim(grads)
        assert same_bits(t2n(got), want), f"{spec} n={n} step {step}"
    return opt, sim


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("codec", COMPRESSED)
def test_compressed_allreduce_equals_simulation(codec, n):
    spec = codec + ",collective=allreduce"
    opt, sim = check_against_simulation(spec, n)
    # allreduce admits both of ours for the quantisers; on tensors this small the chunk headers
    # can make the homomorphic one cheaper (test_large_quantiser_tensors_... pins the choice)
    want = {col.COMPRESSED_ALLREDUCE, col.HOMOMORPHIC} & set(hc.get_codec(sim.cfg.codec).strategies)
    assert sim.strategy in want
    assert opt.compression_stats.tensors["w"].collective == sim.strategy


@pytest.mark.parametrize("codec", ["minmax8", "dithering", "qsgd", "terngrad"])
def test_large_quantiser_tensors_take_the_compressed_allreduce(codec):
    """Under allreduce the quantisers' codes are narrower than the homomorphic lanes (which
    widen by log2(ranks) bits), so beyond a few chunk headers the compressed allreduce wins."""
    opt, sim = check_against_simulation(codec + ",collective=allreduce", 4096 * WORLD, steps=1)
    assert sim.strategy == col.COMPRESSED_ALLREDUCE


# Quantisers with evenly spaced levels, summed as integer codes by Horovod's allreduce.
HOMOMORPHIC = ["minmax8,chunk=64", "dithering,s=4", "qsgd", "terngrad",
               "minmax8,ef=vanilla", "dithering,ef=vanilla,momentum=nesterov,seed=3"]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("codec", HOMOMORPHIC)
def test_homomorphic_allreduce_equals_simulation(codec, n):
    opt, sim = check_against_simulation(codec + ",collective=homomorphic", n)
    assert sim.strategy == col.HOMOMORPHIC
    assert opt.compression_stats.tensors["w"].collective == col.HOMOMORPHIC


def test_homomorphic_allreduce_is_unbiased():
    """The mean over many draws (fresh stochastic rounding each step) of the reduced gradient
    approaches the true mean: within 6 standard errors of a level gap for every value, where
    nearest rounding would be off by up to half a gap. Each value sits at 16 places of one
    block, so 13 steps give 208 draws of it: few collectives, which cost most at 8 ranks."""
    values, copies, steps = 256, 16, 13
    p, opt = row_optimizer("terngrad,collective=homomorphic", values * copies)
    g = torch.linspace(-1, 1, values).repeat(copies) * (RANK + 1)  # max |x|: WORLD, one block
    true = sum(torch.linspace(-1, 1, values) * (r + 1) for r in range(WORLD)) / WORLD
    total = torch.zeros(values, dtype=torch.float64)
    for _ in range(steps):
        total += reduce_step(p, opt, g.clone()).double().view(copies, values).sum(0)
    draws = steps * copies
    gap = float(WORLD)  # terngrad: codes 0..2 over [-M, M], M = WORLD
    assert torch.all((total / draws - true.double()).abs() <= 6 * gap / (2 * draws ** 0.5))


@pytest.mark.parametrize("spec", ["onebit,ef=vanilla", "topk,k=0.05,ef=vanilla,momentum=nesterov",
                                  "efsignsgd", "minmax8,ef=vanilla,momentum=nesterov",
                                  "dithering,s=4,ef=vanilla",
                                  "dgc,k=0.05,warmup_steps=2", "threshold,threshold=0.5,ef=vanilla",
                                  "bf16,ef=vanilla"])
def test_worker_and_owner_residuals_over_steps_equal_simulation(spec):
    """Both residuals (each rank's for every chunk, each owner's for its own chunk) carry
    through four steps exactly as in the simulation."""
    opt, sim = check_against_simulation(spec + ",collective=allreduce", 512 * WORLD + 37, steps=4)
    assert sim.strategy == col.COMPRESSED_ALLREDUCE
    state = opt.compression_state_dict()["slots"]["w"]
    owner = [k for k in state if k.startswith("owner_ef")]
    assert len(owner) == 1 and np.array_equal(state[owner[0]], sim.owner_e[RANK])
    worker = state["ef" if "ef" in state else "dgc_accumulator"]
    assert same_bits(worker.reshape(-1), sim.e[RANK])
    if "momentum" in state:  # top-k's masked where each chunk's worker residual is zero
        assert same_bits(state["momentum"].reshape(-1), sim.m[RANK])


def test_float64_and_float16_gradients():
    for spec, dtype in [("onebit,ef=vanilla", "float64"), ("topk,k=0.1,ef=vanilla", "float64"),
                        ("minmax8", "float16"), ("bf16", "float16")]:
        check_against_simulation(spec + ",collective=allreduce", 64 * WORLD + 5, dtype, steps=2)


@pytest.mark.parametrize("codec", ["onebit", "topk,k=0.05", "minmax8", "bf16"])
def test_auto_picks_by_bytes(codec):
    """auto: allgather at two ranks (a tie goes to one compression), the compressed allreduce
    from three ranks on for a tensor large enough that headers do not decide; forced
    allgather still gathers."""
    n = 4096 * WORLD
    _, opt = row_optimizer(codec, n)
    sim = Simulation(codec, n, "float32", WORLD)
    grads = grads_for_step(n, "float32", 0, WORLD)
    p = opt.param_groups[0]["params"][0]
    assert same_bits(t2n(reduce_step(p, opt, n2t(grads[RANK], "float32"))), sim(grads))
    want = col.ALLGATHER if WORLD == 2 else col.COMPRESSED_ALLREDUCE
    assert opt.compression_stats.tensors["w"].collective == want
    _, forced = row_optimizer(codec + ",collective=allgather", n)
    reduce_step(forced.param_groups[0]["params"][0], forced, n2t(grads[RANK], "float32"))
    assert forced.compression_stats.tensors["w"].collective == col.ALLGATHER
    if WORLD > 2:
        assert (opt.compression_stats.last_step_wire
                < forced.compression_stats.last_step_wire)


def test_linear_codecs_keep_horovods_allreduce():
    """Except fp16 between two ranks over Gloo: gathered as a sum, then summed by our kernels
    in float32 rather than by Gloo's slow half precision (collectives.family)."""
    pair = hvd.gloo_enabled() and WORLD == 2
    for spec in ["fp16", "randomk,k=0.1"]:
        _, opt = row_optimizer(spec, 1000)
        reduce_step(opt.param_groups[0]["params"][0], opt, torch.ones(1, 1000))
        want = col.ALLGATHER if pair and spec == "fp16" else col.ALLREDUCE
        assert opt.compression_stats.tensors["w"].collective == want


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
@pytest.mark.parametrize("spec", ["fp16,collective=allgather", "bf16,collective=allgather"])
def test_cast_codecs_reduce_from_the_sum_of_both_payloads(spec, dtype, monkeypatch):
    """fp16 and bf16 gathered between two ranks over Gloo are reduced straight from the sum of
    both payloads' words (aggregate_pair): the other rank's payload is never written out
    (pair_rows is not called). The result is the simulation's, bit for bit, for lengths that
    leave the last word half filled or not; elsewhere they are gathered as any payload."""
    if hvd.gloo_enabled() and WORLD == 2:
        def refuse(*args, **kwargs):
            raise AssertionError("the pair's payloads were gathered, not reduced from the sum")
        monkeypatch.setattr(TorchCodec, "pair_rows", refuse)
    for n in SIZES + [64 * WORLD + 38]:
        opt, sim = check_against_simulation(spec, n, dtype, steps=2)
        assert opt.compression_stats.tensors["w"].collective == col.ALLGATHER


def test_the_simulation_knows_the_transport():
    assert GLOO == hvd.gloo_enabled()


@pytest.mark.parametrize("nbytes", [1, 3, 4, 1001, 1 << 16])
def test_gathered_rows_equal_horovods_allgather(nbytes):
    """collectives.gather_rows: between two ranks over Gloo an allreduce of the payloads as
    int32 words (sums that wrap, on random bytes), elsewhere the allgather; either way what
    Horovod's allgather of the same payloads returns, bit for bit."""
    payload = torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(RANK + 7 * nbytes))
    job = col.Job(name="rows", n=nbytes, itemsize=1, config=hc.parse_spec("bf16"), rank=RANK,
                  world=WORLD, average=True, opname=f"rows.{nbytes}", gloo=hvd.gloo_enabled())
    asked = []
    codec = TorchCodec(job.config, None, RANK, WORLD)
    got = PendingPlan(_recorded(col.gather_rows(job, codec, payload.clone(), job.opname),
                                asked), {None: hvd.global_process_set})()
    want = hvd.allgather(payload.view(1, -1), name=f"rows_check.{nbytes}").view(-1)
    assert torch.equal(got.view(-1), want)
    pair = hvd.gloo_enabled() and WORLD == 2
    assert asked == [col.Allreduce if pair else col.Allgather]


def _recorded(gen, asked):
    request = next(gen)
    try:
        while True:
            asked.append(type(request))
            request = gen.send((yield request))
    except StopIteration as done:
        return done.value


@pytest.mark.parametrize("base", [1, 4, 1001])
def test_sized_gathers_equal_horovods_allgather(base):
    """collectives.gather_sized, for payloads whose size differs by rank (threshold's): every
    rank's payload back to back, as Horovod's allgather of them returns, bit for bit; between
    two ranks over Gloo by a sum of the sizes, then of the words."""
    nbytes = base + 3 * RANK
    payload = torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(RANK + 7 * base))
    job = col.Job(name="sized", n=nbytes, itemsize=1, config=hc.parse_spec("threshold"),
                  rank=RANK, world=WORLD, average=True, opname=f"sized.{base}",
                  gloo=hvd.gloo_enabled())
    asked = []
    codec = TorchCodec(job.config, None, RANK, WORLD)
    got = PendingPlan(_recorded(col.gather_sized(job, codec, payload.clone(), job.opname),
                                asked), {None: hvd.global_process_set})()
    want = hvd.allgather(payload, name=f"sized_check.{base}")
    assert torch.equal(got, want)
    pair = hvd.gloo_enabled() and WORLD == 2
    assert asked == ([col.Allreduce, col.Allreduce] if pair else [col.Allgather])


def test_all_ranks_hold_identical_results():
    p, opt = row_optimizer("onebit,ef=vanilla,collective=allreduce", 1000)
    got = reduce_step(p, opt, torch.randn(1000, generator=torch.Generator().manual_seed(RANK)))
    every = hvd.allgather(got.unsqueeze(0), name="identical_check")
    assert all(torch.equal(every[0], every[r]) for r in range(WORLD))


@pytest.mark.parametrize("spec", ["onebit,ef=vanilla,collective=allreduce",
                                  "topk,k=0.05,ef=vanilla,collective=allreduce",
                                  "minmax8,ef=vanilla,collective=homomorphic"])
def test_checkpointed_state_continues_bit_exactly(spec):
    """Both residuals go through compression_state_dict() (numpy arrays keyed by parameter name
    and chunk, the format both frontends share) into a fresh optimizer that carries on exactly
    as the uninterrupted simulation does."""
    n = 512 * WORLD + 37
    p, opt = row_optimizer(spec, n)
    sim = Simulation(spec, n, "float32", WORLD)
    for step in range(4):
        if step == 2:
            saved = opt.compression_state_dict()
            p, opt = row_optimizer(spec, n)
            opt.load_compression_state_dict(saved)
        grads = grads_for_step(n, "float32", step, WORLD)
        assert same_bits(t2n(reduce_step(p, opt, n2t(grads[RANK], "float32"))), sim(grads))


@pytest.mark.parametrize("spec", ["none", "topk,k=0.05,ef=vanilla", "minmax8,chunk=64",
                                  "powersgd,rank=1,start_iter=0"])
def test_a_rank_waiting_for_the_others_leaves_its_core_free(spec):
    """Horovod's synchronize() spins until a collective is done. The optimizer polls and sleeps
    instead, so a rank that waits does not take the core that the other ranks, and Horovod's
    background thread doing the collective, need. Rank 0 starts the step at once and the
    others `late` seconds after it: rank 0's thread may spend a small part of that wait on the
    CPU, where a spin spends all of it. Every path that waits: the count of stepping ranks, a
    plan's collectives, Horovod's allreduce of an uncompressed bias, PowerSGD's two rounds."""
    late = 0.4
    w = torch.nn.Parameter(torch.zeros(16, 64))
    b = torch.nn.Parameter(torch.zeros(64))
    opt = hvdc.DistributedOptimizer(torch.optim.SGD([w, b], lr=0.0),
                                    named_parameters=[("w", w), ("b", b)], compression=spec,
                                    min_compress_bytes=0)
    for step in range(2):
        opt.zero_grad()
        if RANK != 0:
            time.sleep(late)
        wall, cpu = time.perf_counter(), time.thread_time()
        ((w * (step + 1)).sum() + b.sum()).backward()
        opt.synchronize()
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        with opt.skip_synchronize():
            opt.step()
    if RANK == 0:
        assert wall > 0.5 * late, "rank 0 did not wait for the others"
        assert cpu < 0.2 * wall, f"rank 0 spent {cpu:.3f} s on the CPU in a {wall:.3f} s wait"
