"""`await` on dtorch_ops futures: woken by the completion itself, no polling, no threads."""
import asyncio
import gc
import os
import threading
import time

import pytest
import torch

import dtorch_ops
from conftest import Heartbeat

TIMEOUT_S = 10


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


def test_await_ready_and_pending_futures():
    async def main():
        ready = await dtorch_ops.to_torch_async(torch.arange(3))
        promise = dtorch_ops.TensorPromise()
        future = promise.get_future()
        asyncio.get_running_loop().call_later(0.01, promise.set_value, torch.ones(2))
        pending = await future
        return ready, pending, future.valid()

    ready, pending, valid = run(main())
    assert torch.equal(ready, torch.arange(3)) and torch.equal(pending, torch.ones(2))
    assert not valid  # await consumes like get()


def test_two_hundred_futures_fulfilled_by_a_worker_thread():
    n = 200
    promises = [dtorch_ops.TensorPromise() for _ in range(n)]
    futures = [p.get_future() for p in promises]

    def worker():
        for i, p in enumerate(promises):
            if i % 20 == 0:
                time.sleep(0.002)
            p.set_value(torch.tensor(i))

    async def main():
        threading.Thread(target=worker, daemon=True).start()
        return await asyncio.gather(*(f for f in futures))

    assert [int(v) for v in run(main())] == list(range(n))


def test_heartbeat_runs_while_an_await_is_pending():
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()

    async def main():
        async with Heartbeat() as hb:
            threading.Timer(0.2, promise.set_value, args=(torch.ones(1),)).start()
            value = await future
        return hb.beats, value

    beats, value = run(main())
    assert beats >= 10, f"the loop was blocked: only {beats} heartbeats in 0.2 s"
    assert torch.equal(value, torch.ones(1))


def test_thousand_pending_awaits_add_no_threads_and_burn_no_cpu():
    n = 1000
    promises = [dtorch_ops.TensorPromise() for _ in range(n)]

    async def main():
        threads_before = threading.active_count()
        tasks = [asyncio.ensure_future(p.get_future()) for p in promises]
        await asyncio.sleep(0.05)  # every task is now suspended in its await
        cpu0, wall0 = time.process_time(), time.monotonic()
        await asyncio.sleep(0.5)
        cpu = time.process_time() - cpu0
        wall = time.monotonic() - wall0
        threads_during = threading.active_count()
        assert not any(t.done() for t in tasks)
        for i, p in enumerate(promises):
            p.set_value(torch.tensor(i))
        values = await asyncio.gather(*tasks)
        return threads_before, threads_during, cpu, wall, values

    before, during, cpu, wall, values = run(main())
    # (<=: a thread of an earlier test, e.g. a closed loop's executor worker, may end meanwhile)
    assert during <= before, "pending awaits started threads"
    assert cpu < 0.25 * wall, f"{cpu:.3f} s CPU in {wall:.3f} s while 1000 awaits were pending"
    assert [int(v) for v in values] == list(range(n))


def test_exception_through_await():
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()

    async def main():
        asyncio.get_running_loop().call_later(0.01, promise.set_exception, "model diverged")
        await future

    with pytest.raises(RuntimeError, match="model diverged"):
        run(main())


def test_broken_promise_through_await():
    holder = {"promise": dtorch_ops.TensorPromise()}
    future = holder["promise"].get_future()

    def drop():
        holder.clear()
        gc.collect()

    async def main():
        threading.Timer(0.02, drop).start()
        await future

    with pytest.raises(RuntimeError, match="broken promise"):
        run(main())


def test_cancelling_the_awaiting_task_keeps_the_future():
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()

    async def main():
        task = asyncio.ensure_future(future)
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert future.valid() and not future.is_ready()
        promise.set_value(torch.full((2,), 5.0))  # the stale wake-up must be harmless
        await asyncio.sleep(0.01)
        return await future

    assert torch.equal(run(main()), torch.full((2,), 5.0))


def test_wait_for_timeout_leaves_the_future_valid():
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.ensure_future(future), 0.02)
        assert future.valid()
        promise.set_value(torch.ones(1))
        return await future

    assert torch.equal(run(main()), torch.ones(1))


def test_completion_after_the_loop_closed_is_harmless():
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()

    async def main():
        task = asyncio.ensure_future(future)
        await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(main())
    promise.set_value(torch.ones(1))  # wakes a waiter whose loop is gone
    assert torch.equal(future.wait(1000), torch.ones(1))


def test_raw_results_are_not_awaitable():
    raw = torch.ops.dtorch.get_tensor_async(torch.ones(1))

    async def main():
        await raw

    with pytest.raises(TypeError):
        run(main())
    assert torch.equal(run(_await_wrapped(raw)), torch.ones(1))


async def _await_wrapped(raw):
    return await dtorch_ops.TensorFuture(raw)


def test_event_loops_do_not_leak_file_descriptors():
    async def one_loop():
        promise = dtorch_ops.TensorPromise()
        future = promise.get_future()
        asyncio.get_running_loop().call_later(0.001, promise.set_value, torch.ones(1))
        return await future

    asyncio.run(one_loop())  # warm up: the first loop may cache fds of its own
    gc.collect()
    before = open_fds()
    for _ in range(50):
        asyncio.run(one_loop())
    gc.collect()
    assert open_fds() - before <= 2


def test_one_notifier_serves_many_awaits_in_a_loop():
    from dtorch_ops import _waker

    async def main():
        promises = [dtorch_ops.TensorPromise() for _ in range(20)]
        tasks = [asyncio.ensure_future(p.get_future()) for p in promises]
        await asyncio.sleep(0.01)
        waker = _waker._loop_wakers[asyncio.get_running_loop()]
        assert len(waker.waiters) == 20
        for p in reversed(promises):  # completion order differs from await order
            p.set_value(torch.ones(1))
        await asyncio.gather(*tasks)
        return len(waker.waiters)

    assert run(main()) == 0


def test_retried_timeouts_register_the_future_once():
    from dtorch_ops import _waker

    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()

    async def main():
        for _ in range(500):  # "wait with a timeout, then retry"
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(_awaited(future), 0.0005)
        waker = _waker._loop_wakers[asyncio.get_running_loop()]
        registered = len(waker.waiters)
        promise.set_value(torch.ones(1))
        return registered, await future, waker

    registered, value, waker = run(main())
    assert registered == 1, f"{registered} registrations for one future"
    assert torch.equal(value, torch.ones(1))
    assert waker.notifier.drain() == []  # one completion posted one token, already drained


async def _awaited(future):
    return await future


def test_a_loop_closed_with_pending_awaits_is_released():
    from dtorch_ops import _waker

    promises = []

    async def abandon():
        promise = dtorch_ops.TensorPromise()
        promises.append(promise)
        asyncio.ensure_future(_awaited(promise.get_future()))
        await asyncio.sleep(0.005)  # the await is pending when asyncio.run cancels it

    gc.collect()
    before_fds, before_wakers = open_fds(), len(_waker._loop_wakers)
    for _ in range(20):
        asyncio.run(abandon())
    promises.clear()  # the pending callbacks (and the eventfds they hold) go with the promises
    gc.collect()
    assert len(_waker._loop_wakers) == before_wakers, "closed loops kept their wakers"
    assert open_fds() - before_fds <= 2, "closed loops leaked file descriptors"
