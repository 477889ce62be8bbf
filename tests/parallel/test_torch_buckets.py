"""Gradient buckets (bucket_mb) at any rank count: `make test` runs this module at 2, 3, 4 and 8
ranks, at 8 each test once, in one job per count with test_torch_collectives.py (Makefile).

The oracle is the layout (hvd_compress.buckets.layout) and, per bucket, the numpy simulation of
the codec on the concatenation of its members' gradients (tests/simulation.py), every rank's
gradient computed from seeds; each parameter's reduced gradient is read back out of its buckets
and compared bit for bit, over several steps so that the residuals kept in the parameters' own
slots (placed as consecutive views of one buffer per bucket) are checked too.
"""
from __future__ import annotations

import time

import horovod.torch as hvd
import numpy as np
import pytest
import torch

import bucket_oracle
from bucket_oracle import BUCKET_MB, SHAPES, assert_reduced
from helpers import ranks_marker, same_bits, t2n
from simulation import Simulation
from hvd_compress import buckets
import hvd_compress as hc
import hvd_compress.torch as hvdc

hvd.init()
WORLD, RANK = hvd.size(), hvd.rank()
pytestmark = ranks_marker(WORLD)


def make_oracle(spec, min_bytes=0):
    return bucket_oracle.BucketOracle(spec, WORLD, min_bytes)


def step_grads(step):
    return bucket_oracle.step_grads(step, WORLD)


def bucketed(spec, bucket_mb=BUCKET_MB, min_compress_bytes=0, lr=0.0):
    params = {name: torch.nn.Parameter(torch.zeros(shape)) for name, shape in SHAPES.items()}
    opt = hvdc.DistributedOptimizer(torch.optim.SGD(params.values(), lr=lr),
                                    named_parameters=list(params.items()), compression=spec,
                                    min_compress_bytes=min_compress_bytes, bucket_mb=bucket_mb)
    return params, opt


def reduce(params, opt, grads):
    opt.zero_grad()
    sum((p * torch.from_numpy(grads[name][RANK])).sum() for name, p in params.items()).backward()
    opt.synchronize()
    got = {name: t2n(p.grad) for name, p in params.items()}
    with opt.skip_synchronize():
        opt.step()
    return got


SPECS = ["onebit,ef=vanilla", "topk,k=0.05,ef=vanilla,momentum=nesterov", "efsignsgd",
         "randomk,k=0.1,ef=vanilla,seed=3", "minmax8,chunk=64", "dgc,k=0.05",
         "threshold,threshold=1.5,ef=vanilla", "dithering,ef=vanilla,collective=allreduce",
         "fp16,ef=vanilla"]


def test_layout_cuts_large_tensors_and_fills_buckets_in_backward_order():
    layout = make_oracle("onebit").layout
    assert [[(m.name, m.start, m.stop) for m in b.members] for b in layout] == [
        [("emb", 0, 1666)], [("emb", 1666, 3333)], [("emb", 3333, 5000)],
        [("bias", 0, 7), ("w", 0, 1200), ("v", 0, 300)]]


@pytest.mark.parametrize("spec", SPECS)
def test_buckets_equal_the_simulated_bucket(spec):
    params, opt = bucketed(spec)
    oracle = make_oracle(spec)
    for step in range(3):
        grads = step_grads(step)
        oracle.check(reduce(params, opt, grads), oracle(grads), f"{spec} at step {step}")


def test_bucket_mb_in_the_spec_sets_the_buckets():
    """As `python -m hvd_compress --compression SPEC` sets them: no optimizer argument."""
    spec = "onebit,ef=vanilla"
    params, opt = bucketed(f"{spec},bucket_mb={BUCKET_MB!r}", bucket_mb=None)
    oracle = make_oracle(spec)
    for step in range(2):
        grads = step_grads(step)
        oracle.check(reduce(params, opt, grads), oracle(grads), f"step {step}")
    assert {n for n in opt.compression_stats.tensors if n.startswith("hvd_compress.bucket")}


@pytest.mark.parametrize("spec", bucket_oracle.GRANULAR_SPECS)
def test_tensor_granularity_selects_in_each_member_as_without_buckets(spec):
    """granularity=tensor: three tensors in one bucket and one allgather, each selecting its own
    k as when it travels alone, so the bits equal the per-tensor run's; with the default
    (bucket) granularity the selection spans the bucket and they differ."""
    shapes = bucket_oracle.GRANULAR_SHAPES

    def run(spec, bucket_mb):
        params = {name: torch.nn.Parameter(torch.zeros(shape)) for name, shape in shapes.items()}
        opt = hvdc.DistributedOptimizer(torch.optim.SGD(params.values(), lr=0.0),
                                        named_parameters=list(params.items()), compression=spec,
                                        min_compress_bytes=0, bucket_mb=bucket_mb)
        got = [reduce(params, opt, bucket_oracle.granular_grads(step, WORLD))
               for step in range(3)]
        return got, opt.compression_stats.tensors

    bucket_oracle.check_granularity(spec, run)


@pytest.mark.parametrize("spec", ["fp16", "bf16", "fp16,ef=vanilla"])
def test_elementwise_codecs_give_the_per_tensor_result(spec):
    per_tensor, opt_a = bucketed(spec, bucket_mb=0)
    in_buckets, opt_b = bucketed(spec)
    for step in range(3):
        grads = step_grads(step)
        a, b = reduce(per_tensor, opt_a, grads), reduce(in_buckets, opt_b, grads)
        for name in SHAPES:
            magnitude = 2 * sum(np.abs(g.astype(np.float64)) for g in grads[name])
            assert_reduced(a[name], b[name], "half" if spec.startswith("fp16") else True,
                           f"{spec}: {name} at step {step}", WORLD, magnitude)


@pytest.mark.parametrize("spec", ["onebit,ef=vanilla", "topk,k=0.05,ef=vanilla,momentum=nesterov",
                                  "dgc,k=0.05"])
def test_state_is_keyed_by_parameter_and_a_restart_continues_bit_for_bit(spec):
    params, opt = bucketed(spec)
    oracle = make_oracle(spec)
    for step in range(2):
        grads = step_grads(step)
        reduce(params, opt, grads)
        oracle(grads)
    # the shared bucket's members keep their state in one buffer, in layout order
    shared = [m.name for m in oracle.layout[-1].members]
    store = opt._hvdc_store
    for kind in store.kinds(shared[0]):
        slots = [store.peek(name, kind) for name in shared]
        ends = [s.data_ptr() + s.numel() * s.element_size() for s in slots]
        assert [s.data_ptr() for s in slots[1:]] == ends[:-1], kind
    state = opt.compression_state_dict()
    compressed = {m.name for b in oracle.layout for m in b.members}
    assert set(state["steps"]) == compressed
    for name in compressed:
        for kind, arr in state["slots"][name].items():
            assert arr.shape == SHAPES[name], f"{name} {kind}"
    # the residual of each member is its share of the simulated bucket's residual
    cfg = hc.parse_spec(spec)
    if cfg.ef == "vanilla" and not cfg.info.state_slots:
        for b in oracle.layout:
            e, at = oracle.sims[b.index].e[RANK], 0
            for m in b.members:
                assert same_bits(state["slots"][m.name]["ef"].reshape(-1)[m.start:m.stop],
                                 e[at:at + m.n]), m
                at += m.n
    params2, opt2 = bucketed(spec)
    opt2.load_compression_state_dict(state)
    for step in range(2, 4):
        grads = step_grads(step)
        oracle.check(reduce(params2, opt2, grads), oracle(grads), f"{spec} at step {step}")


@pytest.mark.parametrize("spec", ["onebit,ef=vanilla", "dithering,ef=vanilla,collective=allreduce",
                                  "dgc,k=0.05"])
def test_non_finite_bucket_step_leaves_no_trace(spec):
    """From its second step a bucket's residual (DGC: its velocity and accumulator) is written
    into a second buffer, the first kept as the step's backup (a bucket of one piece: its
    member's slot alternates likewise): a skipped step puts the first back, and the steps after
    it go on alternating, as the oracle's residual says."""
    state_kinds = hc.parse_spec(spec).info.state_slots or ("ef",)
    params, opt = bucketed(spec)
    oracle = make_oracle(spec)
    store = opt._hvdc_store
    for step in range(2):
        grads = step_grads(step)
        reduce(params, opt, grads)
        oracle(grads)
    before = opt.compression_state_dict()
    # DGC compresses matrices only: "emb" travels uncompressed, its momentum updated in place
    names = ("w",) if state_kinds != ("ef",) else ("w", "emb")
    held = {(n, k): store.peek(n, k) for n in names for k in state_kinds}
    bad = step_grads(2)
    bad["w"][0][3, 4] = np.nan
    reduce(params, opt, bad)
    after = opt.compression_state_dict()
    assert after["steps"] == before["steps"]
    for name, kinds in before["slots"].items():
        for kind, arr in kinds.items():
            assert same_bits(after["slots"][name][kind], arr), f"{name} {kind}"
    assert all(store.peek(*key) is t for key, t in held.items())
    for step in (3, 4):
        grads = step_grads(step)
        oracle.check(reduce(params, opt, grads), oracle(grads), f"step {step}, after the skip")
        # every slot held is in the other buffer now ("w" shares its bucket, "emb" is in three
        # of its own)
        moved = {key: store.peek(*key) for key in held}
        assert all(moved[key].data_ptr() != t.data_ptr() for key, t in held.items())
        held = moved


def test_small_buckets_travel_uncompressed_and_a_bucket_without_gradients_goes_without_them():
    # min_compress_bytes above the shared bucket (1507 elements) but below each emb piece
    spec = "onebit,ef=vanilla"
    params, opt = bucketed(spec, min_compress_bytes=1600 * 4)
    oracle = make_oracle(spec, min_bytes=1600 * 4)
    assert len(oracle.layout) == 3 and set(oracle.plain) == {"v", "w", "bias"}
    grads = step_grads(0)
    oracle.check(reduce(params, opt, grads), oracle(grads), "small buckets")
    # a step in which no rank has a gradient for "w": the shared bucket goes without it
    params, opt = bucketed(spec)
    opt.zero_grad()
    g = step_grads(0)
    sum((params[n] * torch.from_numpy(g[n][RANK])).sum() for n in ("v", "bias", "emb")).backward()
    opt.synchronize()
    members = [buckets.Member("bias", 0, 7), buckets.Member("v", 0, 300)]
    sim = Simulation(spec, 307, "float32", WORLD,
                     name=buckets.Bucket(3, (), "float32").named(members))
    want = sim([np.concatenate([g["bias"][r], g["v"][r]]) for r in range(WORLD)])
    assert same_bits(t2n(params["bias"].grad), want[:7])
    assert same_bits(t2n(params["v"].grad), want[7:])
    assert params["w"].grad is None
    assert "w" not in opt.compression_state_dict()["steps"]


@pytest.mark.parametrize("bucket_mb, message", [(-1, "bucket_mb must be a number of MiB >= 0"),
                                                ("4", "bucket_mb must be a number of MiB >= 0")])
def test_bad_bucket_sizes_are_refused(bucket_mb, message):
    with pytest.raises(ValueError, match=message):
        bucketed("onebit", bucket_mb=bucket_mb)


def test_ranks_with_different_bucket_sizes_get_an_error():
    with pytest.raises(ValueError, match="ranks disagree on the compression spec"):
        bucketed("onebit", bucket_mb=1 if RANK == 0 else 2)


@pytest.mark.parametrize("bucket_mb", [0, 1])
def test_a_bucketed_checkpoint_loads_without_buckets_or_with_another_size(bucket_mb):
    """The state is per parameter, so another layout continues from the same residuals. A
    rank's new onebit residual depends on its own residual and gradient only, so each rank
    checks its own against the simulation of the new layout started from the loaded state."""
    spec = "onebit,ef=vanilla"
    params, opt = bucketed(spec)
    for step in range(2):
        reduce(params, opt, step_grads(step))
    state = opt.compression_state_dict()
    params2, opt2 = bucketed(spec, bucket_mb=bucket_mb)
    opt2.load_compression_state_dict(state)
    grads = step_grads(2)
    reduce(params2, opt2, grads)
    after = opt2.compression_state_dict()
    if bucket_mb == 0:  # every tensor alone
        groups = [(name, [buckets.Member(name, 0, int(np.prod(SHAPES[name])))])
                  for name in SHAPES]
    else:  # 1 MiB holds every tensor: one bucket, in backward order
        (bucket,) = buckets.layout([(name, int(np.prod(shape)), "float32", 4)
                                    for name, shape in reversed(SHAPES.items())], 1 << 20)
        groups = [(bucket.name, list(bucket.members))]
    for name, members in groups:
        flat = lambda src, r: np.concatenate([src[m.name][r].reshape(-1) for m in members])
        sim = Simulation(spec, sum(m.n for m in members), "float32", WORLD, name=name)
        sim.step = int(state["steps"][members[0].name])
        sim.e[RANK] = np.concatenate([state["slots"][m.name]["ef"].reshape(-1)
                                      for m in members])
        sim([flat(grads, r) for r in range(WORLD)])
        at = 0
        for m in members:
            assert after["slots"][m.name]["ef"].shape == SHAPES[m.name]
            assert same_bits(after["slots"][m.name]["ef"].reshape(-1), sim.e[RANK][at:at + m.n]), m
            at += m.n


def test_a_bucket_is_sent_when_its_last_gradient_arrives_during_backward():
    """Overlap: the pieces of "emb" leave as soon as its gradient exists and the step's count
    of stepping ranks is in, before the gradients of the other bucket are computed; that one
    leaves with its last member. The count, issued at the first gradient, does not stop
    backward: a gradient that comes before it is held and sent at the next one after it."""
    spec = "topk,k=0.05,ef=vanilla"
    params, opt = bucketed(spec)
    oracle = make_oracle(spec)
    grads = step_grads(0)
    opt.zero_grad()
    (params["emb"] * torch.from_numpy(grads["emb"][RANK])).sum().backward()
    if not opt._hvdc_flights:
        assert opt._hvdc_deferred == [params["emb"]]
    opt._hvdc_counted(block=True)
    (params["w"] * torch.from_numpy(grads["w"][RANK])).sum().backward()
    assert opt._hvdc_deferred == []
    assert sorted(opt._hvdc_flights) == [0, 1, 2]
    sum((params[n] * torch.from_numpy(grads[n][RANK])).sum() for n in ("v", "bias")).backward()
    assert sorted(opt._hvdc_flights) == [0, 1, 2, 3]
    opt.synchronize()
    oracle.check({n: t2n(p.grad) for n, p in params.items()}, oracle(grads), "overlap")


@pytest.mark.parametrize("spec", ["threshold,threshold=1.5,ef=vanilla", "topk,k=0.05,ef=vanilla",
                                  "dithering,ef=vanilla,collective=allreduce"])
def test_buckets_whose_collective_finished_move_on_at_the_next_gradient(spec):
    """A plan's next step (threshold's payloads after its sizes between two Gloo ranks, the
    compressed allreduce's allgather after its alltoall, or the decode) is taken at the first
    gradient after its collective finishes, during backward, not left to synchronize()."""
    params, opt = bucketed(spec)
    oracle = make_oracle(spec)
    grads = step_grads(0)

    def backward(*names):
        sum((params[n] * torch.from_numpy(grads[n][RANK])).sum() for n in names).backward()
    opt.zero_grad()
    backward("emb")
    opt._hvdc_counted(block=True)  # the next gradient routes any that waited for the count
    backward("w")
    plans = [opt._hvdc_flights[i][0] for i in (0, 1, 2)]
    deadline = time.monotonic() + 60
    while not all(p.ready() for p in plans):
        assert time.monotonic() < deadline, "the buckets' first collectives did not finish"
        time.sleep(0.001)
    backward("v")
    assert all(p.moved for p in plans)
    backward("bias")
    opt.synchronize()
    oracle.check({n: t2n(p.grad) for n, p in params.items()}, oracle(grads), "moved in backward")


@pytest.mark.parametrize("spec", ["onebit,ef=vanilla", "minmax8,chunk=64",
                                  "dithering,ef=vanilla,collective=allreduce"])
def test_a_gradient_in_buckets_of_its_own_is_reduced_in_its_own_memory(spec):
    """"emb" fills three buckets alone: they are pieces of its gradient, reduced in place, so
    the reduced gradient is the memory backward wrote (no copy into a bucket, none out of it).
    "w" shares its bucket and is read out of it, with the same result as the oracle's."""
    params, opt = bucketed(spec)
    oracle = make_oracle(spec)
    for step in range(2):
        grads = step_grads(step)
        opt.zero_grad()
        sum((p * torch.from_numpy(grads[n][RANK])).sum() for n, p in params.items()).backward()
        written = {n: p.grad.data_ptr() for n, p in params.items()}
        opt.synchronize()
        assert params["emb"].grad.data_ptr() == written["emb"]
        assert params["w"].grad.data_ptr() != written["w"]
        oracle.check({n: t2n(p.grad) for n, p in params.items()}, oracle(grads), f"step {step}")
        with opt.skip_synchronize():
            opt.step()


@pytest.mark.parametrize("spec", ["onebit,ef=vanilla", "topk,k=0.05,ef=vanilla,momentum=nesterov"])
@pytest.mark.parametrize("slow", ["compressed", "uncompressed"])
def test_autotune_probes_both_arms_and_every_rank_keeps_the_faster(spec, slow):
    """hvd_compress.autotune: 2 warm-up steps compress, then 2K probe steps alternate (C, U),
    (U, C); an uncompressed step is the spec's momentum and Horovod's average, its residuals
    left for the next compressed step. One arm is made slower by a sleep far above these steps'
    noise; every rank must then keep the other arm, with the same bits as the oracle."""
    from hvd_compress.autotune import WARMUP, compressed_arm
    probes = 2
    params, opt = bucketed(f"{spec},autotune={probes}")
    launch, plain = opt._hvdc_launch, opt._hvdc_plain

    def slow_launch(bucket):
        if slow == "compressed":
            time.sleep(0.1)
        return launch(bucket)

    def slow_plain(p, name, grad):
        if slow == "uncompressed" and not opt._hvdc_tune.compresses():
            time.sleep(0.1)
        return plain(p, name, grad)
    opt._hvdc_launch, opt._hvdc_plain = slow_launch, slow_plain
    counts = []  # per step, whether the count of stepping ranks was issued
    count = opt._hvdc_count

    def counting():
        if opt._hvdc_active is None and opt._hvdc_counting is None:
            counts[-1] = True
        return count()
    opt._hvdc_count = counting
    oracle = make_oracle(spec)
    decided = slow == "uncompressed"
    for step in range(WARMUP + 2 * probes + 2):
        arm = compressed_arm(step - WARMUP) if step < WARMUP + 2 * probes else decided
        grads = step_grads(step)
        counts.append(False)
        oracle.check(reduce(params, opt, grads), oracle(grads, compressing=arm),
                     f"step {step}, {'compressed' if arm else 'uncompressed'}")
    # Settled on uncompressed steps, a spec without momentum touches no state: its steps are
    # Horovod's allreduce alone, without the count that looks for a joined rank.
    assert counts == [True] * (WARMUP + 2 * probes) + [decided or "momentum" in spec] * 2
    tuned = opt.compression_report()["autotune"]
    assert tuned["compress"] is decided
    assert (tuned["compressed_ms"] > tuned["uncompressed_ms"]) is not decided
    every = hvd.allgather(torch.tensor([tuned["compressed_ms"], tuned["uncompressed_ms"]],
                                       dtype=torch.float64).view(1, 2), name="autotune_check")
    assert (every == every[0]).all()


def test_autotune_is_refused_for_codec_none_and_ranks_must_agree_on_it():
    with pytest.raises(ValueError, match="codec none compresses nothing"):
        bucketed("none,autotune=2")
    with pytest.raises(ValueError, match="ranks disagree on the compression spec"):
        bucketed(f"onebit,autotune={RANK + 1}")
