"""Which bucket size: a real model's step time on the shaped link for each `bucket_mb`, to choose
the optimizers' default by measurement.

    python bench/bucket_size.py                       # ResNet-50, 0-32 MiB, 1 and 10 Gbit/s
    python bench/bucket_size.py --model transformer --sizes 0,4,16 --rates 1gbit --steps 3
    python bench/bucket_size.py --work /tmp/sweep     # keep each run there; a rerun resumes

Each (repeat, size) is one `bench/network.py` run (root, namespaces, the same rows and link),
with our rows at that `bucket_mb` (0: each gradient alone) and Horovod's rows as the baseline
of that run; a run's files are kept under --work as r<repeat>b<size>, and a run whose files are
there is not run again, so a sweep cut short goes on where it stopped (a run made with other
--steps, rates or rows is refused rather than mixed in). The table is the median
over the repeats of ms per step of rank 0, per codec, size and rate; "geomean" is the geometric
mean over the codecs, relative to each gradient alone (below 1: the buckets are faster).
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def run_dir(work, repeat, size):
    return os.path.join(work, f"r{repeat}b{size:g}")


def check_reused(out, got, args, size):
    """A run made with other settings would enter the medians unnoticed: refuse it."""
    made = got.get("settings", {})
    wrong = []
    if made.get("steps") != args.steps:
        wrong.append(f"--steps {made.get('steps')} (this sweep: {args.steps})")
    if made.get("bucket_mb") != size:
        wrong.append(f"bucket_mb {made.get('bucket_mb')} (this sweep: {size:g})")
    rates = [r for r in args.rates.split(",") if r not in made.get("rates", [])]
    if rates:
        wrong.append(f"no rate {', '.join(rates)}")
    labels = {r["row"] for r in got["rows"]}
    words = [w for w in args.select.split(",") if not any(w in label for label in labels)]
    if words:
        wrong.append(f"no row for --select {', '.join(words)}")
    if wrong:
        sys.exit(f"{out} holds a run made with other settings: {'; '.join(wrong)}. Pass another "
                 f"--work, or delete that folder to run it again")


def sweep(args, sizes):
    """{(rate, row, size): [ms per step, one per repeat]}, running what --work lacks."""
    runs = {}
    for repeat in range(1, args.repeats + 1):
        for size in sizes:
            out = run_dir(args.work, repeat, size)
            name = f"network_{args.model}" + (f"_buckets{size:g}mb" if size else "")
            path = os.path.join(out, f"{name}.json")
            if not os.path.exists(path):
                print(f"== repeat {repeat}, bucket_mb={size:g}", flush=True)
                subprocess.run([sys.executable, os.path.join(HERE, "network.py"), "--model",
                                args.model, "--bucket-mb", f"{size:g}", "--rates", args.rates,
                                "--select", args.select, "--steps", str(args.steps), "--out",
                                out], check=True, stdin=subprocess.DEVNULL)
            with open(path) as f:
                got = json.load(f)
            check_reused(out, got, args, size)
            for r in got["rows"]:
                runs.setdefault((r["rate"], r["row"], size), []).append(r["ms_per_step"])
    return runs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["resnet50", "transformer", "keras-resnet50"],
                    default="resnet50")
    ap.add_argument("--sizes", default="0,2,4,8,16,32", help="bucket_mb values, comma-separated")
    ap.add_argument("--rates", default="1gbit,10gbit")
    ap.add_argument("--select", default="onebit,topk,minmax8,randomk,dithering,dgc",
                    help="our rows, as bench/network.py --select")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per row and rate")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--work", default=None,
                    help="where the runs' files stay (default: a folder of the system's temp dir)")
    ap.add_argument("--out", default=results.DEFAULT_OUT)
    args = ap.parse_args()
    sizes = [float(s) for s in args.sizes.split(",")]
    if 0 not in sizes:
        sys.exit("--sizes must include 0: every size is read against each gradient alone")
    args.work = args.work or os.path.join(tempfile.gettempdir(), f"hvdc_bucket_size_{args.model}")
    runs = sweep(args, sizes)

    rates = args.rates.split(",")
    labels = list(dict.fromkeys(row for (_, row, _) in runs))
    ours = [row for row in labels if not row.startswith(("horovod", "ddp"))]
    median = {key: statistics.median(v) for key, v in runs.items()}
    rows, table = [], []
    for rate in rates:
        for label in labels:
            line = [rate, label]
            for size in sizes:
                ms = median.get((rate, label, size))
                line.append("" if ms is None else f"{ms:.0f}")
                if ms is not None:
                    rows.append({"rate": rate, "row": label, "bucket_mb": size,
                                 "ms_per_step": ms, "runs": runs[(rate, label, size)]})
            table.append(line)
        line = [rate, "geomean of ours / alone"]
        for size in sizes:
            ratios = [median[(rate, r, size)] / median[(rate, r, 0)] for r in ours
                      if (rate, r, size) in median and (rate, r, 0) in median]
            g = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else float("nan")
            line.append(f"{g:.2f}")
            rows.append({"rate": rate, "row": "geomean of ours / alone", "bucket_mb": size,
                         "ms_per_step": g, "runs": []})
        table.append(line)
    header = ["rate", "row"] + [f"{s:g} MiB" if s else "alone" for s in sizes]
    print(f"{args.model}, 2 ranks on the shaped link, median of {args.repeats} runs of "
          f"{args.steps} timed steps, ms per step (Horovod rows: no buckets in any run)")
    print(results.markdown(header, table))
    name = f"bucket_size_{args.model}"
    results.write(args.out, name, {"model": args.model, "sizes": sizes, "rates": rates,
                                   "steps": args.steps, "repeats": args.repeats}, rows)

    plt = results.pyplot()
    fig, axes = plt.subplots(1, len(rates), figsize=(6 * len(rates), 4.5), squeeze=False)
    x = range(len(sizes))
    for ax, rate in zip(axes[0], rates):
        for label in ours:
            ax.plot(list(x), [median.get((rate, label, s), float("nan")) for s in sizes],
                    marker="o", label=label)
        ax.axhline(median[(rate, labels[0], 0)], color="k", ls="--", lw=1, label=labels[0])
        ax.set_xticks(list(x))
        ax.set_xticklabels([f"{s:g}" if s else "alone" for s in sizes])
        ax.set_xlabel("bucket_mb")
        ax.set_ylabel("ms per step (rank 0)")
        ax.set_title(f"{args.model}, {rate}", fontsize=10)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, f"{name}.png"), dpi=110)


if __name__ == "__main__":
    main()
