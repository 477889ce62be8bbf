"""Codec throughput: our kernels beside the same operation built from plain torch ops, measured
in the same run on the same gradient.

    python bench/codecs.py                 # 100 MB fp32 gradient, 1 thread, median of 7 runs
    python bench/codecs.py --quick         # 10 MB, median of 3
    python bench/codecs.py --mb 10 --runs 3
    python bench/codecs.py --device cuda   # the CUDA kernels (needs a GPU and the CUDA build)
    python bench/codecs.py --codecs natural,minmax8   # only these rows

Results go to docs/benchmarks/codecs.{json,csv,png}, codecs_cuda.* for --device cuda (--out to
change the folder).

GB/s = fp32 input bytes / time (for decompress too, so the columns compare). The header line
measures this machine's memory: a read-only pass (x.sum()) bounds any compressor, a copy bounds
anything that writes a gradient-sized output. On CUDA, times come from CUDA events around each
call, and the table adds each kernel's GB/s as a share of the device-to-device copy's.
"""
import argparse
import os
import statistics
import sys
import time

import torch

import hvd_compress as hc
from hvd_compress.torch import _C
from hvd_compress.torch.codec import kernel_params

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results  # noqa: E402


def median_seconds(fn, runs):
    fn()  # warm-up: page faults, caches, lazy CUDA module loading
    times = []
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ours_powersgd(spec, x):
    """The local work of one PowerSGD step on x viewed as a matrix (the two allreduces
    excluded): compress = M = g + e, P = M Q, orthogonalise P, Q = M^T P, e = M - P Q^T;
    decompress = P Q^T."""
    rank = hc.parse_spec(spec).param_dict["rank"]
    m = x.view(ROWS_OF_MATRIX, -1)
    e = torch.zeros_like(m)
    qt = torch.randn(1, rank, m.shape[1], device=x.device)
    p = torch.empty(1, m.shape[0], rank, device=x.device)
    q = torch.empty_like(qt)
    out = torch.empty_like(m)

    def compress():
        _C.powersgd_project([m], [e], True, qt, p)
        _C.powersgd_orthogonalize(p, 0.0)
        _C.powersgd_back_project([e], p, q)
        _C.powersgd_reconstruct(p, q, [e], 1.0, True)
    compress()
    return compress, lambda: _C.powersgd_reconstruct(p, q, [out], 1.0, False), (p.numel() + q.numel()) * 4


def ours(spec, x):
    cfg = hc.parse_spec(spec)
    if cfg.info.rounds == 2:
        return ours_powersgd(spec, x)
    kid = cfg.info.kernel_id
    p = kernel_params(cfg, x.numel(), seed=12345)
    payload = _C.new_payload(kid, x, p)
    out = torch.empty_like(x)
    e = torch.zeros_like(x)
    carry = torch.zeros(_C.ef_carry_size(kid), device=x.device)
    if cfg.info.state_slots:
        u, v = torch.zeros_like(x), torch.zeros_like(x)
        compress = lambda: _C.encode_with_state(kid, x, [u, v], p, payload)  # noqa: E731
    elif cfg.ef == "vanilla":
        compress = lambda: _C.ef_encode(kid, x, e, carry, p, payload)  # noqa: E731
    else:
        compress = lambda: _C.encode(kid, x, p, payload)  # noqa: E731
    compress()
    wire = _C.encoded_bytes(kid, payload, x, p)
    return compress, lambda: _C.decode(kid, payload, out, p, 1.0, False), wire


def torch_ops(name, x, k):
    n = x.numel()
    e = torch.zeros_like(x)
    state = {}
    if name == "fp16":
        state["h"] = x.half()
        return lambda: x.half(), lambda: state["h"].float()
    if name == "bf16":
        state["h"] = x.bfloat16()
        return lambda: x.bfloat16(), lambda: state["h"].float()
    if name in ("onebit", "signsgd"):  # GRACE-style: one byte per sign, scale from abs().mean()
        def c():
            state["s"], state["scale"] = (x < 0).to(torch.uint8), x.abs().mean()
        c()
        return c, lambda: torch.where(state["s"].bool(), -state["scale"], state["scale"])
    if name == "efsignsgd":
        def c():
            p = x + e
            s, scale = p < 0, p.abs().mean()
            e.copy_(p - torch.where(s, -scale, scale))
            state["s"], state["scale"] = s.to(torch.uint8), scale
        c()
        return c, lambda: torch.where(state["s"].bool(), -state["scale"], state["scale"])
    if name == "topk":
        def c():
            _, idx = torch.topk(x.abs(), k, sorted=False)
            state["i"], state["v"] = idx.int(), x[idx]
        c()
        return c, lambda: torch.zeros_like(x).scatter_(0, state["i"].long(), state["v"])
    if name == "randomk":  # the same stratified draw, from torch ops
        lo = torch.arange(k, device=x.device) * n // k
        size = (torch.arange(1, k + 1, device=x.device) * n // k) - lo
        g = torch.Generator(device=x.device).manual_seed(0)

        def c():
            state["i"] = lo + (torch.rand(k, generator=g, device=x.device) * size).long()
            state["v"] = x[state["i"]]
        c()
        return c, lambda: torch.zeros_like(x).scatter_(0, state["i"], state["v"])
    if name == "minmax8":  # per-chunk min/max and uint8 codes, in torch ops
        c = 4096
        m = n // c * c  # whole chunks only; the ragged tail is under 0.02% of the input

        def c8():
            v = x[:m].view(-1, c)
            lo, hi = v.amin(1, keepdim=True), v.amax(1, keepdim=True)
            state["lo"], state["step"] = lo, (hi - lo) / 255
            state["q"] = ((v - lo) * (255 / (hi - lo))).round_().to(torch.uint8)
        c8()
        return c8, lambda: state["lo"] + state["q"].float() * state["step"]
    if name in ("dithering", "qsgd", "terngrad"):  # linear levels, stochastic rounding, int8 codes
        s = {"dithering": 8, "qsgd": 127, "terngrad": 1}[name]

        def cq():
            a = x.abs()
            if name == "qsgd":
                norm = torch.linalg.vector_norm(x)
            elif name == "terngrad":
                norm = torch.minimum(a.max(), 2.5 * x.std())
            else:
                norm = a.max()
            t = (a * (s / norm)).clamp_(max=s)
            f = t.floor()
            lev = f + (torch.rand_like(t) < t - f)
            state["q"], state["norm"] = (lev * x.sign()).to(torch.int8), norm
        cq()
        return cq, lambda: state["q"].float() * (state["norm"] / s)
    if name == "natural":
        def cn():
            m, ex = torch.frexp(x.abs())
            up = torch.rand_like(x) < 2 * m - 1
            state["e"], state["s"] = (ex - 1 + up).to(torch.int8), x < 0
        cn()
        return cn, lambda: torch.where(state["s"], -1.0, 1.0) * torch.ldexp(torch.ones_like(x), state["e"].float())
    if name == "threshold":
        def ct():
            state["i"] = (x.abs() > THRESHOLD).nonzero().view(-1)
            state["v"] = x[state["i"]]
        ct()
        return ct, lambda: torch.zeros_like(x).scatter_(0, state["i"], state["v"])
    if name == "dgc":  # momentum correction, 1% sample threshold, masking
        u, v = torch.zeros_like(x), torch.zeros_like(x)

        def cd():
            u.mul_(0.9).add_(x)
            v.add_(u)
            a = v.abs()
            sample = a[::100]
            thr = torch.topk(sample, max(1, k // 100 // 10), sorted=False).values.min()
            idx = (a >= thr).nonzero().view(-1)
            state["i"], state["v"] = idx, v[idx]
            u[idx] = 0
            v[idx] = 0
        cd()
        return cd, lambda: torch.zeros_like(x).scatter_(0, state["i"], state["v"])
    if name == "powersgd":  # the same step from torch.matmul and torch.linalg.qr
        m = x.view(ROWS_OF_MATRIX, -1)
        e = torch.zeros_like(m)
        qt = torch.randn(2, m.shape[1], device=x.device)

        def cp():
            mm = m + e
            p, _ = torch.linalg.qr(mm @ qt.T)
            q = mm.T @ p
            e.copy_(mm - p @ q.T)
            state["p"], state["q"] = p, q
        cp()
        return cp, lambda: state["p"] @ state["q"].T
    raise KeyError(name)


DEVICE = torch.device("cpu")
ROWS_OF_MATRIX = 5000  # PowerSGD views the gradient as a 5000-row matrix
THRESHOLD = 2.576  # keeps ~1% of a standard normal gradient
ROWS = [("fp16", "fp16"), ("bf16", "bf16"), ("onebit", "onebit"), ("signsgd", "signsgd"),
        ("efsignsgd", "efsignsgd"), ("topk", "topk,k=0.01"), ("randomk", "randomk,k=0.01"),
        ("minmax8", "minmax8"), ("dithering", "dithering"), ("qsgd", "qsgd"),
        ("terngrad", "terngrad"), ("natural", "natural"), ("threshold", f"threshold,threshold={THRESHOLD}"),
        ("dgc", "dgc,k=0.001"), ("powersgd", "powersgd,rank=2")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10 MB, median of 3")
    ap.add_argument("--mb", type=float, default=None, help="fp32 gradient size in MB (100)")
    ap.add_argument("--runs", type=int, default=None, help="timed runs per cell (7)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default=results.DEFAULT_OUT, help="folder for json/csv/png")
    ap.add_argument("--codecs", default=None,
                    help="comma-separated row names to run (default: all): "
                    + ",".join(name for name, _ in ROWS))
    args = ap.parse_args()
    rows_run = ROWS
    if args.codecs:
        wanted = args.codecs.split(",")
        unknown = sorted(set(wanted) - {name for name, _ in ROWS})
        if unknown:
            ap.error(f"unknown codec(s) {','.join(unknown)}; choose from {','.join(n for n, _ in ROWS)}")
        rows_run = [(name, spec) for name, spec in ROWS if name in wanted]
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not (torch.cuda.is_available() and _C.built_with_cuda()):
        sys.exit("--device cuda needs a CUDA device and hvd_compress built with CUDA "
                 f"(torch.cuda.is_available()={torch.cuda.is_available()}, "
                 f"built_with_cuda={_C.built_with_cuda()})")
    args.mb = args.mb or (10.0 if args.quick else 100.0)
    args.runs = args.runs or (3 if args.quick else 7)
    torch.set_num_threads(args.threads)
    n = int(args.mb * 1e6 / 4)
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    gb = n * 4 / 1e9
    k = hc.get_codec("topk").kept({"k": 0.01}, n)
    n = n // ROWS_OF_MATRIX * ROWS_OF_MATRIX
    x = x[:n]

    y = torch.empty_like(x)
    copy_s = median_seconds(lambda: y.copy_(x), args.runs)
    read_s = median_seconds(lambda: x.sum(), args.runs)
    cuda = DEVICE.type == "cuda"
    where = torch.cuda.get_device_name() if cuda else f"{args.threads} thread(s), SIMD path: {_C.cpu_isa()}"
    print(f"{n:,} fp32 elements ({n * 4 / 1e6:.0f} MB), median of {args.runs}; {where}")
    print(f"memory: read-only x.sum() {gb / read_s:.1f} GB/s, copy y.copy_(x) {gb / copy_s:.1f} GB/s")
    header = (f"| {'codec':26s} | {'wire bytes':>12s} | {'compress GB/s':>13s} | "
              + (f"{'% of copy':>9s} | " if cuda else "")
              + f"{'torch ops GB/s':>14s} | {'speedup':>7s} | {'decompress GB/s':>15s} | "
              f"{'torch ops GB/s':>14s} |")
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    rows = []
    for name, spec in rows_run:
        c_ours, d_ours, wire = ours(spec, x)
        c_torch, d_torch = torch_ops(name, x, k)
        r = {"codec": spec, "wire_bytes": wire,
             "compress_gbps": gb / median_seconds(c_ours, args.runs),
             "compress_torch_gbps": gb / median_seconds(c_torch, args.runs),
             "decompress_gbps": gb / median_seconds(d_ours, args.runs),
             "decompress_torch_gbps": gb / median_seconds(d_torch, args.runs)}
        rows.append(r)
        share = f"{100 * r['compress_gbps'] * copy_s / gb:8.0f}% | " if cuda else ""
        print(f"| {spec:26s} | {wire:12,d} | {r['compress_gbps']:13.2f} | {share}"
              f"{r['compress_torch_gbps']:14.2f} | "
              f"{r['compress_gbps'] / r['compress_torch_gbps']:6.1f}x | "
              f"{r['decompress_gbps']:15.2f} | {r['decompress_torch_gbps']:14.2f} |", flush=True)
    settings = {"elements": n, "threads": args.threads, "runs": args.runs, "device": where,
                "copy_gbps": gb / copy_s, "read_gbps": gb / read_s, "simd": _C.cpu_isa()}
    name = "codecs_cuda" if cuda else "codecs"
    results.write(args.out, name, settings, rows)
    plot(rows, settings, args.out, name)


def plot(rows, settings, out_dir, name):
    plt = results.pyplot()
    fig, ax = plt.subplots(figsize=(11, 4.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["compress_gbps"] for r in rows], 0.4, label="hvd_compress kernel")
    ax.bar([x + 0.2 for x in xs], [r["compress_torch_gbps"] for r in rows], 0.4,
           label="same math in torch ops")
    ax.axhline(settings["read_gbps"], color="gray", linestyle="--", linewidth=0.8,
               label="read-only pass (x.sum())")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["codec"] for r in rows], rotation=45, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("compress GB/s (fp32 input)")
    ax.set_title(f"{settings['elements'] * 4 / 1e6:.0f} MB gradient, {settings['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"{name}.png"), dpi=110)


if __name__ == "__main__":
    main()
