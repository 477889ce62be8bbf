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

from hvd_compress.torch import _C
from helpers import device_bits
from plan_sim import BUCKET_SPECS, CASES, MEMBERS, case_spec, run

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: make test-gpu runs these on a GPU machine", allow_module_level=True)
if not _C.built_with_cuda():
    pytest.skip("the extension was built without CUDA (CPU torch or no nvcc)", allow_module_level=True)

DEV = torch.device("cuda")


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
        assert got_state[r]["slots"].keys() == want_state[r]["slots"].keys()
        for name, slots in want_state[r]["slots"].items():
            assert got_state[r]["slots"][name].keys() == slots.keys(), f"rank {r} {name}"
            for kind, arr in slots.items():
                other = got_state[r]["slots"][name][kind]
                assert np.array_equal(other, arr, equal_nan=True), \
                    f"{strategy}: rank {r} {name} {kind}"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("codec,collective", CASES, ids=[f"{c}-{s or 'auto'}" for c, s in CASES])
def test_plans_on_cuda_equal_cpu(codec, collective, world):
    assert_cuda_equals_cpu(case_spec(codec, collective), world)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("spec", BUCKET_SPECS)
def test_bucket_plans_on_cuda_equal_cpu(spec, dtype):
    """A bucket as the optimizer sends it: per member or over the whole bucket."""
    assert_cuda_equals_cpu(spec, 2, dtype=dtype, members=MEMBERS)
