"""torch.compile'd steps.

1. A training step (MLP, synthetic data): per-step time with the loss logged through a future
   (dtorch_ops.get_tensor inside the compiled step, values read later by a logger), or through the
   host copy (to_torch_async(loss, device="cpu") inside the step: the logger gets a CPU value) vs
   no logging vs loss.item() every step. On a GPU the target is <= 2% over no logging and faster
   than .item(); on CPU .item() does not stall, so all should be close.
2. A small step (64x64) that creates a future mid-step with dtorch_ops.to_torch_async: compiled
   into the graph (an ordered op returning the opaque future) vs the graph-break fallback (what a
   torch without opaque types gets) vs no future; and the same step calling the raw op,
   torch.ops.dtorch.get_tensor_async, which Dynamo traces as to_torch_async (the same graph).
"""
import statistics
import time

import torch
import torch._dynamo

import dtorch_ops
from common import (Anchor, Figure, Report, Target, interleaved_samples, per_call_us,
                    print_medians)

SECTION = "torch.compile"


def _make(device, backend, mode):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    host_copy = mode == "host"

    def forward(x, y, promise):
        loss = torch.nn.functional.mse_loss(model(x), y)
        if promise is not None:
            dtorch_ops.get_tensor(loss.detach(), promise)
        if host_copy:
            return loss, dtorch_ops.to_torch_async(loss, device="cpu")
        return loss, None

    # (Before torch 2.12 the host copy's future is made at a graph break.)
    in_graph = not host_copy or dtorch_ops.compile.graph_ops.defined_ops is not None
    compiled = torch.compile(forward, fullgraph=in_graph, backend=backend)
    x = torch.randn(256, 512, device=device)
    y = torch.randn(256, 1, device=device)
    pending = []

    def step():
        promise = dtorch_ops.TensorPromise() if mode == "future" else None
        loss, copy = compiled(x, y, promise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if mode == "item":
            pending.append(loss.item())
        elif mode == "future":
            pending.append(promise.get_future())
        elif mode == "host":
            pending.append(copy)

    def drain():  # the logger reads the values later, off the step's critical path
        for f in pending:
            if not isinstance(f, float):
                f.wait(60_000)
        pending.clear()

    return step, drain


def main(report, steps=30, rounds=5, backend="inductor"):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch._dynamo.reset()
    runners = {mode: _make(device, backend, mode) for mode in ("none", "future", "host", "item")}
    for step, drain in runners.values():  # compile and warm up
        for _ in range(3):
            step()
        drain()
    samples = {mode: [] for mode in runners}
    for _ in range(rounds):
        for mode, (step, drain) in runners.items():
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                step()
            if device == "cuda":
                torch.cuda.synchronize()
            samples[mode].append((time.perf_counter() - start) / steps * 1e3)
            drain()
    m = {mode: statistics.median(v) for mode, v in samples.items()}
    print(f"\ncompiled training step on {device} ({backend}; ms per step, median of {rounds} "
          f"rounds x {steps} steps)")
    labels = {"none": "no logging", "future": "loss via get_tensor + future",
              "host": "loss via host copy (to_torch_async(loss, device='cpu'))",
              "item": "loss.item() every step"}
    for mode, label in labels.items():
        print(f"  {label:>56}: {m[mode]:8.3f} ms")
    on_gpu = device == "cuda"
    report.add(Figure(SECTION, f"compiled training step on {device} ({backend})", "ms",
                      labels["future"], samples["future"],
                      [Anchor(labels["none"], samples["none"],
                              Target("<=", 1.02, issue=6, condition="on a GPU", applies=on_gpu)),
                       # on CPU .item() does not stall: the three are close there
                       Anchor(labels["item"], samples["item"],
                              Target("<", 1, issue=6, condition="on a GPU", applies=on_gpu))]))
    report.add(Figure(SECTION, f"compiled training step on {device} ({backend}), host copy", "ms",
                      labels["host"], samples["host"],
                      [Anchor(labels["none"], samples["none"],
                              Target("<=", 1.02, issue=16, condition="on a GPU",
                                     applies=on_gpu)),
                       Anchor(labels["item"], samples["item"],
                              Target("<", 1, issue=16, condition="on a GPU", applies=on_gpu))]))


def _step_no_future(x, w):
    h = torch.relu(x @ w)
    return (h * 2).sum(), None


def _step_future(x, w):
    h = torch.relu(x @ w)
    future = dtorch_ops.to_torch_async(h.sum())  # mid-step: later work follows
    return (h * 2).sum(), future


def _step_future_fallback(x, w):  # the same body, its own code object (its own compiled entry)
    h = torch.relu(x @ w)
    future = dtorch_ops.to_torch_async(h.sum())
    return (h * 2).sum(), future


def _step_raw_op(x, w):  # the raw op as the design card writes it: traced as to_torch_async
    h = torch.relu(x @ w)
    future = torch.ops.dtorch.get_tensor_async(h.sum())
    return (h * 2).sum(), future


class _WithoutOpaqueTypes:
    """Runs the code as a torch without opaque types does: the raw op and a graph break."""

    def __enter__(self):
        self._saved = dtorch_ops.compile.graph_ops.defined_ops
        dtorch_ops.compile.graph_ops.defined_ops = None

    def __exit__(self, *exc):
        dtorch_ops.compile.graph_ops.defined_ops = self._saved


def main_future_in_graph(report, rounds=7, calls=300, backend="inductor"):
    if dtorch_ops.compile.graph_ops.defined_ops is None:
        print(f"\nfuture created in a compiled step: skipped (torch {torch.__version__} has no "
              "opaque types; compiled code takes the graph-break fallback)")
        return
    torch._dynamo.reset()
    x, w = torch.randn(64, 64), torch.randn(64, 64)
    none = torch.compile(_step_no_future, backend=backend)
    in_graph = torch.compile(_step_future, backend=backend)
    fallback = torch.compile(_step_future_fallback, backend=backend)
    raw_op = torch.compile(_step_raw_op, backend=backend)

    def run_fallback():
        with _WithoutOpaqueTypes():
            fallback(x, w)[1].get()

    cases = {
        "no future": lambda: none(x, w),
        "future in the graph": lambda: in_graph(x, w)[1].get(),
        "graph-break fallback": run_fallback,
        "raw op in the graph": lambda: raw_op(x, w)[1].get(),
    }
    for fn in cases.values():  # compile and warm up
        for _ in range(5):
            fn()
    s = interleaved_samples(cases, rounds, lambda fn: per_call_us(fn, calls))
    print_medians(f"future created in a compiled 64x64 step ({backend}, CPU threads "
                  f"{torch.get_num_threads()}; us per step incl. get(), median of {rounds} rounds)",
                  s, "us")
    report.add(Figure(SECTION, f"future created in a compiled 64x64 step ({backend})", "us",
                      "future in the graph", s["future in the graph"],
                      # aot_eager runs with_effects in Python: the target is inductor's
                      [Anchor("graph-break fallback", s["graph-break fallback"],
                              Target("<", 1, issue=10, condition="under inductor",
                                     applies=backend == "inductor")),
                       Anchor("no future", s["no future"])]))
    report.add(Figure(SECTION, f"raw op called in a compiled 64x64 step ({backend})", "us",
                      "raw op in the graph", s["raw op in the graph"],
                      [Anchor("future in the graph", s["future in the graph"]),
                       Anchor("graph-break fallback", s["graph-break fallback"],
                              Target("<", 1, issue=34, condition="under inductor",
                                     applies=backend == "inductor"))]))


if __name__ == "__main__":
    main(Report())
    main_future_in_graph(Report())
