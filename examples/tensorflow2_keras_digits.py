"""Keras model.fit on scikit-learn's digits (bundled, no download) with compression.

    mpirun -np 2 python examples/tensorflow2_keras_digits.py --compression topk,k=0.05,ef=vanilla
    horovodrun --gloo -np 2 -H localhost:2 python examples/tensorflow2_keras_digits.py ...
"""
import argparse
import json

import horovod.tensorflow.keras as hvd
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import hvd_compress.tensorflow.keras as hvdk

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--compression", default="none")
parser.add_argument("--epochs", type=int, default=8)
parser.add_argument("--start-epoch", type=int, default=0,
                    help="plain allreduce before this epoch (CompressionScheduleCallback)")
parser.add_argument("--min-compress-bytes", type=int, default=0)
parser.add_argument("--checkpoint", default=None, help="compression state path prefix")
parser.add_argument("--json-out", default=None)
args = parser.parse_args()

hvd.init()
tf.keras.utils.set_random_seed(1234)
digits = load_digits()
x = (digits.data / 16.0).astype("float32")
y = digits.target.astype("int64")
order = np.random.RandomState(0).permutation(len(x))
x, y = x[order], y[order]
x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]
# Each rank trains on its own shard.
x_train, y_train = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]

model = tf.keras.Sequential([tf.keras.layers.Dense(128, activation="relu", input_shape=(64,)),
                             tf.keras.layers.Dense(128, activation="relu"),
                             tf.keras.layers.Dense(10)])
opt = hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(0.05), compression=args.compression,
                                min_compress_bytes=args.min_compress_bytes)
model.compile(optimizer=opt,
              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
             hvd.callbacks.MetricAverageCallback(),
             hvdk.CompressionScheduleCallback(start_epoch=args.start_epoch),
             hvdk.CompressionStatsCallback()]
if args.checkpoint:
    callbacks.append(hvdk.CompressionCheckpointCallback(args.checkpoint))
history = model.fit(x_train, y_train, batch_size=32, epochs=args.epochs, callbacks=callbacks,
                    verbose=2 if hvd.rank() == 0 else 0, shuffle=False)
loss, acc = model.evaluate(x_test, y_test, verbose=0)
if hvd.rank() == 0:
    h = history.history
    print(f"{args.compression}: test loss {loss:.4f}, accuracy {acc:.4f}, "
          f"compression ratio {h['compression_ratio'][-1]:.1f}x")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"compression": args.compression, "test_loss": loss, "test_accuracy": acc,
                       "history": {k: [float(v) for v in vs] for k, vs in h.items()}}, f)
