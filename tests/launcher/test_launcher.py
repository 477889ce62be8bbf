"""`python -m hvd_compress` and HVD_COMPRESSION on Horovod scripts that do not import us.

The scripts in scripts/ are written as Horovod's examples are (a PyTorch optimizer, a TF2
GradientTape, Keras model.fit with Horovod's callbacks). Each runs at 2 ranks under `mpirun`
and `horovodrun --gloo`, through the launcher and through the environment variable, and must
give exactly the weights of the same script edited by hand to use hvd_compress with that spec.
This file runs in one plain process and starts the jobs itself.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import tensorboard_scalars

from hvd_compress import parse_spec
from hvd_compress.stats import SCALARS

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "scripts")
PY = sys.executable
STEPS = 4
EXIT_CODE = 3

# script -> (spec, the hand edit: (original text, replacement) pairs, each found exactly once)
CASES = {
    # bucket_mb in the spec: the launcher's only way to turn buckets on
    "torch_train": ("topk,k=0.01,ef=vanilla,bucket_mb=1", [
        ("import horovod.torch as hvd\n",
         "import horovod.torch as hvd\nimport hvd_compress.torch as hvdc\n"),
        ("hvd.DistributedOptimizer(", "hvdc.DistributedOptimizer("),
        ("compression=compression)", "compression=SPEC)")]),
    "tf_tape_train": ("onebit,ef=vanilla", [
        ("import horovod.tensorflow as hvd\n",
         "import horovod.tensorflow as hvd\nimport hvd_compress.tensorflow as hvdt\n"),
        ("hvd.DistributedGradientTape(tape, compression=compression)",
         "hvdt.DistributedGradientTape(tape, compression=SPEC)")]),
    "keras_train": ("efsignsgd", [
        ("import horovod.tensorflow.keras as hvd\n",
         "import horovod.tensorflow.keras as hvd\nimport hvd_compress.tensorflow.keras as hvdk\n"),
        ("hvd.DistributedOptimizer(opt, compression=compression)",
         "hvdk.DistributedOptimizer(opt, compression=SPEC)")]),
}


def job(launcher: str, argv: list[str], env: dict | None = None, ranks: int = 2):
    """Start `argv` (a python command line) on `ranks` ranks; env is added to every rank's."""
    env = env or {}
    if launcher == "mpirun":
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(ranks), "-x", "PATH"]
        for key in env:
            cmd += ["-x", key]
    else:
        cmd = [os.path.join(os.path.dirname(PY), "horovodrun"), "--gloo", "-np", str(ranks), "-H", f"localhost:{ranks}"]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("HVD_COMPRESSION")}
    full_env["PATH"] = os.path.dirname(PY) + os.pathsep + full_env.get("PATH", "")
    full_env.update(env)
    return subprocess.run(cmd + [PY] + argv, env=full_env, capture_output=True, text=True,
                          timeout=600)


def script_args(out: str) -> list[str]:
    return ["--out", out, "--steps", str(STEPS), "--exit-code", str(EXIT_CODE)]


def check_exit(proc, launcher: str) -> None:
    """The script's exit code reaches the launcher (horovodrun reports it and returns 1)."""
    output = proc.stdout + proc.stderr
    if launcher == "mpirun":
        assert proc.returncode == EXIT_CODE, output
    else:
        assert proc.returncode != 0 and f"Exit code: {EXIT_CODE}" in output, output


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


@functools.lru_cache(maxsize=None)
def hand_edited(script: str, root: str) -> dict:
    """The weights of the script edited to build hvd_compress's optimizer or tape itself, run
    once, under mpirun: two ranks sum in the same order under either launcher, so the unchanged
    script must give these weights bit for bit under horovodrun too."""
    spec, edits = CASES[script]
    with open(os.path.join(SCRIPTS, script + ".py")) as f:
        source = f.read()
    for old, new in edits:
        assert source.count(old) == 1, f"{script}.py no longer contains {old!r} once"
        source = source.replace(old, new.replace("SPEC", repr(spec)))
    edited = os.path.join(root, f"{script}_edited.py")
    with open(edited, "w") as f:
        f.write(source)
    out = os.path.join(root, f"{script}_edited.json")
    proc = job("mpirun", [edited] + script_args(out))
    check_exit(proc, "mpirun")
    return load(out)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("launcher"))


# Each script under both launchers and both ways in, paired so that across the scripts every
# launcher meets every way in, in 9 jobs with the hand-edited runs where every combination took
# 18 (15-20 s each in CI).
PAIRS = {"torch_train": [("mpirun", "module"), ("horovodrun", "env")],
         "tf_tape_train": [("mpirun", "env"), ("horovodrun", "module")],
         "keras_train": [("mpirun", "module"), ("horovodrun", "env")]}


@pytest.mark.parametrize("script,launcher,mode",
                         [(script, *pair) for script, pairs in PAIRS.items() for pair in pairs])
def test_compresses_an_unchanged_script(script, launcher, mode, root):
    spec, _ = CASES[script]
    tag = f"{script}_{launcher}_{mode}"
    out, stats = os.path.join(root, tag + ".json"), os.path.join(root, tag + ".stats.json")
    tensorboard = os.path.join(root, tag + ".tb")
    path = os.path.join(SCRIPTS, script + ".py")
    # The script's own fp16 request is what the spec overrides.
    args = script_args(out) + ["--fp16-allreduce"]
    if mode == "module":
        proc = job(launcher, ["-m", "hvd_compress", "--compression", spec, "--stats", stats,
                              "--tensorboard", tensorboard, path] + args)
    else:
        proc = job(launcher, [path] + args, env={"HVD_COMPRESSION": spec,
                                                 "HVD_COMPRESSION_STATS": stats,
                                                 "HVD_COMPRESSION_TENSORBOARD": tensorboard})
    check_exit(proc, launcher)
    got = load(out)
    assert got["argv"] == [path] + args and got["name"] == "__main__"
    assert got["hvd_compress_loaded"]
    losses = got["losses"]
    assert len(losses) == STEPS and np.all(np.isfinite(losses)) and losses[-1] < losses[0]

    # One override line and one summary line, from rank 0 only.
    config = parse_spec(spec)
    api = {"torch_train": "horovod.torch.DistributedOptimizer",
           "tf_tape_train": "horovod.tensorflow.DistributedGradientTape",
           "keras_train": "horovod.tensorflow.keras.DistributedOptimizer"}[script]
    source = "--compression" if mode == "module" else "HVD_COMPRESSION"
    assert proc.stderr.count(f"hvd_compress: {api} compresses with {config} (from {source}); "
                             f"the script's compression=hvd.Compression.fp16 is overridden") == 1
    assert proc.stderr.count(f"hvd_compress: {config} via {api}: {STEPS} steps") == 1

    report = load(stats)["optimizers"]
    assert len(report) == 1 and report[0]["api"] == api and report[0]["spec"] == str(config)
    assert report[0]["steps"] == STEPS and report[0]["ratio"] > 1
    assert {t["codec"] for t in report[0]["tensors"].values()} >= {config.codec}
    if config.bucket_mb:
        assert any(name.startswith("hvd_compress.bucket") for name in report[0]["tensors"])
    assert report[0]["codec_ms"] > 0

    scalars = tensorboard_scalars(tensorboard)
    assert set(scalars) == set(SCALARS)
    assert [step for step, _ in scalars["hvd_compress/ratio"]] == list(range(1, STEPS + 1))
    assert all(abs(v - report[0]["ratio"]) < 1e-6 * v for _, v in scalars["hvd_compress/ratio"])

    want = hand_edited(script, root)
    assert got["weights"].keys() == want["weights"].keys()
    for name in want["weights"]:
        np.testing.assert_array_equal(got["weights"][name], want["weights"][name], err_msg=name)


@pytest.mark.parametrize("script", list(CASES))
def test_without_the_launcher_nothing_changes(script, root):
    """No launcher, no variable: Horovod's own optimizer, and not one module of ours loaded."""
    out = os.path.join(root, f"{script}_plain.json")
    path = os.path.join(SCRIPTS, script + ".py")
    proc = job("mpirun", [path] + script_args(out) + ["--fp16-allreduce"])
    check_exit(proc, "mpirun")
    got = load(out)
    assert not got["hvd_compress_loaded"]
    assert got["optimizer"].startswith("horovod."), got["optimizer"]
    assert "hvd_compress" not in proc.stderr


@pytest.mark.parametrize("mode", ["module", "env"])
def test_a_bad_spec_stops_every_rank_before_the_script(mode, root):
    spec = "topk,ratio=3"
    with pytest.raises(ValueError) as api_error:
        parse_spec(spec)
    path = os.path.join(SCRIPTS, "torch_train.py")
    out = os.path.join(root, "never.json")
    if mode == "module":
        proc = job("mpirun", ["-m", "hvd_compress", "--compression", spec, path, "--out", out])
    else:
        proc = job("mpirun", [path, "--out", out], env={"HVD_COMPRESSION": spec})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count(str(api_error.value)) == 2  # each rank says it
    assert "script started" not in proc.stdout and not os.path.exists(out)



PROBE = '''import os, sys
print("argv", sys.argv)
print("name", __name__, "path0", sys.path[0], "file", os.path.basename(__file__))
def fail():
    raise RuntimeError("from the script")
if "--raise" in sys.argv:
    fail()
sys.exit(int(sys.argv[-1]))
'''


@pytest.mark.parametrize("how", ["script", "module"])
@pytest.mark.parametrize("ending", ["5", "--raise"])
def test_runs_the_script_as_python_would(how, ending, tmp_path):
    """Same output, sys.argv, __main__, sys.path[0], exit code and traceback as a plain run."""
    (tmp_path / "probe.py").write_text(PROBE)
    target = ["probe.py"] if how == "script" else ["-m", "probe"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HVD_COMPRESSION")}

    def run(prefix):
        return subprocess.run([PY] + prefix + target + ["--x", "1", ending], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=120)

    plain = run([])
    launched = run(["-m", "hvd_compress", "--compression", "fp16"])
    assert launched.returncode == plain.returncode == (5 if ending == "5" else 1)
    assert launched.stdout == plain.stdout
    # The traceback starts at the script's frame (`python -m` shows two of runpy's first).
    lines = plain.stderr.splitlines(keepends=True)
    runpy_frames = [i for i, line in enumerate(lines) if line.startswith('  File "<frozen runpy>"')]
    assert len(runpy_frames) == (2 if how == "module" and ending == "--raise" else 0)
    assert launched.stderr == "".join(l for i, l in enumerate(lines) if i not in runpy_frames)
    if ending == "--raise":
        assert 'File "' in plain.stderr and "RuntimeError: from the script" in plain.stderr


@pytest.mark.parametrize("argv, message", [
    ([], "give the script to run"),
    (["--compression", "fp16", "missing.py"], "can't open file"),
    (["x.py"], "give --compression SPEC (or set HVD_COMPRESSION)"),
    (["--compression", "fp16", "--min-compress-bytes", "-3", "x.py"],
     "min_compress_bytes must be an integer >= 0, got -3"),
    (["--compression", "fp16", "--bogus", "1", "x.py"], "unrecognized arguments: --bogus"),
])
def test_launcher_usage_errors(argv, message):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HVD_COMPRESSION")}
    proc = subprocess.run([PY, "-m", "hvd_compress"] + argv, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_the_pth_opt_in_is_installed_and_inert():
    """The environment opt-in is the package's .pth, in site-packages; without the variable a
    fresh interpreter loads nothing of ours."""
    import sysconfig
    with open(os.path.join(os.path.dirname(HERE), "..", "hvd_compress", "env.pth")) as f:
        line = f.read()
    installed = os.path.join(sysconfig.get_paths()["platlib"], "hvd_compress_env.pth")
    with open(installed) as f:
        assert f.read() == line
    env = {k: v for k, v in os.environ.items() if not k.startswith("HVD_COMPRESSION")}
    for value in (None, ""):
        if value is not None:
            env["HVD_COMPRESSION"] = value
        # (The editable install's own finder is not ours to judge: it only maps paths.)
        proc = subprocess.run([PY, "-c", "import sys; print(sorted(m for m in sys.modules "
                               "if m.startswith('hvd_compress')))"], env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr


# (setup, the stock call, the same call made to hvd_compress directly), one process, one rank.
UNSUPPORTED = {
    "torch": ("import torch\nimport horovod.torch as hvd\nhvd.init()\n"
              "m = torch.nn.Linear(4, 4)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n",
              "hvd.DistributedOptimizer(opt, named_parameters=m.named_parameters(), num_groups=2)",
              "import hvd_compress.torch as hvdc\nhvdc.DistributedOptimizer(opt, named_parameters="
              "m.named_parameters(), num_groups=2, compression='onebit')"),
    "tape": ("import tensorflow as tf\nimport horovod.tensorflow as hvd\nhvd.init()\n"
             "with tf.GradientTape() as tape:\n    pass\n",
             "hvd.DistributedGradientTape(tape, device_dense='/gpu:0')",
             "import hvd_compress.tensorflow as hvdt\n"
             "hvdt.DistributedGradientTape(tape, device_dense='/gpu:0', compression='onebit')"),
    "keras": ("import tensorflow as tf\nimport horovod.keras as hvd\nhvd.init()\n",
              "hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), gradient_predivide_factor=2.0)",
              "import hvd_compress.tensorflow.keras as hvdk\nhvdk.DistributedOptimizer("
              "tf.keras.optimizers.SGD(0.1), gradient_predivide_factor=2.0, compression='onebit')"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_stock_arguments_we_cannot_honour_fail_as_in_the_api(case, tmp_path):
    setup, stock, direct = UNSUPPORTED[case]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HVD_COMPRESSION")}
    (tmp_path / "stock.py").write_text(setup + stock + "\n")
    (tmp_path / "direct.py").write_text(setup + direct + "\n")
    launched = subprocess.run([PY, "-m", "hvd_compress", "--compression", "onebit", "stock.py"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    called = subprocess.run([PY, "direct.py"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert launched.returncode == called.returncode == 1
    error = called.stderr.strip().splitlines()[-1]
    assert error.startswith("ValueError: ") and "not supported by hvd_compress" in error
    assert launched.stderr.strip().splitlines()[-1] == error


@pytest.mark.parametrize("module, optimizer", [
    ("horovod.keras", "tf.keras.optimizers.SGD(0.1)"),
    ("horovod.tensorflow", "tf.compat.v1.train.GradientDescentOptimizer(0.1)"),
    ("horovod.tensorflow", "tf.keras.optimizers.SGD(0.1)")])
def test_the_other_tensorflow_optimizers_are_replaced_too(module, optimizer, tmp_path):
    """Standalone horovod.keras, and horovod.tensorflow's optimizer with a TF1-style or a Keras
    optimizer: each builds ours."""
    (tmp_path / "k.py").write_text(
        f"import tensorflow as tf\nimport {module} as hvd\nhvd.init()\n"
        f"opt = hvd.DistributedOptimizer({optimizer})\n"
        "print('ours', hasattr(opt, 'compression_report'))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HVD_COMPRESSION")}
    proc = subprocess.run([PY, "k.py"], cwd=tmp_path, env=dict(env, HVD_COMPRESSION="onebit"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ours True" in proc.stdout, proc.stderr
    assert f"{module}.DistributedOptimizer compresses with onebit" in proc.stderr
