"""Helpers shared by the benchmarks: interleaved rounds, medians, ratio lines."""
import statistics
import time


def per_call_us(fn, calls):
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def interleaved_medians(cases, rounds, measure):
    """measure(fn) -> one sample; cases run in turn each round; returns {name: median}."""
    samples = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            samples[name].append(measure(fn))
    return {name: statistics.median(v) for name, v in samples.items()}


def report(title, medians, unit):
    print(f"\n{title}")
    for name, value in medians.items():
        print(f"  {name:>34}: {value:9.2f} {unit}")


def ratio_line(label, ours, anchor, target):
    ratio = ours / anchor
    print(f"  => {label}: {ratio:.2f}x ({target})")
    return ratio
