"""Completion of device values, on the simulated device (tests/simdev): how soon after the stream
finishes a value's work does wait() return, what the library's threads cost while work is pending,
and how many threads many busy streams take.

Latency: the stream runs 0.1 / 10 / 100 ms of work, then a kernel that stamps the time, then the
value's event; the waiting thread returns from wait() and takes the time (the same clock). The
anchor is a two-hop condition-variable wake chain measured in the same run behind the same work:
a kernel stamps and wakes a relay thread, which wakes the caller (the shortest path a detector
thread can give: device -> detector -> waiter). Cases interleaved; p50 and p99.
"""
import os
import statistics
import sys
import time

import torch

import dtorch_ops
from common import Anchor, Figure, Report, Target

SECTION = "Device completion (simulated device)"
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))


def _simdev():
    import simdev

    simdev.load()
    return simdev


def _percentile(samples, q):
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _ours_us(x, work_us):
    torch.ops.simdev.sleep_us(work_us)
    slot = torch.ops.simdev.stamp()
    future = dtorch_ops.to_torch_async(x)
    future.wait(60_000)
    returned = time.monotonic_ns()
    return (returned - torch.ops.simdev.stamp_ns(slot)) / 1e3


def _anchor_us(work_us):
    torch.ops.simdev.sleep_us(work_us)
    stamp = torch.ops.simdev.two_hop_wait()
    return (time.monotonic_ns() - stamp) / 1e3


def latency(report, samples_by_work):
    """{work_us: samples} -> prints p50/p99 of ours (blocking wait and polling) and the anchor."""
    x = torch.ones(4, device="simdev")
    torch.ops.simdev.synchronize()
    print("\ncompletion -> wait() returns, simulated device (us; p50 / p99 over n samples)")
    print(f"  {'queued work':>12} {'n':>4} {'dtorch (blocking wait)':>24} {'anchor: 2-hop chain':>22}"
          f" {'ratio p50':>10} {'dtorch (polling)':>18}")
    for work_us, samples in samples_by_work.items():
        blocking, anchor, polling = [], [], []
        for _ in range(samples):  # interleaved
            blocking.append(_ours_us(x, work_us))
            anchor.append(_anchor_us(work_us))
            torch.ops.simdev.set_blocking_wait(False)
            try:
                polling.append(_ours_us(x, work_us))
            finally:
                torch.ops.simdev.set_blocking_wait(True)
        p50 = statistics.median(blocking)
        a50 = statistics.median(anchor)
        print(f"  {work_us / 1e3:>9.1f} ms {samples:>4} "
              f"{p50:>12.1f} / {_percentile(blocking, 0.99):>9.1f} "
              f"{a50:>11.1f} / {_percentile(anchor, 0.99):>8.1f} {p50 / a50:>9.2f}x "
              f"{statistics.median(polling):>8.1f} / {_percentile(polling, 0.99):>7.1f}")
        report.add(Figure(SECTION, f"completion -> wait() returns, after {work_us / 1e3:g} ms of "
                          "queued work", "us", "dtorch, blocking wait", blocking,
                          [Anchor("two-hop wake chain (simulated device)", anchor,
                                  Target("<=", 2, issue=11)),
                           Anchor("dtorch, polling with back-off (no blocking wait)", polling)]))


def library_thread_cpu_ns():
    """CPU time (ns) used so far by the library's threads (dtorch-*) alive now."""
    total = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                if not f.read().startswith("dtorch-"):
                    continue
            with open(f"/proc/self/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:  # exited meanwhile
            pass
    return total


def cpu_while_pending(report, seconds):
    """Share of one core the library's threads use while a value waits for `seconds` of work."""
    x = torch.ones(4, device="simdev")
    print(f"\nlibrary threads' CPU while {seconds:g} s of device work is pending (% of one core)")
    shares = {}
    for label, blocking in (("blocking wait (simdev registers one)", True),
                            ("polling with back-off (no blocking wait)", False)):
        torch.ops.simdev.set_blocking_wait(blocking)
        try:
            dtorch_ops.to_torch(x)  # a detector is alive and settled
            torch.ops.simdev.sleep(int(seconds * 1000))
            future = dtorch_ops.to_torch_async(x)
            time.sleep(0.02)  # the detector is waiting for it now
            cpu0, wall0 = library_thread_cpu_ns(), time.monotonic_ns()
            future.wait(60_000)
            cpu1, wall1 = library_thread_cpu_ns(), time.monotonic_ns()
        finally:
            torch.ops.simdev.set_blocking_wait(True)
        shares[label] = (cpu1 - cpu0) / (wall1 - wall0) * 100
        print(f"  {label:>42}: {shares[label]:6.3f} %")
    report.add(Figure(SECTION, f"library threads' CPU while {seconds:g} s of work is pending",
                      "% of a core", "blocking wait (simdev registers one)",
                      [shares["blocking wait (simdev registers one)"]],
                      [Anchor("polling with back-off (no blocking wait)",
                              [shares["polling with back-off (no blocking wait)"]])],
                      target=Target("<=", 1, issue=11)))


def threads_for_streams(report, streams=200):
    gates, futures = [], []
    for _ in range(streams):
        stream = torch.ops.simdev.new_stream()
        previous = torch.ops.simdev.set_stream(stream)
        try:
            gates.append(torch.ops.simdev.hold())
            futures.append(dtorch_ops.to_torch_async(torch.ones(1, device="simdev")))
        finally:
            torch.ops.simdev.set_stream(previous)
    detectors = dtorch_ops.library_threads()["detectors"]
    for gate in gates:
        torch.ops.simdev.release(gate)
    for future in futures:
        future.wait(60_000)
    print(f"\nthreads for {streams} streams with pending values: {detectors} detectors")
    report.add(Figure(SECTION, f"detector threads for {streams} streams with pending values "
                      "(the cap: config.max_detector_threads)", "threads", "detectors",
                      [detectors], target=Target("<=", dtorch_ops.config.max_detector_threads,
                                                 issue=11)))


def main(report, samples=(300, 60, 12), seconds=1.0):
    _simdev()
    latency(report, dict(zip((100, 10_000, 100_000), samples)))
    cpu_while_pending(report, seconds)
    threads_for_streams(report)


if __name__ == "__main__":
    quick = os.environ.get("QUICK") == "1"
    main(Report(), samples=(60, 10, 3) if quick else (300, 60, 12), seconds=0.3 if quick else 1.0)
