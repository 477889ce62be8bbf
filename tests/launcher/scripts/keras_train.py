"""A Horovod Keras `model.fit` script written as Horovod's examples are (no hvd_compress import):
the launcher tests run it as it is, through `python -m hvd_compress`, through HVD_COMPRESSION,
and edited by hand to use hvd_compress's optimizer."""
import argparse
import json
import sys

import numpy as np
import tensorflow as tf
import horovod.tensorflow.keras as hvd

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
opt = tf.keras.optimizers.SGD(0.05 * hvd.size())
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
opt = hvd.DistributedOptimizer(opt, compression=compression)
model.compile(loss=tf.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer=opt,
              metrics=["accuracy"])

rng = np.random.default_rng(1000 + hvd.rank())
images = rng.standard_normal((32, 64), dtype=np.float32)
labels = rng.integers(0, 10, 32)
callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
             hvd.callbacks.MetricAverageCallback()]
history = model.fit(images, labels, batch_size=32, epochs=args.steps, shuffle=False,
                    callbacks=callbacks, verbose=0)
losses = [float(v) for v in history.history["loss"]]

if hvd.rank() == 0:
    with open(args.out, "w") as f:
        json.dump({"argv": sys.argv, "name": __name__, "losses": losses,
                   "optimizer": type(opt).__module__ + "." + type(opt).__qualname__,
                   "hvd_compress_loaded": "hvd_compress" in sys.modules,
                   "weights": {v.name: v.numpy().astype(np.float64).flatten().tolist()
                               for v in model.variables}}, f)
sys.exit(args.exit_code)
