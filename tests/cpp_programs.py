"""What the C++ package tests share (tests/test_cpp_api.py: the editable install;
tests/test_packaging.py: a wheel in a fresh venv): building the root CMake project's torch targets
against an installed dtorch_ops, and running them."""
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))  # the one C++ build helper (cpp_build.py)
from cpp_build import CppBuildError, build_cpp_target  # noqa: E402


def run_bounded(cmd, timeout, **kwargs):
    """subprocess.run, captured; a command past `timeout` fails the test with its output."""
    try:
        return subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                              timeout=timeout, check=False, **kwargs)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"ran past {timeout} s: {' '.join(map(str, cmd))}\n{e.stdout}\n{e.stderr}")


def _load_example(name):
    """examples/<name>.py as a module (examples/ is not a package): the tests use the examples'
    own code, so what they check is what a user runs."""
    import importlib.util

    if f"dtorch_example_{name}" in sys.modules:
        return sys.modules[f"dtorch_example_{name}"]
    spec = importlib.util.spec_from_file_location(
        f"dtorch_example_{name}", os.path.join(REPO, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (torch.jit.script reads the module's source through it)
    spec.loader.exec_module(module)
    return module


def save_scripted_doubler(directory):
    """The module examples/cpp expects (forward(x) = x * 2 through torch.ops.dtorch.
    get_tensor_async), saved into `directory` by examples/torchscript_to_cpp.py's own function."""
    example = _load_example("torchscript_to_cpp")
    return example.save_scripted_doubler(os.path.join(directory, "doubler.pt"))


def check_cpp_package_paths(paths):
    """paths: include_path(), library_path() and cmake_prefix_path() of one install, by name."""
    assert os.path.isfile(os.path.join(paths["include_path"], "dtorch", "dtorch.h")), paths
    assert os.path.isfile(os.path.join(paths["include_path"], "dtorch_ops.h")), paths
    assert os.path.isfile(paths["library_path"]), paths
    config_dir = os.path.join(paths["cmake_prefix_path"], "dtorch_ops")
    for name in ("dtorch_opsConfig.cmake", "dtorch_opsConfigVersion.cmake"):
        assert os.path.isfile(os.path.join(config_dir, name)), paths
    # Only the public headers are installed: nothing of csrc's internals.
    installed = {os.path.relpath(os.path.join(d, f), paths["include_path"])
                 for d, _, files in os.walk(paths["include_path"]) for f in files}
    assert installed == {"dtorch_ops.h", os.path.join("dtorch", "dtorch.h"),
                         os.path.join("dtorch", "export.h"), os.path.join("dtorch", "types.h")}, \
        installed


def build_torch_targets(cmake, build_dir, targets, prefix_path, source_dir=None):
    """Builds `targets` of the root project with -DDTORCH_WITH_TORCH=ON (or of `source_dir`, a
    project of its own such as examples/cpp) against the packages on `prefix_path`; returns their
    paths. Skips where torch is a CUDA build and the CUDA toolkit is missing (find_package(Torch)
    then needs it)."""
    configure = [f"-DCMAKE_PREFIX_PATH={';'.join(prefix_path)}"]
    if source_dir is None:
        configure.append("-DDTORCH_WITH_TORCH=ON")
    binaries = []
    try:
        for target in targets:
            binaries.append(build_cpp_target(target, build_dir, cmake=cmake,
                                             configure_args=configure, source_dir=source_dir,
                                             configure_timeout=300, build_timeout=600))
    except CppBuildError as e:
        if torch.backends.cuda.is_built() and "Could NOT find CUDA" in str(e):
            pytest.skip("find_package(Torch) of a CUDA build of torch needs the whole CUDA "
                        "toolkit (headers and cudart), which this machine lacks")
        raise
    return binaries


def cmake_cache_value(build_dir, name):
    with open(os.path.join(build_dir, "CMakeCache.txt")) as f:
        for line in f:
            if line.startswith(name + ":"):
                return line.rstrip("\n").split("=", 1)[1]
    raise AssertionError(f"{name} is not in {build_dir}/CMakeCache.txt")


def check_cpp_programs(binaries, module_path):
    """Runs the example (with the scripted module) and the header check, in an environment that
    leads to no library (no LD_PRELOAD, no LD_LIBRARY_PATH: the programs' run paths decide) and
    not to Python (no PYTHON*). Returns the path of the libdtorch_ops.so the header check
    loaded."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHON"))}
    loaded = None
    for binary in binaries:
        name = os.path.basename(binary)
        args = [module_path] if name == "dtorch_cpp_example" else []
        ran = run_bounded([binary, *args], timeout=120, env=env)
        output = ran.stdout + ran.stderr
        assert ran.returncode == 0, output
        if name == "dtorch_cpp_example":
            assert "cpp example: OK" in output and "scripted module" in output, output
        else:
            assert "public header check: OK" in output, output
            (loaded,) = [line.split(": ", 1)[1] for line in output.splitlines()
                         if line.startswith("loaded: ")]
    return loaded
