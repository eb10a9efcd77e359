"""Build of dtorch_ops.

Two native artifacts:
  dtorch_ops/libdtorch_ops.so  the ops, kernels and custom classes; links libtorch only (no
                               Python), so a libtorch C++ program can link or dlopen it too;
  dtorch_ops/_C.*.so           the Python module: a direct pybind11 binding of the library's
                               classes and ops (the only part that links libtorch_python).

Build with `pip install --no-build-isolation -e .` against the torch already installed (torch is
deliberately not a build requirement: pip would pick a multi-GB CUDA build by itself).
"""
import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = os.path.dirname(os.path.abspath(__file__))
LIB_EXT_NAME = "dtorch_ops.libdtorch_ops"

CXX_FLAGS = ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-fvisibility-inlines-hidden"]
# Boost (>= 1.78, headers only: Asio, Interprocess) from the system, or from DTORCH_BOOST_INCLUDE
# (the GPU machine has none installed: scripts/device_check.sh unpacks Debian's package there).
BOOST_INCLUDE = [os.environ["DTORCH_BOOST_INCLUDE"]] if os.environ.get("DTORCH_BOOST_INCLUDE") else []


def _sources(*patterns):
    found = sorted(p for pattern in patterns for p in glob.glob(os.path.join("csrc", pattern)))
    assert found, f"no sources match {patterns}"
    return found


class BuildDtorchExtensions(BuildExtension):
    """Names the core library libdtorch_ops.so and links _C against it (rpath $ORIGIN)."""

    def get_ext_filename(self, fullname):
        filename = super().get_ext_filename(fullname)
        if fullname.split(".")[-1] == LIB_EXT_NAME.split(".")[-1]:
            # A plain library name (no CPython tag): it is not a Python module.
            return filename[: filename.index(".")] + ".so"
        return filename

    def build_extensions(self):
        lib_dir = os.path.dirname(self.get_ext_fullpath(LIB_EXT_NAME))
        for ext in self.extensions:
            if ext.name != LIB_EXT_NAME:
                ext.library_dirs.append(lib_dir)
        super().build_extensions()


def _without_libtorch_python(ext):
    # The core library must load in a process without Python: keep only libtorch's C++ libraries.
    ext.libraries = [lib for lib in ext.libraries if lib != "torch_python"]
    return ext


setup(
    ext_modules=[
        _without_libtorch_python(
            CppExtension(
                LIB_EXT_NAME,
                sources=_sources("core/*.cc", "ops/*.cpp", "*.cpp"),
                include_dirs=BOOST_INCLUDE,
                extra_compile_args={"cxx": CXX_FLAGS},
            )
        ),
        # The direct binding: torch's pybind11 and libtorch_python, linked to the library.
        CppExtension(
            "dtorch_ops._C",
            sources=_sources("python/*.cpp"),
            extra_compile_args={"cxx": CXX_FLAGS},
            extra_link_args=["-l:libdtorch_ops.so", "-Wl,-rpath,$ORIGIN"],
        ),
    ],
    cmdclass={"build_ext": BuildDtorchExtensions},
)
