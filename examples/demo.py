"""dtorch_ops demo: what asynchronous tensor values buy a training loop and an asyncio service.

1. Training loop: log the loss every step through futures, consumed by a logger thread, instead of
   `loss.item()`, which makes the Python thread wait for the device each step.
2. asyncio service: request handlers `await` tensors that an inference worker thread produces in
   batches; the event loop never blocks (a heartbeat keeps ticking) and no thread waits per
   request.

Runs on the CPU here and on a GPU when one is present (there `.item()` stalls on the device and
the futures do not). `--short` makes a quick run (CI).
"""
import argparse
import asyncio
import queue
import statistics
import threading
import time

import torch

import dtorch_ops


def make_model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 1),
    ).to(device)


def train(device, steps, log_with):
    """Trains `steps` steps; returns (seconds per step, logged losses in step order)."""
    model = make_model(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.randn(64, 256, device=device)
    target = data[:, :1].clone()
    logged = {}
    pending = queue.Queue()

    def logger():  # consumes loss futures in the background: the training loop never waits
        while (item := pending.get()) is not None:
            step, future = item
            logged[step] = future.wait(60_000).item()

    thread = threading.Thread(target=logger, daemon=True)
    thread.start()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for step in range(steps):
        loss = torch.nn.functional.mse_loss(model(data), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if log_with == "item":
            logged[step] = loss.item()  # waits for the device every step
        else:
            pending.put((step, dtorch_ops.to_torch_async(loss.detach())))  # returns at once
    loop_seconds = time.perf_counter() - start
    pending.put(None)
    thread.join(60)
    return loop_seconds / steps, [logged[s] for s in range(steps)]


def demo_training(device, steps):
    print(f"\n== 1. training loop, {steps} steps on {device} ==")
    rows = {}
    for mode in ("item", "future", "item", "future"):  # interleaved; the second pair counts
        rows[mode] = train(device, steps, mode)
    (t_item, losses_item), (t_future, losses_future) = rows["item"], rows["future"]
    print(f"  loss.item() every step:             {t_item * 1e3:8.3f} ms/step in the loop")
    print(f"  to_torch_async + logger thread:     {t_future * 1e3:8.3f} ms/step in the loop")
    print(f"  loop time, futures / .item():       {t_future / t_item:8.2f}x")
    same = all(abs(a - b) <= 1e-5 * max(1.0, abs(a)) for a, b in zip(losses_item, losses_future))
    print(f"  logged losses identical: {same}; first {losses_future[0]:.5f} -> last "
          f"{losses_future[-1]:.5f}")
    if not same:
        raise SystemExit("demo: the futures logged different losses than .item()")


class InferenceWorker:
    """A worker thread that batches requests and fulfils each request's promise with its row."""

    def __init__(self, device, max_batch=32):
        self.device = device
        self.model = make_model(device).eval()
        self.requests = queue.Queue()
        self.max_batch = max_batch
        self.batches = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def submit(self, x):
        promise = dtorch_ops.TensorPromise()
        future = promise.get_future()
        self.requests.put((x, promise))
        return future

    def _run(self):
        while (first := self.requests.get()) is not None:
            batch = [first]
            while len(batch) < self.max_batch:
                try:
                    item = self.requests.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self.requests.put(None)
                    break
                batch.append(item)
            with torch.no_grad():
                out = self.model(torch.stack([x for x, _ in batch]).to(self.device))
            for row, (_, promise) in zip(out, batch):
                dtorch_ops.get_tensor(row, promise)  # on a GPU: fulfilled when the batch is done
            self.batches += 1

    def close(self):
        self.requests.put(None)
        self.thread.join(60)


async def serve(worker, n_requests, concurrency):
    latencies = []
    beats = []

    async def heartbeat():
        while True:
            beats.append(time.perf_counter())
            await asyncio.sleep(0.002)

    async def handle(i):
        x = torch.randn(256)
        start = time.perf_counter()
        y = await worker.submit(x)  # suspends this handler only; no thread waits for it
        latencies.append(time.perf_counter() - start)
        return float(y)

    hb = asyncio.create_task(heartbeat())
    threads = threading.active_count()
    sem = asyncio.Semaphore(concurrency)

    async def limited(i):
        async with sem:
            return await handle(i)

    start = time.perf_counter()
    results = await asyncio.gather(*(limited(i) for i in range(n_requests)))
    elapsed = time.perf_counter() - start
    hb.cancel()
    gaps = [b - a for a, b in zip(beats, beats[1:])]
    return results, latencies, elapsed, max(gaps) if gaps else 0.0, threading.active_count() - threads


def demo_service(device, n_requests, concurrency=64):
    print(f"\n== 2. asyncio service, {n_requests} requests, {concurrency} in flight, on {device} ==")
    worker = InferenceWorker(device)
    try:
        results, lat, elapsed, max_gap, extra_threads = asyncio.run(
            serve(worker, n_requests, concurrency))
    finally:
        worker.close()
    lat_ms = sorted(v * 1e3 for v in lat)
    print(f"  {len(results)} responses in {elapsed * 1e3:.1f} ms ({len(results) / elapsed:,.0f}/s), "
          f"{worker.batches} batches")
    print(f"  request latency p50 {statistics.median(lat_ms):.2f} ms, "
          f"p99 {lat_ms[int(0.99 * (len(lat_ms) - 1))]:.2f} ms")
    print(f"  heartbeat every 2 ms kept running: longest gap {max_gap * 1e3:.2f} ms; "
          f"threads added while serving: {extra_threads}")
    if len(results) != n_requests:
        raise SystemExit("demo: lost responses")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="a quick run (CI)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"dtorch_ops demo on {device} (torch {torch.__version__})")
    demo_training(device, steps=20 if args.short else 200)
    demo_service(device, n_requests=200 if args.short else 2000)
    print("\ndemo: OK")


if __name__ == "__main__":
    main()
