"""The Python API: plain Python classes over the direct binding (dtorch_ops._C).

Each future or promise holds ``_h``, a handle of the ``_C`` module to the C++ object, which every
method calls directly (one call each), and gives ``.raw``, the TorchScript object
(``torch.classes.dtorch.*``) of the very same C++ state, for TorchScript and ``torch.ops`` calls.
Inside ``torch.compile`` the functions keep to the ops, which Dynamo can trace.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import sys
import threading
import time
import weakref

import torch

from . import _C, _graph_ops
from ._on_import import register_on_import
from .config import config
from .errors import FutureError, FutureTimeoutError, _exception_parts

_Tensor = torch.Tensor
# torch.futures.Future's base class (RPC's futures are instances too).
_TorchFuture = torch._C.Future
# Both are folded to True by Dynamo while it traces. is_compiling is also True under torch.export's
# non-strict tracing (no Dynamo: graph breaks do not exist there); is_dynamo_compiling is cheaper.
_is_compiling = torch.compiler.is_compiling
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling
_new = object.__new__

# The ops, for compiled code (Dynamo traces torch.ops, not the _C binding).
_get_tensor_op = torch.ops.dtorch.get_tensor.default
_get_tensor_async_op = torch.ops.dtorch.get_tensor_async.default
_copy_to_host_async_op = torch.ops.dtorch.copy_to_host_async.default
_copy_list_to_host_async_op = torch.ops.dtorch.copy_list_to_host_async.default
_sync_op = torch.ops.dtorch.sync.default
_sync_wait_op = torch.ops.dtorch.sync_wait.default
_sync_into_op = torch.ops.dtorch.sync_into.default


class _LoopWaker:
    """One per asyncio loop: the loop watches a ReadyNotifier's eventfd; completing futures post
    their waiter's token to it from whatever thread completes them, without taking the GIL."""

    __slots__ = ("notifier", "waiters", "_tokens", "__weakref__")

    def __init__(self, loop):
        self.notifier = _C.ReadyNotifier()
        # token -> asyncio.Future, touched only on the loop's thread. Weak: a waiter lives as long
        # as the dtorch future's wrapper (or a task awaiting it) holds it, so neither a closed loop
        # with pending awaits nor an abandoned future is kept alive from here.
        self.waiters = weakref.WeakValueDictionary()
        self._tokens = itertools.count()
        loop.add_reader(self.notifier.fileno(), self._drain)

    def register(self, loop):
        token = next(self._tokens)
        waiter = self.waiters[token] = loop.create_future()
        return token, waiter

    def _drain(self):
        for token in self.notifier.drain():
            waiter = self.waiters.pop(token, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)


# Weakly keyed: a loop that is gone takes its waker, and with it the eventfd (pending futures hold
# the notifier weakly), along.
_loop_wakers: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopWaker]" = (
    weakref.WeakKeyDictionary()
)


_loop_wakers_lock = threading.Lock()  # event loops may run on several threads


def _waker_for(loop) -> _LoopWaker:
    waker = _loop_wakers.get(loop)
    if waker is None:
        with _loop_wakers_lock:
            # A new loop: release the eventfds of closed ones now, rather than when (or if) the
            # garbage collector frees them (asyncio.run per request would otherwise pile them up).
            for old in [old for old in _loop_wakers.keys() if old.is_closed()]:
                _loop_wakers.pop(old, None)
            waker = _loop_wakers[loop] = _LoopWaker(loop)
    return waker


async def _await_ready(waitable) -> None:
    """Suspends until waitable is ready: woken by the completion itself, no polling, no thread.
    One registration per (future, loop), however often the await is cancelled and retried
    (asyncio.wait_for with a timeout in a loop, say)."""
    handle = waitable._h
    if handle.is_ready():
        return
    loop = asyncio.get_running_loop()
    pending = getattr(waitable, "_pending", None)
    if pending is None or pending.get_loop() is not loop or pending.done():
        waker = _waker_for(loop)
        token, pending = waker.register(loop)
        handle.notify_when_ready(waker.notifier, token)
        waitable._pending = pending
    # Shielded: cancelling this await leaves the registration for the next one.
    await asyncio.shield(pending)


def _handle_from_script(handle_class, obj):
    """The _C handle of `obj` if it is a raw dtorch object of handle_class's class, else None
    (each caller words its own TypeError)."""
    if not isinstance(obj, torch.ScriptObject):
        return None
    try:
        return handle_class.from_script(obj)
    except TypeError:
        return None


def _a(name: str) -> str:
    """`name` with its article: "an ObjectFuture", "a TensorFuture"."""
    return ("an " if name[:1].lower() in "aeiou" else "a ") + name


def _script_name(obj) -> str:
    """'torch.classes.dtorch.X' for a raw dtorch object, else the Python type's name."""
    if isinstance(obj, torch.ScriptObject):
        return obj._type().qualified_name().replace("__torch__.", "")
    return type(obj).__name__


def _check_local_tensor(t, what: str) -> None:
    if not isinstance(t, _Tensor):
        raise TypeError(f"dtorch_ops.{what} expects a torch.Tensor, got {type(t).__name__}")
    if _is_dtensor(t):
        raise TypeError(
            f"dtorch_ops.{what} expects a local tensor, got a DTensor: pass t.to_local() "
            "(or t.full_tensor()) instead"
        )


def _is_dtensor(t) -> bool:
    # No DTensor can exist before its module is imported; importing it here would cost ~0.6 s.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _is_tracing_tensor(t) -> bool:
    """FakeTensor / FunctionalTensor: stand-ins of tracing, dispatched through their modes."""
    for name, cls in (("torch._subclasses.fake_tensor", "FakeTensor"),
                      ("torch._subclasses.functional_tensor", "FunctionalTensor")):
        module = sys.modules.get(name)
        if module is not None and isinstance(t, getattr(module, cls)):
            return True
    return False


def _defines_torch_dispatch(t) -> bool:
    """A tensor subclass with its own __torch_dispatch__ (a wrapper such as TwoTensor; not an
    nn.Parameter). Written so that Dynamo evaluates it on the traced tensor's type."""
    return type(t) is not _Tensor and type(t).__torch_dispatch__ is not _Tensor.__torch_dispatch__


def _fake_mode_active() -> bool:
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def _tracing_here() -> bool:
    """Whether this thread traces without Dynamo (torch.export's non-strict mode runs the module's
    Python under a fake or proxy mode, which are per thread). is_compiling() alone will not do: it
    is a process-wide flag, True in every thread while any thread compiles."""
    modes = torch._C._TorchDispatchModeKey
    return (torch._C._get_dispatch_mode(modes.FAKE) is not None
            or torch._C._get_dispatch_mode(modes.PROXY) is not None)


def _above_subclass(t, what: str) -> bool:
    """For a tensor that is not exactly torch.Tensor: checks it, and says whether our op must run
    above its __torch_dispatch__ (a wrapper subclass: the future then yields the subclass itself,
    not what its dispatch would pass on)."""
    _check_local_tensor(t, what)
    return (torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python)
            and not _is_tracing_tensor(t))


def _script_object_of(handle_owner):
    """The `raw` of a future or promise: the TorchScript object of its handle's state, made on
    first use and kept (a graph break under Dynamo, which cannot trace the binding)."""
    if _is_dynamo_compiling():
        return _InGraphEagerly.get_member(handle_owner, "raw")
    raw = getattr(handle_owner, "_raw", None)
    if raw is None:
        raw = handle_owner._raw = handle_owner._h.script()
    return raw


class _Waitable(metaclass=_graph_ops.opaque_metaclass()):
    """get / wait / is_ready / valid / await over a handle (its class: _HANDLE).

    The metaclass lets the future classes be torch.compile opaque reference types
    (dtorch_ops/_graph_ops.py), so compiled graphs can create and return them.
    """

    # __weakref__: tracing keeps opaque objects in weak dictionaries. _fanout: the one completion
    # callback the waits over several futures share (_fanout_of).
    __slots__ = ("_h", "_raw", "_pending", "_fanout", "__weakref__")
    _HANDLE = None
    _PRODUCED_BY = ""
    # torch.futures.Future -> a handle of _HANDLE completed by it (None: not adoptable).
    _ADOPT = None

    def __init__(self, raw):
        """Wraps a raw future (a torch.classes.dtorch object, e.g. an op's result); the wrapper
        and the raw object share one state. A torch.futures.Future (an RPC future, say) is
        adopted: this future completes with its value or error when it does."""
        # (ScriptObject first: the opaque metaclass makes isinstance() slow for non-instances.)
        if not isinstance(raw, torch.ScriptObject):
            if isinstance(raw, type(self)):
                self._h = raw._h
                return
            if isinstance(raw, _TorchFuture) and self._ADOPT is not None:
                self._h = type(self)._ADOPT(raw)
                return
        handle = _handle_from_script(self._HANDLE, raw)
        if handle is None:
            adopts = " or a torch.futures.Future" if self._ADOPT is not None else ""
            raise TypeError(
                f"dtorch_ops.{type(self).__name__} wraps a torch.classes.dtorch."
                f"{self._HANDLE.__name__} (the result of {self._PRODUCED_BY}){adopts}, got "
                f"{_script_name(raw)}"
            )
        self._h = handle
        self._raw = raw

    @classmethod
    def _wrap(cls, handle):
        """Wraps a handle of the _C module (the hot path: no checks)."""
        future = _new(cls)
        future._h = handle
        return future

    @classmethod
    def _from_op(cls, raw):
        """Wraps an op's raw result in compiled code, where Dynamo cannot trace the binding: the
        handle is looked up on first use (__getattr__), after the graph."""
        future = _new(cls)
        future._raw = raw
        return future

    def __getattr__(self, name):
        # Only reached for an unset slot: the handle of a future made by _from_op.
        if name != "_h":
            raise AttributeError(name)
        handle = self._h = self._HANDLE.from_script(self._raw)
        return handle

    raw = property(_script_object_of, doc=(
        "The TorchScript object of the same state (for TorchScript and torch.ops calls)."))

    # get(), wait(timeout_ms=None, *, timeout=None), result(timeout=None), value(), is_ready(),
    # done(), valid() and add_done_callback() are C++ methods installed by the binding
    # (_C.install_wait_methods, below the classes).

    def exception(self, timeout=None, *, timeout_ms=None):
        """concurrent.futures.Future.exception(): waits like result() (timeout in seconds, or
        timeout_ms=) and returns the future's error (what get() would raise), or None when it
        holds a value; past the timeout raises FutureTimeoutError. Consumes nothing."""
        if _is_dynamo_compiling():
            return _InGraphEagerly.call_member(self, "exception", timeout,
                                               timeout_ms=timeout_ms)  # a graph break
        limit = _C.timeout_ms_of("exception", timeout, timeout_ms)
        # Waited for without reading its outcome: a wait's own error (a timeout, Ctrl-C) is
        # raised, the future's is returned.
        if not self._h.is_ready() and _completion_queue([self]).pop(limit) is None:
            raise FutureTimeoutError(
                f"dtorch: timed out: exception(): the future was not complete within "
                f"{_describe_timeout(timeout, timeout_ms)}; it is still valid, wait again")
        try:
            self.value()
        except BaseException as e:  # noqa: BLE001 (the future's error, whatever its type)
            return e
        return None

    def then(self, callback):
        """Returns a new future of ``callback(self)``'s result, called once this future is
        complete (as ``torch.futures.Future.then``); the callback reads this future's value with
        ``value()``, which raises its error, if any.

        The new future is a ``TensorFuture`` when the callback is annotated to return a tensor
        (``def f(fut) -> torch.Tensor``), else an ``ObjectFuture``. An exception raised by the
        callback fails the new future: an ``ObjectFuture`` raises that very exception, a
        ``TensorFuture`` a ``ProducerError`` naming it. Where the callback runs: see
        ``add_done_callback``.
        """
        if _is_dynamo_compiling():
            return _InGraphEagerly.call_member(self, "then", callback)  # a graph break
        if not callable(callback):
            raise TypeError(f"dtorch: then() needs a callable, got {type(callback).__name__}")
        if _returns_tensor(callback):
            promise = _C.TensorPromise("memory")
            derived = TensorFuture._wrap(promise.get_future())
            settle = _promise_settler(promise, "the then() callback")
        else:
            derived = _new(ObjectFuture)
            settle = _pending_object_future(derived)
        self.add_done_callback(lambda done: _call_and_settle(callback, done, settle))
        return derived

    def to_torch_future(self) -> torch.futures.Future:
        """A ``torch.futures.Future`` that completes with this future's value (or error) when it
        does, for code built on torch.futures and RPC. This future is not consumed."""
        if _is_dynamo_compiling():
            return _InGraphEagerly.call_member(self, "to_torch_future")  # a graph break
        torch_future = torch.futures.Future()

        def settle(ok, value):
            if ok:
                torch_future.set_result(value)
            else:
                torch_future.set_exception(value)

        _settle_when_done(self, settle)
        return torch_future

    def __await__(self):
        """``await future``: suspends the coroutine (not the loop) until the value is ready.

        Woken by the completion itself (no polling). Cancelling the awaiting task leaves the
        future valid. Errors (exception, broken promise) are raised here.
        """
        yield from _await_ready(self).__await__()
        return self._h.get()

    def __reduce__(self):
        raise TypeError(
            f"dtorch: {_a(type(self).__name__)} cannot be pickled or copied; send the promise to "
            "the producer instead"
        )

    def _state(self) -> str:
        if not self._h.valid():
            return "consumed"
        return "ready" if self._h.is_ready() else "pending"


class _Future(_Waitable):
    """A promise's consumer end: also reports its kind."""

    __slots__ = ()

    def kind(self) -> str:
        if _is_dynamo_compiling():
            return _InGraphEagerly.call_member(self, "kind")  # a graph break
        return self._h.kind()

    def __repr__(self) -> str:
        return f"dtorch_ops.{type(self).__name__}(kind={self._h.kind()!r}, {self._state()})"


class TensorFuture(_Future):
    """The consumer's end of a tensor promise/future pair.

    ``TensorFuture(torch.ops.dtorch.get_tensor_async(x))`` wraps an op's raw result.
    ``get()`` consumes the future (``valid()`` is False afterwards), like ``std::future``.
    Blocking calls release the GIL. Thread-safe.
    """

    __slots__ = ()
    _HANDLE = _C.TensorFuture
    _PRODUCED_BY = "torch.ops.dtorch.get_tensor_async"


class TensorListFuture(_Future):
    """Several tensors that arrive together: the host copies of
    ``to_torch_async([loss, acc, lr], device="cpu")``. ``get()`` returns the list (in order);
    otherwise like TensorFuture (consumed by get(), errors raised, awaitable)."""

    __slots__ = ()
    _HANDLE = _C.TensorListFuture
    _PRODUCED_BY = "torch.ops.dtorch.copy_list_to_host_async"


class VoidFuture(_Future):
    """A completion signal without a value: get() and wait() return None. Otherwise like
    TensorFuture (consumed by get(), errors and broken promises raised, awaitable)."""

    __slots__ = ()
    _HANDLE = _C.VoidFuture
    _PRODUCED_BY = "torch.classes.dtorch.VoidPromise.get_future"


class VoidFutureCollect(_Waitable):
    """One VoidFuture per device of a sync, awaited as one (the result of sync_async).

    Ready when every device is; get() raises the error of the first device (in devices() order)
    that failed, naming it. wait(timeout_ms) bounds the wait for all devices together.
    """

    __slots__ = ()
    _HANDLE = _C.VoidFutureCollect
    _PRODUCED_BY = "torch.ops.dtorch.sync"

    def devices(self) -> list[torch.device]:
        if _is_dynamo_compiling():
            return _InGraphEagerly.call_member(self, "devices")  # a graph break
        return list(self._h.devices())

    def __repr__(self) -> str:
        names = ", ".join(str(d) for d in self._h.devices())
        return f"dtorch_ops.VoidFutureCollect([{names}], {self._state()})"


class ObjectFuture(_Waitable):
    """A future of any Python value: what ``then()`` returns when its callback is not annotated
    to return a tensor, and what ``collect_all()`` returns. ``ObjectFuture(torch_future)`` adopts
    a ``torch.futures.Future``.

    The methods of ``TensorFuture``: ``get()`` (consumes), ``value()`` (does not), ``wait``,
    ``is_ready`` / ``done``, ``valid``, ``then``, ``add_done_callback``, ``to_torch_future`` and
    ``await``. A failed one raises the very exception its callback (or adopted future) raised.
    Thread-safe.
    """

    __slots__ = ("_result",)  # (True, value) or (False, exception), set before completion, kept
    _HANDLE = _C.VoidFuture  # the completion; the value stays in Python
    _PRODUCED_BY = "then() or collect_all()"

    def __init__(self, torch_future):
        if not isinstance(torch_future, _TorchFuture):
            raise TypeError("dtorch_ops.ObjectFuture(torch_future) adopts a torch.futures.Future,"
                            f" got {_script_name(torch_future)}")
        _settle_when_done(torch_future, _pending_object_future(self))

    def get(self):
        """Blocks until the value is ready and returns it (or raises the error); consumes the
        future. The GIL is released while waiting."""
        self._h.get()  # waits; raises once consumed, or broken
        return _unpack(self._result)

    def wait(self, timeout_ms=None, *, timeout=None):
        """Blocks until the value is ready and returns it (or raises the error), without
        consuming it. timeout_ms (milliseconds) or timeout= (seconds) bound the wait: past it,
        raises FutureTimeoutError (a TimeoutError)."""
        self._h.wait(timeout_ms, timeout=timeout)
        return _unpack(self._result)

    def result(self, timeout=None, *, timeout_ms=None):
        """concurrent.futures.Future.result(): wait() with the timeout in seconds."""
        self._h.result(timeout, timeout_ms=timeout_ms)
        return _unpack(self._result)

    def value(self):
        """The value of a completed future without consuming it (also after get()), or its
        error raised."""
        self._h.value()  # raises FutureNotReadyError before completion
        return _unpack(self._result)

    def __await__(self):
        yield from _await_ready(self).__await__()
        return self.get()

    @property
    def raw(self):
        raise TypeError("dtorch: an ObjectFuture holds a Python value, which TorchScript cannot "
                        "carry: it has no TorchScript object (then() makes a TensorFuture, which "
                        "has one, when its callback is annotated to return a torch.Tensor)")

    def __repr__(self) -> str:
        return f"dtorch_ops.ObjectFuture({self._state()})"


def _unpack(result):
    ok, value = result
    if ok:
        return value
    raise value


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _pending_object_future(future: ObjectFuture, timeout_ms=None, what=""):
    """Makes `future` pending; returns settle(ok, value), which completes it once. With
    timeout_ms, it fails with FutureTimeoutError if not settled by then (what: the message)."""
    promise = _C.VoidPromise("memory")
    future._h = promise.get_future()
    future._result = None
    lock = threading.Lock()
    timer = None if timeout_ms is None else _C.fail_after(promise, timeout_ms, what)

    def settle(ok, value):
        with lock:  # (one settle at a time; the timeout's timer may complete it meanwhile)
            if future._h.is_ready():
                return  # (timed out, or settled already)
            future._result = (ok, value)
            try:
                promise.set_value()
            except FutureError:
                return  # (the timeout came first: the future raises it, not this result)
        if timer is not None:
            timer.cancel()  # (released now, not at its deadline)

    return settle


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


def _returns_tensor(callback) -> bool:
    """Whether callback is annotated to return a tensor (then() then makes a TensorFuture)."""
    try:  # (Python 3.14 evaluates annotations on access: a parameter's may not resolve)
        annotation = dict(getattr(callback, "__annotations__", None) or {}).get("return")
    except Exception:
        return False
    if isinstance(annotation, str):  # (from __future__ import annotations)
        try:
            annotation = eval(annotation, getattr(callback, "__globals__", {}))  # noqa: S307
        except Exception:  # a name that does not resolve: not known to be a tensor
            return False
    return annotation is _Tensor


def _adopter(promise_class):
    """_ADOPT of a future class: a torch.futures.Future -> a handle completed by it."""

    def adopt(torch_future):
        promise = promise_class("memory")
        handle = promise.get_future()
        _settle_when_done(torch_future,
                          _promise_settler(promise, "the adopted torch.futures.Future"))
        return handle

    return staticmethod(adopt)


TensorFuture._ADOPT = _adopter(_C.TensorPromise)
VoidFuture._ADOPT = _adopter(_C.VoidPromise)

for _cls in (TensorFuture, TensorListFuture, VoidFuture, VoidFutureCollect):
    _C.install_wait_methods(_cls, _cls._HANDLE)
_C.install_wait_methods(ObjectFuture, ObjectFuture._HANDLE, with_values=False)


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


def _describe_timeout(timeout, timeout_ms) -> str:
    return f"{timeout} s" if timeout is not None else f"{timeout_ms} ms"


def collect_all(futures, timeout=None, *, timeout_ms=None) -> ObjectFuture:
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


def wait_all(futures, timeout=None, *, timeout_ms=None) -> list:
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


# torch.futures.Future -> its _C.CompletionFanout (ours keep theirs in a slot); the lock makes
# one fanout per future, of either.
_torch_future_fanouts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_fanouts_lock = threading.RLock()


def _fanout_of(future):
    """The future's one completion callback, shared by every wait over several futures that
    watches it (a wait_any in a polling loop adds no callback per call)."""
    if isinstance(future, _Waitable):
        fanout = getattr(future, "_fanout", None)
        if fanout is None:
            with _fanouts_lock:  # (one fanout per future, also across threads)
                fanout = getattr(future, "_fanout", None)
                if fanout is None:
                    fanout = future._fanout = _C.CompletionFanout.of(future._h)
        return fanout
    with _fanouts_lock:
        fanout = _torch_future_fanouts.get(future)
        if fanout is None:
            fanout = _torch_future_fanouts[future] = _C.CompletionFanout()
            future.add_done_callback(lambda _f, fire=fanout.fire: fire())
    return fanout


def _completion_queue(futures):
    """A _C.CompletionQueue that each of `futures` posts its index to once complete."""
    queue = _C.CompletionQueue()
    for index, future in enumerate(futures):
        _fanout_of(future).subscribe(queue, index)
    return queue


def wait_any(futures, timeout=None, *, timeout_ms=None) -> tuple[list, list]:
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


def as_completed(futures, timeout=None, *, timeout_ms=None):
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


_PROMISE_FORMS = ("The forms that compile: dtorch_ops.get_tensor(t, promise) / sync_into(devices, "
                  "promise) with a promise created outside, or dtorch_ops.to_torch_async(t) / "
                  "sync_async(), which return the future")
_PROMISE_CREATION = ("a graph cannot create a promise. To compile the whole step, create the "
                     "promise outside and pass it in (get_tensor(t, promise) compiles), or use "
                     "dtorch_ops.to_torch_async(t), which compiles and returns the future")


def _kind_spec(name: str, kind: str, options: dict) -> str:
    """A promise kind with its options in the one string TorchScript and C++ take
    ("file://device=cpu"). TensorPromise(kind="file") takes device="cpu" (the consumer receives
    CPU tensors) and zero_copy=True (a CUDA value arrives as the IPC view of the producer's memory,
    not copied)."""
    if kind == "network":
        return _network_spec(name, options)
    if not options:
        return kind
    if name != "TensorPromise" or kind != "file":
        raise TypeError(f"dtorch_ops.{name}(kind={kind!r}) got options {sorted(options)} that "
                        f"this kind does not take")
    unknown = sorted(set(options) - {"device", "zero_copy"})
    if unknown:
        raise TypeError(f"dtorch_ops.TensorPromise(kind='file') takes the options device= and "
                        f"zero_copy=, got {unknown}")
    device, zero_copy = options.get("device"), options.get("zero_copy", False)
    if not isinstance(zero_copy, bool):
        raise TypeError(f"zero_copy must be a bool, got {zero_copy!r}")
    if device is not None and torch.device(device) != torch.device("cpu"):
        raise ValueError(
            f"TensorPromise(kind='file', device=...) takes device='cpu' (the consumer then "
            f"receives CPU tensors), got {device!r}; without device=, a device tensor arrives on "
            f"the same device when this process has it")
    if device is not None and zero_copy:
        raise ValueError("TensorPromise(kind='file'): zero_copy=True shares device memory, "
                         "device='cpu' asks for CPU tensors: pass one of them")
    if device is not None:
        return "file://device=cpu"
    return "file://zero_copy" if zero_copy else "file"


def _store_address(store) -> str:
    """"host:port" of the TCPStore `store` is (or wraps, as a PrefixStore does), or `store` itself
    when it is that string already."""
    if isinstance(store, str):
        return store  # checked by the library
    import torch.distributed as dist

    seen = store
    while isinstance(seen, dist.PrefixStore):
        seen = seen.underlying_store
    if isinstance(seen, dist.TCPStore):
        host = seen.host
        return f"[{host}]:{seen.port}" if ":" in host else f"{host}:{seen.port}"
    raise TypeError(
        f"store= takes a torch.distributed.TCPStore (or a PrefixStore over one, as the default "
        f"group's store is) or its address \"host:port\", got {type(store).__name__}: the "
        f"network kind needs a store that other hosts can reach")


def _network_spec(name: str, options: dict) -> str:
    """"network://host:port[?device=cpu]" from TensorPromise(kind="network", store=...,
    device="cpu")."""
    allowed = {"store", "device"} if name == "TensorPromise" else {"store"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise TypeError(f"dtorch_ops.{name}(kind='network') takes the options "
                        f"{', '.join(sorted(a + '=' for a in allowed))}; got {unknown}")
    if "store" not in options:
        raise TypeError(f"dtorch_ops.{name}(kind='network') needs store=: a "
                        f"torch.distributed.TCPStore (or a PrefixStore over one) or \"host:port\"")
    spec = "network://" + _store_address(options["store"])
    device = options.get("device")
    if device is not None:
        if torch.device(device) != torch.device("cpu"):
            raise ValueError(
                f"TensorPromise(kind='network', device=...) takes device='cpu' (the consumer then "
                f"receives CPU tensors), got {device!r}; without device=, a device tensor arrives "
                f"on the same device type when this process has it")
        spec += "?device=cpu"
    return spec


def _refuse_promise_in_graph(name: str) -> None:
    """Called where is_compiling() by a promise's constructor: breaks the graph under Dynamo,
    refuses under export's non-strict tracing, which runs it for real with fake values, and
    returns where another thread is compiling. (Where promises are opaque types, Dynamo breaks
    the graph at the constructor call itself, with its own message to the same effect.)"""
    if _is_dynamo_compiling():
        torch._dynamo.graph_break(msg=f"dtorch_ops.{name}() inside a compiled region runs eagerly "
                                      f"(a graph break): {_PROMISE_CREATION}")
    elif _tracing_here():
        raise RuntimeError(f"dtorch: dtorch_ops.{name}() while tracing (torch.export): "
                           f"{_PROMISE_CREATION}")


def _promise_method_traced(name: str) -> bool:
    """Called where is_compiling() by a promise's method: True under Dynamo (the caller then runs
    the call eagerly through _InGraphEagerly.promise_methods: a graph break), raises under export's
    non-strict tracing, which would run it for real with fake values, and False where another
    thread is compiling (this call is eager)."""
    if _is_dynamo_compiling():
        return True
    if _tracing_here():
        raise RuntimeError(
            f"dtorch: a dtorch_ops promise's {name}() while tracing (torch.export) would act on "
            f"the real promise with traced values and not be part of the program. "
            f"{_PROMISE_FORMS}")
    return False


class _PromiseBase(metaclass=_graph_ops.opaque_metaclass()):
    """set_value once, or set_exception; get_future once; pickling through serialize().

    Opaque types for torch.compile, like the futures (dtorch_ops/_graph_ops.py).
    """

    # __weakref__: tracing keeps opaque objects in weak dictionaries.
    __slots__ = ("_h", "_raw", "__weakref__")
    _HANDLE = None
    _FUTURE = _Waitable

    def __init__(self, kind: str = "memory", **options):
        """kind: "memory" (the pair lives in this process), "file" (the promise can be sent to
        other processes of this host: pickle it, put it in a torch.multiprocessing queue, or
        pass serialize()'s string) or "network" (to processes of other hosts too, through a
        torch.distributed TCPStore: store= is one, a PrefixStore over one, or "host:port").
        Options of a kind are keyword arguments (TensorPromise(kind="file") takes device="cpu"
        and zero_copy=True; kind="network" takes store= and device="cpu")."""
        if _is_compiling():
            _refuse_promise_in_graph(type(self).__name__)
        if isinstance(kind, torch.ScriptObject):  # wrap an existing raw promise
            handle = _handle_from_script(self._HANDLE, kind)
            if handle is None:
                raise TypeError(
                    f"dtorch_ops.{type(self).__name__}(kind) takes a kind ('memory', 'file', "
                    f"'network') or a raw torch.classes.dtorch.{self._HANDLE.__name__} to wrap, "
                    f"got a raw {_script_name(kind)}"
                )
            self._h = handle
            self._raw = kind
            return
        if not isinstance(kind, str):
            raise TypeError(f"kind must be a str ('memory', 'file', 'network'), got {kind!r}")
        self._init_handle(self._HANDLE(_kind_spec(type(self).__name__, kind, options)))

    def _init_handle(self, handle):
        self._h = handle
        if _graph is None:
            # Compiled code passes the raw promise to the ops: made now, as a promise passed
            # into a compiled step must not create objects while Dynamo traces it. (Else made
            # on first use of .raw: compiled code passes this object itself.)
            self._raw = handle.script()

    @classmethod
    def from_serialized(cls, s: str):
        """Rebuilds a promise that another process serialized (serialize(), or pickling).

        The string is checked (format, names, nonce) before anything is opened; a bad one raises
        InvalidHandleError (a ValueError). This process holds the promise from now on: if it
        dies, exits or drops it without setting it, the consumer's future fails (README,
        "Ownership: when a pair breaks"); a handle that names no pair of this user raises at
        first use.
        """
        if not isinstance(s, str):
            raise TypeError(
                f"from_serialized expects the str from serialize(), got {type(s).__name__}")
        promise = _new(cls)
        promise._init_handle(cls._HANDLE.from_serialized(s))
        return promise

    raw = property(_script_object_of, doc=(
        "The TorchScript object of the same state (for TorchScript and torch.ops calls)."))

    def get_future(self):
        """The consumer's end; a promise has exactly one future."""
        if _is_compiling() and _promise_method_traced("get_future"):
            return _InGraphEagerly.promise_methods["get_future"](self)
        return self._FUTURE._wrap(self._h.get_future())

    def set_exception(self, exception) -> None:
        """Fails the future with `exception`, as torch.futures.Future.set_exception: in this
        process its get() / wait() / value() / await raise that very exception object; in
        another process (file, network) its type's name, message and traceback travel, and the
        consumer raises the same built-in type (ValueError, KeyError, RuntimeError, ...) or a
        ProducerError naming the type, with the producer's traceback as a note. A str (or any
        other object) fails it with a ProducerError carrying that message. A second set raises
        PromiseAlreadySatisfiedError."""
        if _is_compiling() and _promise_method_traced("set_exception"):
            return _InGraphEagerly.promise_methods["set_exception"](self, exception)
        if isinstance(exception, type) and issubclass(exception, BaseException):
            exception = exception()
        if isinstance(exception, BaseException):
            self._h.set_exception_object(exception, *_exception_parts(exception))
        else:
            self._h.set_exception(str(exception))

    @contextlib.contextmanager
    def fulfilling(self):
        """``with promise.fulfilling(): ...``: if the block raises, the promise is failed with
        that exception (its traceback text travels with it to a consumer in another process) and
        the exception goes on. The worker's idiom::

            with promise.fulfilling():
                model = load_model()                    # a failure here reaches the consumer
                dtorch_ops.get_tensor(model(x), promise)

        A promise the block has set already keeps its value."""
        try:
            yield self
        except BaseException as e:
            try:
                self.set_exception(e)
            except FutureError:
                pass  # (set already, or failed by its consumer: nothing more to tell)
            raise

    def kind(self) -> str:
        if _is_dynamo_compiling():
            return _InGraphEagerly.call_member(self, "kind")  # a graph break
        return self._h.kind()

    def serialize(self) -> str:
        """A string another process can pass to from_serialized (file promises); memory
        promises raise CannotLeaveProcessError (a TypeError)."""
        if _is_dynamo_compiling():
            return _InGraphEagerly.call_member(self, "serialize")  # a graph break
        return self._h.serialize()

    def __reduce__(self):
        return (type(self).from_serialized, (self.serialize(),))

    def __repr__(self) -> str:
        return f"dtorch_ops.{type(self).__name__}(kind={self._h.kind()!r})"


class TensorPromise(_PromiseBase):
    """The producer's end: ``set_value(t)`` once, or ``set_exception(message)``.

    ``kind="memory"`` pairs live in one process; the future yields the tensor itself.
    ``kind="file"`` promises travel to other processes of this host (pickle, queues, Process
    arguments, serialize()); a CPU value is copied into shared memory when it is set and the
    future yields a view of that copy. A device value is snapshotted on its stream when it is set
    and published once that copy is done: the consumer receives it on the same device (CUDA: a
    copy in its own memory, through CUDA IPC; ``zero_copy=True``: the IPC view itself), or on the
    CPU with ``device="cpu"`` or where it lacks that device (README, "Device tensors"). Destroying a promise without setting it makes its future fail with
    "broken promise" (across processes: see the README). Thread-safe.
    """

    __slots__ = ()
    _HANDLE = _C.TensorPromise
    _FUTURE = TensorFuture

    @classmethod
    def for_tensor(cls, t: torch.Tensor, per_device_per_process: bool | None = None):
        """A promise of the kind promise_kind_for(t) advises."""
        return cls(promise_kind_for(t, per_device_per_process))

    def set_value(self, t: torch.Tensor) -> None:
        """Fulfils the promise with t (memory: no copy; file: copied now, or for a device tensor
        snapshotted on its stream now and published once that copy is done). A second set
        raises PromiseAlreadySatisfiedError; the first value stays."""
        if _is_compiling() and _promise_method_traced("set_value"):
            return _InGraphEagerly.promise_methods["set_value"](self, t)
        if type(t) is not _Tensor:
            _check_refused(t, "TensorPromise.set_value", self._h)
        self._h.set_value(t)


class VoidPromise(_PromiseBase):
    """A completion signal's producer end: ``set_value()`` once, or ``set_exception(message)``
    (``sync_into`` fulfils one when devices are done). Thread-safe."""

    __slots__ = ()
    _HANDLE = _C.VoidPromise
    _FUTURE = VoidFuture

    def set_value(self) -> None:
        """Signals completion. A second set raises."""
        if _is_compiling() and _promise_method_traced("set_value"):
            return _InGraphEagerly.promise_methods["set_value"](self)
        self._h.set_value()


# The ops that create futures and fulfil promises inside compiled graphs; None on a torch without
# opaque types (promises then carry their TorchScript object from birth, for the raw ops).
_graph = _graph_ops.define(TensorFuture, TensorListFuture, VoidFutureCollect, TensorPromise,
                          VoidPromise, _C)


def _check_refused(t, what: str, handle) -> None:
    """_check_local_tensor(t, what); a value it refuses also fails the promise (its handle), so
    that a consumer in another process learns why no value comes."""
    try:
        _check_local_tensor(t, what)
    except TypeError as e:
        try:
            handle.set_exception(f"{what.rsplit('.', 1)[-1]} in the producer (pid {os.getpid()}) "
                                 f"refused the value: {e}")
        except FutureError:
            pass  # (set already, or its pair gone)
        raise


def run_into(promise, fn, *args, **kwargs):
    """Calls ``fn(*args, **kwargs)`` and fulfils `promise` with its result: a tensor through
    ``get_tensor`` (a TensorPromise: ready once the device work producing it is done), nothing
    for a VoidPromise (set when fn returns). If fn raises, the promise fails with that exception
    (``promise.fulfilling()``) and the exception goes on. Returns fn's result."""
    if not isinstance(promise, _PromiseBase):
        raise TypeError(f"dtorch_ops.run_into takes a dtorch_ops.TensorPromise or VoidPromise, "
                        f"got {_script_name(promise)}"
                        + (" (wrap a raw one: dtorch_ops.TensorPromise(raw))"
                           if isinstance(promise, torch.ScriptObject) else ""))
    with promise.fulfilling():
        result = fn(*args, **kwargs)
        if isinstance(promise, VoidPromise):
            promise.set_value()
        else:
            get_tensor(result, promise)
    return result


def _register_holders(obj, depth: int = 0, budget=None) -> None:
    """Registers this process as a holder of the cross-process promises in `obj` (a forked
    multiprocessing child's arguments: it received them without deserializing them), looking
    into lists, tuples, sets and dicts a few levels deep."""
    if budget is None:
        budget = [10_000]
    budget[0] -= 1
    if budget[0] < 0 or depth > 4:
        return
    if isinstance(obj, _PromiseBase):
        if obj._h.kind() != "memory":
            obj._h.register_holder()
    elif isinstance(obj, torch.ScriptObject):
        for wrapper in (TensorPromise, VoidPromise):
            handle = _handle_from_script(wrapper._HANDLE, obj)
            if handle is not None and handle.kind() != "memory":
                handle.register_holder()
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for item in obj:
            _register_holders(item, depth + 1, budget)
    elif isinstance(obj, dict):
        for item in obj.values():
            _register_holders(item, depth + 1, budget)


def _promise_handle(promise, wrapper=TensorPromise):
    if isinstance(promise, wrapper):
        return promise._h
    handle = _handle_from_script(wrapper._HANDLE, promise)
    if handle is not None:
        return handle
    raise TypeError(
        f"expected a dtorch_ops.{wrapper.__name__} (or a raw torch.classes.dtorch."
        f"{wrapper._HANDLE.__name__}), got {_script_name(promise)}"
    )


def _traced_promise(promise, wrapper=TensorPromise):
    """The object to pass to the raw op in traced code: the wrapper's raw promise, else what was
    passed (a raw promise is a stand-in while tracing; the op's schema checks its class)."""
    if not isinstance(promise, wrapper):
        return promise
    # A wrapper gets here only where promises are not opaque types: it made its raw object at
    # construction, a slot Dynamo reads (.raw would break the graph).
    return promise._raw


def _opaque_promise(promise, wrapper) -> bool:
    """Whether traced code (Dynamo, or torch.export's non-strict tracing) passes a wrapper promise
    to the graph op as it is: a program input, not a constant object baked into the program."""
    return _graph is not None and isinstance(promise, wrapper)


def get_tensor(t: torch.Tensor, promise) -> None:
    """Fulfils promise with t once the work producing t on its current stream is done.

    Returns at once. Usable inside torch.compile'd code with a promise created outside.
    """
    if _is_compiling():
        _check_local_tensor(t, "get_tensor")
        if _opaque_promise(promise, TensorPromise):
            _graph.get_tensor(t, promise)
        else:
            _get_tensor_op(t, _traced_promise(promise))
    elif _fake_mode_active() or _is_tracing_tensor(t):
        # Eagerly, under a FakeTensorMode made by hand: the fake kernel would leave the promise
        # unfulfilled for good. (The raw op cannot tell this from AOTAutograd's own fake passes.)
        raise RuntimeError(
            "dtorch: get_tensor ran under a FakeTensorMode (or with a fake tensor) outside "
            "torch.compile/torch.export: fake tensors have no value, so the promise would never "
            "be fulfilled; call get_tensor with a real tensor, outside FakeTensorMode")
    elif type(t) is _Tensor:
        _C.get_tensor(t, _promise_handle(promise))
    else:
        handle = _promise_handle(promise)
        _check_refused(t, "get_tensor", handle)
        _C.get_tensor(t, handle, _above_subclass(t, "get_tensor"))


def to_torch_async(t, device=None):
    """Returns at once a future that yields t (aliased, no copy) when the work producing it is
    done. On CPU the value is ready at once. Inside torch.compile: an ordered op of the graph.

    ``device="cpu"``: the host copy. The future yields a CPU copy of t, made by a non-blocking
    copy into pinned memory (torch's cached pinned allocator) queued on t's current stream, and is
    ready once the copy has landed (an event after it; no device sync, other streams are not
    waited for): a loss to log without ``.item()``'s stall. A CPU tensor is yielded as it is (no
    copy). A list or tuple of tensors is copied with one event per device, and gives one
    ``TensorListFuture`` yielding the list. The values are detached (a tensor that requires grad
    yields one that does not)."""
    if device is not None:
        return _to_host_async(t, device)
    if isinstance(t, (list, tuple)):
        raise TypeError(
            f"dtorch_ops.to_torch_async expects a torch.Tensor, got {type(t).__name__}: a list of "
            "tensors is for the host copy, to_torch_async([...], device='cpu'), which gives one "
            "TensorListFuture")
    if _is_compiling():
        _check_local_tensor(t, "to_torch_async")
        if not (_defines_torch_dispatch(t) and not _is_tracing_tensor(t)):
            if _graph is not None:
                return _graph.to_torch_async(t)
            # A torch without opaque types: the raw op, a graph break, then it runs eagerly.
            return TensorFuture._from_op(_get_tensor_async_op(t))
        # A subclass: a graph would unwrap it before our op runs. Break, and the eager path
        # delivers the subclass itself.
        if _is_dynamo_compiling():
            return _InGraphEagerly.to_torch_async(t)
        if _tracing_here():
            raise RuntimeError(
                "dtorch: to_torch_async on a tensor subclass while tracing (torch.export): the "
                "traced op would see the tensors it wraps, not the subclass; pass a plain tensor")
        # (Else another thread is compiling: this call is eager.)
    if type(t) is _Tensor:
        return TensorFuture._wrap(_C.get_tensor_async(t))
    return TensorFuture._wrap(_C.get_tensor_async(t, _above_subclass(t, "to_torch_async")))


def _to_host_async(t, device):
    if device != "cpu" and _device(device, "to_torch_async").type != "cpu":
        raise ValueError(
            f"dtorch_ops.to_torch_async(t, device=...) copies to the host only: pass "
            f"device='cpu' (or no device, for t itself), got {device!r}")
    many = isinstance(t, (list, tuple))
    tensors = list(t) if many else [t]
    for x in tensors:
        _check_local_tensor(x, "to_torch_async")
        if _defines_torch_dispatch(x) and not _is_tracing_tensor(x):
            raise TypeError(
                f"dtorch_ops.to_torch_async(t, device='cpu') copies plain tensors, got a "
                f"{type(x).__name__} (a tensor subclass): copy the tensors it holds, or pass it "
                "without device= (its future then yields the subclass itself)")
    if _is_compiling():
        if _graph is not None:
            return _graph.to_host_list_async(tensors) if many else _graph.to_host_async(t)
        # A torch without opaque types: the raw op, a graph break, then it runs eagerly.
        if many:
            return TensorListFuture._from_op(_copy_list_to_host_async_op(tensors))
        return TensorFuture._from_op(_copy_to_host_async_op(t))
    if many:
        return TensorListFuture._wrap(_C.copy_list_to_host_async(tensors))
    return TensorFuture._wrap(_C.copy_to_host_async(t))


def to_torch(t, device=None):
    """The blocking form: to_torch_async(t, device).get(). Inside torch.compile a graph break: a
    wait cannot be part of a graph."""
    if _is_dynamo_compiling():
        return _InGraphEagerly.to_torch(t, device)  # a graph break, then the eager path
    return to_torch_async(t, device).get()


class _InGraphEagerly:
    """What compiled code calls to run a call eagerly: torch.compiler.disable'd versions of our
    functions, so that Dynamo breaks the graph at the user's call with the reason given (a plain
    graph break would trace the rest of our function in a resumed frame). Made when torch._dynamo
    is imported (no graph is traced before), as importing it with dtorch_ops would cost ~1 s."""

    to_torch = to_torch_async = call_member = get_member = None
    # A promise's method name -> a caller running promise.<name>(*args) eagerly.
    promise_methods = {}

    @classmethod
    def define(cls, _dynamo_module) -> None:
        disable = torch.compiler.disable

        def promise_method(name):
            return disable(lambda promise, *args: getattr(promise, name)(*args), reason=(
                f"a dtorch_ops promise's {name}() inside a compiled region runs eagerly (a graph "
                f"break). {_PROMISE_FORMS}"))

        cls.promise_methods = {name: promise_method(name)
                               for name in ("get_future", "set_exception", "set_value")}
        waiting = ("waiting on a dtorch_ops future, or asking its state, inside a compiled "
                   "region runs eagerly (a graph break). To compile the whole step, call get() / "
                   "wait() / is_ready() / kind() / .raw outside the compiled function")
        cls.call_member = staticmethod(disable(
            lambda obj, name, *args, **kwargs: getattr(obj, name)(*args, **kwargs),
            reason=waiting))
        cls.get_member = staticmethod(disable(getattr, reason=waiting))
        cls.to_torch = staticmethod(disable(to_torch, reason=(
            "dtorch_ops.to_torch(t) blocks until t's value is ready, which a compiled graph "
            "cannot do: it runs eagerly (a graph break). To compile the whole step, call "
            "dtorch_ops.to_torch_async(t) inside it and get() the future outside")))
        cls.to_torch_async = staticmethod(disable(to_torch_async, reason=(
            "dtorch_ops.to_torch_async on a tensor subclass runs eagerly (a graph break), so "
            "that its future yields the subclass: inside a graph the op would see the tensors "
            "the subclass wraps. Pass a plain tensor to compile it into the graph")))


register_on_import({"torch._dynamo": _InGraphEagerly.define})


def promise_kind_for(t: torch.Tensor, per_device_per_process: bool | None = None) -> str:
    """The promise kind for a pair whose promise a worker fulfils with t.

    CPU tensor -> "memory"; device tensor with per_device_per_process -> "file" (one worker
    process per device); otherwise "memory". per_device_per_process=None takes
    dtorch_ops.config.per_device_per_process.
    """
    _check_local_tensor(t, "promise_kind_for")
    if per_device_per_process is None:
        per_device_per_process = config.per_device_per_process
    if t.device.type == "cpu":
        return "memory"
    return "file" if per_device_per_process else "memory"


def _device(d, what: str) -> torch.device:
    if isinstance(d, torch.device):
        return d
    if isinstance(d, bool) or not isinstance(d, (str, int)):
        raise TypeError(
            f"dtorch_ops.{what}: devices must be a device (a str such as 'cuda:0', a "
            f"torch.device or an int index) or a list of them, got {type(d).__name__} {d!r}"
        )
    try:
        return torch.device(d)
    except RuntimeError as e:
        raise ValueError(f"dtorch_ops.{what}: {d!r} is not a device this process can name "
                         f"({e}); pass e.g. 'cpu' or 'cuda:0'") from None


def _device_list(devices, what: str):
    """None, a device (str, int, torch.device) or a list/tuple of them -> None or [torch.device]."""
    if devices is None:
        return None
    if isinstance(devices, (list, tuple)):
        return [_device(d, what) for d in devices]
    return [_device(devices, what)]


def sync(devices=None) -> None:
    """Blocks (GIL released) until the work queued so far on each device's current stream is done.

    devices: a device, a list of devices, or None for the devices this process has used (the
    accelerators with a context; CPU when there is none). Only the current stream of each device
    is waited for; the device is not synchronised as a whole.
    """
    if _is_compiling():
        # In a graph: the sync_wait op, an ordered effect that compiled code keeps in place.
        _sync_wait_op(_device_list(devices, "sync"))
    else:
        _C.sync_async(_device_list(devices, "sync")).get()


def sync_async(devices=None) -> VoidFutureCollect:
    """Like sync(), but returns at once an awaitable VoidFutureCollect (get / wait / await)."""
    if _is_compiling():
        devices = _device_list(devices, "sync_async")
        if _graph is not None:
            return _graph.sync_async(devices)
        # A torch without opaque types: the raw op, a graph break, then it runs eagerly.
        return VoidFutureCollect._from_op(_sync_op(devices))
    return VoidFutureCollect._wrap(_C.sync_async(_device_list(devices, "sync_async")))


def sync_into(devices, promise) -> None:
    """Fulfils a VoidPromise (it may belong to another process) when the devices are done.
    Usable inside torch.compile'd code with a promise created outside."""
    if _is_compiling():
        devices = _device_list(devices, "sync_into")
        if _opaque_promise(promise, VoidPromise):
            _graph.sync_into(devices, promise)
        else:
            _sync_into_op(devices, _traced_promise(promise, VoidPromise))
        return
    _C.sync_into(_device_list(devices, "sync_into"), _promise_handle(promise, VoidPromise))


def _patch_script_objects() -> None:
    """Raw dtorch objects are handles: truthy, and never copied.

    torch.ScriptObject's bool() falls back to len() (which ours refuse) and its copy.copy()
    returns a second reference to the same C++ object while copy.deepcopy() refuses. Both are
    fixed for dtorch's classes only; every other script object behaves as before.
    """
    script_object = torch.ScriptObject
    if getattr(script_object, "_dtorch_patched", False):
        return
    original_copy = script_object.__copy__

    def ours(obj) -> bool:
        return obj._type().qualified_name().startswith("__torch__.torch.classes.dtorch.")

    def __bool__(self):
        return True if ours(self) else len(self) != 0

    def __copy__(self):
        if ours(self):
            raise TypeError(f"dtorch: a {_script_name(self)} cannot be copied; it is a handle to "
                            "one promise or future (pass the object itself)")
        return original_copy(self)

    script_object.__bool__ = __bool__
    script_object.__copy__ = __copy__
    script_object._dtorch_patched = True


_patch_script_objects()
