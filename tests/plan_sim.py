"""The torch frontend's reduction plans with the collectives simulated in one process: each
collective the plans issue is performed across the simulated ranks in rank order, as Horovod
returns it to each. tests/gpu runs it on CUDA against the CPU (the GPU machine has no Horovod);
tests/unit/test_plan_sim.py runs it on the CPU, so that it keeps driving the plans as the
optimizer does where no GPU is; bench/device_step.py times a model's plans through it."""
from __future__ import annotations

import torch

import hvd_compress as hc
from hvd_compress import collectives
from hvd_compress.state import StateStore
from hvd_compress.torch.codec import TorchAdapter, TorchCodec
from helpers import codec_strategies, random_grad

N = 3001  # not a multiple of any chunk or word size


def perform(requests: list) -> list:
    """One collective across the simulated ranks, as Horovod returns it to each."""
    first = requests[0]
    if isinstance(first, collectives.Allreduce):
        # Half precision summed in float32 and rounded once, as simulation.py models Horovod's
        # (the collective tests hold it to Horovod at 2 to 8 ranks); Horovod has no bfloat16
        # allreduce, so the plans send those as float32.
        half = first.tensor.dtype == torch.float16
        ts = [r.tensor.float() if r.tensor.dtype in (torch.bfloat16, torch.float16) else r.tensor
              for r in requests]
        out = ts[0].clone()
        for t in ts[1:]:
            out = torch.maximum(out, t) if first.op == "max" else out + t
        out = out.half() if half else out
        return [out.clone() for _ in requests]
    if isinstance(first, collectives.Allgather):
        if first.rows:
            out = torch.stack([r.tensor.reshape(-1) for r in requests])
        else:
            out = torch.cat([r.tensor.reshape(-1) for r in requests])
        return [out.clone() for _ in requests]
    pieces = [list(torch.split(r.tensor, r.splits)) for r in requests]  # alltoall
    return [torch.cat([pieces[i][j] for i in range(len(requests))]) for j in range(len(requests))]


def drive(gens: list, collective=perform) -> list:
    """Every rank's plan (collectives.plan) to its end, each collective performed across the
    ranks as they issue it (by `collective`, perform or a wrapper of it); every rank's result."""
    requests, results = [next(g) for g in gens], [None] * len(gens)
    while requests:
        answers, following = collective(requests), []
        for r, (g, a) in enumerate(zip(gens, answers)):
            try:
                following.append(g.send(a))
            except StopIteration as done:
                results[r] = done.value
        assert len(following) in (0, len(gens)), "ranks issued different collectives"
        requests = following
    return results


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
            if members:  # as the optimizer launches a bucket: its state is its members' slots
                views, start = [], 0
                for m, size in members:
                    views.append((m, grad[start:start + size], 0, size))
                    start += size
                codecs[r].view("w", views)
            at = stores[r].next_step("w")
            job = collectives.Job(name="w", n=n, itemsize=grad.element_size(), config=config,
                                  rank=r, world=world, average=True, opname="w", step=at,
                                  fields_step=at, nodes=None, extra={"grad": grad},
                                  members=members)
            strategy = collectives.choose(job)
            gens.append(collectives.plan(job, codecs[r]))
        results = drive(gens)
        for s in stores:
            s.commit()
        reduced.append([t.detach().cpu().clone() for t in results])
    return reduced, [s.state_dict() for s in stores], strategy


# Every codec on every strategy it has, but PowerSGD: its orthogonalisation adds float32 in
# another order on the GPU, so tests/gpu compares its passes to a tolerance, kernel by kernel.
CASES = [(codec, collective) for codec, collective in codec_strategies() if codec != "powersgd"]


def case_spec(codec: str, collective: str | None) -> str:
    """The spec a case runs: with error feedback and momentum where the codec has no state of
    its own."""
    info = hc.get_codec(codec)
    spec = {"dgc": "dgc,k=0.05", "threshold": "threshold,threshold=0.5"}.get(codec, codec)
    if not info.builtin_ef and info.rounds != 2:
        spec += ",ef=vanilla,momentum=nesterov,mu=0.9"
    if collective:
        spec += f",collective={collective}"
    return spec


# Odd member sizes, so that under granularity=tensor the members' payloads, back to back in one
# allgather, start off the alignment of their values (half-precision values: off 4 bytes too).
MEMBERS = (("a", 1001), ("b", 999), ("c", 37))
BUCKET_SPECS = ["topk,k=0.01,ef=vanilla,granularity=tensor", "topk,k=5,ef=vanilla,granularity=tensor",
                "dgc,k=0.05,granularity=tensor", "topk,k=0.01,ef=vanilla", "onebit,ef=vanilla",
                "onebit,ef=vanilla,granularity=tensor", "efsignsgd,granularity=tensor"]
