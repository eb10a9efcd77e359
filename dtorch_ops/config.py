"""Process-wide settings of dtorch_ops: ``dtorch_ops.config.<name> = value``.

The thread settings live in the C++ library (C++ programs share them); setting one here checks it
and applies it at once.
"""
from . import _C


class _LibrarySetting:
    """A setting held by the library: get/set through _C, scaled between Python's unit and the
    library's (seconds here, milliseconds there)."""

    def __init__(self, getter, setter, kind, scale, doc):
        self._get, self._set, self._kind, self._scale = getter, setter, kind, scale
        self.__doc__ = doc

    def __set_name__(self, owner, name):
        self._name = name

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        return self._kind(self._get() / self._scale) if self._scale != 1 else self._get()

    def __set__(self, obj, value):
        if isinstance(value, bool) or not isinstance(value, (int, float) if self._kind is float
                                                     else int):
            raise TypeError(f"dtorch_ops.config.{self._name} must be "
                            f"{'a number' if self._kind is float else 'an int'}, got "
                            f"{type(value).__name__}")
        native = value * self._scale
        if self._kind is float:
            import math

            if math.isnan(native):
                raise ValueError(f"dtorch_ops.config.{self._name} must be a number, got nan")
            native = math.ceil(min(max(native, -1), 2**62))  # +-inf: the library judges
        try:
            self._set(int(native))
        except ValueError as e:
            raise ValueError(f"dtorch_ops.config.{self._name} = {value!r}: {e}") from None
        except RuntimeError as e:
            raise RuntimeError(f"dtorch_ops.config.{self._name} = {value!r}: {e}") from None


class Config:
    # The seed's perDevicePerProcess: device tensors are produced by one worker process per device,
    # so a pair whose promise such a worker fulfils must be able to cross processes ("file" kind).
    # The default for promise_kind_for(..., per_device_per_process=None).
    per_device_per_process: bool = False

    max_detector_threads = _LibrarySetting(
        _C.max_detector_threads, _C.set_max_detector_threads, int, 1,
        "Detector threads (named dtorch-detect) at most: one per device stream with pending "
        "values up to this, beyond which streams share them (default 32).")
    detector_idle_exit_s = _LibrarySetting(
        _C.detector_idle_exit_ms, _C.set_detector_idle_exit_ms, float, 1000,
        "Seconds a detector thread with nothing to watch waits before it exits (default 2.0).")
    pool_threads = _LibrarySetting(
        _C.pool_threads, _C.set_pool_threads, int, 1,
        "Threads of the completion pool (named dtorch-pool), started on its first use (default "
        "2); set it before then.")
    exit_timeout_s = _LibrarySetting(
        _C.exit_timeout_ms, _C.set_exit_timeout_ms, float, 1000,
        "At interpreter exit, how long the library's threads get to finish completions in "
        "progress and work posted to the pool, before every value still pending fails with "
        "'dropped at interpreter exit' (default 1.0).")

    attach_timeout_s = _LibrarySetting(
        _C.attach_timeout_ms, _C.set_attach_timeout_ms, float, 1000,
        "File and network promises: how long a promise in flight waits for a process to hold it "
        "before its future fails with 'no producer attached' (default 30.0): one serialized "
        "(or inherited by a forked child) whose creator dropped its handle and that no process "
        "received, and one that a holder passed on (serialized) before every holder was gone, "
        "counted from then.")
    network_heartbeat_timeout_s = _LibrarySetting(
        _C.network_heartbeat_timeout_ms, _C.set_network_heartbeat_timeout_ms, float, 1000,
        "Network promises: a process with network pairs in flight bumps its heartbeat in the "
        "store every 0.5 s; how long a producer's heartbeat may stand still before its "
        "consumers count it dead and fail the futures it was to set (default 5.0, at least 1.0).")
    network_store_timeout_s = _LibrarySetting(
        _C.network_store_timeout_ms, _C.set_network_store_timeout_ms, float, 1000,
        "Network promises: the bound of every exchange with the store (connecting, each call "
        "of a producer, a consumer or the library's thread): a store that does not answer "
        "within it (frozen, cut off) fails the calls and the pairs waiting on it with "
        "BrokenPromiseError naming the store (default 30.0, at least 0.1).")
    file_payload_idle_s = _LibrarySetting(
        _C.payload_idle_ms, _C.set_payload_idle_ms, float, 1000,
        "File promises: a producer writes each value into a shared-memory segment that it and "
        "the consumer keep mapped for the next value of that size; how long such a segment, "
        "unused, is kept before both processes release it (default 5.0).")

    def __repr__(self):
        names = ("per_device_per_process", "max_detector_threads", "detector_idle_exit_s",
                 "pool_threads", "exit_timeout_s", "attach_timeout_s",
                 "network_heartbeat_timeout_s", "network_store_timeout_s", "file_payload_idle_s")
        return "dtorch_ops.Config(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in names) + ")"


config = Config()
