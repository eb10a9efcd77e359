"""torch.compile of futures created inside compiled graphs (opaque future classes, Python-defined
ops): eager, aot_eager and inductor backends, dynamic shapes, the simulated device, a second
process (CPU; inductor compiles take seconds on 2 cores)."""
import pytest
import torch
import torch._dynamo

import dtorch_ops
from compile_helpers import GRAPH_OPS, RAW_OPS, _GraphCapture, _model
from conftest import WAIT_MS


# ---- futures created inside compiled graphs (opaque future classes, Python-defined ops) ----

BACKENDS = ["eager", "aot_eager", "inductor"]


def _future_step(x, w):
    """Three futures in one graph, two on one tensor and one on a view; none of their values is a
    graph output; the tensor is overwritten in place later in the graph."""
    product = x @ w
    loss = product.sum()
    first = dtorch_ops.to_torch_async(loss)
    again = dtorch_ops.to_torch_async(loss)
    row = dtorch_ops.to_torch_async(product[1:])
    done = dtorch_ops.sync_async()
    loss.mul_(3)  # later in the graph: an intermediate overwritten in place
    return loss * 2 + 1, (first, again, row, done)


def _raw_op_step(x, w):
    """The same step through the raw ops, as the packet and as .default (traced as the Python
    API's calls: dtorch_ops/compile/raw_ops.py)."""
    product = x @ w
    loss = product.sum()
    first = torch.ops.dtorch.get_tensor_async(loss)
    again = torch.ops.dtorch.get_tensor_async.default(loss)
    row = torch.ops.dtorch.get_tensor_async(product[1:])
    done = torch.ops.dtorch.sync()
    loss.mul_(3)
    return loss * 2 + 1, (first, again, row, done)


@GRAPH_OPS
@pytest.mark.parametrize("step", [pytest.param(_future_step, id="python_api"),
                                  pytest.param(_raw_op_step, id="raw_ops", marks=RAW_OPS)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_futures_created_in_a_compiled_step(backend, step):
    torch._dynamo.reset()
    explain = torch._dynamo.explain(step)(torch.randn(3, 4), torch.randn(4, 5))
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    seen = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            x, w = torch.randn(3, 4), torch.randn(4, 5)
            out, (first, again, row, done) = compiled(x, w)
            product = x @ w
            # Functionalized backends capture the intermediate as of the call; the eager backend
            # runs the graph as written, so the future aliases it like eager code.
            loss = product.sum() * (3 if backend == "eager" else 1)
            assert type(first) is dtorch_ops.TensorFuture and first is not again
            assert first.kind() == "memory" and isinstance(first.raw, torch.ScriptObject)
            torch.testing.assert_close(first.wait(WAIT_MS), loss)
            torch.testing.assert_close(again.get(), loss)
            torch.testing.assert_close(row.wait(WAIT_MS), product[1:])
            assert type(done) is dtorch_ops.VoidFutureCollect and done.wait(WAIT_MS) is None
            torch.testing.assert_close(out, product.sum() * 6 + 1)
            assert first.valid() and not again.valid()  # (only get() consumes)
            seen.append(first)
    assert len({id(f) for f in seen}) == 3  # a fresh future each call


@GRAPH_OPS
def test_compiled_futures_are_awaitable():
    import asyncio

    torch._dynamo.reset()
    compiled = torch.compile(lambda x: (x + 1, dtorch_ops.to_torch_async(x * 2)),
                             fullgraph=True, backend="aot_eager")

    async def main():
        out, future = compiled(torch.ones(2))
        return await asyncio.wait_for(future, WAIT_MS / 1000)

    assert torch.equal(asyncio.run(main()), torch.full((2,), 2.0))


@GRAPH_OPS
def test_compiled_future_is_recorded_right_after_its_value():
    torch._dynamo.reset()
    capture = _GraphCapture()

    def step(x, w):
        loss = (x @ w).sum()
        future = dtorch_ops.to_torch_async(loss)
        later = (x * 3).exp().sum()  # independent work, after the call
        return later, future

    _, future = torch.compile(step, fullgraph=True, backend=capture)(torch.randn(2, 3),
                                                                     torch.randn(3, 2))
    future.get()
    nodes = list(capture.aot_graphs[0].graph.nodes)
    targets = [str(n.target) for n in nodes]
    at = next(i for i, n in enumerate(nodes)
              if "with_effects" in str(n.target) and "to_torch_async" in str(n.args))
    assert "sum" in targets[at - 1], targets  # right after the value's producer...
    assert any("exp" in t for t in targets[at + 1:]), targets  # ...before the later work


# A future made in the graph: by the Python API, or by the raw ops (traced as the Python API's
# calls: dtorch_ops/compile/raw_ops.py).
FUTURE_FORMS = pytest.mark.parametrize(
    "future_of, sync_of",
    [pytest.param(dtorch_ops.to_torch_async, dtorch_ops.sync_async, id="python_api"),
     pytest.param(torch.ops.dtorch.get_tensor_async, torch.ops.dtorch.sync, id="raw_ops",
                  marks=RAW_OPS)])


@GRAPH_OPS
@FUTURE_FORMS
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_futures_over_dynamic_shapes(backend, future_of, sync_of):
    torch._dynamo.reset()

    def step(x):
        doubled = x * 2
        return doubled.sum(), future_of(doubled), sync_of()

    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend=backend)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for n in (3, 5, 8):
            x = torch.randn(n)
            total, future, done = compiled(x)
            torch.testing.assert_close(future.wait(WAIT_MS), x * 2)  # not a graph output
            torch.testing.assert_close(total, (x * 2).sum())
            assert done.wait(WAIT_MS) is None


@GRAPH_OPS
@FUTURE_FORMS
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_training_step_logs_its_loss_through_a_future(backend, future_of, sync_of):
    torch._dynamo.reset()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def forward(x, y):
        hidden = torch.relu(model[0](x))
        loss = torch.nn.functional.mse_loss(model[2](hidden), y)
        return loss, hidden.detach().norm()

    def step(x, y):
        loss, hidden_norm = forward(x, y)
        # The loss's future holds a graph output's alias; the norm's is no output of the graph.
        return loss, future_of(loss.detach()), future_of(hidden_norm)

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            x, y = torch.randn(4, 8), torch.randn(4, 1)
            expected_loss, expected_norm = (t.detach() for t in forward(x, y))
            loss, logged, norm = compiled(x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()  # parameters change: the logged values are this step's
            torch.testing.assert_close(logged.wait(WAIT_MS), expected_loss)
            torch.testing.assert_close(norm.wait(WAIT_MS), expected_norm)


@GRAPH_OPS
def test_compiled_future_on_the_simulated_device_waits_for_its_stream():
    import time

    from devices import SimDev

    dev = SimDev()
    torch._dynamo.reset()

    def step(x):
        y = (x + 1) * 2
        return dtorch_ops.to_torch_async(y)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x = torch.ones(4, device="simdev")
    compiled(x).get()  # compile outside the held stream
    release = dev.hold()
    try:
        future = compiled(x)
        time.sleep(0.05)
        assert not future.is_ready()
    finally:
        release()
    assert torch.equal(future.wait(WAIT_MS).cpu(), torch.full((4,), 4.0))


@GRAPH_OPS
def test_compiled_reduce_overhead_mode_gives_the_values():
    # Reference opaques disable CUDA graphs (tests/gpu checks that fallback on a GPU); on CPU the
    # mode compiles with inductor and the values must be right.
    torch._dynamo.reset()
    compiled = torch.compile(_future_step, mode="reduce-overhead", fullgraph=True)
    for _ in range(2):
        x, w = torch.randn(3, 4), torch.randn(4, 5)
        out, (first, again, row, done) = compiled(x, w)
        product = x @ w
        torch.testing.assert_close(first.wait(WAIT_MS), product.sum())
        torch.testing.assert_close(row.wait(WAIT_MS), product[1:])
        torch.testing.assert_close(out, product.sum() * 6 + 1)


_SECOND_PROCESS = """
import torch, dtorch_ops
def step(x):
    y = (x * 2).sum()
    f = dtorch_ops.to_torch_async(y)
    y.add_(1)
    return y, f
compiled = torch.compile(step, fullgraph=True, backend="inductor")
for i in range(2):
    x = torch.arange(4.0) + i
    out, f = compiled(x)
    assert torch.equal(f.wait(10000), (x * 2).sum()), (f, x)
    assert torch.equal(out, (x * 2).sum() + 1)
print("ok")
"""


@GRAPH_OPS
def test_a_second_process_runs_the_same_compiled_step(tmp_path):
    # Effectful graphs bypass the FX graph cache: what matters is the values in each process.
    import os
    import subprocess
    import sys

    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path))
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _SECOND_PROCESS], env=env,
                              capture_output=True, text=True, timeout=240)
        assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
