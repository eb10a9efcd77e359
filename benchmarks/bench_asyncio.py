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
from common import Anchor, Figure, Report, Target

SECTION = "asyncio (memory kind)"
SEED = "seed's 1 ms polling"
FLOOR = "asyncio.Future + call_soon_threadsafe"


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
    """us from the producer's set to the coroutine running again, per sample. The producer is one
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
    return latencies


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


def main(report, samples=100, pending=1000, seconds=1.0):
    async def run():
        lat = {}
        for _ in range(3):  # interleave
            for kind in ("ours", "seed", "floor"):
                lat.setdefault(kind, []).extend(await _resume_latency(kind, samples // 3 + 1))
        fresh = {}
        for _ in range(3):
            for kind in ("ours", "floor"):
                fresh.setdefault(kind, []).extend(
                    await _resume_latency(kind, samples // 3 + 1, fresh_thread=True))
        med = {k: statistics.median(v) for k, v in lat.items()}
        fresh_med = {k: statistics.median(v) for k, v in fresh.items()}
        print("\nasyncio: set_value on a worker thread -> awaiting coroutine resumed (us, median)")
        print(f"  {'dtorch await (completion-driven)':>40}: {med['ours']:9.1f} us")
        print(f"  {'seed: is_ready() + asyncio.sleep(1 ms)':>40}: {med['seed']:9.1f} us")
        print(f"  {'floor: asyncio.Future + call_soon_threadsafe':>40}: {med['floor']:9.1f} us")
        print(f"  {'dtorch await, fresh setter thread':>40}: {fresh_med['ours']:9.1f} us")
        print(f"  {'floor, fresh setter thread':>40}: {fresh_med['floor']:9.1f} us")
        report.add(Figure(SECTION, "set_value on a long-lived worker thread -> await resumes",
                          "us", "dtorch await (completion-driven)", lat["ours"],
                          [Anchor(SEED, lat["seed"], Target(">=", 10, issue=35), inverse=True),
                           Anchor(FLOOR, lat["floor"], Target("<=", 1.2, issue=35))]))
        report.add(Figure(SECTION, "set_value on a fresh thread per value -> await resumes", "us",
                          "dtorch await (completion-driven)", fresh["ours"],
                          [Anchor(FLOOR, fresh["floor"], Target("<=", 1.5, issue=9))]))
        print(f"\nasyncio: {pending} awaits pending for {seconds:.1f} s")
        cost = {}
        for kind, label in (("ours", "dtorch await"), ("seed", "seed polling")):
            cost[kind] = await _pending_cost(kind, pending, seconds)
            print(f"  {label:>40}: {cost[kind][0]:5.1f}% of a core, {cost[kind][1]:+d} threads")
        report.add(Figure(SECTION, f"CPU while {pending} awaits are pending", "% of a core",
                          "dtorch await", [cost["ours"][0]], [Anchor(SEED, [cost["seed"][0]])]))
        report.add(Figure(SECTION, f"threads added while {pending} awaits are pending",
                          "threads", "dtorch await", [cost["ours"][1]],
                          [Anchor(SEED, [cost["seed"][1]])]))

    asyncio.run(run())


if __name__ == "__main__":
    main(Report())
