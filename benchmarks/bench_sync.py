"""sync(): its overhead on CPU against a bare op call, and on a GPU (when present) the time from
the stream's completion to sync() returning against torch.cuda.synchronize()."""
import statistics
import time

import torch

import dtorch_ops
from common import interleaved_medians, per_call_us, ratio_line, report


def cpu(rounds, calls):
    x = torch.ones(4)
    cases = {
        "dtorch_ops.sync()": dtorch_ops.sync,
        "sync_async().get()": lambda: dtorch_ops.sync_async().get(),
        "anchor: torch.ops.aten.alias(x)": lambda: torch.ops.aten.alias(x),
    }
    for fn in cases.values():
        per_call_us(fn, 200)
    m = interleaved_medians(cases, rounds, lambda fn: per_call_us(fn, calls))
    report(f"sync on CPU (us per call; median of {rounds} rounds x {calls})", m, "us")
    ratio_line("sync() vs a bare op call", m["dtorch_ops.sync()"],
               m["anchor: torch.ops.aten.alias(x)"], "overhead, no target")


def gpu(samples, kernel_ms=5.0):
    """Wall time after a ~kernel_ms kernel minus the kernel's own duration (CUDA events)."""
    cycles_per_ms = None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    cycles_per_ms = 10_000_000 / start.elapsed_time(end)

    def lag_us(wait):
        torch.cuda.synchronize()
        begin, finish = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        begin.record()
        torch.cuda._sleep(int(kernel_ms * cycles_per_ms))
        finish.record()
        wait()
        wall_ms = (time.perf_counter() - t0) * 1e3
        return (wall_ms - begin.elapsed_time(finish)) * 1e3

    cases = {"dtorch_ops.sync()": dtorch_ops.sync,
             "anchor: torch.cuda.synchronize()": torch.cuda.synchronize}
    m = interleaved_medians(cases, samples, lag_us)
    report(f"sync on {torch.cuda.get_device_name()}: stream done -> call returns "
           f"(us; median of {samples})", m, "us")
    ratio_line("sync() vs torch.cuda.synchronize()", m["dtorch_ops.sync()"],
               m["anchor: torch.cuda.synchronize()"], "lag after completion")


def main(rounds=7, calls=1000, samples=50):
    cpu(rounds, calls)
    if torch.cuda.is_available():
        gpu(samples)
    else:
        print("  (no GPU here: the stream-completion lag is measured when one is present)")


if __name__ == "__main__":
    main()
