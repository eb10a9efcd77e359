"""torch.library.opcheck and torch.compile smoke tests (the full compile work is a later issue)."""
import pytest
import torch
import torch._dynamo
from torch.testing._internal.optests.generate_tests import OpCheckError

import dtorch_ops
from conftest import WAIT_MS


@pytest.mark.parametrize("util", ["test_schema", "test_autograd_registration", "test_faketensor"])
def test_opcheck_get_tensor(util):
    # opcheck runs the kernel more than once: a fresh promise per utility.
    x = torch.randn(3, 4)
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()
    torch.library.opcheck(torch.ops.dtorch.get_tensor.default, (x, promise.raw), test_utils=util)
    if util != "test_autograd_registration":  # that one inspects registrations, runs nothing
        assert torch.equal(future.wait(WAIT_MS), x)


def test_opcheck_get_tensor_aot_dispatch_runs_the_op_in_the_compiled_graph():
    # test_aot_dispatch_dynamic runs the op eagerly, then through an AOT-compiled graph, with the
    # same promise. The compiled run reaching the one-shot promise (and being refused) proves the
    # zero-output op was kept in the graph; the eager value stays in the future.
    x = torch.randn(4)
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()
    with pytest.raises(OpCheckError, match="promise already satisfied"):
        torch.library.opcheck(torch.ops.dtorch.get_tensor.default, (x, promise.raw),
                              test_utils="test_aot_dispatch_dynamic")
    assert torch.equal(future.wait(WAIT_MS), x)


@pytest.mark.parametrize("util", ["test_schema", "test_autograd_registration", "test_faketensor"])
def test_opcheck_get_tensor_async(util):
    # test_aot_dispatch_dynamic compares eager and compiled outputs with assert_close, which has no
    # rule for script objects: it does not apply to an op that returns a future.
    torch.library.opcheck(torch.ops.dtorch.get_tensor_async.default, (torch.randn(2, 2),),
                          test_utils=util)


def test_compile_get_tensor_with_promise_fullgraph():
    torch._dynamo.reset()
    model = torch.nn.Linear(4, 1)
    calls = []

    def step(x, promise):
        loss = model(x).pow(2).mean()
        torch.ops.dtorch.get_tensor(loss.detach(), promise)
        return loss

    def counting_backend(gm, example_inputs):
        calls.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    compiled = torch.compile(step, fullgraph=True, backend=counting_backend)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(3):
            x = torch.randn(8, 4)
            promise = dtorch_ops.TensorPromise()
            future = promise.get_future()
            loss = compiled(x, promise.raw)
            value = future.wait(WAIT_MS)  # the op ran in this step: the promise was fulfilled
            torch.testing.assert_close(value, loss.detach())
            torch.testing.assert_close(value, model(x).pow(2).mean().detach())
    assert len(calls) == 1, "compiled once, no recompiles"
    assert "dtorch.get_tensor" in str(calls[0].graph)


def test_compile_get_tensor_async_falls_back_without_fullgraph():
    torch._dynamo.reset()

    def f(x):
        return torch.ops.dtorch.get_tensor_async(x * 2)

    fut = torch.compile(f, backend="aot_eager")(torch.ones(3))
    assert torch.equal(fut.wait(WAIT_MS), torch.full((3,), 2.0))


def test_fake_future_says_where_it_came_from():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fut = torch.ops.dtorch.get_tensor_async(torch.empty(2))
    with pytest.raises(RuntimeError, match="fake kernel"):
        fut.get()
