"""Functions that test_network.py and test_network_failures.py run in their other processes:
producers and consumers (spawned producer_process.ProducerProcess children, which run these by
reference), the TCPStore server the test kills, and the fuzzer of serialized promises.

A process keeps what it must hold between two calls (a consumer's future, a producer's attached
promise) in _KEPT, by a name the test gives.
"""
import json
import os
import sys
import time

import torch

import dtorch_ops
from file_producers import make_tensor
from producer_process import describe, die_with_parent

_KEPT = {}


def configure(heartbeat_timeout_s: float = None, attach_timeout_s: float = None) -> None:
    if heartbeat_timeout_s is not None:
        dtorch_ops.config.network_heartbeat_timeout_s = heartbeat_timeout_s
    if attach_timeout_s is not None:
        dtorch_ops.config.attach_timeout_s = attach_timeout_s


def _promise(promise, cls=dtorch_ops.TensorPromise):
    """A promise sent as itself (pickled) or as its serialize() string."""
    return cls.from_serialized(promise) if isinstance(promise, str) else promise


def seeded(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A large deterministic tensor both sides can make (cheaper than sending it through a
    multiprocessing queue)."""
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=generator, dtype=dtype)
    return torch.randint(0, 256, (numel,), generator=generator, dtype=torch.uint8).to(dtype)


# ---- producers --------------------------------------------------------------------------------


def produce(promise, dtype, shape, layout) -> None:
    """Sets make_tensor(...) through get_tensor, then writes into it: the consumer must receive
    the value as of the call."""
    t = make_tensor(dtype, shape, layout)
    dtorch_ops.get_tensor(t, _promise(promise))
    if t.numel() and layout not in ("expanded", "conj"):
        t.zero_() if dtype != torch.bool else t.logical_not_()


def produce_seeded(promise, numel: int, dtype: torch.dtype, seed: int) -> None:
    dtorch_ops.get_tensor(seeded(numel, dtype, seed), _promise(promise))


def set_value(promise, value: torch.Tensor) -> None:
    _promise(promise).set_value(value)


def set_void(promise) -> None:
    _promise(promise, dtorch_ops.VoidPromise).set_value()


def set_exception(promise, message: str, cls_name: str = "TensorPromise") -> None:
    _promise(promise, getattr(dtorch_ops, cls_name)).set_exception(message)


def produce_many(handles: list) -> float:
    """Sets value i, full((4,), i), on the promise of handles[i]; returns the seconds it took."""
    start = time.monotonic()
    for i, handle in enumerate(handles):
        dtorch_ops.get_tensor(torch.full((4,), float(i)),
                              dtorch_ops.TensorPromise.from_serialized(handle))
    return time.monotonic() - start


def try_set(promise, value: torch.Tensor):
    """set_value; returns None, or describe() of its error."""
    try:
        _promise(promise).set_value(value)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return describe(e)
    return None


def set_through_two_handles(handle: str) -> tuple:
    """Two handles of one pair in this process: the first sets, the second must be refused.
    Returns describe() of the second's error (or a tuple saying it was not refused)."""
    first = dtorch_ops.TensorPromise.from_serialized(handle)
    second = dtorch_ops.TensorPromise.from_serialized(handle)
    first.set_value(torch.ones(1))
    try:
        second.set_value(torch.zeros(1))
    except Exception as e:  # noqa: BLE001 - reported to the test
        return describe(e)
    return ("", "", "not refused")


def set_again_later(handle: str):
    """A new handle of a pair this process already set (its first attachment gone): refused too."""
    import gc

    gc.collect()
    return try_set(handle, torch.zeros(1))


HOLDING = ("", "", "holding")


def _hold(promise) -> tuple:
    """This process holds `promise` (deserialized: a holder from that moment, announced to the
    consumer) without setting anything; returns HOLDING."""
    assert promise.kind() == "network"
    return HOLDING


def attach_and_keep(handle: str, name: str) -> tuple:
    """Holds the promise (deserialized) and keeps it (the test kills this process)."""
    promise = dtorch_ops.TensorPromise.from_serialized(handle)
    _KEPT[name] = promise
    return _hold(promise)


def attach_and_drop(handle: str) -> tuple:
    """Holds the promise (deserialized), then drops its only handle without setting."""
    import gc

    promise = dtorch_ops.TensorPromise.from_serialized(handle)
    refusal = _hold(promise)
    del promise
    gc.collect()
    return refusal


@torch.jit.script
def scripted_producer(x: torch.Tensor, promise: torch.classes.dtorch.TensorPromise) -> torch.Tensor:
    y = x * 2
    torch.ops.dtorch.get_tensor(y, promise)
    return y + 1


def script_produce(promise, x: torch.Tensor) -> torch.Tensor:
    return scripted_producer(x, _promise(promise).raw)


def _step(x, promise):
    hidden = x.sin() * 2  # an intermediate, not a graph output
    dtorch_ops.get_tensor(hidden, promise)
    hidden.mul_(10)  # later in the step, in place: the consumer must get the value as of the call
    return (hidden + 1).sum()


_compiled_step = None


def compiled_produce(promise, x: torch.Tensor) -> torch.Tensor:
    global _compiled_step
    if _compiled_step is None:
        _compiled_step = torch.compile(_step, fullgraph=True)
    return _compiled_step(x, _promise(promise))


# ---- consumers ----------------------------------------------------------------------------------


def make_pair(store: str, name: str, cls_name: str = "TensorPromise", **options) -> str:
    """Creates a pair on the store at `store` ("host:port"), keeps it under `name`, returns its
    promise serialized."""
    promise = getattr(dtorch_ops, cls_name)(kind="network", store=store, **options)
    _KEPT[name] = (promise, promise.get_future())
    return promise.serialize()


def take(name: str, timeout_ms: int):
    """Waits for the future kept under `name` and forgets the pair."""
    promise, future = _KEPT.pop(name)
    del promise
    return future.wait(timeout_ms)


def drop(name: str) -> None:
    import gc

    _KEPT.pop(name, None)
    gc.collect()


def pending_network_pairs() -> int:
    return dtorch_ops._C.diagnostics()["network"]["pending_pairs"]


# ---- the store server the test kills ------------------------------------------------------------


def store_server_main() -> None:
    """Runs a TCPStore server on 127.0.0.1 (a free port, printed) until killed (at most 120 s)."""
    die_with_parent()
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    print(server.port, flush=True)
    time.sleep(120)
    os._exit(3)


# ---- the fuzzer ---------------------------------------------------------------------------------


# ---- two network namespaces (two "hosts") -------------------------------------------------------


def netns_consumer_main(host: str, pair_groups: int = 1) -> None:
    """Runs a store server on `host` and a pair on it (config.network_pair_groups =
    `pair_groups`); prints the serialized promise, then what arrived (JSON)."""
    die_with_parent()
    import torch.distributed as dist

    dtorch_ops.config.network_pair_groups = pair_groups
    server = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    promise = dtorch_ops.TensorPromise(kind="network", store=server)
    future = promise.get_future()
    print(promise.serialize(), flush=True)
    del promise
    try:
        value = future.wait(60_000)
        print(json.dumps({"value": value.tolist()}), flush=True)
    except Exception as e:  # noqa: BLE001 - reported to the test
        print(json.dumps({"error": describe(e)}), flush=True)


def netns_producer_main() -> None:
    """Reads a serialized promise from stdin and sets it to arange(10)."""
    die_with_parent()
    handle = sys.stdin.readline().strip()
    dtorch_ops.get_tensor(torch.arange(10.0), dtorch_ops.TensorPromise.from_serialized(handle))
    print(f"set links_out={dtorch_ops._C.diagnostics()['network']['links_out']}", flush=True)


def set_stamped(promises: list, pace_s: float) -> None:
    """Sets each promise in turn, `pace_s` apart, to a float64 tensor holding time.monotonic()
    just before the set (one system-wide clock: the consumer's arrival time compares)."""
    for promise in promises:
        time.sleep(pace_s)
        _promise(promise).set_value(torch.tensor([time.monotonic()], dtype=torch.float64))


def default_group_store_host(port: int) -> None:
    """Rank 0 of a 2-process default group whose store it hosts (init_method tcp://): joins the
    group, waits at a barrier for rank 1 to have made its network pair, then dies (os._exit,
    nothing cleaned up) and takes the store with it (test_user_edges)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
    dist.barrier()
    time.sleep(0.5)
    os._exit(1)
