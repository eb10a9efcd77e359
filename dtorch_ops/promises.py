"""The promise classes: the producer's ends of the pairs, plain Python classes over the direct
binding (dtorch_ops._C), as the futures are (dtorch_ops.futures); and how the functions take a
promise argument (a wrapper, or a raw torch.classes.dtorch object)."""
from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

import torch

from . import _C
from ._script_objects import (
    _handle_from_script,
    _passing_hint_of,
    _script_name,
    _script_object_of,
)
from .compile import graph_ops as _graph_ops
from .compile.eager import _PROMISE_FORMS, _InGraphEagerly
from .compile.tracing import _check_local_tensor, _compiler, _is_dynamo_compiling, _tracing_here
from .errors import FutureError, _exception_parts
from .futures import TensorFuture, VoidFuture, _Waitable
from .kind_options import _kind_spec, promise_kind_for

if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any, Self

_Tensor = torch.Tensor
_new = object.__new__
_PROMISE_CREATION = ("a graph cannot create a promise. To compile the whole step, create the "
                     "promise outside and pass it in (get_tensor(t, promise) compiles), or use "
                     "dtorch_ops.to_torch_async(t), which compiles and returns the future")


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

    Opaque types for torch.compile, like the futures (dtorch_ops/compile/graph_ops.py).
    """

    # __weakref__: tracing keeps opaque objects in weak dictionaries.
    __slots__ = ("_h", "_raw", "__weakref__")
    _HANDLE = None
    _FUTURE = _Waitable

    def __init__(self, kind: str | torch.ScriptObject = "memory", **options: Any) -> None:
        """kind: "memory" (the pair lives in this process), "file" (the promise can be sent to
        other processes of this host: pickle it, put it in a torch.multiprocessing queue, or
        pass serialize()'s string) or "network" (to processes of other hosts too, through a
        torch.distributed TCPStore: store= is one, a PrefixStore over one, or "host:port").
        Options of a kind are keyword arguments (TensorPromise(kind="file") takes device="cpu"
        and zero_copy=True; kind="network" takes store= and device="cpu")."""
        if _is_dynamo_compiling() or _compiler._is_compiling_flag:
            _refuse_promise_in_graph(type(self).__name__)
        if type(kind) is str and kind == "memory" and not options:  # the hot path: no checks
            self._h = handle = self._HANDLE("memory")
            if _graph_ops.defined_ops is None:
                self._raw = handle.script()  # (as _init_handle)
            return
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
        if _graph_ops.defined_ops is None:
            # Compiled code passes the raw promise to the ops: made now, as a promise passed
            # into a compiled step must not create objects while Dynamo traces it. (Else made
            # on first use of .raw: compiled code passes this object itself.)
            self._raw = handle.script()

    @classmethod
    def from_serialized(cls, s: str) -> Self:
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
    # Read by TorchScript where it expects a raw object: its error then says to pass .raw.
    capsule = property(_passing_hint_of)

    def get_future(self) -> _Waitable:
        """The consumer's end; a promise has exactly one future."""
        if ((_is_dynamo_compiling() or _compiler._is_compiling_flag)
                and _promise_method_traced("get_future")):
            return _InGraphEagerly.promise_methods["get_future"](self)
        future = _new(self._FUTURE)  # (_Waitable._wrap, inlined: the hot path)
        future._h = self._h.get_future()
        return future

    def set_exception(self, exception: BaseException | type[BaseException] | str) -> None:
        """Fails the future with `exception`, as torch.futures.Future.set_exception: in this
        process its get() / wait() / value() / await raise that very exception object; in
        another process (file, network) its type's name, message and traceback travel, and the
        consumer raises the same built-in type (ValueError, KeyError, RuntimeError, ...) or a
        ProducerError naming the type, with the producer's traceback as a note. A str (or any
        other object) fails it with a ProducerError carrying that message. A second set raises
        PromiseAlreadySatisfiedError."""
        if ((_is_dynamo_compiling() or _compiler._is_compiling_flag)
                and _promise_method_traced("set_exception")):
            return _InGraphEagerly.promise_methods["set_exception"](self, exception)
        if isinstance(exception, type) and issubclass(exception, BaseException):
            exception = exception()
        if isinstance(exception, BaseException):
            self._h.set_exception_object(exception, *_exception_parts(exception))
        else:
            self._h.set_exception(str(exception))

    @contextlib.contextmanager
    def fulfilling(self) -> Iterator[Self]:
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

    if TYPE_CHECKING:
        def get_future(self) -> TensorFuture: ...

    @classmethod
    def for_tensor(cls, t: torch.Tensor, per_device_per_process: bool | None = None) -> Self:
        """A promise of the kind promise_kind_for(t) advises."""
        return cls(promise_kind_for(t, per_device_per_process))

    def set_value(self, t: torch.Tensor) -> None:
        """Fulfils the promise with t (memory: no copy; file: copied now, or for a device tensor
        snapshotted on its stream now and published once that copy is done). A second set
        raises PromiseAlreadySatisfiedError; the first value stays."""
        if ((_is_dynamo_compiling() or _compiler._is_compiling_flag)
                and _promise_method_traced("set_value")):
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

    if TYPE_CHECKING:
        def get_future(self) -> VoidFuture: ...

    def set_value(self) -> None:
        """Signals completion. A second set raises."""
        if ((_is_dynamo_compiling() or _compiler._is_compiling_flag)
                and _promise_method_traced("set_value")):
            return _InGraphEagerly.promise_methods["set_value"](self)
        self._h.set_value()


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
