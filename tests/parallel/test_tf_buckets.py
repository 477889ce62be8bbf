"""Gradient buckets in the TensorFlow frontend, the twin of test_torch_buckets.py: `make test` runs
this module at 2, 3, 4 and 8 ranks, at 8 each test once, in one job per count with
test_tf_collectives.py (Makefile).

The oracle is the one the torch tests use (tests/bucket_oracle.py), so both frontends lay out the
same buckets and deliver the same bits for the same gradients, eagerly and inside tf.function;
the state they keep per parameter is the same too, so a torch checkpoint continues here.
"""
from __future__ import annotations

import warnings

import horovod.tensorflow as hvd
import numpy as np
import pytest
import tensorflow as tf

import bucket_oracle
from bucket_oracle import BUCKET_MB, SHAPES
from helpers import ranks_marker, same_bits
from simulation import Simulation
from tf_arms import traced_arms
import hvd_compress as hc
import hvd_compress.tensorflow as hvdc_tf
import hvd_compress.tensorflow.keras as hvdc_keras
from hvd_compress import buckets
from hvd_compress.spec import spec_momentum

hvd.init()
WORLD, RANK = hvd.size(), hvd.rank()
pytestmark = ranks_marker(WORLD)

SPECS = ["onebit,ef=vanilla", "topk,k=0.05,ef=vanilla,momentum=nesterov", "efsignsgd",
         "randomk,k=0.1,ef=vanilla,seed=3", "minmax8,chunk=64", "dgc,k=0.05",
         "threshold,threshold=1.5,ef=vanilla", "dithering,ef=vanilla,collective=allreduce",
         "fp16,ef=vanilla"]


class Model:
    """The four variables of the oracle, given in its order, reduced by a reducer of their own
    (fresh state) as a DistributedGradientTape reduces them."""

    def __init__(self, spec, bucket_mb=BUCKET_MB, min_compress_bytes=0, graph=False):
        self.vars = [tf.Variable(tf.zeros(shape), name=name) for name, shape in SHAPES.items()]
        self.reducer = hvdc_tf.Reducer(hvdc_tf.reducer.to_config(spec), min_compress_bytes,
                                       hvd.Average, hvd.global_process_set,
                                       bucket_bytes=int(bucket_mb * 2 ** 20))
        step = lambda gs: self.reducer.reduce(gs, self.vars)
        self.step = tf.function(step) if graph else step

    def reduce(self, grads):
        got = self.step([tf.constant(grads[name][RANK]) for name in SHAPES])
        return {name: g.numpy() for name, g in zip(SHAPES, got)}


# Eager and traced run the same plan: beyond 2 ranks (oversubscribed in CI) traced only.
@pytest.mark.parametrize("graph", [False, True] if WORLD == 2 else [True],
                         ids=["eager", "tf.function"] if WORLD == 2 else ["tf.function"])
@pytest.mark.parametrize("spec", SPECS)
def test_buckets_equal_the_simulated_bucket(spec, graph):
    model = Model(spec, graph=graph)
    oracle = bucket_oracle.BucketOracle(spec, WORLD)
    for step in range(3):
        grads = bucket_oracle.step_grads(step, WORLD)
        oracle.check(model.reduce(grads), oracle(grads), f"{spec} at step {step}")


@pytest.mark.parametrize("graph", [False, True] if WORLD == 2 else [True],
                         ids=["eager", "tf.function"] if WORLD == 2 else ["tf.function"])
@pytest.mark.parametrize("spec", ["topk,k=0.05,ef=vanilla,momentum=nesterov", "dgc,k=0.05"])
def test_spec_momentum_goes_on_while_compression_is_off(spec, graph):
    """Under a spec's momentum the optimizer's own is 0, so the steps that
    CompressionScheduleCallback keeps uncompressed (`enabled` off) give each bucket's members
    the spec's momentum before Horovod's allreduce, and compression starts from it. Such a
    step that is not finite moves no momentum: the momentum is written only once the step
    proved finite, and the steps after it go on from the state before it."""
    model = Model(spec, graph=graph)
    oracle = bucket_oracle.BucketOracle(spec, WORLD)
    for step, on in enumerate([False, False, None, True, False, None, False, True]):
        grads = bucket_oracle.step_grads(step, WORLD)
        if on is None:  # uncompressed, NaN in one rank's gradient of each parameter
            model.reducer.enabled.assign(False)
            before = model.reducer.state_dict()
            for gs in grads.values():
                gs[WORLD - 1].flat[0] = np.nan
            got = model.reduce(grads)
            assert all(np.isnan(g.flat[0]) for g in got.values())
            after = model.reducer.state_dict()
            assert after["steps"] == before["steps"]
            assert after["slots"].keys() == before["slots"].keys()
            for name, kinds in before["slots"].items():
                assert kinds.keys() == after["slots"][name].keys()
                for kind, arr in kinds.items():
                    assert same_bits(after["slots"][name][kind], arr), (step, name, kind)
            continue
        model.reducer.enabled.assign(on)
        oracle.check(model.reduce(grads), oracle(grads, compressing=on), f"step {step}")
    kind = spec_momentum(hc.parse_spec(spec))[2]
    kept = model.reducer.state_dict()["slots"]
    assert all(kept[name][kind].any() for name in SHAPES)  # every parameter's momentum moved


def test_a_bucket_without_some_gradients_is_compressed_without_them():
    """As in the torch frontend: a step in which no rank has a gradient for "w" sends the
    shared bucket compressed without it, though the rest (307 elements) is under
    min_compress_bytes, which the layout weighed on the full bucket (1507); the spec's
    momentum stays in the members' own slots, none under the bucket's name."""
    spec = "topk,k=0.05,ef=vanilla,momentum=nesterov"
    model = Model(spec, min_compress_bytes=1000 * 4)
    g = bucket_oracle.step_grads(0, WORLD)
    got = model.step([None if name == "w" else tf.constant(g[name][RANK]) for name in SHAPES])
    got = dict(zip(SHAPES, got))
    members = [buckets.Member("bias", 0, 7), buckets.Member("v", 0, 300)]
    sim = Simulation(spec, 307, "float32", WORLD,
                     name=buckets.Bucket(3, (), "float32").named(members))
    want = sim([np.concatenate([g["bias"][r], g["v"][r]]) for r in range(WORLD)])
    assert same_bits(got["bias"].numpy(), want[:7])
    assert same_bits(got["v"].numpy(), want[7:])
    assert got["w"] is None
    slots = model.reducer.state_dict()["slots"]
    # From 3 ranks on, the compressed allreduce's chunk owners keep residuals under the
    # bucket's name; the momentum is the members' own.
    assert not [n for n, kinds in slots.items() if n not in SHAPES and "momentum" in kinds]
    assert same_bits(slots["v"]["momentum"], sim.m[RANK][7:])


@pytest.mark.parametrize("spec", ["onebit,ef=vanilla", "topk,k=0.05,ef=vanilla,momentum=nesterov",
                                  "dgc,k=0.05", "randomk,k=0.1,ef=vanilla,seed=3"])
def test_state_is_per_variable_and_continues_without_buckets(spec):
    """The residuals and momenta are the members' shares of the simulated bucket's, in slots
    shaped like the variables; a reducer without buckets then continues from them."""
    model = Model(spec, graph=True)
    oracle = bucket_oracle.BucketOracle(spec, WORLD)
    for step in range(2):
        grads = bucket_oracle.step_grads(step, WORLD)
        model.reduce(grads)
        oracle(grads)
    state = model.reducer.state_dict()
    cfg = hc.parse_spec(spec)
    kinds = {"ef": "e", "momentum": "m"} if not cfg.info.state_slots else {
        "dgc_velocity": "u", "dgc_accumulator": "e"}
    for b in oracle.layout:
        sim, at = oracle.sims[b.index], 0
        for m in b.members:
            for kind, attr in kinds.items():
                if kind == "momentum" and cfg.momentum != "nesterov":
                    continue
                if kind == "ef" and cfg.ef != "vanilla":
                    continue
                held = state["slots"][m.name][kind]
                assert held.shape == SHAPES[m.name], (m, kind)
                want = getattr(sim, attr)[RANK][at:at + m.n]
                assert same_bits(held.reshape(-1)[m.start:m.stop], want), (m, kind)
            at += m.n
    per_tensor = Model(spec, bucket_mb=0)
    per_tensor.reducer.load_state_dict(state)
    assert per_tensor.reducer.state_dict()["slots"].keys() == state["slots"].keys()


@pytest.mark.parametrize("graph", [False, True] if WORLD == 2 else [True],
                         ids=["eager", "tf.function"] if WORLD == 2 else ["tf.function"])
@pytest.mark.parametrize("spec", bucket_oracle.GRANULAR_SPECS)
def test_tensor_granularity_selects_in_each_member_as_without_buckets(spec, graph):
    """The torch test's case: under granularity=tensor one bucket gives the bits of each tensor
    sent alone; under bucket granularity they differ."""
    shapes = bucket_oracle.GRANULAR_SHAPES

    def run(spec, bucket_mb):
        variables = [tf.Variable(tf.zeros(shape), name=name) for name, shape in shapes.items()]
        reducer = hvdc_tf.Reducer(hvdc_tf.reducer.to_config(spec), 0, hvd.Average,
                                  hvd.global_process_set, bucket_bytes=bucket_mb << 20)
        step = lambda gs: reducer.reduce(gs, variables)
        step = tf.function(step) if graph else step
        got = []
        for i in range(3):
            grads = bucket_oracle.granular_grads(i, WORLD)
            out = step([tf.constant(grads[name][RANK]) for name in shapes])
            got.append({name: g.numpy() for name, g in zip(shapes, out)})
        return got, reducer.stats.tensors

    bucket_oracle.check_granularity(spec, run)


def test_the_tape_and_keras_optimizer_take_bucket_mb():
    spec = "onebit,ef=vanilla"
    variables = [tf.Variable(tf.zeros(shape), name=name) for name, shape in SHAPES.items()]
    oracle = bucket_oracle.BucketOracle(spec, WORLD)
    # the spec's bucket_mb sets the optimizer's buckets as the argument sets the tape's
    opt = hvdc_keras.DistributedOptimizer(tf.keras.optimizers.SGD(1.0),
                                          compression=f"{spec},bucket_mb={BUCKET_MB!r}",
                                          min_compress_bytes=0)
    def loss_of(grads):
        return lambda: tf.add_n([tf.reduce_sum(v * grads[name][RANK])
                                 for v, name in zip(variables, SHAPES)])
    grads = bucket_oracle.step_grads(0, WORLD)
    with tf.GradientTape() as tape:
        loss = loss_of(grads)()
    tape = hvdc_tf.DistributedGradientTape(tape, compression=spec, min_compress_bytes=0,
                                           bucket_mb=BUCKET_MB)
    got = tape.gradient(loss, variables)
    oracle.check({n: g.numpy() for n, g in zip(SHAPES, got)}, oracle(grads), "tape")
    # the Keras optimizer keeps a state store of its own: its first step, from zeros
    grads = bucket_oracle.step_grads(1, WORLD)
    opt.minimize(loss_of(grads), var_list=variables)
    fresh = bucket_oracle.BucketOracle(spec, WORLD)
    fresh.check({n: -v.numpy() for n, v in zip(SHAPES, variables)}, fresh(grads), "keras")


def test_bad_bucket_sizes_are_refused():
    with pytest.raises(ValueError, match="bucket_mb must be a number of MiB >= 0"):
        with tf.GradientTape() as tape:
            pass
        hvdc_tf.DistributedGradientTape(tape, compression="onebit", bucket_mb=-1)


def test_ranks_with_different_bucket_sizes_get_an_error():
    with pytest.raises(ValueError, match="ranks disagree on the compression spec"):
        hvdc_tf.reducer.new_reducer("onebit", 0, hvd.Average, hvd.global_process_set,
                                    bucket_mb=1 if RANK == 0 else 2)


def graph_ancestors(op):
    """Every op that `op` waits for in its graph: data and control inputs, transitively."""
    seen, todo = set(), [op]
    while todo:
        current = todo.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


@pytest.mark.parametrize("spec", ["onebit,ef=vanilla", "topk,k=0.1,ef=vanilla"])
def test_a_traced_bucket_waits_only_for_its_own_gradients(spec):
    """Overlap inside tf.function (Keras' compiled steps): a bucket's compression and
    collectives depend on its members' gradients and on nothing computed later in backward, so
    TF's executor starts them while the rest of backward runs, as it does Horovod's allreduces.
    Three chained layers, one bucket each: backward computes c's gradient, then b's, then a's;
    c's reduced gradient must not wait for b's or a's, nor b's for a's."""
    size = 8
    layers = [tf.Variable(tf.random.stateless_normal([size, size], [7, i]), name=n)
              for i, n in enumerate("abc")]
    reducer = hvdc_tf.Reducer(hvdc_tf.reducer.to_config(spec), 0, hvd.Average,
                              hvd.global_process_set, bucket_bytes=size * size * 4)
    seen = {}

    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for w in layers:
                h = tf.tanh(h @ w)
            loss = tf.reduce_sum(h)
        grads = tape.gradient(loss, layers)
        reduced = reducer.reduce(grads, layers)
        seen["grads"], seen["reduced"] = ([t.op.name for t in ts] for ts in (grads, reduced))
        return reduced

    traced = tf.function(step)
    x = tf.random.stateless_normal([2, size], [RANK, 1])
    graph = traced.get_concrete_function(x).graph
    assert sorted(reducer.stats.tensors) == [f"hvd_compress.bucket{i}" for i in range(3)]
    traced(x)  # the graph inspected is the one that runs: every rank's collectives match
    op = graph.get_operation_by_name
    grad_a, grad_b, grad_c = (op(n) for n in seen["grads"])
    reduced_a, reduced_b, reduced_c = (op(n) for n in seen["reduced"])
    before_c, before_b = graph_ancestors(reduced_c), graph_ancestors(reduced_b)
    assert grad_c in before_c and grad_b in before_b and grad_a in graph_ancestors(reduced_a)
    assert grad_b not in before_c and grad_a not in before_c, "c's bucket waits for later gradients"
    assert grad_a not in before_b, "b's bucket waits for a's gradient"


@pytest.mark.parametrize("spec", ["onebit,ef=vanilla", "topk,k=0.05,ef=vanilla,momentum=nesterov"])
def test_a_traced_step_checks_finiteness_only_where_its_state_can_change(spec):
    """A step that does not compress leaves residuals and counters as they were, so a traced
    step looks for a non-finite reduced gradient (to put back what it changed) only in the
    branch taken when it compresses; a spec's momentum moves in every step, so under one the
    check is the step's. Either way a non-finite compressed step leaves no trace."""
    model = Model(spec, graph=True)
    graph = model.step.get_concrete_function(
        [tf.TensorSpec(shape) for shape in SHAPES.values()]).graph
    # Each arm says whether its own results are finite, in its branch: the check, reading the
    # gradients, would hold every one of them until the step's last was reduced. Under a
    # spec's momentum the uncompressed arms say it too, as the check is then every step's.
    checks = {"IsFinite", "HvdcAllFinite"}  # ours, and TF's for other dtypes
    assert not checks & {op.type for op in graph.get_operations()}
    told = [op for op in graph.get_operations() if op.type in ("If", "StatelessIf")
            and checks & {o.type for o in graph._get_function(
                op.get_attr("else_branch").name).graph.get_operations()}]
    assert bool(told) == ("momentum" in spec), [op.name for op in told]
    if "momentum" not in spec:
        # The check, a call, takes each compressing arm's verdict, not the reduced gradients:
        # it would hold every one of them until the step's last was reduced.
        check, = [op for op in graph.get_operations()
                  if op.type == "If" and "finite_check" in op.name]
        assert not [t for t in check.inputs if t.dtype.is_floating], list(check.inputs)
    model.reduce(bucket_oracle.step_grads(0, WORLD))
    before = model.reducer.state_dict()
    bad = bucket_oracle.step_grads(1, WORLD)
    for g in bad[next(iter(SHAPES))]:  # every rank's: a sign codec reads NaN as positive
        g.flat[0] = np.nan
    assert not np.isfinite(model.reduce(bad)[next(iter(SHAPES))]).all()
    after = model.reducer.state_dict()
    assert after["steps"] == before["steps"] and after["slots"].keys() == before["slots"].keys()
    for name, kinds in before["slots"].items():
        for kind, arr in kinds.items():
            assert same_bits(after["slots"][name][kind], arr), (name, kind)


def test_the_probe_times_a_traced_step_to_the_end_of_all_its_reduction_did():
    """The probe's clock runs after everything the step's reduction started, state writes and
    the finite check included, not only after the reduced gradients: work left after the
    clock would be timed in the next step, whichever arm that is (on Keras' ResNet-50 the
    uncompressed steps that followed compressed ones measured 10-20% above Horovod's)."""
    model = Model("onebit,ef=vanilla,autotune=2", graph=True)
    graph = model.step.get_concrete_function(
        [tf.TensorSpec(shape) for shape in SHAPES.values()]).graph
    ops = graph.get_operations()
    clock = next(op for op in ops if op.type == "Timestamp")
    before = graph_ancestors(clock)
    conds = [op for op in ops[:ops.index(clock)] if op.type in ("If", "StatelessIf")]
    assert len(conds) > 2 and all(op in before for op in conds), \
        [op.name for op in conds if op not in before]


@pytest.mark.parametrize("graph", [False, True] if WORLD == 2 else [True],
                         ids=["eager", "tf.function"] if WORLD == 2 else ["tf.function"])
@pytest.mark.parametrize("slow", ["compressed", "uncompressed"])
def test_autotune_probes_both_arms_and_every_rank_keeps_the_faster(slow, graph):
    """The twin of the torch test, with the probe in the step's own ops: warm-up steps
    (C, C, U, U), then (C, U), (U, C); an uncompressed step is one with `enabled` off. The clock
    is the test's, and it stands still inside the reduction: the arm's cost is added before the
    step, as forward and backward would take it, so a step's time must run from the end of the
    previous one. One arm is slower on every rank."""
    from hvd_compress.autotune import WARMUP, compressed_arm
    spec, probes = "topk,k=0.05,ef=vanilla,momentum=nesterov", 2
    model = Model(f"{spec},autotune={probes}", graph=graph)
    tune = model.reducer.autotune
    ticks = tf.Variable(0.0, dtype=tf.float64)
    slow_arm = slow == "compressed"
    tune.clock = ticks.read_value
    oracle = bucket_oracle.BucketOracle(spec, WORLD)
    decided = slow == "uncompressed"
    for step in range(WARMUP + 2 * probes + 2):
        arm = compressed_arm(step - WARMUP) if step < WARMUP + 2 * probes else decided
        ticks.assign_add(1.0 if arm == slow_arm else 0.1)
        grads = bucket_oracle.step_grads(step, WORLD)
        oracle.check(model.reduce(grads), oracle(grads, compressing=arm),
                     f"step {step}, {'compressed' if arm else 'uncompressed'}")
        # the probe's last step ends with the decision in `enabled`
        assert bool(model.reducer.enabled.numpy()) is (
            decided if step >= WARMUP + 2 * probes - 1 else arm), f"step {step}"
    tuned = model.reducer.compression_report()["autotune"]
    cost = {True: 1.0 if slow_arm else 0.1, False: 0.1 if slow_arm else 1.0}
    assert tuned == {"probes": probes, "compress": decided,
                     "compressed_ms": pytest.approx(1e3 * WORLD * cost[True]),
                     "uncompressed_ms": pytest.approx(1e3 * WORLD * cost[False])}


def record_allreduces(monkeypatch) -> list:
    """(name, elements) of each hvd.allreduce the reducer issues. Eager: a tf.cond runs only
    the branch taken, so the list is what the step sent; traced, what the graph holds."""
    sent, real = [], hvd.allreduce

    def allreduce(tensor, *args, name=None, **kwargs):
        sent.append((name, tensor.shape.num_elements()))
        return real(tensor, *args, name=name, **kwargs)
    monkeypatch.setattr(hvd, "allreduce", allreduce)
    return sent


@pytest.mark.parametrize("spec", ["onebit,ef=vanilla", "topk,k=0.05,ef=vanilla,momentum=nesterov"])
def test_uncompressed_steps_send_each_member_as_horovod_would(spec, monkeypatch):
    """While compression is off, each parameter goes to Horovod's allreduce whole (one cut
    between buckets too), not inside a bucket built to be split again.
    Without a spec's momentum the step counts no stepping ranks either: it then issues what
    Horovod's own optimizer would. A spec's momentum must not move while a rank is joined,
    so that spec keeps the count."""
    model = Model(spec)
    oracle = bucket_oracle.BucketOracle(spec, WORLD)
    sent = record_allreduces(monkeypatch)
    cut = [m.name for b in oracle.layout for m in b.members if m.n < np.prod(SHAPES[m.name])]
    assert cut, "the layout cuts no parameter between buckets"
    whole = sorted(int(np.prod(shape)) for shape in SHAPES.values())
    for step in range(3):
        on = step == 1
        model.reducer.enabled.assign(on)
        sent.clear()
        grads = bucket_oracle.step_grads(step, WORLD)
        oracle.check(model.reduce(grads), oracle(grads, compressing=on), f"step {step}")
        counts = [n for name, n in sent if name == "hvdc.stepping_ranks"]
        assert len(counts) == (1 if on or "momentum" in spec else 0), (step, sent)
        if not on:
            assert sorted(n for name, n in sent if name != "hvdc.stepping_ranks") == whole, \
                (step, sent)


@pytest.mark.parametrize("spec", ["onebit,ef=vanilla", "topk,k=0.05,ef=vanilla,momentum=nesterov"])
def test_traced_uncompressed_buckets_wait_for_no_other_bucket_nor_walk_its_compression(spec, monkeypatch):
    """While compression is off, a traced step sends each bucket's members from a cond of their
    own that touches no state. TF runs a cond that writes a variable after every earlier op
    that uses it, and a member cut between buckets has its residual written in both buckets'
    compressing branches: with one cond for both arms, a bucket's uncompressed allreduces
    waited until the previous bucket's had completed (Keras' ResNet-50 at 10 Gbit/s:
    efsignsgd, topk, threshold and dithering, uncompressed, 6-11% below Horovod)."""
    oracle = bucket_oracle.BucketOracle(spec, WORLD)
    assert any(m.n < np.prod(SHAPES[m.name]) for b in oracle.layout for m in b.members), \
        "the layout cuts no parameter between buckets"
    model = Model(spec, graph=True)
    conds, calls, checks = traced_arms(model.step, [tf.TensorSpec(shape) for shape in SHAPES.values()],
                               ".plain", monkeypatch)
    # The finite check guards state only a compressing arm wrote, so it is a call too, unless
    # the spec's momentum moves in every step
    assert len(checks) == (spec_momentum(hc.parse_spec(spec)) is None), [op.name for op in checks]
    # a bucket holding only pieces of a parameter sent whole elsewhere sends nothing
    assert len(conds) > 1, [op.name for op in conds]
    assert len(calls) == len(oracle.layout), [op.name for op in calls]
    model.reducer.enabled.assign(False)
    grads = bucket_oracle.step_grads(0, WORLD)
    oracle.check(model.reduce(grads), oracle(grads, compressing=False), "uncompressed")


@pytest.mark.parametrize("spec", ["onebit,ef=vanilla", "topk,k=0.05,ef=vanilla,momentum=nesterov",
                                  "dgc,k=0.05"])
def test_traced_uncompressed_tensors_without_buckets_skip_their_compression(spec, monkeypatch):
    """bucket_mb=0: each gradient alone, its arms in conds of their own as a bucket's. The
    uncompressed cond touches no state, so it waits for no other gradient's compressing cond;
    the compressing one is kept as one If op, not walked as dead in each uncompressed step."""
    model = Model(spec, bucket_mb=0, graph=True)
    conds, calls, checks = traced_arms(model.step, [tf.TensorSpec(shape) for shape in SHAPES.values()],
                               ".plain", monkeypatch)
    # The finite check guards state only a compressing arm wrote, so it is a call too, unless
    # the spec's momentum moves in every step
    assert len(checks) == (spec_momentum(hc.parse_spec(spec)) is None), [op.name for op in checks]
    min_dim = hc.parse_spec(spec).info.min_dim
    compressed = [n for n, shape in SHAPES.items() if len(shape) >= min_dim]
    assert len(conds) == len(compressed), ([op.name for op in conds], compressed)
    assert len(calls) == len(compressed), [op.name for op in calls]
    # Both arms still give what each gradient simulated alone gives, state carried across.
    sims = {name: Simulation(spec, int(np.prod(shape)), "float32", WORLD, name=name,
                             plain=name not in compressed) for name, shape in SHAPES.items()}
    for step, on in enumerate([True, False, True]):
        model.reducer.enabled.assign(on)
        grads = bucket_oracle.step_grads(step, WORLD)
        got = model.reduce(grads)
        for name, sim in sims.items():
            sim.plain = not on or name not in compressed
            want = sim([g.reshape(-1) for g in grads[name]]).reshape(SHAPES[name])
            magnitude = sum(np.abs(g.astype(np.float64)) for g in grads[name])
            bucket_oracle.assert_reduced(got[name], want, sim.plain, f"step {step}: {name}",
                                         WORLD, magnitude)


def slower_arm_clock(tune, slow: str) -> None:
    """The probe's clock made the test's: each step costs 1 in its slow arm, 0.1 in the other."""
    ticks = tf.Variable(0.0, dtype=tf.float64)
    cost = {"compressed": (1.0, 0.1), "uncompressed": (0.1, 1.0)}[slow]
    tune.clock = lambda: ticks.assign_add(tf.where(tune.enabled, tf.constant(cost[0], tf.float64),
                                                   cost[1]))


def test_autotune_counts_stepping_ranks_until_it_settles_on_uncompressed(monkeypatch):
    """The probe's uncompressed steps are counted only where every rank stepped, so they count
    the ranks; once autotune keeps uncompressed steps (here the compressed arm is slower on
    the test's clock), a spec without momentum issues no count."""
    from hvd_compress.autotune import WARMUP, compressed_arm
    spec, probes = "onebit,ef=vanilla", 1
    model = Model(f"{spec},autotune={probes}")
    slower_arm_clock(model.reducer.autotune, "compressed")
    oracle = bucket_oracle.BucketOracle(spec, WORLD)
    sent = record_allreduces(monkeypatch)
    probing = WARMUP + 2 * probes
    for step in range(probing + 2):
        arm = compressed_arm(step - WARMUP) if step < probing else False
        sent.clear()
        grads = bucket_oracle.step_grads(step, WORLD)
        oracle.check(model.reduce(grads), oracle(grads, compressing=arm), f"step {step}")
        issued = sum(name == "hvdc.stepping_ranks" for name, _ in sent)
        assert issued == (1 if step < probing else 0), (step, arm, sent)
    assert model.reducer.compression_report()["autotune"]["compress"] is False


def test_autotune_leaves_no_room_for_a_compression_schedule():
    from types import SimpleNamespace
    model = Model("onebit,ef=vanilla,autotune=2")
    with pytest.raises(ValueError, match="autotune decides when to compress: use one of them"):
        model.reducer.set_config(hc.parse_spec("onebit,ef=vanilla"))
    callback = hvdc_keras.CompressionScheduleCallback(start_step=1)
    callback.set_model(SimpleNamespace(optimizer=SimpleNamespace(_hvdc_reducer=model.reducer)))
    with pytest.raises(ValueError, match="CompressionScheduleCallback and the spec's autotune"):
        callback.on_train_begin()


def all_op_types(graph) -> set:
    """The op types of a graph and of every function it calls (cond branches included)."""
    gdef = graph.as_graph_def()
    return ({n.op for n in gdef.node}
            | {n.op for f in gdef.library.function for n in f.node_def})


# Our kernels that compress, send or decode a payload, as opposed to the spec's momentum
# (HvdcHeavyBall, HvdcNesterov), the finite check and the codec clock.
CODEC_OPS = ("HvdcEncode", "HvdcEfEncode", "HvdcDecode", "HvdcAggregate", "HvdcHomo",
             "HvdcPowersgd", "HvdcEfSettle")


def expected_traces(probes: int, slow: str, steps: int) -> list:
    """Reducer.next_trace's answers over `steps` steps of the probe and after it."""
    from hvd_compress.autotune import WARMUP, compressed_arm
    settled = "uncompressed" if slow == "compressed" else "compressing"
    return [settled if s >= WARMUP + 2 * probes
            else "compressing" if compressed_arm(s - WARMUP) else "probe-uncompressed"
            for s in range(steps)]


@pytest.mark.parametrize("slow", ["compressed", "uncompressed"])
@pytest.mark.parametrize("spec", ["onebit,ef=vanilla", "topk,k=0.05,ef=vanilla,momentum=nesterov"])
def test_each_arm_runs_its_own_trace_and_uncompressed_ones_hold_only_horovods_allreduces(
        spec, slow, monkeypatch):
    """A step function traced per next_trace() answer, as AutotuneCallback keeps them: the
    probe's uncompressed steps run a trace that holds the probe (its decision's allreduce)
    and, of the reduction, only each gradient's allreduce (after the spec's momentum, which
    keeps its count of stepping ranks); once settled on uncompressed steps, a trace without
    the probe, and without any cond where the spec keeps no momentum. Results and state are
    as with one trace: the simulated arms, residuals untouched by uncompressed steps."""
    from hvd_compress.autotune import WARMUP
    probes = 1
    model = Model(f"{spec},autotune={probes}", graph=True)
    slower_arm_clock(model.reducer.autotune, slow)
    oracle = bucket_oracle.BucketOracle(spec, WORLD)
    functions, graphs, sent = {}, {}, record_allreduces(monkeypatch)
    inputs = [tf.TensorSpec(shape) for shape in SHAPES.values()]
    steps = WARMUP + 2 * probes + 2
    traces = []
    for step in range(steps):
        trace = model.reducer.next_trace()
        traces.append(trace)
        if trace not in functions:
            functions[trace] = tf.function(lambda gs: model.reducer.reduce(gs, model.vars))
            sent.clear()
            graphs[trace] = (functions[trace].get_concrete_function(inputs).graph,
                             sorted(name for name, _ in sent))
        grads = bucket_oracle.step_grads(step, WORLD)
        arm = trace == "compressing"
        before = model.reducer.state_dict()
        got = {name: g.numpy() for name, g in zip(SHAPES, functions[trace](
            [tf.constant(grads[name][RANK]) for name in SHAPES]))}
        oracle.check(got, oracle(grads, compressing=arm), f"step {step}: {trace}")
        if not arm:
            after = model.reducer.state_dict()
            for name, kinds in before["slots"].items():
                if "ef" in kinds:
                    assert same_bits(after["slots"][name]["ef"], kinds["ef"]), (step, name)
    assert traces == expected_traces(probes, slow, steps), traces
    assert model.reducer.compression_report()["autotune"]["compress"] is (slow == "uncompressed")
    momentum = spec_momentum(hc.parse_spec(spec)) is not None
    for trace, (graph, names) in graphs.items():
        if trace == "compressing":
            continue
        assert names == sorted([f"hvdc.{name}.plain" for name in SHAPES]
                               + ["hvdc.stepping_ranks"] * (momentum or trace != "uncompressed")
                               + ["hvd_compress.autotune"] * (trace != "uncompressed")), \
            (trace, names)
        types = all_op_types(graph)
        assert not [t for t in types if t.startswith(CODEC_OPS)], (trace, types)
        assert not {"HorovodAllgather", "HorovodAlltoall"} & types, (trace, types)
        if trace == "uncompressed" and not momentum:
            assert not {"If", "StatelessIf"} & types, types


def test_without_autotune_or_with_its_decision_read_every_step_compresses_in_one_trace():
    """Without autotune next_trace() reads nothing and always answers "compressing"; with
    per_arm=False (a call that runs several steps) it answers so until autotune has decided."""
    from hvd_compress.autotune import WARMUP
    model = Model("onebit,ef=vanilla")
    assert [model.reducer.next_trace() for _ in range(3)] == ["compressing"] * 3
    probes = 1
    model = Model(f"onebit,ef=vanilla,autotune={probes}")
    slower_arm_clock(model.reducer.autotune, "compressed")
    traces = []
    for step in range(WARMUP + 2 * probes + 1):
        traces.append(model.reducer.next_trace(per_arm=False))
        model.reduce(bucket_oracle.step_grads(step, WORLD))
    assert traces == ["compressing"] * (WARMUP + 2 * probes) + ["uncompressed"], traces


def keras_sgd_run(spec: str, steps: int, handoff: bool = True):
    """`steps` of a Keras SGD (momentum 0.9, which the spec's replaces) wrapped by our optimizer
    with `spec` and autotune=1 settling on uncompressed steps, each step in the trace
    next_trace() names. handoff=False: the spec keeps its own momentum after settling."""
    variables = [tf.Variable(tf.zeros(shape), name=name) for name, shape in SHAPES.items()]
    with pytest.warns(UserWarning, match="replaces the optimizer's own momentum"):
        opt = hvdc_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9),
                                              compression=f"{spec},autotune=1",
                                              min_compress_bytes=0, bucket_mb=BUCKET_MB)
    reducer = opt._hvdc_reducer
    assert reducer.handoff is not None
    if not handoff:
        reducer.handoff = None
    slower_arm_clock(reducer.autotune, "compressed")

    def train(gs):
        with tf.GradientTape() as tape:  # whose gradients are gs, exactly
            loss = tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, gs)])
        opt.apply_gradients(opt.compute_gradients(loss, variables, tape=tape))
    functions = {}
    for step in range(steps):
        trace = reducer.next_trace()
        if trace not in functions:
            functions[trace] = tf.function(train)
        grads = bucket_oracle.step_grads(step, WORLD)
        functions[trace]([tf.constant(grads[name][RANK]) for name in SHAPES])
    return variables, opt, functions


@pytest.mark.parametrize("spec", ["dgc,k=0.05", "topk,k=0.05,ef=vanilla,momentum=nesterov"])
def test_settled_uncompressed_steps_leave_the_spec_momentum_to_keras_sgd(spec):
    """Once autotune settles on uncompressed steps, the optimizer's own momentum (Keras' SGD,
    Nesterov's for momentum=nesterov) takes over from the spec's: its slots get the reduced
    velocity times -lr, and the settled trace is Horovod's (allreduces, no momentum kernel, no
    finite check, no count of stepping ranks). The weights follow the run that keeps the
    spec's momentum, and the velocity read back is the mean of that run's velocities."""
    from hvd_compress.autotune import WARMUP
    steps = WARMUP + 2 + 3
    moved, opt, functions = keras_sgd_run(spec, steps)
    kept, kept_opt, kept_functions = keras_sgd_run(spec, steps, handoff=False)
    assert opt.momentum == 0.9 and opt.nesterov is ("nesterov" in spec), (opt.momentum,
                                                                           opt.nesterov)
    assert kept_opt.momentum == 0.0
    # Both forms round differently, and sums cancel in places: float32 rounding of the
    # largest element bounds the difference.
    for a, b in zip(moved, kept):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5,
                                   atol=1e-5 * np.abs(b.numpy()).max(),
                                   err_msg=f"{spec}: {a.name}")
    slot = spec_momentum(hc.parse_spec(spec))[2]
    got, want = opt.compression_state_dict(), kept_opt.compression_state_dict()
    for name in SHAPES:
        mean = hvd.allreduce(tf.constant(want["slots"][name][slot]), op=hvd.Average,
                             name=f"handoff_test.{name}").numpy()
        np.testing.assert_allclose(got["slots"][name][slot], mean, rtol=1e-5,
                                   atol=1e-5 * np.abs(mean).max(),
                                   err_msg=f"{spec}: velocity of {name}")
    inputs = [tf.TensorSpec(shape) for shape in SHAPES.values()]
    graph = functions["uncompressed"].get_concrete_function(inputs).graph
    types = all_op_types(graph)
    assert not {"HvdcHeavyBall", "HvdcNesterov", "HvdcAllFinite", "If",
                "StatelessIf"} & types, types
    assert not [t for t in types if t.startswith(CODEC_OPS)], types

    def counts(g):
        return [n.name for n in g.as_graph_def().node if "stepping_ranks" in n.name]
    assert not counts(graph) and counts(kept_functions["uncompressed"].get_concrete_function(
        inputs).graph), "the count of stepping ranks goes with the spec's momentum"


def test_a_trace_made_for_the_other_side_of_the_momentum_hand_over_stops_with_an_error():
    """After the hand-over only the uncompressed trace may run (the others apply the spec's
    momentum); after a state is loaded the momentum is the spec's again until the next
    next_trace() hands it over, and the uncompressed trace may not run."""
    from hvd_compress.autotune import WARMUP
    variables, opt, functions = keras_sgd_run("dgc,k=0.05", WARMUP + 3)
    grads = [tf.constant(bucket_oracle.step_grads(0, WORLD)[name][RANK]) for name in SHAPES]
    with pytest.raises(tf.errors.InvalidArgumentError, match="momentum hand-over"):
        functions["compressing"](grads)
    reducer = opt._hvdc_reducer
    reducer.load_state_dict(reducer.state_dict())
    assert opt.momentum == 0.0
    with pytest.raises(tf.errors.InvalidArgumentError, match="Reducer.next_trace"):
        functions["uncompressed"](grads)
    assert reducer.next_trace() == "uncompressed" and opt.momentum == 0.9
    functions["uncompressed"](grads)


@pytest.mark.parametrize("slow", ["compressed", "uncompressed"])
@pytest.mark.parametrize("spec,momentum", [("onebit,ef=vanilla", 0.0), ("dgc,k=0.05", 0.9)])
def test_keras_autotune_callback_runs_each_batch_in_its_arms_trace(slow, spec, momentum):
    """model.fit with AutotuneCallback: each batch runs the train function of its trace, each
    made once; every rank ends with the same weights (DGC: also once the optimizer has taken
    over the momentum)."""
    from hvd_compress.autotune import WARMUP
    probes = 1
    tf.keras.utils.set_random_seed(0)  # the same starting weights on every rank
    model = tf.keras.Sequential([tf.keras.layers.Dense(16, activation="tanh", input_shape=(8,)),
                                 tf.keras.layers.Dense(1)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DGC's: it replaces the optimizer's momentum
        opt = hvdc_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=momentum),
                                              compression=f"{spec},autotune={probes}",
                                              min_compress_bytes=0)
    model.compile(optimizer=opt, loss="mse")
    slower_arm_clock(opt._hvdc_reducer.autotune, slow)
    functions = []
    seen = tf.keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda b, logs: functions.append(model.train_function))
    batches = WARMUP + 2 * probes + 3
    x = np.random.RandomState(RANK).normal(size=(4 * batches, 8)).astype(np.float32)
    y = x.sum(1, keepdims=True)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvdc_keras.AutotuneCallback(), seen])
    assert len(functions) == batches, len(functions)
    traces, by_function = expected_traces(probes, slow, batches), {}
    for b, (function, trace) in enumerate(zip(functions, traces)):
        assert by_function.setdefault(trace, function) is function, (b, trace)
    assert len({id(f) for f in by_function.values()}) == len(by_function), by_function
    assert opt.compression_report()["autotune"]["compress"] is (slow == "uncompressed")
    assert opt.momentum == (momentum if slow == "compressed" else 0.0), opt.momentum
    flat = tf.concat([tf.reshape(w, [-1]) for w in model.trainable_weights], 0)
    gathered = hvd.allgather(tf.expand_dims(flat, 0), name="autotune_callback.weights")
    assert all(np.array_equal(gathered[0].numpy(), g.numpy()) for g in gathered), "ranks diverged"


def test_the_autotune_callback_needs_autotune_in_the_spec():
    from types import SimpleNamespace
    model = Model("onebit,ef=vanilla")
    callback = hvdc_keras.AutotuneCallback()
    callback.set_model(SimpleNamespace(optimizer=SimpleNamespace(_hvdc_reducer=model.reducer)))
    with pytest.raises(ValueError, match="AutotuneCallback needs autotune=K in the compression "
                                         "spec, got onebit,"):
        callback.on_train_begin()
