"""Many pending futures and per-device sync on a GPU: 10,000 pending futures over 40 busy streams
stay within the detector cap (and none is ready early); library threads are idle meanwhile (no
spinning: their CPU time is measured); sync waits for each device's current stream only.

Runs on CUDA, or on the simulated device with DTORCH_GPU_TESTS=simdev (see conftest.py)."""
import os
import sys
import time

import torch

import dtorch_ops
from conftest import WAIT_MS, detector_threads

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "benchmarks"))
from bench_completion import library_thread_cpu_ns  # noqa: E402


def test_10k_pending_futures_stay_within_the_detector_cap_without_spinning(gpu):
    cap = dtorch_ops.config.max_detector_threads
    x = torch.ones(4, device=gpu.name)
    streams = [gpu.new_stream() for _ in range(40)]
    releases, futures = [], []
    for stream in streams:
        with gpu.using_stream(stream):
            if gpu.name == "cuda":
                # Busy for longer than the 10,000 calls take: each takes a new blocking-sync
                # event while the pool has none free (4.2 s for 10,000 on the H200 machine).
                gpu.sleep(15_000)
                releases.append(lambda: None)
            else:
                releases.append(gpu.hold())  # busy until released
    try:
        cpu_before = library_thread_cpu_ns()
        issued = time.perf_counter()
        for i in range(10_000):
            with gpu.using_stream(streams[i % len(streams)]):
                futures.append(dtorch_ops.to_torch_async(x))
        print(f"10,000 to_torch_async calls took {time.perf_counter() - issued:.2f} s")
        time.sleep(0.5)
        assert not any(f.is_ready() for f in futures)
        assert 1 <= detector_threads() <= cap
        # Waiting threads sleep: well under a core's 0.5 s (CUDA: blocking-sync events; the
        # simulated device: its blocking wait).
        spent = (library_thread_cpu_ns() - cpu_before) / 1e9
        assert spent < 0.25, f"library threads used {spent:.2f} s of CPU in 0.5 s"
    finally:
        for release in releases:
            release()
    for future in futures:
        assert torch.equal(future.wait(WAIT_MS).cpu(), torch.ones(4))
    assert detector_threads() <= cap


def test_sync_waits_for_each_devices_current_stream_only(gpu):
    with gpu.side_stream():
        release_side = gpu.hold()  # another stream's work: not waited for
    try:
        gpu.sleep(50)
        started = time.monotonic()
        collect = dtorch_ops.sync_async([f"{gpu.name}:0"])
        assert not collect.is_ready()
        collect.wait(WAIT_MS)
        assert time.monotonic() - started < 1.5  # not the side stream's (CUDA: 2 s) hold
        dtorch_ops.sync([f"{gpu.name}:0"])
    finally:
        release_side()
