"""Per-tensor cost: the same gradient elements as 1 tensor and as many tensors, two ranks on
localhost, ms per step for Horovod and for every codec through our optimizer.

    python bench/tensors.py                 # 21M elements as 1 and as 300 tensors, 3 timed steps
    python bench/tensors.py --quick         # 2M elements
    python bench/tensors.py --select topk   # only rows whose label contains one of these words
    python bench/tensors.py --model resnet50     # ResNet-50's 161 gradients (bench/models.py)
    python bench/tensors.py --model transformer  # a BERT-base-sized encoder's 150
    python bench/tensors.py --bucket-mb 4   # and the many tensors again in 4 MiB buckets
    python bench/tensors.py --bucket-mb 4 --granularity tensor   # each member encoded alone

Real models have hundreds of tensors, most of them small: each compressed tensor is its own
chain of kernel calls and its own collective, where Horovod fuses small allreduces into one.
The "many / 1" column is what that costs (the issue's target: at most 1.2x for every codec);
with --bucket-mb our rows run the many-tensor layout a third time with that optimizer's
bucket_mb (hvd_compress.buckets), and "bucketed / 1" is the cost left.

A rank's step is backward through `sum(p * g)` (so p.grad = g, the same fixed gradient every
step) and the optimizer's step; every tensor is compressed (min_compress_bytes=0). The ranks
run under `horovodrun --gloo -np 2` with one thread each; ms/step is the slower rank's mean.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results  # noqa: E402

ROWS = [("horovod, no compression", "horovod", "none"),
        ("horovod fp16", "horovod", "fp16"),
        ("fp16", "ours", "fp16"),
        ("onebit", "ours", "onebit,ef=vanilla"),
        ("efsignsgd", "ours", "efsignsgd"),
        ("topk 1%", "ours", "topk,k=0.01,ef=vanilla"),
        ("randomk 1%", "ours", "randomk,k=0.01,ef=vanilla"),
        ("minmax8", "ours", "minmax8"),
        ("dithering", "ours", "dithering,ef=vanilla"),
        ("natural", "ours", "natural"),
        ("dgc 1%", "ours", "dgc,k=0.01"),
        ("threshold", "ours", "threshold,threshold=0.01,ef=vanilla"),
        ("powersgd rank=4", "ours", "powersgd,rank=4,start_iter=0")]
TARGET = 1.2


def shapes(elements, tensors):
    """`tensors` matrices (PowerSGD factors matrices) holding `elements` in all, alike in size
    to within one row."""
    cols = 100
    rows = max(1, elements // cols)
    per, extra = divmod(rows, tensors)
    return [(per + (i < extra), cols) for i in range(tensors)]


def model_shapes(name):
    """The gradient shapes of a bench/models.py model, in its registration order."""
    import models
    return [tuple(p.shape) for p in models.MODELS[name]().parameters()]


def layout_shapes(opts, tensors):
    if tensors == 1 or not opts.get("model"):
        return shapes(opts["elements"], tensors)
    return model_shapes(opts["model"])


def worker(args):
    import warnings

    import horovod.torch as hvd
    import torch

    import hvd_compress.torch as hvdc
    warnings.simplefilter("ignore")  # dgc's note that it replaces the optimizer's momentum
    torch.set_num_threads(1)
    hvd.init()
    opts = json.loads(args.opts)
    def seconds_per_step(how, spec, tensors, bucket_mb):
        gen = torch.Generator().manual_seed(1 + hvd.rank())
        params = [torch.nn.Parameter(torch.zeros(s)) for s in layout_shapes(opts, tensors)]
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        named = [(f"t{i}", p) for i, p in enumerate(params)]
        sgd = torch.optim.SGD(params, lr=0.01)
        if how == "horovod":
            comp = hvd.Compression.fp16 if spec == "fp16" else hvd.Compression.none
            opt = hvd.DistributedOptimizer(sgd, named, compression=comp)
        else:
            if bucket_mb and opts.get("granularity", "bucket") != "bucket":
                spec = results.with_setting(spec, "granularity", opts["granularity"]) or spec
            opt = hvdc.DistributedOptimizer(sgd, named, compression=spec, min_compress_bytes=0,
                                            bucket_mb=bucket_mb)

        def step():
            opt.zero_grad()
            sum((p * g).sum() for p, g in zip(params, grads)).backward()
            opt.step()

        step()
        hvd.allreduce(torch.zeros(1), name="tensors.sync")
        t0 = time.perf_counter()
        for _ in range(opts["steps"]):
            step()
        return (time.perf_counter() - t0) / opts["steps"], spec

    out = []
    for label, how, spec in json.loads(args.rows):
        for tensors, bucket_mb in opts["layouts"]:
            if bucket_mb and how != "ours":
                continue
            seconds, ran = seconds_per_step(how, spec, tensors, bucket_mb)
            slowest = hvd.allreduce(torch.tensor([seconds]), op=hvd.Max, name="tensors.max")
            if hvd.rank() == 0:
                out.append({"row": label, "spec": spec, "ran": ran, "how": how,
                            "tensors": tensors, "bucket_mb": bucket_mb,
                            "ms_per_step": 1e3 * slowest.item()})
                how_sent = f"in {bucket_mb:g} MiB buckets" if bucket_mb else ""
                print(f"  {label:26s} {tensors:4d} tensors {how_sent:20s} "
                      f"{1e3 * slowest.item():9.1f} ms", flush=True)
    if hvd.rank() == 0:
        with open(args.result, "w") as f:
            json.dump(out, f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2M elements instead of 21M")
    ap.add_argument("--elements-m", type=float, default=None, help="gradient elements, millions")
    ap.add_argument("--tensors", type=int, default=300, help="tensors of the many-tensor layout")
    ap.add_argument("--model", choices=["resnet50", "transformer"], default=None,
                    help="the many-tensor layout is this model's gradients (and the element "
                         "count its size)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per row and layout")
    ap.add_argument("--bucket-mb", type=float, default=0,
                    help="also time the many tensors in buckets of this many MiB (our rows)")
    ap.add_argument("--granularity", choices=["bucket", "tensor"], default="bucket",
                    help="in those buckets, the codecs that take one encode each member alone "
                         "(tensor) or the bucket whole (bucket, the default)")
    ap.add_argument("--select", default=None, help="comma-separated words; rows containing one")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=results.DEFAULT_OUT)
    results.worker_arguments(ap, "--rows", "--opts", "--result")
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    rows = ROWS
    if args.select:
        words = args.select.split(",")
        rows = [r for r in ROWS if any(w in r[0] for w in words)]
        if not rows:
            sys.exit(f"--select {args.select}: no row matches; rows: "
                     + ", ".join(r[0] for r in ROWS))
    elements = int(1e6 * (args.elements_m or (2 if args.quick else 21)))
    many = args.tensors
    if args.model:
        sizes = model_shapes(args.model)
        elements, many = sum(math.prod(s) for s in sizes), len(sizes)
    layouts = [(1, 0), (many, 0)] + ([(many, args.bucket_mb)] if args.bucket_mb else [])
    opts = {"elements": elements, "layouts": layouts, "steps": args.steps, "model": args.model,
            "granularity": args.granularity}
    load = os.getloadavg()[0]
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "rows.json")
        cmd = [horovodrun, "--gloo", "-np", "2", "-H", "localhost:2", sys.executable,
               os.path.abspath(__file__), "--worker", "--rows", json.dumps(rows), "--opts",
               json.dumps(opts), "--result", result]
        subprocess.run(cmd, check=True, timeout=args.timeout, stdin=subprocess.DEVNULL)
        with open(result) as f:
            got = json.load(f)

    by = {(r["row"], r["tensors"], r["bucket_mb"]): r for r in got}
    lines = []
    for label, _, spec in rows:
        one, lots = by[(label, 1, 0)]["ms_per_step"], by[(label, many, 0)]["ms_per_step"]
        ratio = lots / one
        for r in (by[(label, 1, 0)], by[(label, many, 0)]):
            r["many_over_one"] = ratio
        line = [label, f"{one:.1f}", f"{lots:.1f}", f"{ratio:.2f}x"]
        bucketed = by.get((label, many, args.bucket_mb)) if args.bucket_mb else None
        if args.bucket_mb:
            if bucketed:
                bucketed["many_over_one"] = bucketed["ms_per_step"] / one
                ratio = min(ratio, bucketed["many_over_one"])
                line += [f"{bucketed['ms_per_step']:.1f}", f"{bucketed['many_over_one']:.2f}x"]
            else:
                line += ["", ""]
        lines.append(line + ["holds" if ratio <= TARGET else "MISSED"])
    header = ["row", "1 tensor ms", f"{many} tensors ms", "many / 1"]
    if args.bucket_mb:
        header += [f"in {args.bucket_mb:g} MiB buckets ms", "bucketed / 1"]
    header.append(f"<= {TARGET}x")
    what = f"{args.model}'s {many} gradients" if args.model else f"{many} tensors"
    print(f"{elements / 1e6:.1f}M gradient elements as 1 tensor and as {what}, 2 ranks, "
          f"localhost Gloo, {args.steps} timed steps")
    print(results.markdown(header, lines))
    settings = {**opts, "bucket_mb": args.bucket_mb, "ranks": 2, "threads_per_rank": 1, "min_compress_bytes": 0,
                "cores": os.cpu_count(), "load_average_at_start": load}
    name = f"tensors_{args.model}" if args.model else "tensors"
    if args.granularity != "bucket":
        name += f"_granularity_{args.granularity}"
    results.write(args.out, name, settings, got)

    plt = results.pyplot()
    fig, ax = plt.subplots(figsize=(10, 5))
    x = range(len(rows))
    series = [("1 tensor", 1, 0), (f"{many} tensors", many, 0)]
    if args.bucket_mb:
        series.append((f"{many} tensors in {args.bucket_mb:g} MiB buckets", many,
                       args.bucket_mb))
    width = 0.8 / len(series)
    for j, (what_label, tensors, bucket_mb) in enumerate(series):
        ax.bar([i + (j - (len(series) - 1) / 2) * width for i in x],
               [by[(r[0], tensors, bucket_mb)]["ms_per_step"] if (r[0], tensors, bucket_mb) in by
                else 0 for r in rows], width, label=what_label)
    ax.set_xticks(list(x))
    ax.set_xticklabels([r[0] for r in rows], rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("ms per step (slower rank)")
    ax.set_title(f"{elements / 1e6:.1f}M gradient elements as 1 tensor and as {what}, "
                 "2 ranks, localhost", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, f"{name}.png"), dpi=110)


if __name__ == "__main__":
    main()
