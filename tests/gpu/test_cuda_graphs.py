"""GPU only: compiled futures under mode="reduce-overhead" (CUDA graphs). A graph holding an opaque
reference object cannot be captured as a CUDA graph (pytorch#176615): inductor must skip CUDA
graphs for it and still run the ops every call, each call's future holding that call's value."""
import pytest
import torch

import dtorch_ops
from conftest import CUDA, WAIT_MS


@CUDA
@pytest.mark.skipif(dtorch_ops.futures._graph is None,
                    reason="this torch cannot return opaque objects from graphs")
def test_reduce_overhead_falls_back_from_cuda_graphs_and_gives_the_values():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    def step(x, w):
        h = torch.relu(x @ w)
        loss = h.sum()
        future = dtorch_ops.to_torch_async(loss)
        h.mul_(3)  # later in the graph: the future keeps the value as of the call
        return (h * 2).sum(), future

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    futures = []
    for i in range(4):
        x = torch.randn(64, 64, device="cuda")
        w = torch.randn(64, 64, device="cuda")
        out, future = compiled(x, w)
        h = torch.relu(x @ w)
        torch.testing.assert_close(future.wait(WAIT_MS), h.sum())
        torch.testing.assert_close(out, (h * 6).sum())
        futures.append(future)
    assert len({id(f) for f in futures}) == 4
    assert counters["inductor"]["cudagraph_skips"] >= 1, dict(counters["inductor"])
