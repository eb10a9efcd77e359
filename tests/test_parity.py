"""torch.futures parity: done(), value(), then(), add_done_callback(), collect_all(), wait_all(),
to_torch_future(), and torch.futures.Future adopted where a future is expected. Each behaviour is
checked against what torch.futures.Future does in the same situation where torch has one."""
import asyncio
import gc
import multiprocessing
import os
import sys
import threading
import time
import weakref

import pytest
import torch

import dtorch_ops
from dtorch_ops.errors import FutureConsumedError, FutureNotReadyError, ProducerError
from conftest import WAIT_MS, run_in_thread, wait_until

pytestmark = pytest.mark.timeout(60)


def _pair(kind="memory"):
    promise = dtorch_ops.TensorPromise(kind)
    return promise, promise.get_future()


def _thread_name() -> str:
    """The OS name of the calling thread (the library's threads are named, not Python's)."""
    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
        return f.read().strip()


@pytest.fixture
def unraisable(monkeypatch):
    """Exceptions reported through sys.unraisablehook during the test."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    return seen


# ---- done() and value() ----

@pytest.mark.parametrize("kind", ["memory", "file"])
def test_value_reads_without_consuming_and_get_still_takes(kind):
    promise, future = _pair(kind)
    assert not future.done() and not future.is_ready()
    with pytest.raises(FutureNotReadyError,
                       match=r"value\(\) \(C\+\+: Value\(\)\) reads a completed future"):
        future.value()
    assert future.valid()  # (a refused value() changes nothing)
    x = torch.arange(4.0)
    promise.set_value(x)
    assert future.done() and future.is_ready()
    first, second = future.value(), future.value()
    assert torch.equal(first, x) and second is first  # the same tensor each time
    if kind == "memory":
        assert first is x  # in-process futures alias the value
    assert future.valid() and future.done()
    taken = future.get()
    assert taken is first
    assert not future.valid() and future.done()  # consumed, still complete (torch's done())
    with pytest.raises(FutureConsumedError):
        future.get()
    assert future.value() is first  # as torch's value(): readable while the future lives


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_value_raises_the_error_each_time_and_get_consumes_it(kind):
    promise, future = _pair(kind)
    promise.set_exception("boom")
    for _ in range(2):
        with pytest.raises(ProducerError, match="boom"):
            future.value()
    assert future.valid()
    with pytest.raises(ProducerError, match="boom"):
        future.get()
    with pytest.raises(FutureConsumedError):
        future.get()
    with pytest.raises(ProducerError, match="boom"):
        future.value()


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_wait_for_answers_as_the_raw_future_does(kind):
    # The raw futures' wait_for(ms) -> bool on the Python ones (a compiled raw op returns these):
    # True once complete, value or error, reading and consuming nothing.
    promise, future = _pair(kind)
    raw = future.raw
    started = time.monotonic()
    assert future.wait_for(30) is False and raw.wait_for(0) is False
    assert time.monotonic() - started >= 0.025
    promise.set_value(torch.ones(2))
    assert future.wait_for(WAIT_MS) is True and raw.wait_for(0) is True and future.valid()
    assert torch.equal(future.get(), torch.ones(2))
    assert future.wait_for(0) is raw.wait_for(0) is True  # consumed: still complete
    failed, failing = _pair(kind)
    failed.set_exception(ValueError("bad batch"))
    assert failing.wait_for(WAIT_MS) is True and failing.valid()  # the error is not raised
    with pytest.raises(TypeError, match="needs a timeout"):
        failing.wait_for(None)
    with pytest.raises(ValueError, match=">= 0"):
        failing.wait_for(-1)
    with pytest.raises(TypeError, match="number of milliseconds"):
        failing.wait_for("1")
    for other in (dtorch_ops.sync_async(), dtorch_ops.VoidPromise().get_future()):
        assert isinstance(other.wait_for(0), bool)


def test_value_of_void_futures_and_of_a_sync():
    promise = dtorch_ops.VoidPromise()
    future = promise.get_future()
    with pytest.raises(FutureNotReadyError):
        future.value()
    promise.set_value()
    assert future.value() is None and future.done()
    collect = dtorch_ops.sync_async()
    collect.wait(WAIT_MS)
    assert collect.valid()  # (wait() does not consume)
    collect = dtorch_ops.sync_async()
    assert dtorch_ops.wait_all([collect]) == [None]
    assert collect.value() is None and collect.done() and collect.valid()
    collect.get()
    assert collect.done() and not collect.valid() and collect.value() is None


def test_value_and_get_from_threads_at_once_both_have_the_value():
    for kind in ("memory", "file"):
        for _ in range(20):
            promise, future = _pair(kind)
            promise.set_value(torch.ones(2))
            start = threading.Barrier(2)

            def read(how):
                start.wait()
                try:
                    return getattr(future, how)()
                except FutureConsumedError:
                    return "consumed"

            (t1, r1), (t2, r2) = run_in_thread(read, "value"), run_in_thread(read, "get")
            t1.join(10)
            t2.join(10)
            assert "value" in r1 and "value" in r2, (r1, r2)
            assert torch.equal(r1["value"], torch.ones(2)) and torch.equal(r2["value"],
                                                                           torch.ones(2))


# ---- add_done_callback ----

def test_callbacks_on_a_complete_future_run_at_once_like_torch():
    for future, complete in (_torch_pair(), _ours_pair()):
        complete(torch.ones(1))
        ran = []
        future.add_done_callback(lambda f: ran.append(threading.get_ident()))
        assert ran == [threading.get_ident()], type(future)  # before add_done_callback returned


def _torch_pair():
    future = torch.futures.Future()
    return future, future.set_result


def _ours_pair():
    promise, future = _pair()
    return future, promise.set_value


def test_callbacks_run_in_order_on_the_completing_python_thread_and_share_one_value():
    promise, future = _pair()
    seen = []
    for i in range(3):
        future.add_done_callback(lambda f, i=i: seen.append((i, f.value(), threading.get_ident())))
    assert seen == []
    x = torch.ones(2)
    thread, result = run_in_thread(promise.set_value, x)
    thread.join(10)
    assert "error" not in result
    assert [i for i, _, _ in seen] == [0, 1, 2]
    assert all(value is x for _, value, _ in seen)
    assert {ident for _, _, ident in seen} == {thread.ident}
    assert future.get() is x  # the callbacks consumed nothing


def test_an_exception_in_a_callback_is_reported_and_spares_the_producer_and_other_callbacks(
        unraisable):
    promise, future = _pair()
    ran = []

    def bad(f):
        raise ValueError("callback failed")

    future.add_done_callback(bad)
    future.add_done_callback(lambda f: ran.append(True))
    promise.set_value(torch.ones(1))  # does not raise
    assert ran == [True]
    assert len(unraisable) == 1
    assert isinstance(unraisable[0].exc_value, ValueError)
    assert unraisable[0].object is bad
    # Registered on a complete future: reported the same way, not raised into the registrar.
    future.add_done_callback(bad)
    assert len(unraisable) == 2


def test_a_broken_promise_runs_the_callbacks_with_its_error():
    promise, future = _pair()
    errors = []

    def read(f):
        try:
            f.value()
        except dtorch_ops.BrokenPromiseError as e:
            errors.append(e)

    future.add_done_callback(read)
    del promise
    gc.collect()
    assert len(errors) == 1


def test_a_callback_is_released_once_it_has_run():
    promise, future = _pair()

    class Callback:
        def __call__(self, f):
            pass

    callback = Callback()
    alive = weakref.ref(callback)
    future.add_done_callback(callback)
    del callback
    assert alive() is not None  # held while pending
    promise.set_value(torch.ones(1))
    gc.collect()
    assert alive() is None


def test_add_done_callback_refuses_what_is_not_callable():
    _, future = _pair()
    with pytest.raises(TypeError, match="needs a callable, got int"):
        future.add_done_callback(3)


def test_a_device_completion_runs_callbacks_on_the_pool(dev):
    x = torch.ones(4, device=dev.name)
    ran = threading.Event()
    where = []

    def callback(f):
        where.append((_thread_name(), f.value().device))
        ran.set()

    with dev.busy():
        future = dtorch_ops.to_torch_async(x * 2)
        future.add_done_callback(callback)
        assert not ran.is_set()
    assert ran.wait(WAIT_MS / 1000)
    # Completed by a detector, which must not wait for the GIL: the pool ran it.
    assert where == [("dtorch-pool", x.device)]
    assert torch.equal(future.get().cpu(), torch.full((4,), 2.0))


def _set_after(promise, delay_s):
    time.sleep(delay_s)
    promise.set_value(torch.full((3,), 7.0))


@pytest.mark.timeout(120)
def test_a_file_pair_completed_by_another_process_runs_callbacks_on_the_pool():
    promise, future = _pair("file")
    ran = threading.Event()
    where = []
    future.add_done_callback(lambda f: (where.append((_thread_name(), f.value().tolist())),
                                        ran.set()))
    child = multiprocessing.get_context("fork").Process(target=_set_after, args=(promise, 0.2))
    child.start()
    try:
        assert ran.wait(WAIT_MS / 1000)
    finally:
        child.join(30)
    assert where == [("dtorch-pool", [7.0, 7.0, 7.0])]
    assert future.get().tolist() == [7.0, 7.0, 7.0]


def test_a_file_future_read_by_its_callback_and_its_owner_at_once():
    # The pair's callbacks run when the value is first received: they read the future too.
    promise, future = _pair("file")
    seen = []
    future.add_done_callback(lambda f: seen.append((f.value().tolist(), f.done(), f.valid())))
    promise.set_value(torch.ones(2))
    assert future.value().tolist() == [1.0, 1.0]
    # (It ran here, or on the pool when the doorbell watcher saw the completion first.)
    assert wait_until(lambda: seen, 5.0)
    assert seen == [([1.0, 1.0], True, True)]
    assert future.get().tolist() == [1.0, 1.0]


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_callbacks_read_the_value_whoever_gets_it_first(kind):
    # Waiters wake before callbacks run: a get() on another thread may take the value first.
    for _ in range(100):
        promise, future = _pair(kind)
        derived = future.then(lambda f: f.value() + 1)
        theirs = future.to_torch_future()
        collected = dtorch_ops.collect_all([future])
        taker, taken = run_in_thread(future.get)
        promise.set_value(torch.ones(1))
        taker.join(10)
        assert taken["value"].tolist() == [1.0]
        assert derived.wait(WAIT_MS).tolist() == [2.0]
        assert theirs.wait().tolist() == [1.0]
        assert collected.wait(WAIT_MS)[0].value().tolist() == [1.0]


def test_callbacks_on_the_pool_run_one_at_a_time_in_order(dev):
    order, running, overlaps = [], [0], []
    done = threading.Event()

    def callback(i):
        def run(f):
            running[0] += 1
            overlaps.append(running[0])
            time.sleep(0.01)
            order.append(i)
            running[0] -= 1
            if i == 4:
                done.set()
        return run

    with dev.busy():
        future = dtorch_ops.to_torch_async(torch.ones(2, device=dev.name) + 1)
        for i in range(5):
            future.add_done_callback(callback(i))
    assert done.wait(WAIT_MS / 1000)
    assert order == [0, 1, 2, 3, 4] and max(overlaps) == 1


_EXIT_WITH_A_RUNNING_CALLBACK = """
import sys, threading, time, torch, dtorch_ops
promise = dtorch_ops.TensorPromise("file")  # (completed through the watcher: the pool runs it)
future = promise.get_future()
started = threading.Event()
never = dtorch_ops.TensorPromise().get_future()  # never completed
complete = dtorch_ops.TensorPromise()
complete.set_value(torch.ones(1))
complete = complete.get_future()
def busy(f):
    started.set()
    end = time.monotonic() + 1.5
    while time.monotonic() < end:  # Python running on the pool thread when exit begins, in and
        dtorch_ops.to_torch_async(torch.ones(1)).get()  # out of library calls that keep the GIL
    print("callback returned", flush=True)
def blocked(f):  # blocked in a library wait at exit: it parks there
    started.set()
    never.get()
callbacks = {
    "busy": busy,
    "blocked": blocked,
    "blocked in a raw wait": lambda f: (started.set(), never.raw.get()),
    "blocked in a nested callback": lambda f: complete.add_done_callback(blocked),
}
future.add_done_callback(callbacks[sys.argv[1]])
promise.set_value(torch.ones(2))
assert started.wait(10)
time.sleep(0.1)
print("main exits", flush=True)
"""


@pytest.mark.parametrize("callback", ["busy", "blocked", "blocked in a raw wait",
                                      "blocked in a nested callback"])
def test_exit_with_a_callback_running_on_the_pool_is_clean(callback):
    import subprocess

    done = subprocess.run([sys.executable, "-c", _EXIT_WITH_A_RUNNING_CALLBACK, callback],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Fatal" not in done.stderr and "terminate" not in done.stderr
    if callback == "busy":  # waited for, as a non-daemon thread would be
        assert done.stdout.split() == ["main", "exits", "callback", "returned"]
    else:  # not waited for: it cannot return to Python any more (the timeout bounds the wait)
        assert done.stdout.split() == ["main", "exits"]
        assert "waiting at exit" not in done.stderr


_FORK_WHILE_A_CALLBACK_RUNS = """
import os, sys, threading, time, torch, dtorch_ops
promise = dtorch_ops.TensorPromise()
promise.set_value(torch.ones(1))
future = promise.get_future()
running = threading.Event()
def callback(f):
    running.set()
    time.sleep(1)
threading.Thread(target=future.add_done_callback, args=(callback,), daemon=True).start()
assert running.wait(10)
pid = os.fork()
if pid == 0:  # the parent's running callback does not exist here: exit does not wait for it
    os.write(1, b"child exits\\n")
    sys.exit(0)
_, status = os.waitpid(pid, 0)
print("child status", status, flush=True)
"""


def test_a_fork_child_does_not_wait_at_exit_for_its_parent_callbacks():
    import subprocess

    done = subprocess.run([sys.executable, "-c", _FORK_WHILE_A_CALLBACK_RUNS],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["child", "exits", "child", "status", "0"]


def test_a_promise_does_not_keep_the_value_once_its_future_is_gone():
    promise, future = _pair()
    x = torch.ones(3)
    alive = weakref.ref(x)
    promise.set_value(x)
    assert future.get() is x and future.value() is x  # the future keeps it while it lives
    del x, future
    gc.collect()
    assert alive() is None  # the promise, still alive, does not
    # The future dropped first, then the value set: not kept either.
    promise, future = _pair()
    del future
    x = torch.ones(3)
    alive = weakref.ref(x)
    promise.set_value(x)
    del x
    gc.collect()
    assert alive() is None
    with pytest.raises(dtorch_ops.PromiseAlreadySatisfiedError):
        promise.set_value(torch.ones(1))


# ---- then ----

def test_then_chains_like_torch():
    promise, future = _pair()
    ours = future.then(lambda f: f.value().sum().item()).then(lambda f: f.value() + 1)
    theirs_source = torch.futures.Future()
    theirs = theirs_source.then(lambda f: f.value().sum().item()).then(lambda f: f.value() + 1)
    assert isinstance(ours, dtorch_ops.ObjectFuture) and not ours.done()
    promise.set_value(torch.ones(3))
    theirs_source.set_result(torch.ones(3))
    assert ours.value() == theirs.wait() == 4.0
    assert ours.get() == 4.0 and not ours.valid()


def test_then_makes_a_tensor_future_when_the_callback_returns_a_tensor():
    promise, future = _pair()

    def double(f) -> torch.Tensor:
        return f.value() * 2

    derived = future.then(double)
    assert isinstance(derived, dtorch_ops.TensorFuture) and derived.kind() == "memory"
    promise.set_value(torch.ones(2))
    assert torch.equal(derived.get(), torch.full((2,), 2.0))

    def not_a_tensor(f) -> torch.Tensor:
        return 3

    promise, future = _pair()
    derived = future.then(not_a_tensor)
    promise.set_value(torch.ones(1))
    with pytest.raises(ProducerError, match="gave an int, not a tensor"):
        derived.get()


def test_errors_propagate_through_then():
    # The source's error: value() raises it in the callback, and it fails the derived future.
    promise, future = _pair()
    derived = future.then(lambda f: f.value())
    promise.set_exception("producer failed")
    with pytest.raises(ProducerError, match="producer failed"):
        derived.get()
    # torch does the same (as a RuntimeError).
    source = torch.futures.Future()
    theirs = source.then(lambda f: f.value())
    source.set_exception(ValueError("producer failed"))
    with pytest.raises(Exception, match="producer failed"):
        theirs.wait()

    # The callback's own exception: the ObjectFuture raises that very exception.
    promise, future = _pair()
    derived = future.then(lambda f: 1 / 0)
    promise.set_value(torch.ones(1))
    for read in (derived.value, derived.get):
        with pytest.raises(ZeroDivisionError):
            read()

    # A TensorFuture carries it as a ProducerError naming it.
    def fails(f) -> torch.Tensor:
        raise KeyError("nope")

    promise, future = _pair()
    derived = future.then(fails)
    promise.set_value(torch.ones(1))
    with pytest.raises(ProducerError, match="the then\\(\\) callback failed: KeyError: 'nope'"):
        derived.get()


def test_then_on_void_futures_and_a_sync():
    promise = dtorch_ops.VoidPromise()
    derived = promise.get_future().then(lambda f: ("done", f.value()))
    promise.set_value()
    assert derived.get() == ("done", None)
    assert dtorch_ops.sync_async().then(lambda f: "synced").get() == "synced"


def test_then_reads_the_return_annotation_only():
    def double(f: "NoSuchName") -> "torch.Tensor":  # noqa: F821 (an unresolvable parameter)
        return f.value() * 2

    promise, future = _pair()
    derived = future.then(double)
    assert isinstance(derived, dtorch_ops.TensorFuture)
    promise.set_value(torch.ones(1))
    assert derived.get().tolist() == [2.0]


def test_then_refuses_what_is_not_callable():
    _, future = _pair()
    with pytest.raises(TypeError, match="then\\(\\) needs a callable"):
        future.then(None)


def test_an_object_future_cannot_reach_torchscript():
    promise, future = _pair()
    derived = future.then(lambda f: 1)
    with pytest.raises(TypeError, match="no TorchScript object"):
        derived.raw
    promise.set_value(torch.ones(1))
    assert derived.get() == 1


# ---- collect_all / wait_all ----

def test_collect_all_yields_the_futures_once_all_are_done():
    (p1, f1), (p2, f2) = _pair(), _pair()
    theirs = torch.futures.Future()
    collected = dtorch_ops.collect_all([f1, f2, theirs])
    assert not collected.done()
    p2.set_value(torch.ones(1))
    theirs.set_result("torch")
    assert not collected.done()
    p1.set_value(torch.zeros(1))
    futures = collected.get()
    assert futures[0] is f1 and futures[1] is f2 and futures[2] is theirs
    assert [f.value().tolist() for f in futures[:2]] == [[0.0], [1.0]]


def test_collect_all_with_one_failing_future_fails_at_once_with_its_error_like_torch():
    (p1, f1), (p2, f2) = _pair(), _pair()
    collected = dtorch_ops.collect_all([f1, f2])
    p1.set_exception("first failed")
    assert collected.done()  # without waiting for f2
    with pytest.raises(ProducerError, match="first failed"):
        collected.get()
    p2.set_value(torch.ones(1))
    assert f1.valid() and f2.value().tolist() == [1.0]  # consumed nothing
    # torch.futures.collect_all: the same, for an error of the future itself.
    a, b = torch.futures.Future(), torch.futures.Future()
    failing = a.then(lambda f: 1 / 0)
    theirs = torch.futures.collect_all([failing, b])
    a.set_result(1)
    assert theirs.done()
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        theirs.wait()


def test_wait_all_returns_the_values_or_raises_the_first_error_like_torch():
    (p1, f1), (p2, f2) = _pair(), _pair()
    theirs = torch.futures.Future()
    threading.Timer(0.05, p1.set_value, args=(torch.ones(1),)).start()
    p2.set_value(torch.zeros(1))
    theirs.set_result(5)
    values = dtorch_ops.wait_all([f1, f2, theirs])
    assert [values[0].tolist(), values[1].tolist(), values[2]] == [[1.0], [0.0], 5]
    assert f1.valid()  # not consumed, as torch's wait_all consumes nothing

    # The first to fail, at once: f1 never completes, f2 fails later.
    (p1, f1), (p2, f2), (p3, f3) = _pair(), _pair(), _pair()
    p3.set_exception("third")
    timer = threading.Timer(0.5, p2.set_exception, args=("second",))
    timer.start()
    with pytest.raises(ProducerError, match="third"):
        dtorch_ops.wait_all([f1, f2, f3])
    timer.cancel()
    a, b = torch.futures.Future(), torch.futures.Future()
    failing = a.then(lambda f: 1 / 0)
    a.set_result(1)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        torch.futures.wait_all([b, failing])  # b never completes either


def test_collect_all_of_nothing_and_of_what_is_not_a_future():
    assert dtorch_ops.collect_all([]).get() == []
    assert dtorch_ops.wait_all([]) == []
    with pytest.raises(TypeError, match="takes dtorch_ops futures or torch.futures.Future"):
        dtorch_ops.collect_all([torch.ones(1)])
    raw = torch.ops.dtorch.get_tensor_async(torch.ones(1))
    with pytest.raises(TypeError, match="wrap a raw one"):
        dtorch_ops.wait_all([raw])


def test_collect_all_and_then_results_are_awaitable():
    async def main():
        (p1, f1), (p2, f2) = _pair(), _pair()
        loop = asyncio.get_running_loop()
        loop.call_later(0.02, p1.set_value, torch.ones(1))
        loop.call_later(0.03, p2.set_value, torch.full((1,), 2.0))
        futures = await dtorch_ops.collect_all([f1, f2])
        summed = await f1.then(lambda f: f.value().item() + f2.value().item())
        return [f.value().item() for f in futures], summed

    assert asyncio.run(asyncio.wait_for(main(), 10)) == ([1.0, 2.0], 3.0)


def test_collect_all_of_futures_completed_from_many_threads():
    pairs = [_pair() for _ in range(200)]
    collected = dtorch_ops.collect_all([f for _, f in pairs])
    threads = [threading.Thread(target=lambda chunk=pairs[i::4]: [
        p.set_value(torch.full((1,), float(k))) for k, (p, _) in enumerate(chunk)])
        for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(collected.wait(WAIT_MS)) == 200


# ---- conversions with torch.futures.Future ----

def test_to_torch_future_carries_the_value_and_the_error():
    promise, future = _pair()
    theirs = future.to_torch_future()
    assert isinstance(theirs, torch.futures.Future) and not theirs.done()
    x = torch.ones(2)
    promise.set_value(x)
    assert theirs.wait() is x
    assert future.get() is x  # not consumed by the conversion

    promise, future = _pair()
    theirs = future.to_torch_future()
    promise.set_exception("failed")
    with pytest.raises(ProducerError, match="failed"):
        theirs.wait()

    void = dtorch_ops.VoidPromise()
    theirs = void.get_future().to_torch_future()
    void.set_value()
    assert theirs.wait() is None
    # torch's own combinators take them.
    assert torch.futures.wait_all([dtorch_ops.sync_async().to_torch_future()]) == [None]


def test_a_torch_future_is_adopted_where_a_future_is_expected():
    theirs = torch.futures.Future()
    ours = dtorch_ops.TensorFuture(theirs)
    assert ours.kind() == "memory" and not ours.done()
    x = torch.ones(3)
    theirs.set_result(x)
    assert ours.get() is x

    theirs = torch.futures.Future()
    ours = dtorch_ops.TensorFuture(theirs)
    theirs.set_exception(ValueError("rpc failed"))
    with pytest.raises(ProducerError, match="adopted torch.futures.Future failed: ValueError: rpc"):
        ours.get()

    theirs = torch.futures.Future()
    ours = dtorch_ops.TensorFuture(theirs)
    theirs.set_result("not a tensor")
    with pytest.raises(ProducerError, match="gave a str, not a tensor"):
        ours.get()

    theirs = torch.futures.Future()
    void = dtorch_ops.VoidFuture(theirs)
    theirs.set_result(None)
    assert void.get() is None


def test_an_object_future_adopts_a_torch_future_and_keeps_its_exception():
    theirs = torch.futures.Future()
    ours = dtorch_ops.ObjectFuture(theirs)

    async def main():
        asyncio.get_running_loop().call_later(0.02, theirs.set_result, {"loss": 1.5})
        return await ours

    assert asyncio.run(asyncio.wait_for(main(), 10)) == {"loss": 1.5}

    theirs = torch.futures.Future()
    ours = dtorch_ops.ObjectFuture(theirs)
    theirs.set_exception(KeyError("k"))
    with pytest.raises(KeyError):
        ours.value()
    with pytest.raises(TypeError, match="adopts a torch.futures.Future"):
        dtorch_ops.ObjectFuture(3)
    with pytest.raises(TypeError, match="or a torch.futures.Future"):
        dtorch_ops.TensorFuture(3)


# ---- TorchScript ----

@torch.jit.script
def _scripted_read(future: torch.classes.dtorch.TensorFuture) -> torch.Tensor:
    if future.done():
        return future.value() + future.value()
    return torch.zeros(1)


def test_torchscript_has_done_and_value():
    promise, future = _pair()
    assert _scripted_read(future.raw).tolist() == [0.0]
    promise.set_value(torch.ones(1))
    assert _scripted_read(future.raw).tolist() == [2.0]
    assert future.get().tolist() == [1.0]  # value() consumed nothing


def test_a_compiled_function_reading_a_future_breaks_the_graph_and_stays_right():
    promise, future = _pair()
    promise.set_value(torch.ones(2))

    @torch.compile(backend="eager")
    def step(x, fut):
        if fut.done():
            return x + fut.value()
        return x

    assert step(torch.ones(2), future).tolist() == [2.0, 2.0]
    assert future.valid()


_CALLBACKS_ON_PYTHON_THREADS = """
import threading, torch, dtorch_ops
ran = []
for i in range(100):
    promise = dtorch_ops.TensorPromise()
    derived = promise.get_future().then(lambda f: ran.append(threading.get_ident()))
    setter = threading.Thread(target=promise.set_value, args=(torch.ones(1),))
    setter.start(); setter.join(10)
    derived.wait(10_000)
assert len(ran) == 100 and threading.get_ident() not in ran, ran
print(dtorch_ops.library_threads()["pool"])
"""


def test_no_thread_is_started_for_callbacks_completed_by_python_threads():
    import subprocess

    done = subprocess.run([sys.executable, "-c", _CALLBACKS_ON_PYTHON_THREADS],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"  # (a fresh process: the pool was never started)
