"""Waiting as torch.futures, concurrent.futures and std::future have it: done() means complete
(also after get()), wait() waits without a limit and does not consume, result(timeout) and
exception(timeout) in seconds, set_exception(exc) raises that very exception; collecting from
many futures: wait_all / collect_all with a timeout, wait_any, as_completed.

The ported cases follow pytorch's test/test_futures.py (TestFuture), each checked against what
torch.futures.Future does where torch has the behaviour.
"""
import inspect
import threading
import time

import pytest
import torch

import dtorch_ops
from conftest import run_in_thread
from dtorch_ops import errors

pytestmark = pytest.mark.timeout(60)


# ---- every future class: done() after get(), wait() without a limit, repeated, not consuming ----

def _completed(which):
    """A completed future of each class, and the value it holds."""
    if which in ("tensor", "file"):
        promise = dtorch_ops.TensorPromise("memory" if which == "tensor" else "file")
        future = promise.get_future()
        promise.set_value(torch.arange(3.0))
        return future, torch.arange(3.0)
    if which == "void":
        promise = dtorch_ops.VoidPromise()
        future = promise.get_future()
        promise.set_value()
        return future, None
    if which == "list":
        return dtorch_ops.to_torch_async([torch.ones(1), torch.zeros(2)], device="cpu"), \
            [torch.ones(1), torch.zeros(2)]
    if which == "collect":
        return dtorch_ops.sync_async(["cpu"]), None
    if which == "object":
        source = dtorch_ops.TensorPromise()
        future = source.get_future().then(lambda f: int(f.value().sum()))
        source.set_value(torch.ones(4))
        return future, 4
    if which == "collect_all":
        promise = dtorch_ops.TensorPromise()
        inner = promise.get_future()
        promise.set_value(torch.ones(1))
        return dtorch_ops.collect_all([inner]), "futures"
    raise AssertionError(which)


CLASSES = ["tensor", "file", "void", "list", "collect", "object", "collect_all"]


def _same(got, expected):
    if expected is None:
        return got is None
    if expected == "futures":
        return isinstance(got, list) and len(got) == 1
    if isinstance(expected, list):
        return all(torch.equal(a, b) for a, b in zip(got, expected))
    if isinstance(expected, torch.Tensor):
        return torch.equal(got, expected)
    return got == expected


@pytest.mark.parametrize("which", CLASSES)
def test_done_stays_true_after_get_and_only_get_consumes(which):
    future, expected = _completed(which)
    assert future.done() and future.is_ready() and future.valid()
    assert _same(future.wait(), expected)          # no timeout: allowed
    assert _same(future.wait(), expected)          # repeated: torch's wait() can be
    assert _same(future.wait(1000), expected)      # timeout_ms, positional
    assert _same(future.wait(timeout=1.0), expected)
    assert _same(future.result(), expected) and _same(future.result(1.0), expected)
    assert future.exception() is None
    assert future.valid()                          # none of those consumed it
    assert _same(future.get(), expected)
    assert future.done() and future.is_ready()     # complete, as torch's done()
    assert not future.valid()                      # valid() reports consumption
    assert _same(future.value(), expected) and _same(future.wait(), expected)
    with pytest.raises(errors.FutureConsumedError):
        future.get()


@pytest.mark.parametrize("which", ["tensor", "void", "object"])
def test_a_pending_future_is_not_done_and_a_bounded_wait_leaves_it_valid(which):
    if which == "object":
        source = dtorch_ops.TensorPromise()
        future = source.get_future().then(lambda f: f.value())
    else:
        source = (dtorch_ops.TensorPromise if which == "tensor" else dtorch_ops.VoidPromise)()
        future = source.get_future()
    assert not future.done() and not future.is_ready() and future.valid()
    for wait in (lambda: future.wait(20), lambda: future.wait(timeout_ms=20),
                 lambda: future.wait(timeout=0.02), lambda: future.result(0.02),
                 lambda: future.exception(timeout=0.02)):
        started = time.monotonic()
        with pytest.raises(errors.FutureTimeoutError) as info:
            wait()
        assert isinstance(info.value, TimeoutError)
        assert time.monotonic() - started >= 0.019
    assert future.valid() and not future.done()
    if which == "void":
        source.set_value()
    else:
        source.set_value(torch.ones(1))
    future.wait()
    assert future.done()


def test_wait_without_a_timeout_waits_for_another_thread():
    # torch: test_wait_multi_thread
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()

    def slow_set():
        time.sleep(0.3)
        promise.set_value(torch.ones(2, 2))

    thread = threading.Thread(target=slow_set)
    thread.start()
    assert torch.equal(future.wait(), torch.ones(2, 2))
    thread.join()
    assert future.done() and future.valid()


def test_the_timeout_error_words_every_limit_in_milliseconds():
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()
    with pytest.raises(errors.FutureTimeoutError, match=r"within 15 ms"):
        future.wait(15)
    with pytest.raises(errors.FutureTimeoutError, match=r"within 15 ms"):
        future.result(0.015)


@pytest.mark.parametrize("call,message", [
    (lambda f: f.wait(1, 2), r"wait\(\) takes at most one argument, timeout_ms"),
    (lambda f: f.wait(timeout=1, timeout_ms=5), r"not both"),
    (lambda f: f.wait(5, timeout_ms=5), r"both as an argument and by keyword"),
    (lambda f: f.wait(seconds=1), r"unexpected keyword argument 'seconds'"),
    (lambda f: f.wait("1"), r"timeout_ms must be a number of milliseconds"),
    (lambda f: f.wait(timeout="1"), r"timeout must be a number of seconds"),
    (lambda f: f.result(1, 2), r"result\(\) takes at most one argument, timeout"),
    (lambda f: f.get(5), r"get\(\) takes no arguments"),
    (lambda f: f.is_ready(1), r"is_ready\(\) takes no arguments"),
    (lambda f: f.add_done_callback(), r"takes exactly one argument"),
])
def test_wrong_arguments_get_a_real_message(call, message):
    future = dtorch_ops.TensorPromise().get_future()
    with pytest.raises(TypeError, match=message) as info:
        call(future)
    assert "incompatible function arguments" not in str(info.value)


@pytest.mark.parametrize("value,error", [(-1, ValueError), (float("nan"), ValueError),
                                         (True, TypeError)])
def test_bad_timeouts_by_keyword(value, error):
    future = dtorch_ops.TensorPromise().get_future()
    with pytest.raises(error):
        future.wait(timeout=value)
    with pytest.raises(error):
        dtorch_ops.wait_all([future], timeout=value)


def test_help_shows_clean_signatures():
    cls = dtorch_ops.TensorFuture
    assert str(inspect.signature(cls.wait)) == "(self, /, timeout_ms=None, *, timeout=None)"
    assert str(inspect.signature(cls.result)) == "(self, /, timeout=None, *, timeout_ms=None)"
    assert str(inspect.signature(cls.get)) == "(self, /)"
    future = dtorch_ops.TensorPromise().get_future()
    assert str(inspect.signature(future.wait)) == "(timeout_ms=None, *, timeout=None)"
    for name in ("wait_all", "collect_all", "wait_any", "as_completed"):
        parameters = inspect.signature(getattr(dtorch_ops, name)).parameters
        assert list(parameters) == ["futures", "timeout", "timeout_ms"]
        assert parameters["timeout_ms"].kind is inspect.Parameter.KEYWORD_ONLY
    import pydoc

    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    assert "wait(self, /, timeout_ms=None, *, timeout=None)" in text
    assert "pybind11" not in text


# ---- set_exception(exc): the very exception, in one process ----

@pytest.mark.parametrize("kind", ["memory", "file"])
def test_set_exception_with_an_exception_raises_that_instance(kind):
    # torch: test_set_exception
    error = ValueError("Intentional Value Error")
    promise = dtorch_ops.TensorPromise(kind)
    future = promise.get_future()
    promise.set_exception(error)
    assert future.done()
    for read in (future.wait, future.value, future.result, future.get):
        with pytest.raises(ValueError, match="Intentional") as info:
            read()
        assert info.value is error
    assert future.exception() is error
    theirs = torch.futures.Future()
    theirs.set_exception(error)
    with pytest.raises(ValueError):
        theirs.wait()


def test_set_exception_of_an_exception_class_and_a_string():
    promise = dtorch_ops.VoidPromise()
    future = promise.get_future()
    promise.set_exception(KeyError)
    with pytest.raises(KeyError):
        future.wait()
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()
    promise.set_exception("worker failed")
    with pytest.raises(errors.ProducerError, match="worker failed"):
        future.wait()
    with pytest.raises(errors.PromiseAlreadySatisfiedError):
        promise.set_exception(ValueError("second"))


def test_set_exception_wakes_a_waiting_thread():
    # torch: test_set_exception_multithreading
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()
    error = ValueError("Intentional Value Error")

    def wait_for_it():
        with pytest.raises(ValueError, match="Intentional"):
            future.wait()
        return True

    thread, result = run_in_thread(wait_for_it)
    time.sleep(0.05)
    promise.set_exception(error)
    thread.join(10)
    assert result.get("value") is True, result


def test_fulfilling_fails_the_promise_with_the_block_exception_and_reraises():
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()
    with pytest.raises(RuntimeError, match="load failed"):
        with promise.fulfilling():
            raise RuntimeError("load failed")
    with pytest.raises(RuntimeError, match="load failed"):
        future.wait()
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()
    with pytest.raises(ZeroDivisionError):
        with promise.fulfilling():
            promise.set_value(torch.ones(1))
            1 / 0
    assert torch.equal(future.wait(), torch.ones(1))  # (the value set first stays)


def test_run_into_sets_the_result_or_the_exception():
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()
    assert torch.equal(dtorch_ops.run_into(promise, torch.full, (2,), 3.0), torch.full((2,), 3.0))
    assert torch.equal(future.wait(), torch.full((2,), 3.0))
    void = dtorch_ops.VoidPromise()
    done = void.get_future()
    dtorch_ops.run_into(void, lambda: None)
    assert done.wait() is None
    failing = dtorch_ops.TensorPromise()
    failed = failing.get_future()
    with pytest.raises(OSError):
        dtorch_ops.run_into(failing, open, "/nonexistent/checkpoint.pt")
    with pytest.raises(OSError):
        failed.wait()
    with pytest.raises(TypeError, match="run_into takes a dtorch_ops.TensorPromise"):
        dtorch_ops.run_into(failing.raw, lambda: None)


def test_a_value_set_value_refuses_fails_the_future_with_why():
    promise = dtorch_ops.TensorPromise(kind="file")
    future = promise.get_future()
    with pytest.raises(RuntimeError, match="strided"):
        promise.set_value(torch.ones(2).to_sparse())
    with pytest.raises(errors.ProducerError, match=r"set_value in the producer \(pid \d+\) "
                                                    r"refused the value"):
        future.wait()
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()
    with pytest.raises(TypeError, match="expects a torch.Tensor"):
        promise.set_value([1, 2])
    with pytest.raises(errors.ProducerError, match="refused the value"):
        future.wait()


# ---- callbacks and then() (torch: test_done_exception, test_then, add_one) ----

def test_callbacks_and_then_callbacks_may_call_wait():
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()
    seen = []
    future.add_done_callback(lambda f: seen.append(f.wait() + 1))
    chained = future.then(lambda f: f.wait() + 1)  # torch's add_one
    promise.set_value(torch.ones(2))
    assert torch.equal(seen[0], torch.full((2,), 2.0))
    assert torch.equal(chained.wait(), torch.full((2,), 2.0))
    assert future.valid() and chained.done()


def test_a_then_callback_that_raises_completes_its_future():
    source = dtorch_ops.TensorPromise()

    def raise_exception(unused):
        raise RuntimeError("Intentional error")

    derived = source.get_future().then(raise_exception)
    assert not derived.done()
    source.set_value(torch.ones(1))
    assert derived.done()
    with pytest.raises(RuntimeError, match="Intentional"):
        derived.wait()


# ---- many futures: wait_all / collect_all with a timeout, wait_any, as_completed ----

def _pending(n):
    promises = [dtorch_ops.TensorPromise() for _ in range(n)]
    return promises, [p.get_future() for p in promises]


def test_wait_all_and_collect_all_take_a_timeout():
    promises, futures = _pending(3)
    promises[0].set_value(torch.zeros(1))
    started = time.monotonic()
    with pytest.raises(errors.FutureTimeoutError, match=r"wait_all: 2 of 3 futures"):
        dtorch_ops.wait_all(futures, timeout=0.05)
    assert 0.04 <= time.monotonic() - started < 5
    with pytest.raises(errors.FutureTimeoutError):
        dtorch_ops.wait_all(futures, timeout_ms=20)
    collected = dtorch_ops.collect_all(futures, timeout=0.1)
    with pytest.raises(errors.FutureTimeoutError, match="collect_all: not every future"):
        collected.wait(timeout=10)  # (failed by the library's timer, no thread of ours)
    assert collected.done()
    for i, promise in enumerate(promises[1:], 1):
        promise.set_value(torch.full((1,), float(i)))
    assert [float(v) for v in dtorch_ops.wait_all(futures, timeout=5)] == [0.0, 1.0, 2.0]
    assert all(f.valid() for f in futures)
    in_time = dtorch_ops.collect_all(futures, timeout=5)
    assert len(in_time.wait(timeout=5)) == 3


def test_wait_all_names_itself_in_its_errors():
    with pytest.raises(TypeError, match=r"dtorch_ops.wait_all takes"):
        dtorch_ops.wait_all([1])
    with pytest.raises(TypeError, match=r"wait_all takes a list of futures, got one future"):
        dtorch_ops.wait_all(dtorch_ops.TensorPromise().get_future())


def test_wait_any_returns_the_done_and_the_pending():
    promises, futures = _pending(3)
    done, pending = dtorch_ops.wait_any(futures, timeout=0.02)  # none: returns, no raise
    assert done == [] and pending == futures

    def later():
        time.sleep(0.1)
        promises[1].set_value(torch.ones(1))

    thread = threading.Thread(target=later)
    thread.start()
    done, pending = dtorch_ops.wait_any(futures)  # no limit
    thread.join()
    assert done == [futures[1]] and pending == [futures[0], futures[2]]
    torch_future = torch.futures.Future()
    promises[0].set_exception(ValueError("x"))
    done, pending = dtorch_ops.wait_any([torch_future, futures[0]], timeout=5)
    assert done == [futures[0]] and pending == [torch_future]  # (a failed one is done)


def test_as_completed_yields_in_completion_order_and_times_out():
    promises, futures = _pending(4)
    promises[2].set_value(torch.full((1,), 2.0))
    torch_future = torch.futures.Future()
    order = []

    def produce():
        for i in (3, 0):
            time.sleep(0.05)
            promises[i].set_value(torch.full((1,), float(i)))
        torch_future.set_result(9)

    watched = [futures[0], futures[2], futures[3], futures[2], torch_future]  # (one twice)
    iterator = dtorch_ops.as_completed(watched, timeout=10)  # (subscribed before any completes)
    thread = threading.Thread(target=produce)
    thread.start()
    for future in iterator:
        order.append(future)
    thread.join()
    assert order == [futures[2], futures[3], futures[0], torch_future]  # (futures[1] below)
    iterator = dtorch_ops.as_completed([futures[1]], timeout=0.05)
    with pytest.raises(errors.FutureTimeoutError, match=r"1 \(of 1\) futures unfinished"):
        next(iterator)


def test_as_completed_counts_its_timeout_from_the_call():
    promises, futures = _pending(1)
    iterator = dtorch_ops.as_completed(futures, timeout=0.1)
    time.sleep(0.15)
    started = time.monotonic()
    with pytest.raises(errors.FutureTimeoutError):
        next(iterator)
    assert time.monotonic() - started < 0.05


# ---- raw TorchScript methods ----

@torch.jit.script
def _scripted_waits(x: torch.Tensor) -> torch.Tensor:
    fut = torch.ops.dtorch.get_tensor_async(x * 2)
    first = fut.wait()
    again = fut.wait(1000)
    assert fut.valid()
    taken = fut.get()
    assert fut.done() and fut.is_ready() and not fut.valid()
    return first + again + taken + fut.wait()


def test_raw_wait_without_a_timeout_and_done_after_get():
    assert torch.equal(_scripted_waits(torch.ones(2)), torch.full((2,), 8.0))
    raw = torch.ops.dtorch.sync()
    raw.wait()
    raw.get()
    assert raw.done() and not raw.valid()


def test_waits_in_a_polling_loop_register_one_callback_per_future():
    """wait_any / as_completed / exception() in a loop share each future's one completion
    callback (its fanout) instead of adding one per call."""
    promises, futures = _pending(2)
    torch_future = torch.futures.Future()
    watched = futures + [torch_future]
    for _ in range(2000):
        done, pending = dtorch_ops.wait_any(watched, timeout=0)
        assert done == []
    fanouts = [f._fanout for f in futures]
    with pytest.raises(errors.FutureTimeoutError):
        futures[0].exception(timeout=0)
    assert [f._fanout for f in futures] == fanouts  # the same objects: registered once
    promises[1].set_value(torch.ones(1))
    done, pending = dtorch_ops.wait_any(watched, timeout=5)
    assert done == [futures[1]] and pending == [futures[0], torch_future]
    torch_future.set_result(3)
    assert dtorch_ops.wait_any([torch_future], timeout=5)[0] == [torch_future]
