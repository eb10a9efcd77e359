"""torch.compile and opcheck: the ops and classes inside traced graphs (CPU).

opcheck of every op; compiled steps that fulfil promises passed in (a training step logging its
loss, inductor holding those buffers, in-place changes after the call); what breaks the graph,
and what the message says; autocast. Futures created inside compiled graphs are in
tests/test_compile_futures.py, torch.export in tests/test_compile_export.py.

aot_eager for most cases; inductor for a few (compiles take seconds on 2 cores)."""
import pytest
import torch
import torch._dynamo
from torch.testing._internal.optests.generate_tests import OpCheckError

import dtorch_ops
from compile_helpers import GRAPH_OPS, _GraphCapture, _model
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


@GRAPH_OPS
@pytest.mark.parametrize("util", UTILS)
@pytest.mark.parametrize("op, args", [
    ("to_torch_async", (torch.randn(2, 2),)),
    ("sync_async", (None,)),
    ("sync_async", ([torch.device("cpu")],)),
])
def test_opcheck_python_defined_future_ops(util, op, args):
    # (test_aot_dispatch_dynamic compares outputs with assert_close, which futures are not.)
    _check(getattr(torch.ops.dtorch, op).default, args, util)


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
    # (A wrapper promise goes to the graph op taking it as an opaque object, where torch has it.)
    opaque = promise_kind == "wrapper" and dtorch_ops.compile.graph_ops.defined_ops is not None
    op = "dtorch.get_tensor_opaque.default" if opaque else "dtorch.get_tensor.default"
    assert "with_effects" in aot and op in aot


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


def _mutating_step_with_promises(x, p_intermediate, p_input):
    y = x * 2
    dtorch_ops.get_tensor(y, p_intermediate)
    y.add_(100)
    dtorch_ops.get_tensor(x, p_input)
    x.add_(1)
    return y.sum(), None


def _mutating_step_with_futures(x, p_intermediate, p_input):
    y = x * 2
    intermediate = dtorch_ops.to_torch_async(y)
    y.add_(100)
    graph_input = dtorch_ops.to_torch_async(x)
    x.add_(1)
    return y.sum(), (intermediate, graph_input)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("step", [_mutating_step_with_promises, _mutating_step_with_futures])
def test_what_a_future_yields_when_the_graph_mutates_its_tensor_later(backend, step):
    # Compiled (functionalized): an intermediate is captured as of the call; a graph input
    # mutated later in the graph shows the mutation (it is copied back into the input).
    # Eager: the future aliases the tensor, so it shows every later in-place change.
    if step is _mutating_step_with_futures and dtorch_ops.compile.graph_ops.defined_ops is None:
        pytest.skip("this torch cannot return opaque objects from graphs")
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for run, expect_intermediate in ((step, 102.0), (compiled, 2.0)):
        x = torch.ones(3)
        promises = [dtorch_ops.TensorPromise() for _ in range(2)]
        futures = [p.get_future() for p in promises]
        total, made = run(x, *promises)
        futures = made or futures
        assert torch.equal(total, torch.tensor(306.0))
        assert torch.equal(futures[0].wait(WAIT_MS), torch.full((3,), expect_intermediate))
        assert torch.equal(futures[1].wait(WAIT_MS), torch.full((3,), 2.0))  # x after add_(1)
        assert torch.equal(x, torch.full((3,), 2.0))


# ---- what breaks the graph, cleanly, and what the message says ----


def _compile(fn, fullgraph):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=fullgraph, backend="aot_eager")


def _to_torch_step(x):
    return dtorch_ops.to_torch(x * 2) + 1


def _wait_in_the_creating_region(x):
    future = dtorch_ops.to_torch_async(x * 2)
    return future.get() + 1, future.valid()


def _promise_made_inside(x):
    promise = dtorch_ops.TensorPromise()
    dtorch_ops.get_tensor(x * 2, promise)
    return promise.get_future()


def _set_value_inside(x, promise):
    promise.set_value(x * 2)
    return x + 1


@pytest.mark.parametrize("fn, match, needs_graph_ops", [
    (_to_torch_step, r"to_torch\(t\) blocks.*call dtorch_ops.to_torch_async\(t\) inside", False),
    (_wait_in_the_creating_region, r"created inside a compiled region.*return the future", True),
    # (Where promises are opaque types, Dynamo says it itself, at the constructor call.)
    (_promise_made_inside, r"(?s)TensorPromise\(\) inside a compiled region.*create the promise "
                           r"outside and pass it in|opaque object was created in the middle.*"
                           r"create the opaque object before calling torch.compile and pass it "
                           r"in", False),
])
def test_graph_breaks_name_the_form_that_compiles(fn, match, needs_graph_ops):
    if needs_graph_ops and dtorch_ops.compile.graph_ops.defined_ops is None:
        pytest.skip("this torch cannot return opaque objects from graphs")
    x = torch.ones(3)
    with pytest.raises(torch._dynamo.exc.Unsupported, match=match) as info:
        _compile(fn, fullgraph=True)(x)
    assert "test_compile.py" in str(info.value)  # points at the user's line
    result = _compile(fn, fullgraph=False)(x)  # without fullgraph: the eager path, right values
    if fn is _promise_made_inside:
        assert torch.equal(result.wait(WAIT_MS), torch.full((3,), 2.0))
    elif fn is _wait_in_the_creating_region:
        assert torch.equal(result[0], torch.full((3,), 3.0)) and result[1] is False
    else:
        assert torch.equal(result, torch.full((3,), 3.0))


def test_promise_methods_inside_a_compiled_region_break_the_graph():
    promise = dtorch_ops.TensorPromise()
    with pytest.raises(torch._dynamo.exc.Unsupported,
                       match=r"set_value\(\) inside a compiled region.*get_tensor\(t, promise\)"):
        _compile(_set_value_inside, fullgraph=True)(torch.ones(3), promise)
    assert not promise.get_future().is_ready()
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()
    assert torch.equal(_compile(_set_value_inside, fullgraph=False)(torch.ones(3), promise),
                       torch.full((3,), 2.0))
    assert torch.equal(future.wait(WAIT_MS), torch.full((3,), 2.0))


def test_future_passed_into_a_compiled_region_breaks_the_graph_to_wait():
    future = dtorch_ops.to_torch_async(torch.ones(2))
    fn = _compile(lambda x, f: (x * 2, f.is_ready()), fullgraph=False)
    out, ready = fn(torch.ones(2), future)
    assert ready is True and torch.equal(future.get(), torch.ones(2))


def test_sync_into_compiles_with_a_promise_made_outside():
    promise = dtorch_ops.VoidPromise()
    future = promise.get_future()

    def step(x, p):
        y = x * 2
        dtorch_ops.sync_into("cpu", p)
        return y

    assert torch.equal(_compile(step, fullgraph=True)(torch.ones(2), promise),
                       torch.full((2,), 2.0))
    assert future.wait(WAIT_MS) is None


@GRAPH_OPS
def test_a_wrapper_subclass_breaks_the_graph_and_is_delivered_whole():
    from torch.testing._internal.two_tensor import TwoTensor

    t = TwoTensor(torch.ones(3), torch.full((3,), 2.0))
    with pytest.raises(torch._dynamo.exc.Unsupported, match="tensor subclass"):
        _compile(lambda a: dtorch_ops.to_torch_async(a), fullgraph=True)(t)
    future = _compile(lambda a: dtorch_ops.to_torch_async(a), fullgraph=False)(t)
    value = future.wait(WAIT_MS)
    assert type(value) is TwoTensor and value is t


@GRAPH_OPS
@pytest.mark.parametrize("how", ["to_torch_async", "get_tensor"])
def test_inductor_backward_does_not_overwrite_a_held_activation(how):
    # The backward graph reused the buffer of an activation saved for it (it wrote cos(h) into
    # the future of h): in a training forward the lowering holds a copy of its own.
    torch._dynamo.reset()

    def step(x, w, promise):
        h = x @ w
        if how == "to_torch_async":
            return h.sin().sum(), dtorch_ops.to_torch_async(h.detach())
        dtorch_ops.get_tensor(h.detach(), promise)
        return h.sin().sum(), None

    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    for _ in range(2):
        x, w = torch.randn(8, 8), torch.randn(8, 8, requires_grad=True)
        promise = dtorch_ops.TensorPromise()
        promised = promise.get_future()
        loss, future = compiled(x, w, promise)
        value = (future or promised).wait(WAIT_MS)
        loss.backward()
        torch.testing.assert_close(value, (x @ w).detach())
        torch.testing.assert_close(w.grad, x.t() @ (x @ w).detach().cos())


@GRAPH_OPS
def test_a_parameter_compiles_into_the_graph():
    torch._dynamo.reset()
    lin = torch.nn.Linear(3, 2)

    def step(x):
        return lin(x).sum(), dtorch_ops.to_torch_async(lin.weight.detach()), \
            dtorch_ops.to_torch_async(lin.weight)

    loss, detached, parameter = torch.compile(step, fullgraph=True, backend="aot_eager")(
        torch.ones(1, 3))
    torch.testing.assert_close(detached.wait(WAIT_MS), lin.weight.detach())
    torch.testing.assert_close(parameter.wait(WAIT_MS), lin.weight.detach())


@GRAPH_OPS
def test_members_of_a_future_passed_into_a_compiled_region_run_eagerly():
    cases = [
        (lambda x, f: (x + 1, f.kind()), dtorch_ops.to_torch_async, "memory"),
        (lambda x, c: (x + 1, c.devices()), lambda t: dtorch_ops.sync_async("cpu"),
         [torch.device("cpu")]),
        (lambda x, f: (x + 1, f.valid()), dtorch_ops.to_torch_async, True),
    ]
    for fn, make, expected in cases:
        future = make(torch.ones(2))
        with pytest.raises(torch._dynamo.exc.Unsupported):
            _compile(fn, fullgraph=True)(torch.ones(2), future)
        out, got = _compile(fn, fullgraph=False)(torch.ones(2), future)
        assert got == expected
    future = dtorch_ops.to_torch_async(torch.ones(2))
    with pytest.raises(torch._dynamo.exc.Unsupported, match="waiting on a dtorch_ops future"):
        _compile(lambda x, f: (x + 1, f.kind()), fullgraph=True)(torch.ones(2), future)


@GRAPH_OPS
def test_raw_of_a_future_passed_into_a_compiled_region_is_that_futures():
    compiled = _compile(lambda x, f: (x + 1, f.raw), fullgraph=True)
    for value in (1.0, 2.0):
        future = dtorch_ops.to_torch_async(torch.full((2,), value))
        _, raw = compiled(torch.ones(2), future)
        assert raw is future.raw
        assert torch.equal(dtorch_ops.TensorFuture(raw).get(), torch.full((2,), value))


def test_eager_calls_while_another_thread_compiles(monkeypatch):
    # torch.compiler.is_compiling() is a process-wide flag, True in every thread while any thread
    # compiles: eager calls made meanwhile must behave as eager calls.
    from torch.testing._internal.two_tensor import TwoTensor

    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
    assert torch.compiler.is_compiling()
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()
    promise.set_value(torch.ones(2))
    assert torch.equal(future.wait(WAIT_MS), torch.ones(2))
    failed = dtorch_ops.VoidPromise()
    failed_future = failed.get_future()
    failed.set_exception("no")
    with pytest.raises(RuntimeError, match="no"):
        failed_future.wait(WAIT_MS)
    assert torch.equal(dtorch_ops.to_torch_async(torch.ones(2) * 3).wait(WAIT_MS),
                       torch.full((2,), 3.0))
    t = TwoTensor(torch.ones(2), torch.ones(2))
    assert dtorch_ops.to_torch_async(t).wait(WAIT_MS) is t
    assert dtorch_ops.sync_async("cpu").wait(WAIT_MS) is None


@GRAPH_OPS
def test_compiled_vmap_refuses_like_eager():
    def f(x):
        return torch.func.vmap(lambda row: (row * 2, dtorch_ops.to_torch_async(row))[0])(x)

    with pytest.raises(RuntimeError, match="cannot run inside a torch.func transform"):
        f(torch.ones(2, 3))
    with pytest.raises(RuntimeError, match="cannot run inside a torch.func transform"):
        _compile(f, fullgraph=False)(torch.ones(2, 3))


@GRAPH_OPS
def test_inductor_cpp_wrapper_refuses_future_ops_by_name():
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    with inductor_config.patch(cpp_wrapper=True), pytest.raises(
            Exception, match="cpp_wrapper mode cannot hold"):
        torch.compile(lambda x: (x + 1, dtorch_ops.to_torch_async(x * 2)),
                      fullgraph=True)(torch.ones(3))


@GRAPH_OPS
def test_future_op_on_a_meta_tensor_says_why():
    with pytest.raises(NotImplementedError, match="meta tensors have no value"):
        torch.ops.dtorch.to_torch_async(torch.ones(2, device="meta"))


def test_without_opaque_types_compiled_code_falls_back_to_a_graph_break(monkeypatch):
    # What torch versions without opaque types (or refusing our registrations) get: the raw ops,
    # a graph break whose reason names the version, then they run eagerly (a raw op called as
    # such returns its TorchScript future).
    monkeypatch.setattr(dtorch_ops.compile.graph_ops, "defined_ops", None)

    def f(x):
        return (dtorch_ops.to_torch_async(x * 2), dtorch_ops.sync_async(),
                torch.ops.dtorch.get_tensor_async(x * 3))

    torch._dynamo.reset()
    explain = torch._dynamo.explain(f)(torch.ones(3))
    # (the reason: this torch is too old, or it refused the graph ops, as here)
    why = ("refused dtorch_ops' graph ops" if dtorch_ops.compile.graph_ops._returns_opaques_from_graphs()
           else "cannot return an opaque future from a compiled graph")
    assert any(f"torch {torch.__version__} {why}" in r.reason and "runs eagerly" in r.reason
               for r in explain.break_reasons), explain.break_reasons
    future, collect, raw = _compile(f, fullgraph=False)(torch.ones(3))
    assert isinstance(future, dtorch_ops.TensorFuture) and isinstance(raw, torch.ScriptObject)
    assert torch.equal(future.wait(WAIT_MS), torch.full((3,), 2.0))
    assert torch.equal(raw.wait(WAIT_MS), torch.full((3,), 3.0))
    assert collect.wait(WAIT_MS) is None
    with pytest.raises(torch._dynamo.exc.Unsupported, match="runs eagerly"):
        _compile(f, fullgraph=True)(torch.ones(3))


def test_fake_future_says_where_it_came_from():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fut = torch.ops.dtorch.get_tensor_async(torch.empty(2))
    with pytest.raises(RuntimeError, match="fake kernel"):
        fut.get()


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
