"""The sharp edges a new user met (issue 36), each as the user now sees it: the network kind over
the default process group's store, TorchScript taking the Python wrappers, one detach rule for
the ops' futures eagerly and compiled, then() adopting a tensor result's type, C++ names in error
text, one timeout wording, to_torch's device checked by type, and the hint for loading a
TorchScript module without importing dtorch_ops."""
import gc
import os
import socket
import subprocess
import sys
import textwrap
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import dtorch_ops
from dtorch_ops import errors

WAIT_MS = 10_000
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_python(code: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


# ---- the network kind and the default process group ---------------------------------------------


def test_network_promise_without_store_before_init_process_group_names_both_ways():
    if dist.is_initialized():
        dist.destroy_process_group()  # (left by another test)
    with pytest.raises(TypeError, match=r"needs store=.*init_process_group"):
        dtorch_ops.TensorPromise(kind="network")


def test_network_promise_takes_the_default_groups_store():
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=host, rank=0, world_size=1)
    try:
        promise = dtorch_ops.TensorPromise(kind="network")
        future = promise.get_future()
        assert f":127.0.0.1:{host.port}:" in promise.serialize()
        promise.set_value(torch.arange(3.0))
        assert torch.equal(future.wait(WAIT_MS), torch.arange(3.0))
        void = dtorch_ops.VoidPromise(kind="network")
        done = void.get_future()
        void.set_value()
        assert done.wait(WAIT_MS) is None
        # A store of one's own still wins.
        own = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                            timeout=timedelta(seconds=30))
        mine = dtorch_ops.TensorPromise(kind="network", store=own)
        assert f":127.0.0.1:{own.port}:" in mine.serialize()
        mine.set_value(torch.ones(1))
        mine.get_future().get()
        del mine, promise, void
        gc.collect()
    finally:
        dist.destroy_process_group()


def test_a_default_group_on_a_file_store_asks_for_store(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0,
                            world_size=1)
    try:
        with pytest.raises(TypeError, match=r"FileStore.*pass store="):
            dtorch_ops.TensorPromise(kind="network")
    finally:
        dist.destroy_process_group()


def test_the_store_host_dying_prints_only_our_error():
    """Two processes in one default group; the store's host (rank 0) dies: the consumer's future
    fails with BrokenPromiseError, and nothing else is printed (no c10d warning or C++ trace)."""
    proc = _run_python(f"""
        import os, time, torch, torch.distributed as dist, torch.multiprocessing as mp
        import dtorch_ops
        import sys
        sys.path.insert(0, "tests")
        from network_workers import default_group_store_host
        if __name__ == "__main__":
            port = {_free_port()}
            host = mp.get_context("spawn").Process(target=default_group_store_host, args=(port,))
            host.start()
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=1,
                                    world_size=2)
            promise = dtorch_ops.TensorPromise(kind="network")
            future = promise.get_future()
            dist.barrier()
            try:
                future.wait(20000)
            except dtorch_ops.BrokenPromiseError as e:
                print("broken:", e)
            host.join(20)
            dist.destroy_process_group()
            print("end")
    """)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "broken: dtorch: broken promise: the store at 127.0.0.1:" in proc.stdout
    assert proc.stdout.rstrip().endswith("end")
    for marker in ("[W", "[E", "c10d", "Exception raised from", "frame #", "Traceback"):
        assert marker not in proc.stderr, proc.stderr


# ---- TorchScript --------------------------------------------------------------------------------


@torch.jit.script
def _fill(promise: torch.classes.dtorch.TensorPromise, t: torch.Tensor) -> None:
    torch.ops.dtorch.get_tensor(t, promise)


@torch.jit.script
def _wait(future: torch.classes.dtorch.TensorFuture) -> torch.Tensor:
    return future.wait(10000)


def test_scripted_functions_and_raw_ops_say_to_pass_raw_for_a_wrapper():
    """TorchScript does not check what a Python object's `capsule` holds against the class it
    expects (a VoidPromise would pass as a TensorPromise), so the wrappers are refused, with torch's
    error saying to pass .raw; .raw passes."""
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()
    hint = r"a dtorch_ops wrapper is not a TorchScript object: pass the \.raw of the promise or "
    with pytest.raises(RuntimeError, match=hint + r"future expected here \(this dtorch_ops\."
                                           r"TensorPromise's promise\.raw is a "
                                           r"torch\.classes\.dtorch\.TensorPromise\)"):
        _fill(promise, torch.arange(2.0))
    with pytest.raises(RuntimeError, match=hint + r".*future\.raw is a torch\.classes\.dtorch\."
                                           r"TensorFuture"):
        _wait(future)
    with pytest.raises(RuntimeError, match=hint + r".*VoidPromise's promise\.raw"):
        torch.ops.dtorch.get_tensor(torch.ones(1), dtorch_ops.VoidPromise())

    class MyPromise(dtorch_ops.TensorPromise):  # a user's subclass names the library's class
        pass

    with pytest.raises(RuntimeError, match=r"this dtorch_ops\.TensorPromise's promise\.raw"):
        _fill(MyPromise(), torch.ones(1))
    _fill(promise.raw, torch.arange(2.0))
    assert torch.equal(_wait(future.raw), torch.arange(2.0))
    assert torch.equal(future.get(), torch.arange(2.0))
    # A raw object of the wrong class: torch's own check.
    with pytest.raises(RuntimeError, match="VoidPromise"):
        torch.ops.dtorch.get_tensor(torch.ones(1), dtorch_ops.VoidPromise().raw)


def test_an_object_future_tells_what_torchscript_can_take():
    derived = dtorch_ops.to_torch_async(torch.ones(1)).then(lambda f: 3)
    assert isinstance(derived, dtorch_ops.ObjectFuture)
    with pytest.raises(RuntimeError, match="an ObjectFuture holds a Python value"):
        _wait(derived)


class _CallsTheOp(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.dtorch.get_tensor_async(x).wait(10000)


class _TakesAFuture(torch.nn.Module):
    def forward(self, future: torch.classes.dtorch.TensorFuture) -> torch.Tensor:
        return future.wait(10000)


def test_loading_a_module_without_importing_dtorch_ops_is_explained(tmp_path):
    """torch's own error names our class; the docs say what to do (import dtorch_ops first)."""
    path = tmp_path / "m.pt"

    torch.jit.save(torch.jit.script(_CallsTheOp()), str(path))
    bare = _run_python(f"import torch; torch.jit.load({str(path)!r})")
    assert bare.returncode != 0 and "Unknown builtin op: dtorch::get_tensor_async" in bare.stderr
    classes = tmp_path / "classes.pt"
    torch.jit.save(torch.jit.script(_TakesAFuture()), str(classes))
    bare = _run_python(f"import torch; torch.jit.load({str(classes)!r})")
    assert bare.returncode != 0
    assert "Unknown type name '__torch__.torch.classes.dtorch.TensorFuture'" in bare.stderr
    ok = _run_python(f"import torch, dtorch_ops; m = torch.jit.load({str(path)!r}); "
                     f"print(m(torch.ones(2)).tolist())")
    assert ok.returncode == 0 and "[1.0, 1.0]" in ok.stdout, ok.stderr
    with open(os.path.join(REPO, "docs", "reference", "errors.md")) as f:
        errors_md = f.read()
    assert "Unknown type name '__torch__.torch.classes.dtorch." in errors_md
    assert "Unknown builtin op: dtorch::get_tensor_async" in errors_md
    assert "`import dtorch_ops` before `torch.jit.load`" in errors_md


# ---- one detach rule ----------------------------------------------------------------------------


def _loss_with_graph():
    """A loss and a weak reference to an activation its autograd graph saves (alive as long as
    the graph is)."""
    x = torch.ones(3, requires_grad=True)
    activation = x * 2
    loss = (activation * activation).sum()  # saves `activation` for backward
    return x, loss, weakref.ref(activation)


@pytest.mark.parametrize("how", ["to_torch_async", "raw_op", "get_tensor"])
def test_eager_futures_yield_detached_values_that_share_memory(how):
    x, loss, graph = _loss_with_graph()
    if how == "to_torch_async":
        future = dtorch_ops.to_torch_async(loss)
    elif how == "raw_op":
        future = dtorch_ops.TensorFuture(torch.ops.dtorch.get_tensor_async(loss))
    else:
        promise = dtorch_ops.TensorPromise()
        future = promise.get_future()
        dtorch_ops.get_tensor(loss, promise)
    value = future.wait(WAIT_MS)
    assert not value.requires_grad and value.grad_fn is None
    assert value.data_ptr() == loss.data_ptr()  # no copy
    assert graph() is not None  # (kept by the loss's graph)
    del loss
    gc.collect()
    assert graph() is None  # the future does not keep the autograd graph alive
    assert value.item() == 12.0 and future.valid()


def test_a_tensor_without_grad_is_yielded_as_it_is():
    t = torch.arange(3.0)
    assert dtorch_ops.to_torch_async(t).get() is t


def test_compiled_and_eager_futures_follow_the_same_rule():
    x = torch.ones(3, requires_grad=True)

    def step(x):
        loss = (x * 2).sum()
        return loss, dtorch_ops.to_torch_async(loss)

    def logged_step(x, promise):
        loss = (x * 2).sum()
        dtorch_ops.get_tensor((x * 3).sum(), promise)  # a value that is not a graph output
        return loss

    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        eager_loss, eager_future = step(x)
        compiled_loss, compiled_future = torch.compile(step, backend=backend, fullgraph=True)(x)
        promise = dtorch_ops.TensorPromise()
        logged = torch.compile(logged_step, backend=backend, fullgraph=True)(x, promise)
        eager, compiled = eager_future.get(), compiled_future.get()
        by_promise = promise.get_future().get()
        for value in (eager, compiled, by_promise):
            assert not value.requires_grad and value.grad_fn is None, backend
        assert eager.item() == compiled.item() == 6.0 and by_promise.item() == 9.0
        # The graph's outputs keep their autograd graph.
        assert eager_loss.requires_grad and compiled_loss.requires_grad and logged.requires_grad
        assert eager.data_ptr() == eager_loss.data_ptr()


# ---- then() -------------------------------------------------------------------------------------


def test_then_gives_a_tensor_future_for_a_tensor_result_on_a_complete_future():
    derived = dtorch_ops.to_torch_async(torch.ones(2)).then(lambda f: f.value() + 1)
    assert type(derived) is dtorch_ops.TensorFuture
    assert isinstance(derived.raw, torch.ScriptObject)
    assert torch.equal(_wait(derived.raw), torch.full((2,), 2.0))  # TorchScript takes it
    assert torch.equal(derived.get(), torch.full((2,), 2.0)) and not derived.valid()


def test_then_adopts_the_tensor_type_once_a_pending_future_completes():
    promise = dtorch_ops.TensorPromise()
    derived = promise.get_future().then(lambda f: f.value() * 3)
    assert type(derived) is dtorch_ops.ObjectFuture  # not known before the callback has run
    assert not derived.is_ready()
    promise.set_value(torch.ones(1))
    assert torch.equal(derived.wait(WAIT_MS), torch.full((1,), 3.0))
    assert type(derived) is dtorch_ops.TensorFuture
    assert isinstance(derived.raw, torch.ScriptObject)
    assert derived.kind() == "memory"
    assert torch.equal(derived.get(), torch.full((1,), 3.0))
    with pytest.raises(errors.FutureConsumedError):
        derived.get()


async def _await(future):
    return await future


def test_then_adopting_while_awaited_and_other_results():
    import asyncio

    promise = dtorch_ops.TensorPromise()
    derived = promise.get_future().then(lambda f: f.value() + 1)

    async def main():
        task = asyncio.ensure_future(_await(derived))
        await asyncio.sleep(0.01)
        promise.set_value(torch.zeros(1))
        return await asyncio.wait_for(task, 10)

    assert torch.equal(asyncio.run(main()), torch.ones(1))
    assert type(derived) is dtorch_ops.TensorFuture
    # Non-tensor results and errors stay ObjectFutures, raising the callback's very exception.
    number = dtorch_ops.to_torch_async(torch.ones(1)).then(lambda f: f.value().item())
    assert type(number) is dtorch_ops.ObjectFuture and number.get() == 1.0

    def fails(f):
        raise KeyError("no")

    failed = dtorch_ops.to_torch_async(torch.ones(1)).then(fails)
    assert type(failed) is dtorch_ops.ObjectFuture
    with pytest.raises(KeyError):
        failed.get()


# ---- error text ---------------------------------------------------------------------------------


def test_error_text_names_the_cpp_methods_too():
    future = dtorch_ops.to_torch_async(torch.ones(1))
    future.get()
    with pytest.raises(errors.FutureConsumedError, match=r"get\(\) \(C\+\+: Get\(\)\)"):
        future.get()
    promise = dtorch_ops.TensorPromise()
    promise.get_future()
    with pytest.raises(errors.FutureError, match=r"get_future\(\) \(C\+\+: GetFuture\(\)\)"):
        promise.get_future()
    pending = dtorch_ops.TensorPromise()
    with pytest.raises(errors.FutureNotReadyError, match=r"Value\(\)"):
        pending.get_future().value()


def test_cpp_guide_names_the_cpp_api():
    with open(os.path.join(REPO, "docs", "guide", "cpp.md")) as f:
        guide = f.read()
    assert "`const dtorch::CodedErrorBase*`" in guide
    assert "a `dtorch::FutureErrc`)" not in guide  # CodeOf does not return the code itself
    for name in ("future->Get()", "future->Wait(timeout_ms)", "promise->SetValue(t)",
                 "promise->GetFuture()", "future->IsReady()"):
        assert name in guide


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_one_timeout_wording_whichever_unit_was_written(kind):
    promise = dtorch_ops.TensorPromise(kind=kind)
    future = promise.get_future()
    for call in (lambda: future.wait(250), lambda: future.wait(timeout=0.25),
                 lambda: future.result(0.25), lambda: future.exception(timeout=0.25),
                 lambda: dtorch_ops.wait_all([future], timeout=0.25)):
        with pytest.raises(errors.FutureTimeoutError, match=r"within 250 ms"):
            call()
    promise.set_value(torch.ones(1))
    future.get()


# ---- to_torch's arguments -----------------------------------------------------------------------


def test_to_torch_refuses_a_number_as_device_and_says_how_to_time_out():
    t = torch.ones(1)
    with pytest.raises(TypeError, match=r"got int 100.*timeout_ms=100"):
        dtorch_ops.to_torch(t, 100)
    with pytest.raises(TypeError, match=r"got float 0.5"):
        dtorch_ops.to_torch_async(t, 0.5)
    with pytest.raises(TypeError, match=r"got bool"):
        dtorch_ops.to_torch(t, True)
    assert dtorch_ops.to_torch(t, timeout_ms=100) is t
    assert torch.equal(dtorch_ops.to_torch(t, "cpu", timeout=1), t)
    pending = dtorch_ops.TensorPromise()
    with pytest.raises(TypeError):  # to_torch takes a tensor
        dtorch_ops.to_torch(pending, timeout_ms=10)


def test_a_tensor_subclass_that_requires_grad_is_yielded_detached_as_itself():
    from torch.testing._internal.two_tensor import TwoTensor

    class Marked(torch.Tensor):  # a plain subclass (no __torch_dispatch__)
        pass

    two = TwoTensor(torch.ones(2), torch.ones(2)).requires_grad_()
    marked = torch.ones(2).as_subclass(Marked).requires_grad_()
    for t, cls in ((two, TwoTensor), (marked, Marked)):
        value = dtorch_ops.to_torch_async(t).get()
        assert type(value) is cls and not value.requires_grad
        assert value.sum().item() == 2.0
        promise = dtorch_ops.TensorPromise()
        dtorch_ops.get_tensor(t, promise)
        value = promise.get_future().get()
        assert type(value) is cls and not value.requires_grad


def test_then_adoption_seen_by_methods_bound_before_and_by_a_blocked_get():
    import threading

    import sys
    import time

    promise = dtorch_ops.TensorPromise()
    derived = promise.get_future().then(lambda f: f.value() + 1)
    is_ready, valid, add_done_callback = derived.is_ready, derived.valid, derived.add_done_callback
    got = []
    getter = threading.Thread(target=lambda: got.append(derived.get()))
    getter.start()
    # Until the getter is blocked in ObjectFuture.get (on the completion handle, pre-adoption).
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(getter.ident)
        if frame is not None and frame.f_code is dtorch_ops.ObjectFuture.get.__code__:
            break
        time.sleep(0.001)
    else:
        pytest.fail("the getter never blocked in ObjectFuture.get")
    time.sleep(0.05)  # (inside its handle's get(), the GIL released)
    promise.set_value(torch.zeros(1))
    getter.join(10)
    assert got and torch.equal(got[0], torch.ones(1))
    assert type(derived) is dtorch_ops.TensorFuture
    assert is_ready() and not valid()  # bound while it was an ObjectFuture; consumed as one
    called = []
    add_done_callback(lambda f: called.append(f))
    assert called == [derived]
    with pytest.raises(errors.FutureConsumedError):
        derived.get()


def test_then_keeps_a_value_a_tensor_promise_refuses(monkeypatch):
    """Where the tensor cannot become a TensorFuture's value, the future stays an ObjectFuture
    holding it (a DTensor, say; here a refusal made by hand)."""
    from dtorch_ops import _settle

    monkeypatch.setattr(_settle, "_adopted_handle", lambda value: None)
    promise = dtorch_ops.TensorPromise()
    derived = promise.get_future().then(lambda f: f.value() * 2)
    promise.set_value(torch.ones(1))
    assert torch.equal(derived.wait(WAIT_MS), torch.full((1,), 2.0))
    assert type(derived) is dtorch_ops.ObjectFuture
