"""The expected result of gradient buckets (hvd_compress.buckets), shared by the torch and
TensorFlow bucket tests: the layout, and per bucket the numpy simulation of the codec on the
concatenation of its members' gradients (simulation.py), every rank's gradient from seeds."""
import numpy as np

from helpers import same_bits
from simulation import Simulation, grads_for_step
from hvd_compress import buckets
import hvd_compress as hc

# Given in this order, so backward order (the layout's) is the reverse: "emb" (5000 elements)
# is cut into 3 pieces of a 2000-element bucket, "bias", "w" and "v" share one bucket.
SHAPES = {"v": (300,), "w": (40, 30), "bias": (7,), "emb": (5000,)}
BUCKET_MB = 2000 * 4 / 2 ** 20


# granularity=tensor: three matrices (DGC compresses weights only) in one bucket, with top-k's
# k as a fraction, as a count per tensor, and DGC's; the sign codecs' scale per member (their
# error feedback's lazy scale, one per member), and the quantisers' norms and seeds per member.
GRANULAR_SHAPES = {"a": (30, 20), "b": (10, 50), "c": (64, 8)}
GRANULAR_SPECS = ["topk,k=0.05,ef=vanilla", "topk,k=7,ef=vanilla,momentum=nesterov",
                  "dgc,k=0.05", "dgc,k=0.05,warmup_steps=2", "onebit,ef=vanilla", "efsignsgd",
                  "dithering,ef=vanilla"]


def granular_grads(step, world):
    return {name: [g.reshape(shape) for g in
                   grads_for_step(int(np.prod(shape)), "float32", 10 * step + i, world)]
            for i, (name, shape) in enumerate(GRANULAR_SHAPES.items())}


def check_granularity(spec, run):
    """`run(spec, bucket_mb)` reduces granular_grads for 3 steps with a fresh optimizer and
    returns ({name: reduced} per step, the names its statistics list). Under
    granularity=tensor one bucket must give the bits of each tensor sent alone; under the
    default granularity the selection spans the bucket, and the bits differ."""
    alone, _ = run(f"{spec},collective=allgather", 0)
    in_tensors, names = run(f"{spec},granularity=tensor", 1)
    in_bucket, _ = run(spec, 1)
    assert set(names) == {"hvd_compress.bucket0"}
    for step, (a, b) in enumerate(zip(alone, in_tensors)):
        for name in GRANULAR_SHAPES:
            assert same_bits(a[name], b[name]), f"{name} at step {step}"
    assert not all(same_bits(a[n], b[n]) for a, b in zip(alone, in_bucket)
                   for n in GRANULAR_SHAPES)


def step_grads(step, world):
    """Every rank's gradient of every parameter at this step: {name: [rank 0's, ...]}."""
    out = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        flat = grads_for_step(int(np.prod(shape)), "float32", 10 * step + i, world)
        out[name] = [g.reshape(shape) for g in flat]
    return out


def assert_reduced(got, want, horovod_sums, what, world, magnitude=None):
    """Bit for bit, except for the sums of Horovod's own allreduce at more than 2 ranks: its
    ring adds the ranks' values in an order that depends on how the fused buffer is segmented,
    not in rank order. Two orders of n-1 additions differ by at most 2(n-1) roundings of the
    partial sums, each at most half an ulp of sum(|x_r|): `magnitude` is that sum, of the
    values averaged (float16 ones for fp16, whose sums round to half precision)."""
    if world == 2 or not horovod_sums:
        assert same_bits(got, want), what
    elif horovod_sums == "half":
        bound = 2 * (world - 1) * 2.0 ** -11 * magnitude / world + 2.0 ** -24
        excess = np.abs(got.astype(np.float64) - want) - bound
        assert excess.max() <= 0, f"{what}: off by {excess.max():.3g} beyond the bound"
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=what)


class BucketOracle:
    """The expected reduction: each bucket simulated as one tensor named like the bucket, the
    parameters outside buckets (fewer dimensions than the codec takes) as Horovod's average
    of their gradients with the spec's momentum."""

    def __init__(self, spec, world, min_bytes=0):
        cfg = hc.parse_spec(spec)
        self.world = world
        order = [(name, int(np.prod(shape)), "float32", 4)
                 for name, shape in reversed(SHAPES.items()) if len(shape) >= cfg.info.min_dim]
        self.layout = buckets.layout(order, int(BUCKET_MB * 2 ** 20), min_bytes)
        inside = {m.name for b in self.layout for m in b.members}
        self.sims = {b.index: Simulation(spec, b.n, "float32", world, name=b.name)
                     for b in self.layout}
        self.plain = {name: Simulation(spec, int(np.prod(shape)), "float32", world, plain=True)
                      for name, shape in SHAPES.items() if name not in inside}
        # where the result is a sum by Horovod's allreduce (hvd_compress.collectives.family)
        linear = cfg.info.linear and cfg.collective == "auto"
        self.sums = {name: "half" if linear and cfg.codec == "fp16" and name in inside
                     else (linear or name in self.plain) for name in SHAPES}

    def check(self, got, want, what):
        for name in SHAPES:
            assert_reduced(got[name], want[name], self.sums[name] or not self.compressing,
                           f"{what}: {name}", self.world, self.magnitude[name])

    def __call__(self, grads, compressing=True):
        """compressing=False: a step that compression sits out (the TF reducer's `enabled`
        off): the spec's momentum, elementwise and so each bucket's own, then Horovod's
        average."""
        self.compressing = compressing
        for sim in self.sims.values():
            sim.plain = not compressing
        flat = {name: [g.reshape(-1) for g in gs] for name, gs in grads.items()}
        # EF adds fp16's rounding residual (under 2^-11 of each value): 2x covers it
        self.magnitude = {name: 2 * sum(np.abs(g.astype(np.float64)) for g in gs).reshape(
            SHAPES[name]) for name, gs in grads.items()}
        out = {name: np.empty(int(np.prod(shape)), np.float32) for name, shape in SHAPES.items()}
        for b in self.layout:
            per_rank = [np.concatenate([flat[m.name][r][m.start:m.stop] for m in b.members])
                        for r in range(self.world)]
            reduced, at = self.sims[b.index](per_rank), 0
            for m in b.members:
                out[m.name][m.start:m.stop] = reduced[at:at + m.n]
                at += m.n
        for name, sim in self.plain.items():
            out[name] = sim(flat[name])
        return {name: out[name].reshape(SHAPES[name]) for name in SHAPES}
