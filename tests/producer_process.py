"""A persistent producer process for the file-kind tests (test_file_kind.py,
test_file_failures.py and the other file-kind modules): the test process is the consumer; the
producer runs functions the test sends it, by reference (so they live in modules a spawned child
can import: pytest puts tests/ on sys.path, which spawn hands to the child).

ProducerProcess(context).call(function, *args) runs function(*args) there and returns its value,
or raises its error rebuilt as the same class where that is one of dtorch_ops.errors' or a
built-in one. Every call is bounded.
"""
import builtins
import ctypes
import os
import queue
import signal
import time

import pytest


def die_with_parent() -> None:
    """prctl(PR_SET_PDEATHSIG, SIGKILL): this process goes when its parent does."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    except (AttributeError, OSError):
        pass


def describe(error: BaseException) -> tuple:
    """(module, class name, message): how an exception travels back to the test."""
    return (type(error).__module__, type(error).__qualname__, str(error))


def remote_error(module: str, qualname: str, message: str) -> BaseException:
    """An exception a child described, rebuilt as its own class where it is dtorch_ops.errors'
    or a builtin one."""
    if module == "dtorch_ops.errors":
        from dtorch_ops import errors

        return getattr(errors, qualname)(message)
    if module == "builtins" and isinstance(getattr(builtins, qualname, None), type):
        return getattr(builtins, qualname)(message)
    return RuntimeError(f"{module}.{qualname}: {message}")


def serve(requests, results) -> None:
    """The producer's loop: (sequence number, function, args) from `requests` until None; puts
    (sequence number, "ok", value) or (sequence number, "error", describe(e)) on `results`."""
    die_with_parent()
    import dtorch_ops  # noqa: F401  (loaded before the first request)

    while (request := requests.get()) is not None:
        sequence, function, args = request
        try:
            results.put((sequence, "ok", function(*args)))
        except Exception as e:  # noqa: BLE001 - reported to the test
            results.put((sequence, "error", describe(e)))


class ProducerProcess:
    def __init__(self, context):
        self.requests, self.results = context.Queue(), context.Queue()
        self.process = context.Process(target=serve, args=(self.requests, self.results),
                                       daemon=True)
        self.process.start()
        self._sequence = 0
        self.pid = self.call(os.getpid, timeout_s=120)

    def call(self, function, *args, timeout_s: float = 60.0):
        self._sequence += 1
        self.requests.put((self._sequence, function, args))
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                sequence, status, value = self.results.get(
                    timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:
                pytest.fail(f"the producer process did not answer {function.__name__}{args} "
                            f"within {timeout_s} s (hung)")
            if sequence == self._sequence:
                break  # (an older answer arriving late after a failed call: skipped)
        if status == "error":
            raise remote_error(*value)
        return value

    def close(self):
        self.requests.put(None)
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
