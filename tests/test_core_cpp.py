"""Builds (CMake target test_core, CMakeLists.txt at the root) and runs the C++ tests of the
torch-free core (tests/cpp/test_core*.cpp)."""
import os
import subprocess

from conftest import require_tool

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "benchmarks")


def test_core_cpp(tmp_path, monkeypatch):
    cmake = require_tool("cmake", "cannot build the core's C++ tests (CMakeLists.txt)")
    monkeypatch.syspath_prepend(BENCHMARKS)  # the one C++ build helper, shared with the benchmarks
    from cpp_build import build_cpp_target

    # Under ASan/UBSan (CMakeLists.txt); Boost from DTORCH_BOOST_INCLUDE where the system has none
    # (the GPU machine: scripts/device_check.sh). Raises with the build's output on failure.
    binary = build_cpp_target("test_core", tmp_path / "build", cmake=cmake)
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
