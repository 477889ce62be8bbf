"""Numpy simulation of a codec's whole reduction over all ranks (each rank can compute every
rank's gradient from seeds), shared by the torch and TensorFlow parallel tests."""
import os

import numpy as np
import torch

import numpy_ref as ref
from helpers import random_grad, t2n
from hvd_compress.torch import _C
import hvd_compress as hc
from hvd_compress import collectives as col
from hvd_compress.spec import masks_momentum, spec_momentum
from hvd_compress.powersgd import PowerSGDState, matrix_shape

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
# Whether the launcher runs Horovod over Gloo (horovodrun --gloo, tests/nodes.py): the plans then
# gather between two ranks by a sum (collectives.gather_rows), and fp16 takes that way under
# auto. test_torch_collectives checks this against hvd.gloo_enabled().
GLOO = os.environ.get("HOROVOD_CONTROLLER") == "gloo"


class Simulation:
    """Every rank's codec pipeline in numpy, then the collective strategy the plan picks for
    this tensor (hvd_compress.collectives.choose: which strategy is policy; the arithmetic here
    is numpy_ref's)."""

    def __init__(self, spec, n, dtype, world, name="w", plain=False):
        """plain: the tensor travels uncompressed whatever the codec (under min_compress_bytes,
        fewer dimensions than the codec takes): the spec's momentum, then Horovod's average."""
        self.world = world
        self.plain = plain
        self.name = name
        self.cfg = hc.parse_spec(spec)
        self.n, self.dtype = n, dtype
        self.k = self.cfg.info.kept(self.cfg.param_dict, n)
        self.e = [ref.zeros(n, dtype) for _ in range(world)]
        self.m = [ref.zeros(n, dtype) for _ in range(self.world)]
        self.u = [ref.zeros(n, dtype) for _ in range(self.world)]  # DGC velocity
        self.owner_e = {}  # chunk index -> its owner's residual
        self.step = 0
        self.strategy = None

    def _plain(self, grads):
        """spec.spec_momentum per rank (the optimizer's own is 0), then Horovod's own Average:
        sum, then times 1/size."""
        taken = spec_momentum(self.cfg)
        if taken is not None:
            kind, factor, slot = taken
            step = ref.nesterov if kind == "nesterov" else ref.heavy_ball
            # the slot the codec's own steps keep (DGC's velocity), for a tensor that travels
            # compressed in some steps and uncompressed in others
            held = self.u if slot == "dgc_velocity" else self.m
            grads = list(grads)
            for r in range(self.world):
                grads[r], held[r] = step(grads[r], held[r], factor, self.dtype)
        acc = rank_sum([ref.to_acc(g, self.dtype) for g in grads])
        return ref.from_acc(acc * ref.acc_type(self.dtype)(1.0 / self.world), self.dtype)

    def job(self, rank):
        return col.Job(name=self.name, n=self.n, itemsize=ITEMSIZE[self.dtype], config=self.cfg,
                       rank=rank, world=self.world, average=True, opname=self.name,
                       step=self.step, fields_step=self.step, gloo=GLOO)

    def __call__(self, grads):
        cfg, dtype, n = self.cfg, self.dtype, self.n
        info = cfg.info
        if self.plain or cfg.codec == "none":
            return self._plain(grads)
        self.strategy = col.choose(self.job(0))
        if self.strategy == col.COMPRESSED_ALLREDUCE:
            return self._compressed(grads)
        if self.strategy == col.HOMOMORPHIC:
            return self._homomorphic(grads)

        def seed(r):
            key = hc.seed_name(self.name, r, info.seed_per_rank)
            return hc.derive_seed(cfg.seed, key, self.step) if info.uses_seed else 0
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
                if masks_momentum(cfg):
                    self.m[r][self.e[r] == 0] = 0
            else:
                pl = ref.encode(cfg.codec, x, dtype, seed=seed(r), prescale=prescale, **fields)
            payloads.append(pl)
        seed0 = seed(0)
        self.step += 1
        if cfg.codec == "fp16" and self.strategy == col.ALLREDUCE:  # Horovod's half sum of
            # pre-divided halves; gathered (2 ranks), our float32 sum of them
            hs = [np.frombuffer(pl, np.float16).astype(np.float32) for pl in payloads]
            summed = rank_sum(hs).astype(np.float16).tobytes()
            return ref.decode("fp16", summed, n, dtype, 1.0)
        if cfg.codec == "randomk":
            vals = [ref.to_acc(np.frombuffer(pl, ref._np_dtype(dtype)), dtype) for pl in payloads]
            summed = ref.from_acc(rank_sum(vals), dtype).tobytes()
            return ref.decode("randomk", summed, n, dtype, 1.0 / self.world, k=self.k, seed=seed0)
        alpha = info.average_factors(True, self.world)[1]
        return ref.aggregate(cfg.codec, payloads, n, dtype, alpha, k=self.k)


    def _compressed(self, grads):
        """The compressed allreduce: chunks encoded by every rank (worker residual), each
        owner sums its chunk's payloads and encodes the sum again (owner residual), every
        chunk decoded by every rank."""
        cfg, dtype, w = self.cfg, self.dtype, self.world
        info = cfg.info
        owner_info = col.server_info(info)

        def seed_of(part, codec_info):
            return hc.derive_seed(cfg.seed, part.seed_key, self.step) if codec_info.uses_seed else 0

        sent = []  # sent[r][j]: rank r's payload of chunk j
        for r, g in enumerate(grads):
            x = g
            if cfg.momentum == "nesterov":
                x, self.m[r] = ref.nesterov(x, self.m[r], cfg.mu, dtype)
            row = []
            for p in col.chunks(self.job(r)):
                a, b, f = p.start, p.stop, p.field_dict
                f.pop("rescale", None)
                if cfg.codec == "dgc":
                    pl, self.u[r][a:b], self.e[r][a:b] = ref.dgc_encode(
                        x[a:b], self.u[r][a:b], self.e[r][a:b], dtype, **f)
                elif cfg.ef == "vanilla":
                    pl, self.e[r][a:b] = ref.ef_encode(cfg.codec, x[a:b], self.e[r][a:b], dtype,
                                                       seed=seed_of(p, info), **f)
                    if masks_momentum(cfg):
                        self.m[r][a:b][self.e[r][a:b] == 0] = 0
                else:
                    pl = ref.encode(cfg.codec, x[a:b], dtype, seed=seed_of(p, info), **f)
                row.append(pl)
            sent.append(row)
        out = ref.zeros(self.n, dtype)
        for j, p in enumerate(col.chunks(self.job(0), owner_key=True)):
            a, b, f = p.start, p.stop, p.field_dict
            summed = ref.aggregate(cfg.codec, [sent[r][j] for r in range(w)], b - a, dtype,
                                   1.0 / w, k=f.get("k", 0))
            enc = {k: v for k, v in f.items() if k not in ("momentum_factor", "clip_norm")}
            if cfg.ef == "vanilla":
                e = self.owner_e.get(j, ref.zeros(b - a, dtype))
                pl, self.owner_e[j] = ref.ef_encode(owner_info.name, summed, e, dtype,
                                                    seed=seed_of(p, owner_info), **enc)
            else:
                pl = ref.encode(owner_info.name, summed, dtype, seed=seed_of(p, owner_info), **enc)
            out[a:b] = ref.decode(owner_info.name, pl, b - a, dtype, 1.0, k=f.get("k", 0))
        self.step += 1
        return out


    def _homomorphic(self, grads):
        """Shared per-block scales (max over ranks, NaN taken as inf), every rank's codes packed
        into int32 lanes, the words summed as int32 with wraparound, decoded once."""
        cfg, dtype, n, w = self.cfg, self.dtype, self.n, self.world
        levels, block = col.homomorphic_settings(cfg.info, col.whole(self.job(0)).field_dict)
        ps = []
        for r, g in enumerate(grads):
            x = g
            if cfg.momentum == "nesterov":
                x, self.m[r] = ref.nesterov(x, self.m[r], cfg.mu, dtype)
            if cfg.ef == "vanilla":
                x = ref.from_acc(ref.to_acc(x, dtype) + ref.to_acc(self.e[r], dtype), dtype)
            ps.append(x)
        maxima = [ref.homo_block_absmax(p, dtype, block) for p in ps]
        scales = np.max([np.where(np.isnan(m), np.float32(np.inf), m) for m in maxima], axis=0)
        words = []
        for r, p in enumerate(ps):
            seed = hc.derive_seed(cfg.seed, hc.seed_name(f"{self.name}/homomorphic", r, True),
                                  self.step)
            words.append(ref.homo_encode(p, dtype, scales, block, levels, w, seed))
            if cfg.ef == "vanilla":
                self.e[r] = ref.homo_decode(words[-1], n, dtype, scales, block, levels, w, 1,
                                            -1.0, out=p)
        total = np.sum([wd.astype(np.int64) for wd in words], axis=0) & 0xFFFFFFFF
        summed = total.astype(np.uint32).view(np.int32)
        self.step += 1
        return ref.homo_decode(summed, n, dtype, scales, block, levels, w, w, 1.0 / w)


class TwoLevelSimulation:
    """hierarchical=true over nodes of per_node ranks (rank = node * per_node + local rank):
    each node's shards summed in rank order and averaged over the node, each shard through the
    codec's strategy between the nodes with its own residuals, the shards put back together.
    hierarchical=fp16: float32 gradients cross the node as float16 (rounded to nearest even),
    the sum still in float32, and so do the shards they come back as, unless the node shares
    the shards encoded (collectives.node_share): then every rank decodes them as their owner."""

    def __init__(self, spec, n, nodes, per_node, dtype="float32"):
        self.n, self.dtype, self.nodes, self.per_node = n, dtype, nodes, per_node
        self.half = "hierarchical=fp16" in spec and dtype == "float32"
        job = col.Job(name="w", n=n, itemsize=ITEMSIZE[dtype], config=hc.parse_spec(spec),
                      rank=0, world=nodes * per_node, average=True, opname="w",
                      nodes=(0, per_node, 0, nodes), gloo=GLOO)
        self.encoded = col.node_share(job) is not None
        inner = spec.replace(",hierarchical=true", "").replace(",hierarchical=fp16", "")
        self.bounds = col.chunk_bounds(n, per_node)
        self.inner = [Simulation(inner, self.bounds[j + 1] - self.bounds[j], dtype, nodes,
                                 name=f"w/shard{j}") for j in range(per_node)]

    def _leg(self, a):
        return a.astype(np.float16).astype(np.float32) if self.half else a

    def __call__(self, grads):
        A = ref.acc_type(self.dtype)
        out = []
        for j, sim in enumerate(self.inner):
            a, b = self.bounds[j], self.bounds[j + 1]
            shards = []
            for c in range(self.nodes):
                rows = [self._leg(grads[c * self.per_node + lr][a:b])
                        for lr in range(self.per_node)]
                acc = ref.to_acc(rows[0], self.dtype).astype(A)
                for row in rows[1:]:
                    acc = acc + ref.to_acc(row, self.dtype)
                shards.append(ref.from_acc(acc * A(1.0 / self.per_node), self.dtype))
            out.append(sim(shards) if self.encoded else self._leg(sim(shards)))
        return np.concatenate(out)


class PowerSGDSimulation:
    """Both ranks' PowerSGD steps in float64 numpy (the kernels sum in a different order, so
    results are compared with a tolerance)."""

    def __init__(self, spec, name, world):
        self.cfg = hc.parse_spec(spec)
        self.st = PowerSGDState.from_config(self.cfg)
        self.name, self.world = name, world
        self.e = None
        self.qt = None
        self.m = None  # per rank, under momentum=nesterov
        self.step = 0

    def _nesterov(self, grads):
        """The spec's momentum, before anything else: m = mu*m + g; g = mu*m + g."""
        if self.cfg.momentum != "nesterov":
            return grads
        mu = self.cfg.mu
        if self.m is None:
            self.m = [np.zeros_like(g, np.float64) for g in grads]
        self.m = [mu * m + g for m, g in zip(self.m, grads)]
        return [mu * m + g for m, g in zip(self.m, grads)]

    def __call__(self, grads):
        st, step = self.st, self.step
        self.step += 1
        grads = self._nesterov(grads)
        mats = [g.reshape(matrix_shape(g.shape)).astype(np.float64) for g in grads]
        if step < st.start_iter or not st.compresses(grads[0].shape):
            return sum(mats) / self.world
        rows, cols = mats[0].shape
        if self.e is None:
            self.e = [np.zeros_like(m) for m in mats]
        if self.qt is None or not st.warm_start:
            # the kernel both frontends draw the first Q with
            self.qt = _C.powersgd_initial_q(hc.derive_seed(st.seed, self.name, step), st.rank,
                                            cols, True).numpy()
        if st.error_feedback:
            mats = [m + e for m, e in zip(mats, self.e)]
        p = sum(m @ self.qt.T for m in mats)
        for c in range(st.rank):
            p[:, c] /= np.linalg.norm(p[:, c]) + st.orthogonalization_epsilon
            for c2 in range(c + 1, st.rank):
                p[:, c2] -= (p[:, c] @ p[:, c2]) * p[:, c]
        qs = [m.T @ p for m in mats]
        if st.error_feedback:
            self.e = [m - p @ q.T for m, q in zip(mats, qs)]
        q = sum(qs) / self.world
        self.qt = q.T.copy()
        return p @ q.T


class PowerSGDKernelSimulation(PowerSGDSimulation):
    """Every rank's PowerSGD step on the kernels both frontends call (in the gradients' dtype,
    float32 or float64), with the collectives' sums done here in rank order: the frontends'
    results bit for bit, where PowerSGDSimulation's float64 arithmetic only comes within a
    tolerance. `e` (per rank) and `qt` are the state the frontends keep."""

    def _nesterov(self, grads):
        """Rounded to the gradients' dtype at each operation, as the kernel."""
        if self.cfg.momentum != "nesterov":
            return grads
        if self.m is None:
            self.m = [np.zeros_like(g) for g in grads]
        out = []
        for r, g in enumerate(grads):
            x, self.m[r] = ref.nesterov(g, self.m[r], self.cfg.mu, g.dtype.name)
            out.append(x)
        return out

    def off(self, grads):
        """A step that compression sits out (the TF reducer's `enabled` off): the spec's
        momentum and Horovod's average; no step counted."""
        grads = self._nesterov(grads)
        return rank_sum(grads) * grads[0].dtype.type(1.0 / self.world)

    def __call__(self, grads):
        st, step = self.st, self.step
        self.step += 1
        grads = self._nesterov(grads)
        shape, dtype = grads[0].shape, grads[0].dtype
        if step < st.start_iter or not st.compresses(shape):
            return rank_sum(grads) * dtype.type(1.0 / self.world)  # Horovod's Average
        rows, _ = matrix_shape(shape)
        mats = [torch.from_numpy(g.reshape(rows, -1).copy()) for g in grads]
        cols, ftype = mats[0].shape[1], mats[0].dtype
        if self.e is None:
            self.e = [torch.zeros_like(m) for m in mats]
        if self.qt is None or not st.warm_start:
            self.qt = _C.powersgd_initial_q(hc.derive_seed(st.seed, self.name, step), st.rank,
                                            cols, ftype == torch.float64)
        ps = []
        for r in range(self.world):  # M = G + E (into E), P = M Q
            ps.append(torch.empty(1, rows, st.rank, dtype=ftype))
            _C.powersgd_project([mats[r]], [self.e[r]] if st.error_feedback else [],
                                st.error_feedback, self.qt[None].clone(), ps[r])
        m = self.e if st.error_feedback else mats
        p = torch.from_numpy(rank_sum([t.numpy() for t in ps]))
        _C.powersgd_orthogonalize(p, st.orthogonalization_epsilon)
        qs = []
        for r in range(self.world):  # Q_r = M^T P, E = M - P Q_r^T
            qs.append(torch.empty(1, st.rank, cols, dtype=ftype))
            _C.powersgd_back_project([m[r]], p, qs[r])
            if st.error_feedback:
                _C.powersgd_reconstruct(p, qs[r], [m[r]], 1.0, True)
        q = torch.from_numpy(rank_sum([t.numpy() for t in qs])).mul_(1.0 / self.world)
        self.qt = q[0].clone()
        out = torch.empty(rows, cols, dtype=ftype)
        _C.powersgd_reconstruct(p, q, [out], 1.0, False)
        return out.numpy().reshape(shape)


def rank_sum(arrays):
    """Rank 0 + rank 1 + ..., as the collective adds (Python's sum() starts at +0, which would
    turn -0.0 into +0.0)."""
    total = arrays[0]
    for a in arrays[1:]:
        total = total + a
    return total


def grads_for_step(n, dtype, step, world):
    return [t2n(random_grad(n, dtype, seed=1000 * step + r)) for r in range(world)]


BPPS_SPECS = ["none", "onebit,ef=vanilla", "topk,k=0.05,ef=vanilla",
              "powersgd,rank=2,start_iter=1"]
# a matrix, so that PowerSGD factors it (a vector it would send uncompressed)
BPPS_SHAPE = (60, 50)


def bpps_pass_grads(step, p, world, shape=BPPS_SHAPE):
    n = int(np.prod(shape))
    return [g.reshape(shape) for g in grads_for_step(n, "float32", 100 * step + p, world)]


def bpps_weights(spec, steps, passes, lr, world, name="w", shape=BPPS_SHAPE):
    """Weights of one float32 parameter after `steps` updates of SGD(lr) with
    backward_passes_per_step=`passes`, from zeros: each rank sums its passes' gradients in pass
    order, the sum goes through the codec once, the update is w - lr * aggregate (lr a power of
    two, so that no framework's fused multiply-add can round differently)."""
    n = int(np.prod(shape))
    if hc.parse_spec(spec).codec == "powersgd":
        sim = PowerSGDKernelSimulation(spec, name, world)
    else:
        flat = Simulation(spec, n, "float32", world, name=name)
        sim = lambda gs: flat([g.reshape(-1) for g in gs]).reshape(shape)  # noqa: E731
    w = np.zeros(shape, np.float32)
    for step in range(steps):
        acc = bpps_pass_grads(step, 0, world, shape)
        for p in range(1, passes):
            acc = [a + g for a, g in zip(acc, bpps_pass_grads(step, p, world, shape))]
        w = w - np.float32(lr) * sim(acc)
    return w

