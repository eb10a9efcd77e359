"""Scale: memory per pending future, and futures resolved per second from several threads.

Memory: N futures kept pending, each case in a fresh process (so that one case's freed heap does
not hold the next case's objects): the memory kind as a Python user holds it (a TensorPromise and
its future, both kept: the "wrapped pair"), one torch.futures.Future, and the file kind
(bench_file.memory). Bytes per future = the RSS (VmRSS) delta after gc / N; then tracemalloc
counts the Python-side bytes of another N (RSS first: tracemalloc's own tables would inflate it).

Throughput: T threads each loop over: create a memory pair, set_value, get(); against the same
loop with torch.futures.Future (set_result, wait). Rounds interleave the two.
"""
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc

import torch

import bench_file
import dtorch_ops
from common import Anchor, Figure, Report, Target, print_medians, proc_status_bytes

SECTION = "Scale"
WAIT_S = 300.0  # bound on each fresh process and each producer thread
PAIR = "memory pair (promise + future kept)"
TORCH_FUTURE = "torch.futures.Future"
FILE_PAIR = "file pair (promise + future kept)"


# ---- memory per pending future (the child process's side) ----


def _hold(case, n):
    """n pending futures of `case`, kept as a user keeps them (promises and futures in lists)."""
    if case == TORCH_FUTURE:
        return [torch.futures.Future() for _ in range(n)]
    promises = [dtorch_ops.TensorPromise() for _ in range(n)]
    return promises, [p.get_future() for p in promises]


def _per_future(case, n, bytes_now):
    """How much bytes_now() grows per future while n futures of `case` are held (after gc)."""
    gc.collect()
    before = bytes_now()
    held = _hold(case, n)
    gc.collect()
    grown = bytes_now() - before
    del held
    gc.collect()
    return grown / n


def _pending_bytes(case, n):
    """{"rss": bytes per pending future, "python": of which tracemalloc sees}."""
    rss = _per_future(case, n, lambda: proc_status_bytes("VmRSS"))
    tracemalloc.start()
    python = _per_future(case, n, lambda: tracemalloc.get_traced_memory()[0])
    tracemalloc.stop()
    return {"rss": rss, "python": python}


def _child(case, n, result_path):
    if case == FILE_PAIR:
        result = {"rss": bench_file.memory(n)["memory"]["per_future"]["rss"]}
    else:
        result = _pending_bytes(case, n)
    with open(result_path, "w") as f:
        json.dump(result, f)


def _in_fresh_process(case, n):
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--pending", case, str(n),
                        result_path], check=True, timeout=WAIT_S)
        with open(result_path) as f:
            return json.load(f)


def memory(report, pending, file_pending, repeats):
    measured = {PAIR: [], TORCH_FUTURE: []}
    for _ in range(repeats):  # interleaved
        for case, results in measured.items():
            results.append(_in_fresh_process(case, pending))
    rss = {case: [r["rss"] for r in results] for case, results in measured.items()}
    python = {case: [r["python"] for r in results] for case, results in measured.items()}
    print_medians(f"memory per pending future, {pending:,} pending (bytes, RSS delta / N; "
                  f"median of {repeats} fresh processes)", rss, "B")
    print_medians("  of which Python objects (tracemalloc)", python, "B")
    report.add(Figure(SECTION, f"bytes per pending future, {pending:,} pending (RSS)", "B", PAIR,
                      rss[PAIR], [Anchor(TORCH_FUTURE, rss[TORCH_FUTURE],
                                         Target("<=", 1.3, issue=35))]))
    report.add(Figure(SECTION, f"Python-side bytes per pending future, {pending:,} pending "
                      "(tracemalloc)", "B", PAIR, python[PAIR],
                      [Anchor(TORCH_FUTURE, python[TORCH_FUTURE])]))
    file_rss = _in_fresh_process(FILE_PAIR, file_pending)["rss"]
    report.add(Figure(SECTION, f"bytes per pending file future, {file_pending:,} pending (RSS)",
                      "B", FILE_PAIR, [file_rss]))


# ---- futures resolved per second ----


def _resolve_ours(count, value):
    for _ in range(count):
        promise = dtorch_ops.TensorPromise()
        future = promise.get_future()
        promise.set_value(value)
        future.get()


def _resolve_torch(count, value):
    for _ in range(count):
        future = torch.futures.Future()
        future.set_result(value)
        future.wait()


def _resolved_per_s(loop, threads, count):
    """Futures resolved per second by `threads` threads running loop(count, value) at once."""
    value = torch.ones(4)
    start = threading.Barrier(threads + 1)

    def producer():
        start.wait(WAIT_S)
        loop(count, value)

    workers = [threading.Thread(target=producer, daemon=True) for _ in range(threads)]
    for worker in workers:
        worker.start()
    start.wait(WAIT_S)
    t0 = time.perf_counter()
    for worker in workers:
        worker.join(WAIT_S)
        if worker.is_alive():
            raise TimeoutError(f"a producer thread did not finish within {WAIT_S} s")
    return threads * count / (time.perf_counter() - t0)


def throughput(report, thread_counts, count, rounds):
    for threads in thread_counts:
        cases = {PAIR: _resolve_ours, TORCH_FUTURE: _resolve_torch}
        rates = {case: [] for case in cases}
        for _ in range(rounds):  # interleaved
            for case, loop in cases.items():
                rates[case].append(_resolved_per_s(loop, threads, count))
        print_medians(f"futures resolved per second, {threads} producer thread(s), {count:,} each "
                      f"(median of {rounds} rounds)", rates, "futures/s")
        report.add(Figure(SECTION, f"futures resolved per second, {threads} producer thread(s)",
                          "futures/s", PAIR, rates[PAIR],
                          [Anchor(TORCH_FUTURE, rates[TORCH_FUTURE],
                                  Target(">=", 0.9, issue=35))]))


def main(report, pending=100_000, file_pending=10_000, repeats=3, thread_counts=(1, 2, 4, 8),
         count=20_000, rounds=5):
    memory(report, pending, file_pending, repeats)
    throughput(report, thread_counts, count, rounds)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--pending"]:  # one case, in the fresh process memory() starts
        _child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        main(Report())
