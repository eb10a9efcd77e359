"""sync(): its overhead on CPU against a bare op call, and on a GPU (when present) the time from
the stream's completion to sync() returning against torch.cuda.synchronize()."""
import time

import torch

import dtorch_ops
from common import Anchor, Figure, Report, interleaved_samples, per_call_us, print_medians

SECTION = "sync()"


def cpu(report, rounds, calls):
    x = torch.ones(4)
    cases = {
        "dtorch_ops.sync()": dtorch_ops.sync,
        "sync_async().get()": lambda: dtorch_ops.sync_async().get(),
        "anchor: torch.ops.aten.alias(x)": lambda: torch.ops.aten.alias(x),
    }
    for fn in cases.values():
        per_call_us(fn, 200)
    s = interleaved_samples(cases, rounds, lambda fn: per_call_us(fn, calls))
    print_medians(f"sync on CPU (us per call; median of {rounds} rounds x {calls})", s, "us")
    for ours in ("dtorch_ops.sync()", "sync_async().get()"):  # overhead, no target
        report.add(Figure(SECTION, f"{ours} on CPU", "us", ours, s[ours],
                          [Anchor("aten.alias (a bare op call)",
                                  s["anchor: torch.ops.aten.alias(x)"])]))


def gpu(report, samples, kernel_ms=5.0):
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
    s = interleaved_samples(cases, samples, lag_us)
    print_medians(f"sync on {torch.cuda.get_device_name()}: stream done -> call returns "
                  f"(us; median of {samples})", s, "us")
    report.add(Figure(SECTION, f"stream done -> sync() returns, {torch.cuda.get_device_name()}",
                      "us", "dtorch_ops.sync()", s["dtorch_ops.sync()"],
                      [Anchor("torch.cuda.synchronize()",
                              s["anchor: torch.cuda.synchronize()"])]))


def main(report, rounds=7, calls=1000, samples=50):
    cpu(report, rounds, calls)
    if torch.cuda.is_available():
        gpu(report, samples)
    else:
        print("  (no GPU here: the stream-completion lag is measured when one is present)")


if __name__ == "__main__":
    main(Report())
