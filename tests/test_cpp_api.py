"""The C++ API: libdtorch_ops.so links no Python, and examples/cpp (a libtorch program including
dtorch_ops.h) builds, runs its checks and runs a TorchScript module saved here that calls
torch.ops.dtorch.*."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

import dtorch_ops
from conftest import require_tool

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE_DIR = os.path.join(REPO, "examples", "cpp")


def _run(cmd, timeout, **kwargs):
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, check=False, **kwargs
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{cmd[0]} ran past {timeout} s: {' '.join(map(str, cmd))}\n{e.stdout}\n{e.stderr}")
    return proc


class _Doubler(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fut = torch.ops.dtorch.get_tensor_async(x * 2)
        return fut.wait(1000)


def test_library_links_no_python():
    readelf = require_tool("readelf", "cannot inspect the library's dependencies")
    proc = _run([readelf, "-d", dtorch_ops.library_path()], timeout=60)
    assert proc.returncode == 0, proc.stderr
    needed = [line.split("[", 1)[1].rstrip("]") for line in proc.stdout.splitlines() if "(NEEDED)" in line]
    assert needed, proc.stdout
    assert not [lib for lib in needed if "python" in lib], needed
    assert any(lib.startswith("libtorch") for lib in needed), needed


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cpp_example_builds_and_runs_scripted_module(tmp_path):
    cmake = require_tool("cmake", "cannot build examples/cpp")
    make = require_tool("make", "cannot build examples/cpp")
    # The module is scripted and saved here; C++ loads it with torch::jit::load.
    scripted = torch.jit.script(_Doubler())
    x = torch.arange(4, dtype=torch.float32)
    assert torch.equal(scripted(x), x * 2)
    module_path = tmp_path / "doubler.pt"
    torch.jit.save(scripted, str(module_path))

    build = tmp_path / "build"
    configure = _run(
        [
            cmake,
            "-S", EXAMPLE_DIR,
            "-B", str(build),
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DDTORCH_OPS_PYTHON={sys.executable}",
            f"-DDTORCH_OPS_INCLUDE_DIR={dtorch_ops.include_path()}",
            f"-DDTORCH_OPS_LIBRARY={dtorch_ops.library_path()}",
            "-DCMAKE_BUILD_TYPE=",  # no optimisation: one TU, compiled as fast as possible
        ],
        timeout=180,
    )
    if (configure.returncode != 0 and torch.backends.cuda.is_built()
            and "Could NOT find CUDA" in configure.stdout + configure.stderr):
        pytest.skip("find_package(Torch) of a CUDA build of torch needs the whole CUDA toolkit "
                    "(headers and cudart), which this machine lacks")
    assert configure.returncode == 0, configure.stdout + configure.stderr

    compiled = _run([make, "-C", str(build), "-j2"], timeout=600)
    assert compiled.returncode == 0, compiled.stdout[-5000:] + compiled.stderr[-10000:]

    binary = build / "dtorch_cpp_example"
    assert binary.exists()
    # A plain environment: the program must not rely on the Python process (no LD_PRELOAD etc.).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LD_PRELOAD", "PYTHON"))}
    ran = _run([str(binary), str(module_path)], timeout=120, env=env)
    output = ran.stdout + ran.stderr
    assert ran.returncode == 0, output
    assert "cpp example: OK" in output, output
    assert "scripted module" in output, output
