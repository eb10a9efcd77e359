"""asyncio: latency from set_value (worker thread) to the awaiting coroutine resuming, and the cost
of many pending awaits. dtorch_ops' completion-driven await vs the seed's 1 ms is_ready() polling,
with a bare asyncio.Future resolved by call_soon_threadsafe as the floor."""
import asyncio
import queue
import random
import statistics
import threading
import time

import torch

import dtorch_ops


async def _poll_seed(future):
    # The seed's __await__: poll is_ready() every millisecond.
    while not future.is_ready():
        await asyncio.sleep(0.001)
    return future.get()


async def _await_ours(future):
    return await future


def _job(delay, stamp, fire):
    time.sleep(delay)
    stamp["t0"] = time.perf_counter()
    fire()


async def _resume_latency(kind, samples, fresh_thread=False):
    """Median us from the producer's set to the coroutine running again. The producer is one
    long-lived worker thread (as in a service), handed each job through a queue, or with
    fresh_thread a new thread per value."""
    loop = asyncio.get_running_loop()
    value = torch.ones(1)
    jobs = queue.Queue()

    def worker():
        while (job := jobs.get()) is not None:
            _job(*job)

    thread = None if fresh_thread else threading.Thread(target=worker)
    if thread is not None:
        thread.start()
    latencies = []
    for _ in range(samples):
        stamp = {}
        # A random phase, so that the producer is not in step with the seed's 1 ms polling.
        delay = 0.002 + random.uniform(0, 0.001)
        if kind == "floor":
            waiter = loop.create_future()
            job = (delay, stamp, lambda w=waiter: loop.call_soon_threadsafe(w.set_result, value))
            awaitable = waiter
        else:
            promise = dtorch_ops.TensorPromise()
            future = promise.get_future()
            job = (delay, stamp, lambda p=promise: p.set_value(value))
            awaitable = _await_ours(future) if kind == "ours" else _poll_seed(future)
        if fresh_thread:
            threading.Thread(target=_job, args=job).start()
        else:
            jobs.put(job)
        await awaitable
        latencies.append((time.perf_counter() - stamp["t0"]) * 1e6)
    if thread is not None:
        jobs.put(None)
        thread.join()
    return statistics.median(latencies)


async def _pending_cost(kind, n, seconds):
    promises = [dtorch_ops.TensorPromise() for _ in range(n)]
    runner = _await_ours if kind == "ours" else _poll_seed
    threads0 = threading.active_count()
    tasks = [asyncio.ensure_future(runner(p.get_future())) for p in promises]
    await asyncio.sleep(0.05)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.sleep(seconds)
    cpu = time.process_time() - cpu0
    wall = time.perf_counter() - wall0
    threads = threading.active_count() - threads0
    for p in promises:
        p.set_value(torch.zeros(1))
    await asyncio.gather(*tasks)
    return cpu / wall * 100, threads


def main(samples=100, pending=1000, seconds=1.0):
    async def run():
        lat = {}
        for _ in range(3):  # interleave
            for kind in ("ours", "seed", "floor"):
                lat.setdefault(kind, []).append(await _resume_latency(kind, samples // 3 + 1))
        lat = {k: statistics.median(v) for k, v in lat.items()}
        fresh = {}
        for _ in range(3):
            for kind in ("ours", "floor"):
                fresh.setdefault(kind, []).append(
                    await _resume_latency(kind, samples // 3 + 1, fresh_thread=True))
        fresh = {k: statistics.median(v) for k, v in fresh.items()}
        print(f"\nasyncio: set_value on a worker thread -> awaiting coroutine resumed (us, median)")
        print(f"  {'dtorch await (completion-driven)':>40}: {lat['ours']:9.1f} us")
        print(f"  {'seed: is_ready() + asyncio.sleep(1 ms)':>40}: {lat['seed']:9.1f} us")
        print(f"  {'floor: asyncio.Future + call_soon_threadsafe':>40}: {lat['floor']:9.1f} us")
        print(f"  {'dtorch await, fresh setter thread':>40}: {fresh['ours']:9.1f} us")
        print(f"  {'floor, fresh setter thread':>40}: {fresh['floor']:9.1f} us")
        print(f"  => seed polling / dtorch await: {lat['seed'] / lat['ours']:.1f}x lower latency"
              " (target >= 10x)")
        print(f"  => dtorch await / floor, long-lived setter: {lat['ours'] / lat['floor']:.2f}x"
              " (target <= 1.5x)")
        print(f"  => dtorch await / floor, fresh setter thread: "
              f"{fresh['ours'] / fresh['floor']:.2f}x (target <= 1.5x)")
        print(f"\nasyncio: {pending} awaits pending for {seconds:.1f} s")
        for kind, label in (("ours", "dtorch await"), ("seed", "seed polling")):
            cpu_pct, threads = await _pending_cost(kind, pending, seconds)
            print(f"  {label:>40}: {cpu_pct:5.1f}% of a core, {threads:+d} threads")

    asyncio.run(run())


if __name__ == "__main__":
    main()
