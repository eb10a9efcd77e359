"""GPU only: compiled futures under mode="reduce-overhead" (CUDA graphs). A graph holding an opaque
reference object cannot be captured as a CUDA graph (pytorch#176615): inductor must skip CUDA
graphs for it and still run the ops every call, each call's future holding that call's value.
CUDA only: skipped on the simulated device (DTORCH_GPU_TESTS=simdev, see conftest.py)."""
import torch

import dtorch_ops
from conftest import WAIT_MS, cuda_only


@cuda_only("CUDA graphs")
def test_reduce_overhead_falls_back_from_cuda_graphs_and_gives_the_values():
    # (Before torch 2.12 the future is made at a graph break instead: CUDA graphs may then capture
    # the pieces around it, and the values must be right all the same.)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    def step(x, w):
        h = torch.relu(x @ w)
        loss = h.sum()
        future = dtorch_ops.to_torch_async(loss)
        h.mul_(3)  # later in the graph: the future keeps the value as of the call
        return (h * 2).sum(), future

    in_graph = dtorch_ops.compile.graph_ops.defined_ops is not None
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=in_graph)
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
    if in_graph:
        assert counters["inductor"]["cudagraph_skips"] >= 1, dict(counters["inductor"])
