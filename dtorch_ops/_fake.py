"""Fake classes and fake kernels: how torch.compile / torch.export see dtorch's classes and ops.

While tracing, script objects become FakeScriptObjects built from ``__obj_flatten__`` (the kind
only, so Dynamo guards on the kind and does not recompile per object) and ops run these Python
fake kernels. The C++ library names this module (``set_python_module``) so that torch asks for it
when the ops are used without ``import dtorch_ops``.
"""
import logging
import sys

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ._graph_ops import register_ordered_effect, require_fake_mode
from ._on_import import register_on_import


def _unflatten(cls, flattened):
    return cls(**dict(flattened))


def _no_len(self):
    raise TypeError(f"{type(self).__name__} has no len()")


def _same_object(self, other):
    return self is other


class _DeepcopyFallbackFilter(logging.Filter):
    """Drops torch's warning that it could not deep-copy one of our objects while tracing.

    Tracing tries copy.deepcopy on each script object and, when that fails, keeps using the
    object itself, warning that methods could mutate it. Ours cannot be copied (a memory promise
    cannot be pickled, by design) and our fake classes never call their methods, so the fallback
    is safe and the warning, logged at every compile, is noise.
    """

    def filter(self, record):
        return not (record.getMessage().startswith("Unable to deepcopy the custom object")
                    and "torch.classes.dtorch." in record.getMessage())


logging.getLogger("torch._library.fake_class_registry").addFilter(_DeepcopyFallbackFilter())


def _register_fake_class(name: str, methods: tuple, why: str):
    """A fake class for torch.classes.dtorch.<name>: it keeps the kind (its __obj_flatten__), and
    its other methods refuse, saying `why`: traced code must not depend on these objects' state."""

    def __init__(self, kind: str):
        self._kind = kind

    def refuse(self, *args):
        raise RuntimeError(f"dtorch: {name} methods cannot run inside a traced graph: {why}")

    namespace = {
        "__init__": __init__,
        "__obj_unflatten__": classmethod(_unflatten),
        "kind": lambda self: self._kind,
        "__len__": _no_len,
        "__eq__": _same_object,
        **{method: refuse for method in methods},
    }
    fake = type(f"Fake{name}", (), namespace)
    # Importable by name: inductor's cache pickles fake objects (by class reference).
    fake.__module__ = __name__
    globals()[fake.__name__] = fake
    torch._library.register_fake_class(f"dtorch::{name}")(fake)
    return fake


_WAIT_OUTSIDE = "wait on the future outside the compiled region"
_USE_OPS = "call the ops (get_tensor, sync_into) with the promise there instead"
for _name in ("TensorFuture", "VoidFuture", "TensorListFuture"):
    _register_fake_class(
        _name, ("get", "wait", "value", "wait_for", "is_ready", "done", "valid",
                "notify_when_ready"),
        _WAIT_OUTSIDE)
for _name in ("TensorPromise", "VoidPromise"):
    _register_fake_class(_name, ("set_value", "set_exception", "get_future", "serialize"),
                         _USE_OPS)
_register_fake_class(
    "VoidFutureCollect",
    ("get", "wait", "value", "wait_for", "is_ready", "done", "valid", "devices",
     "notify_when_ready"),
    _WAIT_OUTSIDE)
_register_fake_class("ReadyNotifier", ("fileno", "drain"), "it belongs to an event loop")


def _in_cross_ref_check() -> bool:
    """Whether torch's CrossRefFakeMode (torch.library.opcheck's fake-tensor check) runs this
    fake kernel: it passes the real promise to the fake kernel, then runs the real op with it."""
    from torch._subclasses.fake_utils import CrossRefFakeMode

    code = CrossRefFakeMode.__torch_dispatch__.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


@torch.library.register_fake("dtorch::get_tensor")
def _get_tensor_fake(input, promise):
    require_fake_mode("get_tensor", input)
    if isinstance(promise, torch.ScriptObject) and not _in_cross_ref_check():
        # Tracing hands fake kernels stand-ins (FakeScriptObject); a real promise means the op
        # was called under FakeTensorMode by hand, where no value exists to fulfil it with.
        raise RuntimeError(
            "dtorch: get_tensor ran under FakeTensorMode with a real promise: fake tensors have "
            "no value, so the promise would never be fulfilled; call it outside FakeTensorMode "
            "(or trace it with torch.compile / torch.export)"
        )
    return None


def _failed_future(op):
    promise = torch.classes.dtorch.TensorPromise("memory")
    future = promise.get_future()
    promise.set_exception(f"this TensorFuture came from dtorch::{op}'s fake kernel (tracing) and "
                          "holds no value")
    return future


@torch.library.register_fake("dtorch::get_tensor_async")
def _get_tensor_async_fake(input):
    require_fake_mode("get_tensor_async", input)
    # The op's output must convert to the schema's class type (a FakeScriptObject does not), so
    # the fake output is a real future that can only report that it came from tracing. Dynamo
    # (torch 2.13) then graph-breaks at the op and runs it eagerly: ops returning a new script
    # object cannot be captured (tests/test_compile.py, ..._fall_back_with_a_graph_break).
    return _failed_future("get_tensor_async")


@torch.library.register_fake("dtorch::copy_to_host_async")
def _copy_to_host_async_fake(input):
    # As for get_tensor_async (a real object of the schema's class; Dynamo breaks the graph).
    require_fake_mode("copy_to_host_async", input)
    return _failed_future("copy_to_host_async")


@torch.library.register_fake("dtorch::copy_list_to_host_async")
def _copy_list_to_host_async_fake(inputs):
    for input in inputs:
        require_fake_mode("copy_list_to_host_async", input)
    from . import _C

    return _C.failed_tensor_list_future(
        "this TensorListFuture came from dtorch::copy_list_to_host_async's fake kernel "
        "(tracing) and holds no value").script()


@torch.library.register_fake("dtorch::sync")
def _sync_fake(devices=None):
    # As for get_tensor_async, the output must be a real object of the schema's class: a collect
    # over no devices (it waits for nothing and touches no device).
    with _disable_current_modes():
        return torch.ops.dtorch.sync.default([])


@torch.library.register_fake("dtorch::sync_into")
def _sync_into_fake(devices, promise):
    return None


@torch.library.register_fake("dtorch::sync_wait")
def _sync_wait_fake(devices=None):
    return None


register_ordered_effect("dtorch::sync_wait")


def _reject_dtensor(cls, func, types, args=(), kwargs=None):
    raise TypeError(
        f"dtorch: {func} expects a local tensor, got a DTensor: pass t.to_local() "
        "(or t.full_tensor()) instead"
    )


def _register_dtensor_rules(dtensor_module) -> None:
    for op in _OPS_TAKING_A_TENSOR:
        torch.library.register_torch_dispatch(op, dtensor_module.DTensor, _reject_dtensor)


def _register_inductor_lowerings(lowering_module) -> None:
    """Inductor must never write a later result into the buffer of a tensor one of our ops holds
    (a future aliases it): without this, `buf3 = buf1; del buf1  # reuse` handed the future of
    `loss` the value of `loss * 2 + 1`. Each such op is lowered as the usual fallback kernel with
    its input realized and marked never-reuse (inductor internals, pinned by
    tests/test_compile.py). In a training forward an intermediate is first copied into a buffer of
    our own: the backward graph may reuse the buffers of the activations saved for it (it wrote
    cos(h) into the future of h); the copy is a pointwise node that fuses into its producer. Graph
    inputs are held as they are (a later in-graph mutation shows, as under aot_eager)."""
    from torch._inductor.virtualized import V

    def refuse_cpp_wrapper(op):
        if op in _OPS_WITH_PYTHON_OBJECTS and V.graph.cpp_wrapper:
            raise RuntimeError(
                f"dtorch: {op} returns or takes a Python object (a future, a promise), which "
                "inductor's cpp_wrapper mode cannot hold: compile this graph without "
                "cpp_wrapper, or make the future (or fulfil the promise) outside it")

    def held(input):
        input.realize()
        if not V.graph.is_inference and input.get_name() not in V.graph.graph_inputs:
            input = lowering_module.clone(input)
            input.realize()
        V.graph.never_reuse_buffers.add(input.get_name())
        return input

    def lower_holding_input(op):
        # The first argument: a tensor, or a list of them (to_host_list_async).
        def lowering(input, *args):
            refuse_cpp_wrapper(op)
            input = [held(x) for x in input] if isinstance(input, (list, tuple)) else held(input)
            return lowering_module.fallback_handler(op, add_to_fallback_set=False)(input, *args)

        return lowering

    def lower_refusing_cpp_wrapper(op):
        def lowering(*args):
            refuse_cpp_wrapper(op)
            return lowering_module.fallback_handler(op, add_to_fallback_set=False)(*args)

        return lowering

    for op in _OPS_HOLDING_THEIR_INPUT:
        lowering_module.register_lowering(op, type_promotion_kind=None)(lower_holding_input(op))
    for op in set(_OPS_WITH_PYTHON_OBJECTS) - set(_OPS_HOLDING_THEIR_INPUT):
        lowering_module.register_lowering(op, type_promotion_kind=None)(
            lower_refusing_cpp_wrapper(op))


def _defined_ops(*names):
    """The default overloads of those dtorch ops that exist (the Python-defined ones only where
    this torch can return opaque objects from graphs)."""
    return tuple(getattr(torch.ops.dtorch, name).default
                 for name in names if hasattr(torch.ops.dtorch, name))


# Ops whose kernels keep a reference to their tensor input after they return (the futures they
# fulfil alias it; the host copies alias a CPU input, and read a device input after they return).
_OPS_HOLDING_THEIR_INPUT = _defined_ops("get_tensor", "to_torch_async", "get_tensor_opaque",
                                        "to_host_async", "to_host_list_async")
# The Python-defined ops, which return or take Python objects (futures, promises).
_OPS_WITH_PYTHON_OBJECTS = _defined_ops("to_torch_async", "to_host_async", "to_host_list_async",
                                        "sync_async", "get_tensor_opaque", "sync_into_opaque")
# Ops that take a tensor: a DTensor gets the error that says to pass a local tensor.
_OPS_TAKING_A_TENSOR = tuple(op.name() for op in _OPS_HOLDING_THEIR_INPUT) + (
    "dtorch::get_tensor_async", "dtorch::copy_to_host_async", "dtorch::copy_list_to_host_async")


_registrations = {"torch._inductor.lowering": _register_inductor_lowerings}
if torch.distributed.is_available():
    _registrations["torch.distributed.tensor"] = _register_dtensor_rules
register_on_import(_registrations)
