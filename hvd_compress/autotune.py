"""Whether compression pays on this job, measured on its own steps (spec key `autotune=K`).

Compression trades CPU (encode, decode, bucket copies) for bytes on the link. On a fast link
with busy cores that trade can lose: two ranks sharing two vCPUs at 10 Gbit/s run ResNet-50
0.83-0.96x as fast as Horovod without compression (docs/benchmarks.md). Which side wins depends
on the link, the cores and the model, so it is measured rather than predicted:

    1. The first WARMUP steps warm both arms up, two compressed then two uncompressed, and are
       not timed: an arm's first steps make its plans, buffers and kernel dispatch, and
       Horovod negotiates its tensors' names (Keras' ResNet-50, 2 ranks on 2 cores: the
       uncompressed arm's first two steps took 912 and 494 ms, its later ones 356-412).
    2. The next 2K steps are the probe: compressed and uncompressed in turn, the order flipped
       in every pair so that a drift in step time weighs on both arms alike. An uncompressed
       step sends every gradient through Horovod's allreduce; its compression state stays as it
       was (residuals wait for the next compressed step), except for the spec's momentum,
       which the optimizer's own (set to 0) cannot replace.
    3. A step's time runs from its first gradient to the end of synchronize(): forward and the
       optimizer's update are the same in both arms, and a second model trained in between
       (bench/network.py --paired) stays out of it. A TensorFlow graph has no first-gradient
       hook, and times from the previous step's end (tensorflow/autotune.py says why).
    4. After the probe's last step, one allreduce sums each probe step's time over the ranks,
       so that every rank takes the same decision: compress from then on only if the median
       compressed step is at least MARGIN faster than the median uncompressed one. A closer
       call is within the probe's noise (on Keras' ResNet-50 at 10 Gbit/s, dithering's
       compressed median was 1% under its uncompressed one and its steps then ran 33% slower
       than Horovod's), and an uncompressed step loses nothing to compression error.

Steps in which a rank is joined (hvd.join) are not counted: that rank steps no further, so the
count stays the same on every rank, and they travel uncompressed anyway.
"""
from __future__ import annotations

import statistics
import time

WARMUP = 4
MARGIN = 0.05  # how much faster the compressed median must be; see step 4


class Autotune:
    """The probe's schedule, its times on this rank, and the decision once made."""

    def __init__(self, probes: int):
        self.probes = probes
        self.step = 0  # steps counted so far: the same on every rank
        self.times: list[float] = []  # this rank's seconds per probe step, in step order
        self.compress = None if probes else True  # the decision; None while undecided
        self.summed: list[float] | None = None  # the probe's times summed over the ranks
        self._began = None

    def compresses(self) -> bool:
        """Whether the step now being routed compresses."""
        if self.compress is not None:
            return self.compress
        return compressed_arm(self.step - WARMUP)

    def begin(self) -> None:
        """The step's first gradient."""
        if self._began is None:
            self._began = time.perf_counter()

    def end(self, counted: bool) -> bool:
        """The end of synchronize(); counted: every rank stepped. True when the decision is due
        (then decide() with the summed times, on every rank)."""
        began, self._began = self._began, None
        if not counted or self.compress is not None:
            return False
        if self.step >= WARMUP:  # a rank without a gradient in the step adds 0 to the sum
            self.times.append(0.0 if began is None else time.perf_counter() - began)
        self.step += 1
        return self.step == WARMUP + 2 * self.probes

    def decide(self, summed: list[float]) -> bool:
        self.summed = list(summed)
        self.compress = self.median(True) <= (1 - MARGIN) * self.median(False)
        return self.compress

    def median(self, compressed: bool) -> float:
        """The median summed probe step of one arm, in seconds."""
        return statistics.median(t for i, t in enumerate(self.summed)
                                 if compressed_arm(i) == compressed)

    def report(self) -> dict | None:
        """For compression_report(): the decision and the medians behind it (ms summed over
        the ranks), or None without autotune."""
        if not self.probes:
            return None
        out = {"probes": self.probes, "compress": self.compress}
        if self.summed is not None:
            out["compressed_ms"] = 1e3 * self.median(True)
            out["uncompressed_ms"] = 1e3 * self.median(False)
        return out


def compressed_arm(i: int) -> bool:
    """Whether probe step i (warm-up steps: i < 0) compresses: pairs (C, U), (U, C), ..."""
    if i < 0:
        return i < -WARMUP // 2
    pair, second = divmod(i, 2)
    return (pair % 2 == 0) != bool(second)
