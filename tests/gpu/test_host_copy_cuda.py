"""GPU only: the host copy on CUDA. to_torch_async(t, device="cpu") behind ~100 ms of queued
kernels returns in microseconds with the future not ready, copies into pinned memory from torch's
caching host allocator (not an allocation per call), and yields the values once the copy has
landed; in a compiled step (inductor) too. tests/test_host_copy.py runs the device-generic cases on
CUDA as well."""
import time

import torch

import dtorch_ops
from conftest import CUDA, WAIT_MS


def _sleep_ms(ms):
    from devices import Cuda

    Cuda().sleep(ms)


@CUDA
def test_returns_at_once_behind_queued_kernels_then_lands():
    x = torch.randn(1024, device="cuda")
    dtorch_ops.to_torch_async(x, device="cpu").wait(WAIT_MS)  # the first pinned block, a detector
    torch.cuda.synchronize()
    _sleep_ms(100)
    loss = (x * 2).sum()
    t0 = time.perf_counter()
    future = dtorch_ops.to_torch_async([loss, x[:4]], device="cpu")
    issued = time.perf_counter() - t0
    assert issued < 0.01, f"the host copy took {issued * 1e6:.0f} us to return"
    assert not future.is_ready()
    got_loss, head = future.wait(WAIT_MS)
    assert got_loss.is_pinned() and head.is_pinned()
    torch.testing.assert_close(got_loss, (x * 2).sum().cpu())
    torch.testing.assert_close(head, x[:4].cpu())


@CUDA
def test_pinned_blocks_are_reused_not_allocated_per_call():
    # The caching host allocator hands a freed pinned block out again: after a warm-up, the
    # copies' host pointers come from a small set.
    x = torch.ones(256, device="cuda")
    pointers = set()
    for _ in range(50):
        value = dtorch_ops.to_torch_async(x, device="cpu").wait(WAIT_MS)
        pointers.add(value.data_ptr())
        del value
    # (A few: a block returns to the cache once its future's completion is dropped, which may be
    # just after wait() returns.)
    assert len(pointers) <= 8, f"{len(pointers)} distinct pinned blocks for 50 copies"


@CUDA
def test_other_stream_is_not_waited_for():
    y = torch.ones(8, device="cuda")
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        _sleep_ms(300)
    t0 = time.perf_counter()
    value = dtorch_ops.to_torch_async(y, device="cpu").wait(WAIT_MS)
    assert time.perf_counter() - t0 < 0.2, "the copy waited for the side stream"
    assert torch.equal(value, torch.ones(8))


@CUDA
def test_compiled_training_step_logs_its_loss_through_the_host_copy():
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model.cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    @torch.compile(fullgraph=dtorch_ops.futures._graph is not None)
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
