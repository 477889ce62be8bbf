"""Numpy simulation of a codec's whole reduction over all ranks (each rank can compute every
rank's gradient from seeds), shared by the torch and TensorFlow parallel tests."""
import numpy as np

import numpy_ref as ref
from helpers import random_grad, t2n
import hvd_compress as hc


class Simulation:
    """Both ranks' codec pipelines in numpy, then the collective the codec uses."""

    def __init__(self, spec, n, dtype, world, name="w"):
        self.world = world
        self.name = name
        self.cfg = hc.parse_spec(spec)
        self.n, self.dtype = n, dtype
        self.k = self.cfg.info.kept(self.cfg.param_dict, n)
        self.e = [ref.zeros(n, dtype) for _ in range(world)]
        self.m = [ref.zeros(n, dtype) for _ in range(self.world)]
        self.u = [ref.zeros(n, dtype) for _ in range(self.world)]  # DGC velocity
        self.step = 0

    def __call__(self, grads):
        cfg, dtype, n = self.cfg, self.dtype, self.n
        info = cfg.info

        def seed(r):
            key = hc.seed_name(self.name, r, info.seed_per_rank)
            return hc.derive_seed(cfg.seed, key, self.step) if info.uses_seed else 0
        if cfg.codec == "none":  # Horovod's own Average: sum, then times 1/size
            acc = rank_sum([ref.to_acc(g, dtype) for g in grads])
            return ref.from_acc(acc * ref.acc_type(dtype)(1.0 / self.world), dtype)
        prescale = 1.0 / self.world if cfg.info.prescale_average else 1.0
        fields = {**cfg.kernel_fields(n, self.step)}
        fields.pop("rescale", None)
        payloads = []
        for r, g in enumerate(grads):
            x = g
            if cfg.momentum == "nesterov":
                x, self.m[r] = ref.nesterov(x, self.m[r], cfg.mu, dtype)
            if cfg.codec == "dgc":  # e holds the accumulator
                pl, self.u[r], self.e[r] = ref.dgc_encode(x, self.u[r], self.e[r], dtype, **fields)
            elif cfg.ef == "vanilla":
                pl, self.e[r] = ref.ef_encode(cfg.codec, x, self.e[r], dtype, prescale=prescale,
                                              seed=seed(r), **fields)
            else:
                pl = ref.encode(cfg.codec, x, dtype, seed=seed(r), prescale=prescale, **fields)
            payloads.append(pl)
        seed0 = seed(0)
        self.step += 1
        if cfg.codec == "fp16":  # half sum of pre-divided halves
            hs = [np.frombuffer(pl, np.float16).astype(np.float32) for pl in payloads]
            summed = rank_sum(hs).astype(np.float16).tobytes()
            return ref.decode("fp16", summed, n, dtype, 1.0)
        if cfg.codec == "randomk":
            vals = [ref.to_acc(np.frombuffer(pl, ref._np_dtype(dtype)), dtype) for pl in payloads]
            summed = ref.from_acc(rank_sum(vals), dtype).tobytes()
            return ref.decode("randomk", summed, n, dtype, 1.0 / self.world, k=self.k, seed=seed0)
        return ref.aggregate(cfg.codec, payloads, n, dtype, 1.0 / self.world, k=self.k)


def rank_sum(arrays):
    """Rank 0 + rank 1 + ..., as the collective adds (Python's sum() starts at +0, which would
    turn -0.0 into +0.0)."""
    total = arrays[0]
    for a in arrays[1:]:
        total = total + a
    return total


def grads_for_step(n, dtype, step, world):
    return [t2n(random_grad(n, dtype, seed=1000 * step + r)) for r in range(world)]


