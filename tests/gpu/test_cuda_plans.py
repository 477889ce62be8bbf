"""The torch frontend's reduction plans on CUDA gradients against the same plans on the CPU: every
codec on every strategy it has, error feedback and momentum included, 2 and 3 ranks simulated
in one process (this GPU machine has no Horovod). Each collective the plans issue is performed
across the simulated ranks in rank order, identically for both devices, so the reduced
gradients and the state the store ends with must agree bit for bit: what this adds to
test_cuda_kernels.py is everything between the kernels (state slots and carries on the device,
chunking, owner residuals, the homomorphic words and scales, the gathered payloads' split)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import hvd_compress as hc
from hvd_compress import collectives
from hvd_compress.state import StateStore
from hvd_compress.torch import _C
from hvd_compress.torch.codec import TorchAdapter, TorchCodec
from helpers import codec_strategies, device_bits, random_grad

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: make test-gpu runs these on a GPU machine", allow_module_level=True)
if not _C.built_with_cuda():
    pytest.skip("the extension was built without CUDA (CPU torch or no nvcc)", allow_module_level=True)

DEV = torch.device("cuda")
N = 3001  # not a multiple of any chunk or word size


def perform(requests: list) -> list:
    """One collective across the simulated ranks, as Horovod returns it to each."""
    first = requests[0]
    if isinstance(first, collectives.Allreduce):
        ts = [r.tensor.float() if r.tensor.dtype == torch.bfloat16 else r.tensor for r in requests]
        out = ts[0].clone()
        for t in ts[1:]:
            out = torch.maximum(out, t) if first.op == "max" else out + t
        return [out.clone() for _ in requests]
    if isinstance(first, collectives.Allgather):
        if first.rows:
            out = torch.stack([r.tensor.reshape(-1) for r in requests])
        else:
            out = torch.cat([r.tensor.reshape(-1) for r in requests])
        return [out.clone() for _ in requests]
    pieces = [list(torch.split(r.tensor, r.splits)) for r in requests]  # alltoall
    return [torch.cat([pieces[i][j] for i in range(len(requests))]) for j in range(len(requests))]


def run(spec: str, world: int, device: torch.device, steps: int = 3, dtype: str = "float32",
        members: tuple = ()):
    """`members`: the job is a bucket of these (name, elements), as the optimizer sends one."""
    config = hc.parse_spec(spec)
    stores = [StateStore(TorchAdapter(), spec=config.canonical()) for _ in range(world)]
    codecs = [TorchCodec(config, s, rank=r, world=world) for r, s in enumerate(stores)]
    reduced, strategy = [], None
    for step in range(steps):
        gens = []
        n = sum(m for _, m in members) or N
        for r in range(world):
            stores[r].begin()
            grad = random_grad(n, dtype, seed=100 * step + r).to(device)
            at = stores[r].next_step("w")
            job = collectives.Job(name="w", n=n, itemsize=grad.element_size(), config=config,
                                  rank=r, world=world, average=True, opname="w", step=at,
                                  fields_step=at, nodes=None, extra={"grad": grad},
                                  members=members)
            strategy = collectives.choose(job)
            gens.append(collectives.plan(job, codecs[r]))
        requests, results = [next(g) for g in gens], [None] * world
        while requests:
            answers, following = perform(requests), []
            for r, (g, a) in enumerate(zip(gens, answers)):
                try:
                    following.append(g.send(a))
                except StopIteration as done:
                    results[r] = done.value
            assert len(following) in (0, world), "ranks issued different collectives"
            requests = following
        for s in stores:
            s.commit()
        reduced.append([t.detach().cpu().clone() for t in results])
    return reduced, [s.state_dict() for s in stores], strategy


def assert_cuda_equals_cpu(spec: str, world: int, **kw) -> None:
    """run() on the GPU and on the CPU: every rank's result each step, bit for bit, and the
    state each rank ends with."""
    got, got_state, strategy = run(spec, world, DEV, **kw)
    want, want_state, _ = run(spec, world, torch.device("cpu"), **kw)
    for step, (g, w) in enumerate(zip(got, want)):
        for r in range(world):
            assert device_bits(g[r]) == device_bits(w[r]), f"{strategy}: rank {r} step {step}"
    for r in range(world):
        assert got_state[r]["steps"] == want_state[r]["steps"]
        for kind, arr in want_state[r]["slots"]["w"].items():
            other = got_state[r]["slots"]["w"][kind]
            assert np.array_equal(other, arr, equal_nan=True), f"{strategy}: rank {r} {kind}"


CASES = [(codec, collective) for codec, collective in codec_strategies() if codec != "powersgd"]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("codec,collective", CASES, ids=[f"{c}-{s or 'auto'}" for c, s in CASES])
def test_plans_on_cuda_equal_cpu(codec, collective, world):
    info = hc.get_codec(codec)
    spec = {"dgc": "dgc,k=0.05", "threshold": "threshold,threshold=0.5"}.get(codec, codec)
    if not info.builtin_ef and info.rounds != 2:
        spec += ",ef=vanilla,momentum=nesterov,mu=0.9"
    if collective:
        spec += f",collective={collective}"
    assert_cuda_equals_cpu(spec, world)


# Odd member sizes, so that under granularity=tensor the members' payloads, back to back in one
# allgather, start off the alignment of their values (half-precision values: off 4 bytes too).
MEMBERS = (("a", 1001), ("b", 999), ("c", 37))
BUCKET_SPECS = ["topk,k=0.01,ef=vanilla,granularity=tensor", "topk,k=5,ef=vanilla,granularity=tensor",
                "dgc,k=0.05,granularity=tensor", "topk,k=0.01,ef=vanilla", "onebit,ef=vanilla",
                "onebit,ef=vanilla,granularity=tensor", "efsignsgd,granularity=tensor"]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("spec", BUCKET_SPECS)
def test_bucket_plans_on_cuda_equal_cpu(spec, dtype):
    """A bucket as the optimizer sends it: per member or over the whole bucket."""
    assert_cuda_equals_cpu(spec, 2, dtype=dtype, members=MEMBERS)
