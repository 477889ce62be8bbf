"""Error feedback as a training step pays for it: the step transaction's backup of the residual
(hvd_compress.state) and ef_encode, done the two ways the store can do them, on one gradient.

    python bench/ef_step.py                      # 16M fp32 elements, 1 thread, median of 7
    python bench/ef_step.py --codecs onebit,topk --mb 16

- copy, then in place: the backup copies the residual into the buffer kept for it, and the
  kernel updates the residual in place (what a bucket's residual and TensorFlow still do);
- into the kept buffer: the kernel reads the old residual (the backup, left as it was) and writes
  the new one into the kept buffer (StateStore.rewrite: PyTorch, each gradient alone).

Both in the same run, alternating step by step, each on its own residuals started alike and fed
the same gradients (a residual's sparsity changes how much threshold and top-k send, so the two
must see the same steps); ms per step and the gradient's fp32 bytes / time.
Results go to docs/benchmarks/ef_step.{json,csv,png} (--out to change the folder).
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

SPECS = {"onebit": "onebit,ef=vanilla", "efsignsgd": "efsignsgd", "topk": "topk,k=0.01,ef=vanilla",
         "randomk": "randomk,k=0.01,ef=vanilla", "minmax8": "minmax8,ef=vanilla",
         "dithering": "dithering,ef=vanilla", "qsgd": "qsgd,ef=vanilla",
         "threshold": "threshold,threshold=2.0,ef=vanilla"}


def measure(spec, grads, runs):
    cfg = hc.parse_spec(spec)
    kid = cfg.info.kernel_id
    p = kernel_params(cfg, grads[0].numel(), seed=12345)
    payload = _C.new_payload(kid, grads[0], p)
    start = torch.randn(grads[0].shape, generator=torch.Generator().manual_seed(1)) * 0.1
    # per way: [live residual, kept buffer, carry]
    state = {way: [start.clone(), torch.empty_like(start),
                   torch.zeros(_C.ef_carry_size(kid))] for way in ("copy", "kept")}

    def copy_then_in_place(x):
        live, kept, carry = state["copy"]
        kept.copy_(live)
        _C.ef_encode(kid, x, live, carry, p, payload)

    def into_kept(x):
        live, kept, carry = state["kept"]
        _C.ef_encode(kid, x, kept, carry, p, payload, e_in=live)
        state["kept"][:2] = kept, live

    times = {"copy": [], "kept": []}
    for step in range(runs + 1):  # the first step is a warm-up: pages touched
        x = grads[step % len(grads)]
        for way, fn in (("copy", copy_then_in_place), ("kept", into_kept)):
            t0 = time.perf_counter()
            fn(x)
            if step:
                times[way].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=64.0, help="fp32 gradient size in MB (64)")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--codecs", default=",".join(SPECS), help="comma-separated: " + ", ".join(SPECS))
    ap.add_argument("--out", default=results.DEFAULT_OUT)
    args = ap.parse_args()
    wanted = args.codecs.split(",")
    unknown = [c for c in wanted if c not in SPECS]
    if unknown:
        sys.exit(f"unknown codec(s) {unknown}; valid: {', '.join(SPECS)}")
    torch.set_num_threads(1)
    n = int(args.mb * 1e6 / 4)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen) for _ in range(3)]
    print(f"{n:,} fp32 elements ({args.mb:g} MB), median of {args.runs}, 1 thread, "
          f"SIMD path: {_C.cpu_isa()}")
    rows, lines = [], []
    for name in wanted:
        t = measure(SPECS[name], grads, args.runs)
        rows.append({"codec": name, "spec": SPECS[name], "copy_then_in_place_ms": 1e3 * t["copy"],
                     "into_kept_ms": 1e3 * t["kept"]})
        lines.append([SPECS[name], f"{1e3 * t['copy']:.1f}", f"{4 * n / t['copy'] / 1e9:.2f}",
                      f"{1e3 * t['kept']:.1f}", f"{4 * n / t['kept'] / 1e9:.2f}",
                      f"{t['copy'] / t['kept']:.2f}x"])
    print(results.markdown(["spec", "copy + in place ms", "GB/s", "into kept ms", "GB/s",
                            "speedup"], lines))
    results.write(args.out, "ef_step", {"elements": n, "runs": args.runs, "threads": 1}, rows)
    plt = results.pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    at = range(len(rows))
    ax.bar([i - 0.2 for i in at], [r["copy_then_in_place_ms"] for r in rows], 0.4,
           label="backup copy, then ef_encode in place")
    ax.bar([i + 0.2 for i in at], [r["into_kept_ms"] for r in rows], 0.4,
           label="ef_encode into the kept buffer")
    ax.set_xticks(list(at))
    ax.set_xticklabels([r["codec"] for r in rows])
    ax.set_ylabel("ms per step, one thread")
    ax.set_title(f"error feedback and its step backup, {n:,} fp32 elements")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "ef_step.png"), dpi=110)


if __name__ == "__main__":
    main()
