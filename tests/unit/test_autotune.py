"""hvd_compress.autotune on its own: the probe's schedule, which arm a decision keeps, and the
steps it counts. The optimizer's side (the arms' results bit for bit, every rank keeping the
same arm) is in tests/parallel/test_torch_buckets.py."""
import pytest

import hvd_compress as hc
from hvd_compress.autotune import WARMUP, Autotune, compressed_arm


def run(tune, steps, counted=True):
    """Steps through `tune` as the optimizer does: begin at the first gradient, end in
    synchronize; the arm each step took."""
    arms = []
    for _ in range(steps):
        arms.append(tune.compresses())
        tune.begin()
        tune.end(counted)
    return arms


def test_the_probe_alternates_pairs_after_the_warm_up():
    warm_up = [True, True, False, False]  # each arm warmed up, compressed first
    assert WARMUP == len(warm_up)
    assert [compressed_arm(i) for i in range(-WARMUP, 8)] == (
        warm_up + [True, False, False, True, True, False, False, True])
    tune = Autotune(3)
    assert run(tune, WARMUP + 5) == warm_up + [True, False, False, True, True]
    assert tune.compress is None and len(tune.times) == 5


def test_the_decision_is_due_once_after_the_probe_and_keeps_the_faster_arm():
    tune = Autotune(2)
    due = []
    for _ in range(WARMUP + 4 + 3):
        tune.begin()
        due.append(tune.end(True))
        if due[-1]:
            # summed over the ranks: C, U, U, C; the uncompressed median is lower
            assert tune.decide([0.5, 0.3, 0.2, 0.6]) is False
    assert due == [False] * (WARMUP + 3) + [True, False, False, False]
    assert run(tune, 3) == [False] * 3
    assert tune.report() == {"probes": 2, "compress": False, "compressed_ms": 550.0,
                             "uncompressed_ms": 250.0}


@pytest.mark.parametrize("summed, keeps", [([0.3, 0.3, 0.3, 0.3], False),  # a tie keeps exact steps
                                           ([0.2, 0.5, 0.5, 0.2], True),
                                           ([0.4, 0.1, 0.2, 0.4], False),
                                           # C, U, U, C: 4% faster is within MARGIN, 6% is not
                                           ([0.96, 1.0, 1.0, 0.96], False),
                                           ([0.94, 1.0, 1.0, 0.94], True)])
def test_medians_decide(summed, keeps):
    tune = Autotune(2)
    run(tune, WARMUP + 4)
    assert tune.decide(summed) is keeps


@pytest.mark.parametrize("probes", [2, 3])
def test_the_graphs_decision_is_the_same(probes):
    """TensorFlow decides in the step's own ops (tensorflow/autotune.py), with a median of its
    own: it must keep the arm the core keeps, at MARGIN's edge too."""
    import tensorflow as tf
    from hvd_compress.tensorflow.autotune import GraphAutotune

    class OneRank:
        def size(self):
            return 1
    for compressed, uncompressed in [(0.3, 0.3), (0.96, 1.0), (0.95, 1.0), (0.94, 1.0),
                                     (0.2, 0.5), (0.5, 0.2)]:
        summed = [compressed if compressed_arm(i) else uncompressed
                  for i in range(2 * probes)]
        enabled = tf.Variable(True)
        tune = GraphAutotune(probes, enabled, OneRank())
        tune.times.assign(summed)
        tune._decide()
        core = Autotune(probes)
        assert bool(enabled.numpy()) is core.decide(summed), (compressed, uncompressed)


def test_steps_with_a_joined_rank_are_not_counted_and_a_step_without_gradients_adds_zero():
    tune = Autotune(1)
    run(tune, WARMUP)
    run(tune, 3, counted=False)
    assert tune.step == WARMUP and tune.times == []
    tune.end(True)  # no gradient reached this rank: begin() never ran
    assert tune.times == [0.0]


def test_without_autotune_every_step_compresses_and_nothing_is_reported():
    tune = Autotune(0)
    assert run(tune, 5) == [True] * 5 and tune.times == [] and tune.report() is None


def test_autotune_sets_the_probe_but_not_the_states_identity():
    cfg = hc.parse_spec("topk,k=0.01,ef=vanilla,autotune=4")
    assert cfg.autotune == 4 and str(cfg) == "topk,k=0.01,ef=vanilla,autotune=4"
    assert cfg.canonical() == hc.parse_spec("topk,k=0.01,ef=vanilla").canonical()
    assert hc.parse_spec("onebit").autotune == 0
