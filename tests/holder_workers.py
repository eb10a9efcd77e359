"""Workers of test_holders.py: the processes a controller hands a promise to (as a Process
argument, through a queue, in a TorchScript module), which then fail in each way a worker does.
Run in spawned or forked children, by reference."""
import io
import os
import signal
import time

import torch

import dtorch_ops


def behave(promise, behavior: str, ready) -> None:
    """A worker that received `promise` and never touches it: it says it is ready (its pid, on a
    pipe: written before the call returns), then raises, ends in os._exit(1), is killed, or
    returns."""
    ready.send(os.getpid())
    if behavior == "raise":
        raise RuntimeError("the worker failed while loading its model")
    if behavior == "os_exit":
        os._exit(1)
    if behavior == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if behavior == "return":
        return
    raise AssertionError(behavior)


def drop_and_wait(serialized: str, cls_name: str, ready, release) -> None:
    """Deserializes a promise, drops it unset, and stays alive until told."""
    promise = getattr(dtorch_ops, cls_name).from_serialized(serialized)
    del promise
    ready.send(os.getpid())
    release.get(timeout=60)


def drop_and_return(serialized: str, ready) -> None:
    """Deserializes a promise, drops it unset, says so, and returns at once (its drop message
    goes out at the exit, before the next round of the library's thread could send it)."""
    promise = dtorch_ops.TensorPromise.from_serialized(serialized)
    del promise
    ready.send(os.getpid())


def fail_inside_fulfilling(promise) -> None:
    """The idiom: a failure inside `with promise.fulfilling()` reaches the consumer."""
    with promise.fulfilling():
        raise KeyError("checkpoint/layer3.weight")


def refused_value(promise) -> None:
    """set_value of a value the kind refuses: the consumer learns why."""
    try:
        promise.set_value(torch.ones(2).to_sparse())
    except (RuntimeError, TypeError, ValueError):
        pass  # (the worker swallows it; the consumer still gets the cause)
    time.sleep(0.5)


class CustomError(Exception):
    pass


def set_exception_object(promise, which: str) -> None:
    exception = {"value": ValueError("bad shape (3, 4)"), "key": KeyError("weights"),
                 "custom": CustomError("a custom failure")}[which]
    try:
        raise exception
    except Exception as e:  # noqa: BLE001 (a raised one: it has a traceback)
        promise.set_exception(e)


def forward(promise, queue) -> None:
    """A holder that passes the promise on through a queue and returns at once."""
    queue.put(promise)
    queue.close()
    queue.join_thread()  # (the handle is pickled by the queue's feeder thread)


def receive_when_told(queue, go, value: float) -> None:
    """The grandchild: reads the forwarded promise only when told (the forwarding holder is long
    gone by then), then fulfils it."""
    go.get(timeout=60)
    promise = queue.get(timeout=60)
    promise.set_value(torch.full((3,), value))


def hold_then_set(promise, go, value: float) -> None:
    """The real producer: holds the promise until told, then sets it."""
    go.get(timeout=60)
    promise.set_value(torch.full((2,), value))


def load_module_and_exit(saved: bytes, ready, release=None) -> None:
    """A third process that loads a TorchScript module holding the promise (a copy that never
    produces), says so, then exits (when told, if `release`)."""
    module = torch.jit.load(io.BytesIO(saved))
    assert module is not None
    ready.send(os.getpid())
    if release is not None:
        release.get(timeout=60)


class PromiseHolder(torch.nn.Module):
    """A scripted module that keeps a raw promise as an attribute (saved with it)."""

    def __init__(self, promise):
        super().__init__()
        self.promise = promise

    def forward(self, x):
        torch.ops.dtorch.get_tensor(x, self.promise)
        return x
