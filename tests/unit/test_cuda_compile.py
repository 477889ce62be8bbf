"""The CUDA kernels compile: every csrc/cuda/*.cu with nvcc, the torch bindings with the CUDA
dispatch switched on, and the TensorFlow ops with their GPU kernels (GOOGLE_CUDA), linked with
the CUDA objects and loaded. CI machines have nvcc but no GPU and CPU builds of torch and
TensorFlow, so this is what catches a CUDA compile error there; tests/gpu runs the kernels where
a GPU exists.

Without nvcc the tests skip, unless HVDC_REQUIRE_NVCC=1 (set by .ci/run) makes that a failure.
"""
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CUDA_SOURCES = sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
# Hopper (the lent GPU machines) and Ampere, the GPUs Horovod clusters run today.
ARCHS = ["sm_90", "sm_80"]


def find_nvcc():
    cuda_home = os.environ.get("CUDA_HOME", "/nonexistent")
    for candidate in (shutil.which("nvcc"), os.path.join(cuda_home, "bin", "nvcc"),
                      *sorted(glob.glob("/usr/local/cuda*/bin/nvcc"), reverse=True)):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


NVCC = find_nvcc()
if NVCC is None:
    if os.environ.get("HVDC_REQUIRE_NVCC") == "1":
        raise RuntimeError("HVDC_REQUIRE_NVCC=1 but no nvcc was found (PATH, $CUDA_HOME, "
                           "/usr/local/cuda*/bin)")
    pytest.skip("no nvcc on this machine (CI sets HVDC_REQUIRE_NVCC=1, where this is a "
                "failure instead)", allow_module_level=True)


def find_cuda_include():
    beside = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(NVCC))), "include")
    for d in (beside, os.path.join(os.environ.get("CUDA_HOME", "/nonexistent"), "include"),
              *sorted(glob.glob("/usr/local/cuda*/include"), reverse=True)):
        if os.path.exists(os.path.join(d, "cuda_runtime_api.h")):
            return d
    return beside


CUDA_INCLUDE = find_cuda_include()


def nvcc_compile(src, out_dir):
    obj = os.path.join(out_dir, f"{os.path.basename(src)}.o")
    # One call for every arch: nvcc preprocesses and compiles the host side once (a third less
    # time than a call per arch) and the device side per arch, into one object.
    gencode = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in ARCHS]
    # -fPIC: the objects are linked into the TF op library below, as setup.py links them.
    cmd = [NVCC, "-c", src, "-o", obj, *gencode, "-std=c++17", "--fmad=false", "-O3",
           "-Xcompiler", "-fPIC", "-Werror", "all-warnings",
           "-I", os.path.join(ROOT, "csrc", "include")]
    return src, obj, subprocess.run(cmd, capture_output=True, text=True)


def bindings_check(inc_dir):
    """g++ -fsyntax-only on the torch bindings with the CUDA dispatch switched on."""
    import torch  # the extension is a torch extension: make test always has torch
    tinc = os.path.join(os.path.dirname(torch.__file__), "include")
    # A CPU build of torch ships c10's CUDA headers but not the one its CMake generates.
    stub = os.path.join(inc_dir, "c10", "cuda", "impl")
    os.makedirs(stub)
    with open(os.path.join(stub, "cuda_cmake_macros.h"), "w") as f:
        f.write("#define C10_CUDA_BUILD_SHARED_LIBS\n")
    cmd = ["g++", "-std=c++17", "-fsyntax-only", "-DHVDC_WITH_CUDA", "-DTORCH_EXTENSION_NAME=_C",
           "-DTORCH_API_INCLUDE_EXTENSION_H", f"-I{inc_dir}", f"-I{tinc}",
           f"-I{os.path.join(tinc, 'torch', 'csrc', 'api', 'include')}",
           f"-I{sysconfig.get_paths()['include']}", f"-I{CUDA_INCLUDE}",
           f"-I{os.path.join(ROOT, 'csrc', 'include')}",
           os.path.join(ROOT, "csrc", "torch", "bindings.cpp")]
    return subprocess.run(cmd, capture_output=True, text=True)


TF_SOURCES = [os.path.join(ROOT, "csrc", "tensorflow", "ops.cc"),
              *sorted(glob.glob(os.path.join(ROOT, "csrc", "cpu", "*.cc")))]


def tf_compile(tf, src, out_dir):
    """A source of the TF op library as setup.py compiles it for a CUDA TensorFlow."""
    obj = os.path.join(out_dir, f"{os.path.basename(src)}.o")
    warn = ["-Wall", "-Werror"] if src == TF_SOURCES[0] else []
    cmd = ["g++", "-std=c++17", "-O1", "-fPIC", "-DGOOGLE_CUDA=1", "-DEIGEN_USE_GPU",
           *tf.sysconfig.get_compile_flags(), f"-I{CUDA_INCLUDE}",
           f"-I{os.path.join(ROOT, 'csrc', 'include')}", *warn, "-c", src, "-o", obj]
    return src, obj, subprocess.run(cmd, capture_output=True, text=True)


@pytest.fixture(scope="module")
def compiles(tmp_path_factory):
    """Every compile of this module, started at once on one pool whose workers the tests then
    wait on: nvcc and the bindings' check are one thread each, so started test by test they
    left a core idle for a minute. The longest job goes first."""
    out = tmp_path_factory.mktemp("compiles")
    for d in ("cuda", "tf", "include"):
        (out / d).mkdir()
    try:
        import tensorflow as tf
    except ImportError:
        tf = None
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        yield {"bindings": pool.submit(bindings_check, str(out / "include")),
               "cuda": [pool.submit(nvcc_compile, src, str(out / "cuda")) for src in CUDA_SOURCES],
               "tf": None if tf is None else [pool.submit(tf_compile, tf, src, str(out / "tf"))
                                              for src in TF_SOURCES]}


@pytest.fixture(scope="module")
def cuda_objects(compiles):
    """(source, object, nvcc result) for every .cu, each object holding every arch."""
    return [f.result() for f in compiles["cuda"]]


def nvcc_failures(results):
    return [f"{os.path.relpath(src, ROOT)}:\n{r.stderr[-3000:]}"
            for src, _, r in results if r.returncode != 0]


def test_there_are_cuda_kernels_for_every_cpu_kernel_file():
    cpu = {os.path.splitext(os.path.basename(f))[0]
           for f in glob.glob(os.path.join(ROOT, "csrc", "cpu", "*.cc"))}
    cuda = {os.path.splitext(os.path.basename(f))[0] for f in CUDA_SOURCES}
    # randomk's kernels sit with the other element-wise ones in cast.cu; topk with the sparse ones.
    assert cpu - cuda == {"randomk", "topk"}, sorted(cpu - cuda)


def test_every_cu_file_compiles(cuda_objects):
    failed = nvcc_failures(cuda_objects)
    assert not failed, "\n".join(failed)
    assert len(cuda_objects) == len(CUDA_SOURCES) > 0


def test_torch_bindings_compile_with_cuda_dispatch(compiles):
    r = compiles["bindings"].result()
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert r.returncode == 0, "\n".join(errors[:20]) or r.stderr[-3000:]


# Inputs a GPU kernel reads on the host (HostMemory); everything else stays on the device.
HOST_SCALARS = {"step", "prescale", "alpha", "mu", "eps", "factor"}
# Computed on the host whatever the device: their GPU kernels keep host outputs.
HOST_OPS = {"HvdcCodecTime": {"nanoseconds"}, "HvdcPowersgdInitialQ": {"step", "qt"}}


def test_tensorflow_ops_build_with_gpu_kernels(tmp_path, compiles, cuda_objects):
    """ops.cc as setup.py builds it for a CUDA TensorFlow: GOOGLE_CUDA and EIGEN_USE_GPU against
    the installed TF headers (a CPU wheel ships the same framework headers and Eigen's GPU
    device; the CUDA ones come from the toolkit), linked with the nvcc objects and static cudart.
    Registering a DEVICE_GPU kernel needs no GPU, so the library loads into a CPU TensorFlow and
    its kernel registry shows every op on both devices."""
    tf = pytest.importorskip("tensorflow")
    assert not nvcc_failures(cuda_objects), "the CUDA objects did not compile"
    objects = [obj for _, obj, _ in cuda_objects]
    cuda_lib = os.path.join(os.path.dirname(CUDA_INCLUDE), "lib64")
    compiled = [f.result() for f in compiles["tf"]]
    failed = [f"{os.path.relpath(src, ROOT)}:\n{r.stderr[-3000:]}"
              for src, _, r in compiled if r.returncode != 0]
    assert not failed, "\n".join(failed)

    lib = str(tmp_path / "_ops_gpu.so")
    link = ["g++", "-shared", "-o", lib, *[obj for _, obj, _ in compiled], *objects,
            *tf.sysconfig.get_link_flags(), f"-Wl,-rpath,{tf.sysconfig.get_lib()}",
            f"-L{cuda_lib}", "-lcudart_static", "-ldl", "-lrt", "-lpthread"]
    r = subprocess.run(link, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]

    with open(TF_SOURCES[0]) as f:
        ops = re.findall(r'REGISTER_OP\("(\w+)"\)', f.read())
    # A fresh process: this one may hold the CPU-only library, whose ops would clash.
    probe = ("import json, sys, tensorflow as tf\n"
             "from tensorflow.python.framework import kernels\n"
             "tf.load_op_library(sys.argv[1])\n"
             "print(json.dumps({op: {k.device_type: sorted(k.host_memory_arg) for k in "
             "kernels.get_registered_kernels_for_op(op).kernel} for op in sys.argv[2:]}))\n")
    r = subprocess.run([sys.executable, "-c", probe, lib, *ops], capture_output=True, text=True,
                       env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert r.returncode == 0, r.stderr[-3000:]
    registered = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(ops) == len(registered) >= 17
    for op, devices in registered.items():
        assert set(devices) == {"CPU", "GPU"}, (op, devices)
        assert devices["CPU"] == [], (op, devices)
        assert set(devices["GPU"]) <= HOST_OPS.get(op, HOST_SCALARS), (op, devices)
    assert registered["HvdcEncode"]["GPU"] == ["prescale", "step"]
    assert registered["HvdcHomoEncode"]["GPU"] == ["step"]
    assert registered["HvdcPowersgdInitialQ"]["GPU"] == ["qt", "step"]
