"""The raw ops inside torch.compile graphs: Dynamo traces a call of

    torch.ops.dtorch.get_tensor_async(t)            as dtorch_ops.to_torch_async(t)
    torch.ops.dtorch.copy_to_host_async(t)          as dtorch_ops.to_torch_async(t, device="cpu")
    torch.ops.dtorch.copy_list_to_host_async(ts)    as dtorch_ops.to_torch_async(ts, device="cpu")
    torch.ops.dtorch.sync(devices)                  as dtorch_ops.sync_async(devices)

(the op packet or its ``.default`` overload), which compile into the graph as the ordered ops of
``graph_ops`` returning the Python future classes: no graph break, and the future the compiled
call returns has the raw methods (get, wait(ms), is_ready, valid) and the Python API's (await,
the torch.futures names). Eager calls, TorchScript and torch.export's non-strict mode (no Dynamo)
call the C++ op as before.

Why a substitution: Dynamo keeps an op's output only if it is a tensor, a FakeScriptObject or an
object of a registered opaque type (``torch/_dynamo/variables/builder.py``,
``handle_traced_output``). The C++ op returns a TorchScript object, and its fake kernel cannot
return a FakeScriptObject: the dispatcher converts a kernel's output to the schema's class
(``TorchBindOpOverload`` dispatches in Python only for script-object *inputs*). So the op itself
cannot be traced without a change to PyTorch; its Python form can.

How: ``torch._dynamo.substitute_in_graph`` makes Dynamo inline a Python function in place of
another, but takes functions only (it refuses an OpOverload), so ``_register`` makes the same
three registrations it makes (``VariableBuilder._id_dispatch``,
``trace_rules._polyfilled_function_ids``, ``PolyfilledFunctionVariable._get_polyfill_handlers``;
the same in torch 2.13, 2.14.1 and 2.15.0, whose ``scripts/compat.sh`` runs pin them) for the op
objects. Where a torch lacks them, the raw op keeps Dynamo's own graph break (a
warning says so, where the graph ops exist). Where the graph ops do not exist (no opaque types),
the stand-ins run the raw op eagerly: a graph break with a reason that says so.

When: once torch._dynamo is imported (importing it with dtorch_ops would cost ~2 s; no graph is
traced before).
"""
import warnings

import torch

from .. import functions
from .._on_import import register_on_import
from . import graph_ops
from .eager import _InGraphEagerly

_ops = torch.ops.dtorch
_Tensor = torch.Tensor
_device = torch.device

# Why a raw op breaks the graph where the graph ops do not exist (also reached through
# dtorch_ops.to_torch_async / sync_async there, which call the raw ops): a torch before opaque
# types, or one that refused their registration (graph_ops warned at import).
if graph_ops._returns_opaques_from_graphs():
    _NO_GRAPH_OPS = (f"torch {torch.__version__} refused dtorch_ops' graph ops (see the warning "
                     "at import), so torch.ops.dtorch.{name} runs eagerly (a graph break)")
else:
    _NO_GRAPH_OPS = (f"torch {torch.__version__} cannot return an opaque future from a compiled "
                     "graph, so torch.ops.dtorch.{name} runs eagerly (a graph break); torch >= "
                     "2.12 compiles it into the graph")

# Whether Dynamo traces the raw ops as their stand-ins (set once torch._dynamo is imported).
registered = False


# The stand-ins: what Dynamo traces in place of each raw op (same parameters). They take what the
# op's schema takes, and refuse the rest as the op does eagerly (the Python API takes more, e.g.
# one device for sync), so that code that compiles also runs eagerly and in TorchScript.


def _check_tensor(value, op: str, argument: str) -> None:
    if not isinstance(value, _Tensor):
        raise TypeError(f"torch.ops.dtorch.{op} expects a Tensor for {argument}, got "
                        f"{type(value).__name__}")


def get_tensor_async(input):
    _check_tensor(input, "get_tensor_async", "input")
    if graph_ops.defined_ops is None:
        return _InGraphEagerly.raw_get_tensor_async(input)
    return functions.to_torch_async(input)


def copy_to_host_async(input):
    _check_tensor(input, "copy_to_host_async", "input")
    if graph_ops.defined_ops is None:
        return _InGraphEagerly.raw_copy_to_host_async(input)
    return functions.to_torch_async(input, device="cpu")


def copy_list_to_host_async(inputs):
    if not isinstance(inputs, (list, tuple)):
        raise TypeError(f"torch.ops.dtorch.copy_list_to_host_async expects a list of Tensors for "
                        f"inputs, got {type(inputs).__name__}")
    for input in inputs:
        _check_tensor(input, "copy_list_to_host_async", "each of inputs")
    if graph_ops.defined_ops is None:
        return _InGraphEagerly.raw_copy_list_to_host_async(inputs)
    return functions.to_torch_async(list(inputs), device="cpu")


def sync(devices=None):
    if devices is not None:
        if not isinstance(devices, (list, tuple)):
            raise TypeError(f"torch.ops.dtorch.sync expects None or a list of devices, got "
                            f"{type(devices).__name__} (dtorch_ops.sync_async takes one device)")
        for device in devices:
            if not isinstance(device, (str, _device)):
                raise TypeError(f"torch.ops.dtorch.sync expects devices as str or torch.device, "
                                f"got {type(device).__name__}")
    if graph_ops.defined_ops is None:
        return _InGraphEagerly.raw_sync(devices)
    return functions.sync_async(devices)


# Each raw op's name -> its stand-in.
_STAND_INS = {fn.__name__: fn for fn in
              (get_tensor_async, copy_to_host_async, copy_list_to_host_async, sync)}


def _eager_call(name):
    op = getattr(_ops, name).default

    def call(*args):
        return op(*args)

    call.__name__ = call.__qualname__ = f"torch.ops.dtorch.{name}"  # as the graph break names it
    return call


for _name in _STAND_INS:
    _InGraphEagerly.add_function(f"raw_{_name}", _eager_call(_name),
                                 reason=_NO_GRAPH_OPS.format(name=_name))

# The op objects Dynamo was told to substitute (packets and overloads): kept alive with the
# registrations, which are keyed by id().
_substituted = []


def _register(_dynamo_module) -> bool:
    """Makes Dynamo trace each raw op (packet and overloads) as its stand-in; False (and a
    warning where the graph ops exist) on a torch whose Dynamo lacks the registrations."""
    try:
        from torch._dynamo.guards import GuardBuilder
        from torch._dynamo.trace_rules import _polyfilled_function_ids
        from torch._dynamo.variables.builder import VariableBuilder
        from torch._dynamo.variables.functions import PolyfilledFunctionVariable
        from torch._dynamo.variables.torch import TorchInGraphFunctionVariable

        id_dispatch = VariableBuilder._id_dispatch()
        handlers = PolyfilledFunctionVariable._get_polyfill_handlers()
        id_match = GuardBuilder.ID_MATCH
        add_polyfilled_id = _polyfilled_function_ids.add
    except (ImportError, AttributeError) as e:
        if graph_ops.defined_ops is not None:
            warnings.warn(f"dtorch_ops: the raw ops (torch.ops.dtorch.get_tensor_async, sync) "
                          f"break compiled graphs on torch {torch.__version__}, whose Dynamo "
                          f"lacks what they are traced through ({type(e).__name__}: {e}); "
                          "dtorch_ops.to_torch_async / sync_async compile", stacklevel=2)
        return False

    class RawOpVariable(PolyfilledFunctionVariable):
        """A raw op: calling it (or an overload of it) traces its stand-in; any other method
        (``overloads()``, ...) is what Dynamo does for an op (a polyfill would take the method
        for a function to substitute)."""

        @classmethod
        def _get_polyfill_handlers(cls):
            return handlers  # the base class's (its cache is per class)

        def call_method(self, tx, name, args, kwargs):
            if name == "__call__":
                return self.call_function(tx, args, kwargs)
            if id(getattr(self.fn, name, None)) in id_dispatch:  # packet.default(...)
                return super().call_method(tx, name, args, kwargs)
            return TorchInGraphFunctionVariable(self.fn, source=self.source).call_method(
                tx, name, args, kwargs)

    def as_stand_in(builder, value):
        guards = builder.install_guards(id_match) or {}  # None for a constant source
        return RawOpVariable(value, source=builder.source, **guards)

    for name, stand_in in _STAND_INS.items():
        packet = getattr(_ops, name)
        for op in (packet, *(getattr(packet, overload) for overload in packet.overloads())):
            if id(op) in id_dispatch:
                continue  # registered already: dtorch_ops reloaded, whose first stand-ins stay

            def handler(*args, _op=op, **kwargs):  # what substitute_in_graph's wrapper is
                return _op(*args, **kwargs)

            handler.__torch_dynamo_original__ = op
            handler.__torch_dynamo_polyfill__ = stand_in
            handler.__torch_dynamo_can_constant_fold_through__ = False
            id_dispatch[id(op)] = as_stand_in
            add_polyfilled_id(id(op))
            handlers[op] = handler
            _substituted.append(op)
    global registered
    registered = True
    return True


register_on_import({"torch._dynamo": _register})
