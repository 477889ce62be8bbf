"""torch_elastic_train.py's job with a Keras model: the same hosts, the same kill (or removal)
at step KILL_AT and slot added back at step GROW_AT, the same dumps to
OUT/<event>_<world>_<rank>.npz, the state kept by hvd_compress.tensorflow.elastic. LOOP (the
third argument) is how it trains:

    fit   model.fit with our Keras DistributedOptimizer, in hvdc_elastic.KerasState; a callback
          does at each batch's end what the torch loop does after its step;
    tape  a custom loop, a tf.function made in each call of train() that reduces with our
          DistributedGradientTape, in hvdc_elastic.TensorFlowKerasState(compressed=tape).
"""
import os
import sys

import horovod.tensorflow.keras as hvd
import numpy as np
import tensorflow as tf

import hvd_compress.tensorflow as hvdc
import hvd_compress.tensorflow.elastic as hvdc_elastic
import hvd_compress.tensorflow.keras as hvdk
from elastic_job import STEPS, after_step

OUT, SPEC, LOOP = sys.argv[1], sys.argv[2], sys.argv[3]

hvd.init()
tf.keras.utils.set_random_seed(0)
model = tf.keras.Sequential([tf.keras.Input((16,)), tf.keras.layers.Dense(32, "tanh"),
                             tf.keras.layers.Dense(4)])
if LOOP == "fit":
    optimizer = hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(0.05), compression=SPEC,
                                          min_compress_bytes=0)
    model.compile(optimizer=optimizer, loss="mse")
    compressed = optimizer
else:
    optimizer = tf.keras.optimizers.SGD(0.05)
    # Any tape made with these arguments shares the reducer of those the step makes.
    compressed = hvdc.DistributedGradientTape(tf.GradientTape(), compression=SPEC,
                                              min_compress_bytes=0)
# Keras makes the optimizer's slots at its first step: a joining worker must hold them already
# for the sync's broadcast of optimizer.variables() to match rank 0's.
optimizer.build(model.trainable_variables)


def dump(event, loss=float("nan")):
    state = compressed.compression_state_dict()
    arrays = {f"w/{v.name}": v.numpy() for v in model.variables}
    arrays.update({f"s/{n}/{k}": a for n, kinds in state["slots"].items()
                   for k, a in kinds.items()})
    arrays.update({f"c/{n}": np.int64(c) for n, c in state["steps"].items()})
    np.savez(os.path.join(OUT, f"{event}_{hvd.size()}_{hvd.rank()}.npz"), loss=loss, **arrays)


def batches(start):
    """Each rank's own batch for every step from `start`, the same whatever the world."""
    draws = [np.random.RandomState(1000 * step + hvd.rank()) for step in range(start, STEPS)]
    x = np.concatenate([g.randn(8, 16) for g in draws]).astype(np.float32)
    y = np.concatenate([g.randn(8, 4) for g in draws]).astype(np.float32)
    return x, y


class AfterStep(tf.keras.callbacks.Callback):
    def __init__(self, state):
        super().__init__()
        self.state = state
        self.loss = None

    def on_train_batch_end(self, batch, logs=None):
        self.loss = logs["loss"]
        after_step(self.state, dump, hvd.size)


def fit(state, x, y):
    callback = AfterStep(state)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    return callback.loss


def tape_loop(state, x, y):
    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        tape = hvdc.DistributedGradientTape(tape, compression=SPEC, min_compress_bytes=0)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    loss = None
    for i in range(0, len(x), 8):
        loss = float(step(x[i:i + 8], y[i:i + 8]))
        after_step(state, dump, hvd.size)
    return loss


@hvd.elastic.run
def train(state):
    dump(f"sync{state.step}")
    return (fit if LOOP == "fit" else tape_loop)(state, *batches(state.step))


if LOOP == "fit":
    state = hvdc_elastic.KerasState(model, step=0)
else:
    state = hvdc_elastic.TensorFlowKerasState(model, optimizer, compressed=compressed, step=0)
loss = train(state)
dump("end", loss)
