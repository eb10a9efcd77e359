"""torch.compile / torch.export support of dtorch_ops.

- ``tracing``: what a call sees of tracing (is Dynamo compiling, is this thread tracing under
  export, is this a FakeTensor / a wrapper subclass / a DTensor);
- ``eager``: the ``torch.compiler.disable``'d callers compiled code runs a call through eagerly
  (a graph break with a reason);
- ``graph_ops``: the Python ops whose schemas return the future classes and take the promise
  classes as opaque reference types (``defined_ops``: None where this torch cannot);
- ``opaque_types``: registers the future and promise classes as those types (``graph_ops.define``);
- ``fakes``: the fake classes tracing sees for the TorchScript classes, and the fake kernels of
  the C++-defined ops (the module the C++ library names in ``set_python_module``: torch checks
  that they are registered from there);
- ``lowerings``: inductor's lowerings of the ops and the DTensor rules;
- ``raw_ops``: Dynamo traces the raw ops (``torch.ops.dtorch.get_tensor_async``, ``sync``, the
  host copies) as the Python API's calls, so they compile into the graph too.

This ``__init__`` imports nothing: importing any of these modules runs it, from the future and
promise modules too.
"""
