"""Typed uses of dtorch_ops' public API, for mypy only: tests/test_typing.py type-checks this
file (nothing runs it). Each assert_type pins a type that the package's typing must keep: the
binding's stub (dtorch_ops/_C.pyi), the declarations of the methods the binding installs on the
future classes (dtorch_ops/futures.py, under TYPE_CHECKING), the annotations of the functions, and
the settings of dtorch_ops.config. A line ending in ``# type: ignore[code]`` is a call that must
stay an error: the test runs with warn_unused_ignores for this file, so an ignore that is no
longer needed (the call type-checks) fails it.
"""
import asyncio
from typing import Any, assert_type

import torch

import dtorch_ops
from dtorch_ops import (
    ObjectFuture,
    TensorFuture,
    TensorListFuture,
    TensorPromise,
    VoidFuture,
    VoidFutureCollect,
    VoidPromise,
    _C,
)


def tensor_futures(t: torch.Tensor) -> None:
    fut = dtorch_ops.to_torch_async(t)
    assert_type(fut, TensorFuture)
    assert_type(fut.get(), torch.Tensor)
    assert_type(fut.wait(), torch.Tensor)
    assert_type(fut.wait(100), torch.Tensor)
    assert_type(fut.wait(2.5), torch.Tensor)
    assert_type(fut.wait(timeout_ms=100), torch.Tensor)
    assert_type(fut.wait(None, timeout=0.5), torch.Tensor)
    assert_type(fut.result(), torch.Tensor)
    assert_type(fut.result(0.5), torch.Tensor)
    assert_type(fut.result(timeout_ms=500), torch.Tensor)
    assert_type(fut.value(), torch.Tensor)
    assert_type(fut.is_ready(), bool)
    assert_type(fut.done(), bool)
    assert_type(fut.valid(), bool)
    assert_type(fut.kind(), str)
    assert_type(fut.wait_for(10), bool)
    assert_type(fut.exception(timeout=1), BaseException | None)
    fut.add_done_callback(lambda done: assert_type(done, TensorFuture))

    def on_done(done: TensorFuture) -> None:
        print(done.value().shape)

    fut.add_done_callback(on_done)
    # An op's raw result, wrapped.
    assert_type(TensorFuture(torch.ops.dtorch.get_tensor_async(t)), TensorFuture)
    assert_type(dtorch_ops.to_torch(t), torch.Tensor)
    assert_type(dtorch_ops.to_torch(t, timeout_ms=100), torch.Tensor)

    fut.wait("10")  # type: ignore[arg-type]
    fut.wait(10, 1)  # type: ignore[call-arg]
    fut.get(10)  # type: ignore[call-arg]
    dtorch_ops.to_torch_async("t")  # type: ignore[call-overload]


def host_copies(t: torch.Tensor) -> None:
    host = dtorch_ops.to_torch_async([t, t], device="cpu")
    assert_type(host, TensorListFuture)
    assert_type(host.get(), list[torch.Tensor])
    assert_type(host.wait(timeout=1), list[torch.Tensor])
    loss, metric = host.value()
    assert_type(loss, torch.Tensor)
    assert_type(dtorch_ops.to_torch_async((t,), device=torch.device("cpu")), TensorListFuture)
    assert_type(dtorch_ops.to_torch_async(t, device="cpu"), TensorFuture)
    assert_type(dtorch_ops.to_torch([t], "cpu"), list[torch.Tensor])

    dtorch_ops.to_torch_async([t])  # type: ignore[call-overload]
    dtorch_ops.to_torch_async(t, device=0)  # type: ignore[call-overload]


def promises(t: torch.Tensor) -> None:
    promise = TensorPromise()
    future = promise.get_future()
    assert_type(future, TensorFuture)
    promise.set_value(t)
    promise.set_exception(ValueError("no value"))
    promise.set_exception(ValueError)
    promise.set_exception("no value")
    assert_type(TensorPromise(kind="file", device="cpu", zero_copy=True), TensorPromise)
    assert_type(TensorPromise.for_tensor(t), TensorPromise)
    assert_type(TensorPromise.from_serialized(promise.serialize()), TensorPromise)
    assert_type(promise.kind(), str)
    with promise.fulfilling() as same:
        assert_type(same, TensorPromise)
    dtorch_ops.get_tensor(t, promise)
    assert_type(dtorch_ops.run_into(promise, lambda x: x * 2, t), torch.Tensor)

    done = VoidPromise()
    assert_type(done.get_future(), VoidFuture)
    assert_type(VoidPromise.from_serialized("..."), VoidPromise)
    done.set_value()
    assert_type(dtorch_ops.run_into(done, len, [1, 2]), int)
    dtorch_ops.sync_into("cpu", done)

    promise.set_value()  # type: ignore[call-arg]
    dtorch_ops.run_into(promise, len, [1, 2])  # type: ignore[call-overload]


def void_futures() -> None:
    future = VoidPromise().get_future()
    future.get()
    future.wait(100)
    future.result(timeout=0.1)
    assert_type(future.is_ready(), bool)
    collect = dtorch_ops.sync_async()
    assert_type(collect, VoidFutureCollect)
    assert_type(dtorch_ops.sync_async(["cpu", 0, torch.device("cpu")]), VoidFutureCollect)
    assert_type(collect.devices(), list[torch.device])
    collect.wait(timeout=1)
    dtorch_ops.sync()
    dtorch_ops.sync("cpu")

    dtorch_ops.sync(1.5)  # type: ignore[arg-type]


def waits(t: torch.Tensor) -> None:
    futures = [dtorch_ops.to_torch_async(t) for _ in range(3)]
    done, pending = dtorch_ops.wait_any(futures, timeout=1)
    assert_type(done, list[TensorFuture])
    for future in dtorch_ops.as_completed(futures, timeout_ms=1000):
        assert_type(future, TensorFuture)
    assert_type(dtorch_ops.wait_all(futures, timeout=5), list[Any])
    torch_future: torch.futures.Future[int] = torch.futures.Future()
    collected = dtorch_ops.collect_all([futures[0], torch_future])
    assert_type(collected, ObjectFuture)
    assert_type(collected.get(), Any)
    assert_type(collected.wait(timeout=1), Any)
    assert_type(ObjectFuture(torch_future), ObjectFuture)
    assert_type(collected.done(), bool)
    assert_type(futures[0].to_torch_future(), torch.futures.Future[Any])


async def awaiting(t: torch.Tensor) -> None:
    assert_type(await dtorch_ops.to_torch_async(t), torch.Tensor)
    assert_type(await dtorch_ops.to_torch_async([t], device="cpu"), list[torch.Tensor])
    await VoidPromise().get_future()
    await dtorch_ops.sync_async()
    assert_type(await dtorch_ops.collect_all([]), Any)
    # (asyncio.wait_for's own signature gives Tensor | Any: a union in typeshed.)
    assert_type(await asyncio.ensure_future(dtorch_ops.to_torch_async(t)), torch.Tensor)


def settings() -> None:
    config = dtorch_ops.config
    assert_type(config.exit_timeout_s, float)
    assert_type(config.pool_threads, int)
    assert_type(config.per_device_per_process, bool)
    config.exit_timeout_s = 2
    config.detector_idle_exit_s = 0.5
    config.max_detector_threads = 8
    config.network_pair_groups = 0

    config.pool_threads = 1.5  # type: ignore[assignment]
    print(config.no_such_setting)  # type: ignore[attr-defined]


def errors() -> None:
    assert issubclass(dtorch_ops.FutureTimeoutError, TimeoutError)
    assert issubclass(dtorch_ops.errors.ProducerError, dtorch_ops.FutureError)


def binding(t: torch.Tensor) -> None:
    # The stub is what mypy sees of the binding (not Any).
    assert_type(_C.get_tensor_async(t), _C.TensorFuture)
    assert_type(_C.TensorPromise("memory").get_future().get(), torch.Tensor)
    assert_type(_C.settings()[0]["name"], str)
    assert_type(dtorch_ops.library_threads(), dict[str, int])
