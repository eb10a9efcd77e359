import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import dtorch_ops  # noqa: F401  (loads the library)

# The helper modules the test modules share: their asserts get pytest's rewritten messages too.
pytest.register_assert_rewrite("file_failure_helpers", "network_fixtures", "compile_helpers")

# Every blocking call in the tests is bounded by this (ms); pytest-timeout bounds the rest.
WAIT_MS = 10_000

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def require_tool(name: str, why: str) -> str:
    """The tool's path; skips without it, except in CI, whose set-up (make deps) installs it."""
    import os
    import shutil

    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed: {why}"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI must install it: scripts/install_deps.sh)")
        pytest.skip(message)
    return path


def wait_until(predicate, timeout_s: float) -> bool:
    """Whether predicate() became true within timeout_s (polled every 50 ms)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def run_in_thread(fn, *args):
    """Starts fn(*args) on a daemon thread; returns (thread, result dict with 'value'/'error')."""
    result = {}

    def target():
        try:
            result["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, result


class Heartbeat:
    """A coroutine ticking every `period` s while the block runs: its count proves the event loop
    was not blocked meanwhile. Use as ``async with Heartbeat() as hb: ...; hb.beats``."""

    def __init__(self, period: float = 0.005):
        self.period = period
        self.beats = 0

    async def _tick(self):
        while True:
            self.beats += 1
            await asyncio.sleep(self.period)

    async def __aenter__(self):
        self._task = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *exc):
        self._task.cancel()


def _devices():
    import devices

    return devices.available()


@pytest.fixture(params=_devices(), ids=lambda d: d.name)
def dev(request):
    """Each asynchronous device available: the simulated one, and CUDA when present."""
    device = request.param
    device.synchronize()
    yield device
    device.synchronize()


def threads_named(name: str) -> int:
    """Threads of this process named `name` now (the library's: "dtorch-detect", "dtorch-pool")."""
    import os

    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().strip() == name
        except OSError:  # the thread exited meanwhile
            pass
    return count


def detector_threads() -> int:
    """The library's detector threads alive now, counted by name."""
    return threads_named("dtorch-detect")


TESTS = os.path.dirname(os.path.abspath(__file__))


def run_python(script: str, timeout: float = 120):
    """Runs `script` (dedented) in a fresh interpreter that can import the tests' helpers."""
    prologue = f"import sys; sys.path.insert(0, {TESTS!r})\n"
    return subprocess.run([sys.executable, "-c", prologue + textwrap.dedent(script)],
                          capture_output=True, text=True, timeout=timeout)


def consumer_segments() -> set:
    """This process's file-kind segments: the pairs it created and the payloads sent to it (named
    for their consumer); not its doorbell, which lives while pairs are pending, and a while
    after."""
    mine = f"dtorch_{os.getpid()}-"
    doorbell = dtorch_ops._C.diagnostics()["doorbell"]["doorbell_segment"]
    return {name for name in os.listdir("/dev/shm") if name.startswith(mine) and name != doorbell}


@pytest.fixture
def nothing_left_in_dev_shm():
    """Fails a test after which a segment of this process (consumer_segments) it made is still in
    /dev/shm 5 s later (file-kind modules use it for every test)."""
    import gc

    before = consumer_segments()
    yield
    deadline = time.monotonic() + 5.0
    while True:
        gc.collect()
        left = consumer_segments() - before
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"left in /dev/shm: {sorted(left)}"


# ---- the core's C++ tests: built while the others run (core_build.py) ----

def _is_core_cpp(item) -> bool:
    return os.path.basename(str(item.fspath)) == "test_core_cpp.py"


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=_is_core_cpp)  # (stable: the rest keep their order) last, as its build runs


def pytest_collection_finish(session):
    if not session.config.option.collectonly and any(map(_is_core_cpp, session.items)):
        import core_build

        core_build.start()


def pytest_sessionfinish(session, exitstatus):
    if "core_build" in sys.modules:
        sys.modules["core_build"].cleanup()
