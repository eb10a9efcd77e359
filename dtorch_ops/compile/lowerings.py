"""How inductor lowers the ops, and what a DTensor gets from them: registered when inductor's
lowering module and torch.distributed.tensor are imported (too costly to import with dtorch_ops).
"""
import torch

from .._on_import import register_on_import
# The Python-defined ops, which these rules cover too (_defined_ops), are defined there.
from . import opaque_types  # noqa: F401


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
