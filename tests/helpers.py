"""Shared test helpers: torch <-> numpy (bfloat16 as uint16 bits) and kernel calls."""
from __future__ import annotations

import glob
import os

import numpy as np
import pytest
import torch

from hvd_compress.torch import _C

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float64": torch.float64}


def t2n(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16).copy()
    return t.numpy().copy()


def n2t(a: np.ndarray, dtype: str) -> torch.Tensor:
    if dtype == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def random_grad(n: int, dtype: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Mixed magnitudes, exact zeros and negative zeros, so sign and selection edge cases occur.
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.exp(
        torch.randn(n, generator=g, dtype=torch.float64) * 2)
    if n > 4:
        x[::7] = 0.0
        x[3::11] = -0.0
    return x.to(TORCH_DTYPES[dtype])


def params(k: int = 0, seed: int = 0, scaling: bool = True, prescale: float = 1.0,
           rescale: bool = False, chunk: int = 4096, **fields) -> _C.Params:
    p = _C.Params()
    p.k, p.seed, p.scaling, p.prescale, p.rescale = k, seed, scaling, prescale, rescale
    p.chunk = chunk
    for name, value in fields.items():
        setattr(p, name, value)
    return p


def payload_bytes(payload: torch.Tensor) -> bytes:
    return payload.contiguous().view(torch.uint8).numpy().tobytes()


def device_bits(t: torch.Tensor) -> bytes:
    """The tensor's bytes, every NaN as torch's one NaN: a NaN's own bits are the hardware's
    (x86 makes inf - inf the negative quiet NaN, CUDA the positive one, and they carry an
    operand's payload differently); that it is NaN, and where, is compared (tests/gpu)."""
    t = t.detach().cpu().contiguous()
    if t.is_floating_point():
        t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
    return t.view(torch.uint8).numpy().tobytes()


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def codec_strategies() -> list[tuple[str, str | None]]:
    """Every codec, alone (collective=auto: Horovod's allreduce or the allgather at 2 ranks)
    and forced onto each other strategy it has: collective=allreduce takes the compressed
    allreduce (or for the quantisers the homomorphic one where that is fewer bytes),
    collective=homomorphic the homomorphic allreduce (the matrix tests of both frontends)."""
    import hvd_compress as hc
    pairs = []
    for c in hc.codecs():
        pairs.append((c.name, None))
        if "compressed_allreduce" in c.strategies:
            pairs.append((c.name, "allreduce"))
        if "homomorphic" in c.strategies:
            pairs.append((c.name, "homomorphic"))
    return pairs


def join_specs() -> list[str]:
    """Every codec, error feedback on where it takes one, under each strategy it has (the join
    tests)."""
    import hvd_compress as hc
    specs = []
    for info in hc.codecs():
        spec = info.name
        if not any(setting == "ef=vanilla" for setting, _ in info.rejects):
            spec += ",ef=vanilla"
        if any(p.name == "start_iter" for p in info.params):
            spec += ",start_iter=0"
        specs.append(spec)
        if "compressed_allreduce" in info.strategies:
            specs.append(spec + ",collective=allreduce")
        if "homomorphic" in info.strategies:
            specs.append(spec + ",collective=homomorphic")
    return specs


def two_rank_marker(world: int):
    """Skip in a plain single-process pytest (no second rank to talk to). `make test` launches
    these modules with 2 ranks and sets HVDC_TWO_RANKS=1, where any other world size is an
    error, so the tests can never pass by being skipped there."""
    if os.environ.get("HVDC_TWO_RANKS") == "1" and world != 2:
        raise RuntimeError(f"launched with {world} rank(s); these tests need exactly 2")
    return pytest.mark.skipif(world != 2, reason="two-rank test: run by `make test` under "
                              "mpirun -np 2 and horovodrun --gloo -np 2")


def ranks_marker(world: int):
    """For tests that run at any world size >= 2. `make test` launches them at 2, 3, 4 and 8
    ranks with HVDC_RANKS set to the count it asked for, where any other world size is an
    error, so they can never pass by being skipped there."""
    want = os.environ.get("HVDC_RANKS")
    if want and int(want) != world:
        raise RuntimeError(f"launched with {world} rank(s); make asked for {want}")
    return pytest.mark.skipif(world < 2, reason="multi-rank test: run by `make test` at 2, "
                              "3, 4 and 8 ranks under mpirun or horovodrun --gloo")


def nodes_marker(nodes: int, per_node: int):
    """For the two-level tests: `make test` runs them through tests/nodes.py as 2 nodes x 2
    local ranks with HVDC_NODES set, where any other layout is an error."""
    if os.environ.get("HVDC_NODES") and (nodes, per_node) != (2, 2):
        raise RuntimeError(f"launched as {nodes} node(s) x {per_node}; make asked for 2 x 2")
    return pytest.mark.skipif((nodes, per_node) != (2, 2), reason="run by `make test` through "
                              "tests/nodes.py as 2 nodes x 2 local ranks")


def row_optimizer(spec, n, dtype=torch.float32):
    """hvd_compress's optimizer over one [1, n] parameter named "w" (2-D: DGC compresses
    weights only), compressing at any size."""
    import hvd_compress.torch as hvdc
    p = torch.nn.Parameter(torch.zeros(1, n, dtype=dtype))
    opt = hvdc.DistributedOptimizer(torch.optim.SGD([p], lr=0.0), named_parameters=[("w", p)],
                                    compression=spec, min_compress_bytes=0)
    return p, opt


def reduce_step(p, opt, g):
    """The reduced gradient of loss = sum(p * g), flattened; the step itself changes nothing."""
    opt.zero_grad()
    (p * g.view(p.shape)).sum().backward()
    opt.synchronize()
    out = p.grad.detach().reshape(-1).clone()
    with opt.skip_synchronize():
        opt.step()
    return out


def tensorboard_scalars(logdir: str) -> dict:
    """tag -> [(step, value)] from the event files in logdir (torch and TF write them apart:
    simple values and tensors)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util
    found: dict = {}
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        for event in EventFileLoader(path).Load():
            for value in event.summary.value:
                v = (value.simple_value if value.HasField("simple_value")
                     else float(tensor_util.make_ndarray(value.tensor)))
                found.setdefault(value.tag, []).append((event.step, v))
    return found


def owner_sums_rounded_to(dtype, monkeypatch, reduce_of):
    """In the compressed allreduce a chunk's owner sums the ranks' payloads into a tensor of
    the gradient's dtype and encodes that again: a float16 or bfloat16 gradient's sum is
    rounded once more there. The twin of such a run rounds its owners' sums the same way
    (`reduce_of`: the frontend codec class and its cast), and nothing else."""
    cls, cast = reduce_of
    original = cls.reduce

    def rounded(self, job, payloads, part, info, ranks, alpha, *out):
        summed = original(self, job, payloads, part, info, ranks, alpha, *out)
        return summed if out else cast(summed, dtype)

    monkeypatch.setattr(cls, "reduce", rounded)
