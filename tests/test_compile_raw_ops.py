"""The raw ops (torch.ops.dtorch.get_tensor_async, sync, the host copies) inside torch.compile'd
code: Dynamo traces them as the Python API's calls (dtorch_ops/compile/raw_ops.py), so they
compile into the graph and the compiled call returns the Python futures: the host copies, the
methods of the future after the call, the op reached any way, what it refuses, TorchScript, a
Dynamo without the registrations. The raw ops' compiled steps (every backend, dynamic shapes, a
training step) and the fallback without graph ops are beside the Python API's
(test_compile_futures.py, test_compile.py), torch.export in test_compile_export.py (CPU; inductor
compiles take seconds on 2 cores)."""
import asyncio
import time

import pytest
import torch
import torch._dynamo

import dtorch_ops
from compile_helpers import RAW_OPS
from conftest import WAIT_MS

ops = torch.ops.dtorch


def _host_copy_step(x):
    """The host copies and sync over a device list, through the raw ops (the packet and .default
    forms of get_tensor_async and sync are in test_compile_futures.py)."""
    doubled = x * 2
    host = ops.copy_to_host_async(doubled[0])
    host_list = ops.copy_list_to_host_async.default([doubled[0], doubled.sum()])
    done_on = ops.sync.default([torch.device("cpu")])
    doubled.mul_(3)  # later in the graph: an intermediate overwritten in place
    return doubled + 1, (host, host_list, done_on)


@RAW_OPS
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_raw_host_copies_compile_into_the_graph(backend):
    torch._dynamo.reset()
    explain = torch._dynamo.explain(_host_copy_step)(torch.randn(3))
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(_host_copy_step, fullgraph=True, backend=backend)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            x = torch.randn(3)
            out, (host, host_list, done_on) = compiled(x)
            assert type(host) is dtorch_ops.TensorFuture
            torch.testing.assert_close(host.wait(WAIT_MS), x[0] * 2)  # as of the call
            assert type(host_list) is dtorch_ops.TensorListFuture
            first, total = host_list.wait(WAIT_MS)
            torch.testing.assert_close(first, x[0] * 2)
            torch.testing.assert_close(total, (x * 2).sum())
            assert done_on.wait(WAIT_MS) is None and done_on.devices() == [torch.device("cpu")]
            torch.testing.assert_close(out, x * 6 + 1)
    # Eager calls still reach the C++ op and its TorchScript future.
    raw = ops.get_tensor_async(torch.ones(2))
    assert isinstance(raw, torch.ScriptObject) and torch.equal(raw.wait(WAIT_MS), torch.ones(2))


@RAW_OPS
def test_a_compiled_raw_future_has_the_raw_and_the_python_methods():
    from devices import SimDev

    dev = SimDev()
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: ops.get_tensor_async((x + 1) * 2), fullgraph=True,
                             backend="aot_eager")
    x = torch.ones(4, device="simdev")
    compiled(x).get()  # compile outside the held stream
    release = dev.hold()
    try:
        future = compiled(x)
        assert not future.is_ready() and not future.done() and future.valid()
        with pytest.raises(RuntimeError, match="timed out") as timed_out:
            future.wait(50)  # the raw op's wait(ms): a RuntimeError subclass on timeout
        assert isinstance(timed_out.value, dtorch_ops.FutureTimeoutError) and future.valid()
        assert future.wait_for(20) is False  # the raw op's wait_for(ms) -> bool
        derived = future.then(lambda f: f.value() + 1)  # torch.futures.Future's names
        called = []
        future.add_done_callback(lambda f: called.append(f.value().cpu().sum().item()))
    finally:
        release()
    expected = torch.full((4,), 4.0)
    assert future.wait_for(WAIT_MS) is True
    assert torch.equal(future.wait(WAIT_MS).cpu(), expected)
    assert torch.equal(future.result(WAIT_MS / 1000).cpu(), expected)
    assert torch.equal(derived.wait(WAIT_MS).cpu(), expected + 1)
    deadline = time.monotonic() + WAIT_MS / 1000
    while not called and time.monotonic() < deadline:
        time.sleep(0.01)
    assert called == [16.0]
    assert torch.equal(future.get().cpu(), expected)
    assert future.done() and future.is_ready() and not future.valid()


@RAW_OPS
def test_a_compiled_raw_future_is_awaitable():
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: (x + 1, ops.get_tensor_async(x * 2), ops.sync()),
                             fullgraph=True, backend="inductor")

    async def main():
        _, future, done = compiled(torch.ones(2))
        return (await asyncio.wait_for(future, WAIT_MS / 1000),
                await asyncio.wait_for(done, WAIT_MS / 1000))

    value, nothing = asyncio.run(main())
    assert torch.equal(value, torch.full((2,), 2.0)) and nothing is None


@RAW_OPS
def test_the_op_reached_any_way_compiles():
    # Dynamo meets the op object through a global, a closure, an argument, a container, a
    # partial, getattr: each is traced as the stand-in. Another op passed in recompiles.
    import functools

    in_a_list, in_a_dict = [ops.get_tensor_async], {"op": ops.get_tensor_async.default}
    partial = functools.partial(ops.get_tensor_async)

    def make(op):
        return lambda x: op(x + 1)

    forms = {
        "closure": make(ops.get_tensor_async),
        "list": lambda x: in_a_list[0](x + 1),
        "dict": lambda x: in_a_dict["op"](x + 1),
        "partial": lambda x: partial(x + 1),
        "getattr": lambda x: getattr(ops.get_tensor_async, "default")(x + 1),
        "keyword": lambda x: ops.get_tensor_async(input=x + 1),
    }
    for name, form in forms.items():
        torch._dynamo.reset()
        future = torch.compile(form, fullgraph=True, backend="eager")(torch.ones(2))
        assert type(future) is dtorch_ops.TensorFuture, name
        assert torch.equal(future.wait(WAIT_MS), torch.full((2,), 2.0)), name
    # The op's other members are what Dynamo makes of an op's (overloads(): a graph break).
    torch._dynamo.reset()
    with_overloads = torch.compile(lambda x: (ops.get_tensor_async.overloads(),
                                              ops.get_tensor_async(x + 1))[1], backend="eager")
    future = with_overloads(torch.ones(2))
    assert torch.equal(future.wait(WAIT_MS), torch.full((2,), 2.0))
    torch._dynamo.reset()
    compiled = torch.compile(lambda op, x: op(x + 1), fullgraph=True, backend="eager")
    assert torch.equal(compiled(ops.get_tensor_async, torch.ones(2)).get(), torch.full((2,), 2.0))
    host = compiled(ops.copy_to_host_async, torch.ones(2))  # a guard fails: a second graph
    assert type(host) is dtorch_ops.TensorFuture and torch.equal(host.get(), torch.full((2,), 2.0))


@RAW_OPS
def test_what_the_raw_op_refuses_eagerly_it_refuses_compiled():
    # The Python API takes more (one device for sync_async, a str): a raw op in compiled code
    # takes what its schema takes, so compiled code also runs eagerly and in TorchScript.
    for bad, why in ((lambda x: ops.get_tensor_async([x]), "expects a Tensor for input"),
                     (lambda x: ops.sync("cpu"), "expects None or a list of devices"),
                     (lambda x: ops.sync([0]), "expects devices as str or torch.device"),
                     (lambda x: ops.copy_list_to_host_async(x), "expects a list of Tensors")):
        with pytest.raises(RuntimeError):
            bad(torch.ones(1))  # eagerly: the schema refuses
        torch._dynamo.reset()
        with pytest.raises(Exception, match=why):
            torch.compile(bad, fullgraph=True, backend="eager")(torch.ones(1))


_WITHOUT_THE_REGISTRATIONS = """
import warnings
import torch, torch._dynamo
import torch._dynamo.variables.functions as dynamo_functions
del dynamo_functions.PolyfilledFunctionVariable  # a Dynamo without what raw_ops registers in
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import dtorch_ops
if dtorch_ops.compile.graph_ops.defined_ops is not None:
    assert any("break compiled graphs" in str(w.message) for w in caught), caught
assert not dtorch_ops.compile.raw_ops.registered  # (what tests/compile_helpers.RAW_OPS skips on)
explain = torch._dynamo.explain(lambda x: torch.ops.dtorch.get_tensor_async(x * 2))(torch.ones(2))
reasons = [r.reason for r in explain.break_reasons]
assert any("returned non-Tensor" in r for r in reasons), reasons  # Dynamo's own graph break
print("ok")
"""


def test_the_raw_op_route_exists_where_it_is_pinned():
    # Dynamo's tables raw_ops.py registers the stand-ins in: checked on the torch versions
    # scripts/compat.sh runs (2.13 here, 2.14.1, 2.15.0); 2.11 has no graph ops (a graph break
    # naming the version: test_compile.py), and an untested torch may lack the tables (RAW_OPS
    # then skips the raw-op cases, and Dynamo's own graph break stays).
    from torch.torch_version import TorchVersion

    version = TorchVersion(torch.__version__)
    if not ("2.13" <= version < "2.16"):
        pytest.skip(f"torch {torch.__version__} is not one the route is pinned on (2.13-2.15)")
    assert dtorch_ops.compile.graph_ops.defined_ops is not None
    assert dtorch_ops.compile.raw_ops.registered
    # Each op's packet and its one overload (.default), of the four raw ops.
    names = sorted(str(op) for op in dtorch_ops.compile.raw_ops._substituted)
    assert len(names) == 8 and len(set(names)) == 8, names


def test_a_dynamo_without_the_registrations_keeps_its_own_graph_break():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _WITHOUT_THE_REGISTRATIONS],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


# ---- TorchScript of a module calling the raw op (its torch.export: test_compile_export.py) ----


class _CallsTheRawOp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x):
        out = self.lin(x).sum()
        return out, torch.ops.dtorch.get_tensor_async((out * 2).detach())


def test_scripting_the_module_is_unchanged(tmp_path):
    module = _CallsTheRawOp()
    scripted = torch.jit.script(module)
    path = tmp_path / "module.pt"
    torch.jit.save(scripted, str(path))
    loaded = torch.jit.load(str(path))
    for runnable in (scripted, loaded):
        x = torch.randn(2, 4)
        out, future = runnable(x)
        assert isinstance(future, torch.ScriptObject)
        torch.testing.assert_close(future.wait(WAIT_MS), module(x)[0].detach() * 2)
    if dtorch_ops.compile.raw_ops.registered and dtorch_ops.compile.graph_ops.defined_ops:
        # and the same module compiles
        torch._dynamo.reset()
        out, future = torch.compile(module, fullgraph=True, backend="aot_eager")(x)
        torch.testing.assert_close(future.wait(WAIT_MS), out.detach() * 2)
