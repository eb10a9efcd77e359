"""The future classes: plain Python classes over the direct binding (dtorch_ops._C).

Each future holds ``_h``, a handle of the ``_C`` module to the C++ object, which every method
calls directly (one call each), and gives ``.raw``, the TorchScript object
(``torch.classes.dtorch.*``) of the very same C++ state, for TorchScript and ``torch.ops`` calls.
Inside ``torch.compile`` the functions keep to the ops, which Dynamo can trace.

The promises are in dtorch_ops.promises, the functions in dtorch_ops.functions (the ops) and
dtorch_ops.waiting (waits over several futures).
"""
from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, overload

import torch

from . import _C
from ._script_objects import (
    _a,
    _passing_hint_of,
    _handle_from_script,
    _script_name,
    _script_object_of,
)
from ._settle import (
    _call_and_settle,
    _pending_object_future,
    _promise_settler,
    _settle_when_done,
    _unpack,
)
from ._waker import _await_ready
from .compile import graph_ops as _graph_ops
from .compile.eager import _InGraphEagerly
from .compile.tracing import _is_dynamo_compiling
from .errors import FutureTimeoutError

if TYPE_CHECKING:
    from collections.abc import Callable, Generator
    from typing import Any, Self

_Tensor = torch.Tensor

# torch.futures.Future's base class (RPC's futures are instances too).
_TorchFuture = torch._C.Future
_new = object.__new__


class _Waitable(metaclass=_graph_ops.opaque_metaclass()):
    """get / wait / is_ready / valid / await over a handle (its class: _HANDLE).

    The metaclass lets the future classes be torch.compile opaque reference types
    (dtorch_ops/compile/graph_ops.py), so compiled graphs can create and return them.
    """

    # __weakref__: tracing keeps opaque objects in weak dictionaries. _fanout: the one completion
    # callback the waits over several futures share (_fanout_of).
    # _result: an ObjectFuture's outcome; here, so that the future then() returns, an
    # ObjectFuture until its callback has returned, can become a TensorFuture (same layout).
    __slots__ = ("_h", "_raw", "_pending", "_fanout", "_result", "__weakref__")
    _HANDLE = None
    _PRODUCED_BY = ""
    # torch.futures.Future -> a handle of _HANDLE completed by it (None: not adoptable).
    _ADOPT = None

    def __init__(self, raw: torch.ScriptObject | torch.futures.Future[Any] | Self) -> None:
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
    # Read by TorchScript where it expects a raw object: its error then says to pass .raw.
    capsule = property(_passing_hint_of)

    # get(), wait(timeout_ms=None, *, timeout=None), result(timeout=None), value(), is_ready(),
    # done(), valid() and add_done_callback() are C++ methods installed by the binding
    # (_C.install_wait_methods, below the classes).
    if TYPE_CHECKING:  # what type checkers see of them (those returning the value: per class)
        def is_ready(self) -> bool: ...
        def done(self) -> bool: ...
        def valid(self) -> bool: ...
        def add_done_callback(self, callback: Callable[[Self], object], /) -> None: ...

    def exception(self, timeout: float | None = None, *,
                  timeout_ms: float | None = None) -> BaseException | None:
        """concurrent.futures.Future.exception(): waits like result() (timeout in seconds, or
        timeout_ms=) and returns the future's error (what get() would raise), or None when it
        holds a value; past the timeout raises FutureTimeoutError. Consumes nothing."""
        if _is_dynamo_compiling():
            return _InGraphEagerly.call_member(self, "exception", timeout,
                                               timeout_ms=timeout_ms)  # a graph break
        limit = _C.timeout_ms_of("exception", timeout, timeout_ms)
        # Waited for without reading its outcome: a wait's own error (a timeout, Ctrl-C) is
        # raised, the future's is returned.
        if not self._ready_within(limit):
            raise FutureTimeoutError(
                f"dtorch: timed out: exception(): the future was not complete within "
                f"{_describe_timeout(timeout, timeout_ms)}; it is still valid, wait again")
        try:
            self.value()
        except BaseException as e:  # noqa: BLE001 (the future's error, whatever its type)
            return e
        return None

    def wait_for(self, timeout_ms: float) -> bool:
        """The raw futures' ``wait_for(ms)``: True once the future is complete (its value or its
        error, neither read), False if it is not within ``timeout_ms`` milliseconds. Consumes
        nothing; the GIL is released while waiting."""
        if _is_dynamo_compiling():
            return _InGraphEagerly.call_member(self, "wait_for", timeout_ms)  # a graph break
        if timeout_ms is None:
            raise TypeError("dtorch: wait_for(timeout_ms) needs a timeout in milliseconds "
                            "(wait() waits without one)")
        if isinstance(timeout_ms, (int, float)) and timeout_ms < 0:
            raise ValueError(f"dtorch: wait_for(timeout_ms) needs timeout_ms >= 0, got {timeout_ms}")
        return self._ready_within(_C.timeout_ms_of("wait_for", None, timeout_ms))

    def _ready_within(self, limit_ms) -> bool:
        """Whether the future is complete within limit_ms (None: no limit), its outcome unread:
        a wait's own error (Ctrl-C) is raised."""
        return self._h.is_ready() or _completion_queue([self]).pop(limit_ms) is not None

    # A callback returning a tensor gives a TensorFuture once complete (at once where annotated),
    # an ObjectFuture before: both, to a type checker.
    @overload
    def then(self, callback: Callable[[Self], torch.Tensor]) -> TensorFuture | ObjectFuture: ...
    @overload
    def then(self, callback: Callable[[Self], object]) -> ObjectFuture: ...

    def then(self, callback):
        """Returns a new future of ``callback(self)``'s result, called once this future is
        complete (as ``torch.futures.Future.then``); the callback reads this future's value with
        ``value()``, which raises its error, if any.

        The new future is a ``TensorFuture`` whenever the callback returns a tensor (one a
        memory promise takes; a DTensor stays an ``ObjectFuture``'s value): at once
        when the callback is annotated to return one (``def f(fut) -> torch.Tensor``; its
        ``.raw`` then exists before the callback has run), else it is an ``ObjectFuture`` until
        the callback has returned and then adopts its result's type (``isinstance(f,
        TensorFuture)`` holds from the moment it is complete: at once where this future is
        complete already). An exception raised by the callback fails the new future: an
        ``ObjectFuture`` raises that very exception, an annotated ``TensorFuture`` a
        ``ProducerError`` naming it. Where the callback runs: see ``add_done_callback``.
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
            settle = _pending_object_future(derived, adopt_tensor=TensorFuture)
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

    def __await__(self) -> Generator[Any, None, Any]:
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

    if TYPE_CHECKING:  # installed by the binding (_C.install_wait_methods)
        def get(self) -> torch.Tensor: ...
        def wait(self, timeout_ms: float | None = None, *,
                 timeout: float | None = None) -> torch.Tensor: ...
        def result(self, timeout: float | None = None, *,
                   timeout_ms: float | None = None) -> torch.Tensor: ...
        def value(self) -> torch.Tensor: ...
        def __await__(self) -> Generator[Any, None, torch.Tensor]: ...


class TensorListFuture(_Future):
    """Several tensors that arrive together: the host copies of
    ``to_torch_async([loss, acc, lr], device="cpu")``. ``get()`` returns the list (in order);
    otherwise like TensorFuture (consumed by get(), errors raised, awaitable)."""

    __slots__ = ()
    _HANDLE = _C.TensorListFuture
    _PRODUCED_BY = "torch.ops.dtorch.copy_list_to_host_async"

    if TYPE_CHECKING:  # installed by the binding (_C.install_wait_methods)
        def get(self) -> list[torch.Tensor]: ...
        def wait(self, timeout_ms: float | None = None, *,
                 timeout: float | None = None) -> list[torch.Tensor]: ...
        def result(self, timeout: float | None = None, *,
                   timeout_ms: float | None = None) -> list[torch.Tensor]: ...
        def value(self) -> list[torch.Tensor]: ...
        def __await__(self) -> Generator[Any, None, list[torch.Tensor]]: ...


class VoidFuture(_Future):
    """A completion signal without a value: get() and wait() return None. Otherwise like
    TensorFuture (consumed by get(), errors and broken promises raised, awaitable)."""

    __slots__ = ()
    _HANDLE = _C.VoidFuture
    _PRODUCED_BY = "torch.classes.dtorch.VoidPromise.get_future"

    if TYPE_CHECKING:  # installed by the binding (_C.install_wait_methods)
        def get(self) -> None: ...
        def wait(self, timeout_ms: float | None = None, *,
                 timeout: float | None = None) -> None: ...
        def result(self, timeout: float | None = None, *,
                   timeout_ms: float | None = None) -> None: ...
        def value(self) -> None: ...
        def __await__(self) -> Generator[Any, None, None]: ...


class VoidFutureCollect(_Waitable):
    """One VoidFuture per device of a sync, awaited as one (the result of sync_async).

    Ready when every device is; get() raises the error of the first device (in devices() order)
    that failed, naming it. wait(timeout_ms) bounds the wait for all devices together.
    """

    __slots__ = ()
    _HANDLE = _C.VoidFutureCollect
    _PRODUCED_BY = "torch.ops.dtorch.sync"

    if TYPE_CHECKING:  # installed by the binding (_C.install_wait_methods)
        def get(self) -> None: ...
        def wait(self, timeout_ms: float | None = None, *,
                 timeout: float | None = None) -> None: ...
        def result(self, timeout: float | None = None, *,
                   timeout_ms: float | None = None) -> None: ...
        def value(self) -> None: ...
        def __await__(self) -> Generator[Any, None, None]: ...

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

    # _result (a slot of _Waitable): (True, value) or (False, exception), set before completion,
    # kept.
    __slots__ = ()
    _HANDLE = _C.VoidFuture  # the completion; the value stays in Python
    _PRODUCED_BY = "then() or collect_all()"

    def __init__(self, torch_future: torch.futures.Future[Any]) -> None:
        if not isinstance(torch_future, _TorchFuture):
            raise TypeError("dtorch_ops.ObjectFuture(torch_future) adopts a torch.futures.Future,"
                            f" got {_script_name(torch_future)}")
        _settle_when_done(torch_future, _pending_object_future(self))

    def get(self) -> Any:
        """Blocks until the value is ready and returns it (or raises the error); consumes the
        future. The GIL is released while waiting."""
        handle = self._h
        handle.get()  # waits; raises once consumed, or broken
        if self._h is not handle:  # adopted a tensor meanwhile (then()): consumed as one
            self._h.get()
        return _unpack(self._result)

    def wait(self, timeout_ms: float | None = None, *, timeout: float | None = None) -> Any:
        """Blocks until the value is ready and returns it (or raises the error), without
        consuming it. timeout_ms (milliseconds) or timeout= (seconds) bound the wait: past it,
        raises FutureTimeoutError (a TimeoutError)."""
        self._h.wait(timeout_ms, timeout=timeout)
        return _unpack(self._result)

    def result(self, timeout: float | None = None, *, timeout_ms: float | None = None) -> Any:
        """concurrent.futures.Future.result(): wait() with the timeout in seconds."""
        self._h.result(timeout, timeout_ms=timeout_ms)
        return _unpack(self._result)

    def value(self) -> Any:
        """The value of a completed future without consuming it (also after get()), or its
        error raised."""
        self._h.value()  # raises FutureNotReadyError before completion
        return _unpack(self._result)

    def __await__(self) -> Generator[Any, None, Any]:
        yield from _await_ready(self).__await__()
        return self.get()

    @property
    def raw(self):
        raise TypeError("dtorch: an ObjectFuture holds a Python value, which TorchScript cannot "
                        "carry: it has no TorchScript object (then() makes a TensorFuture, which "
                        "has one, when its callback returns a torch.Tensor)")

    def __repr__(self) -> str:
        return f"dtorch_ops.ObjectFuture({self._state()})"


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


def _describe_timeout(timeout, timeout_ms) -> str:
    """A wait's limit as every timeout error words it: in milliseconds, whichever unit the caller
    wrote."""
    if timeout is None:
        return f"{timeout_ms} ms"
    return f"{_C.timeout_ms_of('wait', timeout, None)} ms"


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
