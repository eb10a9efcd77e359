"""Quick tour of dtorch_ops: futures for tensor values, in eager Python, TorchScript and across
processes.

Runs on CPU; on a machine with a GPU the same calls return before the device work finishes.
"""
import threading
import time

import torch

import dtorch_ops


def produce(promise, x: torch.Tensor) -> None:
    """Runs in a worker process: fulfils the consumer's promise (the value is copied into shared
    memory now; the consumer gets a view of that copy)."""
    dtorch_ops.get_tensor(x.sum(0), promise)


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(1024, 1024, device=device)
    y = x @ x  # queued on the current stream when on a GPU

    t0 = time.perf_counter()
    fut = dtorch_ops.to_torch_async(y)  # returns at once
    t_issue = time.perf_counter() - t0
    value = fut.wait(10_000)  # the value, once the matmul has finished
    t_value = time.perf_counter() - t0
    print(f"[{device}] to_torch_async returned in {t_issue * 1e6:.1f} us; "
          f"value ready after {t_value * 1e3:.2f} ms; aliases y: {value.data_ptr() == y.data_ptr()}")

    # The host copy: CPU copies of a loss and a metric, ready once they have landed (what a
    # training loop logs each step instead of calling .item(), which waits for the device).
    loss, metric = dtorch_ops.to_torch_async([y.sum(), y.mean()], device="cpu").wait(10_000)
    print(f"host copies on {loss.device}: loss {loss.item():.1f}, metric {metric.item():.3f}")

    # A producer thread fulfils a promise; the consumer blocks without holding the GIL.
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()
    def produce_later() -> None:
        time.sleep(0.01)
        promise.set_value(torch.ones(3))

    threading.Thread(target=produce_later).start()
    print("value from another thread:", future.wait(10_000).tolist())

    # Errors reach the waiter.
    broken = dtorch_ops.TensorPromise()
    orphan = broken.get_future()
    del broken
    try:
        orphan.get()
    except RuntimeError as e:
        print("dropped promise ->", e)

    # TorchScript: the raw op and the future's methods.
    @torch.jit.script
    def scripted(t: torch.Tensor) -> torch.Tensor:
        f = torch.ops.dtorch.get_tensor_async(t * 2)
        return f.wait(10000)

    print("scripted:", scripted(torch.arange(3.0)).tolist())

    # Across processes: a file promise travels to a worker (pickled with the Process's arguments,
    # or through a torch.multiprocessing queue); the future stays here.
    promise = dtorch_ops.TensorPromise(kind="file")
    future = promise.get_future()
    worker = torch.multiprocessing.get_context("spawn").Process(
        target=produce, args=(promise, torch.ones(4, 4)))
    worker.start()
    print("value from another process:", future.wait(60_000).tolist())
    worker.join()


if __name__ == "__main__":
    main()
