"""Elastic Horovod keeps the compression state consistent (hvd_compress.torch.elastic,
hvd_compress.tensorflow.elastic).

`horovodrun --gloo` elastic jobs on localhost (torch_elastic_train.py; tf_elastic_train.py with
Keras' model.fit or a tape in a custom loop): 2 ranks, a worker killed at step 4 (or its host
removed from the discovery output: no sync then), 1 rank goes on, a slot added back at step 8, 2
ranks to the end. After each reset every rank must hold the same weights and the same
compression state (rank 0's step counters, no per-rank residual), and training must go on with
finite losses.
This file runs in one plain process and starts the job itself.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# The training script and its arguments after OUT. TF keeps step counters only for codecs that
# read them: randomk's seeds must agree between ranks after every reset.
FRONTENDS = {"torch": ["torch_elastic_train.py", "topk,k=0.25,ef=vanilla"],
             "tf-fit": ["tf_elastic_train.py", "randomk,k=0.25,ef=vanilla", "fit"],
             "tf-tape": ["tf_elastic_train.py", "randomk,k=0.25,ef=vanilla", "tape"]}


def load(out, event, world, rank):
    with np.load(os.path.join(out, f"{event}_{world}_{rank}.npz")) as z:
        return {k: z[k] for k in z.files}


def assert_same(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        if k != "loss":
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def run_job(tmp_path, mode, frontend):
    script, *args = FRONTENDS[frontend]
    tmp_path.mkdir()
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")
    env = dict(os.environ, HVDC_ELASTIC_HOSTS=str(hosts), HVDC_ELASTIC_MODE=mode,
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
    cmd = ["horovodrun", "--gloo", "-np", "2", "--min-np", "1", "--max-np", "2",
           "--host-discovery-script", os.path.join(HERE, "discover.sh"),
           sys.executable, os.path.join(HERE, script), str(tmp_path), *args]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    if mode == "kill":
        assert "exit with status code 17" in log, "the worker was not killed"
    else:
        assert "has been removed from elastic job" in log, "the worker was not removed"
    events = sorted(os.path.basename(f)[:-4] for f in glob.glob(str(tmp_path / "*.npz")))
    assert events == ["end_2_0", "end_2_1", "step5_1_0", "sync0_2_0", "sync0_2_1", "sync4_1_0",
                      "sync8_2_0", "sync8_2_1"], events

    # After the failure: the survivor resumes from the last commit, its residuals dropped by
    # the sync (removal skips the sync: they go at its next step).
    alone = load(tmp_path, "sync4", 1, 0)
    if mode == "kill":
        assert not [k for k in alone if k.startswith("s/")]
    assert {int(v) for k, v in alone.items() if k.startswith("c/")} == {4}

    # After the slot came back: the new worker holds exactly what rank 0 holds.
    r0, r1 = load(tmp_path, "sync8", 2, 0), load(tmp_path, "sync8", 2, 1)
    assert_same(r0, r1)
    assert not [k for k in r0 if k.startswith("s/")]
    assert {int(v) for k, v in r0.items() if k.startswith("c/")} == {8}

    # Training went on in the new world: compressed with error feedback, weights identical.
    e0, e1 = load(tmp_path, "end", 2, 0), load(tmp_path, "end", 2, 1)
    assert np.isfinite(e0["loss"]) and np.isfinite(e1["loss"])
    for k in e0:
        if k.startswith("w/"):
            np.testing.assert_array_equal(e0[k], e1[k], err_msg=k)
    assert {int(v) for k, v in e0.items() if k.startswith("c/")} == {14}
    assert [k for k in e0 if k.startswith("s/") and k.endswith("/ef") and np.any(e0[k])]
    first = min(k for k in e0 if k.startswith("w/"))
    assert not np.array_equal(e0[first], r0[first])
    return load(tmp_path, "step5", 1, 0), e0


@pytest.mark.parametrize("frontend", sorted(FRONTENDS))
def test_kill_and_regrow_keeps_state_consistent(tmp_path, frontend):
    killed = run_job(tmp_path / "kill", "kill", frontend)
    # Removing the worker instead resumes from the same commit with the same state: the
    # survivors' state must come out the same, bit for bit.
    removed = run_job(tmp_path / "remove", "remove", frontend)
    # The first step in the smaller world: no residual of the 2-rank steps is left either way.
    assert_same(killed[0], removed[0])
    assert_same(killed[1], removed[1])
