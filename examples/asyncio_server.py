"""An asyncio inference server: handlers `await` tensors that a batching worker thread produces.

Each request handler gives its input to an inference worker thread with a promise and `await`s
the promise's future. The worker runs the model on batches of whatever requests are waiting and
fulfils each request's promise with its row (`dtorch_ops.get_tensor(row, promise)`: on a GPU, once
the batch has been computed, without the worker waiting for it). An awaiting handler is a
suspended coroutine: no thread blocks per request, and the event loop stays free. A heartbeat task
ticking every few milliseconds shows it.

Run: python examples/asyncio_server.py
"""
import asyncio
import queue
import threading
import time

import torch

import dtorch_ops

REQUESTS = 200
MAX_BATCH = 32
BATCH_TIME_S = 0.005  # stands in for a slower model: the worker sleeps this long per batch
TIMEOUT_S = 30.0  # every wait is bounded

Request = tuple[torch.Tensor, dtorch_ops.TensorPromise]


class InferenceWorker:
    """A thread that runs the model on batches of requests and fulfils each request's promise."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.requests: "queue.Queue[Request | None]" = queue.Queue()
        self.batches = 0
        self.thread = threading.Thread(target=self._run, name="inference", daemon=True)
        self.thread.start()

    def submit(self, x: torch.Tensor) -> dtorch_ops.TensorFuture:
        """Called on the event loop: returns at once with the future of x's result."""
        promise = dtorch_ops.TensorPromise()  # kind="memory": both ends in this process
        self.requests.put((x, promise))
        return promise.get_future()

    def _run(self) -> None:
        while (first := self.requests.get()) is not None:
            batch = [first]
            while len(batch) < MAX_BATCH:  # take what else is waiting, up to a batch
                try:
                    item = self.requests.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self.requests.put(None)  # stop after this batch
                    break
                batch.append(item)
            time.sleep(BATCH_TIME_S)
            with torch.no_grad():
                out = self.model(torch.stack([x for x, _ in batch]))
            for row, (_, promise) in zip(out, batch):
                dtorch_ops.get_tensor(row, promise)  # wakes that request's handler
            self.batches += 1

    def close(self) -> None:
        self.requests.put(None)
        self.thread.join(timeout=TIMEOUT_S)


async def serve(worker: InferenceWorker, inputs: list[torch.Tensor]
                ) -> tuple[list[torch.Tensor], int, float, int]:
    """Serves one request per input, all at once; returns the responses, the heartbeat's ticks
    while serving, its longest gap between ticks (seconds) and the most threads seen."""
    ticks: list[float] = []
    threads: list[int] = []

    async def heartbeat() -> None:  # runs only when the loop is free
        while True:
            ticks.append(time.perf_counter())
            threads.append(threading.active_count())
            await asyncio.sleep(0.002)

    async def handle(x: torch.Tensor) -> torch.Tensor:
        # Suspends this handler until the worker has fulfilled the promise; the loop goes on.
        return await asyncio.wait_for(worker.submit(x), timeout=TIMEOUT_S)

    beat = asyncio.create_task(heartbeat())
    await asyncio.sleep(0)  # let the heartbeat start
    responses = await asyncio.gather(*(handle(x) for x in inputs))
    beat.cancel()
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    return list(responses), len(ticks), max(gaps, default=0.0), max(threads)


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    model.eval()
    inputs = [torch.randn(8) for _ in range(REQUESTS)]
    worker = InferenceWorker(model)
    threads_before = threading.active_count()
    start = time.perf_counter()
    try:
        responses, ticks, longest_gap, most_threads = asyncio.run(serve(worker, inputs))
    finally:
        worker.close()
    elapsed = time.perf_counter() - start
    print(f"{len(responses)} responses in {elapsed:.2f} s, from {worker.batches} batches")

    with torch.no_grad():
        expected = model(torch.stack(inputs))
    assert all(torch.allclose(r, e, atol=1e-5) for r, e in zip(responses, expected))
    print("responses equal the model's output: True")

    # No thread waits per request: the thread count stays that of the main thread and the worker.
    print(f"threads: {threads_before} before, at most {most_threads} while {REQUESTS} requests "
          f"waited (no thread per request)")
    assert most_threads <= threads_before + 2, (threads_before, most_threads)
    # The loop was never blocked: the heartbeat kept ticking while every request waited.
    print(f"event loop free: the heartbeat ticked {ticks} times while serving, "
          f"longest gap {longest_gap * 1e3:.1f} ms")
    assert ticks > 1 and longest_gap < 0.5, (ticks, longest_gap)
    print("asyncio_server: OK")


if __name__ == "__main__":
    main()
