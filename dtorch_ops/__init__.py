"""dtorch_ops: asynchronous tensor values for PyTorch.

``to_torch_async(t)`` returns a future at once; its value arrives when the device work that
produces ``t`` has finished (an event on ``t``'s current stream), without blocking Python and
without synchronising the device. In-process futures alias the input tensor: no copy is made.

``sync()`` / ``sync_async()`` wait for the work queued so far on each device's current stream.

The futures have torch.futures.Future's methods too (``done``, ``wait``, ``value``, ``then``,
``add_done_callback``, ``to_torch_future``; ``collect_all`` / ``wait_all``), concurrent.futures'
(``result``, ``exception``; ``wait_any``, ``as_completed``), and adopt a ``torch.futures.Future``
(``TensorFuture(torch_future)``, ``ObjectFuture(torch_future)``). Only ``get()`` consumes a
future; ``promise.set_exception(exc)`` takes an exception, and ``with promise.fulfilling():``
fails the promise with whatever the block raises.

Raw ops and classes (TorchScript, C++, torch.compile): ``torch.ops.dtorch.get_tensor_async``,
``get_tensor``, ``sync``, ``sync_into``, ``sync_wait``; ``torch.classes.dtorch.TensorFuture``,
``TensorPromise``, ``VoidFuture``, ``VoidPromise``, ``VoidFutureCollect``.
"""
import atexit as _atexit
import os as _os
from typing import TYPE_CHECKING as _TYPE_CHECKING

import torch as _torch


def _load_native_library():
    try:
        # The binding; importing it loads libdtorch_ops.so, which registers the ops.
        from . import _C
    except (ImportError, OSError) as e:
        raise ImportError(
            "dtorch_ops: the compiled library could not be loaded "
            f"({type(e).__name__}: {e}). It is built against one torch and must be rebuilt for "
            f"another: this Python imports torch {_torch.__version__} from "
            f"{_os.path.dirname(_torch.__file__)}. Build it with `make build` (or "
            "`pip install --no-build-isolation -e .`) in the dtorch_ops checkout."
        ) from e
    return _C


if _TYPE_CHECKING:
    from . import _C  # (its stub, _C.pyi)
else:
    _C = _load_native_library()


def _at_exit():
    """Before the interpreter is torn down: threads that finish a wait from now on park instead
    of re-taking the GIL (which aborts once finalization has begun), and the library's threads
    stop (within config.exit_timeout_s) while Python can still serve them: what is done is
    completed, every value still pending fails with "dropped at interpreter exit"."""
    _C.close_exit_gate()
    _C.stop_library_threads()


_atexit.register(_at_exit)
# A fork child's main thread is the thread that forked; no thread of the parent survives there.
_os.register_at_fork(after_in_child=_C.after_fork_in_child)


class _MultiprocessingChildExit:
    """A multiprocessing child started with fork ends in os._exit, past the library's exit
    handler; its finalizers still run: one says to the consumers of the file and network promises
    it holds that it exited (rather than died; they wait until it is gone, as its threads may
    still set values), and unlinks its doorbell if none of its own pairs is pending. Registered
    after multiprocessing's own after-fork reset, which clears the finalizers a child inherits.
    The same after-fork hook makes the child a holder of the promises among its arguments."""

    def __init__(self):
        from multiprocessing import util

        util.register_after_fork(self, _MultiprocessingChildExit._in_child)

    @staticmethod
    def _in_child(_self):
        import multiprocessing
        from multiprocessing import util

        util.Finalize(None, _C.at_child_exit, exitpriority=-100)
        # A forked child received its arguments without unpickling them: the promises among
        # them are held here from now on (as unpickling makes a spawned child their holder), so
        # that a child that dies before it uses one fails its future at once.
        process = multiprocessing.current_process()
        from .promises import _register_holders

        _register_holders(getattr(process, "_args", ()))
        _register_holders(getattr(process, "_kwargs", {}))


_multiprocessing_child_exit = _MultiprocessingChildExit()

from . import _pair_groups  # noqa: E402

_pair_groups.register(_C)

from .config import config  # noqa: E402
from . import errors  # noqa: E402
from .errors import (  # noqa: E402
    BrokenPromiseError,
    FutureError,
    FutureNotReadyError,
    FutureTimeoutError,
    InvalidHandleError,
    PromiseAlreadySatisfiedError,
)
from .futures import (  # noqa: E402
    ObjectFuture,
    TensorFuture,
    TensorListFuture,
    VoidFuture,
    VoidFutureCollect,
)
from .promises import TensorPromise, VoidPromise  # noqa: E402
from .kind_options import promise_kind_for  # noqa: E402
from .waiting import as_completed, collect_all, wait_all, wait_any  # noqa: E402
from .functions import (  # noqa: E402
    get_tensor,
    run_into,
    sync,
    sync_async,
    sync_into,
    to_torch,
    to_torch_async,
)
# The future and promise classes as opaque types, and the Python ops over them (graph_ops).
from .compile import opaque_types as _opaque_types  # noqa: E402,F401
from .compile import fakes as _fakes  # noqa: E402,F401  (fake classes and kernels: compile / export)
# Inductor's lowerings and the DTensor rules (of the Python ops too), when those are imported.
from .compile import lowerings as _lowerings  # noqa: E402,F401
# The raw ops in compiled graphs: Dynamo traces them as the Python API's calls, when it is imported.
from .compile import raw_ops as _raw_ops  # noqa: E402,F401


def library_threads() -> dict[str, int]:
    """The library's threads alive now, by role:
    ``{"detectors": n, "pool": m, "doorbell": d, "network": k}``.

    Detectors (named ``dtorch-detect`` in ``ps -L``, ``/proc``, gdb) watch device streams with
    pending values: at most one per such stream, up to ``config.max_detector_threads``; they exit
    after ``config.detector_idle_exit_s`` without work. The pool (``dtorch-pool``,
    ``config.pool_threads``) runs long completion work and starts on its first use. The doorbell
    watcher (``dtorch-doorbell``, at most one) serves this process's pending file futures
    (callbacks, ``await``, producer liveness) and exits when there are none. The network kind's
    (``dtorch-net-watch``, one per store this process awaits values from, and ``dtorch-net-tick``,
    at most one: heartbeats and liveness) run while network pairs are in flight, the tick thread
    also while this process holds a network promise (its heartbeat is how a consumer on another
    host knows it lives)."""
    return _C.library_threads()


def library_path() -> str:
    """Path of libdtorch_ops.so, for C++ programs (link it, or torch::ops::load_library)."""
    return _os.path.join(_os.path.dirname(__file__), "libdtorch_ops.so")


def include_path() -> str:
    """Directory of the public C++ headers, for ``#include <dtorch/dtorch.h>``.

    The build puts the headers in the package (``dtorch_ops/include``), for editable and
    non-editable installs alike; CMake users take them from ``find_package(dtorch_ops)``.
    """
    return _os.path.join(_os.path.dirname(__file__), "include")


def cmake_prefix_path() -> str:
    """What to add to ``CMAKE_PREFIX_PATH`` for ``find_package(dtorch_ops)``, as
    ``torch.utils.cmake_prefix_path`` is for ``find_package(Torch)``: the package config defines
    the imported target ``dtorch_ops::dtorch_ops`` (headers, library, torch)."""
    return _os.path.join(_os.path.dirname(__file__), "share", "cmake")


__all__ = [
    "BrokenPromiseError",
    "FutureError",
    "FutureNotReadyError",
    "FutureTimeoutError",
    "InvalidHandleError",
    "ObjectFuture",
    "PromiseAlreadySatisfiedError",
    "TensorFuture",
    "TensorListFuture",
    "TensorPromise",
    "VoidFuture",
    "VoidFutureCollect",
    "VoidPromise",
    "as_completed",
    "cmake_prefix_path",
    "collect_all",
    "config",
    "errors",
    "get_tensor",
    "include_path",
    "library_path",
    "library_threads",
    "promise_kind_for",
    "run_into",
    "sync",
    "sync_async",
    "sync_into",
    "to_torch",
    "to_torch_async",
    "wait_all",
    "wait_any",
]
