"""plan_sim (the in-process collectives that tests/gpu runs the torch plans through on a GPU
machine) on the CPU, against the numpy simulation of each codec's whole reduction: CI has no
GPU, so this is what keeps that harness driving the plans as the optimizer does."""
import numpy as np
import pytest
import torch

from helpers import random_grad, same_bits, t2n
from plan_sim import BUCKET_SPECS, CASES, MEMBERS, N, case_spec, run
from simulation import Simulation

CPU = torch.device("cpu")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("codec,collective", CASES, ids=[f"{c}-{s or 'auto'}" for c, s in CASES])
def test_plans_equal_simulation(codec, collective, world):
    spec = case_spec(codec, collective)
    reduced, _, _ = run(spec, world, CPU)
    sim = Simulation(spec, N, "float32", world)
    for step, got in enumerate(reduced):
        want = sim([t2n(random_grad(N, "float32", seed=100 * step + r)) for r in range(world)])
        for r in range(world):
            assert same_bits(t2n(got[r]), want), f"{spec}: rank {r} step {step}"


@pytest.mark.parametrize("spec", BUCKET_SPECS)
def test_bucket_state_is_its_members(spec):
    """A bucket driven as the optimizer drives one: every rank reduces to the same bits, and the
    state lands in each member's own slots, of the member's size."""
    reduced, states, _ = run(spec, 2, CPU, members=MEMBERS)
    for got in reduced:
        assert same_bits(t2n(got[0]), t2n(got[1]))
    for state in states:
        assert set(state["slots"]) == {m for m, _ in MEMBERS}
        for m, size in MEMBERS:
            assert state["slots"][m] and all(np.asarray(a).size == size
                                             for a in state["slots"][m].values()), m
