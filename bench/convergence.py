"""Does compression cost accuracy? Two ranks (horovodrun --gloo) train the same small MLP on
scikit-learn's digits (bundled with scikit-learn, no download) with each codec, with and without
error feedback, from the same seeds; final test accuracy and the training-loss curve per run.

    python bench/convergence.py             # 40 epochs per run
    python bench/convergence.py --quick     # 15 epochs
    python bench/convergence.py --ranks 4 --collective allreduce --ef-only
                                            # the compressed allreduce at 4 ranks
    python bench/convergence.py --model cnn --bucket-mb 1 --ef-only
                                            # a small CNN's 10 tensors, in one bucket
    python bench/convergence.py --momentum 0.9 --epochs 15 --ef-only --advised
                                            # SGD momentum 0.9, each spec as the optimizer's
                                            # warning advises (spec.momentum_fix)
    python bench/convergence.py --seeds 3   # each run from 3 seeds: mean, min and max
    python bench/convergence.py --select dgc,topk   # those codecs' rows and uncompressed

Every run: 1437 training and 360 test images (stratified split, seed 0), global batch 64 split
between the ranks, plain SGD with lr 0.1 (dgc adds its own momentum correction), all tensors
compressed (min_compress_bytes=0). "ef" is vanilla error feedback (ef=vanilla);
efsignsgd and dgc carry their own, powersgd's is its error_feedback parameter.

One test image is 0.28 points of accuracy, and a run's last digits move with any change in the
order of its float operations: with --seeds N every spec trains from N seeds (the model's
initial weights and the shuffle; seed 0 is the single run's), and the table gives the mean
with the lowest and highest run, the mean compared against uncompressed's mean.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results  # noqa: E402

# (codec, spec without EF or None, spec with EF or None)
RUNS = [("none", "none", None),
        ("fp16", "fp16", "fp16,ef=vanilla"),
        ("bf16", "bf16", "bf16,ef=vanilla"),
        ("onebit", "onebit", "onebit,ef=vanilla"),
        ("signsgd", "signsgd", "signsgd,ef=vanilla"),
        ("efsignsgd", None, "efsignsgd"),
        ("topk 1%", "topk,k=0.01", "topk,k=0.01,ef=vanilla"),
        ("randomk 1%", "randomk,k=0.01", "randomk,k=0.01,ef=vanilla"),
        ("minmax8", "minmax8", "minmax8,ef=vanilla"),
        ("dithering", "dithering", "dithering,ef=vanilla"),
        ("qsgd", "qsgd", "qsgd,ef=vanilla"),
        ("terngrad", "terngrad", "terngrad,ef=vanilla"),
        ("natural", "natural", "natural,ef=vanilla"),
        ("threshold 0.01", "threshold,threshold=0.01", "threshold,threshold=0.01,ef=vanilla"),
        ("dgc 1%", None, "dgc,k=0.01"),
        ("powersgd rank 2", "powersgd,rank=2,start_iter=50,error_feedback=false",
         "powersgd,rank=2,start_iter=50")]
GLOBAL_BATCH = 64
# Plain SGD: with momentum 0.9 at this learning rate the sign codecs and random-k diverge once
# error feedback is on (see docs/benchmarks.md); --momentum reproduces that.
LR, MOMENTUM = 0.1, 0.0
MODELS = {"mlp": "MLP 64-128-64-10",
          "cnn": "CNN conv3x3(16)-conv3x3(32)-maxpool-conv3x3(32)-fc64-fc10, 10 small tensors"}


def make_model(kind):
    import torch
    nn = torch.nn
    if kind == "mlp":
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                             nn.Linear(64, 10))
    return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(512, 64), nn.ReLU(), nn.Linear(64, 10))


def worker(args):
    import warnings

    import horovod.torch as hvd
    import numpy as np
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    import hvd_compress.torch as hvdc
    from hvd_compress import parse_spec
    from hvd_compress.spec import momentum_fix
    warnings.simplefilter("ignore")  # dgc's note that it replaces the optimizer's momentum
    torch.set_num_threads(1)
    hvd.init()
    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x.astype(np.float32) / 16.0, y, test_size=0.2,
                                              random_state=0, stratify=y)
    x_tr, y_tr = torch.from_numpy(x_tr), torch.from_numpy(y_tr)
    x_te, y_te = torch.from_numpy(x_te), torch.from_numpy(y_te)
    out = []
    for seed, spec in ((seed, spec) for seed in range(args.seeds)
                       for spec in json.loads(args.specs)):
        ran = (args.advised and momentum_fix(parse_spec(spec), args.momentum)) or spec
        torch.manual_seed(seed)
        model = make_model(args.model)
        sgd = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
        opt = hvdc.DistributedOptimizer(sgd, model.named_parameters(), compression=ran,
                                        min_compress_bytes=0, bucket_mb=args.bucket_mb)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        order = torch.Generator().manual_seed(1 + seed)  # the same shuffle on both ranks
        curve = []
        for _ in range(args.epochs):
            perm = torch.randperm(len(y_tr), generator=order)
            total, batches = 0.0, 0
            for s in range(0, len(perm) - GLOBAL_BATCH + 1, GLOBAL_BATCH):
                mine = perm[s:s + GLOBAL_BATCH][hvd.rank()::hvd.size()]
                opt.zero_grad()
                loss = F.cross_entropy(model(x_tr[mine]), y_tr[mine])
                loss.backward()
                opt.step()
                total += loss.item()
                batches += 1
            curve.append(float(hvd.allreduce(torch.tensor(total / batches), name="epoch_loss")))
        with torch.no_grad():
            acc = (model(x_te).argmax(1) == y_te).double().mean().item() * 100
        out.append({"spec": spec, "ran": ran, "seed": seed, "test_accuracy": acc,
                    "final_loss": curve[-1], "curve": curve})
        if hvd.rank() == 0:
            print(f"  {ran:52s} seed {seed} accuracy {acc:6.2f}%  loss {curve[-1]:.4f}",
                  flush=True)
    if hvd.rank() == 0:
        with open(args.result, "w") as f:
            json.dump(out, f)


def with_collective(spec, collective):
    """The spec routed by `collective`, or None where the codec cannot travel that way."""
    if collective == "auto" or spec is None:
        return spec
    return results.with_setting(spec, "collective", collective)


def with_granularity(spec, granularity):
    """The spec with `granularity` where the codec takes one (it encodes a bucket's members
    alone or the bucket whole), else as it is: the setting means nothing to it."""
    if granularity == "bucket" or spec is None:
        return spec
    return results.with_setting(spec, "granularity", granularity) or spec


def runs(collective, ef_only, granularity="bucket"):
    def routed(spec):
        return with_granularity(with_collective(spec, collective), granularity)
    return [("none", "none", None) if codec == "none" else
            (codec, None if ef_only else routed(plain), routed(ef))
            for codec, plain, ef in RUNS]


def selected(table, select):
    """The rows whose codec contains one of select's comma-separated words, and uncompressed."""
    if not select:
        return table
    words = select.split(",")
    return [r for r in table if r[0] == "none" or any(w in r[0] for w in words)]


def over_seeds(got):
    """{spec: one run, or the mean of its seeds' runs with the lowest and highest accuracy}."""
    runs_of = {}
    for r in got:
        runs_of.setdefault(r["spec"], []).append(r)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {spec: {"spec": spec, "ran": rs[0]["ran"], "seeds": len(rs),
                   "test_accuracy": mean([r["test_accuracy"] for r in rs]),
                   "lowest": min(r["test_accuracy"] for r in rs),
                   "highest": max(r["test_accuracy"] for r in rs),
                   "final_loss": mean([r["final_loss"] for r in rs]),
                   "curve": [mean(c) for c in zip(*(r["curve"] for r in rs))]}
            for spec, rs in runs_of.items()}


def report(got, settings, out_dir, name="convergence"):
    by_spec = over_seeds(got)
    base = round(by_spec["none"]["test_accuracy"], 2)
    rows, lines = [], []
    table = selected(runs(settings["collective"], settings["ef_only"],
                          settings.get("granularity", "bucket")), settings.get("select"))
    for codec, plain, ef in table:
        row = {"codec": codec}
        for kind, spec in (("no_ef", plain), ("ef", ef)):
            r = by_spec.get(spec)
            row[f"{kind}_spec"] = spec or ""
            row[f"{kind}_ran"] = r["ran"] if r else ""
            row[f"{kind}_accuracy"] = round(r["test_accuracy"], 2) if r else ""
            row[f"{kind}_lowest"] = round(r["lowest"], 2) if r else ""
            row[f"{kind}_highest"] = round(r["highest"], 2) if r else ""
            row[f"{kind}_final_loss"] = round(r["final_loss"], 4) if r else ""
        if row["ef_accuracy"] != "":
            row["ef_within_1_point"] = base - row["ef_accuracy"] <= 1.0
        else:
            row["ef_within_1_point"] = ""
        rows.append(row)
        def fmt(kind):
            v = row[f"{kind}_accuracy"]
            if v == "":
                return "-"
            if settings["seeds"] == 1:
                return f"{v:.2f}"
            return f"{v:.2f} ({row[f'{kind}_lowest']:.2f}-{row[f'{kind}_highest']:.2f})"
        lines.append([codec, fmt("no_ef"), fmt("ef"),
                      f"{row['ef_accuracy'] - base + 0.0:+.2f}" if row["ef_accuracy"] != "" else "-",
                      {True: "yes", False: "NO", "": "-"}[row["ef_within_1_point"]]])
    of = "" if settings["seeds"] == 1 else f", mean of {settings['seeds']} seeds (lowest-highest)"
    print(results.markdown(["codec", f"accuracy % (no EF{of})", f"accuracy % (EF{of})",
                            "EF - none", "EF within 1 point"], lines))
    results.write(out_dir, name, settings, rows)
    with open(os.path.join(out_dir, f"{name}_curves.json"), "w") as f:
        json.dump({spec: r["curve"] for spec, r in by_spec.items()}, f, indent=1)

    plt = results.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, kind, title in ((axes[0], 2, "with error feedback"), (axes[1], 1, "without")):
        for run in table:
            spec = run[kind] if run[0] != "none" else "none"
            if spec in by_spec:
                ax.plot(range(1, settings["epochs"] + 1), by_spec[spec]["curve"], label=run[0],
                        linewidth=2.5 if spec == "none" else 1.0,
                        color="black" if spec == "none" else None)
        ax.set_yscale("log")
        ax.set_xlabel("epoch")
        ax.set_ylabel("training loss (mean over ranks)")
        ax.set_title(f"digits, {settings['ranks']} ranks: {title}")
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"{name}.png"), dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="15 epochs instead of 40")
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--lr", type=float, default=LR)
    ap.add_argument("--momentum", type=float, default=MOMENTUM)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--collective", default="auto", help="routes every spec: auto, allgather, "
                    "allreduce (codecs that cannot travel that way are left out)")
    ap.add_argument("--ef-only", action="store_true", help="only the runs with error feedback")
    ap.add_argument("--model", choices=list(MODELS), default="mlp")
    ap.add_argument("--bucket-mb", type=float, default=0,
                    help="the optimizer's bucket_mb (0: every tensor alone)")
    ap.add_argument("--granularity", choices=["bucket", "tensor"], default="bucket",
                    help="with --bucket-mb: the codecs that take one encode each member alone "
                    "(tensor) or the bucket whole (bucket, the default)")
    ap.add_argument("--advised", action="store_true",
                    help="run each spec as the optimizer's momentum warning advises")
    ap.add_argument("--seeds", type=int, default=1,
                    help="train each spec from this many seeds and report their mean")
    ap.add_argument("--select", default=None,
                    help="comma-separated words: only the codecs whose row contains one, beside "
                    "uncompressed (files named after the words)")
    ap.add_argument("--out", default=results.DEFAULT_OUT)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--specs", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.seeds < 1:
        sys.exit(f"--seeds must be at least 1, got {args.seeds}")
    epochs = args.epochs or (15 if args.quick else 40)
    table = selected(runs(args.collective, args.ef_only, args.granularity), args.select)
    if len(table) == 1:
        sys.exit(f"--select {args.select} matches no codec; the rows: "
                 f"{', '.join(r[0] for r in runs(args.collective, args.ef_only))}")
    specs = [s for run in table for s in run[1:] if s]
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "runs.json")
        cmd = [horovodrun, "--gloo", "-np", str(args.ranks), "-H", f"localhost:{args.ranks}",
               sys.executable, os.path.abspath(__file__), "--worker", "--epochs", str(epochs),
               "--lr", str(args.lr), "--momentum", str(args.momentum), "--seeds", str(args.seeds),
               "--model", args.model, "--bucket-mb", str(args.bucket_mb), "--specs",
               json.dumps(specs), "--result", result] + ["--advised"] * args.advised
        subprocess.run(cmd, check=True, timeout=3600)
        with open(result) as f:
            got = json.load(f)
    settings = {"epochs": epochs, "ranks": args.ranks, "global_batch": GLOBAL_BATCH, "lr": args.lr,
                "momentum": args.momentum, "model": MODELS[args.model],
                "bucket_mb": args.bucket_mb,
                "data": "sklearn digits, 80/20", "collective": args.collective,
                "ef_only": args.ef_only, "advised": args.advised, "seeds": args.seeds,
                "select": args.select, "granularity": args.granularity}
    name = "convergence"
    if (args.ranks, args.collective) != (2, "auto"):
        name += f"_{args.ranks}ranks_{args.collective}"
    if args.model != "mlp":
        name += f"_{args.model}"
    if args.bucket_mb:
        name += f"_buckets{args.bucket_mb:g}mb"
    if args.granularity != "bucket":
        name += f"_granularity_{args.granularity}"
    if args.momentum:
        name += f"_momentum{args.momentum:g}" + "_advised" * args.advised
    if args.seeds > 1:
        name += f"_seeds{args.seeds}"
    if args.select:
        name += "_" + "_".join(args.select.split(","))
    report(got, settings, args.out, name)


if __name__ == "__main__":
    main()
