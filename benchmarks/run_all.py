"""Benchmarks of dtorch_ops, each reported as a ratio against an anchor measured in the same run.

Interleaved rounds, median of rounds. Timing is reported, never asserted.
"""
import statistics
import time

import torch

import dtorch_ops

ROUNDS = 7
CALLS = 2000


def _per_call_us(fn, calls=CALLS):
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def round_trips(x):
    def raw_op():
        torch.ops.dtorch.get_tensor_async(x).get()

    def python_api():
        dtorch_ops.to_torch_async(x).get()

    def anchor_alias_future():
        y = torch.ops.aten.alias(x)
        f = torch.futures.Future()
        f.set_result(y)
        f.wait()

    def anchor_future():
        f = torch.futures.Future()
        f.set_result(x)
        f.wait()

    cases = {"raw": raw_op, "api": python_api, "alias+future": anchor_alias_future,
             "future": anchor_future}
    samples = {name: [] for name in cases}
    for fn in cases.values():  # warm up
        _per_call_us(fn, 200)
    for _ in range(ROUNDS):
        for name, fn in cases.items():
            samples[name].append(_per_call_us(fn))
    return {name: statistics.median(v) for name, v in samples.items()}


def main():
    x = torch.ones(16)
    m = round_trips(x)
    print(f"round trip, median of {ROUNDS} rounds x {CALLS} calls (us per call):")
    for name, us in m.items():
        print(f"  {name:>14}: {us:7.2f}")
    print(f"raw get_tensor_async(x).get() / (aten.alias + Future): {m['raw'] / m['alias+future']:.2f}x"
          " (target <= 1.5x)")
    print(f"to_torch_async(x).get() / Future round trip:         {m['api'] / m['future']:.2f}x"
          " (target <= 2x)")


if __name__ == "__main__":
    main()
