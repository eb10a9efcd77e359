"""Builds and runs the C++ tests of the torch-free core (tests/cpp/test_core.cpp)."""
import glob
import os
import subprocess

from conftest import require_tool

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Boost's headers where the system has none (the GPU machine: scripts/device_check.sh).
BOOST_INCLUDE = (["-I", os.environ["DTORCH_BOOST_INCLUDE"]]
                 if os.environ.get("DTORCH_BOOST_INCLUDE") else [])


def test_core_cpp(tmp_path):
    cxx = require_tool(os.environ.get("CXX", "g++"), "cannot build the core's C++ tests")
    binary = tmp_path / "test_core"
    build = subprocess.run(
        [cxx, "-std=c++20", "-O1", "-g", "-fno-omit-frame-pointer", "-Wall", "-Wextra", "-pthread",
         "-fsanitize=address,undefined", "-I", os.path.join(REPO, "csrc"), *BOOST_INCLUDE,
         os.path.join(REPO, "tests", "cpp", "test_core.cpp"),
         *sorted(glob.glob(os.path.join(REPO, "csrc", "core", "*.cc"))), "-o", str(binary)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr
    # Stopping at exit leaks what it dropped, on purpose (the runtime below may be gone at exit, and a
# file pair's last reference may go later in the exit, on another thread).
    suppressions = tmp_path / "lsan.supp"
    suppressions.write_text("leak:TestStopAtExit\nleak:StopFileKind\n")
    # Whole allocation stacks (the fast unwinder can stop after two frames, short of the test's
    # name that the suppression matches: seen on a GPU machine).
    env = {**os.environ, "LSAN_OPTIONS": f"suppressions={suppressions}",
           "ASAN_OPTIONS": "fast_unwind_on_malloc=0"}
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "core tests: 18 passed" in run.stdout
