"""Graph sync: sync / sync_async / sync_into / sync_wait, VoidPromise / VoidFuture and
VoidFutureCollect, on CPU and on the asynchronous devices (simulated; CUDA when present)."""
import asyncio
import contextlib
import gc
import os
import pickle
import threading
import time

import pytest
import torch
from functorch.compile import make_boxed_func

import devices
import dtorch_ops
from conftest import WAIT_MS, run_in_thread

# ---- VoidPromise / VoidFuture: the tensor futures' semantics without a value ----


def test_void_pair_semantics():
    promise = dtorch_ops.VoidPromise()
    future = promise.get_future()
    assert isinstance(future, dtorch_ops.VoidFuture) and future.valid() and not future.is_ready()
    with pytest.raises(TimeoutError):
        future.wait(20)
    assert future.valid()
    thread, result = run_in_thread(future.get)
    time.sleep(0.02)
    promise.set_value()
    thread.join(WAIT_MS / 1000)
    assert result == {"value": None}
    assert not future.valid()
    with pytest.raises(RuntimeError, match="already satisfied"):
        promise.set_value()
    with pytest.raises(RuntimeError, match="already retrieved"):
        promise.get_future()


def test_void_exception_broken_promise_and_await():
    promise = dtorch_ops.VoidPromise()
    failing = promise.get_future()
    promise.set_exception("worker lost")
    with pytest.raises(RuntimeError, match="worker lost"):
        failing.wait(WAIT_MS)

    dropped = dtorch_ops.VoidPromise()
    orphan = dropped.get_future()
    del dropped
    gc.collect()
    with pytest.raises(RuntimeError, match="broken promise"):
        orphan.get()

    async def main():
        p = dtorch_ops.VoidPromise()
        f = p.get_future()
        asyncio.get_running_loop().call_later(0.01, p.set_value)
        return await f

    assert asyncio.run(asyncio.wait_for(main(), 10)) is None


def test_void_promises_cannot_leave_the_process():
    promise = dtorch_ops.VoidPromise()
    with pytest.raises(TypeError, match="memory promises cannot leave the process"):
        pickle.dumps(promise)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(promise.get_future())


# ---- sync on CPU ----


def test_sync_on_cpu():
    assert dtorch_ops.sync() is None
    assert dtorch_ops.sync("cpu") is None
    collect = dtorch_ops.sync_async("cpu")
    assert isinstance(collect, dtorch_ops.VoidFutureCollect)
    assert collect.is_ready() and collect.valid()  # CPU work is done when the op runs
    assert collect.get() is None and not collect.valid()
    with pytest.raises(RuntimeError, match="already called"):
        collect.get()
    both = dtorch_ops.sync_async(["cpu", torch.device("cpu")])
    assert both.devices() == [torch.device("cpu")] * 2
    assert both.wait(WAIT_MS) is None
    assert dtorch_ops.sync_async([]).wait(0) is None  # no devices: nothing to wait for


def test_sync_default_devices_in_a_process_without_an_accelerator():
    import subprocess
    import sys

    code = ("import dtorch_ops; c = dtorch_ops.sync_async(); print(c.devices()); "
            "dtorch_ops.sync()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[device(type='cpu')]"


def test_a_pending_sync_into_claims_its_promise(dev):
    promise = dtorch_ops.VoidPromise()
    future = promise.get_future()
    with dev.busy():
        dtorch_ops.sync_into(dev.name, promise)
        with pytest.raises(RuntimeError, match="already satisfied"):
            promise.set_value()
        with pytest.raises(RuntimeError, match="already satisfied"):
            dtorch_ops.sync_into("cpu", promise)
    assert future.wait(WAIT_MS) is None


def test_sync_into_completes_a_void_promise():
    promise = dtorch_ops.VoidPromise()
    future = promise.get_future()
    dtorch_ops.sync_into(None, promise)
    assert future.wait(WAIT_MS) is None
    used = dtorch_ops.VoidPromise()
    used.set_value()
    with pytest.raises(RuntimeError, match="already holds a value"):
        dtorch_ops.sync_into("cpu", used)
    with pytest.raises(TypeError, match="VoidPromise"):
        dtorch_ops.sync_into("cpu", dtorch_ops.TensorPromise())


@pytest.mark.parametrize("bad, message", [
    ("cuda:97", r"cuda:97"),
    ("simdev:5", r"simdev:5 does not exist: this process sees 2 simdev device"),
    ("meta", r"cannot sync meta"),
])
def test_bad_devices_get_a_clear_error(bad, message):
    devices.SimDev()  # makes "simdev" a known device type
    if bad.startswith("cuda") and torch.cuda.is_available():
        message = r"cuda:97 does not exist"
    with pytest.raises(RuntimeError, match=message):
        dtorch_ops.sync(bad)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.dtorch.sync([torch.device(bad)])


def test_cuda_without_a_gpu_is_named():
    if torch.cuda.is_available():
        pytest.skip("this process has a GPU")
    # A CPU-only build has no CUDA at all; a CUDA build on a machine without a GPU sees none. In
    # a fresh process: once a FakeTensorMode has run, a CUDA build without a GPU installs a no-op
    # CUDA device guard (fake CUDA tensors), and cuda:0 then "exists".
    import subprocess
    import sys

    why = ("this process sees no cuda device" if torch.backends.cuda.is_built()
           else "this torch build has no cuda support")
    code = "import dtorch_ops; dtorch_ops.sync_async('cuda:0')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and f"cannot sync cuda:0: {why}" in proc.stderr, proc.stderr


# ---- sync on asynchronous devices ----


def test_sync_async_returns_before_queued_work_and_completes_after(dev):
    with dev.busy():
        torch.ones(8, device=dev.name) * 2  # queued behind the busy kernel
        collect = dtorch_ops.sync_async(dev.name)
        assert collect.devices() == [torch.device(dev.name, 0)]
        time.sleep(0.05)
        assert not collect.is_ready(), "sync completed while the stream was still busy"
        with pytest.raises(TimeoutError):
            collect.wait(10)
        assert collect.valid()
    assert collect.wait(WAIT_MS) is None


def test_blocking_sync_waits_for_the_device(dev):
    queued = time.perf_counter()
    dev.sleep(100)
    y = torch.ones(4, device=dev.name) * 3
    dtorch_ops.sync(dev.name)
    assert time.perf_counter() - queued >= 0.1  # not before the 100 ms kernel finished
    assert torch.equal(y.cpu(), torch.full((4,), 3.0))


def test_blocking_sync_can_be_interrupted(dev):
    import signal

    if dev.name != "simdev":
        pytest.skip("needs a stream that stays busy until released")
    about_to_sync = threading.Event()

    def interrupt():  # only once the main thread is inside the pytest.raises block
        about_to_sync.wait(10)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)

    sender = threading.Thread(target=interrupt)
    sender.start()
    with dev.busy():
        start = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):
            about_to_sync.set()
            dtorch_ops.sync(dev.name)  # Ctrl-C reaches a sync on a stuck device
        assert time.perf_counter() - start < 5
    sender.join(10)


def test_sync_does_not_wait_for_other_streams(dev):
    with contextlib.ExitStack() as side_busy:
        with dev.side_stream():
            side_busy.enter_context(dev.busy())
        # The current stream is idle: sync completes although the side stream is busy.
        assert dtorch_ops.sync_async(dev.name).wait(1000) is None


def test_default_devices_include_the_used_accelerator(dev):
    torch.ones(1, device=dev.name) * 1  # the process has used the device
    with dev.busy():
        collect = dtorch_ops.sync_async()
        assert torch.device(dev.name, 0) in collect.devices()
        time.sleep(0.02)
        assert not collect.is_ready(), "devices=None did not wait for the used device"
    assert collect.wait(WAIT_MS) is None


def test_await_a_collect(dev):
    async def main():
        release = dev.hold()
        collect = dtorch_ops.sync_async([dev.name, "cpu"])
        assert not collect.is_ready()
        asyncio.get_running_loop().call_later(0.05, release)  # completes while the await waits
        start = time.perf_counter()
        result = await collect
        return result, time.perf_counter() - start

    result, waited = asyncio.run(asyncio.wait_for(main(), 10))
    assert result is None and waited >= 0.04


def test_sync_into_from_a_producer_thread(dev):
    promise = dtorch_ops.VoidPromise()
    future = promise.get_future()
    queued, checked = threading.Event(), threading.Event()

    def producer():  # a worker: its stream is busy when it signals the consumer's promise
        with dev.busy():
            dtorch_ops.sync_into(dev.name, promise)
            queued.set()
            checked.wait(10)

    thread = threading.Thread(target=producer)
    thread.start()
    assert queued.wait(10)
    assert not future.is_ready(), "fulfilled before the producer's stream was done"
    checked.set()
    thread.join(10)
    assert future.wait(WAIT_MS) is None


def test_sync_waits_for_every_device(dev):
    if dev.device_count() < 2:
        pytest.skip(f"needs two {dev.name} devices")
    with dev.on_device(0):
        release0 = dev.hold()
    with dev.on_device(1):
        release1 = dev.hold()
    try:
        collect = dtorch_ops.sync_async([f"{dev.name}:0", f"{dev.name}:1"])
        time.sleep(0.02)
        assert not collect.is_ready()
        release1()
        time.sleep(0.02)
        assert not collect.is_ready(), "ready although device 0 is still busy"
    finally:
        release0()
        release1()
    assert collect.wait(WAIT_MS) is None


def test_of_two_failing_devices_the_first_listed_wins(dev):
    if not dev.can_inject_faults or dev.device_count() < 2:
        pytest.skip(f"needs two {dev.name} devices with injectable faults")
    # A fault on a side stream of each device (a fault poisons its stream only).
    streams = {}
    for index, message in ((0, "fault A"), (1, "fault B")):
        with dev.on_device(index):
            streams[index] = dev.new_stream()
            with dev.using_stream(streams[index]):
                dev.fail(message)
    with dev.on_device(1), dev.using_stream(streams[1]), dev.on_device(0), \
            dev.using_stream(streams[0]):
        one_first = dtorch_ops.sync_async(["cpu", f"{dev.name}:1", f"{dev.name}:0"])
        zero_first = dtorch_ops.sync_async([f"{dev.name}:0", f"{dev.name}:1"])
    with pytest.raises(RuntimeError, match=rf"sync on {dev.name}:1 failed: .*fault B") as err:
        one_first.wait(WAIT_MS)
    assert "fault A" not in str(err.value)
    with pytest.raises(RuntimeError, match=rf"sync on {dev.name}:0 failed: .*fault A"):
        zero_first.wait(WAIT_MS)


def test_the_first_error_wins_and_names_its_device(dev):
    if not dev.can_inject_faults:
        pytest.skip(f"{dev.name}: no recoverable way to inject a device fault")
    with dev.side_stream():  # the fault poisons this stream only
        dev.fail("ECC error (simulated)")
        collect = dtorch_ops.sync_async(["cpu", dev.name])
        promise = dtorch_ops.VoidPromise()
        future = promise.get_future()
        dtorch_ops.sync_into(["cpu", dev.name], promise)
    with pytest.raises(RuntimeError, match=rf"sync on {dev.name}:0 failed: .*ECC error"):
        collect.wait(WAIT_MS)
    with pytest.raises(RuntimeError, match=rf"sync on {dev.name}:0 failed: .*ECC error"):
        future.get()


# ---- TorchScript ----


@torch.jit.script
def _scripted_sync(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    collect = torch.ops.dtorch.sync([torch.device("cpu")])
    assert collect.valid()
    collect.wait(10000)
    collect.wait()
    assert collect.valid()  # waits consume nothing
    collect.get()
    assert not collect.valid() and collect.done()
    torch.ops.dtorch.sync_wait(None)
    promise = torch.classes.dtorch.VoidPromise("memory")
    done = promise.get_future()
    torch.ops.dtorch.sync_into(None, promise)
    done.get()
    return y


def test_scripted_sync_survives_save_and_load(tmp_path):
    class Step(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _scripted_sync(x)

    module = torch.jit.script(Step())
    assert torch.equal(module(torch.ones(2)), torch.full((2,), 2.0))
    path = str(tmp_path / "step.pt")
    torch.jit.save(module, path)
    assert torch.equal(torch.jit.load(path)(torch.ones(3)), torch.full((3,), 2.0))
    graph = str(_scripted_sync.graph)
    assert all(f"dtorch::{op}(" in graph for op in ("sync", "sync_wait", "sync_into"))


# ---- torch.compile: the blocking sync is an ordered effect ----


def test_compiled_sync_is_kept_as_an_ordered_effect():
    import torch._dynamo
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    graphs = []

    def forward_compiler(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    def step(x):
        y = x * 2
        dtorch_ops.sync()
        return y + 1

    compiled = torch.compile(step, fullgraph=True, backend=aot_autograd(fw_compiler=forward_compiler))
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 3.0))
    assert len(graphs) == 1
    # Threaded through an effect token (with_effects): not dropped although it has no output, and
    # kept between the computations before and after it.
    order = [n.name for n in graphs[0].graph.nodes if n.op == "call_function"]
    effect = next(n for n in graphs[0].graph.nodes if "with_effects" in str(n.target))
    assert effect.args[1] is torch.ops.dtorch.sync_wait.default
    assert order.index("mul") < order.index(effect.name) < order.index("add")


def test_inductor_keeps_sync_in_place():
    import torch._dynamo
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()

    def step(x):
        y = (x * 2).sum()
        dtorch_ops.sync()
        return y + 1

    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    result, code = run_and_get_code(compiled, torch.ones(3))
    assert torch.equal(result, torch.tensor(7.0))
    assert any("dtorch.sync_wait" in c for c in code), "inductor dropped the sync"
