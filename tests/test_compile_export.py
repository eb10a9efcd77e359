"""torch.export of the ops and classes (CPU): programs taking promises as inputs or creating
futures, saving and unflattening them, and what non-strict export refuses (and says why)."""
import pytest
import torch

import dtorch_ops
from compile_helpers import GRAPH_OPS, RAW_OPS
from conftest import WAIT_MS


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


class _ExportedWithWrappers(torch.nn.Module):
    def forward(self, x, promise, done):
        dtorch_ops.get_tensor(x * 2, promise)
        dtorch_ops.sync_into("cpu", done)
        return x + 1


@GRAPH_OPS
@pytest.mark.parametrize("strict", [False, True])
def test_export_with_wrapper_promises_takes_them_as_inputs(strict):
    # The promises are inputs of the program: each call fulfils the ones passed to it, never the
    # example ones export traced with.
    example, example_done = dtorch_ops.TensorPromise(), dtorch_ops.VoidPromise()
    example_future, example_done_future = example.get_future(), example_done.get_future()
    ep = torch.export.export(_ExportedWithWrappers(), (torch.ones(2), example, example_done),
                             strict=strict)
    runnable = ep.module()
    for i in range(2):
        promise, done = dtorch_ops.TensorPromise(), dtorch_ops.VoidPromise()
        future, done_future = promise.get_future(), done.get_future()
        out = runnable(torch.full((2,), float(i)), promise, done)
        assert out.tolist() == [i + 1.0] * 2
        assert future.wait(WAIT_MS).tolist() == [2.0 * i] * 2
        assert done_future.wait(WAIT_MS) is None
    assert not example_future.is_ready() and not example_done_future.is_ready()


def test_saving_an_export_that_holds_a_memory_promise_says_why():
    import io

    ep = torch.export.export(_Exported(), (torch.randn(2, 4), dtorch_ops.TensorPromise().raw))
    with pytest.raises(TypeError, match="memory promises cannot leave the process"):
        torch.export.save(ep, io.BytesIO())


class _ReturnsAFuture(torch.nn.Module):
    """Returns a future of a value that is no output, made by to_torch_async or by the raw op."""

    def __init__(self, raw=False):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.raw = raw

    def forward(self, x):
        out = self.lin(x).sum()
        if self.raw:
            return out, torch.ops.dtorch.get_tensor_async((out * 2).detach())
        return out, dtorch_ops.to_torch_async((out * 2).detach())


def _keeps_the_raw_op(strict, raw):
    # Non-strict export runs the module's Python without Dynamo: the raw op stays itself and
    # returns its TorchScript future, as it does eagerly. Strict export traces it as
    # to_torch_async (dtorch_ops/compile/raw_ops.py).
    return raw and not strict


FORMS = pytest.mark.parametrize("raw", [pytest.param(False, id="to_torch_async"),
                                         pytest.param(True, id="raw_op", marks=RAW_OPS)])


@GRAPH_OPS
@FORMS
@pytest.mark.parametrize("strict", [False, True])
def test_export_of_a_module_that_creates_futures_runs(strict, raw):
    module = _ReturnsAFuture(raw)
    ep = torch.export.export(module, (torch.randn(2, 4),), strict=strict)
    keeps_raw = _keeps_the_raw_op(strict, raw)
    op = "dtorch.get_tensor_async.default" if keeps_raw else "dtorch.to_torch_async.default"
    assert op in str(ep.graph), ep.graph
    runnable = ep.module()
    futures = []
    for _ in range(2):
        x = torch.randn(2, 4)
        out, future = runnable(x)
        futures.append(future)
        if keeps_raw:
            assert isinstance(future, torch.ScriptObject)
            future = dtorch_ops.TensorFuture(future)
        assert type(future) is dtorch_ops.TensorFuture
        torch.testing.assert_close(out, module(x)[0])
        torch.testing.assert_close(future.wait(WAIT_MS), out.detach() * 2)
    assert futures[0] is not futures[1]


@GRAPH_OPS
@FORMS
@pytest.mark.parametrize("strict", [False, True])
def test_saving_an_export_that_creates_futures_names_the_limit(strict, raw):
    import io

    ep = torch.export.export(_ReturnsAFuture(raw), (torch.randn(2, 4),), strict=strict)
    why = ("TensorFuture cannot be pickled" if _keeps_the_raw_op(strict, raw) else
           r"opaque Python object, which serialized programs \(torch.export.save\) cannot hold")
    with pytest.raises(Exception, match=why):
        torch.export.save(ep, io.BytesIO())


@GRAPH_OPS
def test_unflattened_export_of_a_module_that_creates_futures_runs():
    unflattened = torch.export.unflatten(
        torch.export.export(_ReturnsAFuture(), (torch.randn(2, 4),)))
    out, future = unflattened(torch.ones(2, 4))
    torch.testing.assert_close(future.wait(WAIT_MS), out.detach() * 2)


# ---- non-strict export: what it cannot trace, and what the message says ----


class _WaitsWhileExported(torch.nn.Module):
    def forward(self, x):
        future = dtorch_ops.to_torch_async(x * 2)
        return future.get()


class _BlocksWhileExported(torch.nn.Module):
    def forward(self, x):
        return dtorch_ops.to_torch(x * 2)


@GRAPH_OPS
@pytest.mark.parametrize("module", [_WaitsWhileExported, _BlocksWhileExported])
def test_non_strict_export_of_a_wait_says_why(module):
    # No Dynamo there, so no graph break to take: a clear error, not a program returning None.
    with pytest.raises(RuntimeError, match="created while tracing .torch.export. has no value"):
        torch.export.export(module(), (torch.ones(2),), strict=False)


class _MakesAPromiseWhileExported(torch.nn.Module):
    def forward(self, x):
        promise = dtorch_ops.TensorPromise()
        dtorch_ops.get_tensor(x * 2, promise)
        return x + 1


def test_non_strict_export_of_a_promise_made_inside_says_why():
    with pytest.raises(RuntimeError, match=r"TensorPromise\(\) while tracing .torch.export.: a "
                                           "graph cannot create a promise"):
        torch.export.export(_MakesAPromiseWhileExported(), (torch.ones(2),), strict=False)


class _UsesAPromiseWhileExported(torch.nn.Module):
    def __init__(self, use):
        super().__init__()
        self.promise, self.use = dtorch_ops.TensorPromise(), use

    def forward(self, x):
        self.use(self.promise, x * 2)
        return x + 1


@pytest.mark.parametrize("name, use", [
    ("set_value", lambda p, t: p.set_value(t)),
    ("get_future", lambda p, t: p.get_future()),
    ("set_exception", lambda p, t: p.set_exception("no")),
])
def test_non_strict_export_of_promise_methods_says_why(name, use):
    # Export runs the module's Python for real, with fake values: acting on the real promise
    # would fulfil it with a fake tensor (or use up its future) and not be part of the program.
    module = _UsesAPromiseWhileExported(use)
    with pytest.raises(RuntimeError, match=f"promise's {name}.. while tracing .torch.export."):
        torch.export.export(module, (torch.ones(2),), strict=False)
    future = module.promise.get_future()  # untouched by the refused export
    module.promise.set_value(torch.ones(1))
    assert torch.equal(future.wait(WAIT_MS), torch.ones(1))


class _SubclassWhileExported(torch.nn.Module):
    def forward(self, x):
        from torch.testing._internal.two_tensor import TwoTensor

        return x + 1, dtorch_ops.to_torch_async(TwoTensor(x, x * 3))


def test_non_strict_export_of_a_subclass_future_says_why():
    with pytest.raises(RuntimeError, match="tensor subclass while tracing .torch.export."):
        torch.export.export(_SubclassWhileExported(), (torch.ones(2),), strict=False)
