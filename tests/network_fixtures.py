"""Fixtures and helpers that test_network.py and test_network_failures.py share (the "network"
kind: promise/future pairs across processes through a torch.distributed TCPStore on 127.0.0.1).
Not a test module: each test module imports the fixtures it uses by name.

A test module's store server runs in the test process (the `store` fixture, one per module); that
process is mostly the consumer. A module's spawned processes start together (its `processes`
fixture, through `started_processes`): processes[0] the producer, processes[1] the other producer
(both consumers too, for the three-process tests), from processes[2] on the ones that a test kills
(`victim`). After every test no key of the kind but heartbeats may be left in the store (the
autouse `nothing_left_in_the_store`, which each test module imports so that it runs there).
"""
import gc
import os
import re
import signal
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
import torch.multiprocessing as torch_mp

import dtorch_ops
import producer_process
from conftest import wait_until
from producer_process import ProducerProcess

SPAWN = torch_mp.get_context("spawn")
KEY_PREFIX = "dtorch/n/"
# (Format 2, "v2:g:" first, where the consumer takes links; format 1 where it does not.)
HANDLE = re.compile(r"^dtorch-promise:1:network:(?:v2:g:)?(tensor|void):127\.0\.0\.1:(\d+):"
                    r"([0-9a-f]{32}):"
                    r"([0-9a-f]{32})(:device=cpu)?$")
# How long the library gets to delete the keys of pairs a test dropped (its tick runs every 0.5 s).
CLEANUP_S = 3.0
# The heartbeat timeout the failure tests use (the minimum), and the bound they hold the
# library to for noticing a death with it.
HEARTBEAT_S = 1.0
DEATH_NOTICED_S = 5.0
# The store timeout of the tests of a store that stops answering (`short_store_timeout`).
STORE_TIMEOUT_S = 1.0
# A call on a store that stopped answering fails within the timeout, plus what a call queued
# behind one that timed out waits (one more timeout), plus slack for a loaded machine.
SILENT_STORE_FAILS_WITHIN_S = 2 * STORE_TIMEOUT_S + 2.0


# ---- fixtures -----------------------------------------------------------------------------------


# The store servers (one per test module), kept until the interpreter exits: the library deletes
# its keys there at exit (a server gone before would only make c10d log its failure).
_SERVERS = []


@pytest.fixture(scope="module")
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    _SERVERS.append(server)
    yield server


@pytest.fixture(scope="module")
def address(store):
    return f"127.0.0.1:{store.port}"


class _Process(ProducerProcess):
    """A ProducerProcess started without waiting for it, so that several start together (each
    imports torch: seconds)."""

    def __init__(self, context):  # (ProducerProcess.__init__ but its first call)
        self.requests, self.results = context.Queue(), context.Queue()
        self.process = context.Process(target=producer_process.serve,
                                       args=(self.requests, self.results), daemon=True)
        self.process.start()
        self._sequence = 0

    @classmethod
    def start_many(cls, context, n: int) -> list:
        started = [cls(context) for _ in range(n)]
        for process in started:
            process.pid = process.call(os.getpid, timeout_s=120)
        return started


def started_processes_now(n: int) -> list:
    """n processes started together (closed by the caller)."""
    return _Process.start_many(SPAWN, n)


def started_processes(n: int):
    """For a test module's `processes` fixture (`yield from` it): n processes started together,
    closed after the module's tests."""
    started = started_processes_now(n)
    yield started
    for process in started:
        if process.process.is_alive():
            process.close()


@pytest.fixture
def producer(processes):
    return processes[0]


@pytest.fixture
def other(processes):
    return processes[1]


def victim(processes, index: int) -> ProducerProcess:
    """processes[2 + index], started in advance for a test that kills it; started anew where an
    earlier run of the test (on the other path) killed it."""
    if not processes[2 + index].process.is_alive():
        processes[2 + index] = started_processes_now(1)[0]
    return processes[2 + index]


def our_keys(store) -> list:
    return sorted(key for key in store.list_keys() if key.startswith(KEY_PREFIX))


def leftover_keys(store) -> list:
    """The kind's keys but heartbeats and identities (a live process keeps those until it
    exits)."""
    return [key for key in our_keys(store)
            if not key.startswith((KEY_PREFIX + "hb/", KEY_PREFIX + "id/"))]


@pytest.fixture(autouse=True)
def nothing_left_in_the_store(store):
    yield
    gc.collect()
    assert wait_until(lambda: not leftover_keys(store), CLEANUP_S), leftover_keys(store)


def network_pair(store, cls=dtorch_ops.TensorPromise, **options):
    promise = cls(kind="network", store=store, **options)
    return promise, promise.get_future()


def fields(handle: str) -> dict:
    match = HANDLE.match(handle)
    assert match, handle
    kind, port, consumer, pair, options = match.groups()
    return {"type": kind, "port": int(port), "consumer": consumer, "pair": pair,
            "options": options}


def kill(process: ProducerProcess) -> float:
    os.kill(process.pid, signal.SIGKILL)
    process.process.join(10)
    return time.monotonic()


def setting(name: str, value):
    """For a fixture: dtorch_ops.config.<name> is `value` during the test."""
    before = getattr(dtorch_ops.config, name)
    setattr(dtorch_ops.config, name, value)
    yield
    setattr(dtorch_ops.config, name, before)


@pytest.fixture(params=["store", "pairs"], autouse=True)
def path(request):
    """Every test of a module that imports this runs on both paths: values through the store
    (config.network_pair_groups = 0 when the consumer creates its pairs: their handles say "s"),
    and over point-to-point links (1: "g"; the producers follow the handle)."""
    yield from setting("network_pair_groups", 1 if request.param == "pairs" else 0)


def links_in() -> int:
    return dtorch_ops._C.diagnostics()["network"]["links_in"]


def network_thread_bound() -> int:
    """The kind's threads at most: the watcher and the tick thread, and, once a link was made,
    Gloo's device thread and one receiving thread per producer process linked to this one."""
    return 3 + links_in()


@pytest.fixture
def short_heartbeat():
    yield from setting("network_heartbeat_timeout_s", HEARTBEAT_S)


@pytest.fixture
def short_attach_timeout():
    yield from setting("attach_timeout_s", 1.0)


@pytest.fixture
def short_store_timeout():
    yield from setting("network_store_timeout_s", STORE_TIMEOUT_S)
