"""The Python layer on the direct binding (dtorch_ops._C), and the defects it fixed: exit with a
thread blocked in get(), idle waiters, Ctrl-C, eventfds of closed loops, tensor subclasses,
torch.func, FakeTensorMode, bad arguments. Each test fails on the layer it replaced."""
import asyncio
import copy
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import dtorch_ops
from conftest import WAIT_MS, run_in_thread
from dtorch_ops import _C


def _run_python(code: str, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, **kwargs)


# ---- the binding and the raw objects share one state ----


def test_wrapper_and_raw_object_share_their_state():
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()
    raw_future = future.raw
    assert isinstance(raw_future, torch.ScriptObject) and future.raw is raw_future
    assert not raw_future.is_ready() and not future.is_ready()
    promise.raw.set_value(torch.arange(3))  # set through the TorchScript object
    assert future.is_ready() and raw_future.is_ready()
    assert torch.equal(raw_future.get(), torch.arange(3))  # taken through the raw object
    assert not future.valid()  # ... is seen through the wrapper
    with pytest.raises(RuntimeError, match="already consumed"):
        future.get()
    with pytest.raises(RuntimeError, match="already satisfied"):
        promise.set_value(torch.ones(1))


def test_wrapping_a_raw_future_shares_its_state():
    raw_promise = torch.classes.dtorch.TensorPromise("memory")
    raw_future = raw_promise.get_future()
    future = dtorch_ops.TensorFuture(raw_future)
    assert future.raw is raw_future
    wrapped_promise = dtorch_ops.TensorPromise(raw_promise)
    wrapped_promise.set_value(torch.ones(2))
    assert raw_future.is_ready() and future.is_ready()
    assert torch.equal(future.get(), torch.ones(2)) and not raw_future.valid()


def test_raw_op_results_wrap_and_python_results_unwrap():
    x = torch.randn(4)
    assert torch.equal(dtorch_ops.TensorFuture(torch.ops.dtorch.get_tensor_async(x)).get(), x)
    assert torch.equal(dtorch_ops.to_torch_async(x).raw.get(), x)
    collect = dtorch_ops.sync_async("cpu")
    assert collect.raw.devices() == [torch.device("cpu")]
    collect.raw.get()
    assert not collect.valid()


def test_a_promise_makes_its_raw_object_on_first_use_where_compiled_code_takes_the_promise():
    promise = dtorch_ops.TensorPromise()
    # Compiled code passes the promise itself to a graph op where torch has opaque types (its
    # TorchScript object, ~290 B, is then made on first use); else the raw object, made now.
    assert hasattr(promise, "_raw") == (dtorch_ops.compile.graph_ops.defined_ops is None)
    raw = promise.raw
    assert isinstance(raw, torch.ScriptObject) and promise.raw is raw
    raw.set_value(torch.ones(1))
    assert promise.get_future().get().tolist() == [1.0]  # one state


# ---- 1. exit while threads wait ----

_EXIT_WHILE_WAITING = """
    import threading, torch, dtorch_ops
    promise = dtorch_ops.{promise}()
    future = promise.get_future()
    waiter = {target}
    started = threading.Event()
    def wait():
        started.set()
        waiter()
    threading.Thread(target=wait, daemon=True).start()
    started.wait(10)
    print("exiting", flush=True)
"""


@pytest.mark.parametrize("promise, target", [
    ("TensorPromise", "future.get"),
    ("VoidPromise", "future.get"),
    ("TensorPromise", "lambda: future.wait(10**9)"),
    ("TensorPromise", "future.raw.get"),  # torch's method call path: parked by the library hook
])
def test_exit_with_a_daemon_thread_blocked_in_get_is_clean(promise, target):
    # At exit the promise is destroyed (broken), which wakes the waiter while the interpreter is
    # being finalized: it must park, not re-take the GIL (which aborted: "terminate called").
    code = _EXIT_WHILE_WAITING.format(promise=promise, target=target)
    for _ in range(5):
        proc = _run_python(code)
        assert proc.returncode == 0, proc.stderr
        assert "exiting" in proc.stdout and "terminate" not in proc.stderr, proc.stderr


_EXIT_WHILE_PRODUCING = """
    import threading, time, torch, dtorch_ops
    t = torch.ones(1)
    futures = []
    def produce():
        while True:  # values keep landing while the interpreter shuts down
            p = dtorch_ops.{promise}()
            futures.append(p.get_future())
            {complete}
    def consume():  # waiters woken by those values
        while True:
            try:
                futures.pop().get()
            except (IndexError, RuntimeError):
                time.sleep(0)
    threading.Thread(target=produce, daemon=True).start()
    for _ in range(4):
        threading.Thread(target=consume, daemon=True).start()
    time.sleep(0.05)
"""


@pytest.mark.parametrize("promise, complete", [
    ("TensorPromise", "p.set_value(t)"),
    ("VoidPromise", "p.set_value()"),
    ("TensorPromise", "p.set_exception('x')"),
    ("TensorPromise", "p.raw.set_value(t)"),  # torch's method call path: the library hook parks
    ("TensorPromise", "dtorch_ops.get_tensor(t, p)"),
])
def test_exit_while_a_daemon_thread_completes_promises_is_clean(promise, complete):
    # A completion releases the GIL (to let its waiter in) and must not re-take it once
    # finalization has begun: it parks, as a waiter does. Without that: SIGABRT every run.
    code = _EXIT_WHILE_PRODUCING.format(promise=promise, complete=complete)
    for _ in range(3):
        proc = _run_python(code)
        assert proc.returncode == 0 and "terminate" not in proc.stderr, proc.stderr


def test_a_fork_child_forked_from_a_thread_handles_ctrl_c():
    # The forking thread is the child's main thread: its waits must check for signals.
    proc = _run_python("""
        import os, signal, sys, threading, time, torch, dtorch_ops
        def fork_and_wait():
            pid = os.fork()
            if pid == 0:
                promise = dtorch_ops.TensorPromise()
                future = promise.get_future()
                threading.Timer(0.3, os.kill, args=(os.getpid(), signal.SIGINT)).start()
                start = time.monotonic()
                try:
                    future.wait(60_000)
                    code = 3
                except KeyboardInterrupt:
                    code = 0 if time.monotonic() - start < 1.5 else 4
                os._exit(code)
            _, status = os.waitpid(pid, 0)
            print("child exit", os.waitstatus_to_exitcode(status))
        thread = threading.Thread(target=fork_and_wait)
        thread.start()
        thread.join()
    """)
    assert "child exit 0" in proc.stdout, proc.stdout + proc.stderr


# ---- 2. idle waiters sleep ----


def test_waiters_off_the_main_thread_never_wake_without_their_value():
    promises = [dtorch_ops.TensorPromise() for _ in range(200)]
    futures = [p.get_future() for p in promises]
    runs = [run_in_thread(f.get) for f in futures]
    time.sleep(0.2)  # every thread is now blocked in get()
    before = _C.wait_wakeups()
    time.sleep(0.5)
    woken = _C.wait_wakeups() - before
    for i, p in enumerate(promises):
        p.set_value(torch.tensor(i))
    for thread, _ in runs:
        thread.join(WAIT_MS / 1000)
    assert woken == 0, f"200 idle waiters woke {woken} times in 0.5 s"
    assert [int(r["value"]) for _, r in runs] == list(range(200))


def test_a_main_thread_wait_wakes_only_to_check_for_signals():
    assert threading.current_thread() is threading.main_thread()
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()
    before = _C.wait_wakeups()
    with pytest.raises(TimeoutError):
        future.wait(500)
    woken = _C.wait_wakeups() - before
    assert 2 <= woken <= 8, f"{woken} wake-ups in a 500 ms main-thread wait (one per 100 ms)"


# ---- 3. Ctrl-C ----

_INTERRUPTED = """
    import os, signal, threading, time, torch, dtorch_ops
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()
    threading.Timer(0.3, os.kill, args=(os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()
    try:
        {call}
        print("returned")
    except KeyboardInterrupt:
        print("interrupted after", round(time.monotonic() - start, 3))
    print("valid", future.valid())
    promise.set_value(torch.full((2,), 7.0))
    print("value", future.get().tolist())
"""


@pytest.mark.parametrize("call", ["future.get()", "future.wait(60_000)", "future.wait(1e30)"])
def test_ctrl_c_interrupts_a_wait_and_keeps_the_future(call):
    proc = _run_python(_INTERRUPTED.format(call=call))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("interrupted after"), proc.stdout
    assert float(lines[0].split()[-1]) < 1.3  # 0.3 s until Ctrl-C, then within 1 s
    assert lines[1:] == ["valid True", "value [7.0, 7.0]"]


def test_ctrl_c_interrupts_a_void_future_get():
    call = "void = dtorch_ops.VoidPromise(); void.get_future().get()"
    proc = _run_python(_INTERRUPTED.format(call=call))
    assert proc.stdout.startswith("interrupted after"), proc.stdout + proc.stderr


# ---- 4. eventfds of closed loops ----


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_event_loops_on_many_threads_share_the_notifier_cache_safely():
    # One asyncio.run per request on a pool of threads: the cache of per-loop notifiers is
    # created and swept from several threads at once (a sweep raced an insert before the lock).
    errors = []

    async def request():
        # A pending await registers with this loop's notifier (a ready one would not).
        pending = dtorch_ops.TensorPromise()
        asyncio.get_running_loop().call_soon(pending.set_value, torch.ones(1))
        return await pending.get_future()

    def serve():
        try:
            for _ in range(150):
                asyncio.run(request())
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=serve) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[:3]


def test_closed_loops_do_not_keep_eventfds_open():
    promises = [dtorch_ops.TensorPromise() for _ in range(300)]  # never fulfilled while awaited

    async def request(future):
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.ensure_future(future), 0.001)

    futures = [p.get_future() for p in promises]
    asyncio.run(request(futures[0]))
    before = _open_fds()
    for future in futures[1:]:
        asyncio.run(request(future))  # one loop per request, as a naive server does
    grown = _open_fds() - before
    assert grown <= 2, f"{grown} fds left open by 299 closed loops with pending awaits"
    for i, p in enumerate(promises):  # late completions must not touch closed eventfds
        p.set_value(torch.tensor(i))
    assert _open_fds() - before <= 2


def test_a_dropped_future_does_not_keep_its_loops_eventfd():
    promises = [dtorch_ops.TensorPromise() for _ in range(20)]

    async def abandon(promise):
        task = asyncio.ensure_future(promise.get_future())
        await asyncio.sleep(0.01)
        task.cancel()  # the future is dropped with the task; its promise stays pending

    asyncio.run(abandon(promises[0]))
    before = _open_fds()
    for promise in promises[1:]:
        asyncio.run(abandon(promise))
    assert _open_fds() - before <= 2
    for promise in promises:
        promise.set_value(torch.ones(1))


# ---- 5. tensor subclasses, nested and mkldnn tensors ----


def test_wrapper_subclass_values_are_delivered_whole():
    from torch.testing._internal.two_tensor import TwoTensor

    t = TwoTensor(torch.ones(3), torch.full((3,), 2.0))
    value = dtorch_ops.to_torch_async(t).get()
    assert type(value) is TwoTensor and value is t
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()
    dtorch_ops.get_tensor(t, promise)  # once: no "already satisfied" from a second inner tensor
    assert future.get() is t
    assert dtorch_ops.to_torch(t) is t
    raw = torch.classes.dtorch.TensorPromise("memory")
    raw_future = raw.get_future()
    raw.set_value(t)
    assert type(raw_future.get()) is TwoTensor


def test_nested_and_mkldnn_tensors():
    strided = torch.nested.nested_tensor([torch.ones(2), torch.arange(3.0)])
    assert dtorch_ops.to_torch(strided) is strided
    jagged = torch.nested.nested_tensor([torch.ones(2, 4), torch.ones(3, 4)], layout=torch.jagged)
    assert dtorch_ops.to_torch(jagged) is jagged
    mkldnn = torch.ones(2, 2).to_mkldnn()
    assert torch.equal(dtorch_ops.to_torch(mkldnn).to_dense(), torch.ones(2, 2))
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()
    torch.ops.dtorch.get_tensor(strided, promise.raw)
    assert future.get() is strided


# ---- 6, 7. torch.func and FakeTensorMode ----


def test_torch_func_transforms_get_a_clear_error():
    x = torch.arange(3.0)
    with pytest.raises(RuntimeError, match="torch.func transform.*has_aux"):
        torch.func.grad(lambda t: (t * dtorch_ops.to_torch(t)).sum())(x)
    with pytest.raises(RuntimeError, match="torch.func transform"):
        torch.vmap(dtorch_ops.to_torch)(torch.ones(2, 3))
    promise = dtorch_ops.TensorPromise()
    with pytest.raises(RuntimeError, match="torch.func transform"):
        torch.func.grad(lambda t: (dtorch_ops.get_tensor(t, promise), t.sum())[1])(x)
    # Outside a transform, as before; the value is detached (the futures' rule), so the gradient
    # of t * to_torch(t) is to_torch(t).
    x.requires_grad_()
    (x * dtorch_ops.to_torch(x)).sum().backward()
    assert torch.equal(x.grad, x.detach())


def test_get_tensor_under_fake_tensor_mode_with_a_real_promise_raises():
    from torch._subclasses.fake_tensor import FakeTensorMode

    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()
    with FakeTensorMode() as mode:
        t = mode.from_tensor(torch.ones(2))
        with pytest.raises(RuntimeError, match="FakeTensorMode .* outside torch.compile"):
            dtorch_ops.get_tensor(t, promise)
    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(RuntimeError, match="FakeTensorMode .* outside torch.compile"):
            dtorch_ops.get_tensor(torch.ones(2), promise)  # a real tensor, under the mode
    promise.set_value(torch.ones(2))  # the promise was left untouched
    assert torch.equal(future.get(), torch.ones(2))


# ---- 8. a claimed promise whose completion thread cannot start ----


def test_a_device_get_tensor_without_a_thread_fails_its_waiter(dev):
    # An idle detector would take the new stream: wait until they have all exited.
    deadline = time.monotonic() + 10
    while dtorch_ops.library_threads()["detectors"] and time.monotonic() < deadline:
        time.sleep(0.02)
    with dev.using_stream(dev.new_stream()):  # a stream no detector serves yet
        y = torch.ones(2, device=dev.name) * 2
        promise = dtorch_ops.TensorPromise()
        future = promise.get_future()
        _C.fail_thread_starts_for_testing(1)
        try:
            with pytest.raises(RuntimeError, match="cannot start a thread"):
                dtorch_ops.get_tensor(y, promise)
        finally:
            _C.fail_thread_starts_for_testing(0)
    with pytest.raises(RuntimeError, match="could not wait for .*cannot start a thread"):
        future.wait(WAIT_MS)


# ---- 9, 10. clear errors ----


def test_timeouts_of_every_shape():
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        future.wait(0.5)  # half a millisecond, rounded up: not 0
    assert time.monotonic() - start >= 0.0005
    # (None is no limit: wait(timeout_ms=None), as torch.futures' wait() has none.)
    for bad, error, message in [("1", TypeError, "int or float"), (b"1", TypeError, "bytes"),
                                (True, TypeError, "bool"), (-1, ValueError, ">= 0"),
                                (-0.5, ValueError, ">= 0"), (float("nan"), ValueError, "nan"),
                                (-(2**70), ValueError, ">= 0")]:
        with pytest.raises(error, match=message):
            future.wait(bad)
    assert future.valid()
    for huge in (2**64, 1e30, float("inf")):
        fresh = dtorch_ops.TensorPromise()
        timer = threading.Timer(0.02, fresh.set_value, args=(torch.ones(1),))
        timer.start()
        assert torch.equal(fresh.get_future().wait(huge), torch.ones(1))  # no limit, no overflow
        timer.join()
    promise.set_value(torch.zeros(1))
    assert future.wait(timeout_ms=0).shape == (1,)  # the keyword, as before the binding


def test_bad_devices_name_the_argument():
    for bad in (b"cpu", 3.0, True, object()):
        with pytest.raises(TypeError, match="devices must be a device"):
            dtorch_ops.sync(bad)
        with pytest.raises(TypeError, match="devices must be a device"):
            dtorch_ops.sync_async([bad])
    with pytest.raises(ValueError, match="'nowhere' is not a device"):
        dtorch_ops.sync("nowhere")
    if not torch.accelerator.is_available():
        with pytest.raises(ValueError, match="0 is not a device this process can name"):
            dtorch_ops.sync(0)


def test_raw_get_tensor_async_of_none():
    with pytest.raises(TypeError, match="needs a tensor, got None"):
        torch.ops.dtorch.get_tensor_async(None)


def test_wrapping_the_wrong_raw_class_says_which():
    with pytest.raises(TypeError, match="got a raw torch.classes.dtorch.VoidPromise"):
        dtorch_ops.TensorPromise(torch.classes.dtorch.VoidPromise("memory"))
    with pytest.raises(TypeError, match="got torch.classes.dtorch.TensorPromise"):
        dtorch_ops.TensorFuture(torch.classes.dtorch.TensorPromise("memory"))
    with pytest.raises(TypeError, match="raw torch.classes.dtorch.VoidPromise"):
        dtorch_ops.sync_into("cpu", torch.classes.dtorch.TensorPromise("memory"))


def test_exception_messages_keep_every_character():
    for promise in (dtorch_ops.TensorPromise(), torch.classes.dtorch.TensorPromise("memory")):
        with pytest.raises(ValueError, match="NUL character at index 1"):
            promise.set_exception("a\x00b")
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()
    promise.set_exception("naïve ✓ message")  # still settable after the refusal
    with pytest.raises(RuntimeError, match="naïve ✓ message"):
        future.get()


def test_raw_handles_are_truthy_comparable_and_never_copied():
    promise = torch.classes.dtorch.TensorPromise("memory")
    future = promise.get_future()
    for handle in (promise, future):
        assert bool(handle) is True
        assert (handle == None) is False and (handle != None) is True  # noqa: E711
        assert handle == handle and not (handle != handle)
        with pytest.raises(TypeError, match="cannot be copied"):
            copy.copy(handle)
        with pytest.raises(TypeError, match="cannot"):
            copy.deepcopy(handle)
    wrapped = dtorch_ops.TensorPromise()
    for obj in (wrapped.get_future(), dtorch_ops.to_torch_async(torch.ones(1))):
        with pytest.raises(TypeError, match="cannot be pickled or copied"):
            copy.copy(obj)
        with pytest.raises(TypeError, match="cannot be pickled or copied"):
            copy.deepcopy(obj)
    assert future == future and promise != future


def test_raw_set_value_refuses_a_dtensor():
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, init_device_mesh

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        d = DTensor.from_local(torch.ones(2), init_device_mesh("cpu", (1,)), [Replicate()])
        raw = torch.classes.dtorch.TensorPromise("memory")
        future = raw.get_future()
        with pytest.raises(TypeError, match=r"to_local\(\)"):
            raw.set_value(d)
        # The refusal fails the promise too, saying why (a consumer elsewhere learns it).
        with pytest.raises(RuntimeError, match=r"set_value in the producer .* refused the value"):
            future.wait()
    finally:
        dist.destroy_process_group()


def test_a_second_get_tensor_names_both_calls():
    promise = dtorch_ops.TensorPromise()
    dtorch_ops.get_tensor(torch.ones(1), promise)
    with pytest.raises(RuntimeError, match="get_tensor was called on it first and this "
                                           "get_tensor came second"):
        dtorch_ops.get_tensor(torch.ones(1), promise)
    with pytest.raises(RuntimeError, match="this set_value came second"):
        promise.set_value(torch.ones(1))


def test_a_raw_promise_passed_to_the_wrapper_in_a_compiled_step():
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(x, promise):
        loss = (x * 2).sum()
        dtorch_ops.get_tensor(loss, promise)  # a raw promise: a stand-in while tracing
        return loss + 1

    for i in range(2):
        promise = torch.classes.dtorch.TensorPromise("memory")
        future = promise.get_future()
        x = torch.full((3,), float(i))
        step(x, promise)
        assert torch.equal(future.wait(WAIT_MS), (x * 2).sum())


def test_the_wrappers_still_compile_without_graph_breaks():
    torch._dynamo.reset()

    def step(x, promise, done):
        y = x.sin().sum()
        dtorch_ops.get_tensor(y, promise)
        dtorch_ops.sync()
        return y

    promise, done = dtorch_ops.TensorPromise(), dtorch_ops.VoidPromise()
    explain = torch._dynamo.explain(step)(torch.ones(4), promise, done)
    assert explain.graph_break_count == 0, explain.break_reasons


def test_the_binding_still_dispatches_the_ops():
    # The profiler records the op, and a dispatch mode sees it: to_torch_async and get_tensor go
    # through the dispatcher (a typed operator handle), not around it.
    from torch.utils._python_dispatch import TorchDispatchMode

    x = torch.ones(2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dtorch_ops.to_torch_async(x).get()
        dtorch_ops.get_tensor(x, dtorch_ops.TensorPromise())
    names = {event.name for event in prof.events()}
    assert {"dtorch::get_tensor_async", "dtorch::get_tensor"} <= names, names

    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()
    with Spy():
        dtorch_ops.get_tensor(x, promise)
    assert "dtorch.get_tensor.default" in seen and future.get() is x
