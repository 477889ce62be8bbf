"""Two-rank tests of TF1 graph mode (eager execution disabled, sessions), run in full under
`horovodrun --gloo -np 2` and each test once under `mpirun -np 2`, in a process of their own:
disabling eager execution is for the whole process.

A script written like Horovod's `tensorflow_mnist.py` builds its train op once and runs it in a
session that initialises the global variables; the compression state must need nothing more."""
from __future__ import annotations

import horovod.tensorflow as hvd
import numpy as np
import pytest
import tensorflow as tf

from helpers import same_bits, two_rank_marker
from simulation import PowerSGDSimulation, Simulation, grads_for_step
import hvd_compress.tensorflow as hvdt

tf.compat.v1.disable_eager_execution()
hvd.init()
WORLD, RANK = hvd.size(), hvd.rank()
pytestmark = two_rank_marker(WORLD)
SPECS = ["none", "fp16", "onebit,ef=vanilla", "topk,k=0.01,ef=vanilla", "randomk,k=0.05",
         "minmax8", "dithering,ef=vanilla", "efsignsgd,momentum=nesterov,mu=0.9",
         "dgc,k=0.02,momentum_factor=0.6", "threshold,threshold=0.8,ef=vanilla"]
SHAPE, STEPS = (50, 60), 3  # 2-D: DGC leaves vectors (biases) uncompressed
N = SHAPE[0] * SHAPE[1]


def sgd_steps(make_optimizer, steps=STEPS, monitored=False):
    """The weights after each step of SGD(1.0) on loss = sum(w * g), g this rank's gradient of
    grads_for_step, so that each step subtracts the reduced gradient."""
    out = []
    with tf.Graph().as_default():
        w = tf.compat.v1.get_variable("w", SHAPE, initializer=tf.zeros_initializer())
        g = tf.compat.v1.placeholder(tf.float32, SHAPE)
        train = make_optimizer().minimize(tf.reduce_sum(w * g), var_list=[w])
        feed = [{g: grads_for_step(N, "float32", s, WORLD)[RANK].reshape(SHAPE)}
                for s in range(steps)]
        if monitored:  # as Horovod's examples: the hook broadcasts, the session initialises
            hooks = [hvd.BroadcastGlobalVariablesHook(0)]
            with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as session:
                for f in feed:
                    session.run(train, f)
                    out.append(session.run(w).reshape(-1))
        else:
            with tf.compat.v1.Session() as session:
                session.run(tf.compat.v1.global_variables_initializer())
                for f in feed:
                    session.run(train, f)
                    out.append(session.run(w).reshape(-1))
    return out


def ours(spec):
    return lambda: hvdt.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0),
                                             compression=spec, min_compress_bytes=0)


@pytest.mark.parametrize("monitored", [False, True], ids=["session", "monitored"])
@pytest.mark.parametrize("spec", SPECS)
def test_graph_optimizer_equals_simulation(spec, monitored):
    sim = Simulation(spec, N, "float32", WORLD, name="w")
    want = np.zeros(N, np.float32)
    for step, got in enumerate(sgd_steps(ours(spec), monitored=monitored)):
        want = want - sim(grads_for_step(N, "float32", step, WORLD))
        assert np.array_equal(got, want), f"step {step}"


@pytest.mark.parametrize("spec,tol", [("powersgd,rank=2,start_iter=1", 1e-4),
                                      ("powersgd,rank=1,start_iter=0,warm_start=false", 1e-4)])
def test_powersgd_in_a_graph_equals_simulation(spec, tol):
    """Both rounds, warm start, error feedback and start_iter in a session's graph: the
    eager/tf.function test's simulation (float64, so compared within a tolerance)."""
    shape = (40, 30)
    sim = PowerSGDSimulation(spec, "w", WORLD)
    rng = np.random.RandomState(7)
    with tf.Graph().as_default():
        w = tf.compat.v1.get_variable("w", shape, initializer=tf.zeros_initializer())
        g = tf.compat.v1.placeholder(tf.float32, shape)
        opt = hvdt.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0),
                                        compression=spec, min_compress_bytes=0)
        train = opt.minimize(tf.reduce_sum(w * g), var_list=[w])
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            before = session.run(w)
            for step in range(4):
                grads = [rng.standard_normal(shape) for _ in range(WORLD)]
                session.run(train, {g: grads[RANK].astype(np.float32)})
                after = session.run(w)
                np.testing.assert_allclose((before - after).astype(np.float64),
                                           sim(grads), rtol=tol, atol=tol, err_msg=f"step {step}")
                before = after


def test_spec_none_equals_horovods_own_optimizer_bit_for_bit():
    horovods = sgd_steps(lambda: hvd.DistributedOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(1.0)), monitored=True)
    for mine, theirs in zip(sgd_steps(ours("none"), monitored=True), horovods):
        assert same_bits(mine, theirs)


def test_ranks_that_disagree_get_an_error_in_a_graph():
    with tf.Graph().as_default():
        with pytest.raises(ValueError, match="ranks disagree on the compression spec"):
            hvdt.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0),
                                      compression="topk,k=0.01" if RANK else "onebit")


def test_keras_fit_in_a_graph_lowers_the_loss_alike_on_every_rank():
    import hvd_compress.tensorflow.keras as hvdk
    rng = np.random.RandomState(RANK)
    x = rng.standard_normal((256, 20)).astype(np.float32)
    y = (x[:, :10].sum(1) > 0).astype(np.int64)
    with tf.Graph().as_default():
        model = tf.keras.Sequential([tf.keras.layers.Dense(64, activation="relu",
                                                           input_shape=(20,)),
                                     tf.keras.layers.Dense(2)])
        opt = hvdk.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.3),
                                        compression="topk,k=0.05,ef=vanilla",
                                        min_compress_bytes=0)
        model.compile(opt, tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        # both ranks start alike (Horovod's broadcast callback calls
        # keras.backend.get_session, which Keras 2.15 no longer has)
        start = np.random.RandomState(0)
        model.set_weights([0.1 * start.standard_normal(v.shape).astype(np.float32)
                           for v in model.get_weights()])
        history = model.fit(x, y, batch_size=32, epochs=10, verbose=0)
        weights = np.concatenate([v.reshape(-1) for v in model.get_weights()])
        everyone = tf.compat.v1.keras.backend.get_session().run(
            hvd.allgather(tf.constant(weights[None])))
        report = opt.compression_report()
    assert report["steps"] == 10 * 8 and report["ratio"] > 5
    assert report["tensors"]["dense/kernel"]["codec"] == "topk"
    losses = history.history["loss"]
    assert losses[-1] < 0.8 * losses[0]
    assert same_bits(everyone[0], everyone[1])


def test_saver_checkpoints_the_compression_state(tmp_path_factory):
    """The state is global variables: a Saver checkpoint taken after 2 steps, restored into a
    new graph and session, continues bit for bit as the uninterrupted run: the residual and
    momentum of steps 1 and 2 are in what step 3 sends."""
    spec = "topk,k=0.01,ef=vanilla,momentum=nesterov,mu=0.9"
    path = str(tmp_path_factory.mktemp(f"saver{RANK}") / "model")
    whole = sgd_steps(ours(spec))

    def graph():
        w = tf.compat.v1.get_variable("w", SHAPE, initializer=tf.zeros_initializer())
        g = tf.compat.v1.placeholder(tf.float32, SHAPE)
        return w, g, ours(spec)().minimize(tf.reduce_sum(w * g), var_list=[w])

    def feed(g, step):
        return {g: grads_for_step(N, "float32", step, WORLD)[RANK].reshape(SHAPE)}

    with tf.Graph().as_default():
        w, g, train = graph()
        saver = tf.compat.v1.train.Saver()
        assert len(tf.compat.v1.global_variables()) > 1  # w and our state
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            for step in range(2):
                session.run(train, feed(g, step))
            saver.save(session, path)
    with tf.Graph().as_default():
        w, g, train = graph()
        with tf.compat.v1.Session() as session:
            tf.compat.v1.train.Saver().restore(session, path)
            session.run(train, feed(g, 2))
            assert same_bits(session.run(w).reshape(-1), whole[2])
