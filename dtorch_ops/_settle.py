"""Completing a future with what another gave: the settle(ok, value) callables that fulfil a
pending ObjectFuture or a _C promise once, with a value or an error."""
from __future__ import annotations

import threading

import torch

from . import _C
from ._script_objects import _a
from .errors import FutureError

_Tensor = torch.Tensor


def _unpack(result):
    ok, value = result
    if ok:
        return value
    raise value


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _pending_object_future(future: ObjectFuture, timeout_ms=None, what="", adopt_tensor=None):
    """Makes `future` pending; returns settle(ok, value), which completes it once. With
    timeout_ms, it fails with FutureTimeoutError if not settled by then (what: the message).
    adopt_tensor (the TensorFuture class): a tensor value makes `future` a TensorFuture of it
    (its class and handle changed before it completes, so that whoever it wakes sees that)."""
    # (Adoption is then()'s, which sets no timeout: a timer could complete the future between
    # the adoption and the completion below, leaving a timed-out future that reads as a value.)
    assert adopt_tensor is None or timeout_ms is None
    promise = _C.VoidPromise("memory")
    completion = future._h = promise.get_future()
    future._result = None
    lock = threading.Lock()
    timer = None if timeout_ms is None else _C.fail_after(promise, timeout_ms, what)

    def settle(ok, value):
        with lock:  # (one settle at a time; the timeout's timer may complete it meanwhile)
            if completion.is_ready():
                return  # (timed out, or settled already)
            adopted = _adopted_handle(value) if adopt_tensor is not None and ok else None
            future._result = (ok, value)
            if adopted is not None:
                # The handle first: a method of the class it has until the next line takes
                # either handle (WithHandleOf in csrc/python/module.cpp).
                future._h = adopted
                future.__class__ = adopt_tensor
            try:
                promise.set_value()
            except FutureError:
                return  # (the timeout came first: the future raises it, not this result)
        if timer is not None:
            timer.cancel()  # (released now, not at its deadline)

    return settle


def _adopted_handle(value):
    """A complete TensorFuture handle of `value`, for a then() future adopting its tensor result;
    None for what a memory TensorPromise does not take (not a tensor; a DTensor), which that
    future keeps as an ObjectFuture's value."""
    if not isinstance(value, _Tensor):
        return None
    promise = _C.TensorPromise("memory")
    handle = promise.get_future()
    try:
        promise.set_value(value)
    except Exception:  # noqa: BLE001 (refused: the value stays the ObjectFuture's)
        return None
    return handle


def _promise_settler(promise, source: str):
    """settle(ok, value) completing a _C TensorPromise / VoidPromise with what `source` gave."""

    def settle(ok, value):
        if not ok:
            promise.set_exception(f"{source} failed: {_describe(value)}")
        elif isinstance(promise, _C.VoidPromise):
            promise.set_value()
        elif isinstance(value, _Tensor):
            promise.set_value(value)
        else:
            promise.set_exception(f"{source} gave {_a(type(value).__name__)}, not a tensor")

    return settle


def _call_and_settle(fn, arg, settle) -> None:
    """settle(True, fn(arg)), or settle(False, the exception fn raised): any exception, so that
    the settled future never stays pending."""
    try:
        value = fn(arg)
    except BaseException as e:
        settle(False, e)
    else:
        settle(True, value)


def _settle_when_done(source, settle) -> None:
    """settle(ok, value) with source's value or error once source (ours, or a
    torch.futures.Future) completes."""
    source.add_done_callback(lambda done: _call_and_settle(type(done).value, done, settle))
