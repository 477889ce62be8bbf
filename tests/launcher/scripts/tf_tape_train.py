"""A Horovod TensorFlow 2 GradientTape script written as Horovod's examples are (no hvd_compress
import): the launcher tests run it as it is, through `python -m hvd_compress`, through
HVD_COMPRESSION, and edited by hand to use hvd_compress's tape."""
import argparse
import json
import sys

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--fp16-allreduce", action="store_true")
parser.add_argument("--out", required=True, help="rank 0 writes the trained weights here (JSON)")
parser.add_argument("--exit-code", type=int, default=0)
args = parser.parse_args()
print("script started", flush=True)

hvd.init()
tf.keras.utils.set_random_seed(42)
model = tf.keras.Sequential([tf.keras.layers.Dense(512, activation="relu", input_shape=(64,)),
                             tf.keras.layers.Dense(10)])
loss_fn = tf.losses.SparseCategoricalCrossentropy(from_logits=True)
opt = tf.optimizers.SGD(0.05 * hvd.size())
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none


@tf.function
def training_step(images, labels, first_batch):
    with tf.GradientTape() as tape:
        loss = loss_fn(labels, model(images, training=True))
    tape = hvd.DistributedGradientTape(tape, compression=compression)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)
    return loss


rng = np.random.default_rng(1000 + hvd.rank())
images = rng.standard_normal((32, 64), dtype=np.float32)
labels = rng.integers(0, 10, 32)
losses = [float(training_step(images, labels, step == 0)) for step in range(args.steps)]

if hvd.rank() == 0:
    with open(args.out, "w") as f:
        json.dump({"argv": sys.argv, "name": __name__, "losses": losses,
                   "optimizer": hvd.DistributedGradientTape.__module__,
                   "hvd_compress_loaded": "hvd_compress" in sys.modules,
                   "weights": {v.name: v.numpy().astype(np.float64).flatten().tolist()
                               for v in model.variables}}, f)
sys.exit(args.exit_code)
