"""hvd_compress: gradient compression for Horovod, on PyTorch and TensorFlow.

The codec kernels in csrc/ are compiled into a torch extension when torch is installed (with the
CUDA kernels of csrc/cuda when torch is a CUDA build and nvcc is present) and into a TensorFlow
op library when TensorFlow is; the framework-neutral core (hvd_compress/) installs and imports
without either.
"""
import glob
import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
KERNEL_SOURCES = sorted(glob.glob(os.path.join("csrc", "cpu", "*.cc")))
# -ffp-contract=off keeps a*b+c as two roundings, so the kernels match their numpy references
# bit for bit whatever instructions the compiler picks.
CXX_FLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-fno-math-errno"]


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
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=False)}


def tensorflow_op_library():
    """The TF custom-op library: the same kernel sources, built against the installed TF's
    headers. It is loaded with tf.load_op_library, not imported."""
    try:
        import tensorflow as tf
    except ImportError:
        return []
    from setuptools import Extension
    lib_dir = tf.sysconfig.get_lib()
    return [Extension(
        "hvd_compress.tensorflow._ops",
        KERNEL_SOURCES + ["csrc/tensorflow/ops.cc"],
        include_dirs=[os.path.join(ROOT, "csrc", "include")],
        extra_compile_args=CXX_FLAGS + tf.sysconfig.get_compile_flags(),
        extra_link_args=tf.sysconfig.get_link_flags() + [f"-Wl,-rpath,{lib_dir}"],
        language="c++",
    )]


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
