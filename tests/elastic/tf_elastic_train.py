"""torch_elastic_train.py's job with a Keras model, our Keras DistributedOptimizer and
hvd_compress.tensorflow.elastic.KerasState, trained by model.fit: the same hosts, the same
kill (or removal) at step KILL_AT and slot added back at step GROW_AT, the same dumps to
OUT/<event>_<world>_<rank>.npz. A callback does at each batch's end what the torch loop does
after its step.
"""
import os
import sys

import horovod.tensorflow.keras as hvd
import numpy as np
import tensorflow as tf

import hvd_compress.tensorflow.elastic as hvdc_elastic
import hvd_compress.tensorflow.keras as hvdk
from elastic_job import GROW_AT, KILL_AT, MODE, STEPS, wait_for_hosts, write_hosts

OUT, SPEC = sys.argv[1], sys.argv[2]

hvd.init()
tf.keras.utils.set_random_seed(0)
model = tf.keras.Sequential([tf.keras.Input((16,)), tf.keras.layers.Dense(32, "tanh"),
                             tf.keras.layers.Dense(4)])
optimizer = hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(0.05), compression=SPEC,
                                      min_compress_bytes=0)
model.compile(optimizer=optimizer, loss="mse")
# Keras makes the optimizer's slots at its first step: a joining worker must hold them already
# for the sync's broadcast of optimizer.variables() to match rank 0's.
optimizer.build(model.trainable_variables)


def dump(event, loss=float("nan")):
    state = optimizer.compression_state_dict()
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


class Elastic(tf.keras.callbacks.Callback):
    def __init__(self, state):
        super().__init__()
        self.state = state
        self.loss = None

    def on_train_batch_end(self, batch, logs=None):
        state = self.state
        self.loss = logs["loss"]
        state.step += 1
        if state.step == KILL_AT and os.environ.get("HOROVOD_HOSTNAME") == "127.0.0.1":
            write_hosts("localhost:1\n")
            if MODE == "kill":
                os._exit(17)
        if state.step == KILL_AT + 1:
            dump(f"step{state.step}")
        state.commit()
        if state.step == KILL_AT and MODE == "remove" and hvd.size() == 2:
            wait_for_hosts(state)
        if state.step == GROW_AT and hvd.size() == 1:
            write_hosts("localhost:2\n")
            wait_for_hosts(state)


@hvd.elastic.run
def train(state):
    dump(f"sync{state.step}")
    x, y = batches(state.step)
    elastic = Elastic(state)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[elastic])
    return elastic.loss


state = hvdc_elastic.KerasState(model, step=0)
loss = train(state)
dump("end", loss)
