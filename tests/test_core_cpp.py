"""Builds (CMake target test_core, CMakeLists.txt at the root) and runs the C++ tests of the
torch-free core (tests/cpp/test_core*.cpp). The build runs in the background from the session's
start (core_build.py); this module runs last (conftest.py)."""
import os
import subprocess

import pytest

import core_build
from conftest import require_tool


# (The build's wait counts: the session runs this test last, its build started at the beginning.)
@pytest.mark.timeout(900)
def test_core_cpp(tmp_path):
    cmake = require_tool("cmake", "cannot build the core's C++ tests (CMakeLists.txt)")
    # Under ASan/UBSan (CMakeLists.txt); Boost from DTORCH_BOOST_INCLUDE where the system has none
    # (the GPU machine: scripts/device_check.sh). Raises with the build's output on failure.
    binary = core_build.result(cmake, tmp_path / "build", timeout_s=600)
    # Stopping at exit leaks what it dropped, on purpose (the runtime below may be gone at exit,
    # and a file pair's last reference may go later in the exit, on another thread).
    suppressions = tmp_path / "lsan.supp"
    suppressions.write_text("leak:TestStopAtExit\nleak:StopFileKind\n")
    # Whole allocation stacks (the fast unwinder can stop after two frames, short of the test's
    # name that the suppression matches: seen on a GPU machine).
    env = {**os.environ, "LSAN_OPTIONS": f"suppressions={suppressions}",
           "ASAN_OPTIONS": "fast_unwind_on_malloc=0"}
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "core tests: 19 passed" in run.stdout
