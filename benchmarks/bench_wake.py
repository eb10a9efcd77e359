"""Cross-thread wake: a producer thread sets the value, a consumer thread blocked in get() wakes.

Python: dtorch_ops promise/future vs threading.Event. C++ (benchmarks/cpp/wake_bench.cpp, the
CMake target wake_bench, built here by cpp_build.py): the core's MemoryPromise vs std::promise.
Latency = consumer's resume time minus the producer's time just before it sets; medians over many
samples, cases interleaved.
"""
import shutil
import subprocess
import tempfile
import threading
import time

import torch

import dtorch_ops
from common import Anchor, Figure, Report, Target, interleaved_samples, print_medians
from cpp_build import build_cpp_target

SECTION = "Cross-thread wake (memory kind)"


def _one_wake(make_pair):
    """make_pair() -> (block, release); returns the wake latency of one sample in us."""
    block, release = make_pair()
    stamp = {}

    def consumer():
        block()
        stamp["t1"] = time.perf_counter()

    thread = threading.Thread(target=consumer)
    thread.start()
    time.sleep(0.002)  # let the consumer block
    t0 = time.perf_counter()
    release()
    thread.join(10)
    return (stamp["t1"] - t0) * 1e6


def _dtorch_pair():
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()
    value = torch.ones(1)
    return future.get, lambda: promise.set_value(value)


def _event_pair():
    event = threading.Event()
    return (lambda: event.wait(10)), event.set


def _torch_future_pair():
    future = torch.futures.Future()
    value = torch.ones(1)
    return future.wait, lambda: future.set_result(value)


def python_wake(report, samples):
    cases = {"dtorch promise -> get()": _dtorch_pair, "anchor: threading.Event": _event_pair,
             "reference: torch.futures.Future": _torch_future_pair}
    s = interleaved_samples(cases, samples, _one_wake)
    print_medians(f"cross-thread wake, Python (us; median of {samples} samples)", s, "us")
    report.add(Figure(SECTION, "cross-thread wake, Python", "us",
                      "set_value -> waiter's get() returns", s["dtorch promise -> get()"],
                      [Anchor("threading.Event", s["anchor: threading.Event"],
                              Target("<=", 1.2, issue=35)),
                       # its wait releases the GIL too
                       Anchor("torch.futures.Future", s["reference: torch.futures.Future"])]))


def cpp_wake(report, samples):
    cmake = shutil.which("cmake")
    if cmake is None:
        print("\ncross-thread wake, C++: skipped (no cmake)")
        return
    with tempfile.TemporaryDirectory() as tmp:
        binary = build_cpp_target("wake_bench", tmp, cmake=cmake)
        out = subprocess.run([binary, str(samples)], check=True, capture_output=True, text=True,
                             timeout=300).stdout
    by_case = {name: [float(v) for v in values]
               for name, *values in (line.split() for line in out.strip().splitlines())}
    s = {"core MemoryPromise -> Get()": by_case["memory_promise"],
         "anchor: std::promise": by_case["std_promise"]}
    print_medians(f"cross-thread wake, C++ (us; median of {samples} samples)", s, "us")
    report.add(Figure(SECTION, "cross-thread wake, C++", "us", "core MemoryPromise -> Get()",
                      s["core MemoryPromise -> Get()"],
                      [Anchor("std::promise", s["anchor: std::promise"],
                              Target("<=", 1.5, issue=3))]))


def main(report, samples=300):
    python_wake(report, samples)
    cpp_wake(report, samples)


if __name__ == "__main__":
    main(Report())
