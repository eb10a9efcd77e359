"""The future and promise classes as torch.compile opaque reference types: importing this module
registers them and defines the graph ops over them (``graph_ops.define``), once.

The ops that create futures and fulfil promises inside compiled graphs are then
``graph_ops.defined_ops``; None on a torch without opaque types (promises then carry their
TorchScript object from birth, for the raw ops).
"""
from .. import _C
from ..futures import TensorFuture, TensorListFuture, VoidFutureCollect
from ..promises import TensorPromise, VoidPromise
from . import graph_ops

graph_ops.define(TensorFuture, TensorListFuture, VoidFutureCollect, TensorPromise, VoidPromise,
                 _C)
