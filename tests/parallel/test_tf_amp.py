"""Mixed precision in Keras at two ranks (`make test`: under horovodrun --gloo, each test once under
mpirun): Keras' LossScaleOptimizer around our DistributedOptimizer in model.fit, with an overflow
on one rank. The twin of test_torch_amp.py: the loss scales are powers of two, so a run under a
changing scale must equal, bit for bit, a run whose scale stays at 2 until the overflow halves it
(Keras' floor: 1), if and only if the compression state follows the scale."""
from __future__ import annotations

import horovod.tensorflow.keras as hvd
import numpy as np
import pytest
import tensorflow as tf

from helpers import same_bits, two_rank_marker
import hvd_compress.tensorflow.keras as hvdk

hvd.init()
WORLD, RANK = hvd.size(), hvd.rank()
pytestmark = two_rank_marker(WORLD)

SPECS = ["onebit,ef=vanilla", "topk,k=0.05,ef=vanilla", "efsignsgd",
         "onebit,ef=vanilla,momentum=nesterov,mu=0.9",
         "topk,k=0.05,ef=vanilla,collective=allreduce", "dgc,k=0.05",
         "powersgd,rank=2,start_iter=1"]
BAD_BATCH, BATCH = 3, 16


def data(batches, rank=RANK, overflow=True):
    rng = np.random.default_rng(100 + rank)
    x = rng.standard_normal((batches * BATCH, 16)).astype(np.float32)
    y = np.tanh(x.sum(1, keepdims=True) / 4).astype(np.float32)
    if overflow and rank == 1:  # inf in, NaN gradients out: on rank 1 only
        x[BAD_BATCH * BATCH, 0] = np.inf
    return x, y


def fit(spec, batches, initial_scale, growth, track=True, overflow=True, lr=0.1):
    """model.fit under a dynamic loss scale; returns (model, reducer, scales after each batch)."""
    tf.keras.utils.set_random_seed(0)
    # named layers: both runs' state has the same keys
    model = tf.keras.Sequential([tf.keras.layers.Dense(32, activation="tanh", input_shape=(16,),
                                                       name="hidden"),
                                 tf.keras.layers.Dense(1, name="out")])
    opt = hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(lr), compression=spec,
                                    min_compress_bytes=0)
    wrap = hvdk.LossScaleOptimizer if track else tf.keras.mixed_precision.LossScaleOptimizer
    lso = wrap(opt, initial_scale=initial_scale, dynamic_growth_steps=growth)
    model.compile(optimizer=lso, loss="mse")
    scales = []
    seen = tf.keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: scales.append(float(lso.loss_scale)))
    x, y = data(batches, overflow=overflow)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), seen])
    return model, opt._hvdc_reducer, scales


def unscaled_state(reducer):
    state = reducer.state_dict()
    return {name: {kind: arr / state["loss_scale"] for kind, arr in kinds.items()}
            for name, kinds in state["slots"].items()}


@pytest.mark.parametrize("spec", SPECS)
def test_loss_scaling_is_invisible_to_the_compression_state(spec):
    batches = 8
    model, reducer, scales = fit(spec, batches, 2.0 ** 10, growth=2)
    assert scales[BAD_BATCH] == scales[BAD_BATCH - 1] / 2  # the overflow: skipped, halved
    assert max(scales) > 2.0 ** 10
    # the twin's scale is 2 until the overflow halves it to 1
    twin, twin_reducer, twin_scales = fit(spec, batches, 2.0, growth=10 ** 6)
    assert twin_scales[-1] == 1.0
    for a, b in zip(model.get_weights(), twin.get_weights()):
        assert np.isfinite(a).all() and same_bits(a, b)
    got, want = unscaled_state(reducer), unscaled_state(twin_reducer)
    assert got.keys() == want.keys()
    for name, kinds in want.items():
        assert got[name].keys() == kinds.keys()
        for kind, arr in kinds.items():
            assert same_bits(got[name][kind], arr), (name, kind)


def test_keras_own_loss_scale_optimizer_leaves_the_state_in_other_units():
    """Keras' class around our optimizer, the scale not tracked: the weights part from the
    twin's (what hvdk.LossScaleOptimizer prevents)."""
    model, _, _ = fit("onebit,ef=vanilla", 8, 2.0 ** 10, growth=2, track=False)
    twin, _, _ = fit("onebit,ef=vanilla", 8, 2.0, growth=10 ** 6, track=False)
    assert not all(np.array_equal(a, b) for a, b in zip(model.get_weights(), twin.get_weights()))


@pytest.mark.parametrize("spec", ["onebit,ef=vanilla", "topk,k=0.05,ef=vanilla"])
def test_an_overflow_costs_one_step_and_training_goes_on(spec):
    batches = 120
    model, _, scales = fit(spec, batches, 2.0 ** 10, growth=10)
    halvings = [i for i in range(1, batches) if scales[i] < scales[i - 1]]
    assert halvings == [BAD_BATCH]
    clean, _, clean_scales = fit(spec, batches, 2.0 ** 10, growth=10, overflow=False)
    assert all(b >= a for a, b in zip(clean_scales, clean_scales[1:]))
    x, y = data(8, rank=99, overflow=False)  # held-out batches
    loss = float(tf.reduce_mean((model(x) - y) ** 2))
    ref = float(tf.reduce_mean((clean(x) - y) ** 2))
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert abs(loss - ref) <= 0.02 * ref, (loss, ref)


def test_loss_scale_optimizer_needs_our_optimizer():
    with pytest.raises(ValueError, match="LossScaleOptimizer wraps an optimizer made by "
                                         "hvd_compress.tensorflow.keras.DistributedOptimizer"):
        hvdk.LossScaleOptimizer(tf.keras.optimizers.SGD(0.1))
