"""Two-rank TensorFlow tests, run under both `mpirun -np 2` and `horovodrun --gloo -np 2`
(in their own process: Horovod's torch and TF libraries are not initialised side by side).

The aggregates are compared bit for bit with the same numpy simulation the torch tests use, so
TF and PyTorch deliver identical gradients for the same inputs."""
from __future__ import annotations

import os

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import join_specs, same_bits, tensorboard_scalars, two_rank_marker
from simulation import Simulation, grads_for_step
import hvd_compress.tensorflow as hvdt
import hvd_compress.tensorflow.keras as hvdk
from hvd_compress.tensorflow import Compression

# A set without rank 1: rank 1 must then keep its own gradients, as with Horovod.
FIRST = hvd.ProcessSet([0])
hvd.init(process_sets=[FIRST])
WORLD, RANK = hvd.size(), hvd.rank()
pytestmark = two_rank_marker(WORLD)
TF_DTYPES = {"float32": tf.float32, "float64": tf.float64}
CODECS = ["none", "fp16", "bf16", "onebit", "signsgd", "efsignsgd", "topk", "randomk",
          "minmax8", "dithering", "qsgd", "terngrad", "natural"]


def tape_step(var, g, spec, graph):
    def run(g):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(var * g)
        tape = hvdt.DistributedGradientTape(tape, compression=spec, min_compress_bytes=0)
        return tape.gradient(loss, [var])[0]
    return (tf.function(run) if graph else run)(g)


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("codec", CODECS)
def test_tape_aggregate_equals_simulation(codec, dtype, graph):
    n = 6007
    name = f"w_{codec}_{dtype}_{graph}"
    var = tf.Variable(tf.zeros([n], TF_DTYPES[dtype]), name=name)
    sim = Simulation(codec, n, dtype, WORLD, name=name)
    fn = None
    for step in range(3):
        grads = grads_for_step(n, dtype, step, WORLD)
        g = tf.constant(grads[RANK])
        if graph:
            fn = fn or tf.function(lambda g: tape_step(var, g, codec, graph=False))
            got = fn(g)
        else:
            got = tape_step(var, g, codec, graph=False)
        assert same_bits(np.asarray(got.numpy()), sim(grads)), f"step {step}"


@pytest.mark.parametrize("spec", ["topk,k=0.02,ef=vanilla", "onebit,ef=vanilla,momentum=nesterov",
                                  "randomk,k=0.1,ef=vanilla,seed=11", "efsignsgd"])
def test_tape_error_feedback_and_momentum_equal_simulation(spec):
    n = 4099
    var = tf.Variable(tf.zeros([n]), name="w")  # same name as the torch test: same seeds
    sim = Simulation(spec, n, "float32", WORLD)
    fn = tf.function(lambda g: tape_step(var, g, spec, graph=False))
    for step in range(4):
        grads = grads_for_step(n, "float32", step, WORLD)
        assert same_bits(fn(tf.constant(grads[RANK])).numpy(), sim(grads)), f"step {step}"


def digits_data():
    from sklearn.datasets import load_digits
    d = load_digits()
    x = (d.data / 16.0).astype("float32")
    y = d.target.astype("int64")
    order = np.random.RandomState(0).permutation(len(x))
    x, y = x[order], y[order]
    return (x[:1400][RANK::WORLD], y[:1400][RANK::WORLD]), (x[1400:], y[1400:])


def fit(spec, epochs=8, callbacks=(), start_epoch=0):
    tf.keras.utils.set_random_seed(1234)
    (xt, yt), (xv, yv) = digits_data()
    model = tf.keras.Sequential([tf.keras.layers.Dense(128, activation="relu", input_shape=(64,)),
                                 tf.keras.layers.Dense(128, activation="relu"),
                                 tf.keras.layers.Dense(10)])
    opt = hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(0.05), compression=spec,
                                    min_compress_bytes=0)
    model.compile(optimizer=opt,
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    cbs = [hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0),
           hvd_keras.callbacks.MetricAverageCallback(),
           hvdk.CompressionScheduleCallback(start_epoch=start_epoch), hvdk.CompressionStatsCallback(),
           *callbacks]
    history = model.fit(xt, yt, batch_size=32, epochs=epochs, callbacks=cbs, verbose=0,
                        shuffle=False)
    loss, _ = model.evaluate(xv, yv, verbose=0)
    return model, opt, history, loss


_baseline = {}


@pytest.mark.parametrize("spec", ["fp16", "bf16", "efsignsgd", "onebit,ef=vanilla",
                                  "signsgd,ef=vanilla", "topk,k=0.05,ef=vanilla",
                                  "randomk,k=0.05,ef=vanilla", "minmax8,ef=vanilla"])
def test_keras_fit_reaches_uncompressed_loss(spec):
    if "none" not in _baseline:
        _baseline["none"] = fit("none")[3]
    model, opt, history, loss = fit(spec, start_epoch=1)
    assert loss <= 1.10 * _baseline["none"], (spec, loss, _baseline["none"])
    flat = tf.concat([tf.reshape(w, [-1]) for w in model.trainable_weights], 0)
    gathered = hvd.allgather(tf.expand_dims(flat, 0), name="weights_check")
    assert np.array_equal(gathered[0].numpy(), gathered[1].numpy()), "ranks diverged"
    ratios = history.history["compression_ratio"]
    assert ratios[0] == 1.0 and ratios[-1] > 1.5  # plain for epoch 0, compressed after


def test_keras_stats_callback_writes_tensorboard_scalars_per_step(tmp_path_factory):
    logdir = os.path.join(str(tmp_path_factory.getbasetemp()), f"tb{RANK}")
    _, opt, history, _ = fit("onebit,ef=vanilla", epochs=2, start_epoch=1,
                             callbacks=[hvdk.CompressionStatsCallback(tensorboard=logdir)])
    if RANK != 0:
        assert not os.path.exists(logdir)
        return
    scalars = tensorboard_scalars(logdir)
    ratio = scalars["hvd_compress/ratio"]
    per_epoch = len(ratio) // 2
    assert [step for step, _ in ratio] == list(range(1, 2 * per_epoch + 1)) and per_epoch >= 10
    # Epoch 0 runs uncompressed (the schedule), epoch 1 at the codec's ratio.
    assert all(v == 1.0 for _, v in ratio[:per_epoch])
    # (TensorBoard keeps scalars as float32.)
    want = np.float32(history.history["compression_ratio"][1])
    assert want > 1.5 and all(v == want for _, v in ratio[per_epoch:])
    raw = [v for _, v in scalars["hvd_compress/raw_bytes"]]
    sent = [v for _, v in scalars["hvd_compress/sent_bytes"]]
    assert raw == [history.history["compression_raw_bytes_per_step"][1]] * 2 * per_epoch
    assert sent[-1] == history.history["compression_sent_bytes_per_step"][1] < raw[-1]
    assert all(v >= 0 for _, v in scalars["hvd_compress/codec_ms"])
    assert sum(v for _, v in scalars["hvd_compress/codec_ms"][per_epoch:]) > 0
    report = opt.compression_report()
    assert report["steps"] == 2 * per_epoch and np.float32(report["ratio"]) == want


@pytest.mark.parametrize("argument, message", [
    ({"device_dense": "/gpu:0"}, "device_dense/device_sparse are not supported"),
    ({"num_groups": 2}, "groups/num_groups are not supported"),
    ({"gradient_predivide_factor": 2.0}, "gradient_predivide_factor is not supported"),
])
def test_horovod_arguments_we_cannot_honour_raise(argument, message):
    with tf.GradientTape() as tape:
        pass
    with pytest.raises(ValueError, match=message):
        hvdt.DistributedGradientTape(tape, compression="onebit", **argument)
    with pytest.raises(ValueError, match=message):
        hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression="onebit", **argument)


def test_tape_sparse_as_dense_compresses_embedding_gradients():
    table = tf.Variable(tf.reshape(tf.range(40000, dtype=tf.float32), [10000, 4]) * 0 + 1.0,
                        name="sparse_table")
    ids = tf.constant([RANK, 3, 7])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.gather(table, ids) * float(RANK + 1))
    tape = hvdt.DistributedGradientTape(tape, compression="fp16", sparse_as_dense=True,
                                        min_compress_bytes=0)
    got = tape.gradient(loss, [table])[0]
    assert isinstance(got, tf.Tensor)  # dense, so the codec (not a plain allgather) carried it
    assert tape.compression_stats.tensors["sparse_table"].codec == "fp16"
    want = np.zeros([10000, 4], np.float32)
    for r in range(WORLD):
        for i in (r, 3, 7):
            want[i] += (r + 1) / WORLD
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-3)


def test_keras_compression_checkpoint_saves_and_restores(tmp_path_factory):
    path = os.path.join(str(tmp_path_factory.getbasetemp()), "ckpt", "comp")
    _, opt, _, _ = fit("topk,k=0.05,ef=vanilla", epochs=2,
                       callbacks=[hvdk.CompressionCheckpointCallback(path)])
    saved = opt.compression_state_dict()
    assert os.path.exists(f"{path}.rank{RANK}.pkl")
    assert any(np.abs(kinds["ef"]).sum() > 0 for kinds in saved["slots"].values())
    # A new run restores it at train begin (0 epochs: nothing else changes it).
    _, opt2, _, _ = fit("topk,k=0.05,ef=vanilla", epochs=0,
                        callbacks=[hvdk.CompressionCheckpointCallback(path)])
    restored = opt2.compression_state_dict()
    assert restored["steps"] == saved["steps"]
    for name, kinds in saved["slots"].items():
        assert np.array_equal(restored["slots"][name]["ef"], kinds["ef"])


def test_stock_tape_with_linear_codec_and_refusal_of_allgather_codecs():
    var = tf.Variable(tf.zeros([5000]), name="stock_w")
    grads = grads_for_step(5000, "float32", 0, WORLD)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(var * tf.constant(grads[RANK]))
    got = hvd.DistributedGradientTape(tape, compression=Compression.fp16).gradient(loss, [var])[0]
    hs = [g.astype(np.float16).astype(np.float32) for g in grads]
    want = ((hs[0] + hs[1]).astype(np.float16).astype(np.float32) * np.float32(0.5))
    assert np.array_equal(got.numpy(), want.astype(np.float16).astype(np.float32))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(var * tf.constant(grads[RANK]))
    with pytest.raises(RuntimeError, match="topk payloads travel by allgather"):
        hvd.DistributedGradientTape(tape, compression=Compression.topk).gradient(loss, [var])


def test_ranks_with_different_specs_get_an_error():
    spec = "topk,k=0.01" if RANK == 0 else "onebit"
    with pytest.raises(ValueError, match="ranks disagree on the compression spec"):
        hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=spec)


def test_sparsity_warmup_schedule_switches_codec_parameters():
    warm = hvdk.CompressionScheduleCallback(warmup={0: "topk,k=0.25,ef=vanilla",
                                                    2: "topk,k=0.05,ef=vanilla"})
    _, opt, history, loss = fit("topk,k=0.25,ef=vanilla", epochs=4, callbacks=[warm])
    ratios = history.history["compression_ratio"]
    assert ratios[0] == ratios[1] < ratios[2] == ratios[3]
    assert opt._hvdc_reducer.config.param_dict["k"] == 0.05
    assert all(ms >= 0 for ms in history.history["compression_codec_ms"])
    assert np.isfinite(loss)


def test_tf1_style_optimizer_and_stock_keras_optimizer():
    n = 5000
    var = tf.Variable(tf.zeros([n]), name="v1_w")
    grads = grads_for_step(n, "float32", 0, WORLD)
    opt = hvdt.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0),
                                    compression="topk,k=0.01", min_compress_bytes=0)
    opt.minimize(lambda: tf.reduce_sum(var * tf.constant(grads[RANK])), var_list=[var])
    want = Simulation("topk,k=0.01", n, "float32", WORLD, name="v1_w")(grads)
    assert np.array_equal(var.numpy(), -want)  # by value: SGD turns untouched zeros into -0.0
    # Horovod's own Keras optimizer with one of our linear compressors
    stock = hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.05),
                                           compression=Compression.fp16)
    assert stock is not None


def _two_layer_model(seed):
    tf.keras.utils.set_random_seed(seed)
    model = tf.keras.Sequential([tf.keras.layers.Dense(8, input_shape=(4,), name="shared"),
                                 tf.keras.layers.Dense(3, name="mine")])
    x = tf.constant(np.random.RandomState(RANK).randn(5, 4).astype(np.float32))
    return model, x


@pytest.mark.parametrize("graph", [False, True])
def test_local_sources_and_partial_tape_match_horovods(graph):
    """register_local_source, get_local_and_global_gradients and PartialDistributedGradientTape
    give, with spec none, Horovod's own tapes' gradients bit for bit."""
    model, x = _two_layer_model(7)
    local = model.get_layer("mine")

    names = {}

    def grads(make):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x) ** 2)
        local_pairs, global_pairs = make(tape).get_local_and_global_gradients(
            loss, model.trainable_variables)
        names[make] = [v.name for v, _ in local_pairs + global_pairs]
        return [g for _, g in local_pairs], [g for _, g in global_pairs]

    def stock(tape):
        return hvd.PartialDistributedGradientTape(tape, local_layers=[local])

    def ours(tape):
        return hvdt.PartialDistributedGradientTape(tape, local_layers=local, compression="none",
                                                   min_compress_bytes=0)

    run = (lambda f: tf.function(lambda: grads(f))()) if graph else grads
    want, got = run(stock), run(ours)
    assert names[ours] == names[stock]
    assert names[ours][:2] == [v.name for v in local.trainable_weights]
    for name, w, g in zip(names[ours], want[0] + want[1], got[0] + got[1]):
        assert np.array_equal(w.numpy(), g.numpy()), name
    # The local gradients are this rank's own (divided by the size), so they differ by rank.
    mine = hvd.allgather(tf.reshape(got[0][0], [1, -1]), name=f"local_grads{graph}")
    assert not np.array_equal(mine[0].numpy(), mine[1].numpy())


def test_eager_tape_over_watched_tensors():
    """Sources that are tensors, not variables, have no name in eager mode: they are known by
    position (as with use_generic_names), compressed and reduced like variables."""
    x = tf.constant(np.arange(40000, dtype=np.float32) * (RANK + 1) / 40000)
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(x * x)
    got = hvdt.DistributedGradientTape(tape, compression="fp16", min_compress_bytes=0)
    reduced = got.gradient(loss, [x])[0]
    want = sum(2 * np.arange(40000, dtype=np.float32) * (r + 1) / 40000 for r in range(WORLD))
    np.testing.assert_allclose(reduced.numpy(), want / WORLD, rtol=2e-3)
    assert got.compression_stats.tensors["source_0"].codec == "fp16"


# ---- a skipped step leaves no trace in the compression state --------------------------------
TF_STATEFUL = ["onebit,ef=vanilla", "signsgd,ef=vanilla", "efsignsgd", "topk,k=0.01,ef=vanilla",
               "randomk,k=0.01,ef=vanilla", "fp16,ef=vanilla", "minmax8,ef=vanilla",
               "dithering,ef=vanilla", "onebit,ef=vanilla,momentum=nesterov,mu=0.9",
               "signsgd,momentum=nesterov,mu=0.5", "onebit,ef=vanilla,collective=allreduce",
               "topk,k=0.05,ef=vanilla,collective=allreduce",
               "minmax8,ef=vanilla,collective=allreduce", "fp16,ef=vanilla,collective=allreduce"]


def tf_skip_probe(spec, graph, bad_step=None, value=np.nan, left_out=None, steps=6):
    """The small MLP, its gradients reduced as DistributedGradientTape and the Keras optimizer
    reduce them (a reducer of its own per run, so two runs share no state), the step applied
    only when every reduced gradient is finite (LossScaleOptimizer's rule). bad_step: rank 1's
    first-layer gradient gets `value` in one element; left_out: that batch is never run.
    Returns (variables, reducer, skipped)."""
    import hvd_compress as hc
    rng = np.random.default_rng(0)
    shapes = {"w1": (32, 64), "b1": (64,), "w2": (64, 1), "b2": (1,)}
    vs = [tf.Variable((rng.standard_normal(s) * 0.3).astype("float32"), name=f"probe/{k}")
          for k, s in shapes.items()]
    reducer = hvdt.Reducer(hc.parse_spec(spec), 0, hvd.Average, hvd.global_process_set)

    def step(x, y, poison):
        w1, b1, w2, b2 = vs
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((tf.tanh(x @ w1 + b1) @ w2 + b2 - y) ** 2)
        grads = tape.gradient(loss, vs)
        reduced = reducer.reduce([grads[0] + poison] + grads[1:], vs)
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in reduced])

        def apply():
            for v, g in zip(vs, reduced):
                v.assign_sub(0.05 * g)
            return tf.constant(True)

        return tf.cond(finite, apply, lambda: tf.constant(False))

    run = tf.function(step) if graph else step
    skipped = []
    for i in range(steps):
        if i == left_out:
            continue
        data = np.random.default_rng(1000 * i + RANK)
        x = data.standard_normal((32, 32)).astype("float32")
        y = np.tanh(x[:, :1]).astype("float32")
        poison = np.zeros((32, 64), "float32")
        if i == bad_step and RANK == 1:
            poison.flat[5] = value
        if not bool(run(tf.constant(x), tf.constant(y), tf.constant(poison))):
            skipped.append(i)
    return vs, reducer, skipped


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("spec", TF_STATEFUL)
def test_non_finite_step_is_skipped_once_and_leaves_no_trace(spec, value, graph):
    vs, reducer, skipped = tf_skip_probe(spec, graph, bad_step=3, value=value)
    assert skipped == [3]
    flat = tf.concat([tf.reshape(v, [-1]) for v in vs], 0)
    assert bool(tf.reduce_all(tf.math.is_finite(flat)))
    gathered = hvd.allgather(tf.expand_dims(flat, 0), name="probe_weights")
    assert np.array_equal(gathered[0].numpy(), gathered[1].numpy())
    vs_b, reducer_b, skipped_b = tf_skip_probe(spec, graph, left_out=3)
    assert skipped_b == []
    for a, b in zip(vs, vs_b):
        assert same_bits(a.numpy(), b.numpy())
    got, want = reducer.state_dict(), reducer_b.state_dict()
    if "collective=allreduce" in spec:  # the owner residuals are part of what is compared
        assert any(k.startswith("owner_ef[") for kinds in want["slots"].values() for k in kinds)
    assert got["steps"] == want["steps"] and got["slots"].keys() == want["slots"].keys()
    for name, kinds in want["slots"].items():
        assert got["slots"][name].keys() == kinds.keys()
        for kind, arr in kinds.items():
            assert same_bits(got["slots"][name][kind], arr), (name, kind)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "function"])
@pytest.mark.parametrize("spec", ["randomk,k=0.01", "topk,k=0.001",
                                  "topk,k=0.001,collective=allreduce"])
def test_sparse_codecs_show_a_non_finite_element_on_every_rank(spec, graph):
    n = 6000
    var = tf.Variable(tf.zeros([n]), name=f"vis_{spec}_{graph}")
    g = grads_for_step(n, "float32", 0, WORLD)[RANK] * np.float32(1e-3)
    if RANK == 1:
        g[4321] = np.nan
    fn = tf.function(lambda g: tape_step(var, g, spec, graph=False)) if graph else (
        lambda g: tape_step(var, g, spec, graph=False))
    assert not bool(tf.reduce_all(tf.math.is_finite(fn(tf.constant(g)))))


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("spec", ["none", "onebit,ef=vanilla"])
def test_a_rank_outside_the_process_set_keeps_its_own_gradient(spec, graph):
    model, x = _two_layer_model(5)

    def grads(make):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x) ** 2)
        return make(tape).gradient(loss, model.trainable_variables)

    run = (lambda f: tf.function(lambda: grads(f))()) if graph else grads
    want = run(lambda t: hvd.DistributedGradientTape(t, process_set=FIRST))
    got = run(lambda t: hvdt.DistributedGradientTape(t, compression=spec, process_set=FIRST,
                                                     min_compress_bytes=0))
    if RANK == 1 or spec == "none":
        assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(got, want))



def test_join_with_uneven_batches():
    """Rank 1 runs out of data after one step and joins; rank 0 takes two more steps alone.
    Those steps reduce as Horovod's own tape does under join (rank 1 adds zeros, the average
    divides by the set's size), and no rank's compression state moves, so that once both
    have joined they step together again and agree. Every codec under each of its strategies,
    eager and in a tf.function, shares one join: Horovod 0.28.1's TensorFlow join works once
    per process (a second one returns at once on the rank that joined first, plain
    hvd.allreduce included)."""
    import hvd_compress as hc
    lr, shape = np.float32(0.1), (20, 30)
    runs = []
    for spec in join_specs("tensorflow"):
        for graph in (False, True):
            var = tf.Variable(tf.zeros(shape), name=f"join/{len(runs)}")
            reducer = hvdt.Reducer(hc.parse_spec(spec), 0, hvd.Average, hvd.global_process_set)

            def step(x, var=var, reducer=reducer):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(var * x)
                var.assign_sub(lr * reducer.reduce(tape.gradient(loss, [var]), [var])[0])

            runs.append((f"{spec} {'function' if graph else 'eager'}", var, reducer,
                         tf.function(step) if graph else step))

    def batch(i):
        return np.random.default_rng(100 * i + RANK).standard_normal(shape).astype("float32")

    def step_all(i):
        for _, _, _, run in runs:
            run(tf.constant(batch(i)))

    step_all(0)
    before = [reducer.state_dict() for _, _, reducer, _ in runs]
    alone = [var.numpy() for _, var, _, _ in runs]
    if RANK == 0:
        for i in (1, 2):
            step_all(i)
            alone = [w - lr * (batch(i) * np.float32(0.5)) for w in alone]
        for (what, var, _, _), want in zip(runs, alone):
            assert np.array_equal(var.numpy(), want), what
    assert int(hvd.join()) == 0
    for (what, _, reducer, _), want in zip(runs, before):
        got = reducer.state_dict()
        assert got["steps"] == want["steps"], what
        assert got["slots"].keys() == want["slots"].keys(), what
        for name, kinds in want["slots"].items():
            assert got["slots"][name].keys() == kinds.keys(), what
            for kind, arr in kinds.items():
                assert same_bits(got["slots"][name][kind], arr), (what, name, kind)
    # Rank 1 missed rank 0's updates, as under Horovod's own tape: the weights are broadcast,
    # and the ranks' step counters must still agree.
    for _, var, _, _ in runs:
        var.assign(hvd.broadcast(var, 0, name="join.broadcast"))
    step_all(3)
    for what, var, _, _ in runs:
        rows = hvd.allgather(tf.reshape(var, [1, -1]), name="join.weights")
        assert np.array_equal(rows[0].numpy(), rows[1].numpy()), what
