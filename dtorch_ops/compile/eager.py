"""What compiled code calls to run a call eagerly: ``torch.compiler.disable``'d callers, so that
Dynamo breaks the graph at the user's call with the reason given."""
import torch

from .._on_import import register_on_import

_PROMISE_FORMS = ("The forms that compile: dtorch_ops.get_tensor(t, promise) / sync_into(devices, "
                  "promise) with a promise created outside, or dtorch_ops.to_torch_async(t) / "
                  "sync_async(), which return the future")


class _InGraphEagerly:
    """What compiled code calls to run a call eagerly: torch.compiler.disable'd versions of our
    functions, so that Dynamo breaks the graph at the user's call with the reason given (a plain
    graph break would trace the rest of our function in a resumed frame). Made when torch._dynamo
    is imported (no graph is traced before), as importing it with dtorch_ops would cost ~1 s.

    The module-level functions that need one (``to_torch``, ``to_torch_async``, the raw ops' eager
    calls) add themselves with ``add_function``."""

    to_torch = to_torch_async = call_member = get_member = None
    # The raw ops, where compiled code cannot hold their futures (compile/raw_ops.py).
    raw_get_tensor_async = raw_copy_to_host_async = raw_copy_list_to_host_async = raw_sync = None
    # A promise's method name -> a caller running promise.<name>(*args) eagerly.
    promise_methods = {}
    # name -> (function, reason): made into cls.<name> once torch._dynamo is imported.
    _functions = {}
    _defined = False

    @classmethod
    def add_function(cls, name: str, function, reason: str) -> None:
        """cls.<name>: `function` disabled for Dynamo with `reason` (at once if torch._dynamo is
        imported already, else when it is)."""
        cls._functions[name] = (function, reason)
        if cls._defined:
            cls._define_function(name)

    @classmethod
    def _define_function(cls, name: str) -> None:
        function, reason = cls._functions[name]
        setattr(cls, name, staticmethod(torch.compiler.disable(function, reason=reason)))

    @classmethod
    def define(cls, _dynamo_module) -> None:
        disable = torch.compiler.disable

        def promise_method(name):
            return disable(lambda promise, *args: getattr(promise, name)(*args), reason=(
                f"a dtorch_ops promise's {name}() inside a compiled region runs eagerly (a graph "
                f"break). {_PROMISE_FORMS}"))

        cls.promise_methods = {name: promise_method(name)
                               for name in ("get_future", "set_exception", "set_value")}
        waiting = ("waiting on a dtorch_ops future, or asking its state, inside a compiled "
                   "region runs eagerly (a graph break). To compile the whole step, call get() / "
                   "wait() / is_ready() / kind() / .raw outside the compiled function")
        cls.call_member = staticmethod(disable(
            lambda obj, name, *args, **kwargs: getattr(obj, name)(*args, **kwargs),
            reason=waiting))
        cls.get_member = staticmethod(disable(getattr, reason=waiting))
        cls._defined = True
        for name in cls._functions:
            cls._define_function(name)


register_on_import({"torch._dynamo": _InGraphEagerly.define})
