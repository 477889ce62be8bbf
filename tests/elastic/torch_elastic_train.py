"""Elastic training under `horovodrun --gloo` with a discovery script whose hosts this script
rewrites (tests/elastic/test_elastic.py starts it):

    2 ranks ("localhost:1", "127.0.0.1:1": two names of this machine, so that the failed one can
    be blacklisted without losing the other) -> the worker on 127.0.0.1 removes its host from
    the discovery output and dies (or, HVDC_ELASTIC_MODE=remove, is let go) at step KILL_AT -> 1 rank -> at step GROW_AT rank 0 adds a
    second slot on localhost -> 2 ranks until STEPS.

After every sync (the start of each call of train(), named by the step it resumes at) and at the end, each rank writes its
weights and compression state to OUT/<event>_<world>_<rank>.npz.
"""
import os
import sys

import horovod.torch as hvd
import numpy as np
import torch

import hvd_compress.torch as hvdc
from elastic_job import STEPS, after_step

OUT, SPEC = sys.argv[1], sys.argv[2]

hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
optimizer = hvdc.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
    compression=SPEC, min_compress_bytes=0)


def dump(event, loss=float("nan")):
    state = optimizer.compression_state_dict()
    arrays = {f"w/{k}": v.detach().numpy() for k, v in model.state_dict().items()}
    arrays.update({f"s/{n}/{k}": a for n, kinds in state["slots"].items()
                   for k, a in kinds.items()})
    arrays.update({f"c/{n}": np.int64(c) for n, c in state["steps"].items()})
    np.savez(os.path.join(OUT, f"{event}_{hvd.size()}_{hvd.rank()}.npz"), loss=loss, **arrays)


@hvd.elastic.run
def train(state):
    dump(f"sync{state.step}")
    loss = None
    while state.step < STEPS:
        # Each rank's own batch, the same whatever the world: the data a rank sees depends on
        # its rank and the step only.
        g = torch.Generator().manual_seed(1000 * state.step + hvd.rank())
        x = torch.randn(8, 16, generator=g)
        y = torch.randn(8, 4, generator=g)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        after_step(state, dump, hvd.size)
    return loss.item()


state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0)
loss = train(state)
dump("end", loss)
