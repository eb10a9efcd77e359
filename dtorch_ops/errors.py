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
    """The promise is gone without a value: destroyed unset, or its producer processes died,
    exited or dropped it ("producer died (pid N)"), or none attached in time."""

    code = "broken_promise"


class PromiseAlreadySatisfiedError(FutureError):
    """A second set on a promise (any process): a promise is fulfilled once."""

    code = "promise_already_satisfied"


class FutureAlreadyRetrievedError(FutureError):
    """get_future() called twice, or on a promise whose future lives in another process."""

    code = "future_already_retrieved"


class FutureConsumedError(FutureError):
    """get() or wait() already took the value: a future yields it once."""

    code = "no_state"


class FutureTimeoutError(FutureError, TimeoutError):
    """wait(timeout_ms) elapsed; the future stays valid."""

    code = "timeout"


class ProducerError(FutureError):
    """The producer called set_exception(message)."""

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


_BY_CODE = {cls.code: cls for cls in FutureError.__subclasses__()}
_BY_CODE.update({cls.code: cls for cls in (FutureTimeoutError, CannotLeaveProcessError,
                                           InvalidHandleError)})
_BY_CODE["unknown"] = FutureError

__all__ = [name for name, value in list(globals().items())
           if isinstance(value, type) and issubclass(value, FutureError)]
