"""Functions for test_file_device.py, run in its other processes (producer_process.ProducerProcess):
a producer that loads the simulated device, and a consumer that does not."""
import os
import signal

import torch

import dtorch_ops

_kept = {}  # what a call leaves for the next one (promises, futures, stream gates)


def load_simdev() -> str:
    import simdev

    simdev.load()
    return torch._C._get_privateuse1_backend_name()


def produce_on_device(promise, values: torch.Tensor, index: int, layout: str, via: str) -> None:
    """Puts `values` on simdev:index (as `layout`), fulfils the promise through get_tensor (or
    set_value), then overwrites the tensor in place on the same stream: the consumer must see the
    values of the call (a snapshot), not the later write."""
    load_simdev()
    import simdev

    t = values.to(f"simdev:{index}")
    if layout == "transposed":
        t = t.t()
    elif layout == "sliced":
        t = t[:, ::2]
    with simdev.device(index):
        if via == "get_tensor":
            dtorch_ops.get_tensor(t, promise)
        else:
            promise.set_value(t)
        t.fill_(-1)  # queued after the snapshot copy: must not reach the consumer


def produce_behind_held_stream(promise, numel: int) -> int:
    """Holds simdev:0's current stream, queues a value behind it and fulfils the promise: returns
    at once (the value is not published until the stream moves)."""
    load_simdev()
    t = torch.arange(numel, dtype=torch.float32).to("simdev")
    gate = torch.ops.simdev.hold()
    t = t * 2  # queued behind the held stream, as the snapshot copy is
    dtorch_ops.get_tensor(t, promise)
    _kept["tensor"] = t
    return int(gate)


def release(gate: int) -> None:
    torch.ops.simdev.release(gate)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


# ---- a consumer without the simulated device ----

def consumer_pair(options: dict) -> str:
    """Makes a file pair here (no simdev loaded) and returns the serialized promise."""
    promise = dtorch_ops.TensorPromise(kind="file", **options)
    _kept["future"] = promise.get_future()
    _kept["promise"] = promise
    return promise.serialize()


def consumer_take(timeout_ms: int) -> tuple:
    """(device type, values) of the value the pair received, and whether simdev is loaded here."""
    value = _kept.pop("future").wait(timeout_ms)
    _kept.pop("promise")
    return value.device.type, value.clone(), torch._C._get_privateuse1_backend_name()


# ---- CUDA (tests/gpu/test_file_cuda.py) ----

def cuda_produce(promise, values: torch.Tensor, index: int, sleep_ms: int) -> float:
    """Puts `values` on cuda:index behind `sleep_ms` of queued kernels, fulfils the promise and
    overwrites the tensor in place; returns how long get_tensor took to return (s)."""
    import time

    from devices import Cuda

    with torch.cuda.device(index):
        t = values.cuda()
        if sleep_ms:
            Cuda().sleep(sleep_ms)
        start = time.perf_counter()
        dtorch_ops.get_tensor(t, promise)
        took = time.perf_counter() - start
        t.fill_(-1)
        _kept.setdefault("tensors", []).append(t)
    return took


def cuda_allocated(index: int = 0) -> int:
    """Bytes the caching allocator has handed out on cuda:index (the producer's blocks)."""
    import gc

    gc.collect()
    _kept.pop("tensors", None)
    torch.cuda.synchronize(index)
    return torch.cuda.memory_allocated(index)


def consumer_take_view(timeout_ms: int) -> tuple:
    """Takes the pair's value and keeps it (a zero-copy view stays open until this process ends);
    returns (device, values on the CPU)."""
    value = _kept.pop("future").wait(timeout_ms)
    _kept["value"] = value
    return str(value.device), value.cpu()
