"""Ops that create futures and fulfil promises inside torch.compile graphs: the Python future and
promise classes as opaque types.

Dynamo accepts an op's output only if it is a tensor, a FakeScriptObject or an object of a
registered opaque type; a TorchScript object (what ``dtorch::get_tensor_async`` returns) is none
of these, and a fake kernel cannot stand in for one (the dispatcher converts a fake kernel's output
to the schema's C++ class). So the Python future classes are registered as reference-type opaque
objects (``torch._library.opaque_object``), and two ops defined here return them:

    dtorch::to_torch_async(Tensor input) -> dtorch_ops.futures.TensorFuture
    dtorch::to_host_async(Tensor input) -> dtorch_ops.futures.TensorFuture
    dtorch::to_host_list_async(Tensor[] inputs) -> dtorch_ops.futures.TensorListFuture
    dtorch::sync_async(Device[]? devices=None) -> dtorch_ops.futures.VoidFutureCollect

(``to_host_async`` / ``to_host_list_async``: the host copy, ``to_torch_async(t, device="cpu")``,
over the C++ ``copy_to_host_async`` / ``copy_list_to_host_async``.) Their kernels call the C++
ops through the binding and wrap the result; their fake kernels make a
placeholder future (it fails with a message saying where it came from); they are ordered effects,
so a compiled graph keeps them, runs them once per call and records the completion right after the
value's producer. ``dtorch_ops.to_torch_async`` / ``sync_async`` call them only while compiling:
eager calls keep the direct binding (one C++ call, no dispatcher round trip through Python).

The Python promise classes are opaque reference types too, taken by two more ops, so that a
compiled step fulfils a promise created outside without its TorchScript object (made on first use
of ``.raw`` only: ~290 bytes a promise would otherwise carry from birth):

    dtorch::get_tensor_opaque(Tensor input, dtorch_ops.promises.TensorPromise promise) -> ()
    dtorch::sync_into_opaque(Device[]? devices, dtorch_ops.promises.VoidPromise promise) -> ()

Before torch 2.12 (Dynamo cannot return an opaque object from a graph), or where this torch refuses
these registrations, ``define`` returns None and compiled code falls back to the raw ops: a graph
break that runs them eagerly.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

NAMESPACE = "dtorch"


@dataclass(frozen=True)
class GraphOps:
    """The op overloads compiled code calls (``torch.ops.dtorch.<name>.default``)."""

    to_torch_async: torch._ops.OpOverload
    to_host_async: torch._ops.OpOverload
    to_host_list_async: torch._ops.OpOverload
    sync_async: torch._ops.OpOverload
    get_tensor: torch._ops.OpOverload  # dtorch::get_tensor_opaque
    sync_into: torch._ops.OpOverload  # dtorch::sync_into_opaque


def opaque_metaclass() -> type:
    """The metaclass the future classes need to be registered as opaque reference types
    (isinstance() then also accepts their stand-ins while tracing); ``type`` without the API."""
    try:
        from torch._opaque_base import OpaqueBaseMeta
    except ImportError:
        return type
    return OpaqueBaseMeta


def register_ordered_effect(qualname: str) -> None:
    """Marks an op as an ordered effect: compiled graphs keep it, run it once per call and do not
    reorder it. (Ops with a script-object argument are ordered effects already.)"""
    try:  # torch >= 2.12
        from torch._library.effects import EffectType

        torch.library._register_effectful_op(qualname, EffectType.ORDERED)
    except (ImportError, AttributeError):  # torch 2.11
        from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

        namespace, name = qualname.split("::")
        _register_effectful_op(getattr(getattr(torch.ops, namespace), name).default,
                               _EffectType.ORDERED)


def _returns_opaques_from_graphs() -> bool:
    """torch 2.11's Dynamo takes an opaque object from an op but cannot return one from a graph
    (no bytecode reconstruction for it: "Reconstruction failure") nor take a subclass of an opaque
    type for it; 2.12 added both (checked in their sources: torch/_dynamo/codegen.py,
    torch/_library/opaque_object.py)."""
    from torch.torch_version import TorchVersion

    return TorchVersion(torch.__version__) >= "2.12"


# What a user may call on a future; the placeholder's versions break the graph.
_WAIT_MEMBERS = ("get", "wait", "wait_for", "result", "exception", "value", "is_ready", "done",
                 "valid", "kind", "devices", "add_done_callback", "then", "to_torch_future")
# What a user may call on a promise (each breaks the graph, or refuses under export).
_PROMISE_MEMBERS = ("set_value", "set_exception", "get_future", "kind", "serialize", "raw")


def _placeholder_class(cls):
    """The class of the future a fake kernel returns while a graph is traced. A member called on
    it in the graph that created it breaks the graph (Dynamo inlines it: a static function, as a
    bound method would be run on the stand-in, where a graph break is a hard error), so the call
    runs eagerly, after the graph, on the real future. Outside Dynamo (torch.export's non-strict
    tracing) there is no graph break to take: it raises."""

    def graph_break(*args, **kwargs):
        if torch.compiler.is_dynamo_compiling():
            torch._dynamo.graph_break(msg=(
                f"a dtorch_ops.{cls.__name__} created inside a compiled region has no value "
                "while the region is traced, so waiting on it or asking its state there runs "
                "eagerly (a graph break). To compile the whole step, return the future (or store "
                "it) and call get() / wait() / is_ready() outside the compiled function"))
        raise RuntimeError(
            f"dtorch: a dtorch_ops.{cls.__name__} created while tracing (torch.export) has no "
            "value yet: waiting on it or asking its state cannot be part of the traced program. "
            "Return the future from the module and wait on it outside")

    def __repr__(self):
        # Shown where torch refuses the object, e.g. torch.export.save: "Unable to serialize
        # output <this>".
        return (f"<a dtorch_ops.{cls.__name__} created by a traced graph: an opaque Python "
                "object, which serialized programs (torch.export.save) cannot hold; return no "
                "future from a module you save>")

    def __deepcopy__(self, memo):
        return self  # a stand-in holding no value: copies of a traced program may share it

    members = {name: staticmethod(graph_break) for name in _WAIT_MEMBERS if hasattr(cls, name)}
    return type(f"_Traced{cls.__name__}", (cls,),
                {"__slots__": (), "__module__": cls.__module__, "__repr__": __repr__,
                 "__deepcopy__": __deepcopy__, **members})


def require_fake_mode(op: str, input) -> None:
    """Fake kernels also serve as Meta kernels; a real meta tensor has no value to hand over."""
    try:
        torch.library.get_ctx()
    except RuntimeError:
        raise NotImplementedError(
            f"dtorch::{op}: meta tensors have no value to hand over; pass a tensor on a real "
            "device (or trace under FakeTensorMode)"
        ) from None


# Kept alive for the process: the ops' definitions live as long as this Library object.
_library = None

# The ops define() made, which compiled code calls to create futures and fulfil promises; None
# before it runs and on a torch without opaque types (compiled code then falls back to the raw
# ops, and promises carry their TorchScript object from birth). Read at each call, never copied.
defined_ops: GraphOps | None = None


def define(tensor_future_cls, list_future_cls, collect_cls, tensor_promise_cls, void_promise_cls,
           c_module) -> GraphOps | None:
    """Registers the future and promise classes as opaque types and defines the ops; None where
    this torch cannot (compiled code then falls back to a graph break, and to the promises'
    TorchScript objects). The result is also kept as ``defined_ops``."""
    global defined_ops
    defined_ops = _define(tensor_future_cls, list_future_cls, collect_cls, tensor_promise_cls,
                          void_promise_cls, c_module)
    return defined_ops


def _define(tensor_future_cls, list_future_cls, collect_cls, tensor_promise_cls,
            void_promise_cls, c_module) -> GraphOps | None:
    global _library
    try:
        from torch._library.opaque_object import get_opaque_type_name, register_opaque_type
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError:
        return None
    if not isinstance(tensor_future_cls, opaque_metaclass()) or not _returns_opaques_from_graphs():
        return None
    try:
        classes = (tensor_future_cls, list_future_cls, collect_cls, tensor_promise_cls,
                   void_promise_cls)
        for cls in classes:
            register_opaque_type(cls, typ="reference")
        future_type, list_future_type, collect_type, tensor_promise_type, void_promise_type = (
            get_opaque_type_name(cls) for cls in classes)
        library = torch.library.Library(NAMESPACE, "FRAGMENT")
        # Library.define rather than torch.library.custom_op: ~20 % less per call.
        library.define(f"to_torch_async(Tensor input) -> {future_type}")
        library.define(f"to_host_async(Tensor input) -> {future_type}")
        library.define(f"to_host_list_async(Tensor[] inputs) -> {list_future_type}")
        library.define(f"sync_async(Device[]? devices=None) -> {collect_type}")
        library.define(f"get_tensor_opaque(Tensor input, {tensor_promise_type} promise) -> ()")
        library.define(f"sync_into_opaque(Device[]? devices, {void_promise_type} promise) -> ()")
    except Exception as e:  # a torch whose opaque API differs: the graph-break fallback
        warnings.warn(f"dtorch_ops: futures made inside torch.compile graphs fall back to a graph "
                      f"break on torch {torch.__version__} ({type(e).__name__}: {e})",
                      stacklevel=4)
        return None

    # Members Dynamo may reach (any other is a hard error there): on a future passed into a graph
    # they break the graph and run eagerly (C++ calls Dynamo cannot trace, or Python ones that
    # say why); on one the graph itself creates, the placeholder's break the graph with a message
    # naming the form that compiles.
    from torch._library.opaque_object import MemberType, get_opaque_obj_info

    for cls in (tensor_future_cls, list_future_cls, collect_cls):
        get_opaque_obj_info(cls).members.update(
            {name: MemberType.INLINED for name in (*_WAIT_MEMBERS, "raw") if hasattr(cls, name)})
    # A promise's methods break the graph (or refuse under export) before touching its state.
    for cls in (tensor_promise_cls, void_promise_cls):
        get_opaque_obj_info(cls).members.update(
            {name: MemberType.INLINED for name in _PROMISE_MEMBERS if hasattr(cls, name)})
    placeholder_future_cls = _placeholder_class(tensor_future_cls)
    placeholder_list_future_cls = _placeholder_class(list_future_cls)
    placeholder_collect_cls = _placeholder_class(collect_cls)
    wrap_future = tensor_future_cls._wrap
    wrap_list_future = list_future_cls._wrap
    wrap_collect = collect_cls._wrap
    c_get_tensor_async = c_module.get_tensor_async
    c_copy_to_host_async = c_module.copy_to_host_async
    c_copy_list_to_host_async = c_module.copy_list_to_host_async
    c_sync_async = c_module.sync_async
    c_get_tensor = c_module.get_tensor
    c_sync_into = c_module.sync_into

    # Detached here whether or not the input requires grad now: inside a compiled forward it does
    # not, but the tensor a graph returns is the one autograd then gives a grad_fn, which the
    # future must not hold (the eager rule, DetachedValue in csrc/ops/get_tensor.h).
    def to_torch_async(input):
        return wrap_future(c_get_tensor_async(input.detach()))

    def to_host_async(input):
        return wrap_future(c_copy_to_host_async(input))

    def to_host_list_async(inputs):
        return wrap_list_future(c_copy_list_to_host_async(inputs))

    def sync_async(devices=None):
        return wrap_collect(c_sync_async(devices))

    def get_tensor_opaque(input, promise):
        c_get_tensor(input.detach(), promise._h)

    def sync_into_opaque(devices, promise):
        c_sync_into(devices, promise._h)

    library.impl("to_torch_async", to_torch_async, "CompositeExplicitAutograd")
    library.impl("to_host_async", to_host_async, "CompositeExplicitAutograd")
    library.impl("to_host_list_async", to_host_list_async, "CompositeExplicitAutograd")
    library.impl("sync_async", sync_async, "CompositeExplicitAutograd")
    library.impl("get_tensor_opaque", get_tensor_opaque, "CompositeExplicitAutograd")
    library.impl("sync_into_opaque", sync_into_opaque, "CompositeExplicitAutograd")

    # Fake kernels: Dynamo needs an instance of the registered class, not a fake object. Made
    # outside the fake mode (newer torch refuses reference opaques created under it); a
    # placeholder future fails with a message saying where it came from, should anything wait on
    # it; a placeholder collect spans no device.
    def placeholder_future(op):
        with unset_fake_temporarily():
            promise = c_module.TensorPromise("memory")
            promise.set_exception(f"this future is dtorch::{op}'s placeholder made while "
                                  "tracing; it holds no value")
            return placeholder_future_cls._wrap(promise.get_future())

    def to_torch_async_fake(input):
        require_fake_mode("to_torch_async", input)
        return placeholder_future("to_torch_async")

    def to_host_async_fake(input):
        require_fake_mode("to_host_async", input)
        return placeholder_future("to_host_async")

    def to_host_list_async_fake(inputs):
        for input in inputs:
            require_fake_mode("to_host_list_async", input)
        with unset_fake_temporarily():
            return placeholder_list_future_cls._wrap(c_module.failed_tensor_list_future(
                "this future is dtorch::to_host_list_async's placeholder made while tracing; it "
                "holds no value"))

    def sync_async_fake(devices=None):
        with unset_fake_temporarily():
            return placeholder_collect_cls._wrap(c_sync_async([]))

    def get_tensor_opaque_fake(input, promise):
        require_fake_mode("get_tensor_opaque", input)

    torch.library.register_fake(f"{NAMESPACE}::to_torch_async", to_torch_async_fake,
                                lib=library)
    torch.library.register_fake(f"{NAMESPACE}::to_host_async", to_host_async_fake, lib=library)
    torch.library.register_fake(f"{NAMESPACE}::to_host_list_async", to_host_list_async_fake,
                                lib=library)
    torch.library.register_fake(f"{NAMESPACE}::sync_async", sync_async_fake, lib=library)
    torch.library.register_fake(f"{NAMESPACE}::get_tensor_opaque", get_tensor_opaque_fake,
                                lib=library)
    torch.library.register_fake(f"{NAMESPACE}::sync_into_opaque", lambda devices, promise: None,
                                lib=library)
    for name in ("to_torch_async", "to_host_async", "to_host_list_async", "sync_async",
                 "get_tensor_opaque", "sync_into_opaque"):
        register_ordered_effect(f"{NAMESPACE}::{name}")

    def refuse_vmap(name):
        def refuse(info, in_dims, *args):
            # As the C++ ops refuse eagerly (FuncTorchDynamicLayerFrontMode): compiled code under
            # torch.func.vmap reaches these Python ops instead.
            raise RuntimeError(
                f"dtorch: {name} cannot run inside a torch.func transform (vmap): its future "
                "would hold the transform's internal tensor, which carries no batch dimension. "
                "Take the value outside the transform")

        return refuse

    for name, op in (("to_torch_async", "to_torch_async"), ("get_tensor", "get_tensor_opaque"),
                     ("to_torch_async(t, device='cpu')", "to_host_async"),
                     ("to_torch_async([...], device='cpu')", "to_host_list_async")):
        torch.library.register_vmap(f"{NAMESPACE}::{op}", refuse_vmap(name), lib=library)
    _library = library
    ops = torch.ops.dtorch
    return GraphOps(to_torch_async=ops.to_torch_async.default,
                    to_host_async=ops.to_host_async.default,
                    to_host_list_async=ops.to_host_list_async.default,
                    sync_async=ops.sync_async.default,
                    get_tensor=ops.get_tensor_opaque.default,
                    sync_into=ops.sync_into_opaque.default)
