"""The TorchScript objects (``torch.classes.dtorch.*``) behind the Python wrappers: a wrapper's
handle from a raw object, its ``raw`` made on first use, their names in messages, and the
truthiness and copy behaviour of raw dtorch objects (patched at import)."""
import torch

from .compile.eager import _InGraphEagerly
from .compile.tracing import _is_dynamo_compiling


def _handle_from_script(handle_class, obj):
    """The _C handle of `obj` if it is a raw dtorch object of handle_class's class, else None
    (each caller words its own TypeError)."""
    if not isinstance(obj, torch.ScriptObject):
        return None
    try:
        return handle_class.from_script(obj)
    except TypeError:
        return None


def _a(name: str) -> str:
    """`name` with its article: "an ObjectFuture", "a TensorFuture"."""
    return ("an " if name[:1].lower() in "aeiou" else "a ") + name


def _script_name(obj) -> str:
    """'torch.classes.dtorch.X' for a raw dtorch object, else the Python type's name."""
    if isinstance(obj, torch.ScriptObject):
        return obj._type().qualified_name().replace("__torch__.", "")
    return type(obj).__name__


def _script_object_of(handle_owner):
    """The `raw` of a future or promise: the TorchScript object of its handle's state, made on
    first use and kept (a graph break under Dynamo, which cannot trace the binding)."""
    if _is_dynamo_compiling():
        return _InGraphEagerly.get_member(handle_owner, "raw")
    raw = getattr(handle_owner, "_raw", None)
    if raw is None:
        raw = handle_owner._raw = handle_owner._h.script()
    return raw


# What `capsule` gives, per wrapper class: see _passing_hint_of.
_passing_hints: dict = {}


def _passing_hint_of(handle_owner):
    """The `capsule` of a future or promise wrapper. Where TorchScript expects a
    torch.classes.dtorch object (a scripted function's argument, a torch.ops call) and gets a
    Python object, it tries to build one from that object's `capsule` attribute, without checking
    what the capsule holds against the class it expects: a capsule of this wrapper's state would
    pass a VoidPromise where a TensorPromise is expected and corrupt memory. So the attribute is
    an object whose class name is the hint in torch's cast error ("Unable to cast Python instance
    of type <class 'dtorch_ops: pass promise.raw ...'>")."""
    # The library's own class (a user's subclass of it says the same).
    name = next(c.__name__ for c in type(handle_owner).__mro__
                if c.__module__.startswith("dtorch_ops"))
    hint = _passing_hints.get(name)
    if hint is None:
        variable = "future" if "Future" in name else "promise"
        hint = type("hint", (), {"__slots__": ()})
        hint.__module__ = "dtorch_ops"
        if name == "ObjectFuture":
            hint.__qualname__ = (" an ObjectFuture holds a Python value, which TorchScript cannot "
                                 "carry (then() gives a TensorFuture when its callback returns "
                                 "a tensor)")
        else:
            hint.__qualname__ = (f" a dtorch_ops wrapper is not a TorchScript object: pass the "
                                 f".raw of the promise or future expected here (this "
                                 f"dtorch_ops.{name}'s {variable}.raw is a "
                                 f"torch.classes.dtorch.{name})")
        hint = _passing_hints[name] = hint()
    return hint


def _patch_script_objects() -> None:
    """Raw dtorch objects are handles: truthy, and never copied.

    torch.ScriptObject's bool() falls back to len() (which ours refuse) and its copy.copy()
    returns a second reference to the same C++ object while copy.deepcopy() refuses. Both are
    fixed for dtorch's classes only; every other script object behaves as before.
    """
    script_object = torch.ScriptObject
    if getattr(script_object, "_dtorch_patched", False):
        return
    original_copy = script_object.__copy__

    def ours(obj) -> bool:
        return obj._type().qualified_name().startswith("__torch__.torch.classes.dtorch.")

    def __bool__(self):
        return True if ours(self) else len(self) != 0

    def __copy__(self):
        if ours(self):
            raise TypeError(f"dtorch: a {_script_name(self)} cannot be copied; it is a handle to "
                            "one promise or future (pass the object itself)")
        return original_copy(self)

    script_object.__bool__ = __bool__
    script_object.__copy__ = __copy__
    script_object._dtorch_patched = True


_patch_script_objects()
