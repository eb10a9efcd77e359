"""Fake classes and fake kernels: how torch.compile / torch.export see dtorch's classes and ops.

While tracing, script objects become FakeScriptObjects built from ``__obj_flatten__`` (the kind
only, so Dynamo guards on the kind and does not recompile per object) and ops run these Python
fake kernels. The C++ library names this module (``set_python_module``) so that torch asks for it
when the ops are used without ``import dtorch_ops``.
"""
import importlib.abc
import importlib.util
import logging
import sys

import torch


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


def _require_fake_mode(op: str, input) -> None:
    """Fake kernels also serve as Meta kernels; a real meta tensor has no value to hand over."""
    try:
        torch.library.get_ctx()
    except RuntimeError:
        raise NotImplementedError(
            f"dtorch::{op}: meta tensors have no value to hand over; pass a tensor on a real "
            "device (or trace under FakeTensorMode)"
        ) from None


@torch._library.register_fake_class("dtorch::TensorFuture")
class FakeTensorFuture:
    def __init__(self, kind: str):
        self._kind = kind

    __obj_unflatten__ = classmethod(_unflatten)

    def kind(self) -> str:
        return self._kind

    def _no_value(self, *args):
        raise RuntimeError(
            "dtorch: a TensorFuture has no value while it is being traced; wait on it outside "
            "the compiled region"
        )

    get = wait = wait_for = is_ready = valid = notify_when_ready = _no_value
    __len__, __eq__ = _no_len, _same_object


@torch._library.register_fake_class("dtorch::TensorPromise")
class FakeTensorPromise:
    def __init__(self, kind: str):
        self._kind = kind

    __obj_unflatten__ = classmethod(_unflatten)

    def kind(self) -> str:
        return self._kind

    def _not_traceable(self, *args):
        raise RuntimeError(
            "dtorch: TensorPromise methods cannot run inside a traced graph; call "
            "torch.ops.dtorch.get_tensor(t, promise) there instead"
        )

    set_value = set_exception = get_future = serialize = _not_traceable
    __len__, __eq__ = _no_len, _same_object


@torch._library.register_fake_class("dtorch::ReadyNotifier")
class FakeReadyNotifier:
    """An event loop's wake-up channel; it has no business inside a traced graph."""

    def __init__(self, kind: str):
        self._kind = kind

    __obj_unflatten__ = classmethod(_unflatten)

    def _not_traceable(self, *args):
        raise RuntimeError("dtorch: a ReadyNotifier cannot be used inside a traced graph")

    fileno = drain = _not_traceable
    __len__, __eq__ = _no_len, _same_object


@torch.library.register_fake("dtorch::get_tensor")
def _get_tensor_fake(input, promise):
    _require_fake_mode("get_tensor", input)
    return None


@torch.library.register_fake("dtorch::get_tensor_async")
def _get_tensor_async_fake(input):
    _require_fake_mode("get_tensor_async", input)
    # The op's output must convert to the schema's class type (a FakeScriptObject does not), so
    # the fake output is a real future that can only report that it came from tracing. On torch
    # 2.13 Dynamo then graph-breaks at the op and runs it eagerly; capturing it in the graph is
    # the torch.compile work (see tests/test_compile.py).
    promise = torch.classes.dtorch.TensorPromise("memory")
    future = promise.get_future()
    promise.set_exception(
        "this TensorFuture came from dtorch::get_tensor_async's fake kernel (tracing) and holds "
        "no value"
    )
    return future


def _reject_dtensor(cls, func, types, args=(), kwargs=None):
    raise TypeError(
        f"dtorch: {func} expects a local tensor, got a DTensor: pass t.to_local() "
        "(or t.full_tensor()) instead"
    )


def _register_dtensor_rules(dtensor_module) -> None:
    for op in ("dtorch::get_tensor", "dtorch::get_tensor_async"):
        torch.library.register_torch_dispatch(op, dtensor_module.DTensor, _reject_dtensor)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers the DTensor rules when torch.distributed.tensor is first imported.

    Importing it eagerly would add ~0.6 s to ``import dtorch_ops``; a DTensor cannot exist before
    that module is imported, so registering then is early enough.
    """

    _NAME = "torch.distributed.tensor"

    def find_spec(self, name, path, target=None):
        if name != self._NAME:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _register_dtensor_rules(module)

        spec.loader.exec_module = exec_then_register
        return spec


if torch.distributed.is_available():
    if _RegisterOnImport._NAME in sys.modules:
        _register_dtensor_rules(sys.modules[_RegisterOnImport._NAME])
    else:
        sys.meta_path.insert(0, _RegisterOnImport())
