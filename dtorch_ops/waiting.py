"""Waits over several futures (dtorch_ops futures and torch.futures.Future objects):
collect_all, wait_all, wait_any and as_completed."""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import torch

from . import _C
from ._script_objects import _script_name
from ._settle import _pending_object_future
from .errors import FutureTimeoutError
from .futures import ObjectFuture, _TorchFuture, _Waitable, _completion_queue, _describe_timeout

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator
    from typing import Any, TypeVar

    # A future of dtorch_ops, or a torch.futures.Future.
    _F = TypeVar("_F", bound="_Waitable | torch.futures.Future[Any]")

_new = object.__new__


def _check_future(future, what: str) -> None:
    if not isinstance(future, (_Waitable, _TorchFuture)):
        raise TypeError(
            f"dtorch_ops.{what} takes dtorch_ops futures or torch.futures.Future objects, got "
            f"{_script_name(future)}" + (" (wrap a raw one: dtorch_ops.TensorFuture(raw))"
                                         if isinstance(future, torch.ScriptObject) else ""))


def _future_list(futures, what: str) -> list:
    if isinstance(futures, (_Waitable, _TorchFuture, torch.ScriptObject)):
        raise TypeError(f"dtorch_ops.{what} takes a list of futures, got one future: pass "
                        f"[future]")
    try:
        futures = list(futures)
    except TypeError:
        raise TypeError(f"dtorch_ops.{what} takes a list of futures, got "
                        f"{type(futures).__name__}") from None
    for future in futures:
        _check_future(future, what)
    return futures


def collect_all(futures: Iterable[_Waitable | torch.futures.Future[Any]],
                timeout: float | None = None, *, timeout_ms: float | None = None) -> ObjectFuture:
    """An ObjectFuture yielding the list of `futures` once all have completed, as
    ``torch.futures.collect_all``; as there, it fails as soon as one of them fails, with that
    future's error. Takes dtorch_ops futures and ``torch.futures.Future`` objects; awaitable.
    Consumes none of them: read each with ``value()``.

    timeout (seconds) or timeout_ms=: the collected future fails with FutureTimeoutError if they
    are not all complete by then (a timer of the library's pool, no thread per call)."""
    futures = _future_list(futures, "collect_all")
    return _collect_all(futures, _C.timeout_ms_of("collect_all", timeout, timeout_ms),
                        _describe_timeout(timeout, timeout_ms))


def _collect_all(futures: list, limit, timeout_text: str) -> ObjectFuture:
    """collect_all of checked futures; `limit`: its timeout in ms (None: none), as timeout_text
    says it."""
    collected = _new(ObjectFuture)
    remaining = [len(futures)]
    settle = _pending_object_future(
        collected, None if limit is None or not futures else limit,
        f"collect_all: not every future was complete within {timeout_text}; the futures are "
        f"still valid")
    lock = threading.Lock()  # callbacks run on the threads that complete the futures

    def one_done(future):
        try:
            future.value()
        except BaseException as e:
            error = e
        else:
            error = None
        with lock:
            if remaining[0] == 0:
                return  # (settled: an earlier one failed)
            remaining[0] = 0 if error is not None else remaining[0] - 1
            last = remaining[0] == 0
        if last:
            settle(error is None, futures if error is None else error)

    if not futures:
        settle(True, futures)
    for future in futures:
        future.add_done_callback(one_done)
    return collected


def wait_all(futures: Iterable[_Waitable | torch.futures.Future[Any]],
             timeout: float | None = None, *, timeout_ms: float | None = None) -> list[Any]:
    """Waits for every future of `futures` and returns their values in order, as
    ``torch.futures.wait_all``: as soon as one fails, raises its error without waiting for the
    others. The futures are not consumed (``value()``). Blocks with the GIL released; in a
    coroutine, ``await collect_all(futures)`` instead.

    timeout (seconds) or timeout_ms=: past it, raises FutureTimeoutError (the futures stay as
    they are)."""
    futures = _future_list(futures, "wait_all")
    limit = _C.timeout_ms_of("wait_all", timeout, timeout_ms)
    collected = _collect_all(futures, None, "")
    try:
        collected._h.wait(limit)
    except FutureTimeoutError:
        pending = sum(1 for f in futures if not f.done())
        raise FutureTimeoutError(
            f"dtorch: timed out: wait_all: {pending} of {len(futures)} futures were not complete "
            f"within {_describe_timeout(timeout, timeout_ms)}; the futures are still valid"
        ) from None
    collected.get()  # (raises the first error)
    return [future.value() for future in futures]


def wait_any(futures: Iterable[_F], timeout: float | None = None, *,
             timeout_ms: float | None = None) -> tuple[list[_F], list[_F]]:
    """Blocks until at least one of `futures` is complete, as ``concurrent.futures.wait(...,
    return_when=FIRST_COMPLETED)`` and ``ray.wait``: returns ``(done, pending)``, two lists in
    the order of `futures` (done: those complete when it returns, failed ones included). Past the
    timeout (seconds; or timeout_ms=) returns with those done by then (possibly none); it does not
    raise. Consumes nothing; the GIL is released; no thread per future."""
    futures = _future_list(futures, "wait_any")
    limit = _C.timeout_ms_of("wait_any", timeout, timeout_ms)
    if futures and not any(f.done() for f in futures):
        _completion_queue(futures).pop(limit)
    done = [f for f in futures if f.done()]
    return done, [f for f in futures if not f.done()]


def as_completed(futures: Iterable[_F], timeout: float | None = None, *,
                 timeout_ms: float | None = None) -> Iterator[_F]:
    """Yields `futures` as they complete (as ``concurrent.futures.as_completed``): those complete
    already first, then each as it completes; a future listed twice is yielded once. The timeout
    (seconds; or timeout_ms=) counts from this call: when it has passed with futures still
    pending, the iterator raises FutureTimeoutError (a TimeoutError). Read each with value() or
    get(); the GIL is released while waiting; no thread per future."""
    futures = _future_list(futures, "as_completed")
    limit = _C.timeout_ms_of("as_completed", timeout, timeout_ms)
    unique = list({id(f): f for f in futures}.values())
    queue = _completion_queue(unique)
    deadline = None if limit is None else time.monotonic() + limit / 1000

    def iterate():
        for count in range(len(unique)):
            left = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            index = queue.pop(left)
            if index is None:
                raise FutureTimeoutError(
                    f"dtorch: timed out: as_completed: {len(unique) - count} (of {len(unique)}) "
                    f"futures unfinished after {_describe_timeout(timeout, timeout_ms)}")
            yield unique[index]

    return iterate()
