"""What a call sees of tracing: whether Dynamo compiles it, whether this thread traces under
torch.export, and what kind of tensor it was given (a FakeTensor or FunctionalTensor of tracing,
a wrapper subclass with its own ``__torch_dispatch__``, a DTensor).

Written so that Dynamo evaluates them while it traces (no import, no binding call).
"""
import sys

import torch

_Tensor = torch.Tensor
# Folded to True by Dynamo while it traces.
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling
# What the library asks for torch.compiler.is_compiling() (True also under torch.export's
# non-strict tracing, where graph breaks do not exist) is
#     _is_dynamo_compiling() or _compiler._is_compiling_flag
# at half its cost (one Python call, not two: is_compiling() also asks torch.jit.is_scripting()).
# Under Dynamo the call folds to True, so the flag (a module global Dynamo would guard on) is
# never read while tracing; outside it the flag is what is_compiling() returns (set by
# torch.export's tracing and by a compile session).
_compiler = torch.compiler


def _check_local_tensor(t, what: str) -> None:
    if not isinstance(t, _Tensor):
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


def _is_tracing_tensor(t) -> bool:
    """FakeTensor / FunctionalTensor: stand-ins of tracing, dispatched through their modes."""
    for name, cls in (("torch._subclasses.fake_tensor", "FakeTensor"),
                      ("torch._subclasses.functional_tensor", "FunctionalTensor")):
        module = sys.modules.get(name)
        if module is not None and isinstance(t, getattr(module, cls)):
            return True
    return False


def _defines_torch_dispatch(t) -> bool:
    """A tensor subclass with its own __torch_dispatch__ (a wrapper such as TwoTensor; not an
    nn.Parameter). Written so that Dynamo evaluates it on the traced tensor's type."""
    return type(t) is not _Tensor and type(t).__torch_dispatch__ is not _Tensor.__torch_dispatch__


def _fake_mode_active() -> bool:
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def _tracing_here() -> bool:
    """Whether this thread traces without Dynamo (torch.export's non-strict mode runs the module's
    Python under a fake or proxy mode, which are per thread). is_compiling() alone will not do: it
    is a process-wide flag, True in every thread while any thread compiles."""
    modes = torch._C._TorchDispatchModeKey
    return (torch._C._get_dispatch_mode(modes.FAKE) is not None
            or torch._C._get_dispatch_mode(modes.PROXY) is not None)


def _above_subclass(t, what: str) -> bool:
    """For a tensor that is not exactly torch.Tensor: checks it, and says whether our op must run
    above its __torch_dispatch__ (a wrapper subclass: the future then yields the subclass itself,
    not what its dispatch would pass on)."""
    _check_local_tensor(t, what)
    return (torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python)
            and not _is_tracing_tensor(t))
