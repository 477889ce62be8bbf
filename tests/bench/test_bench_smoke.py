"""The benchmark harnesses, run end to end on tiny sizes: each script must finish and write its
table, CSV, JSON and plot with a row for every configuration it lists. No timing is asserted."""
import csv
import json
import os
import statistics
import subprocess
import sys

from importlib.util import module_from_spec, spec_from_file_location

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))


def run(script, *args, timeout=900):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def outputs(folder, name):
    with open(os.path.join(folder, f"{name}.json")) as f:
        data = json.load(f)
    with open(os.path.join(folder, f"{name}.csv")) as f:
        rows = list(csv.DictReader(f))
    png = os.path.join(folder, f"{name}.png")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    return data, rows


def test_codecs_quick(tmp_path):
    proc = run("codecs.py", "--quick", "--mb", "0.2", "--runs", "1", "--out", str(tmp_path))
    data, rows = outputs(tmp_path, "codecs")
    # bench/codecs.py shares its name with the standard library's codecs: load it by path
    spec = spec_from_file_location("bench_codecs", os.path.join(ROOT, "bench", "codecs.py"))
    mod = module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert [r["codec"] for r in rows] == [s for _, s in mod.ROWS]
    assert all(float(r["compress_gbps"]) > 0 and int(r["wire_bytes"]) > 0 for r in rows)
    assert data["settings"]["elements"] == 50_000  # 0.2 MB of fp32
    assert "| fp16" in proc.stdout


def test_ef_step_quick(tmp_path):
    proc = run("ef_step.py", "--mb", "0.2", "--runs", "1", "--out", str(tmp_path))
    data, rows = outputs(tmp_path, "ef_step")
    import ef_step
    assert [r["codec"] for r in rows] == list(ef_step.SPECS)
    assert all(float(r["copy_then_in_place_ms"]) > 0 and float(r["into_kept_ms"]) > 0
               for r in rows)
    assert data["settings"]["elements"] == 50_000
    assert "| threshold,threshold=2.0,ef=vanilla" in proc.stdout


def test_convergence_quick(tmp_path):
    import convergence
    proc = run("convergence.py", "--quick", "--epochs", "1", "--out", str(tmp_path))
    data, rows = outputs(tmp_path, "convergence")
    assert [r["codec"] for r in rows] == [c for c, _, _ in convergence.RUNS]
    for r in rows:
        for kind in ("no_ef", "ef"):
            if r[f"{kind}_spec"]:
                assert 0.0 <= float(r[f"{kind}_accuracy"]) <= 100.0
                assert float(r[f"{kind}_final_loss"]) > 0
    with open(tmp_path / "convergence_curves.json") as f:
        curves = json.load(f)
    assert all(len(c) == 1 for c in curves.values())
    assert "EF within 1 point" in proc.stdout


def test_convergence_select_runs_those_codecs_beside_uncompressed(tmp_path):
    run("convergence.py", "--epochs", "1", "--seeds", "2", "--ef-only", "--select", "dgc,topk",
        "--out", str(tmp_path))
    data, rows = outputs(tmp_path, "convergence_seeds2_dgc_topk")
    assert [r["codec"] for r in rows] == ["none", "topk 1%", "dgc 1%"]
    assert data["settings"]["select"] == "dgc,topk"
    with open(tmp_path / "convergence_seeds2_dgc_topk_curves.json") as f:
        assert sorted(json.load(f)) == ["dgc,k=0.01", "none", "topk,k=0.01,ef=vanilla"]


def test_convergence_granularity_reaches_the_codecs_that_take_it(tmp_path):
    run("convergence.py", "--epochs", "1", "--ef-only", "--bucket-mb", "1", "--granularity",
        "tensor", "--select", "onebit,fp16", "--out", str(tmp_path))
    _, rows = outputs(tmp_path, "convergence_buckets1mb_granularity_tensor_onebit_fp16")
    ran = {r["codec"]: r["ef_ran"] for r in rows}
    assert ran["onebit"].endswith(",granularity=tensor")
    assert "granularity" not in ran["fp16"]  # one cast per element: the same either way


def test_scaling_quick(tmp_path):
    import scaling
    proc = run("scaling.py", "--quick", "--ranks", "2,3", "--steps", "1", "--out", str(tmp_path))
    data, rows = outputs(tmp_path, "scaling")
    labels = [label for label, _, _, _ in scaling.configurations()]
    assert [(r["row"], int(r["ranks"])) for r in rows] == [(label, n) for n in (2, 3)
                                                           for label in labels]
    assert all(float(r["mb_per_rank"]) > 0 and float(r["optimal_mb"]) > 0 for r in rows)
    # Measured, not modelled: at 3 ranks an allgather moves 2 payloads per rank, the compressed
    # allreduce 4/3 of one.
    at3 = {r["row"]: float(r["mb_per_rank"]) for r in rows if r["ranks"] == "3"}
    assert at3["onebit allgather"] > at3["onebit allreduce"]
    assert data["settings"]["ranks"] == [2, 3]
    assert "Cost model, not measurement" in proc.stdout


def test_reduction_quick(tmp_path):
    specs = ["onebit,ef=vanilla", "dgc,k=0.01"]
    proc = run("reduction.py", "--model", "mlp", "--specs", ";".join(specs), "--rounds", "2",
               "--out", str(tmp_path))
    data, rows = outputs(tmp_path, "reduction")
    assert [r["row"] for r in rows] == ["horovod, no compression"] + specs
    assert all(float(r["median_ms"]) > 0 for r in rows)
    assert data["settings"]["arm"] == "off" and data["settings"]["rounds"] == 2
    assert "| horovod, no compression" in proc.stdout


def test_reduction_whole_step_quick(tmp_path):
    specs = ["efsignsgd", "topk,k=0.01,ef=vanilla"]
    proc = run("reduction.py", "--whole-step", "--model", "mlp", "--specs", ";".join(specs),
               "--rounds", "2", "--out", str(tmp_path))
    data, rows = outputs(tmp_path, "reduction_step")
    assert [r["row"] for r in rows] == ["hvd.allreduce per tensor", "the same again"] + specs
    assert [r["arm"] for r in rows] == ["-", "-", "off", "off"]
    assert all(float(r["median_ms"]) > 0 for r in rows) and float(rows[0]["vs_horovod"]) == 1
    assert data["settings"]["ranks"] == 1 and data["settings"]["whole_step"] is True
    assert " the same again |" in proc.stdout


def test_reduction_refuses_a_spec_it_cannot_parse():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "reduction.py"), "--specs",
                           "onebit;nope"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--specs: 'nope'" in proc.stderr, proc.stderr


def network_unavailable():
    if os.geteuid() != 0:
        return "bench/network.py needs root"
    probe = subprocess.run(["ip", "netns", "add", "hvdc-bench-smokeprobe"], capture_output=True)
    subprocess.run(["ip", "netns", "del", "hvdc-bench-smokeprobe"], capture_output=True)
    if probe.returncode != 0:
        return f"cannot create network namespaces here: {probe.stderr.decode().strip()}"
    return None


def test_network_refuses_clearly_without_root():
    if os.geteuid() == 0:
        code = "import os; os.geteuid = lambda: 1000; import runpy, sys; sys.argv = ['network.py']; " \
               f"runpy.run_path({os.path.join(ROOT, 'bench', 'network.py')!r}, run_name='__main__')"
    else:
        code = f"import runpy, sys; sys.argv = ['network.py']; " \
               f"runpy.run_path({os.path.join(ROOT, 'bench', 'network.py')!r}, run_name='__main__')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "needs root" in proc.stderr


NETWORK_UNAVAILABLE = network_unavailable()


# The issue allows this one skip: the network bench cannot run without root and namespaces.
@pytest.mark.skipif(NETWORK_UNAVAILABLE is not None, reason=f"{NETWORK_UNAVAILABLE}")
def test_network_quick(tmp_path):
    """Two rounds (the second in reverse order): still one row per configuration, in the
    table's order, its speedup the median of the rounds' and within their range."""
    import network
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    proc = run("network.py", "--quick", "--params-m", "0.3", "--steps", "1", "--rates", "1gbit",
               "--rounds", "2", "--out", str(tmp_path))
    data, rows = outputs(tmp_path, "network")
    assert [r["row"] for r in rows] == [label for label, how, _ in network.ROWS
                                       if how != "ddp"] + [label for label, how, _ in network.ROWS
                                                           if how == "ddp"]
    assert all(r["rate"] == "1gbit" and float(r["ms_per_step"]) > 0 for r in rows)
    assert all(int(r["bytes_per_step"]) > 0 for r in rows)
    # every thread's CPU includes the main thread's, and a step takes some of both
    assert all(0 < float(r["main_cpu_ms_per_step"]) <= float(r["cpu_ms_per_step"]) for r in rows)
    base = next(r for r in rows if r["row"] == network.ROWS[0][0])
    assert float(base["speedup"]) == 1.0
    assert data["settings"]["rounds"] == 2 and all(int(r["rounds"]) == 2 for r in rows)
    assert all(float(r["speedup_low"]) <= float(r["speedup"]) <= float(r["speedup_high"])
               for r in rows)
    assert "speedup range" in proc.stdout and "cpu ms/step (main thread)" in proc.stdout
    # every namespace it made is gone
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert [line for line in after.splitlines() if "hvdc-bench-" in line] == \
        [line for line in before.splitlines() if "hvdc-bench-" in line]
    assert "speedup" in proc.stdout


def test_network_measures_each_row_against_the_baseline_runs_around_it():
    """The baseline runs first, after every BASE_EVERY rows and last; a row's base is the mean
    of the baseline's runs on either side of it, the baseline's own runs their own."""
    import network
    table = [("base", "horovod", "none")] + [(f"r{i}", "ours", "fp16") for i in range(6)]
    order = network.bracketed(table)
    every = network.BASE_EVERY
    assert [label for label, _, _ in order] == (
        ["base"] + [f"r{i}" for i in range(every)] + ["base"]
        + [f"r{i}" for i in range(every, 6)] + ["base"])
    ms = {0: 100.0, every + 1: 140.0, len(order) - 1: 120.0}
    results = [{"row": label, "ms_per_step": ms.get(i, 50.0 + i)}
               for i, (label, _, _) in enumerate(order)]
    network.against_bracket(results, "base")
    assert [r["base_ms"] for r in results] == (
        [100.0] + [120.0] * every + [140.0] + [130.0] * (6 - every) + [120.0])


@pytest.mark.parametrize("alternate_warmup", [True, False])
def test_paired_steps_alternate_or_keep_the_baseline_first_in_warmup(alternate_warmup):
    """In turns, a step of ours follows the baseline's every other time, so that neither is
    always second. Keras' warm-up (alternate_warmup off) keeps the baseline first, so that a
    window from one of our steps' end to the next holds one baseline step each time, never
    none then two; its timed steps alternate."""
    import network
    calls = []
    opts = {"warmup": 4, "steps": 4}
    r = network.time_paired(lambda: calls.append("S"), lambda: calls.append("B"), opts, "lo",
                            lambda: None, alternate_warmup)
    steps = "".join(calls)
    pairs = [steps[i:i + 2] for i in range(0, len(steps), 2)]
    assert pairs[4:] == ["SB", "BS"] * 2  # timed: each first in half of them
    assert pairs[:4] == (["SB", "BS"] * 2 if alternate_warmup else ["BS"] * 4)
    # baseline steps between two of ours in the warm-up, where the probe runs
    between = [len(gap) for gap in steps[:8].split("S")[1:4]]
    assert between == ([2, 0, 2] if alternate_warmup else [1, 1, 1])
    assert r["paired_base_ms"] >= 0 and r["ms_per_step"] >= 0
    # each timed step's time is kept, ours and the baseline's, in the order they ran
    assert len(r["steps_ms"]) == len(r["base_steps_ms"]) == opts["steps"]
    assert r["ms_per_step"] == statistics.median(r["steps_ms"])
    assert r["paired_base_ms"] == statistics.median(r["base_steps_ms"])


def test_paired_step_times_reach_the_json_and_stay_out_of_the_csv(tmp_path):
    """collapse() keeps each round's step times; results.write() puts them in the JSON only,
    where the CSV would hold a list in a cell."""
    import network
    import results
    runs = [{"rate": "10gbit", "round": k, "row": row, "spec": "none", "ms_per_step": ms,
             "bytes_per_step": 1, "cpu_ms_per_step": 1.0, "main_cpu_ms_per_step": 1.0,
             "base_ms": 10.0, **paired}
            for k in range(2)
            for row, ms, paired in (("base", 10.0, {}),
                                    ("ours", 9.0 + k, {"paired_base_ms": 10.0,
                                                       "steps_ms": [8.0 + k, 10.0 + k],
                                                       "base_steps_ms": [10.0, 10.0]}))]
    rows = network.collapse(runs, "base")
    ours = next(r for r in rows if r["row"] == "ours")
    assert ours["steps_ms"] == [[8.0, 10.0], [9.0, 11.0]]
    assert ours["base_steps_ms"] == [[10.0, 10.0]] * 2
    assert "steps_ms" not in rows[0]  # the baseline's own rows are not paired
    results.write(str(tmp_path), "t", {}, rows, json_only=("steps_ms", "base_steps_ms"))
    with open(tmp_path / "t.json") as f:
        assert json.load(f)["rows"][1]["steps_ms"] == [[8.0, 10.0], [9.0, 11.0]]
    with open(tmp_path / "t.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["row"] for r in table] == ["base", "ours"]
    assert "steps_ms" not in table[1] and table[1]["ms_per_step"] == "9.5"


# The same skip as the network bench's other runs: namespaces need root (CI has it and runs this).
@pytest.mark.skipif(NETWORK_UNAVAILABLE is not None, reason=f"{NETWORK_UNAVAILABLE}")
def test_network_paired_measures_our_rows_against_a_baseline_beside_them(tmp_path):
    """--paired: each of our rows' speedup is against the baseline steps that ran between its
    own, with its bytes its own; Horovod's rows keep the bracketed baseline, but for the one
    paired with a copy of itself."""
    import network
    run("network.py", "--quick", "--params-m", "0.3", "--steps", "2", "--rates", "1gbit",
        "--select", "topk,onebit", "--paired", "--out", str(tmp_path))
    data, rows = outputs(tmp_path, "network_paired")
    assert data["settings"]["paired"] is True
    ours = {r["row"]: r for r in data["rows"] if r["row"] in ("topk 1%", "onebit")}
    assert len(ours) == 2
    twin = {r["row"]: r for r in data["rows"]}[network.SELF_PAIR]
    for r in data["rows"]:
        assert (r["paired_base_ms"] is not None) == (r["row"] in ours or r is twin), r["row"]
    assert twin["speedup"] == pytest.approx(twin["paired_base_ms"] / twin["ms_per_step"])
    # float32, as the copy beside it sends: about twice Horovod's fp16 row. (An absolute floor
    # of 1 MB failed at 981,419 bytes, Horovod's own row sending 1,051,759 in the same run.)
    fp16 = {r["row"]: r for r in data["rows"]}["horovod fp16"]
    assert twin["bytes_per_step"] > 1.5 * fp16["bytes_per_step"]
    for r in ours.values():
        assert r["paired_base_ms"] > 0
        assert r["speedup"] == pytest.approx(r["paired_base_ms"] / r["ms_per_step"])
        # a 0.3M-parameter model's float32 gradients are about 1.2 MB; these send a tenth
        assert 0 < r["bytes_per_step"] < 200_000


@pytest.mark.slow  # two Keras ResNet-50 steps traced in a row, as REAL_MODELS' Keras case
@pytest.mark.skipif(NETWORK_UNAVAILABLE is not None, reason=f"{NETWORK_UNAVAILABLE}")
def test_network_paired_keras_trains_horovods_copy_beside_ours(tmp_path):
    run("network.py", "--model", "keras-resnet50", "--bucket-mb", "4", "--steps", "2",
        "--rates", "10gbit", "--select", "topk", "--paired", "--out", str(tmp_path))
    data, _ = outputs(tmp_path, "network_keras-resnet50_buckets4mb_paired")
    by = {r["row"]: r for r in data["rows"]}
    assert by["horovod, no compression"]["paired_base_ms"] is None
    mine = by["topk 1%"]
    assert mine["paired_base_ms"] > 0
    assert mine["speedup"] == pytest.approx(mine["paired_base_ms"] / mine["ms_per_step"])
    # the bytes are topk's alone: Horovod's copy beside it sends float32 gradients
    assert 0 < mine["bytes_per_step"] < 25_583_592 * 4 / 10


class QueuedLink:
    """A veth whose counter lags what a step sent: each step's tail leaves during the next one,
    whoever's that is, as the tails of Horovod's last chunks did at 1 Gbit/s."""

    def __init__(self):
        self.counted = self.queued = 0

    def step(self, sends, tail):
        def run():
            self.counted += self.queued + sends - tail
            self.queued = tail
        return run


@pytest.mark.parametrize("warmup,steps,alternate", [(3, 2, True), (3, 5, False), (4, 1, True),
                                                    (6, 4, False)])
def test_paired_bytes_are_ours_alone_with_the_baselines_tail_queued(monkeypatch, warmup, steps,
                                                                    alternate):
    import network
    link = QueuedLink()
    monkeypatch.setattr(network, "tx_bytes", lambda iface: link.counted)
    r = network.time_paired(link.step(100, 40), link.step(1000, 400),
                            {"warmup": warmup, "steps": steps}, "veth", lambda: None, alternate)
    assert r["bytes_per_step"] == 100
    assert len(r["steps_ms"]) == len(r["base_steps_ms"]) == steps


def test_network_refuses_paired_steps_with_no_bytes_of_ours_alone():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "network.py"),
                           "--paired", "--steps", "1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "after 3 warm-up steps needs --steps 2 or more, got 1" in proc.stderr


def test_network_refuses_a_negative_autotune():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "network.py"),
                           "--autotune", "-2"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "--autotune must be a number of probe steps per arm >= 0, got -2" in proc.stderr


# The same skip as the network bench's other runs: namespaces need root (CI has it and runs this).
@pytest.mark.skipif(NETWORK_UNAVAILABLE is not None, reason=f"{NETWORK_UNAVAILABLE}")
def test_network_autotune_probes_inside_the_warm_up(tmp_path):
    """--autotune K: our rows' specs carry autotune=K, the warm-up grows by the probe's steps
    so that only steps after the decision are timed, and each row says which arm it kept."""
    from hvd_compress.autotune import WARMUP
    proc = run("network.py", "--quick", "--params-m", "0.3", "--steps", "1", "--rates", "1gbit",
               "--select", "onebit", "--autotune", "1", "--out", str(tmp_path))
    data, rows = outputs(tmp_path, "network_autotune1")
    assert data["settings"]["warmup"] == 3 + WARMUP + 2 and data["settings"]["autotune"] == 1
    ours = [r for r in data["rows"] if r["row"] == "onebit"]
    assert len(ours) == 1 and ours[0]["spec"] == "onebit,ef=vanilla,autotune=1"
    assert [a["probes"] for a in ours[0]["autotune"]] == [1]
    assert ours[0]["autotune_kept"] == [a["compress"] for a in ours[0]["autotune"]]
    assert all(r["autotune"] is None for r in data["rows"] if r["row"] != "onebit")
    assert "autotune kept" in proc.stdout


@pytest.mark.parametrize("flag,env", [("0", None), ("-1", None), ("nan", None),
                                      (None, "0"), (None, "fast")])
def test_network_refuses_a_cycle_time_that_is_not_positive(flag, env):
    """From the flag, or from HOROVOD_CYCLE_TIME without it, before anything is set up."""
    environ = {k: v for k, v in os.environ.items() if k != "HOROVOD_CYCLE_TIME"}
    if env is not None:
        environ["HOROVOD_CYCLE_TIME"] = env
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "network.py")]
                          + (["--cycle-time-ms", flag] if flag is not None else []),
                          capture_output=True, text=True, timeout=60, env=environ)
    assert proc.returncode != 0 and "--cycle-time-ms must be above 0" in proc.stderr
    assert repr(env if flag is None else float(flag)) in proc.stderr


@pytest.mark.skipif(NETWORK_UNAVAILABLE is not None, reason=f"{NETWORK_UNAVAILABLE}")
def test_network_two_nodes_of_two_quick(tmp_path):
    """The 4-rank layout: two namespaces of two ranks, the two-level rows included; Horovod's
    cycle time as asked, named in the files."""
    import network
    run("network.py", "--layout", "2x2", "--quick", "--params-m", "0.1", "--steps", "1",
        "--rates", "10gbit", "--cycle-time-ms", "2.5", "--out", str(tmp_path))
    data, rows = outputs(tmp_path, "network_2x2_cycle2.5ms")
    assert [r["row"] for r in rows] == [label for label, _, _ in network.ROWS_2X2]
    assert data["settings"]["ranks"] == 4 and data["settings"]["horovod_cycle_time_ms"] == 2.5
    assert all(float(r["ms_per_step"]) > 0 and int(r["bytes_per_step"]) > 0 for r in rows)


# Parameters that cross the link: torchvision's ResNet-50 (bench/models.py), and Keras' through
# the TensorFlow frontend (its 214 trainable tensors; the batch norms' moving statistics are not
# trained). Keras has no DDP rows. Keras' case is slow (TensorFlow traces ResNet-50's step once
# per row: 3.6 minutes of the 2-core CI machine): `make bench-quick` runs it, `make test` not.
REAL_MODELS = [("resnet50", 25_557_032),
               pytest.param("keras-resnet50", 25_583_592, marks=pytest.mark.slow)]


@pytest.mark.skipif(NETWORK_UNAVAILABLE is not None, reason=f"{NETWORK_UNAVAILABLE}")
@pytest.mark.parametrize("model,params", REAL_MODELS)
def test_network_real_model_in_buckets_quick(tmp_path, model, params):
    """A real model's gradients in 4 MiB buckets: the file names the model and the buckets, and
    the bytes on the link are the model's (float32 for Horovod)."""
    run("network.py", "--model", model, "--bucket-mb", "4", "--steps", "1", "--rates",
        "10gbit", "--select", "topk", "--out", str(tmp_path))
    data, rows = outputs(tmp_path, f"network_{model}_buckets4mb")
    assert [r["row"] for r in rows] == ["horovod, no compression", "horovod fp16", "topk 1%"]
    assert data["settings"]["model"] == model and data["settings"]["bucket_mb"] == 4
    plain = int(rows[0]["bytes_per_step"])
    assert params * 4 <= plain < 1.2 * params * 4
    assert int(rows[2]["bytes_per_step"]) < plain / 10


def test_bucket_size_collates_the_runs_it_finds(tmp_path):
    """Runs already under --work are read, not run again (no root needed): the table is the
    median over the repeats, and the geomean row takes our rows only, each against its time
    alone."""
    times = {("onebit", 0): [100, 120], ("onebit", 4): [121, 121], ("topk 1%", 0): [200, 200],
             ("topk 1%", 4): [170, 190], ("horovod, no compression", 0): [900, 900],
             ("horovod, no compression", 4): [500, 500]}
    for repeat in (1, 2):
        for size in (0, 4):
            folder = tmp_path / "work" / f"r{repeat}b{size}"
            folder.mkdir(parents=True)
            rows = [{"rate": "1gbit", "row": row, "spec": "", "bytes_per_step": 1,
                     "ms_per_step": ms[repeat - 1]}
                    for (row, s), ms in times.items() if s == size]
            name = "network_resnet50" + ("_buckets4mb" if size else "")
            settings = {"steps": 8, "bucket_mb": size, "rates": ["1gbit"]}
            (folder / f"{name}.json").write_text(json.dumps({"settings": settings,
                                                             "rows": rows}))
    run("bucket_size.py", "--sizes", "0,4", "--rates", "1gbit", "--repeats", "2", "--select",
        "onebit,topk", "--work", str(tmp_path / "work"), "--out", str(tmp_path))
    data, _ = outputs(tmp_path, "bucket_size_resnet50")
    got = {(r["row"], r["bucket_mb"]): r["ms_per_step"] for r in data["rows"]}
    assert got[("onebit", 0)] == 110 and got[("topk 1%", 4)] == 180
    assert got[("horovod, no compression", 4)] == 500
    assert abs(got[("geomean of ours / alone", 4)] - (121 / 110 * 180 / 200) ** 0.5) < 1e-12
    assert got[("geomean of ours / alone", 0)] == 1


@pytest.mark.parametrize("ask,says", [(["--steps", "3"], "--steps 8 (this sweep: 3)"),
                                      (["--rates", "1gbit,10gbit"], "no rate 10gbit"),
                                      (["--select", "onebit,dgc"], "no row for --select dgc")])
def test_bucket_size_refuses_a_run_made_with_other_settings(tmp_path, ask, says):
    folder = tmp_path / "work" / "r1b0"
    folder.mkdir(parents=True)
    rows = [{"rate": "1gbit", "row": "onebit", "spec": "", "bytes_per_step": 1,
             "ms_per_step": 100}]
    (folder / "network_resnet50.json").write_text(json.dumps(
        {"settings": {"steps": 8, "bucket_mb": 0, "rates": ["1gbit"]}, "rows": rows}))
    args = {"--sizes": "0", "--rates": "1gbit", "--repeats": "1", "--select": "onebit",
            "--steps": "8", "--work": str(tmp_path / "work"), "--out": str(tmp_path)}
    args.update(zip(ask[::2], ask[1::2]))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bucket_size.py"),
                           *[x for kv in args.items() for x in kv]],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode != 0
    assert f"{folder} holds a run made with other settings" in proc.stderr and says in proc.stderr


def test_cost_model_recovers_a_known_fit(tmp_path):
    """Times made exactly by the model, with an intercept shared by each codec's allgather and
    compressed allreduce so that alpha is identifiable: the fit must give back eta and alpha."""
    import cost_model
    import network
    alpha, eta, params_m = 0.5e-3, 0.8, 6.0
    rows = []
    for i, (label, how, spec) in enumerate(r for r in network.ROWS_2X2
                                           if r[0] in cost_model.EXTEND):
        plans = cost_model.tensor_plans(how, spec, params_m, 2, 2)
        compute = 0.1 + 0.02 * len(label.split()[0])  # the same for a codec's two rows
        for j, (rate, bps) in enumerate(network.RATES.items()):
            sent = int(1e6 * (1 + i) * (1 + 0.01 * j))
            t = compute + alpha * cost_model.messages(plans) + sent * 8 / (eta * bps)
            rows.append({"rate": rate, "row": label, "spec": spec, "ms_per_step": 1e3 * t,
                         "bytes_per_step": sent})
    rows.append({"rate": "1gbit", "row": "ddp fp16_compress_hook", "spec": "fp16",
                 "ms_per_step": 1.0, "bytes_per_step": 1})  # not modelled: left out
    src = tmp_path / "synthetic.json"
    src.write_text(json.dumps({"settings": {"params_m": params_m, "ranks": 4, "layout": "2x2"},
                               "rows": rows}))
    proc = run("cost_model.py", str(src), "--out", str(tmp_path), timeout=120)
    with open(tmp_path / "cost_model.json") as f:
        data = json.load(f)
    s = data["settings"]
    assert {k: round(v["eta"], 6) for k, v in s["eta"].items()} == {
        f"2x2 {g}": eta for g in ("allreduce", "allgather", "compressed_allreduce")}
    assert s["alpha_identifiable_per_row"] is False
    assert s["alpha_ms"] == pytest.approx(alpha * 1e3, rel=0.01)
    assert all(abs(r["measured_ms"] - r["fitted_ms"]) < 0.1 for r in s["residuals"])
    assert {(r["ranks"], r["rate"]) for r in data["rows"]} == {
        (n, rate) for n in cost_model.RANKS for rate in cost_model.EXTEND_RATES}
    assert all(r["model_ms"] > r["t_compute_ms"] > 0 for r in data["rows"])
    assert "Model, not measurement" in proc.stdout


def test_device_step_quick(tmp_path):
    """Every codec's plans over the model's buckets on the CPU, with the collectives simulated:
    a row for each, and the bytes rank 0 sends as the payloads it made say."""
    import device_step
    run("device_step.py", "--quick", "--out", str(tmp_path), timeout=300)
    data, rows = outputs(tmp_path, "device_step")
    assert [r["codec"] for r in rows] == [device_step.BASELINE] + [
        label for label, _ in device_step.SPECS]
    wire = {r["codec"]: int(r["wire_bytes"]) for r in rows}
    raw = data["settings"]["elements"] * 4
    assert wire[device_step.BASELINE] == raw  # two ranks: a ring allreduce sends it all once
    assert wire["fp16"] == wire["bf16"] == raw // 2  # every tensor taken, no header
    assert raw / 32 < wire["onebit"] < raw / 30  # a bit an element, a scale per bucket
    assert all(float(r["ms_per_rank"]) > 0 for r in rows[1:])
