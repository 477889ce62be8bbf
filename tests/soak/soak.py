"""What the torch and TensorFlow memory soaks share: the stateful specs, the step count and
the resident-memory reading."""
from __future__ import annotations

import os

# Every kind of state: residuals (with the sign codecs' carries), the compressed allreduce's
# owner residuals, worker momentum, random-k's seeded draws, DGC's velocity and accumulator,
# PowerSGD's Q and error, threshold's variable-size payloads.
SPECS = ["onebit,ef=vanilla", "topk,k=0.01,ef=vanilla", "randomk,k=0.01,ef=vanilla",
         "efsignsgd", "minmax8,ef=vanilla,collective=allreduce",
         "onebit,ef=vanilla,momentum=nesterov,mu=0.9", "dgc,k=0.01",
         "powersgd,rank=4", "threshold,threshold=0.01,ef=vanilla"]
# `make soak`: the full 2000 steps; `make test` runs a shorter soak.
STEPS = int(os.environ.get("HVDC_SOAK_STEPS", "2000"))
WARM = min(200, STEPS // 3)  # allocators and caches settle by then
GROWTH = 0.05


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def check_flat(samples: list[int], spec: str) -> None:
    """samples[i]: resident bytes after step i."""
    base = samples[WARM]
    peak = max(samples[WARM:])
    assert peak <= base * (1 + GROWTH), (
        f"{spec}: resident memory grew {100 * (peak / base - 1):.1f}% between step {WARM} "
        f"({base / 2**20:.1f} MiB) and step {len(samples) - 1} (peak {peak / 2**20:.1f} MiB)")
