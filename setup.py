"""hvd_compress: gradient compression for Horovod, on PyTorch and TensorFlow.

The codec kernels in csrc/ are compiled into a torch extension when torch is installed (with the
CUDA kernels of csrc/cuda when torch is a CUDA build and nvcc is present) and into a TensorFlow
op library when TensorFlow is (with GPU kernels on the same CUDA code when TensorFlow is a CUDA
build and nvcc is present); the framework-neutral core (hvd_compress/) installs and imports
without either.
"""
import glob
import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
KERNEL_SOURCES = sorted(glob.glob(os.path.join("csrc", "cpu", "*.cc")))
# -ffp-contract=off keeps a*b+c as two roundings, so the kernels match their numpy references
# bit for bit whatever instructions the compiler picks.
# -g0 undoes the -g in Python's own CFLAGS: debug information over torch's headers took the
# bindings from 68 to 118 s of one core, the whole clean build from 140 to 214 s on two.
CXX_FLAGS = ["-O3", "-g0", "-std=c++17", "-ffp-contract=off", "-fno-math-errno"]


CUDA_SOURCES = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
# --fmad=false is nvcc's -ffp-contract=off: the CUDA kernels then round where the CPU ones do
# and match them bit for bit.
NVCC_FLAGS = ["-O3", "-std=c++17", "--fmad=false", "-Xcompiler", "-fno-math-errno"]


def cuda_build():
    """Why the CUDA kernels are (not) built: they need a CUDA build of torch and nvcc."""
    if os.environ.get("HVDC_CUDA", "") == "0":
        return False, "HVDC_CUDA=0"
    import torch
    from torch.utils.cpp_extension import CUDA_HOME
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is a CPU build"
    if CUDA_HOME is None:
        return False, "no CUDA toolkit (nvcc) found; set CUDA_HOME"
    return True, f"torch {torch.__version__} (CUDA {torch.version.cuda}), toolkit in {CUDA_HOME}"


def torch_extensions():
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        return [], {}
    with_cuda, why = cuda_build()
    print(f"hvd_compress: CUDA kernels {'built' if with_cuda else 'skipped'}: {why}")
    sources = KERNEL_SOURCES + ["csrc/torch/bindings.cpp"]
    include = [os.path.join(ROOT, "csrc", "include")]
    if with_cuda:
        ext = CUDAExtension(
            "hvd_compress.torch._C", sources + CUDA_SOURCES, include_dirs=include,
            define_macros=[("HVDC_WITH_CUDA", None)],
            extra_compile_args={"cxx": CXX_FLAGS, "nvcc": NVCC_FLAGS},
        )
    else:
        ext = CppExtension("hvd_compress.torch._C", sources, include_dirs=include,
                           extra_compile_args=CXX_FLAGS)
    # ninja compiles an extension's sources side by side (torch falls back to one by one, with a
    # warning, where it finds no ninja on PATH).
    return [ext], {"build_ext": BuildExtension}


def find_cuda_home():
    """The CUDA toolkit for builds without torch to ask: $CUDA_HOME, nvcc on PATH, or
    /usr/local/cuda. The headers are checked too: an nvcc on PATH may be a wrapper script
    outside the toolkit."""
    nvcc = shutil.which("nvcc")
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
                 nvcc and os.path.dirname(os.path.dirname(os.path.realpath(nvcc))),
                 "/usr/local/cuda"):
        if (home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK)
                and os.path.exists(os.path.join(home, "include", "cuda_runtime_api.h"))):
            return home
    return None


def tf_cuda_build(tf):
    """Why the TF ops get (no) GPU kernels: they need a CUDA build of TensorFlow and nvcc."""
    if os.environ.get("HVDC_CUDA", "") == "0":
        return None, "HVDC_CUDA=0"
    if not tf.test.is_built_with_cuda():
        return None, f"tensorflow {tf.__version__} is a CPU build"
    home = find_cuda_home()
    if home is None:
        return None, "no CUDA toolkit (nvcc) found; set CUDA_HOME"
    return home, f"tensorflow {tf.__version__} (CUDA build), toolkit in {home}"


# sm_80 and sm_90 as machine code, and PTX for the GPUs after them.
TF_CUDA_ARCHS = ["-gencode", "arch=compute_80,code=sm_80",
                 "-gencode", "arch=compute_90,code=[sm_90,compute_90]"]


def tensorflow_op_library():
    """The TF custom-op library: the same kernel sources, built against the installed TF's
    headers. It is loaded with tf.load_op_library, not imported."""
    try:
        import tensorflow as tf
    except ImportError:
        return []
    from setuptools import Extension
    cuda_home, why = tf_cuda_build(tf)
    print(f"hvd_compress: TensorFlow GPU kernels {'built' if cuda_home else 'skipped'}: {why}")
    lib_dir = tf.sysconfig.get_lib()
    ext = Extension(
        "hvd_compress.tensorflow._ops",
        KERNEL_SOURCES + ["csrc/tensorflow/ops.cc"],
        include_dirs=[os.path.join(ROOT, "csrc", "include")],
        extra_compile_args=CXX_FLAGS + tf.sysconfig.get_compile_flags(),
        extra_link_args=tf.sysconfig.get_link_flags() + [f"-Wl,-rpath,{lib_dir}"],
        language="c++",
    )
    if cuda_home:
        ext.nvcc = os.path.join(cuda_home, "bin", "nvcc")
        ext.nvcc_sources = CUDA_SOURCES
        ext.define_macros += [("GOOGLE_CUDA", "1"), ("EIGEN_USE_GPU", None)]
        ext.include_dirs.append(os.path.join(cuda_home, "include"))
        # cudart linked statically, as nvcc links it, so the library does not depend on which
        # libcudart TensorFlow's own packages put on the loader's path.
        ext.library_dirs.append(os.path.join(cuda_home, "lib64"))
        ext.libraries += ["cudart_static", "dl", "rt", "pthread"]
    return [ext]


def with_nvcc_sources(base):
    """build_ext that first compiles an extension's `nvcc_sources` with its `nvcc` and links the
    objects in: setuptools has no CUDA support, and the TF library must build without torch's.
    Each extension gets its own object directory: both compile csrc/cpu, with different flags."""
    class BuildExtWithNvcc(base):
        def build_extension(self, ext):
            shared_temp = self.build_temp
            self.build_temp = os.path.join(shared_temp, ext.name)
            try:
                self._build_with_nvcc_sources(ext)
            finally:
                self.build_temp = shared_temp

        def _build_with_nvcc_sources(self, ext):
            objects = []
            for src in getattr(ext, "nvcc_sources", []):
                obj = os.path.join(self.build_temp, "nvcc", os.path.splitext(src)[0] + ".o")
                os.makedirs(os.path.dirname(obj), exist_ok=True)
                self.spawn([ext.nvcc, "-c", src, "-o", obj, *NVCC_FLAGS, "-Xcompiler", "-fPIC",
                            *TF_CUDA_ARCHS, "-I", os.path.join(ROOT, "csrc", "include")])
                objects.append(obj)
            ext.extra_objects = list(ext.extra_objects or []) + objects
            super().build_extension(ext)
    return BuildExtWithNvcc


# The HVD_COMPRESSION opt-in (hvd_compress/launch.py): a .pth file at the top of site-packages,
# inert unless that variable is set.
PTH = "hvd_compress_env.pth"


class build_py_with_pth(build_py):
    def run(self):
        super().run()
        self.copy_file(os.path.join("hvd_compress", "env.pth"),
                       os.path.join(self.build_lib, PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


ext_modules, cmdclass = torch_extensions()
ext_modules += tensorflow_op_library()
cmdclass["build_ext"] = with_nvcc_sources(cmdclass.get("build_ext", build_ext))
cmdclass["build_py"] = build_py_with_pth

setup(
    name="hvd_compress",
    version="0.1.0",
    description="Gradient compression codecs for Horovod, in compiled kernels",
    packages=find_packages(include=["hvd_compress", "hvd_compress.*"]),
    python_requires=">=3.11",
    install_requires=["numpy"],
    package_data={"hvd_compress": ["env.pth"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
