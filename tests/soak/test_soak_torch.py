"""Memory soak, PyTorch, 2 ranks: a 1M-parameter model trained HVDC_SOAK_STEPS steps with each
stateful codec keeps its resident memory flat after the first steps (`make soak`: 2000 steps;
`make test`: fewer)."""
from __future__ import annotations

import horovod.torch as hvd
import pytest
import torch

from helpers import two_rank_marker
from soak import SPECS, STEPS, WARM, check_flat, resident_bytes
import hvd_compress.torch as hvdc

hvd.init()
pytestmark = [two_rank_marker(hvd.size()), pytest.mark.slow]
torch.set_num_threads(1)


@pytest.mark.parametrize("spec", SPECS)
def test_resident_memory_stays_flat(spec):
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)  # 1.05M parameters
    opt = hvdc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                    named_parameters=model.named_parameters(),
                                    compression=spec, min_compress_bytes=0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(hvd.rank())
    x, y = torch.randn(16, 1024, generator=g), torch.randn(16, 1024, generator=g)
    samples = []
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        samples.append(resident_bytes())
    assert len(samples) > WARM
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    check_flat(samples, spec)
