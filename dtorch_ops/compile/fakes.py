"""Fake classes and fake kernels: how torch.compile / torch.export see dtorch's classes and ops.

While tracing, script objects become FakeScriptObjects built from ``__obj_flatten__`` (the kind
only, so Dynamo guards on the kind and does not recompile per object) and ops run these Python
fake kernels. The C++ library names this module (``set_python_module``) so that torch asks for it
when the ops are used without ``import dtorch_ops``; torch also checks that the fake kernels of
the C++-defined ops are registered from the module so named.
"""
import logging
import sys

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .graph_ops import register_ordered_effect, require_fake_mode


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
    # object cannot be captured (tests/test_compile.py, test_the_raw_future_op_breaks_the_graph).
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
    from .. import _C

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
