"""Builds a target of the repository's CMake project (CMakeLists.txt at its root: the torch-free
C++, test_core and wake_bench) and returns the binary's path. The one place in Python that drives
the C++ build: benchmarks/bench_wake.py and the tests (tests/test_core_cpp.py) use it.

Standard library only, so that the tests can import it too (they put benchmarks/ on sys.path)."""
import os
import signal
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class CppBuildError(RuntimeError):
    """The configure or build step failed or ran out of time; the message holds its output."""


def _run(step, command, timeout, nice=False, running=None):
    # A session of its own, so that a timeout ends the compilers make started, not cmake alone.
    if nice:  # (the lowest CPU priority: it takes what other work leaves idle)
        command = ["nice", "-n", "19", *command]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as proc:
        if running is not None:
            running.append(proc)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            raise CppBuildError(
                f"{step} ran past {timeout} s: {' '.join(command)}\n{out}") from None
    if proc.returncode != 0:
        raise CppBuildError(f"{step} failed (exit {proc.returncode}): {' '.join(command)}\n{out}")


def _configured(build_dir):
    """A configure step completed there: it wrote the cache and generated the build system (a
    failed one leaves CMakeCache.txt alone)."""
    return os.path.exists(os.path.join(build_dir, "CMakeCache.txt")) and any(
        os.path.exists(os.path.join(build_dir, name)) for name in ("Makefile", "build.ninja"))


def build_cpp_target(target, build_dir, *, cmake="cmake", build_type="", configure_args=(),
                     configure_timeout=120, build_timeout=300, source_dir=None, nice=False,
                     running=None):
    """Configures the project (the root one, or `source_dir`'s: examples/cpp builds on its own
    too) in build_dir unless a configure step completed there, builds
    `target` (2 jobs) and returns the binary's path. build_type "" lets each target choose its
    own flags (CMakeLists.txt). DTORCH_BOOST_INCLUDE and CXX are read from the environment at the
    first configure. `nice`: at the lowest CPU priority; `running`: a list each step's Popen is
    appended to (to end it from elsewhere: os.killpg). Raises CppBuildError with the step's output
    on failure or timeout."""
    build_dir = os.fspath(build_dir)
    if not _configured(build_dir):
        _run("configure", [cmake, "-S", os.fspath(source_dir or REPO), "-B", build_dir,
                           f"-DCMAKE_BUILD_TYPE={build_type}", *configure_args],
             configure_timeout, nice, running)
    _run("build", [cmake, "--build", build_dir, "--target", target, "--parallel", "2"],
         build_timeout, nice, running)
    binary = os.path.join(build_dir, target)
    if not os.path.isfile(binary):
        raise CppBuildError(f"built {target}, but {binary} does not exist")
    return binary
