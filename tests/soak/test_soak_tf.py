"""Memory soak, TensorFlow (Keras optimizer in a tf.function step), 2 ranks: the twin of
test_soak_torch.py."""
from __future__ import annotations

import horovod.tensorflow.keras as hvd
import pytest
import tensorflow as tf

from helpers import two_rank_marker
from soak import SPECS, STEPS, WARM, check_flat, resident_bytes
import hvd_compress.tensorflow.keras as hvdk

hvd.init()
pytestmark = [two_rank_marker(hvd.size()), pytest.mark.slow]


@pytest.mark.parametrize("spec", SPECS)
def test_resident_memory_stays_flat(spec):
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.layers.Dense(1024, input_shape=(1024,))])
    opt = hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(0.01), compression=spec,
                                    min_compress_bytes=0)
    g = tf.random.Generator.from_seed(hvd.rank())
    x, y = g.normal([16, 1024]), g.normal([16, 1024])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads_and_vars = opt.compute_gradients(loss, model.trainable_variables, tape=tape)
        opt.apply_gradients(grads_and_vars)

    step()
    for v in model.variables:
        v.assign(hvd.broadcast(v, root_rank=0))
    samples = [resident_bytes()]
    for _ in range(STEPS - 1):
        step()
        samples.append(resident_bytes())
    assert len(samples) > WARM
    assert all(bool(tf.reduce_all(tf.math.is_finite(v))) for v in model.variables)
    check_flat(samples, spec)
