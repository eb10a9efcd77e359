"""The package as users install it: a wheel built with `pip wheel --no-build-isolation`, installed
into a fresh venv that sees the system's torch (--system-site-packages). From that venv: the
package imports from the venv (not the checkout), the quick tour runs, and a C++ program built
with find_package(dtorch_ops) against the venv's package (examples/cpp, and the public header
check) builds and runs, the example loading a TorchScript module saved from Python."""
import glob
import json
import os
import site
import sys

import pytest
import torch

from conftest import require_tool
from cpp_programs import (
    REPO,
    build_torch_targets,
    check_cpp_package_paths,
    check_cpp_programs,
    cmake_cache_value,
    run_bounded,
    save_scripted_doubler,
)

_PATHS = ("include_path", "library_path", "cmake_prefix_path")


def _ok(proc, what):
    assert proc.returncode == 0, f"{what} failed:\n{proc.stdout[-5000:]}\n{proc.stderr[-10000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory):
    """(venv's python, the package's paths in it), after building and installing the wheel."""
    work = tmp_path_factory.mktemp("packaging")
    wheels = work / "wheels"
    # In the checkout, as a user would (its build/ keeps the objects of earlier builds); no index:
    # nothing is downloaded, torch included.
    _ok(run_bounded([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                     "--no-index", "-w", wheels, REPO],
                    timeout=1200, cwd=REPO, env={"MAX_JOBS": "2", **os.environ}), "pip wheel")
    (wheel,) = glob.glob(str(wheels / "dtorch_ops-*.whl"))
    venv = work / "venv"
    # Without pip (Debian's python lacks ensurepip unless python3-venv is installed): this
    # interpreter's pip installs into it (--python).
    _ok(run_bounded([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                     venv], timeout=120), "python -m venv")
    python = str(venv / "bin" / "python")
    if sys.prefix != sys.base_prefix:
        # This interpreter is itself a venv: --system-site-packages shows the base interpreter's
        # site-packages, not this one's (where torch is). Show them as well.
        (purelib,) = glob.glob(str(venv / "lib" / "python3*" / "site-packages"))
        with open(os.path.join(purelib, "outer_site_packages.pth"), "w") as pth:
            pth.write("\n".join(site.getsitepackages()) + "\n")
    # --ignore-installed: the site-packages the venv sees may hold an editable dtorch_ops of the
    # same version; the venv gets its own.
    _ok(run_bounded([sys.executable, "-m", "pip", "--python", python, "install", "-q",
                     "--no-deps", "--no-index", "--ignore-installed", wheel], timeout=300),
        "pip install <wheel>")
    out = _ok(run_bounded([python, "-c", "import json, dtorch_ops; print(json.dumps({'file': "
                           "dtorch_ops.__file__, " + ", ".join(
                               f"'{name}': dtorch_ops.{name}()" for name in _PATHS) + "}))"],
                          timeout=120, cwd=work), "import dtorch_ops")
    paths = json.loads(out.strip().splitlines()[-1])
    return python, venv, paths


# The fixture's steps (at most 1,200 + 120 + 300 + 120 s) count towards the first test's limit.
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_wheel_installs_the_package_and_its_cpp_package(installed_wheel):
    python, venv, paths = installed_wheel
    site = os.path.realpath(venv)
    for name in ("file", *_PATHS):
        assert os.path.realpath(paths[name]).startswith(site + os.sep), (name, paths)
    # The typing (PEP 561): the marker and the binding's stub, next to the modules.
    for name in ("py.typed", "_C.pyi"):
        assert os.path.isfile(os.path.join(os.path.dirname(paths["file"]), name)), name
    check_cpp_package_paths(paths)
    with open(os.path.join(paths["cmake_prefix_path"], "dtorch_ops",
                           "dtorch_opsConfigVersion.cmake")) as f:
        assert 'set(PACKAGE_VERSION "' in f.read()


@pytest.mark.slow
@pytest.mark.timeout(2400)  # the fixture may run first (see above)
def test_quick_tour_from_the_venv(installed_wheel, tmp_path):
    python, venv, paths = installed_wheel
    out = _ok(run_bounded([python, os.path.join(REPO, "examples", "quickstart.py")], timeout=240,
                          cwd=tmp_path), "examples/quickstart.py")
    assert "scripted: [0.0, 2.0, 4.0]" in out and "value from another process" in out, out


@pytest.mark.slow
@pytest.mark.timeout(2400)  # the fixture may run first (see above)
def test_cpp_programs_against_the_installed_package(installed_wheel, tmp_path):
    python, venv, paths = installed_wheel
    cmake = require_tool("cmake", "cannot build examples/cpp")
    prefix = [torch.utils.cmake_prefix_path, paths["cmake_prefix_path"]]
    # examples/cpp on its own, as its README says; the header check from the root project.
    example_build = tmp_path / "example"
    binaries = build_torch_targets(cmake, example_build, ["dtorch_cpp_example"], prefix,
                                   source_dir=os.path.join(REPO, "examples", "cpp"))
    check_build = tmp_path / "check"
    binaries += build_torch_targets(cmake, check_build, ["public_header_check"], prefix)
    config_dir = os.path.join(paths["cmake_prefix_path"], "dtorch_ops")
    for build in (example_build, check_build):
        assert cmake_cache_value(build, "dtorch_ops_DIR") == config_dir
    # The programs load the venv's library (the run path CMake wrote), not the checkout's.
    readelf = require_tool("readelf", "cannot read the programs' run paths")
    for binary in binaries:
        dynamic = _ok(run_bounded([readelf, "-d", binary], timeout=60), "readelf")
        assert os.path.dirname(paths["library_path"]) in dynamic, dynamic
        assert os.path.join(REPO, "dtorch_ops") not in dynamic, dynamic
    loaded = check_cpp_programs(binaries, save_scripted_doubler(tmp_path))
    assert os.path.realpath(loaded) == os.path.realpath(paths["library_path"])
