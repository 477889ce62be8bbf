"""The two-level strategy (hierarchical=true) on 4 ranks posing as 2 nodes x 2 local ranks
(`tests/nodes.py`, run by `make test`), bit for bit against a numpy simulation: the node's
shards summed in rank order, each shard through the codec's strategy between the nodes
(tests/simulation.py, with that shard's own residuals), the shards put back together."""
from __future__ import annotations

import horovod.torch as hvd
import pytest
import torch

from helpers import n2t, nodes_marker, reduce_step, row_optimizer, same_bits, t2n
from simulation import TwoLevelSimulation, grads_for_step
from hvd_compress import collectives as col

hvd.init()
RANK, WORLD = hvd.rank(), hvd.size()
NODES, PER_NODE = hvd.cross_size(), hvd.local_size()
pytestmark = nodes_marker(NODES, PER_NODE)
SPECS = ["onebit,ef=vanilla", "topk,k=0.05,ef=vanilla", "efsignsgd",
         "minmax8,chunk=64", "bf16", "fp16",
         "dithering,ef=vanilla,momentum=nesterov",
         "onebit,ef=vanilla,collective=allreduce",
         "topk,k=0.05,ef=vanilla,collective=allreduce"]
# hierarchical=fp16: the node's legs in float16 (each strategy the inner leg can take)
FP16_SPECS = ["onebit,ef=vanilla", "minmax8,chunk=64", "onebit,ef=vanilla,collective=allreduce"]


def test_ranks_are_laid_out_as_two_nodes():
    assert (hvd.cross_rank(), hvd.local_rank()) == divmod(RANK, PER_NODE)


@pytest.mark.parametrize("n", [1, 3, 64 * 4 + 37])
@pytest.mark.parametrize("spec", [s + ",hierarchical=true" for s in SPECS] +
                         [s + ",hierarchical=fp16" for s in FP16_SPECS])
def test_two_level_equals_simulation(spec, n):
    p, opt = row_optimizer(spec, n)
    sim = TwoLevelSimulation(spec, n, NODES, PER_NODE)
    for step in range(3):
        grads = grads_for_step(n, "float32", step, WORLD)
        got = reduce_step(p, opt, n2t(grads[RANK], "float32"))
        assert same_bits(t2n(got), sim(grads)), f"step {step}"
    t = opt.compression_stats.tensors["w"]
    assert t.collective == col.TWO_LEVEL
    every = hvd.allgather(got.unsqueeze(0), name="two_level_identical")
    assert all(torch.equal(every[0], every[r]) for r in range(WORLD))


def test_only_the_shard_crosses_nodes():
    """Flat, 4 ranks take the compressed allreduce: 2(4-1)/4 = 1.5 payloads per rank. Two-level,
    only a shard (half the tensor) crosses between the 2 nodes, by allgather: half a payload,
    a third of the flat figure (within the chunk headers)."""
    n = 4096 * 4
    grads = grads_for_step(n, "float32", 0, WORLD)
    sent = {}
    for spec in ("onebit,ef=vanilla", "onebit,ef=vanilla,hierarchical=true"):
        p, opt = row_optimizer(spec, n)
        reduce_step(p, opt, n2t(grads[RANK], "float32"))
        sent[spec] = opt.compression_stats.last_step_wire
    flat, two = sent["onebit,ef=vanilla"], sent["onebit,ef=vanilla,hierarchical=true"]
    assert two == pytest.approx(flat / 3, rel=0.05)


def test_without_dynamic_process_sets_the_error_says_how(monkeypatch):
    monkeypatch.delenv("HOROVOD_DYNAMIC_PROCESS_SETS")
    with pytest.raises(ValueError, match="needs Horovod's dynamic process sets: call "
                                         r"hvd.init\(process_sets='dynamic'\)"):
        row_optimizer("onebit,hierarchical=true", 10)
