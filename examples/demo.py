"""dtorch_ops demo: what asynchronous tensor values buy a training loop and an asyncio service.

1. Training loop: log the loss of every step through a future
   (`dtorch_ops.to_torch_async(loss, device="cpu")`, whose done-callback logs the value) instead of
   `loss.item()`, which makes the Python thread wait for the device every step. Both loops run
   interleaved, several times; the demo prints the medians of the loop time per step and of the
   time until every loss is logged, and checks that both loops logged the same losses.
   - With a GPU: an MLP trained on CUDA, where `.item()` stalls and the futures do not.
   - Without one: (1a) the MLP on the CPU, where no gain is expected (CPU ops are synchronous:
     the loss exists when its op returns, so `.item()` never waits), to show that the futures
     cost little there (the ratio of the loop times, and each call's cost in microseconds,
     against the target of at most 1.05x); then (1b) a training loop on the test
     suite's simulated device (tests/simdev, compiled on first use), whose kernels take real
     time on a stream: each step makes the next batch on the host, then queues device work; the
     futures loop overlaps the two, `.item()` serializes them. (Skipped where a GPU is present:
     registered, the simulated device would become torch's accelerator in CUDA's place.)
2. asyncio service: request handlers await the rows that one batching inference worker thread
   computes, through a plain `asyncio.Future` completed by `loop.call_soon_threadsafe` (the
   standard pattern), then through dtorch_ops futures (the worker fulfils a promise per request
   from the done-callback of the batch's host copy); for both it prints the throughput, the
   latency, the longest pause of a 2 ms heartbeat task and the threads added while serving.

`--short` makes a quick run (the test's). Every wait is bounded.
"""
import argparse
import asyncio
import functools
import math
import os
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

import dtorch_ops

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAIT_S = 120.0  # the bound of every wait: far above what any part takes


def fail(message: str) -> SystemExit:
    return SystemExit(f"demo: FAILED: {message}")


# ---------------------------------------------------------------------------------------------
# 1. Training loop
# ---------------------------------------------------------------------------------------------

class Workload(Protocol):
    """One training step, split as a training loop does: host-side work, then device work."""

    device: torch.device

    def prepare(self, step: int) -> torch.Tensor:
        """Host-side work: the batch of `step`, on the CPU."""
        ...

    def step(self, batch: torch.Tensor) -> torch.Tensor:
        """Queues the step's device work; returns the loss (on the device, maybe not computed)."""
        ...


class MLPWorkload:
    """A small MLP fit by SGD on `device` (CPU or CUDA): a fresh seeded batch per step."""

    def __init__(self, device: torch.device, batch: int, width: int) -> None:
        torch.manual_seed(0)
        self.device = device
        self.batch = batch
        self.model = torch.nn.Sequential(
            torch.nn.Linear(256, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
            torch.nn.ReLU(), torch.nn.Linear(width, 1),
        ).to(device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)

    def prepare(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(step)
        return torch.randn(self.batch, 256, generator=g)

    def step(self, batch: torch.Tensor) -> torch.Tensor:
        x = batch.to(self.device)
        loss = torch.nn.functional.mse_loss(self.model(x), x[:, :1].sin())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return loss


class SimulatedWorkload:
    """The training step on the simulated device (simdev, kernels that take real time on a stream).

    simdev has only copies, fill_, add, mul and views, plus a `sleep(ms)` kernel: the model is one
    parameter `w` fit by SGD to the mean intensity of each batch, and a `kernel_ms` sleep queued
    before it stands for the forward and backward kernels of a real model. The host side makes and
    augments the batch's images (real CPU work, on tensors small enough that torch runs each op on
    one thread: no OpenMP team to wait for when other processes keep a core busy). The batch's
    upload waits for the work queued before it (simdev's copies from host memory are blocking),
    so the host runs at most one step ahead of the device.
    """

    def __init__(self, device: torch.device, kernel_ms: int, samples: int) -> None:
        self.device = device
        self.kernel_ms = kernel_ms
        self.samples = samples
        self.lr = 0.05
        self.w = torch.empty(1, device=device).fill_(0.0)

    def prepare(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(step)
        means = []
        for _ in range(self.samples):
            image = torch.rand(3, 32, 32, generator=g) * 2 + 2   # a decoded image, mean 3
            if torch.rand(1, generator=g).item() < 0.5:          # a random horizontal flip
                image = image.flip(-1)
            means.append(torch.nn.functional.avg_pool2d(image, 2).mean())  # resized; its mean
        return torch.stack(means).mean().reshape(1)

    def step(self, batch: torch.Tensor) -> torch.Tensor:
        x = batch.to(self.device)                       # the upload
        torch.ops.simdev.sleep(self.kernel_ms)          # forward + backward kernels
        err = torch.add(self.w, x, alpha=-1.0)          # w - x
        loss = err * err
        self.w = torch.add(self.w, err, alpha=-2 * self.lr)  # w -= lr * d(loss)/dw
        return loss


class LossLog:
    """The logged loss of every step, and an event set once all are logged.

    Written by the loop (`.item()`), or by the futures' done-callbacks: these run at once, inline,
    where the future is already complete (CPU), else on the library's pool thread when the host
    copy has landed (docs/guide/python-api.md, "Callbacks")."""

    def __init__(self, steps: int) -> None:
        self.values = [math.nan] * steps
        self.all_logged = threading.Event()
        self._left = steps
        self._lock = threading.Lock()

    def log(self, step: int, value: float) -> None:
        self.values[step] = value
        with self._lock:
            self._left -= 1
            if self._left == 0:
                self.all_logged.set()

    def log_future(self, step: int, future: dtorch_ops.TensorFuture) -> None:
        self.log(step, future.value().item())


@dataclass
class TrainRun:
    loop_s: float        # the training loop (every step queued, or run)
    end_to_end_s: float  # until every step's loss is logged
    losses: list[float]
    device_type: str


def synchronize(device: torch.device) -> None:
    """Waits (bounded) for the work queued on the device's current stream."""
    dtorch_ops.sync_async([device]).wait(timeout=WAIT_S)


def item(loss: torch.Tensor) -> float:
    """loss.item(). simdev has no .item() kernel: there, a blocking copy to the host first, which
    is what .item() does on a GPU."""
    return (loss.cpu() if loss.device.type == "simdev" else loss).item()


def train(workload: Workload, steps: int, mode: str) -> TrainRun:
    """Runs `steps` steps, logging each loss with `.item()` (mode "item") or through a future
    (mode "future")."""
    log = LossLog(steps)
    synchronize(workload.device)
    start = time.perf_counter()
    for step in range(steps):
        loss = workload.step(workload.prepare(step))
        if mode == "item":
            log.log(step, item(loss))  # waits for the device
        else:  # returns at once; the callback logs the value when the host copy has landed
            future = dtorch_ops.to_torch_async(loss, device="cpu")  # (detached: no graph kept)
            future.add_done_callback(functools.partial(log.log_future, step))
    loop_s = time.perf_counter() - start
    if not log.all_logged.wait(WAIT_S):
        raise fail(f"{mode}: {sum(map(math.isnan, log.values))} losses never arrived")
    end_to_end_s = time.perf_counter() - start
    synchronize(workload.device)
    return TrainRun(loop_s, end_to_end_s, log.values, workload.device.type)


MODES = ("item", "future")
FUTURE_LABEL = "to_torch_async + done-callback"


def compare(make: Callable[[], Workload], steps: int, reps: int) -> dict[str, list[TrainRun]]:
    """Runs both loops `reps` times, interleaved (the order alternates), each on a fresh
    workload; a first untimed pair warms up."""
    runs: dict[str, list[TrainRun]] = {mode: [] for mode in MODES}
    for rep in range(reps + 1):
        order = MODES if rep % 2 else MODES[::-1]
        for mode in order:
            run = train(make(), steps, mode)
            if rep:
                runs[mode].append(run)
    return runs


def print_runs(runs: dict[str, list[TrainRun]], steps: int,
               item_label: str = "loss.item() every step") -> tuple[float, float]:
    """Prints the medians of both loops and checks that they logged the same losses; returns the
    futures loop's medians over the .item() loop's: (loop time, time until all is logged)."""
    print(f"  {'logging the loss':32}{'loop ms/step':>14}{'all logged, ms':>16}")
    medians: dict[str, tuple[float, float]] = {}
    for mode, label in zip(MODES, (item_label, FUTURE_LABEL)):
        loop = statistics.median(r.loop_s for r in runs[mode]) / steps
        end = statistics.median(r.end_to_end_s for r in runs[mode])
        medians[mode] = (loop, end)
        print(f"  {label:32}{loop * 1e3:14.3f}{end * 1e3:16.1f}")
    reference = runs["item"][0].losses
    # Bitwise on the CPU and the simulated device; a GPU's kernels may round differently from
    # one run to the next (cuBLAS picks algorithms): there, within a tight tolerance.
    tolerance = 1e-5 if any(r.device_type == "cuda" for mode in MODES for r in runs[mode]) else 0.0
    identical = all(math.isclose(a, b, rel_tol=tolerance, abs_tol=tolerance)
                    for mode in MODES for r in runs[mode] for a, b in zip(r.losses, reference))
    print(f"  logged losses identical in both loops: {identical} "
          f"(first {reference[0]:.4g}, last {reference[-1]:.4g})")
    if not identical:
        raise fail("the futures logged different losses than .item()")
    return (medians["future"][0] / medians["item"][0], medians["future"][1] / medians["item"][1])


def faster(ratio: float) -> str:
    """A time ratio (futures over .item()) as "N.NNx faster" or "N.NNx slower"."""
    return f"{1 / ratio:.2f}x faster" if ratio <= 1 else f"{ratio:.2f}x slower"


def runs_of(reps: int) -> str:
    """How a part's figures were taken, for its header."""
    return "one run each" if reps == 1 else f"medians of {reps} interleaved runs each"


def demo_training_cpu(steps: int, reps: int) -> None:
    print(f"\n== 1a. Training loop on cpu: an MLP, {steps} steps; {runs_of(reps)} ==")
    runs = compare(lambda: MLPWorkload(torch.device("cpu"), batch=64, width=512), steps, reps)
    print_runs(runs, steps)
    pairs = [f.loop_s / i.loop_s for f, i in zip(runs["future"], runs["item"])]
    spread = ""
    if len(pairs) >= 5:
        quartiles = statistics.quantiles(pairs, n=4)
        spread = f"; middle half {quartiles[0]:.2f}-{quartiles[2]:.2f}"
    print(f"  futures / .item() loop time: {statistics.median(pairs):.3f}x (median of {len(pairs)} "
          f"interleaved pairs{spread})")
    # The loop ratio of a short run is mostly the machine's noise: the calls' own cost, measured
    # in a tight loop, says what the futures add to a step.
    step_s = statistics.median(r.loop_s for r in runs["item"]) / steps
    future_s, item_s = logging_cost_s()
    estimate = (step_s - item_s + future_s) / step_s
    print(f"  logging one loss costs {future_s * 1e6:.1f} us with a future, {item_s * 1e6:.1f} us "
          f"with .item(): {estimate:.3f}x a {step_s * 1e3:.2f} ms step\n  (target <= 1.05x: "
          f"{'met' if estimate <= 1.05 else 'NOT met'})")
    print("  => no gain expected on cpu: CPU ops are synchronous, so .item() never stalls there")


def logging_cost_s(calls: int = 2000) -> tuple[float, float]:
    """Seconds per call of logging a computed CPU loss through a future with a done-callback, and
    through .item() (medians of 5 tight loops each)."""
    loss = torch.tensor(0.5)
    sink: list[float] = []

    def log(future: dtorch_ops.TensorFuture) -> None:
        sink.append(future.value().item())

    def with_futures() -> None:
        for _ in range(calls):
            dtorch_ops.to_torch_async(loss, device="cpu").add_done_callback(log)

    def with_item() -> None:
        for _ in range(calls):
            sink.append(loss.item())

    costs: dict[str, list[float]] = {"future": [], "item": []}
    for _ in range(5):
        for name, run in (("future", with_futures), ("item", with_item)):
            start = time.perf_counter()
            run()
            costs[name].append((time.perf_counter() - start) / calls)
            sink.clear()
    return statistics.median(costs["future"]), statistics.median(costs["item"])


def demo_training_device(device: torch.device, steps: int, reps: int) -> None:
    print(f"\n== 1. Training loop on {device}: an MLP, {steps} steps; {runs_of(reps)} ==")
    runs = compare(lambda: MLPWorkload(device, batch=1024, width=4096), steps, reps)
    ratio_loop, ratio_end = print_runs(runs, steps)
    print(f"  => futures: {faster(ratio_loop)} per step, {faster(ratio_end)} until every loss is "
          "logged")


def load_simulated_device() -> bool:
    """Loads the test suite's simulated device, printing how long it took (a first use compiles
    it); False, said, where it cannot be built or loaded here."""
    # tests/simdev is the test suite's simulated asynchronous device ("simdev"): a C++ extension
    # (tests/simdev/simdev.cpp) that torch.utils.cpp_extension compiles on first use, into
    # tests/simdev/build, then loads. Not part of the dtorch_ops package.
    sys.path.append(os.path.join(REPO, "tests"))
    import simdev  # type: ignore[import-not-found]

    library = os.path.join(REPO, "tests", "simdev", "build", "simdev.so")

    def stamp() -> float:
        return os.path.getmtime(library) if os.path.exists(library) else 0.0

    before = stamp()
    if not before:
        print("  compiling the simulated device (tests/simdev; first use: 10-20 s) ...", flush=True)
    start = time.perf_counter()
    try:
        simdev.load()
    except Exception as e:  # noqa: BLE001 (no compiler, a failed build: the rest still runs)
        print(f"  the simulated device is unavailable here ({type(e).__name__}: "
              f"{str(e).splitlines()[0] if str(e) else ''}); part 1b is skipped")
        return False
    took = time.perf_counter() - start
    print(f"  simulated device {'compiled and loaded' if stamp() != before else 'loaded'} "
          f"in {took:.1f} s")
    return True


def demo_training_simdev(steps: int, reps: int, kernel_ms: int = 4, samples: int = 72) -> None:
    print("\n== 1b. Training loop on the simulated device: kernels that take real time on a "
          "stream ==")
    if not load_simulated_device():
        return
    device = torch.device("simdev:0")
    make = functools.partial(SimulatedWorkload, device, kernel_ms, samples)
    host = []
    for step in range(20):
        start = time.perf_counter()
        make().prepare(step)
        host.append(time.perf_counter() - start)
    print(f"  each step: {statistics.median(host) * 1e3:.1f} ms of host work (making the next "
          f"batch), then {kernel_ms} ms of device kernels")
    print(f"  {steps} steps; {runs_of(reps)}")
    ratio_loop, ratio_end = print_runs(compare(make, steps, reps), steps,
                                       item_label="loss.cpu().item() every step")
    print("  (simdev has no .item() kernel: loss.cpu() is the blocking copy .item() makes on a "
          "GPU)")
    print(f"  => futures: {faster(ratio_loop)} per step, {faster(ratio_end)} until every loss is "
          "logged (host and device overlap)")


# ---------------------------------------------------------------------------------------------
# 2. asyncio service
# ---------------------------------------------------------------------------------------------

class InferenceWorker:
    """A worker thread that batches requests and answers each with its row of the model's output.

    `mode` picks how: "asyncio" completes each handler's asyncio.Future through the loop's
    call_soon_threadsafe once the output is on the host (waiting for the device there); "dtorch"
    starts the host copy with to_torch_async and fulfils each request's promise from its
    done-callback, without waiting and without knowing the event loop."""

    def __init__(self, device: torch.device, mode: str, max_batch: int = 32) -> None:
        torch.manual_seed(0)
        self.device = device
        self.mode = mode
        self.model = torch.nn.Sequential(
            torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
            torch.nn.ReLU(), torch.nn.Linear(512, 1),
        ).to(device).eval()
        self.requests: queue.Queue[tuple[torch.Tensor, object] | None] = queue.Queue()
        self.max_batch = max_batch
        self.batches = 0
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="inference-worker")
        self.thread.start()
        if not self.ready.wait(WAIT_S):
            raise fail("the inference worker did not start")

    async def infer(self, x: torch.Tensor) -> torch.Tensor:
        """The handler's side: submits x and awaits its row (suspending this handler only)."""
        if self.mode == "asyncio":
            future: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()
            self.requests.put((x, future))
            return await future
        promise = dtorch_ops.TensorPromise()
        result = promise.get_future()
        self.requests.put((x, promise))
        return await result

    def _run(self) -> None:
        with torch.no_grad():  # warm-up: a first batch starts this thread's OpenMP threads
            self.model(torch.zeros(self.max_batch, 256, device=self.device)).cpu()
        self.ready.set()
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
            replies = [reply for _, reply in batch]
            if self.mode == "asyncio":
                rows = out.cpu()  # waits for the device (on CPU: at once)
                for future, row in zip(replies, rows):
                    assert isinstance(future, asyncio.Future)
                    future.get_loop().call_soon_threadsafe(_set_result, future, row)
            else:
                host = dtorch_ops.to_torch_async(out, device="cpu")  # returns at once
                host.add_done_callback(functools.partial(_fulfil, replies))
            self.batches += 1

    def close(self) -> None:
        self.requests.put(None)
        self.thread.join(WAIT_S)
        if self.thread.is_alive():
            raise fail("the inference worker did not stop")


def _set_result(future: "asyncio.Future[torch.Tensor]", value: torch.Tensor) -> None:
    if not future.done():  # cancelled meanwhile (a timeout)
        future.set_result(value)


def _fulfil(promises: list[object], host: dtorch_ops.TensorFuture) -> None:
    for promise, row in zip(promises, host.value()):
        assert isinstance(promise, dtorch_ops.TensorPromise)
        promise.set_value(row)


def os_threads() -> int:
    """The threads of this process, native ones included (Linux), else Python's."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


@dataclass
class ServeRun:
    responses: int
    seconds: float
    latencies_s: list[float]
    max_gap_s: float
    threads_added: int


async def serve(worker: InferenceWorker, n_requests: int, concurrency: int) -> ServeRun:
    latencies: list[float] = []
    beats: list[float] = []
    threads_before = os_threads()
    peak_threads = threads_before

    async def heartbeat() -> None:
        nonlocal peak_threads
        while True:
            beats.append(time.perf_counter())
            peak_threads = max(peak_threads, os_threads())
            await asyncio.sleep(0.002)

    async def client(first: int) -> list[float]:
        """One of `concurrency` clients, each sending its share of the requests in turn."""
        answers = []
        for i in range(first, n_requests, concurrency):
            x = torch.full((256,), i / n_requests)
            start = time.perf_counter()
            y = await worker.infer(x)
            latencies.append(time.perf_counter() - start)
            answers.append(float(y))
        return answers

    beat = asyncio.create_task(heartbeat())
    await asyncio.sleep(0)
    start = time.perf_counter()
    results = await asyncio.wait_for(
        asyncio.gather(*(client(k) for k in range(concurrency))), WAIT_S)
    seconds = time.perf_counter() - start
    beat.cancel()
    gaps = [b - a for a, b in zip(beats, beats[1:])]
    return ServeRun(sum(map(len, results)), seconds, latencies, max(gaps, default=0.0),
                    peak_threads - threads_before)


SERVICE_MODES = {"asyncio": "asyncio.Future + call_soon_threadsafe", "dtorch": "dtorch_ops futures"}


def demo_service(device: torch.device, n_requests: int, reps: int, concurrency: int = 64) -> None:
    print(f"\n== 2. asyncio service on {device}: handlers await rows a batching worker thread "
          "computes ==")
    how = "one run each" if reps == 1 else (f"{reps} interleaved runs each: req/s their median, "
                                            "latencies pooled, gap and threads their maximum")
    print(f"  {n_requests} requests, {concurrency} in flight; {how}")
    runs: dict[str, list[ServeRun]] = {mode: [] for mode in SERVICE_MODES}
    for rep in range(reps + 1):  # a first, short round warms up
        order = list(SERVICE_MODES) if rep % 2 else list(reversed(SERVICE_MODES))
        for mode in order:
            worker = InferenceWorker(device, mode)
            try:
                run = asyncio.run(serve(worker, n_requests if rep else 64, concurrency))
            finally:
                worker.close()
            if run.responses != (n_requests if rep else 64):
                raise fail(f"{mode}: lost responses")
            if rep:
                runs[mode].append(run)
    print(f"  {'handlers await':38}{'req/s':>8}{'p50 ms':>8}{'p99 ms':>8}{'max gap ms':>12}"
          f"{'threads':>9}")
    throughput: dict[str, float] = {}
    for mode, label in SERVICE_MODES.items():
        rs = runs[mode]
        throughput[mode] = statistics.median(r.responses / r.seconds for r in rs)
        lat = sorted(v * 1e3 for r in rs for v in r.latencies_s)
        p99 = lat[min(len(lat) - 1, math.ceil(0.99 * len(lat)) - 1)]
        print(f"  {label:38}{throughput[mode]:8,.0f}{statistics.median(lat):8.2f}{p99:8.2f}"
              f"{max(r.max_gap_s for r in rs) * 1e3:12.2f}{max(r.threads_added for r in rs):9d}")
    print("  (max gap: the longest pause of a 2 ms heartbeat task; threads: those the process "
          "added)")
    print(f"  => dtorch_ops futures: {throughput['dtorch'] / throughput['asyncio']:.2f}x the plain "
          "pattern's req/s")
    if device.type == "cpu":
        print("     on cpu the plain worker waits for no device either, and its one "
              "call_soon_threadsafe hop\n     costs less than a promise, a future and an await. "
              "The gain needs a device: there the plain\n     worker's .cpu() blocks it per "
              "batch, the futures' worker goes on to the next (and knows no event loop)")
    else:
        print("     the plain worker's .cpu() blocks it until each batch is computed; the "
              "futures' worker goes on to the next batch (and needs no event loop)")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--short", action="store_true", help="a quick run (the test)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the MLP and the service run (default: cuda if present)")
    args = parser.parse_args()
    device = torch.device(args.device)
    started = time.perf_counter()
    print(f"dtorch_ops demo: torch {torch.__version__}, main device {device}, "
          f"{os.cpu_count()} CPU cores, {torch.get_num_threads()} torch threads")
    if device.type == "cpu":
        demo_training_cpu(steps=50 if args.short else 100, reps=3 if args.short else 15)
        demo_training_simdev(steps=20 if args.short else 100, reps=3)
    else:
        demo_training_device(device, steps=50 if args.short else 200, reps=1 if args.short else 3)
        print("  (the simulated device is skipped where a GPU is present: registered, it would "
              "become torch's accelerator in CUDA's place)")
    demo_service(device, n_requests=200 if args.short else 2000, reps=1 if args.short else 3)
    print(f"\ndemo: OK ({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
