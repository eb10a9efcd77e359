"""A controller and worker processes on one host (`kind="file"`), one worker crashing.

The controller makes one `TensorPromise(kind="file")` per task and keeps its future; the promise
travels to a worker process (pickled through a queue) and the worker fulfils it with
`dtorch_ops.get_tensor(result, promise)`: the value comes back through shared memory. One worker
crashes after receiving its task and before fulfilling the promise. No value will ever come for
that task, and the controller is told: the future fails with `dtorch_ops.BrokenPromiseError`
within about a second (the library watches the processes that hold a promise), the controller
reports it and gives the task to a healthy worker. Every wait is bounded.

Run: python examples/controller_workers.py
"""
import multiprocessing.queues
import os
import time

import torch
import torch.multiprocessing as mp

import dtorch_ops

WORKERS = 3
CRASHING_WORKER = 1  # this one dies on its first task, without touching the promise
TIMEOUT_S = 30.0  # every wait is bounded

Job = tuple[int, dtorch_ops.TensorPromise]  # (task, the promise to fulfil with its result)


def compute(task: int) -> torch.Tensor:
    """The work: a small matrix product standing in for a model's forward."""
    x = torch.full((4, 4), float(task))
    return x @ x


def worker(rank: int, jobs: "multiprocessing.queues.Queue[Job | None]",
           ready: "multiprocessing.queues.Queue[int]") -> None:
    """Runs in a worker process: fulfils the promise of each job it receives, until None."""
    ready.put(rank)
    while True:
        job = jobs.get(timeout=TIMEOUT_S)  # receiving the promise makes this process its holder
        if job is None:
            return
        task, promise = job
        if rank == CRASHING_WORKER:
            os._exit(1)  # a crash: no exception, no clean-up, the promise never set
        dtorch_ops.get_tensor(compute(task), promise)  # copied into shared memory; returns


def main() -> None:
    ctx = mp.get_context("spawn")
    queues: list["multiprocessing.queues.Queue[Job | None]"] = [
        ctx.Queue() for _ in range(WORKERS)]
    ready: "multiprocessing.queues.Queue[int]" = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(rank, queues[rank], ready), daemon=True)
             for rank in range(WORKERS)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=TIMEOUT_S)  # each worker has started (imported torch and dtorch_ops)
    print(f"controller (pid {os.getpid()}): {WORKERS} workers ready, "
          f"pids {[p.pid for p in procs]}")

    # One task per worker: a promise goes to the worker, its future stays here.
    futures: dict[int, dtorch_ops.TensorFuture] = {}
    assigned: dict[int, int] = {}
    for task in range(WORKERS):
        promise = dtorch_ops.TensorPromise(kind="file")
        futures[task] = promise.get_future()
        assigned[task] = task
        queues[task].put((task, promise))
    start = time.monotonic()

    results: dict[int, torch.Tensor] = {}
    while futures:
        # Whatever completes first, value or failure (bounded: raises FutureTimeoutError).
        done = next(dtorch_ops.as_completed(list(futures.values()), timeout=TIMEOUT_S))
        task = next(t for t, f in futures.items() if f is done)
        del futures[task]
        try:
            results[task] = done.get()
            print(f"task {task}: value from worker {assigned[task]}, "
                  f"sum {results[task].sum().item():.0f}")
        except dtorch_ops.BrokenPromiseError as e:
            rank = assigned[task]
            procs[rank].join(timeout=TIMEOUT_S)
            print(f"task {task}: worker {rank} crashed (exit code {procs[rank].exitcode}); "
                  f"BrokenPromiseError {time.monotonic() - start:.1f} s after the task was "
                  f"sent: {e}")
            # Reissue: a new promise for the same task, to a healthy worker.
            healthy = next(r for r in range(WORKERS) if procs[r].is_alive())
            promise = dtorch_ops.TensorPromise(kind="file")
            futures[task] = promise.get_future()
            assigned[task] = healthy
            queues[healthy].put((task, promise))
            print(f"task {task}: reissued to worker {healthy}")

    for task in range(WORKERS):
        assert torch.equal(results[task], compute(task)), task
    print(f"all {WORKERS} results correct (task {CRASHING_WORKER} recomputed by worker "
          f"{assigned[CRASHING_WORKER]})")

    for rank, p in enumerate(procs):
        if p.is_alive():
            queues[rank].put(None)
    for p in procs:
        p.join(timeout=TIMEOUT_S)
        if p.is_alive():  # (not expected: a bounded join, then a kill)
            p.kill()
            p.join(timeout=TIMEOUT_S)
    print("controller_workers: OK")


if __name__ == "__main__":
    main()
