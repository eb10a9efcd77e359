"""The build of the core's C++ tests (CMake target test_core: the whole core under ASan/UBSan,
minutes on 2 cores), started in the background as the session begins when it has
test_core_cpp.py to run, at the lowest CPU priority: it takes what the other tests leave idle
(most of them wait on subprocesses and timeouts) and hardly slows them. conftest.py runs
test_core_cpp.py last; it waits for the build (result()). Without a started build (run alone, or
no cmake: the test then skips or fails as require_tool says) result() builds in the foreground.
"""
import os
import shutil
import signal
import sys
import tempfile
import threading

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "benchmarks")
TARGET = "test_core"

_lock = threading.Lock()
_build = None  # guarded by _lock: the one background build of this session


def _build_cpp_target(*args, **kwargs) -> str:
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)  # the one C++ build helper (cpp_build.py)
    from cpp_build import build_cpp_target

    return build_cpp_target(TARGET, *args, **kwargs)


class _Build:
    def __init__(self, cmake: str):
        self.directory = tempfile.mkdtemp(prefix="dtorch-test-core-")
        self.running = []  # the cmake steps' Popen objects
        self.binary = None
        self.error = None
        self.thread = threading.Thread(target=self._run, args=(cmake,), daemon=True,
                                       name="test_core build")
        self.thread.start()

    def _run(self, cmake):
        try:
            # (Bounded, but long: the other tests may leave it little CPU until it runs alone.)
            self.binary = _build_cpp_target(os.path.join(self.directory, "build"), cmake=cmake,
                                            build_timeout=1800, nice=True, running=self.running)
        except BaseException as e:  # (reported by result(), in the test)
            self.error = e


def start() -> None:
    """Starts the build unless it is started or cmake is missing."""
    global _build
    cmake = shutil.which("cmake")
    with _lock:
        if _build is None and cmake is not None:
            _build = _Build(cmake)


def result(cmake: str, build_dir, timeout_s: float) -> str:
    """The test binary's path: the background build's, waited for up to timeout_s, or one built
    now in build_dir. Raises the build's error."""
    with _lock:
        build = _build
    if build is None:
        return _build_cpp_target(build_dir, cmake=cmake)
    build.thread.join(timeout_s)
    if build.thread.is_alive():
        raise TimeoutError(f"the background build of {TARGET} ran past {timeout_s} s more")
    if build.error is not None:
        raise build.error
    return build.binary


def cleanup() -> None:
    """Ends a build still running (the session ends) and deletes its folder."""
    with _lock:
        build = _build
    if build is None:
        return
    for proc in build.running:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    build.thread.join(10)
    shutil.rmtree(build.directory, ignore_errors=True)
