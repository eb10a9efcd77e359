"""The event-gated device path on a real accelerator (CUDA when present; skipped otherwise).

The simulated-device backend (a later issue) runs the same path on CPU-only machines."""
import asyncio
import gc
import os
import time

import pytest
import torch

import dtorch_ops
from conftest import WAIT_MS

DEVICES = ["cuda"] if torch.cuda.is_available() else []
pytestmark = pytest.mark.skipif(not DEVICES, reason="no CUDA device on this machine")


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


_cycles_per_ms = None


def _device_sleep(ms: float) -> None:
    """Queues a kernel that spins for about `ms` milliseconds on the current stream."""
    global _cycles_per_ms
    if _cycles_per_ms is None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        _cycles_per_ms = 10_000_000 / start.elapsed_time(end)
    torch.cuda._sleep(int(ms * _cycles_per_ms))


@pytest.mark.parametrize("device", DEVICES)
def test_returns_before_the_work_and_completes_after(device):
    x = torch.ones(1024, device=device)
    torch.cuda.synchronize()
    _device_sleep(200)
    y = x * 3
    t0 = time.perf_counter()
    fut = dtorch_ops.to_torch_async(y)
    issued = time.perf_counter() - t0
    assert issued < 0.05, f"to_torch_async took {issued * 1e3:.1f} ms: it waited for the device"
    assert not fut.is_ready()
    value = fut.wait(WAIT_MS)
    assert time.perf_counter() - t0 >= 0.1
    assert value.data_ptr() == y.data_ptr()
    assert torch.equal(value.cpu(), torch.full((1024,), 3.0))


@pytest.mark.parametrize("device", DEVICES)
def test_other_streams_are_not_waited_for(device):
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        _device_sleep(500)
    y = torch.arange(4, device=device)  # on the current (default) stream
    fut = dtorch_ops.to_torch_async(y)
    assert torch.equal(fut.wait(300).cpu(), torch.arange(4))  # well before the side stream ends
    assert not side.query()
    side.synchronize()


@pytest.mark.parametrize("device", DEVICES)
def test_ten_thousand_pending_futures_use_few_threads(device):
    torch.cuda.synchronize()
    threads_before = _os_threads()
    _device_sleep(300)
    xs = [torch.full((1,), float(i), device=device) for i in range(10_000)]
    futures = [dtorch_ops.to_torch_async(x) for x in xs]
    assert not futures[-1].is_ready()
    assert _os_threads() - threads_before <= 4, "a thread per pending future?"
    values = torch.cat([f.wait(WAIT_MS) for f in futures]).cpu()
    assert torch.equal(values, torch.arange(10_000, dtype=torch.float32))


@pytest.mark.parametrize("device", DEVICES)
def test_await_wakes_when_the_device_finishes(device):
    async def main():
        _device_sleep(100)
        y = torch.ones(3, device=device) * 2
        return await dtorch_ops.to_torch_async(y)

    value = asyncio.run(asyncio.wait_for(main(), 10))
    assert torch.equal(value.cpu(), torch.full((3,), 2.0))


@pytest.mark.parametrize("device", DEVICES)
def test_dropping_the_future_before_completion_is_safe(device):
    _device_sleep(100)
    y = torch.ones(1 << 20, device=device)
    ptr = y.data_ptr()
    fut = dtorch_ops.to_torch_async(y)
    del fut, y
    gc.collect()
    torch.cuda.synchronize()
    time.sleep(0.05)  # the poller completes (and releases) the dropped value
    z = dtorch_ops.to_torch(torch.zeros(1, device=device))
    assert torch.equal(z.cpu(), torch.zeros(1)) and ptr != 0


@pytest.mark.parametrize("device", DEVICES)
def test_used_promise_is_refused_at_once(device):
    promise = dtorch_ops.TensorPromise()
    promise.set_value(torch.ones(1))
    with pytest.raises(RuntimeError, match="already holds a value"):
        dtorch_ops.get_tensor(torch.ones(1, device=device), promise)
