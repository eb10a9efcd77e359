"""In-process round trip: make a future for a ready (CPU) tensor and take its value."""
import torch

import dtorch_ops
from common import (Anchor, Figure, Report, Target, interleaved_samples, per_call_us,
                    print_medians)

SECTION = "In-process round trip (memory kind)"


def main(report, rounds=7, calls=2000):
    x = torch.ones(16)
    get_tensor_async = torch.ops.dtorch.get_tensor_async

    def raw_op():
        get_tensor_async(x).get()

    def python_api():
        dtorch_ops.to_torch_async(x).get()

    make_promise = dtorch_ops.TensorPromise

    def promise_pair():  # what a producer does by hand: torch.futures.Future's own round trip
        promise = make_promise()
        future = promise.get_future()
        promise.set_value(x)
        future.get()

    def anchor_alias_future():
        y = torch.ops.aten.alias(x)
        f = torch.futures.Future()
        f.set_result(y)
        f.wait()

    def anchor_future():
        f = torch.futures.Future()
        f.set_result(x)
        f.wait()

    cases = {
        "get_tensor_async(x).get()": raw_op,
        "to_torch_async(x).get()": python_api,
        "promise + future + set + get": promise_pair,
        "anchor: aten.alias + Future": anchor_alias_future,
        "anchor: torch.futures.Future": anchor_future,
    }
    for fn in cases.values():
        per_call_us(fn, 200)  # warm up
    s = interleaved_samples(cases, rounds, lambda fn: per_call_us(fn, calls))
    print_medians(f"round trip (us per call; median of {rounds} interleaved rounds x {calls})", s,
                  "us")
    report.add(Figure(SECTION, "round trip, raw op", "us", "get_tensor_async(x).get()",
                      s["get_tensor_async(x).get()"],
                      [Anchor("aten.alias + torch.futures.Future",
                              s["anchor: aten.alias + Future"], Target("<=", 1.3, issue=35))]))
    report.add(Figure(SECTION, "round trip, Python API", "us", "to_torch_async(x).get()",
                      s["to_torch_async(x).get()"],
                      [Anchor("torch.futures.Future", s["anchor: torch.futures.Future"],
                              Target("<=", 1.2, issue=9))],
                      size_bytes=x.nbytes, size_independent=True))
    report.add(Figure(SECTION, "round trip, promise + future + set + get", "us",
                      "TensorPromise(), get_future(), set_value(x), get()",
                      s["promise + future + set + get"],
                      [Anchor("torch.futures.Future() + set_result + wait",
                              s["anchor: torch.futures.Future"], Target("<=", 1.1, issue=35))]))

    # A non-blocking query from Python: one C++ call through the binding, vs the cheapest
    # pybind11 calls (a module function and a bound method of one of torch's own classes).
    future = dtorch_ops.to_torch_async(x)
    graph = torch._C.Graph()
    queries = {
        "future.is_ready()": future.is_ready,
        "anchor: pybind11 module function": torch._C._get_tracing_state,
        "anchor: pybind11 method": graph.param_node,
        "before: raw TorchScript is_ready()": future.raw.is_ready,
    }
    for fn in queries.values():
        per_call_us(fn, 2000)
    q = interleaved_samples(queries, rounds, lambda fn: per_call_us(fn, calls * 20))
    print_medians(f"non-blocking query (us per call; median of {rounds} rounds x {calls * 20})",
                  q, "us")
    report.add(Figure(SECTION, "non-blocking query", "us", "future.is_ready()",
                      q["future.is_ready()"],
                      [Anchor("pybind11 module function", q["anchor: pybind11 module function"],
                              Target("<=", 3, issue=9)),
                       Anchor("pybind11 method", q["anchor: pybind11 method"]),
                       Anchor("raw TorchScript is_ready() (before issue 9)",
                              q["before: raw TorchScript is_ready()"])]))


if __name__ == "__main__":
    main(Report())
