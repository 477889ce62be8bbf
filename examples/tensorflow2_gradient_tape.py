"""A custom TF2 training loop: Horovod's DistributedGradientTape pattern with compression.

    mpirun -np 2 python examples/tensorflow2_gradient_tape.py --compression efsignsgd
"""
import argparse

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import hvd_compress.tensorflow as hvdt

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--compression", default="topk,k=0.05,ef=vanilla")
parser.add_argument("--steps", type=int, default=300)
args = parser.parse_args()

hvd.init()
tf.keras.utils.set_random_seed(1234)
digits = load_digits()
x = (digits.data / 16.0).astype("float32")[hvd.rank()::hvd.size()]
y = digits.target.astype("int64")[hvd.rank()::hvd.size()]

model = tf.keras.Sequential([tf.keras.layers.Dense(128, activation="relu", input_shape=(64,)),
                             tf.keras.layers.Dense(10)])
opt = tf.keras.optimizers.SGD(0.05)
loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@tf.function
def train_step(xb, yb, first_batch):
    with tf.GradientTape() as tape:
        loss = loss_fn(yb, model(xb, training=True))
    tape = hvdt.DistributedGradientTape(tape, compression=args.compression,
                                        min_compress_bytes=0)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    if first_batch:  # after the first step, when the optimizer's variables exist
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables(), root_rank=0)
    return loss


rng = np.random.RandomState(hvd.rank())
for step in range(args.steps):
    idx = rng.randint(0, len(x), 32)
    loss = train_step(x[idx], y[idx], step == 0)
    if step % 50 == 0 and hvd.rank() == 0:
        print(f"step {step}: loss {float(loss):.4f}")

reducer = hvdt.reducer_for(args.compression, 0, hvd.Average, hvd.global_process_set)
stats = reducer.stats
if hvd.rank() == 0:
    raw = sum(t.raw_bytes for t in stats.tensors.values())
    sent = sum(t.sent_bytes for t in stats.tensors.values())
    print(f"{args.compression}: final loss {float(loss):.4f}; per step {raw:,} gradient bytes, "
          f"{sent:,} sent ({raw / sent:.1f}x less)")
