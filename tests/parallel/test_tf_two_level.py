"""The two-level strategy in the TensorFlow frontend, the twin of test_torch_two_level.py: 4
ranks posing as 2 nodes x 2 local ranks (`tests/nodes.py`, run by `make test`), bit for bit
against the same simulation, eagerly and inside tf.function."""
from __future__ import annotations

import horovod.tensorflow as hvd
import numpy as np
import pytest
import tensorflow as tf

from helpers import nodes_marker, same_bits
from simulation import TwoLevelSimulation, grads_for_step
from hvd_compress import collectives as col
from hvd_compress.tensorflow.reducer import Reducer, to_config

hvd.init()
RANK, WORLD = hvd.rank(), hvd.size()
NODES, PER_NODE = hvd.cross_size(), hvd.local_size()
pytestmark = nodes_marker(NODES, PER_NODE)
SPECS = ["onebit,ef=vanilla", "topk,k=0.05,ef=vanilla", "minmax8,chunk=64",
         "dithering,ef=vanilla,momentum=nesterov",
         "onebit,ef=vanilla,collective=allreduce"]
# hierarchical=fp16: the node's legs in float16 (each strategy the inner leg can take)
FP16_SPECS = ["onebit,ef=vanilla", "minmax8,chunk=64", "onebit,ef=vanilla,collective=allreduce"]


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("n", [1, 3, 64 * 4 + 37])
@pytest.mark.parametrize("spec", [s + ",hierarchical=true" for s in SPECS] +
                         [s + ",hierarchical=fp16" for s in FP16_SPECS])
def test_two_level_equals_simulation(spec, n, graph):
    reducer = Reducer(to_config(spec), 0, hvd.Average, hvd.global_process_set)
    var = tf.Variable(tf.zeros([n]), name="w")
    sim = TwoLevelSimulation(spec, n, NODES, PER_NODE)
    fn = (lambda g: reducer.reduce([g], [var])[0])
    fn = tf.function(fn) if graph else fn
    for step in range(3):
        grads = grads_for_step(n, "float32", step, WORLD)
        got = fn(tf.constant(grads[RANK]))
        assert same_bits(np.asarray(got.numpy()), sim(grads)), f"step {step}"
    assert reducer.stats.tensors["w"].collective == col.TWO_LEVEL
