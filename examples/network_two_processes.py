"""A value across processes of a torch.distributed job (`kind="network"`).

Two processes (they could be on two hosts) join a Gloo process group on the loopback interface.
Rank 0 makes a `TensorPromise(kind="network")`: the pair lives in the key-value store the job
already runs (the default group's store), so nothing else has to be set up. It keeps the future
and sends the promise to rank 1 (here with `broadcast_object_list`: any channel works, pickling or
`promise.serialize()`'s string), which fulfils it with `dtorch_ops.get_tensor(t, promise)`.
Rank 0 waits for the value with a timeout. Every wait is bounded.

Run: python examples/network_two_processes.py
"""
import datetime
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dtorch_ops

TIMEOUT_S = 60.0  # every wait is bounded


def expected_value() -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32).reshape(2, 3) * 10


def consumer() -> None:
    """Rank 0: makes the pair, sends the promise, waits for the value."""
    # The pair lives in the default group's store: after init_process_group no store= is
    # needed (store= names another TCPStore, or "host:port").
    promise = dtorch_ops.TensorPromise(kind="network")
    future = promise.get_future()  # stays here
    dist.broadcast_object_list([promise], src=0)  # the promise travels, pickled
    value = future.wait(timeout=TIMEOUT_S)
    print(f"rank 0: value from rank 1: {value.tolist()}")
    assert torch.equal(value, expected_value())


def producer() -> None:
    """Rank 1: receives the promise and fulfils it."""
    received: list[dtorch_ops.TensorPromise | None] = [None]
    dist.broadcast_object_list(received, src=0)
    promise = received[0]
    assert promise is not None
    dtorch_ops.get_tensor(expected_value(), promise)  # the value is sent before it returns
    print("rank 1: promise fulfilled")


def run(rank: int, port: int) -> None:
    """Runs in each of the two processes."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        if rank == 0:
            consumer()
        else:
            producer()
        dist.barrier()  # both done before either leaves the group
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    """A port free on the loopback interface now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def main() -> None:
    port = free_port()
    print(f"two processes, a Gloo group on 127.0.0.1:{port}")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=run, args=(rank, port)) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=2 * TIMEOUT_S)  # bounded: a process still alive then is killed
        if p.is_alive():
            p.kill()
            p.join(timeout=TIMEOUT_S)
    codes = [p.exitcode for p in procs]
    if codes != [0, 0]:
        raise SystemExit(f"network_two_processes: the processes failed (exit codes {codes})")
    print("network_two_processes: OK")


if __name__ == "__main__":
    main()
