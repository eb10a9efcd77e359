"""The exceptions dtorch_ops raises for a future or promise, one class per cause.

Every class derives from ``FutureError`` (a ``RuntimeError``), so ``except RuntimeError`` keeps
working; some also derive from the built-in a Python user expects (``TimeoutError`` for a timed
out wait, ``TypeError`` for pickling a promise that cannot leave its process, ``ValueError`` for a
malformed serialized promise). The C++ core gives each error a code; the binding picks the class
by that code (``code`` below), never by reading the message. Raw TorchScript objects
(``torch.classes.dtorch.*``) raise plain ``RuntimeError`` / ``TypeError`` / ``ValueError``.
"""
from __future__ import annotations


class FutureError(RuntimeError):
    """Base class: a future or promise of dtorch_ops failed."""

    code = "unknown"


class BrokenPromiseError(FutureError):
    """The promise is gone without a value: destroyed unset, or every process that held it died,
    exited or dropped it ("producer died (pid N)"), or none held it in time."""

    code = "broken_promise"


class PromiseAlreadySatisfiedError(FutureError):
    """A second set on a promise (any process): a promise is fulfilled once."""

    code = "promise_already_satisfied"


class FutureAlreadyRetrievedError(FutureError):
    """get_future() called twice, or on a promise whose future lives in another process."""

    code = "future_already_retrieved"


class FutureConsumedError(FutureError):
    """get() already took the value: get() yields it once (wait(), result() and value() read
    it again)."""

    code = "no_state"


class FutureTimeoutError(FutureError, TimeoutError):
    """A wait's timeout elapsed (wait, result, wait_all, as_completed, a collect_all timeout);
    the futures waited for stay as they were."""

    code = "timeout"


class ProducerError(FutureError):
    """The producer failed the promise: set_exception(message), an exception of a type that is
    not a built-in one set in another process (its type is named in the message), or a value
    its set_value / get_tensor refused (the refusal's message)."""

    code = "producer_error"


class DeviceError(FutureError):
    """The device reported an error for the work that produces the value."""

    code = "device_error"


class DroppedAtExitError(FutureError):
    """The value was still pending when the library stopped at interpreter exit."""

    code = "dropped_at_exit"


class DroppedAtForkError(FutureError):
    """The value was pending in the parent when this process forked."""

    code = "dropped_at_fork"


class CannotLeaveProcessError(FutureError, TypeError):
    """A handle was used outside the process it belongs to: a memory promise pickled or
    serialized, or fulfilled in a forked child; a file future used in a forked child."""

    code = "cannot_leave_process"


class InvalidHandleError(FutureError, ValueError):
    """A serialized promise is malformed, tampered with, or names no promise of this user."""

    code = "invalid_handle"


class SharedMemoryError(FutureError):
    """The shared-memory transport failed (/dev/shm full, a segment gone)."""

    code = "shared_memory"


class FutureNotReadyError(FutureError):
    """value() on a future that is not complete yet: wait for it first (wait(), await, a done
    callback), or call get(), which blocks."""

    code = "not_ready"


# The exceptions a consumer raises as they are when a producer in another process set one of
# them with set_exception(exc) (their type's name travels; others become a ProducerError).
_BUILTIN_TYPES = {cls.__name__: cls for cls in (
    Exception, ArithmeticError, AssertionError, AttributeError, BufferError, EOFError,
    FloatingPointError, ImportError, IndexError, KeyError, LookupError, MemoryError,
    ModuleNotFoundError, NameError, NotImplementedError, OSError, OverflowError, RecursionError,
    ReferenceError, RuntimeError, SyntaxError, TimeoutError, TypeError, UnboundLocalError,
    UnicodeError, ValueError, ZeroDivisionError, ConnectionError, BrokenPipeError,
    ConnectionAbortedError, ConnectionRefusedError, ConnectionResetError, FileExistsError,
    FileNotFoundError, InterruptedError, IsADirectoryError, NotADirectoryError, PermissionError,
    ProcessLookupError, ChildProcessError)}


def _exception_parts(exception: BaseException) -> tuple[str, str, str]:
    """(type name, message, traceback text) of an exception set on a promise: what travels to a
    consumer in another process. The name is the built-in's ("ValueError") or "module.QualName";
    the message the exception's one string argument, else str(exception)."""
    import traceback

    cls = type(exception)
    if cls.__module__ == "builtins":
        name = cls.__qualname__
    else:
        name = f"{cls.__module__}.{cls.__qualname__}"
    name = "".join(c if (c.isascii() and (c.isalnum() or c in "._")) else "_" for c in name)[:127]
    args = exception.args
    message = args[0] if len(args) == 1 and isinstance(args[0], str) else str(exception)
    trace = ""
    if exception.__traceback__ is not None:
        trace = "".join(traceback.format_exception(exception))
    # (Text crosses to C++ strings and messages: a NUL would cut it short there.)
    return name, message.replace("\0", "\\x00"), trace.replace("\0", "\\x00")


def _producer_exception(type_name: str, message: str, trace: str):
    """What a consumer raises for an exception a producer in another process set: the built-in
    type it was, with its message (ProducerError naming the type for other types), and a note
    with the producer's traceback (the binding calls this)."""
    exception = None
    cls = _BUILTIN_TYPES.get(type_name)
    if cls is not None:
        try:
            exception = cls(message)
        except Exception:  # noqa: BLE001 (a type that takes other arguments)
            exception = None
    if exception is None:
        exception = ProducerError(f"dtorch: producer error: {type_name}: {message}")
    note = "dtorch_ops: set by the producer with set_exception()"
    if trace:
        note += "; the producer's traceback:\n" + trace.rstrip()
    if hasattr(exception, "add_note"):
        exception.add_note(note)
    return exception


_BY_CODE = {cls.code: cls for cls in FutureError.__subclasses__()}
_BY_CODE.update({cls.code: cls for cls in (FutureTimeoutError, CannotLeaveProcessError,
                                           InvalidHandleError)})
_BY_CODE["unknown"] = FutureError

__all__ = [name for name, value in list(globals().items())
           if isinstance(value, type) and issubclass(value, FutureError)]
