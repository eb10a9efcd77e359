"""The host copy on the GPU: to_torch_async(t, device="cpu") behind ~100 ms of queued kernels
returns in microseconds with the future not ready, copies into pinned memory from a caching host
allocator (not an allocation per call), does not wait for another stream, and yields the values
once the copy has landed; in a compiled step too, before the step's in-place updates.

Runs on CUDA, or on the simulated device with DTORCH_GPU_TESTS=simdev (see conftest.py), except
the nn training step, which needs kernels the simulated device lacks. tests/test_host_copy.py runs
the device-generic cases on both as well."""
import time

import torch

import dtorch_ops
from conftest import WAIT_MS, cuda_only


def test_returns_at_once_behind_queued_kernels_then_lands(gpu):
    x_cpu = torch.randn(1024)
    x = x_cpu.to(gpu.name)
    dtorch_ops.to_torch_async(x, device="cpu").wait(WAIT_MS)  # the first pinned block, a detector
    gpu.synchronize()
    gpu.sleep(100)
    loss = x[0] * 3  # a 0-dim value, behind the 100 ms
    t0 = time.perf_counter()
    future = dtorch_ops.to_torch_async([loss, x[:4]], device="cpu")
    issued = time.perf_counter() - t0
    assert issued < 0.01, f"the host copy took {issued * 1e6:.0f} us to return"
    assert not future.is_ready()
    got_loss, head = future.wait(WAIT_MS)
    assert got_loss.is_pinned() and head.is_pinned()
    torch.testing.assert_close(got_loss, x_cpu[0] * 3)
    torch.testing.assert_close(head, x_cpu[:4])


def test_pinned_blocks_are_reused_not_allocated_per_call(gpu):
    # The caching host allocator hands a freed pinned block out again: after a warm-up, the
    # copies' host pointers come from a small set.
    x = torch.ones(256, device=gpu.name)
    pointers = set()
    for _ in range(50):
        value = dtorch_ops.to_torch_async(x, device="cpu").wait(WAIT_MS)
        pointers.add(value.data_ptr())
        del value
    # (A few: a block returns to the cache once its future's completion is dropped, which may be
    # just after wait() returns.)
    assert len(pointers) <= 8, f"{len(pointers)} distinct pinned blocks for 50 copies"


def test_other_stream_is_not_waited_for(gpu):
    y = torch.ones(8, device=gpu.name)
    gpu.synchronize()
    with gpu.using_stream(gpu.new_stream()):
        gpu.sleep(300)
    t0 = time.perf_counter()
    value = dtorch_ops.to_torch_async(y, device="cpu").wait(WAIT_MS)
    assert time.perf_counter() - t0 < 0.2, "the copy waited for the side stream"
    assert torch.equal(value, torch.ones(8))


def test_compiled_step_logs_through_the_host_copy_before_its_in_place_update(gpu):
    # Elementwise kernels only (the simulated device has no others): each step's logged value is
    # the one of its call, not changed by the update queued after it, even behind queued work.
    torch._dynamo.reset()
    w = torch.full((4,), 2.0).to(gpu.name).requires_grad_()
    x = torch.arange(4.0).to(gpu.name)
    ones = torch.ones(4).to(gpu.name)

    @torch.compile(fullgraph=dtorch_ops.compile.graph_ops.defined_ops is not None,
                   backend="inductor" if gpu.name == "cuda" else "aot_eager")
    def forward(w, x):
        losses = w * x + x
        return losses, dtorch_ops.to_torch_async(losses, device="cpu")

    logged, w_now = [], torch.full((4,), 2.0)
    for _ in range(4):
        gpu.sleep(20)
        losses, future = forward(w, x)
        losses.backward(ones)
        with torch.no_grad():
            w.copy_(w + w.grad * -0.5)  # in place, after the copy on the stream
        w.grad = None
        logged.append((future, w_now * torch.arange(4.0) + torch.arange(4.0)))
        w_now = w_now - 0.5 * torch.arange(4.0)
    for future, expected in logged:
        value = future.wait(WAIT_MS)
        assert value.is_pinned()
        torch.testing.assert_close(value, expected)
    torch.testing.assert_close(w.detach().cpu(), w_now)


@cuda_only("nn.Linear, reductions and inductor's kernels")
def test_compiled_training_step_logs_its_loss_through_the_host_copy(gpu):
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model.cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    @torch.compile(fullgraph=dtorch_ops.compile.graph_ops.defined_ops is not None)
    def forward(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        return loss, dtorch_ops.to_torch_async(loss, device="cpu")

    logged = []
    for _ in range(5):
        x, y = torch.randn(32, 64, device="cuda"), torch.randn(32, 1, device="cuda")
        loss, future = forward(x, y)
        expected = loss.detach().clone()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        logged.append((future, expected))
    for future, expected in logged:
        torch.testing.assert_close(future.wait(WAIT_MS), expected.cpu())
