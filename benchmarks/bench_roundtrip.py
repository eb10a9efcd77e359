"""In-process round trip: make a future for a ready (CPU) tensor and take its value."""
import torch

import dtorch_ops
from common import interleaved_medians, per_call_us, ratio_line, report


def main(rounds=7, calls=2000):
    x = torch.ones(16)
    get_tensor_async = torch.ops.dtorch.get_tensor_async

    def raw_op():
        get_tensor_async(x).get()

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

    cases = {
        "get_tensor_async(x).get()": raw_op,
        "to_torch_async(x).get()": python_api,
        "anchor: aten.alias + Future": anchor_alias_future,
        "anchor: torch.futures.Future": anchor_future,
    }
    for fn in cases.values():
        per_call_us(fn, 200)  # warm up
    m = interleaved_medians(cases, rounds, lambda fn: per_call_us(fn, calls))
    report(f"round trip (us per call; median of {rounds} interleaved rounds x {calls})", m, "us")
    ratio_line("raw op vs aten.alias + Future", m["get_tensor_async(x).get()"],
               m["anchor: aten.alias + Future"], "target <= 1.5x")
    ratio_line("Python API vs Future", m["to_torch_async(x).get()"],
               m["anchor: torch.futures.Future"], "target <= 1.2x")

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
    q = interleaved_medians(queries, rounds, lambda fn: per_call_us(fn, calls * 20))
    report(f"non-blocking query (us per call; median of {rounds} rounds x {calls * 20})", q, "us")
    ratio_line("is_ready() vs pybind11 module function", q["future.is_ready()"],
               q["anchor: pybind11 module function"], "target <= 3x")
    ratio_line("is_ready() vs pybind11 method", q["future.is_ready()"],
               q["anchor: pybind11 method"], "reference")


if __name__ == "__main__":
    main()
