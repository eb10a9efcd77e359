"""The public functions over the ops: to_torch_async / to_torch (a tensor's future, and the host
copy), get_tensor (fulfil a promise with a tensor), run_into, sync / sync_async / sync_into.

Eagerly each is one call of the direct binding (dtorch_ops._C); inside torch.compile they keep to
the ops, which Dynamo can trace (the graph ops of dtorch_ops.compile where this torch has opaque
types, else the raw C++ ops: a graph break). The waits over several futures are in
dtorch_ops.waiting.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, overload

import torch

from . import _C
from ._script_objects import _script_name
from .compile import graph_ops as _graph_ops
from .compile.eager import _InGraphEagerly
from .compile.tracing import (
    _above_subclass,
    _check_local_tensor,
    _defines_torch_dispatch,
    _fake_mode_active,
    _compiler,
    _is_dynamo_compiling,
    _is_tracing_tensor,
    _tracing_here,
)
from .futures import TensorFuture, TensorListFuture, VoidFutureCollect
from .promises import (
    TensorPromise,
    VoidPromise,
    _check_refused,
    _PromiseBase,
    _promise_handle,
    _traced_promise,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import ParamSpec, TypeAlias, TypeVar

    _P = ParamSpec("_P")
    _R = TypeVar("_R")
    _TensorT = TypeVar("_TensorT", bound=torch.Tensor)
    # A device ('cuda:0', torch.device, an index); sync & co. take one, a list or None (all).
    _Device: TypeAlias = str | int | torch.device
    _Devices: TypeAlias = _Device | Sequence[_Device] | None
    # A list of tensors for the host copy (to_torch_async(tensors, device="cpu")).
    _TensorList: TypeAlias = list[torch.Tensor] | tuple[torch.Tensor, ...]

_Tensor = torch.Tensor

# The ops, for compiled code (Dynamo traces torch.ops, not the _C binding).
_get_tensor_op = torch.ops.dtorch.get_tensor.default
_get_tensor_async_op = torch.ops.dtorch.get_tensor_async.default
_copy_to_host_async_op = torch.ops.dtorch.copy_to_host_async.default
_copy_list_to_host_async_op = torch.ops.dtorch.copy_list_to_host_async.default
_sync_op = torch.ops.dtorch.sync.default
_sync_wait_op = torch.ops.dtorch.sync_wait.default
_sync_into_op = torch.ops.dtorch.sync_into.default


@overload
def run_into(promise: TensorPromise, fn: Callable[_P, _TensorT], *args: _P.args,
             **kwargs: _P.kwargs) -> _TensorT: ...
@overload
def run_into(promise: VoidPromise, fn: Callable[_P, _R], *args: _P.args,
             **kwargs: _P.kwargs) -> _R: ...
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


def _opaque_promise(promise, wrapper) -> bool:
    """Whether traced code (Dynamo, or torch.export's non-strict tracing) passes a wrapper promise
    to the graph op as it is: a program input, not a constant object baked into the program."""
    return _graph_ops.defined_ops is not None and isinstance(promise, wrapper)


def get_tensor(t: torch.Tensor, promise: TensorPromise | torch.ScriptObject) -> None:
    """Fulfils promise with t once the work producing t on its current stream is done.

    Returns at once. Usable inside torch.compile'd code with a promise created outside.
    """
    if _is_dynamo_compiling() or _compiler._is_compiling_flag:
        _check_local_tensor(t, "get_tensor")
        if _opaque_promise(promise, TensorPromise):
            _graph_ops.defined_ops.get_tensor(t, promise)
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
        above = _above_subclass(t, "get_tensor")  # (checks t first)
        _C.get_tensor(_detached(t), handle, above)


@overload
def to_torch_async(t: torch.Tensor, device: str | torch.device | None = None) -> TensorFuture: ...
@overload
def to_torch_async(t: _TensorList, device: str | torch.device) -> TensorListFuture: ...
def to_torch_async(t, device=None):
    """Returns at once a future that yields t (aliased, no copy; detached where t requires
    grad: the future holds t's memory, never its autograd graph) when the work producing it is
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
    if _is_dynamo_compiling() or _compiler._is_compiling_flag:
        _check_local_tensor(t, "to_torch_async")
        if not (_defines_torch_dispatch(t) and not _is_tracing_tensor(t)):
            graph = _graph_ops.defined_ops
            if graph is not None:
                return graph.to_torch_async(t)
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
        return TensorFuture._wrap(_C.get_tensor_async(t))  # (detached by the library)
    above = _above_subclass(t, "to_torch_async")  # (checks t first)
    return TensorFuture._wrap(_C.get_tensor_async(_detached(t), above))


def _detached(t):
    """A tensor subclass detached in Python, which keeps its class (its __torch_function__ or
    __torch_dispatch__ makes the detached one); the library detaches plain tensors itself."""
    return t.detach() if isinstance(t, _Tensor) and t.requires_grad else t


def _host_device_arg(device, what: str) -> None:
    """Checks to_torch(_async)'s device= by type first: an int is a timeout written in the wrong
    place far more often than a device index, and the only device it takes is the host."""
    if isinstance(device, (str, torch.device)):
        return
    hint = ""
    if isinstance(device, (int, float)) and not isinstance(device, bool):
        hint = (f"; for a timeout, wait on the future: dtorch_ops.to_torch_async(t)"
                f".wait({device!r}) (milliseconds), or to_torch(t, timeout_ms={device!r})")
    raise TypeError(
        f"dtorch_ops.{what}(t, device): device is 'cpu' or torch.device('cpu') (the host copy), "
        f"got {type(device).__name__} {device!r}{hint}")


def _to_host_async(t, device):
    _host_device_arg(device, "to_torch_async")
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
    if _is_dynamo_compiling() or _compiler._is_compiling_flag:
        graph = _graph_ops.defined_ops
        if graph is not None:
            return graph.to_host_list_async(tensors) if many else graph.to_host_async(t)
        # A torch without opaque types: the raw op, a graph break, then it runs eagerly.
        if many:
            return TensorListFuture._from_op(_copy_list_to_host_async_op(tensors))
        return TensorFuture._from_op(_copy_to_host_async_op(t))
    if many:
        return TensorListFuture._wrap(_C.copy_list_to_host_async(tensors))
    return TensorFuture._wrap(_C.copy_to_host_async(t))


@overload
def to_torch(t: torch.Tensor, device: str | torch.device | None = None, *,
             timeout_ms: float | None = None, timeout: float | None = None) -> torch.Tensor: ...
@overload
def to_torch(t: _TensorList, device: str | torch.device, *, timeout_ms: float | None = None,
             timeout: float | None = None) -> list[torch.Tensor]: ...
def to_torch(t, device=None, *, timeout_ms=None, timeout=None):
    """The blocking form: to_torch_async(t, device).get(). ``timeout_ms`` (milliseconds) or
    ``timeout=`` (seconds) bound the wait: past it, raises FutureTimeoutError. Inside
    torch.compile a graph break: a wait cannot be part of a graph."""
    if _is_dynamo_compiling():  # a graph break, then the eager path
        return _InGraphEagerly.to_torch(t, device, timeout_ms=timeout_ms, timeout=timeout)
    if device is not None:
        _host_device_arg(device, "to_torch")
    future = to_torch_async(t, device)
    if timeout_ms is not None or timeout is not None:
        future.wait(timeout_ms, timeout=timeout)
    return future.get()


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


def sync(devices: _Devices = None) -> None:
    """Blocks (GIL released) until the work queued so far on each device's current stream is done.

    devices: a device, a list of devices, or None for the devices this process has used (the
    accelerators with a context; CPU when there is none). Only the current stream of each device
    is waited for; the device is not synchronised as a whole.
    """
    if _is_dynamo_compiling() or _compiler._is_compiling_flag:
        # In a graph: the sync_wait op, an ordered effect that compiled code keeps in place.
        _sync_wait_op(_device_list(devices, "sync"))
    else:
        _C.sync_async(_device_list(devices, "sync")).get()


def sync_async(devices: _Devices = None) -> VoidFutureCollect:
    """Like sync(), but returns at once an awaitable VoidFutureCollect (get / wait / await)."""
    if _is_dynamo_compiling() or _compiler._is_compiling_flag:
        devices = _device_list(devices, "sync_async")
        graph = _graph_ops.defined_ops
        if graph is not None:
            return graph.sync_async(devices)
        # A torch without opaque types: the raw op, a graph break, then it runs eagerly.
        return VoidFutureCollect._from_op(_sync_op(devices))
    return VoidFutureCollect._wrap(_C.sync_async(_device_list(devices, "sync_async")))


def sync_into(devices: _Devices, promise: VoidPromise | torch.ScriptObject) -> None:
    """Fulfils a VoidPromise (it may belong to another process) when the devices are done.
    Usable inside torch.compile'd code with a promise created outside."""
    if _is_dynamo_compiling() or _compiler._is_compiling_flag:
        devices = _device_list(devices, "sync_into")
        if _opaque_promise(promise, VoidPromise):
            _graph_ops.defined_ops.sync_into(devices, promise)
        else:
            _sync_into_op(devices, _traced_promise(promise, VoidPromise))
        return
    _C.sync_into(_device_list(devices, "sync_into"), _promise_handle(promise, VoidPromise))


_InGraphEagerly.add_function("to_torch", to_torch, reason=(
    "dtorch_ops.to_torch(t) blocks until t's value is ready, which a compiled graph "
    "cannot do: it runs eagerly (a graph break). To compile the whole step, call "
    "dtorch_ops.to_torch_async(t) inside it and get() the future outside"))
_InGraphEagerly.add_function("to_torch_async", to_torch_async, reason=(
    "dtorch_ops.to_torch_async on a tensor subclass runs eagerly (a graph break), so "
    "that its future yields the subclass: inside a graph the op would see the tensors "
    "the subclass wraps. Pass a plain tensor to compile it into the graph"))
