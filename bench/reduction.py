"""The TensorFlow frontend's traced reduction alone, against Horovod's: ms per call, no model.

    python bench/reduction.py                       # Keras' ResNet-50 gradients, 2 ranks
    python bench/reduction.py --arm on --specs onebit,ef=vanilla

Whole training steps paired on two shared cores vary by +-5% from one run to the next (Horovod
against a copy of itself: 0.95-1.05x over 24 steps), too much to tell whether our uncompressed
arm costs 3% or 0%. Here each rank holds fixed gradients shaped as the model's trainable
variables (Keras' ResNet-50: 214 tensors, 25.6M elements) and calls, in turn, a tf.function of
Horovod's reduction (horovod.tensorflow.keras.DistributedOptimizer's `_allreduce_grads`) and one
of ours per spec (hvd_compress.tensorflow.keras.DistributedOptimizer, `--bucket-mb`), each
`--rounds` times after 3 warm-up calls, so that a drift in the machine's speed weighs on every
row alike. `--arm off` holds compression off (`enabled`, as autotune leaves a row it decided
not to compress), `on` holds it on.

The driver launches `horovodrun --gloo -np 2 -H localhost:2` on this script; one thread per rank
(intra- and inter-op), as bench/network.py. Results go to docs/benchmarks/reduction.{json,csv,png}
(--out to change the folder).

    python bench/reduction.py --whole-step          # the whole step, one rank, no network

`--whole-step` times the whole traced training step instead (forward, backward, the reduction,
SGD with momentum 0.9; batch 4) in one process, Horovod at one rank, one thread, against the step
with Horovod's allreduce per tensor (what Horovod's optimizer issues from 2 ranks on; at one rank
its own optimizer skips it) and that step again (the A/A row). With no network and no second rank
the A/A row stays within 2%, so what an arm costs inside a step shows, which a reduction timed
alone cannot: what it does to backward's and the optimizer's ops around it (gradients held
longer, memory gone cold). Results: reduction_step.{json,csv,png}.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results  # noqa: E402

# The default table's specs (bench/network.py's rows).
# threshold: ~1% of the N(0, 0.01) gradients below lie beyond 0.026 (2.58 standard deviations).
SPECS = ["fp16", "onebit,ef=vanilla", "efsignsgd", "topk,k=0.01,ef=vanilla", "minmax8",
         "dithering,ef=vanilla", "qsgd", "natural", "threshold,ef=vanilla,threshold=0.026",
         "dgc,k=0.001", "powersgd,rank=4,start_iter=2"]
MODELS = ("keras-resnet50", "mlp")
HOROVOD = "horovod, no compression"
PER_TENSOR = "hvd.allreduce per tensor"
TWIN = "the same again"


def variables(tf, model: str):
    if model == "keras-resnet50":
        return tf.keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3),
                                              classes=1000).trainable_variables
    # a small stand-in for the tests: four dense layers
    sizes = [(256, 256), (256,), (256, 128), (128,), (128, 10), (10,)]
    return [tf.Variable(tf.zeros(s), name=f"mlp/v{i}") for i, s in enumerate(sizes)]


def model_and_batch(tf, model: str):
    """--whole-step: the model, with the same weights in every row, and a fixed batch of 4."""
    tf.keras.utils.set_random_seed(0)
    if model == "keras-resnet50":
        net = tf.keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=1000)
        shape, classes = [4, 32, 32, 3], 1000
    else:  # the variables of variables(tf, "mlp")
        dense = tf.keras.layers.Dense
        net = tf.keras.Sequential([dense(256, input_shape=(256,)), dense(128),
                                   dense(10, activation="softmax")])
        shape, classes = [4, 256], 10
    gen = tf.random.Generator.from_seed(1)
    return net, gen.normal(shape), gen.uniform([shape[0]], 0, classes, dtype=tf.int64)


def whole_step(tf, model: str, reduce):
    net, x, y = model_and_batch(tf, model)
    vs = net.trainable_variables
    sgd = tf.keras.optimizers.SGD(0.01, momentum=0.9)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                y, net(x, training=True)))
        sgd.apply_gradients(zip(reduce(tape.gradient(loss, vs), vs), vs))
    return step


def per_tensor(hvd):
    return lambda gs, vs: [hvd.allreduce(g, op=hvd.Average, name=f"per_tensor.{i}")
                           for i, g in enumerate(gs)]


def bound(reduce, vs):
    # a closure per row: a lambda in the worker's loop would call the last row's reduce
    return lambda gs: reduce(gs, vs)


def worker(args):
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import warnings
    warnings.simplefilter("ignore")
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvd_keras

    import hvd_compress.tensorflow.keras as hvdk
    hvd.init()
    opts = json.loads(args.opts)
    whole = opts["whole_step"]
    if not whole:
        vs = variables(tf, opts["model"])
        gen = tf.random.Generator.from_seed(1 + hvd.rank())
        grads = [gen.normal(v.shape) * 0.01 for v in vs]
    calls = {}
    for spec in ([PER_TENSOR, TWIN] if whole else [HOROVOD]) + opts["specs"]:
        sgd = tf.keras.optimizers.SGD(0.01, momentum=0.9)
        if spec in (PER_TENSOR, TWIN):
            reduce = per_tensor(hvd)
        elif spec == HOROVOD:
            opt = hvd_keras.DistributedOptimizer(sgd)
            reduce = opt._allreduce_grads
        else:
            opt = hvdk.DistributedOptimizer(sgd, compression=spec, bucket_mb=opts["bucket_mb"])
            opt._hvdc_reducer.enabled.assign(opts["arm"] == "on")
            reduce = opt._hvdc_reducer.reduce
        if whole:
            fn = whole_step(tf, opts["model"], reduce)
        else:
            fn = partial(tf.function(bound(reduce, vs), autograph=False), grads)
        for _ in range(3):  # traces, and Horovod negotiates each tensor's name
            fn()
        calls[spec] = (fn, [])
    for _ in range(opts["rounds"]):
        for fn, times in calls.values():
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    if hvd.rank() == 0:
        with open(args.result, "w") as f:
            json.dump({spec: times for spec, (_, times) in calls.items()}, f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=MODELS, default="keras-resnet50")
    ap.add_argument("--specs", default=";".join(SPECS),
                    help="semicolon-separated compression specs (default: the default table's)")
    ap.add_argument("--arm", choices=["off", "on"], default="off",
                    help="compression held off (default) or on in our rows")
    ap.add_argument("--bucket-mb", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=40, help="calls of each function")
    ap.add_argument("--whole-step", action="store_true",
                    help="time the whole training step on one rank (see above)")
    ap.add_argument("--out", default=results.DEFAULT_OUT)
    results.worker_arguments(ap, "--opts", "--result")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    import hvd_compress
    specs = [s for s in args.specs.split(";") if s]
    for spec in specs:
        try:
            hvd_compress.parse_spec(spec)
        except ValueError as e:
            ap.error(f"--specs: {spec!r}: {e}")
    opts = {"model": args.model, "specs": specs, "arm": args.arm, "bucket_mb": args.bucket_mb,
            "rounds": args.rounds, "whole_step": args.whole_step}
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    launcher = [] if args.whole_step else [horovodrun, "--gloo", "-np", "2", "-H", "localhost:2"]
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "times.json")
        subprocess.run(launcher + [sys.executable, os.path.abspath(__file__), "--worker",
                                   "--opts", json.dumps(opts), "--result", result],
                       check=True, stdin=subprocess.DEVNULL)
        with open(result) as f:
            times = json.load(f)
    first = PER_TENSOR if args.whole_step else HOROVOD
    base = statistics.median(times[first])
    rows = [{"row": spec, "arm": args.arm if spec in specs else "-",
             "median_ms": 1e3 * statistics.median(t), "min_ms": 1e3 * min(t),
             "vs_horovod": statistics.median(t) / base} for spec, t in times.items()]
    print(results.markdown(["row", "arm", "median ms", "min ms", "x Horovod's"],
                           [[r["row"], r["arm"], f"{r['median_ms']:.1f}", f"{r['min_ms']:.1f}",
                             f"{r['vs_horovod']:.2f}"] for r in rows]))
    if args.whole_step:
        name, ranks, launcher, what = ("reduction_step", 1, "none (one process)",
                                       "the whole traced step, 1 rank")
    else:
        name, ranks, launcher, what = ("reduction", 2, "horovodrun --gloo",
                                       "the traced reduction alone, 2 ranks")
    settings = {**opts, "ranks": ranks, "threads_per_rank": 1, "launcher": launcher}
    results.write(args.out, name, settings, rows)
    plt = results.pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(rows) + 1.2))
    ax.barh([r["row"] for r in rows][::-1], [r["median_ms"] for r in rows][::-1])
    ax.set_xlabel(f"ms per call (median of {args.rounds}), compression {args.arm}")
    ax.set_title(f"{args.model}: {what}")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, f"{name}.png"), dpi=110)


if __name__ == "__main__":
    main()
