"""What our reduction costs a rank per step on its own device, without the wire: a model's
gradients (bench/models.py) in buckets, each codec's whole reduction plan (encode, the
collectives' results taken apart, decode, error feedback and its state), for two ranks simulated
in one process by the in-process collectives of tests/plan_sim.py (no Horovod, no network: the
GPU machines have neither).

    python bench/device_step.py --device cuda   # on a GPU
    python bench/device_step.py                 # on the CPU, one thread
    python bench/device_step.py --quick         # a small model, few steps

Both ranks' work runs in this one process, so "ms/step per rank" is the step's time divided by
the rank count. The wire is modelled, not measured: rank 0's bytes on the wire (the
payloads its plan issued, times what Horovod's ring collectives send of them) over
the link rate, with no latency and no overlap with backward; the simulated collectives' own
time is left out of ours. The baseline is Horovod's own allreduce of the uncompressed gradient:
none of our time (its fusion-buffer copies are not counted either), every byte on the wire.
"codec + wire" against that wire time is what compression would gain per step where the link,
not the rank's processor, is the bottleneck; bench/network.py measures real steps on shaped
links.
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]
import torch  # noqa: E402

import results  # noqa: E402
from models import MODELS  # noqa: E402
from network import ROWS  # noqa: E402
from plan_sim import drive, perform  # noqa: E402
import hvd_compress as hc  # noqa: E402
from hvd_compress import buckets, collectives  # noqa: E402
from hvd_compress.state import StateStore  # noqa: E402
from hvd_compress.torch.codec import TorchAdapter, TorchCodec  # noqa: E402

WORLD = 2
# Our rows of bench/network.py but PowerSGD, whose factorisation the optimizer batches per
# matrix outside the buckets.
SPECS = [(label, spec) for label, how, spec in ROWS
         if how == "ours" and not spec.startswith("powersgd")]
# Uncompressed gradients are Horovod's own fused allreduce, no plan of ours: none of our time,
# every byte on the wire.
BASELINE = "horovod, no compression"
RATES = {"1 Gbit/s": 1e9, "10 Gbit/s": 10e9, "100 Gbit/s": 100e9}


def gradient_layout(params: list, bucket_mb: float, spec: str):
    """The buckets the optimizer makes, for `spec`, of the gradients `params` ((name, shape) in
    backward order) that its codec takes (hvd_compress.buckets, min_compress_bytes=0), and the
    elements of those it leaves to Horovod's plain allreduce (DGC takes matrices only)."""
    info = hc.parse_spec(spec).info
    taken = [(n, int(torch.Size(s).numel()), "float32", 4) for n, s in params
             if len(s) >= info.min_dim]
    plain = sum(torch.Size(s).numel() for _, s in params if len(s) < info.min_dim)
    return buckets.layout(taken, buckets.bucket_bytes(bucket_mb)), plain


class Wire:
    """plan_sim's collectives, timed apart (their work stands for Horovod's and the link's, not
    ours) and counted: the bytes rank 0 sends for each, as Horovod's ring collectives send them
    (the payloads the plan actually made: threshold's differ from step to step)."""

    def __init__(self, device):
        self.device, self.seconds, self.sent = device, 0.0, 0

    def __call__(self, requests):
        mine = requests[0]
        nbytes = mine.tensor.numel() * mine.tensor.element_size()
        if isinstance(mine, collectives.Allreduce):
            self.sent += nbytes * 2 * (WORLD - 1) // WORLD
        elif isinstance(mine, collectives.Allgather):
            self.sent += nbytes * (WORLD - 1)
        else:  # alltoall: all but what rank 0 keeps
            self.sent += nbytes - mine.splits[0] * mine.tensor.element_size()
        sync(self.device)
        t0 = time.perf_counter()
        answers = perform(requests)
        sync(self.device)
        self.seconds += time.perf_counter() - t0
        return answers


class Ranks:
    """Every rank's state store and codec, and its step through the buckets."""

    def __init__(self, spec, layout, grads, device):
        self.config = hc.parse_spec(spec)
        self.layout, self.grads = layout, grads
        self.stores = [StateStore(TorchAdapter(), spec=self.config.canonical())
                       for _ in range(WORLD)]
        self.codecs = [TorchCodec(self.config, s, rank=r, world=WORLD)
                       for r, s in enumerate(self.stores)]
        self.gen = torch.Generator(device).manual_seed(0)

    def refill(self) -> None:
        """A new gradient for every rank, as backward writes one (the plans reduce into it).
        Scaled so that threshold's default (0.01) keeps 1% of the elements at the first step, as
        bench/network.py's label says it does of ResNet-50's real gradients; the other codecs'
        work does not depend on the scale. Drawn afresh each step, so that the residuals of
        error feedback grow as with real gradients, not as with one gradient repeated."""
        for g in self.grads:
            for t in g.values():
                t.normal_(0.0, 0.01 / 2.576, generator=self.gen)

    def step(self, wire: Wire) -> None:
        """One step of every rank, its collectives through `wire`."""
        names = {m.name for b in self.layout for m in b.members}
        for s in self.stores:
            s.begin()
        steps = [{n: s.next_step(n) for n in names} for s in self.stores]
        for bucket in self.layout:
            gens = []
            for r in range(WORLD):
                g, ms = self.grads[r], bucket.members
                # As the optimizer launches a bucket: one member's piece is its gradient's memory.
                flat = (g[ms[0].name][ms[0].start:ms[0].stop] if len(ms) == 1 else
                        torch.cat([g[m.name][m.start:m.stop] for m in ms]))
                job = collectives.Job(name=bucket.name, n=flat.numel(), itemsize=4,
                                      config=self.config, rank=r, world=WORLD, average=True,
                                      opname=bucket.name, step=steps[r][ms[0].name],
                                      fields_step=steps[r][ms[0].name], nodes=None,
                                      extra={"grad": flat}, members=tuple((m.name, m.n) for m in ms))
                collectives.choose(job)
                self.codecs[r].view(bucket.name, [(m.name, g[m.name], m.start, m.stop) for m in ms])
                gens.append(collectives.plan(job, self.codecs[r]))
            drive(gens, wire)
        for s in self.stores:
            s.commit()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(spec, layout, grads, device, warmup, steps):
    """(ms a step per rank of our work, the bytes that rank 0 sends a step)."""
    ranks = Ranks(spec, layout, grads, device)
    for _ in range(warmup):  # the state's first allocation, the codecs' first calls
        ranks.refill()
        ranks.step(Wire(device))
    times, sent = [], []
    for _ in range(steps):
        wire = Wire(device)
        ranks.refill()
        sync(device)
        t0 = time.perf_counter()
        ranks.step(wire)
        sync(device)
        times.append(time.perf_counter() - t0 - wire.seconds)
        sent.append(wire.sent)
    # threshold's bytes change from step to step as its residual builds up: their mean
    return statistics.median(times) * 1e3 / WORLD, round(statistics.mean(sent))


def copy_ms(grads, device, steps):
    """One pass over the gradient: a device-to-device copy of every tensor, for scale."""
    outs = {n: torch.empty_like(t) for n, t in grads[0].items()}
    times = []
    for _ in range(steps + 1):
        sync(device)
        t0 = time.perf_counter()
        for n, t in grads[0].items():
            outs[n].copy_(t)
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    ap.add_argument("--model", choices=sorted(MODELS), default="resnet50")
    ap.add_argument("--bucket-mb", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    ap.add_argument("--quick", action="store_true",
                    help="the model's first 20 gradients, 1 MiB buckets, 2 timed steps")
    ap.add_argument("--select", nargs="*", default=None,
                    help="only rows whose label contains one of these words")
    ap.add_argument("--out", default=results.DEFAULT_OUT)
    ap.add_argument("--replot", metavar="JSON", help="only the table and plot again, from a run's "
                                                     "JSON; nothing is measured")
    args = ap.parse_args()
    if args.replot:
        return replot(args.replot)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device")
    if device.type == "cpu":
        torch.set_num_threads(1)  # a rank's one thread, as bench/network.py runs them
    model = MODELS[args.model]()
    bucket_mb, steps = (1.0, 2) if args.quick else (args.bucket_mb, args.steps)
    params = [(n, tuple(p.shape)) for n, p in reversed(list(model.named_parameters()))]
    if args.quick:
        params = params[:20]
    grads = [{n: torch.zeros(torch.Size(s).numel(), device=device) for n, s in params}
             for _ in range(WORLD)]
    rows_spec = [(label, spec) for label, spec in SPECS
                 if args.select is None or any(w in label for w in args.select)]
    elements = sum(t.numel() for t in grads[0].values())
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU, one thread"
    print(f"{args.model}{' (quick)' if args.quick else ''}: {len(params)} gradients, "
          f"{elements:,} float32 elements, {bucket_mb:g} MiB buckets, {WORLD} ranks simulated; "
          f"{where}; median of {steps} steps")
    copy = copy_ms(grads, device, steps)
    print(f"one copy of the gradient: {copy:.2f} ms")
    raw = elements * 4 * 2 * (WORLD - 1) // WORLD
    rows = [{"codec": BASELINE, "spec": "none", "buckets": 0, "ms_per_rank": 0.0,
             "wire_bytes": raw}]
    for label, spec in rows_spec:
        layout, plain = gradient_layout(params, bucket_mb, spec)
        ms, wire = measure(spec, layout, grads, device, warmup=2, steps=steps)
        wire += plain * 4 * 2 * (WORLD - 1) // WORLD  # a ring allreduce's bytes per rank
        rows.append({"codec": label, "spec": spec, "buckets": len(layout), "ms_per_rank": ms,
                     "wire_bytes": wire})
    for row in rows:
        for rate_label, bps in RATES.items():
            row[f"codec_plus_wire_ms_{rate_label.split()[0]}g"] = (
                row["ms_per_rank"] + row["wire_bytes"] * 8 / bps * 1e3)
    settings = {"model": args.model, "quick": args.quick, "gradients": len(params),
                "elements": elements, "bucket_mb": bucket_mb, "world": WORLD, "steps": steps,
                "device": where, "copy_ms": copy, "rates_bps": RATES}
    name = "device_step" + ("_cuda" if device.type == "cuda" else "") + \
        ("" if args.model == "resnet50" else f"_{args.model}")
    results.write(args.out, name, settings, rows)
    report(rows, settings, os.path.join(args.out, f"{name}.png"))


def report(rows, settings, png):
    """The table, and the plot: codec + wire by link rate, one bar per row."""
    rates = list(settings["rates_bps"])
    keys = [f"codec_plus_wire_ms_{r.split()[0]}g" for r in rates]
    header = ["codec", "ms/step per rank", "wire MB per rank"] + [
        f"codec + wire at {r} (ms)" for r in rates]
    lines = [[row["codec"], f"{row['ms_per_rank']:.2f}", f"{row['wire_bytes'] / 1e6:.2f}"] +
             [f"{row[k]:.1f} ({rows[0][k] / row[k]:.2f}x)" for k in keys] for row in rows]
    print(results.markdown(header, lines))
    print(f"(x: {BASELINE}'s wire time over this row's codec + wire; above 1 is a gain)")
    plt = results.pyplot()
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(rows)
    for i, row in enumerate(rows):
        ax.bar([j + i * width for j in range(len(rates))], [row[k] for k in keys], width,
               label=row["codec"], color=plt.cm.tab20(i % 20))
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rates))], rates)
    ax.set_yscale("log")
    ax.set_ylabel("ms per step and rank: codec + wire (modelled)")
    ax.set_title(f"{settings['model']}: our reduction on {settings['device']}, "
                 f"{settings['world']} ranks, the wire modelled")
    ax.legend(fontsize=7, ncol=2, loc="upper right")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def replot(path):
    """The table and plot again from a run's JSON (a GPU machine's, brought back)."""
    with open(path) as f:
        data = json.load(f)
    report(data["rows"], data["settings"], os.path.splitext(path)[0] + ".png")

if __name__ == "__main__":
    main()
