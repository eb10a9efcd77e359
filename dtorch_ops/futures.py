"""The Python API: future/promise wrappers over the raw script objects, and the ops' entry points."""
from __future__ import annotations

import asyncio
import itertools
import sys
import weakref

import torch

from .config import config

_QUALNAME_PREFIX = "__torch__.torch.classes.dtorch."

# The ops, looked up once (the library is loaded before this module is imported).
_get_tensor = torch.ops.dtorch.get_tensor.default
_get_tensor_async = torch.ops.dtorch.get_tensor_async.default
_sync = torch.ops.dtorch.sync.default
_sync_into = torch.ops.dtorch.sync_into.default
_sync_wait = torch.ops.dtorch.sync_wait.default

# A blocking get() waits in slices of this length so that Python signal handlers (Ctrl-C) still
# run; each slice is one wait in C++ with the GIL released, so waiting costs no CPU.
_GET_SLICE_MS = 100

# The raw wait's timeout message starts with this (csrc/core/future_error.h: "dtorch: <code>: ").
_RAW_TIMEOUT_PREFIX = "dtorch: timed out:"
_TIMED_OUT = object()


def _raw_wait(raw, timeout_ms: int):
    """raw.wait(timeout_ms): the value, or _TIMED_OUT (one call into C++ either way)."""
    try:
        return raw.wait(timeout_ms)
    except RuntimeError as e:
        if str(e).startswith(_RAW_TIMEOUT_PREFIX):
            return _TIMED_OUT
        raise


class _LoopWaker:
    """One per asyncio loop: the loop watches a ReadyNotifier's eventfd; completing futures post
    their waiter's token to it from whatever thread completes them, without taking the GIL."""

    def __init__(self, loop):
        self.notifier = torch.classes.dtorch.ReadyNotifier()
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


# Weakly keyed: a loop that is gone takes its waker (and, once no completion holds it, its
# eventfd) with it.
_loop_wakers: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopWaker]" = (
    weakref.WeakKeyDictionary()
)


async def _await_ready(waitable) -> None:
    """Suspends until waitable._raw is ready: woken by the completion itself, no polling, no
    thread. One registration per (future, loop), however often the await is cancelled and
    retried (asyncio.wait_for with a timeout in a loop, say)."""
    raw = waitable._raw
    if raw.is_ready():
        return
    loop = asyncio.get_running_loop()
    pending = waitable._pending
    if pending is None or pending.get_loop() is not loop or pending.done():
        waker = _loop_wakers.get(loop)
        if waker is None:
            waker = _loop_wakers[loop] = _LoopWaker(loop)
        token, pending = waker.register(loop)
        raw.notify_when_ready(waker.notifier, token)
        waitable._pending = pending
    # Shielded: cancelling this await leaves the registration for the next one.
    await asyncio.shield(pending)


def _qualname(obj) -> str | None:
    if isinstance(obj, torch.ScriptObject):
        return obj._type().qualified_name()
    return None


def _check_local_tensor(t, what: str) -> None:
    if not isinstance(t, torch.Tensor):
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


class _Waitable:
    """get / wait / is_ready / valid / await over a raw dtorch future (its class: _RAW_CLASS)."""

    _RAW_CLASS = ""
    _PRODUCED_BY = ""
    _pending = None  # the asyncio waiter of this future's latest await (see _await_ready)

    def __init__(self, raw):
        if isinstance(raw, type(self)):
            raw = raw._raw
        if _qualname(raw) != _QUALNAME_PREFIX + self._RAW_CLASS:
            raise TypeError(
                f"dtorch_ops.{type(self).__name__} wraps a torch.classes.dtorch.{self._RAW_CLASS} "
                f"(the result of {self._PRODUCED_BY}), got {type(raw).__name__}"
            )
        self._raw = raw

    @classmethod
    def _wrap(cls, raw):
        """Wraps a raw future known to be one (skips the type check on hot paths)."""
        future = cls.__new__(cls)
        future._raw = raw
        return future

    @property
    def raw(self):
        """The underlying script object (for TorchScript and torch.ops calls)."""
        return self._raw

    def get(self):
        """Blocks until the value is ready and returns it; consumes the future."""
        while (value := _raw_wait(self._raw, _GET_SLICE_MS)) is _TIMED_OUT:
            pass
        return value

    def wait(self, timeout_ms: int):
        """Returns the value like get() if it is ready within timeout_ms.

        Raises TimeoutError otherwise; the future stays valid and can be waited on again.
        """
        timeout_ms = int(timeout_ms)
        if timeout_ms < 0:
            raise ValueError(f"timeout_ms must be >= 0, got {timeout_ms}")
        value = _raw_wait(self._raw, timeout_ms)
        if value is _TIMED_OUT:
            raise TimeoutError(
                f"dtorch: the value was not ready within {timeout_ms} ms; the future is still "
                "valid, wait again"
            )
        return value

    def is_ready(self) -> bool:
        """True when get() would not block (a value or an error is there). Never blocks."""
        return self._raw.is_ready()

    def valid(self) -> bool:
        """False once get() or wait() has taken the value."""
        return self._raw.valid()

    def __await__(self):
        """``await future``: suspends the coroutine (not the loop) until the value is ready.

        Woken by the completion itself (no polling). Cancelling the awaiting task leaves the
        future valid. Errors (exception, broken promise) are raised here.
        """
        yield from _await_ready(self).__await__()
        return self._raw.get()

    def __reduce__(self):
        raise TypeError(
            f"dtorch: a {type(self).__name__} cannot be pickled; send the promise to the "
            "producer instead"
        )

    def _state(self) -> str:
        if not self._raw.valid():
            return "consumed"
        return "ready" if self._raw.is_ready() else "pending"


class _Future(_Waitable):
    """A promise's consumer end: also reports its kind."""

    def kind(self) -> str:
        return self._raw.kind()

    def __repr__(self) -> str:
        return f"dtorch_ops.{type(self).__name__}(kind={self._raw.kind()!r}, {self._state()})"


class TensorFuture(_Future):
    """The consumer's end of a tensor promise/future pair.

    Wraps the raw ``torch.classes.dtorch.TensorFuture`` that the ops return:
    ``TensorFuture(torch.ops.dtorch.get_tensor_async(x))``. ``get()`` consumes the future
    (``valid()`` is False afterwards), like ``std::future``. Blocking calls release the GIL.
    Thread-safe.
    """

    _RAW_CLASS = "TensorFuture"
    _PRODUCED_BY = "torch.ops.dtorch.get_tensor_async"


class VoidFuture(_Future):
    """A completion signal without a value: get() and wait() return None. Otherwise like
    TensorFuture (consumed by get(), errors and broken promises raised, awaitable)."""

    _RAW_CLASS = "VoidFuture"
    _PRODUCED_BY = "torch.classes.dtorch.VoidPromise.get_future"


class VoidFutureCollect(_Waitable):
    """One VoidFuture per device of a sync, awaited as one (the result of sync_async).

    Ready when every device is; get() raises the error of the first device (in devices() order)
    that failed, naming it. wait(timeout_ms) bounds the wait for all devices together.
    """

    _RAW_CLASS = "VoidFutureCollect"
    _PRODUCED_BY = "torch.ops.dtorch.sync"

    def devices(self) -> list[torch.device]:
        return list(self._raw.devices())

    def __repr__(self) -> str:
        names = ", ".join(str(d) for d in self._raw.devices())
        return f"dtorch_ops.VoidFutureCollect([{names}], {self._state()})"


class _PromiseBase:
    """set_value once, or set_exception; get_future once; pickling through serialize()."""

    _RAW_CLASS = ""
    _FUTURE = _Waitable

    def __init__(self, kind: str = "memory"):
        if _qualname(kind) == _QUALNAME_PREFIX + self._RAW_CLASS:  # wrap an existing raw promise
            self._raw = kind
            return
        if not isinstance(kind, str):
            raise TypeError(f"kind must be a str ('memory', 'file', 'network'), got {kind!r}")
        self._raw = getattr(torch.classes.dtorch, self._RAW_CLASS)(kind)

    @classmethod
    def from_serialized(cls, s: str):
        """Rebuilds a promise that another process serialized (kinds that cross processes)."""
        if not isinstance(s, str):
            raise TypeError(
                f"from_serialized expects the str from serialize(), got {type(s).__name__}")
        raise ValueError(
            f"dtorch: cannot restore a {cls.__name__} from {s[:80]!r}: no promise kind that "
            "crosses processes is available in this build (memory promises cannot leave the "
            "process)"
        )

    @property
    def raw(self):
        """The underlying script object (for TorchScript and torch.ops calls)."""
        return self._raw

    def get_future(self):
        """The consumer's end; a promise has exactly one future."""
        return self._FUTURE._wrap(self._raw.get_future())

    def set_exception(self, message: str) -> None:
        """Fails the future: its get()/wait()/await raise an error carrying message."""
        self._raw.set_exception(str(message))

    def kind(self) -> str:
        return self._raw.kind()

    def serialize(self) -> str:
        """A string another process can pass to from_serialized; memory promises raise."""
        return self._raw.serialize()

    def __reduce__(self):
        return (type(self).from_serialized, (self.serialize(),))

    def __repr__(self) -> str:
        return f"dtorch_ops.{type(self).__name__}(kind={self._raw.kind()!r})"


class TensorPromise(_PromiseBase):
    """The producer's end: ``set_value(t)`` once, or ``set_exception(message)``.

    ``kind="memory"`` pairs live in one process. Destroying a promise without setting it makes
    its future fail with "broken promise". Thread-safe.
    """

    _RAW_CLASS = "TensorPromise"
    _FUTURE = TensorFuture

    @classmethod
    def for_tensor(cls, t: torch.Tensor, per_device_per_process: bool | None = None):
        """A promise of the kind promise_kind_for(t) advises."""
        return cls(promise_kind_for(t, per_device_per_process))

    def set_value(self, t: torch.Tensor) -> None:
        """Fulfils the promise with t (no copy). A second set raises; the first value stays."""
        _check_local_tensor(t, "TensorPromise.set_value")
        self._raw.set_value(t)


class VoidPromise(_PromiseBase):
    """A completion signal's producer end: ``set_value()`` once, or ``set_exception(message)``
    (``sync_into`` fulfils one when devices are done). Thread-safe."""

    _RAW_CLASS = "VoidPromise"
    _FUTURE = VoidFuture

    def set_value(self) -> None:
        """Signals completion. A second set raises."""
        self._raw.set_value()


def _raw_promise(promise, wrapper=TensorPromise):
    if isinstance(promise, wrapper):
        return promise._raw
    if _qualname(promise) == _QUALNAME_PREFIX + wrapper._RAW_CLASS:
        return promise
    raise TypeError(
        f"expected a dtorch_ops.{wrapper.__name__} (or a raw torch.classes.dtorch."
        f"{wrapper._RAW_CLASS}), got {type(promise).__name__}"
    )


def get_tensor(t: torch.Tensor, promise) -> None:
    """Fulfils promise with t once the work producing t on its current stream is done.

    Returns at once. Usable inside torch.compile'd code with a promise created outside.
    """
    _check_local_tensor(t, "get_tensor")
    _get_tensor(t, _raw_promise(promise))


def to_torch_async(t: torch.Tensor) -> TensorFuture:
    """Returns at once a future that yields t (aliased, no copy) when the work producing it is done."""
    _check_local_tensor(t, "to_torch_async")
    return TensorFuture._wrap(_get_tensor_async(t))


def to_torch(t: torch.Tensor) -> torch.Tensor:
    """The blocking form: to_torch_async(t).get()."""
    return to_torch_async(t).get()


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


def _device_list(devices):
    """None, a device (str, int, torch.device) or a sequence of them -> None or [torch.device]."""
    if devices is None:
        return None
    if isinstance(devices, (str, int, torch.device)):
        devices = [devices]
    return [torch.device(d) for d in devices]


def sync(devices=None) -> None:
    """Blocks (GIL released) until the work queued so far on each device's current stream is done.

    devices: a device, a list of devices, or None for the devices this process has used (the
    accelerators with a context; CPU when there is none). Only the current stream of each device
    is waited for; the device is not synchronised as a whole.
    """
    if torch.compiler.is_compiling():
        # In a graph: the sync_wait op, an ordered effect that compiled code keeps in place.
        _sync_wait(_device_list(devices))
    else:
        # Eager: wait in slices, so that Ctrl-C can interrupt a sync on a hung device.
        sync_async(devices).get()


def sync_async(devices=None) -> VoidFutureCollect:
    """Like sync(), but returns at once an awaitable VoidFutureCollect (get / wait / await)."""
    return VoidFutureCollect._wrap(_sync(_device_list(devices)))


def sync_into(devices, promise) -> None:
    """Fulfils a VoidPromise (it may belong to another process) when the devices are done."""
    _sync_into(_device_list(devices), _raw_promise(promise, VoidPromise))
