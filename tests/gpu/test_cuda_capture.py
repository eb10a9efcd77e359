"""GPU only: the library and CUDA graph capture (csrc/cuda/cuda_events.cpp). A call that waits for
device work (get_tensor, to_torch_async, the host copy, sync) on a stream under capture is refused
with an error that says to call it outside the captured region: the capture records the work to
replay later, so there is no value to wait for yet. The refusal leaves the capture intact, and the
documented pattern (read the graph's static outputs after replay()) gives each replay's values. The
library's own CUDA calls on its threads (blocking-sync events, queried or waited for while another
thread captures in torch's default "global" mode) must not invalidate a capture either. And, as
those waits are untimed: a process exits at once, cleanly, with a detector still inside
cudaEventSynchronize. The simulated device checks the device-generic part of all this in CI
(tests/test_device_events.py)."""
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import dtorch_ops
from conftest import CUDA, WAIT_MS

REFUSED = "is being captured into a CUDA graph.*after graph.replay"


@CUDA
def test_calls_inside_a_capture_are_refused_and_the_capture_survives():
    x = torch.arange(8, device="cuda", dtype=torch.float32)
    x * 2  # warm-up outside the capture (kernels, allocator)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()
    with torch.cuda.graph(graph):
        y = x * 2
        with pytest.raises(RuntimeError, match=REFUSED):
            dtorch_ops.to_torch_async(y)
        with pytest.raises(RuntimeError, match="copy_to_host_async .*" + REFUSED):
            dtorch_ops.to_torch_async(y, device="cpu")
        with pytest.raises(RuntimeError, match="copy_list_to_host_async .*" + REFUSED):
            dtorch_ops.to_torch_async([y, y], device="cpu")
        with pytest.raises(RuntimeError, match=REFUSED):
            dtorch_ops.sync([torch.device("cuda")])
        with pytest.raises(RuntimeError, match=REFUSED):
            dtorch_ops.sync_async([torch.device("cuda")])
        with pytest.raises(RuntimeError, match=REFUSED):
            dtorch_ops.get_tensor(y, promise)
        y.add_(1)
    # Refused before anything was claimed: the promise is unused, and can be set after replay().
    assert not future.is_ready()
    # The capture is intact: replaying it recomputes y, which is read after replay().
    for i in range(3):
        x.fill_(float(i))
        graph.replay()
        got = dtorch_ops.to_torch_async(y).wait(WAIT_MS)
        torch.testing.assert_close(got, torch.full((8,), 2.0 * i + 1, device="cuda"))
        host = dtorch_ops.to_torch_async(y, device="cpu").wait(WAIT_MS)
        torch.testing.assert_close(host, torch.full((8,), 2.0 * i + 1))
    dtorch_ops.get_tensor(y, promise)
    torch.testing.assert_close(future.wait(WAIT_MS), torch.full((8,), 5.0, device="cuda"))
    dtorch_ops.sync()


@CUDA
def test_pending_values_on_another_thread_do_not_invalidate_a_capture():
    # While this thread captures in the "global" mode (torch's default), which forbids unsafe CUDA
    # calls process-wide, another thread keeps making values: it records the library's events,
    # and detectors wait for them (cudaEventSynchronize) or query them. The library's calls must be
    # allowed (its threads relax the mode) and leave the capture valid. (The producer thread itself
    # makes no synchronising call of torch's during the capture: that alone would invalidate it.)
    stream = torch.cuda.Stream()
    z = torch.ones(1024, device="cuda")
    stop = threading.Event()
    values, errors = [], []

    def produce_values():
        try:
            with torch.cuda.stream(stream):
                while not stop.is_set():
                    torch.cuda._sleep(2_000_000)  # a kernel of ~1 ms: the value is pending a while
                    future = dtorch_ops.to_torch_async(z * 3)
                    values.append(future.wait(WAIT_MS))  # a C++ wait: no CUDA call here
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    a = torch.randn(256, 256, device="cuda")
    b = torch.randn(256, 256, device="cuda")
    (a @ b).relu()  # warm-up (cuBLAS handles, kernels, allocator) outside the capture
    dtorch_ops.to_torch_async(z * 3).wait(WAIT_MS)
    torch.cuda.synchronize()
    producer = threading.Thread(target=produce_values, daemon=True)
    producer.start()
    time.sleep(0.05)
    made_before = len(values)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # capture_error_mode="global"
        out = a
        for _ in range(20):
            out = (out @ b).relu() / 16
        time.sleep(0.2)  # the capture stays open while values are made
    stop.set()
    producer.join(30)
    assert not producer.is_alive()
    assert not errors, errors
    assert len(values) > made_before, "no value was made during the capture"
    for value in values:
        torch.testing.assert_close(value, torch.full((1024,), 3.0, device="cuda"))
    graph.replay()
    expected = a
    for _ in range(20):
        expected = (expected @ b).relu() / 16
    torch.testing.assert_close(out, expected)


@CUDA
def test_reduce_overhead_with_get_tensor_gives_each_calls_value():
    # torch.compile's CUDA graphs (mode="reduce-overhead") must not capture get_tensor: inductor
    # either skips CUDA graphs for the graph or keeps the op out of the captured part; either way
    # each call completes its own promise with that call's loss.
    torch._dynamo.reset()

    def step(x, w, promise):
        loss = torch.relu(x @ w).sum()
        dtorch_ops.get_tensor(loss, promise)
        return loss * 2

    compiled = torch.compile(step, mode="reduce-overhead")
    for _ in range(4):
        x = torch.randn(64, 64, device="cuda")
        w = torch.randn(64, 64, device="cuda")
        promise = dtorch_ops.TensorPromise()
        future = promise.get_future()
        out = compiled(x, w, promise)
        expected = torch.relu(x @ w).sum()
        torch.testing.assert_close(future.wait(WAIT_MS), expected)
        torch.testing.assert_close(out, expected * 2)


@CUDA
def test_exit_with_a_detector_inside_cuda_event_synchronize():
    # ~3 s of queued kernels, a value behind them, and exit: the detector sleeping in
    # cudaEventSynchronize is abandoned (exit does not wait for the device), the value is dropped,
    # and the process ends without a crash or a hang in CUDA's teardown.
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = textwrap.dedent("""
        import atexit, time
        state = {}

        def after_dtorch_stopped():  # registered first: runs after dtorch_ops' own handler
            try:
                state["value"].get()
                print("late: got a value")
            except RuntimeError as e:
                print("late:", str(e).splitlines()[0])
            print(f"stopped after {time.monotonic() - state['exiting']:.2f} s", flush=True)

        atexit.register(after_dtorch_stopped)
        import torch, dtorch_ops
        from devices import Cuda
        dtorch_ops.config.exit_timeout_s = 5
        x = torch.ones(4, device="cuda")
        dtorch_ops.to_torch_async(x).wait(10_000)  # warm-up: a detector, the event pool
        Cuda().sleep(3000)
        state["value"] = dtorch_ops.to_torch_async(x * 2)
        time.sleep(0.2)  # the detector is inside cudaEventSynchronize
        state["exiting"] = time.monotonic()
    """)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {tests!r})\n"
                           + script], capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "late: dtorch: dropped at interpreter exit" in out, out
    stopped = float(out.split("stopped after ")[1].split(" s")[0])
    assert stopped < 1.0, out  # not exit_timeout_s: the untimed wait is not waited for
    assert took < 60, f"the process took {took:.0f} s"
