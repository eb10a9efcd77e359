"""The host copy: to_torch_async(t, device="cpu") (ops dtorch::copy_to_host_async and
copy_list_to_host_async; dtorch::to_host_async / to_host_list_async in compiled graphs) starts a
non-blocking copy into pinned memory on t's current stream and returns a future that is ready
once the copy has landed.

Runs on the simulated device (whose non-blocking copy into pinned memory is asynchronous on its
stream, as CUDA's is) and on CUDA when present; tests/gpu/test_host_copy_cuda.py adds CUDA-only
checks (a GPU machine runs it). The simulated device runs few kernels (fill, add, mul, copies) and
a copy from host memory to it waits for the stream: inputs are made before a stream is held."""
import asyncio
import time

import pytest
import torch

import dtorch_ops
from conftest import WAIT_MS

# Where torch cannot return opaque objects from graphs (before 2.12), the future is made at a
# graph break: the same tests then check the values.
IN_GRAPH = dtorch_ops.compile.graph_ops.defined_ops is not None


def test_not_ready_while_the_stream_is_held_then_the_values(dev):
    x = torch.arange(6, dtype=torch.float32).to(dev.name)
    release = dev.hold()
    try:
        y = x * 2  # behind the held stream
        t0 = time.perf_counter()
        future = dtorch_ops.to_torch_async(y, device="cpu")
        issued = time.perf_counter() - t0
        assert issued < 0.1, f"the host copy took {issued * 1e3:.1f} ms to return: it waited"
        time.sleep(0.05)
        assert not future.is_ready()
        with pytest.raises(TimeoutError):
            future.wait(10)
        assert future.valid()
    finally:
        release()
    value = future.wait(WAIT_MS)
    assert value.device.type == "cpu" and value.is_pinned()
    assert torch.equal(value, torch.arange(6, dtype=torch.float32) * 2)
    assert future.valid() and future.get() is value and not future.valid()


def test_the_copy_is_a_snapshot_of_the_value_at_the_call(dev):
    # Work queued after the call (an in-place update, as optimizer.step() makes) comes after the
    # copy on the stream: the copy holds the value of the call.
    release = dev.hold()
    try:
        y = torch.ones(4, device=dev.name)
        future = dtorch_ops.to_torch_async(y, device="cpu")
        y.fill_(5.0)
    finally:
        release()
    assert torch.equal(future.wait(WAIT_MS), torch.ones(4))
    assert torch.equal(y.cpu(), torch.full((4,), 5.0))


def test_does_not_wait_for_another_stream(dev):
    y = torch.full((3,), 7.0, device=dev.name)
    dev.synchronize()
    other = dev.new_stream()
    with dev.using_stream(other):
        release = dev.hold()  # the other stream stays busy (CUDA: for 2 s)
    try:
        t0 = time.perf_counter()
        future = dtorch_ops.to_torch_async(y, device="cpu")  # on the current stream
        assert torch.equal(future.wait(WAIT_MS), torch.full((3,), 7.0))
        assert time.perf_counter() - t0 < 1.0, "the copy waited for the other stream"
    finally:
        release()


def test_a_device_error_fails_the_copy(dev):
    if not dev.can_inject_faults:
        pytest.skip(f"{dev.name} cannot inject a device fault without poisoning the process")
    y = torch.ones(2, device=dev.name)
    with dev.side_stream():  # a fault poisons its stream only
        dev.fail("illegal memory access (simulated)")
        future = dtorch_ops.to_torch_async([y], device="cpu")
    with pytest.raises(dtorch_ops.errors.DeviceError, match="illegal memory access"):
        future.wait(WAIT_MS)


def test_several_tensors_one_future(dev):
    half = torch.tensor(0.5).to(dev.name)
    release = dev.hold()
    try:
        loss = half * 2
        acc = torch.full((2,), 3.0, device=dev.name)
        lr = torch.tensor(1e-3)  # a CPU tensor: yielded as it is
        future = dtorch_ops.to_torch_async([loss, acc, lr], device="cpu")
        assert isinstance(future, dtorch_ops.TensorListFuture)
        time.sleep(0.05)
        assert not future.is_ready()
    finally:
        release()
    got_loss, got_acc, got_lr = future.wait(WAIT_MS)
    assert torch.equal(got_loss, torch.tensor(1.0)) and got_loss.is_pinned()
    assert torch.equal(got_acc, torch.full((2,), 3.0))
    assert got_lr.data_ptr() == lr.data_ptr()
    assert future.value()[0].item() == 1.0  # kept after get(), as torch.futures.Future does


def test_cpu_tensor_is_yielded_as_it_is_and_detached():
    x = torch.arange(3.0, requires_grad=True)
    future = dtorch_ops.to_torch_async(x, device="cpu")
    assert future.is_ready()
    value = future.get()
    assert value.data_ptr() == x.data_ptr()  # no copy
    assert not value.requires_grad
    assert dtorch_ops.to_torch(x, device=torch.device("cpu")).data_ptr() == x.data_ptr()


def test_requires_grad_inputs_are_detached(dev):
    w = torch.ones(3, device=dev.name, requires_grad=True)
    loss = w * 2
    values = dtorch_ops.to_torch_async([loss, w], device="cpu").wait(WAIT_MS)
    assert all(not v.requires_grad and v.grad_fn is None for v in values)
    assert torch.equal(values[0], torch.full((3,), 2.0))
    loss.backward(torch.ones(3, device=dev.name))  # the graph is untouched by the copy
    assert torch.equal(w.grad.cpu(), torch.full((3,), 2.0))


def test_awaitable(dev):
    async def main():
        release = dev.hold()
        y = torch.full((2,), 4.0, device=dev.name)
        future = dtorch_ops.to_torch_async([y], device="cpu")
        asyncio.get_running_loop().call_later(0.05, release)
        return await asyncio.wait_for(future, WAIT_MS / 1000)

    (value,) = asyncio.run(main())
    assert torch.equal(value, torch.full((2,), 4.0))


def test_bad_input_gets_clear_errors():
    x = torch.ones(2)
    with pytest.raises(ValueError, match="copies to the host only"):
        dtorch_ops.to_torch_async(x, device="meta")
    with pytest.raises(ValueError, match="not a device"):
        dtorch_ops.to_torch_async(x, device="nonsense")
    with pytest.raises(TypeError, match="expects a torch.Tensor"):
        dtorch_ops.to_torch_async([x, 3.0], device="cpu")
    with pytest.raises(TypeError, match="expects a torch.Tensor"):
        dtorch_ops.to_torch_async(None, device="cpu")

    class Wrapper(torch.Tensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with pytest.raises(TypeError, match="tensor subclass"):
        dtorch_ops.to_torch_async(torch.Tensor._make_subclass(Wrapper, x), device="cpu")
    with pytest.raises(RuntimeError, match="torch.func transform"):
        torch.func.vmap(lambda t: torch.ops.dtorch.copy_to_host_async(t).get())(torch.ones(2, 2))
    with pytest.raises(RuntimeError, match="torch.func transform"):
        torch.func.grad(lambda t: torch.ops.dtorch.copy_list_to_host_async([t]).get()[0].sum())(x)
    with pytest.raises(TypeError, match="a list of tensors is for the host copy"):
        dtorch_ops.to_torch_async([x])
    # An empty list: nothing to copy, a ready future of [].
    assert dtorch_ops.to_torch_async([], device="cpu").get() == []


def test_torchscript(dev):
    @torch.jit.script
    def log_step(x: torch.Tensor) -> torch.classes.dtorch.TensorListFuture:
        return torch.ops.dtorch.copy_list_to_host_async([x * 2, x + x])

    @torch.jit.script
    def one(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.dtorch.copy_to_host_async(x + 1).wait(10000)

    x = torch.ones(4, device=dev.name)
    raw = log_step(x)
    assert [v.tolist() for v in raw.wait(WAIT_MS)] == [[2.0] * 4, [2.0] * 4]
    assert torch.equal(one(x), torch.full((4,), 2.0))
    wrapped = dtorch_ops.TensorListFuture(log_step(x))
    assert all(v.device.type == "cpu" for v in wrapped.get())


def test_cpp_api_names_the_host_copy():
    # The C++ twin (dtorch::GetTensorAsync(t, c10::kCPU)) is exercised by the public header
    # check (tests/cpp/public_header_check.cpp); its op is the one TorchScript calls.
    assert torch.ops.dtorch.copy_to_host_async.default._schema.returns[0].type.name().endswith(
        "TensorFuture")
    assert "TensorListFuture" in str(torch.ops.dtorch.copy_list_to_host_async.default._schema)


# ---- torch.compile ----

def _logging_step(x, w):
    h = torch.relu(x @ w)
    loss = h.sum()
    # The copy's input (loss) is not a graph output: inductor must not reuse its buffer.
    copies = dtorch_ops.to_torch_async([loss, h.mean()], device="cpu")
    return h * 2 + 1, copies


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_on_cpu_identity_path(backend):
    torch._dynamo.reset()
    compiled = torch.compile(_logging_step, fullgraph=IN_GRAPH, backend=backend)
    for _ in range(2):
        x, w = torch.randn(4, 3), torch.randn(3, 5)
        out, copies = compiled(x, w)
        h = torch.relu(x @ w)
        loss, mean = copies.wait(WAIT_MS)
        torch.testing.assert_close(loss, h.sum())
        torch.testing.assert_close(mean, h.mean())
        torch.testing.assert_close(out, h * 2 + 1)


@pytest.mark.parametrize("form", ["tensor", "list"])
def test_compiled_host_copy_holds_its_input_under_inductor(form):
    torch._dynamo.reset()

    def step(x):
        loss = (x * 3).sum()
        future = dtorch_ops.to_torch_async(loss if form == "tensor" else [loss], device="cpu")
        return (x * 5 + loss).sum(), future  # later results that could take loss's buffer

    compiled = torch.compile(step, fullgraph=IN_GRAPH, backend="inductor")
    x = torch.randn(8)
    out, future = compiled(x)
    value = future.wait(WAIT_MS)
    torch.testing.assert_close(value if form == "tensor" else value[0], (x * 3).sum())
    torch.testing.assert_close(out, (x * 5 + (x * 3).sum()).sum())


def test_compiled_on_the_simulated_device_waits_for_the_copy():
    from devices import SimDev

    dev = SimDev()
    torch._dynamo.reset()

    def step(x):
        y = (x + 1) * 2
        return y * 3, dtorch_ops.to_torch_async([y, y * 0], device="cpu")

    compiled = torch.compile(step, fullgraph=IN_GRAPH, backend="aot_eager")
    x = torch.ones(4, device="simdev")
    compiled(x)[1].get()  # compile outside the held stream
    release = dev.hold()
    try:
        out, copies = compiled(x)
        time.sleep(0.05)
        assert not copies.is_ready()
    finally:
        release()
    y, zeros = copies.wait(WAIT_MS)
    assert y.device.type == "cpu" and torch.equal(y, torch.full((4,), 4.0))
    assert torch.equal(zeros, torch.zeros(4))
    assert torch.equal(out.cpu(), torch.full((4,), 12.0))


def test_traced_list_stand_in_raises_rather_than_yielding_nothing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        raw = torch.ops.dtorch.copy_list_to_host_async([mode.from_tensor(torch.ones(2))])
    with pytest.raises(RuntimeError, match="fake kernel"):
        dtorch_ops.TensorListFuture(raw).get()


def test_compiled_without_graph_ops_breaks_the_graph_and_copies(monkeypatch):
    # What a torch without opaque types gets: the raw op (a graph break), run eagerly.
    monkeypatch.setattr(dtorch_ops.compile.graph_ops, "defined_ops", None)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(lambda x: dtorch_ops.to_torch_async([x * 2], device="cpu"),
                                 backend="eager")
        (value,) = compiled(torch.ones(2)).wait(WAIT_MS)
        assert torch.equal(value, torch.full((2,), 2.0))
    finally:
        torch._dynamo.reset()
