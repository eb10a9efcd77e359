"""The C++ API from the editable install: libdtorch_ops.so links no Python and exports only the
API; examples/cpp and the public header check (the root CMake project's torch targets) build
with find_package(dtorch_ops), run their checks, and the example runs a TorchScript module saved
here that calls torch.ops.dtorch.*. (tests/test_packaging.py: the same from an installed wheel.)"""
import os
import subprocess

import pytest
import torch

import dtorch_ops
from conftest import require_tool
from cpp_programs import (
    build_torch_targets,
    check_cpp_package_paths,
    check_cpp_programs,
    cmake_cache_value,
    run_bounded as _run,
    save_scripted_doubler,
)


def test_library_links_no_python():
    readelf = require_tool("readelf", "cannot inspect the library's dependencies")
    proc = _run([readelf, "-d", dtorch_ops.library_path()], timeout=60)
    assert proc.returncode == 0, proc.stderr
    needed = [line.split("[", 1)[1].rstrip("]") for line in proc.stdout.splitlines() if "(NEEDED)" in line]
    assert needed, proc.stdout
    assert not [lib for lib in needed if "python" in lib], needed
    assert any(lib.startswith("libtorch") for lib in needed), needed


def test_library_exports_only_dtorch_symbols():
    """-fvisibility=hidden and csrc/exports.map: the dynamic symbols are the API's (namespace
    dtorch, DTORCH_API / DTORCH_INTERNAL_API), none of the core's, and no copies of the headers'
    templates (Boost.Asio, torch) that another library in the process could bind to."""
    nm = require_tool("nm", "cannot list the library's symbols")
    proc = _run([nm, "-D", "--defined-only", "-C", dtorch_ops.library_path()], timeout=60)
    assert proc.returncode == 0, proc.stderr
    names = [line.split(" ", 2)[2] for line in proc.stdout.splitlines() if line.count(" ") >= 2]
    assert "dtorch::GetTensorAsync(at::Tensor const&)" in names
    assert any(name.startswith("dtorch::internal::") for name in names)
    foreign = [n for n in names if not n.startswith(("dtorch::", "typeinfo for dtorch::",
                                                     "typeinfo name for dtorch::",
                                                     "vtable for dtorch::"))]
    assert not foreign, foreign[:20]
    assert not [n for n in names if "dtorch::core::" in n.split("(")[0]], "the core is exported"


def test_cpp_package_of_the_editable_install():
    """include_path(), library_path() and cmake_prefix_path() lead to the files, and the package
    config's version is the package's (tests/test_packaging.py: the same for a wheel)."""
    from importlib.metadata import version

    check_cpp_package_paths({name: getattr(dtorch_ops, name)()
                             for name in ("include_path", "library_path", "cmake_prefix_path")})
    version_file = os.path.join(dtorch_ops.cmake_prefix_path(), "dtorch_ops",
                                "dtorch_opsConfigVersion.cmake")
    with open(version_file) as f:
        assert f'set(PACKAGE_VERSION "{version("dtorch_ops")}")' in f.read()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cpp_example_and_public_header_against_the_editable_install(tmp_path):
    """The root CMake project's torch targets (examples/cpp and the public header check), found
    with find_package(dtorch_ops) from this install."""
    cmake = require_tool("cmake", "cannot build examples/cpp")
    module_path = save_scripted_doubler(tmp_path)
    build = tmp_path / "build"
    binaries = build_torch_targets(
        cmake, build, ["dtorch_cpp_example", "public_header_check"],
        prefix_path=[torch.utils.cmake_prefix_path, dtorch_ops.cmake_prefix_path()])
    assert cmake_cache_value(build, "dtorch_ops_DIR") == os.path.join(
        dtorch_ops.cmake_prefix_path(), "dtorch_ops")
    loaded = check_cpp_programs(binaries, module_path)
    assert os.path.realpath(loaded) == os.path.realpath(dtorch_ops.library_path())
