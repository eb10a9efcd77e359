import asyncio
import threading

import pytest
import torch

import dtorch_ops  # noqa: F401  (loads the library)

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
