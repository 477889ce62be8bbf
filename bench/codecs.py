"""Codec throughput: our kernels beside the same operation built from plain torch ops, measured
in the same run on the same gradient.

    python bench/codecs.py                 # 100 MB fp32 gradient, 1 thread, median of 7 runs
    python bench/codecs.py --mb 10 --runs 3

GB/s = fp32 input bytes / time (for decompress too, so the columns compare). The header line
measures this machine's memory: a read-only pass (x.sum()) bounds any compressor, a copy bounds
anything that writes a gradient-sized output.
"""
import argparse
import json
import statistics
import time

import torch

import hvd_compress as hc
from hvd_compress.torch import _C
from hvd_compress.torch.codec import kernel_params


def median_seconds(fn, runs):
    fn()  # warm-up: page faults, caches
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ours(spec, x):
    cfg = hc.parse_spec(spec)
    kid = cfg.info.kernel_id
    p = kernel_params(cfg, x.numel(), seed=12345)
    payload = _C.new_payload(kid, x, p)
    out = torch.empty_like(x)
    e = torch.zeros_like(x)
    carry = torch.zeros(_C.ef_carry_size(kid))
    if cfg.ef == "vanilla":
        compress = lambda: _C.ef_encode(kid, x, e, carry, p, payload)  # noqa: E731
    else:
        compress = lambda: _C.encode(kid, x, p, payload)  # noqa: E731
    compress()
    return compress, lambda: _C.decode(kid, payload, out, p, 1.0, False), payload.numel() * payload.element_size()


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
        lo = torch.arange(k) * n // k
        size = (torch.arange(1, k + 1) * n // k) - lo
        g = torch.Generator().manual_seed(0)

        def c():
            state["i"] = lo + (torch.rand(k, generator=g) * size).long()
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
    raise KeyError(name)


ROWS = [("fp16", "fp16"), ("bf16", "bf16"), ("onebit", "onebit"), ("signsgd", "signsgd"),
        ("efsignsgd", "efsignsgd"), ("topk", "topk,k=0.01"), ("randomk", "randomk,k=0.01"), ("minmax8", "minmax8")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=100.0, help="fp32 gradient size in MB")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = int(args.mb * 1e6 / 4)
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    gb = n * 4 / 1e9
    k = hc.get_codec("topk").kept({"k": 0.01}, n)

    y = torch.empty_like(x)
    copy_s = median_seconds(lambda: y.copy_(x), args.runs)
    read_s = median_seconds(lambda: x.sum(), args.runs)
    print(f"{n:,} fp32 elements ({n * 4 / 1e6:.0f} MB), {args.threads} thread(s), "
          f"median of {args.runs}; SIMD path: {_C.cpu_isa()}")
    print(f"memory on this machine: read-only x.sum() {gb / read_s:.1f} GB/s, "
          f"copy y.copy_(x) {gb / copy_s:.1f} GB/s")
    header = (f"| {'codec':14s} | {'wire bytes':>12s} | {'compress GB/s':>13s} | "
              f"{'torch ops GB/s':>14s} | {'speedup':>7s} | {'decompress GB/s':>15s} | "
              f"{'torch ops GB/s':>14s} |")
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    rows = []
    for name, spec in ROWS:
        c_ours, d_ours, wire = ours(spec, x)
        c_torch, d_torch = torch_ops(name, x, k)
        r = {"codec": spec, "wire_bytes": wire,
             "compress_gbps": gb / median_seconds(c_ours, args.runs),
             "compress_torch_gbps": gb / median_seconds(c_torch, args.runs),
             "decompress_gbps": gb / median_seconds(d_ours, args.runs),
             "decompress_torch_gbps": gb / median_seconds(d_torch, args.runs)}
        rows.append(r)
        print(f"| {spec:14s} | {wire:12,d} | {r['compress_gbps']:13.2f} | "
              f"{r['compress_torch_gbps']:14.2f} | "
              f"{r['compress_gbps'] / r['compress_torch_gbps']:6.1f}x | "
              f"{r['decompress_gbps']:15.2f} | {r['decompress_torch_gbps']:14.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"elements": n, "threads": args.threads, "copy_gbps": gb / copy_s,
                       "read_gbps": gb / read_s,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
