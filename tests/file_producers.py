"""Producer-side functions for test_file_kind.py (and the value cases test_network.py shares):
run in the module's producer process
(producer_process.ProducerProcess.call), they fulfil the file promises the test (the consumer)
sends them.
"""
import torch

import dtorch_ops


# (dtype, shape, layout) of the values the cross-process kinds' tests send (make_tensor).
CASES = [
    (torch.float32, (5, 7), "contiguous"),
    (torch.float64, (4, 6), "transposed"),
    (torch.float16, (2, 3, 4, 5), "channels_last"),
    (torch.bfloat16, (3, 8), "sliced"),
    (torch.int64, (4, 5), "expanded"),
    (torch.int8, (16,), "contiguous"),
    (torch.uint8, (3, 3), "transposed"),
    (torch.bool, (6, 2), "sliced"),
    (torch.complex64, (3, 4), "conj"),
    (torch.int32, (0, 4), "contiguous"),
    (torch.float32, (), "contiguous"),
]


def make_tensor(dtype: torch.dtype, shape: tuple, layout: str) -> torch.Tensor:
    """A deterministic tensor of `dtype` and `shape`: contiguous, transposed (dense, other
    strides), channels_last, sliced (gaps), expanded (stride 0) or a conjugated view."""
    numel = 1
    for size in shape:
        numel *= size
    base = torch.arange(numel * 2 if layout == "sliced" else numel, dtype=torch.float64)
    if dtype == torch.bool:
        base = base.remainder(3) == 0
    elif dtype.is_complex:
        base = torch.complex(base, -base)
    else:
        base = base.remainder(100)
    base = base.to(dtype)
    if layout == "sliced":
        return base.reshape(*shape[:-1], shape[-1] * 2)[..., ::2]
    t = base.reshape(shape)
    if layout == "transposed":
        return t.reshape(*reversed(shape)).transpose(0, -1) if len(shape) > 1 else t
    if layout == "channels_last":
        return t.contiguous(memory_format=torch.channels_last)
    if layout == "expanded":
        return t[..., :1].expand(shape)
    if layout == "conj":
        return t.conj()
    return t


def produce(promise, dtype, shape, layout) -> None:
    """Sets make_tensor(...) through get_tensor, then writes into it: the consumer's value must
    be the one at the time of the call (copied then)."""
    t = make_tensor(dtype, shape, layout)
    dtorch_ops.get_tensor(t, promise)
    if t.numel() and layout not in ("expanded", "conj"):
        t.zero_() if dtype != torch.bool else t.logical_not_()


def set_value(promise, value: torch.Tensor) -> None:
    promise.set_value(value)


def set_exception(promise, message: str) -> None:
    promise.set_exception(message)


def sync_into(promise) -> None:
    dtorch_ops.sync_into(None, promise)


def set_twice(promise) -> str:
    """The second set raises in the producer; returns its message."""
    promise.set_value(torch.ones(1))
    try:
        promise.set_value(torch.zeros(1))
    except dtorch_ops.PromiseAlreadySatisfiedError as e:
        return str(e)
    return "not refused"


def produce_from_serialized(serialized: str, value: torch.Tensor) -> None:
    dtorch_ops.get_tensor(value, dtorch_ops.TensorPromise.from_serialized(serialized))


@torch.jit.script
def scripted_producer(x: torch.Tensor, promise: torch.classes.dtorch.TensorPromise) -> torch.Tensor:
    y = x * 2
    torch.ops.dtorch.get_tensor(y, promise)
    return y + 1


def script_produce(promise, x: torch.Tensor) -> torch.Tensor:
    return scripted_producer(x, promise.raw)


def _step(x, promise):
    hidden = x.sin() * 2  # an intermediate, not a graph output: inductor must not reuse it
    dtorch_ops.get_tensor(hidden, promise)
    return (hidden + 1).sum()


_compiled_step = None


def compiled_produce(promise, x: torch.Tensor) -> torch.Tensor:
    global _compiled_step
    if _compiled_step is None:
        _compiled_step = torch.compile(_step, fullgraph=True)
    return _compiled_step(x, promise)


def run_saved_module(path: str, x: torch.Tensor) -> torch.Tensor:
    """Loads a TorchScript module that holds a file promise and runs it: it fulfils that promise."""
    return torch.jit.load(path)(x)


def run_saved_export(path: str, x: torch.Tensor, promise) -> torch.Tensor:
    """Loads a saved torch.export program (its example promise is deserialized, never used) and
    runs it with `promise`."""
    return torch.export.load(path).module()(x, promise.raw)
