"""torch.compile, torch.export and opcheck: the ops and classes inside traced graphs (CPU).

aot_eager for most cases; inductor for a few (compiles take seconds on 2 cores)."""
import pytest
import torch
from functorch.compile import make_boxed_func
import torch._dynamo
from torch._dynamo.backends.common import aot_autograd
from torch.testing._internal.optests.generate_tests import OpCheckError

import dtorch_ops
from conftest import WAIT_MS

UTILS = ["test_schema", "test_autograd_registration", "test_faketensor"]


# ---- opcheck: every op, one call per utility, fresh promises for each ----


def _check(op, args, util):
    torch.library.opcheck(op, args, test_utils=util)


@pytest.mark.parametrize("util", UTILS)
def test_opcheck_get_tensor(util):
    x = torch.randn(3, 4)
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()
    _check(torch.ops.dtorch.get_tensor.default, (x, promise.raw), util)
    if util != "test_autograd_registration":  # that one inspects registrations, runs nothing
        assert torch.equal(future.wait(WAIT_MS), x)


@pytest.mark.parametrize("util", UTILS)
def test_opcheck_get_tensor_async(util):
    _check(torch.ops.dtorch.get_tensor_async.default, (torch.randn(2, 2),), util)


@pytest.mark.parametrize("util", UTILS + ["test_aot_dispatch_dynamic"])
def test_opcheck_sync_wait(util):
    _check(torch.ops.dtorch.sync_wait.default, ([torch.device("cpu")],), util)


@pytest.mark.parametrize("util", UTILS)
@pytest.mark.parametrize("devices", [None, [torch.device("cpu")]])
def test_opcheck_sync(util, devices):
    _check(torch.ops.dtorch.sync.default, (devices,), util)


@pytest.mark.parametrize("util", UTILS)
def test_opcheck_sync_into(util):
    _check(torch.ops.dtorch.sync_into.default,
           ([torch.device("cpu")], torch.classes.dtorch.VoidPromise("memory")), util)


@pytest.mark.parametrize("op, make_args", [
    ("get_tensor", lambda: (torch.randn(4), torch.classes.dtorch.TensorPromise("memory"))),
    ("sync_into", lambda: ([torch.device("cpu")], torch.classes.dtorch.VoidPromise("memory"))),
])
def test_opcheck_aot_dispatch_runs_promise_ops_in_the_compiled_graph(op, make_args):
    # test_aot_dispatch_dynamic runs the op eagerly, then through an AOT-compiled graph, with the
    # same promise. The compiled run reaching the one-shot promise (and being refused) proves the
    # zero-output op was kept in the graph. (For get_tensor_async and sync, whose outputs are
    # script objects, this utility does not apply: it compares outputs with assert_close.)
    with pytest.raises(OpCheckError, match="already"):
        _check(getattr(torch.ops.dtorch, op).default, make_args(), "test_aot_dispatch_dynamic")


# ---- torch.compile of a training step that logs its loss through a promise ----


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _step_wrapper(model):
    def step(x, y, promise):
        loss = torch.nn.functional.mse_loss(model(x), y)
        dtorch_ops.get_tensor(loss.detach(), promise)  # the Python API, with the wrapper class
        return loss

    return step


def _step_raw(model):
    def step(x, y, promise):
        loss = torch.nn.functional.mse_loss(model(x), y)
        torch.ops.dtorch.get_tensor(loss.detach(), promise)
        return loss

    return step


class _GraphCapture:
    """A backend that records Dynamo's graph and the AOT forward graph, then runs aot_eager."""

    def __init__(self):
        self.dynamo_graphs, self.aot_graphs = [], []

    def __call__(self, gm, example_inputs):
        self.dynamo_graphs.append(gm)

        def forward_compiler(fw, fw_inputs):
            self.aot_graphs.append(fw)
            return make_boxed_func(fw.forward)

        return aot_autograd(fw_compiler=forward_compiler)(gm, example_inputs)


@pytest.mark.parametrize("make_step, promise_kind", [(_step_wrapper, "wrapper"), (_step_raw, "raw")])
def test_compiled_step_logs_the_loss_without_graph_breaks(make_step, promise_kind):
    torch._dynamo.reset()
    model = _model()
    step = make_step(model)
    capture = _GraphCapture()
    compiled = torch.compile(step, fullgraph=True, backend=capture)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def promise_arg(promise):
        return promise if promise_kind == "wrapper" else promise.raw

    explain = torch._dynamo.explain(step)(torch.randn(4, 8), torch.randn(4, 1),
                                          promise_arg(dtorch_ops.TensorPromise()))
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            x, y = torch.randn(4, 8), torch.randn(4, 1)
            expected = torch.nn.functional.mse_loss(model(x), y).detach()  # eager, same params
            promise = dtorch_ops.TensorPromise()
            future = promise.get_future()
            loss = compiled(x, y, promise_arg(promise))
            # The op ran in this step: the promise was fulfilled, with the compiled loss.
            value = future.wait(WAIT_MS)
            torch.testing.assert_close(value, loss.detach())
            torch.testing.assert_close(value, expected)
            opt.zero_grad()
            loss.backward()  # backward runs outside the compiled region
            opt.step()
    assert len(capture.dynamo_graphs) == 1, "recompiled"
    # Not dropped, not reordered: get_tensor comes after the loss it reads, in Dynamo's graph and,
    # threaded through an effect token, in the AOT forward graph.
    nodes = [str(n.target) for n in capture.dynamo_graphs[0].graph.nodes]
    get_tensor_at = next(i for i, t in enumerate(nodes) if "dtorch.get_tensor" in t)
    loss_at = next(i for i, t in enumerate(nodes) if "mse_loss" in t)
    assert get_tensor_at > loss_at
    aot = str(capture.aot_graphs[0].graph)
    assert "with_effects" in aot and "dtorch.get_tensor.default" in aot


def test_inductor_compiled_step_logs_the_loss():
    torch._dynamo.reset()
    model = _model()
    compiled = torch.compile(_step_wrapper(model), fullgraph=True, backend="inductor")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            x, y = torch.randn(4, 8), torch.randn(4, 1)
            promise = dtorch_ops.TensorPromise()
            future = promise.get_future()
            loss = compiled(x, y, promise)
            torch.testing.assert_close(future.wait(WAIT_MS), loss.detach())
            torch.testing.assert_close(loss.detach(),
                                       torch.nn.functional.mse_loss(model(x), y).detach())


def test_inductor_never_reuses_a_buffer_a_promise_holds():
    # Values that are not graph outputs: inductor reused the buffer of `loss` for `loss * 2 + 1`
    # (`buf3 = buf1; del buf1  # reuse`), and the future yielded the later value.
    torch._dynamo.reset()

    def step(x, w, p_loss, p_view, p_again):
        product = x @ w
        loss = product.sum()
        torch.ops.dtorch.get_tensor(loss, p_loss)
        row = product[1:]  # a view of an intermediate
        dtorch_ops.get_tensor(row, p_view)
        dtorch_ops.get_tensor(loss, p_again)  # a second future of the same tensor
        return loss * 2 + 1, (row * 3).sum()

    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(2):
            x, w = torch.randn(3, 4), torch.randn(4, 5)
            promises = [dtorch_ops.TensorPromise() for _ in range(3)]
            futures = [p.get_future() for p in promises]
            out, other = compiled(x, w, promises[0].raw, *promises[1:])
            product = x @ w
            torch.testing.assert_close(futures[0].wait(WAIT_MS), product.sum())
            torch.testing.assert_close(futures[1].wait(WAIT_MS), product[1:])
            torch.testing.assert_close(futures[2].wait(WAIT_MS), product.sum())
            torch.testing.assert_close(out, product.sum() * 2 + 1)
            torch.testing.assert_close(other, (product[1:] * 3).sum())


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_what_a_future_yields_when_the_graph_mutates_its_tensor_later(backend):
    # Compiled (functionalized): an intermediate is captured as of the call; a graph input
    # mutated later in the graph shows the mutation (it is copied back into the input).
    # Eager: the future aliases the tensor, so it shows every later in-place change.
    torch._dynamo.reset()

    def step(x, p_intermediate, p_input):
        y = x * 2
        dtorch_ops.get_tensor(y, p_intermediate)
        y.add_(100)
        dtorch_ops.get_tensor(x, p_input)
        x.add_(1)
        return y.sum()

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for run, expect_intermediate in ((step, 102.0), (compiled, 2.0)):
        x = torch.ones(3)
        promises = [dtorch_ops.TensorPromise() for _ in range(2)]
        futures = [p.get_future() for p in promises]
        total = run(x, *promises)
        assert torch.equal(total, torch.tensor(306.0))
        assert torch.equal(futures[0].wait(WAIT_MS), torch.full((3,), expect_intermediate))
        assert torch.equal(futures[1].wait(WAIT_MS), torch.full((3,), 2.0))  # x after add_(1)
        assert torch.equal(x, torch.full((3,), 2.0))


def test_compiled_future_returning_ops_fall_back_with_a_graph_break():
    # Ops that *return* a new script object cannot be captured by Dynamo on torch 2.13: the fake
    # kernel's output must convert to the schema's class, so a FakeScriptObject is refused, and a
    # real object is "a non-Tensor result" (graph break). The fallback runs the op eagerly.
    torch._dynamo.reset()

    def f(x):
        return dtorch_ops.to_torch_async(x * 2), torch.ops.dtorch.sync.default(None)

    explain = torch._dynamo.explain(f)(torch.ones(3))
    assert any("returned non-Tensor" in r.reason for r in explain.break_reasons)
    future, collect = torch.compile(f, backend="aot_eager")(torch.ones(3))
    assert isinstance(future, dtorch_ops.TensorFuture)
    assert torch.equal(future.wait(WAIT_MS), torch.full((3,), 2.0))
    assert collect.wait(WAIT_MS) is None
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch._dynamo.reset()
        torch.compile(f, fullgraph=True, backend="aot_eager")(torch.ones(3))


def test_fake_future_says_where_it_came_from():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fut = torch.ops.dtorch.get_tensor_async(torch.empty(2))
    with pytest.raises(RuntimeError, match="fake kernel"):
        fut.get()


# ---- torch.export ----


class _Exported(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x, promise):
        out = self.lin(x).sum()
        torch.ops.dtorch.get_tensor(out.detach(), promise)
        return out


def test_export_with_a_promise_input_runs():
    module = _Exported()
    example_promise = dtorch_ops.TensorPromise()
    example_future = example_promise.get_future()
    ep = torch.export.export(module, (torch.randn(2, 4), example_promise.raw))
    assert "dtorch.get_tensor.default" in str(ep.graph)
    assert not example_future.is_ready()  # exporting traced the op, it did not run it
    runnable = ep.module()
    for _ in range(2):
        x = torch.randn(2, 4)
        promise = dtorch_ops.TensorPromise()
        future = promise.get_future()
        out = runnable(x, promise.raw)
        torch.testing.assert_close(out, module(x, torch.classes.dtorch.TensorPromise("memory")))
        torch.testing.assert_close(future.wait(WAIT_MS), out.detach())
    assert not example_future.is_ready()


def test_saving_an_export_that_holds_a_memory_promise_says_why():
    import io

    ep = torch.export.export(_Exported(), (torch.randn(2, 4), dtorch_ops.TensorPromise().raw))
    with pytest.raises(TypeError, match="memory promises cannot leave the process"):
        torch.export.save(ep, io.BytesIO())


# ---- autocast ----


def test_ops_dispatch_under_autocast():
    x = torch.randn(2, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert dtorch_ops.to_torch(x) is not None and dtorch_ops.to_torch(x).dtype == torch.float32
        promise = dtorch_ops.TensorPromise()
        future = promise.get_future()
        dtorch_ops.get_tensor(x, promise)
        assert future.get().data_ptr() == x.data_ptr()
        dtorch_ops.sync()
        assert dtorch_ops.sync_async().get() is None
        done = dtorch_ops.VoidPromise()
        dtorch_ops.sync_into("cpu", done)
        assert done.get_future().wait(WAIT_MS) is None

        def step(a, p):
            loss = (a @ a).sum()  # bf16 under autocast
            dtorch_ops.get_tensor(loss, p)
            dtorch_ops.sync()
            return loss

        torch._dynamo.reset()
        promise = dtorch_ops.TensorPromise()
        future = promise.get_future()
        loss = torch.compile(step, fullgraph=True, backend="aot_eager")(x, promise)
        assert loss.dtype == torch.bfloat16 and future.wait(WAIT_MS).dtype == torch.bfloat16
