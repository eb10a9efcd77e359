"""Helpers shared by the torch.compile and torch.export test modules (tests/test_compile*.py):
the skip mark for cases that need graph ops, a small model, a backend capturing the graphs."""
import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import dtorch_ops

GRAPH_OPS = pytest.mark.skipif(
    dtorch_ops.compile.graph_ops.defined_ops is None,
    reason=f"torch {torch.__version__} cannot return opaque objects from compiled graphs: compiled "
           "code falls back to a graph break "
           "(test_without_opaque_types_compiled_code_falls_back_to_a_graph_break)")

# The raw ops traced as their stand-ins (dtorch_ops/compile/raw_ops.py): needs the graph ops and
# Dynamo's tables the stand-ins are registered in (test_the_raw_op_route_exists_where_it_is_pinned
# says on which torch versions they must exist).
RAW_OPS = pytest.mark.skipif(
    not dtorch_ops.compile.raw_ops.registered or dtorch_ops.compile.graph_ops.defined_ops is None,
    reason=f"torch {torch.__version__}: Dynamo does not trace the raw ops here (no graph ops, or "
           "Dynamo lacks the tables raw_ops.py registers them in): they break the graph")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


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

