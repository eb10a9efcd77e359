"""Promise/future semantics through the Python API and the raw script objects (CPU)."""
import gc
import os
import pickle
import threading
import time

import pytest
import torch

import dtorch_ops
from conftest import WAIT_MS, run_in_thread


def _values():
    base = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    return {
        "0d": torch.tensor(3.5),
        "empty": torch.empty(0, 5),
        "noncontig": base.transpose(0, 2),
        "sliced": base[:, ::2, 1:],
        "bool": torch.tensor([True, False, True]),
        "bf16": torch.randn(4, 4).to(torch.bfloat16),
        "f16": torch.randn(3).half(),
        "f64": torch.randn(2, 2, dtype=torch.float64),
        "int8": torch.tensor([-3, 0, 127], dtype=torch.int8),
        "int64": torch.arange(7),
        "uint8": torch.arange(5, dtype=torch.uint8),
        "complex64": torch.randn(3, dtype=torch.complex64),
        "complex128": torch.randn(2, 2, dtype=torch.complex128),
        "requires_grad": torch.randn(3, requires_grad=True),
    }


@pytest.mark.parametrize("name", sorted(_values()))
def test_to_torch_async_yields_the_input(name):
    x = _values()[name]
    fut = dtorch_ops.to_torch_async(x)
    assert isinstance(fut, dtorch_ops.TensorFuture)
    assert fut.is_ready() and fut.valid()
    y = fut.wait(WAIT_MS)
    assert fut.valid()  # wait() does not consume; get() does
    assert fut.get() is y and not fut.valid() and fut.done()
    # In-process futures alias the input: same storage, same view.
    assert y.dtype == x.dtype and y.shape == x.shape and y.stride() == x.stride()
    assert y.data_ptr() == x.data_ptr()
    assert torch.equal(y.detach(), x.detach())


@pytest.mark.parametrize("name", ["0d", "noncontig", "bf16", "complex64", "bool"])
def test_raw_op_and_to_torch(name):
    x = _values()[name]
    raw = torch.ops.dtorch.get_tensor_async(x)
    assert isinstance(raw, torch.ScriptObject)
    assert torch.equal(raw.get(), x)
    assert torch.equal(dtorch_ops.to_torch(x), x)
    assert torch.equal(dtorch_ops.TensorFuture(torch.ops.dtorch.get_tensor_async(x)).get(), x)


def test_get_tensor_with_promise():
    x = torch.randn(5)
    promise = dtorch_ops.TensorPromise()
    fut = promise.get_future()
    assert not fut.is_ready()
    dtorch_ops.get_tensor(x, promise)
    assert fut.is_ready()
    y = fut.get()
    assert y.data_ptr() == x.data_ptr() and torch.equal(y, x)


def test_get_consumes_the_future():
    fut = dtorch_ops.to_torch_async(torch.ones(2))
    fut.get()
    assert not fut.valid() and fut.is_ready()  # consumed, and still complete
    with pytest.raises(RuntimeError, match="already consumed"):
        fut.get()
    assert torch.equal(fut.wait(10), torch.ones(2))  # a wait never consumes, nor refuses


def test_blocked_get_is_woken_from_another_thread():
    promise = dtorch_ops.TensorPromise()
    fut = promise.get_future()
    thread, result = run_in_thread(fut.get)
    time.sleep(0.05)
    assert thread.is_alive(), "get() returned before the value was set"
    value = torch.arange(3)
    promise.set_value(value)
    thread.join(WAIT_MS / 1000)
    assert not thread.is_alive()
    assert "error" not in result, result.get("error")
    assert torch.equal(result["value"], value)


@pytest.mark.parametrize("blocking", ["get", "wait", "raw_get", "raw_wait"])
def test_gil_is_released_while_blocked(blocking):
    promise = dtorch_ops.TensorPromise()
    fut = promise.get_future()
    call = {
        "get": fut.get,
        "wait": lambda: fut.wait(WAIT_MS),
        "raw_get": fut.raw.get,
        "raw_wait": lambda: fut.raw.wait(WAIT_MS),
    }[blocking]
    thread, result = run_in_thread(call)
    # Pure-Python work on this thread must progress while the other one blocks in C++.
    deadline = time.monotonic() + 0.3
    iterations = 0
    while time.monotonic() < deadline:
        iterations += 1
    assert thread.is_alive()
    assert iterations > 10_000, f"only {iterations} loop iterations: the GIL was held"
    promise.set_value(torch.ones(1))
    thread.join(WAIT_MS / 1000)
    assert torch.equal(result["value"], torch.ones(1))


def test_wait_timeout_raises_timeouterror_and_stays_valid():
    promise = dtorch_ops.TensorPromise()
    fut = promise.get_future()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="still valid"):
        fut.wait(50)
    assert time.monotonic() - start >= 0.045
    assert fut.valid() and not fut.is_ready()
    promise.set_value(torch.zeros(2))
    assert torch.equal(fut.wait(WAIT_MS), torch.zeros(2))


def test_raw_wait_timeout_is_runtimeerror():
    promise = torch.classes.dtorch.TensorPromise("memory")
    fut = promise.get_future()
    with pytest.raises(RuntimeError, match="timed out"):
        fut.wait(1)
    assert fut.valid()
    assert fut.wait_for(0) is False
    promise.set_value(torch.ones(1))
    assert fut.wait_for(0) is True
    assert torch.equal(fut.wait(0), torch.ones(1))


def test_negative_timeout_is_rejected():
    fut = dtorch_ops.TensorPromise().get_future()
    with pytest.raises(ValueError):
        fut.wait(-1)
    with pytest.raises(RuntimeError, match="timeout_ms"):
        fut.raw.wait(-5)


def test_set_value_twice_keeps_the_first():
    promise = dtorch_ops.TensorPromise()
    fut = promise.get_future()
    first, second = torch.ones(2), torch.zeros(2)
    promise.set_value(first)
    with pytest.raises(RuntimeError, match="already satisfied"):
        promise.set_value(second)
    with pytest.raises(RuntimeError, match="already satisfied"):
        promise.set_exception("late")
    assert torch.equal(fut.get(), first)


def test_set_exception_reaches_the_waiter():
    promise = dtorch_ops.TensorPromise()
    fut = promise.get_future()
    thread, result = run_in_thread(fut.get)
    promise.set_exception("worker ran out of memory")
    thread.join(WAIT_MS / 1000)
    assert isinstance(result.get("error"), RuntimeError)
    assert "worker ran out of memory" in str(result["error"])
    assert not fut.valid()
    with pytest.raises(RuntimeError, match="already satisfied"):
        promise.set_value(torch.ones(1))


def test_exception_through_wait():
    promise = dtorch_ops.TensorPromise()
    fut = promise.get_future()
    promise.set_exception("boom")
    assert fut.is_ready()
    with pytest.raises(RuntimeError, match="producer error: boom"):
        fut.wait(WAIT_MS)


def test_broken_promise_wakes_a_blocked_waiter():
    promise = dtorch_ops.TensorPromise()
    fut = promise.get_future()
    thread, result = run_in_thread(fut.get)
    time.sleep(0.05)
    del promise
    gc.collect()
    thread.join(WAIT_MS / 1000)
    assert not thread.is_alive()
    assert "broken promise" in str(result.get("error"))


def test_broken_raw_promise():
    promise = torch.classes.dtorch.TensorPromise("memory")
    fut = dtorch_ops.TensorFuture(promise.get_future())
    del promise
    assert fut.is_ready()
    with pytest.raises(RuntimeError, match="broken promise"):
        fut.wait(WAIT_MS)


def test_get_future_twice():
    promise = dtorch_ops.TensorPromise()
    promise.get_future()
    with pytest.raises(RuntimeError, match="already retrieved"):
        promise.get_future()


def test_ten_thousand_outstanding_futures():
    n = 10_000
    promises = [dtorch_ops.TensorPromise() for _ in range(n)]
    futures = [p.get_future() for p in promises]
    assert not any(f.is_ready() for f in futures[:100])
    values = torch.arange(n)

    def produce():
        for i, p in enumerate(promises):
            p.set_value(values[i])

    thread, result = run_in_thread(produce)
    got = [f.wait(WAIT_MS) for f in futures]
    thread.join(WAIT_MS / 1000)
    assert "error" not in result
    assert torch.equal(torch.stack(got), values)
    # Raw op futures: 10k pending values held at once, then drained.
    xs = [torch.full((2,), i) for i in range(n)]
    raw = [torch.ops.dtorch.get_tensor_async(x) for x in xs]
    assert all(r.get().data_ptr() == x.data_ptr() for r, x in zip(raw, xs))


def test_many_threads_setting_and_getting():
    pairs = [dtorch_ops.TensorPromise() for _ in range(64)]
    futures = [p.get_future() for p in pairs]
    barrier = threading.Barrier(8)

    def produce(k):
        barrier.wait(WAIT_MS / 1000)
        for i in range(k, 64, 8):
            pairs[i].set_value(torch.tensor(i))

    threads = [run_in_thread(produce, k)[0] for k in range(8)]
    assert [int(f.wait(WAIT_MS)) for f in futures] == list(range(64))
    for t in threads:
        t.join(WAIT_MS / 1000)


def test_callers_errors():
    with pytest.raises(TypeError, match="wraps a torch.classes.dtorch.TensorFuture"):
        dtorch_ops.TensorFuture(torch.ones(1))
    with pytest.raises(TypeError, match="expects a torch.Tensor"):
        dtorch_ops.to_torch_async([1, 2])
    with pytest.raises(TypeError, match="TensorPromise"):
        dtorch_ops.get_tensor(torch.ones(1), "not a promise")
    with pytest.raises(ValueError, match="unknown TensorPromise kind 'disk'"):
        dtorch_ops.TensorPromise("disk")
    with pytest.raises(ValueError, match="kind 'network' needs its store's address"):
        torch.classes.dtorch.TensorPromise("network")
    with pytest.raises(ValueError, match="kind 'file' takes no options"):
        dtorch_ops.VoidPromise("file://x")
    with pytest.raises(TypeError, match=r"options \['device'\] that this kind does not take"):
        dtorch_ops.TensorPromise("memory", device="cpu")


def test_errors_are_typed_by_their_code():
    """Each cause has its class in dtorch_ops.errors (picked by the core's code, not the message);
    all are RuntimeErrors; raw TorchScript objects raise the plain built-ins."""
    errors = dtorch_ops.errors
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()
    with pytest.raises(errors.FutureAlreadyRetrievedError, match="future already retrieved"):
        promise.get_future()
    with pytest.raises(errors.FutureTimeoutError) as timeout:
        future.wait(1)
    assert isinstance(timeout.value, TimeoutError) and isinstance(timeout.value, RuntimeError)
    promise.set_value(torch.ones(1))
    with pytest.raises(errors.PromiseAlreadySatisfiedError, match="set_value was called on it "
                       "first and this set_exception came second"):
        promise.set_exception("late")
    future.get()
    with pytest.raises(errors.FutureConsumedError, match="already called"):
        future.get()
    promise = dtorch_ops.VoidPromise()
    future = promise.get_future()
    promise.set_exception("no disk")
    with pytest.raises(errors.ProducerError, match="producer error: no disk") as failed:
        future.get()
    assert failed.value.code == "producer_error"
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()
    del promise
    with pytest.raises(dtorch_ops.BrokenPromiseError):
        future.get()
    raw = torch.classes.dtorch.TensorPromise("memory")
    raw.set_value(torch.ones(1))
    with pytest.raises(RuntimeError, match="promise already satisfied") as plain:
        raw.set_value(torch.ones(1))
    assert not isinstance(plain.value, errors.FutureError)
    assert set(errors._BY_CODE) >= {"broken_promise", "timeout", "device_error", "shared_memory",
                                    "invalid_handle", "cannot_leave_process", "dropped_at_exit"}


def test_memory_promises_cannot_leave_the_process():
    promise = dtorch_ops.TensorPromise()
    for dump in (lambda: pickle.dumps(promise), lambda: pickle.dumps(promise.raw), promise.serialize):
        with pytest.raises(TypeError, match="memory promises cannot leave the process"):
            dump()
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(promise.get_future())
    with pytest.raises(dtorch_ops.InvalidHandleError, match="not a serialized TensorPromise"):
        dtorch_ops.TensorPromise.from_serialized("file:/dtorch_x")
    with pytest.raises(dtorch_ops.errors.CannotLeaveProcessError):
        promise.serialize()


def test_promise_kind_for_and_config():
    cpu = torch.ones(1)
    meta = torch.empty(1, device="meta")  # stands in for a device tensor
    assert dtorch_ops.promise_kind_for(cpu) == "memory"
    assert dtorch_ops.promise_kind_for(cpu, per_device_per_process=True) == "memory"
    assert dtorch_ops.promise_kind_for(meta) == "memory"
    assert dtorch_ops.promise_kind_for(meta, per_device_per_process=True) == "file"
    old = dtorch_ops.config.per_device_per_process
    try:
        dtorch_ops.config.per_device_per_process = True
        assert dtorch_ops.promise_kind_for(meta) == "file"
        assert dtorch_ops.promise_kind_for(meta, per_device_per_process=False) == "memory"
    finally:
        dtorch_ops.config.per_device_per_process = old
    assert dtorch_ops.TensorPromise.for_tensor(cpu).kind() == "memory"


def test_repr():
    promise = dtorch_ops.TensorPromise()
    fut = promise.get_future()
    assert "pending" in repr(fut) and "memory" in repr(promise)
    promise.set_value(torch.ones(1))
    assert "ready" in repr(fut)
    fut.get()
    assert "consumed" in repr(fut)


def test_two_blocked_raw_getters_one_gets_the_value():
    promise = torch.classes.dtorch.TensorPromise("memory")
    fut = promise.get_future()
    runs = [run_in_thread(fut.get) for _ in range(2)]
    time.sleep(0.05)
    promise.set_value(torch.ones(2))
    for thread, _ in runs:
        thread.join(WAIT_MS / 1000)
    results = [r for _, r in runs]
    values = [r["value"] for r in results if "value" in r]
    errors = [r["error"] for r in results if "error" in r]
    assert len(values) == 1 and torch.equal(values[0], torch.ones(2))
    assert len(errors) == 1 and "already consumed" in str(errors[0])


@pytest.mark.parametrize("timeout_ms", [10**13, 2**63 - 1])
def test_huge_timeouts_do_not_overflow(timeout_ms):
    promise = dtorch_ops.TensorPromise()
    fut = promise.get_future()
    timer = threading.Timer(0.05, promise.set_value, args=(torch.ones(1),))
    timer.start()
    assert torch.equal(fut.wait(timeout_ms), torch.ones(1))  # waits, does not time out at once
    timer.join()


def test_sparse_and_quantized_cpu_tensors():
    for x in (torch.eye(3).to_sparse(), torch.quantize_per_tensor(torch.ones(2), 0.5, 0, torch.qint8)):
        y = dtorch_ops.to_torch(x)
        assert y.layout == x.layout and y.dtype == x.dtype
        assert torch.equal(y.to_dense() if y.is_sparse else y.dequantize(),
                           x.to_dense() if x.is_sparse else x.dequantize())


def test_meta_tensors_get_a_clear_error():
    meta = torch.empty(2, device="meta")
    with pytest.raises(NotImplementedError, match="meta tensors have no value"):
        dtorch_ops.to_torch_async(meta)
    with pytest.raises(NotImplementedError, match="meta tensors have no value"):
        dtorch_ops.get_tensor(meta, dtorch_ops.TensorPromise())


def test_dtensor_gets_a_clear_error():
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, init_device_mesh

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # no reliance on the host's name resolving
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        d = DTensor.from_local(torch.ones(2), init_device_mesh("cpu", (1,)), [Replicate()])
        promise = dtorch_ops.TensorPromise()
        calls = [lambda: dtorch_ops.to_torch_async(d),
                 lambda: dtorch_ops.get_tensor(d, promise),
                 lambda: torch.ops.dtorch.get_tensor_async(d),
                 lambda: torch.ops.dtorch.get_tensor(d, promise.raw),
                 lambda: torch.compile(dtorch_ops.to_torch_async, backend="eager")(d)]
        if dtorch_ops.compile.graph_ops.defined_ops is not None:  # the op compiled code calls
            calls.append(lambda: torch.ops.dtorch.to_torch_async(d))
        for call in calls:
            with pytest.raises(TypeError, match=r"to_local\(\)"):
                call()
    finally:
        dist.destroy_process_group()


def test_import_without_the_compiled_library_says_why(tmp_path):
    import shutil
    import subprocess
    import sys

    # A copy of the package without its .so files, under another name (the editable install's
    # finder would resolve "dtorch_ops" to this checkout).
    package = os.path.dirname(dtorch_ops.__file__)
    shutil.copytree(package, tmp_path / "dtorch_ops_unbuilt",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    proc = subprocess.run([sys.executable, "-c", "import dtorch_ops_unbuilt"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "the compiled library could not be loaded" in proc.stderr
    assert "make build" in proc.stderr
