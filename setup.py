"""Build of dtorch_ops.

Two native artifacts:
  dtorch_ops/libdtorch_ops.so  the ops, kernels and custom classes; links libtorch only (no
                               Python), so a libtorch C++ program can link or dlopen it too;
  dtorch_ops/_C.*.so           the Python module: a direct pybind11 binding of the library's
                               classes and ops (the only part that links libtorch_python).
and, next to them, the C++ package of the library:
  dtorch_ops/include/          the public headers (csrc/include: <dtorch/dtorch.h>);
  dtorch_ops/share/cmake/dtorch_ops/   dtorch_opsConfig.cmake and its version file (cmake/).
All of it lands in the package directory of the build: the checkout's dtorch_ops/ for an editable
install, the wheel's for a wheel or a `pip install .`.

The CUDA-only sources (csrc/cuda/: blocking-sync events, the graph-capture check, CUDA IPC) are
compiled into libdtorch_ops.so when the torch built against has CUDA and a CUDA toolkit of the same
major version is found (torch.utils.cpp_extension.CUDA_HOME: $CUDA_HOME, nvcc on the PATH, or
/usr/local/cuda); otherwise they are left out and the library is the same as on a CPU-only torch.
DTORCH_WITH_CUDA=0 leaves them out; DTORCH_WITH_CUDA=1 makes a missing piece an error.

Build with `pip install --no-build-isolation -e .` against the torch already installed (torch is
deliberately not a build requirement: pip would pick a multi-GB CUDA build by itself).
"""
import glob
import os
import re
import shutil
import sys

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = os.path.dirname(os.path.abspath(__file__))
LIB_EXT_NAME = "dtorch_ops.libdtorch_ops"

# Hidden by default: the library exports only DTORCH_API (the public API, csrc/include/dtorch) and
# DTORCH_INTERNAL_API (csrc/ops/internal_api.h, for _C and the simulated device).
CXX_FLAGS = ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-fvisibility=hidden",
             "-fvisibility-inlines-hidden"]
# Boost (>= 1.78, headers only: Asio, Interprocess) from the system, or from DTORCH_BOOST_INCLUDE
# (the GPU machine has none installed: scripts/device_check.sh unpacks Debian's package there).
BOOST_INCLUDE = [os.environ["DTORCH_BOOST_INCLUDE"]] if os.environ.get("DTORCH_BOOST_INCLUDE") else []
# The public headers (<dtorch/dtorch.h>), which the library's own sources include as users do.
PUBLIC_INCLUDE = os.path.join(HERE, "csrc", "include")


def _cuda_home():
    """The CUDA toolkit to compile csrc/cuda/ with, or None to leave it out (see the docstring)."""
    setting = os.environ.get("DTORCH_WITH_CUDA", "")
    if setting not in ("", "0", "1"):
        sys.exit(f"DTORCH_WITH_CUDA must be 0 or 1, got {setting!r}")
    if setting == "0":
        return None
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    problem = None
    header = os.path.join(CUDA_HOME or "", "include", "cuda_runtime_api.h")
    if not torch.version.cuda:
        problem = f"torch {torch.__version__} is built without CUDA"
    elif CUDA_HOME is None or not os.path.isfile(header):
        problem = ("no CUDA toolkit was found (set CUDA_HOME to a CUDA "
                   f"{torch.version.cuda.split('.')[0]}.x toolkit)")
    else:
        # The sources call the CUDA runtime torch loads: its headers must be of that major version.
        with open(header) as f:
            found = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", f.read())
        toolkit_major = int(found.group(1)) // 1000 if found else None
        torch_major = int(torch.version.cuda.split(".")[0])
        if toolkit_major != torch_major:
            problem = (f"the CUDA toolkit at {CUDA_HOME} is CUDA {toolkit_major}, torch's is "
                       f"{torch.version.cuda} (set CUDA_HOME to a CUDA {torch_major}.x toolkit)")
    if problem is None:
        return CUDA_HOME
    if setting == "1":
        sys.exit(f"DTORCH_WITH_CUDA=1, but {problem}")
    if torch.version.cuda:
        print(f"dtorch_ops: building without its CUDA sources: {problem}. CUDA tensors are then "
              "waited for by polling, and travel between processes through host memory.",
              file=sys.stderr)
    return None


def _sources(*patterns):
    found = sorted(p for pattern in patterns
                   for p in glob.glob(os.path.join("csrc", pattern), recursive=True))
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

    def finalize_options(self):
        super().finalize_options()
        # The objects stay between builds of this checkout (editable installs, `pip wheel`,
        # `pip install .`: pip builds in the tree), so that ninja recompiles only what changed;
        # one folder per interpreter and torch (scripts/compat.sh builds others in this checkout).
        torch_tag = torch.__version__ + ("-cuda" if CUDA_HOME is not None else "")
        self.build_temp = os.path.join(
            HERE, "build", f"temp-py{sys.version_info[0]}{sys.version_info[1]}-torch{torch_tag}")

    def run(self):
        # build_ext.run clears self.inplace before build_extensions: keep what was asked.
        self._into_checkout = self.inplace or getattr(self, "editable_mode", False)
        super().run()

    def build_extensions(self):
        lib_dir = os.path.dirname(self.get_ext_fullpath(LIB_EXT_NAME))
        for ext in self.extensions:
            if ext.name != LIB_EXT_NAME:
                ext.library_dirs.append(lib_dir)
        super().build_extensions()
        # An editable install builds into a temporary directory and copies only the extensions
        # into the checkout (copy_extensions_to_source): write the package there directly.
        self._write_cpp_package(os.path.join(HERE, "dtorch_ops") if self._into_checkout
                                else lib_dir)

    def _write_cpp_package(self, package_dir):
        """The public headers and the CMake package config, next to the library they describe."""
        include_dir = os.path.join(package_dir, "include")
        shutil.rmtree(include_dir, ignore_errors=True)  # no header left over from an older build
        shutil.copytree(PUBLIC_INCLUDE, include_dir)
        cmake_dir = os.path.join(package_dir, "share", "cmake", "dtorch_ops")
        os.makedirs(cmake_dir, exist_ok=True)
        shutil.copyfile(os.path.join(HERE, "cmake", "dtorch_opsConfig.cmake"),
                        os.path.join(cmake_dir, "dtorch_opsConfig.cmake"))
        with open(os.path.join(HERE, "cmake", "dtorch_opsConfigVersion.cmake.in")) as template:
            version_file = template.read().replace("@VERSION@", self.distribution.get_version())
        with open(os.path.join(cmake_dir, "dtorch_opsConfigVersion.cmake"), "w") as out:
            out.write(version_file)


def _without_libtorch_python(ext):
    # The core library must load in a process without Python: keep only libtorch's C++ libraries.
    ext.libraries = [lib for lib in ext.libraries if lib != "torch_python"]
    return ext


CUDA_HOME = _cuda_home()
LIB_SOURCES = _sources("core/**/*.cc", "ops/**/*.cpp", "*.cpp")
LIB_INCLUDE = [PUBLIC_INCLUDE, *BOOST_INCLUDE]
# (An extension is rebuilt when one of these is newer than it, not only a source: build/ persists,
# and ninja then recompiles what includes the changed header.)
LIB_HEADERS = _sources("**/*.h")
LIB_LIBRARIES = []
if CUDA_HOME is not None:
    # Plain C++ (no kernels): the runtime's headers, and torch's c10_cuda (its caching allocator,
    # streams, error checks). libcudart is not linked directly: c10_cuda brings the one torch
    # loads, whose symbols the library's then resolve to, so that no second search for
    # libcudart.so can fail or find another copy (a libtorch C++ program's run path, say).
    LIB_SOURCES += _sources("cuda/*.cpp")
    LIB_INCLUDE.append(os.path.join(CUDA_HOME, "include"))
    LIB_LIBRARIES.append("c10_cuda")


setup(
    ext_modules=[
        _without_libtorch_python(
            CppExtension(
                LIB_EXT_NAME,
                sources=LIB_SOURCES,
                include_dirs=LIB_INCLUDE,
                libraries=LIB_LIBRARIES,
                extra_compile_args={"cxx": CXX_FLAGS},
                depends=LIB_HEADERS,
                # A SONAME, so that CMake links the library by its path (dtorch_ops::dtorch_ops), not
                # as -ldtorch_ops found on the search path; the version script limits the exports.
                extra_link_args=["-Wl,-soname,libdtorch_ops.so",
                                 f"-Wl,--version-script={os.path.join(HERE, 'csrc', 'exports.map')}"],
            )
        ),
        # The direct binding: torch's pybind11 and libtorch_python, linked to the library.
        CppExtension(
            "dtorch_ops._C",
            sources=_sources("python/*.cpp"),
            include_dirs=[PUBLIC_INCLUDE],
            extra_compile_args={"cxx": CXX_FLAGS},
            depends=LIB_HEADERS,
            extra_link_args=["-l:libdtorch_ops.so", "-Wl,-rpath,$ORIGIN"],
        ),
    ],
    cmdclass={"build_ext": BuildDtorchExtensions},
)
