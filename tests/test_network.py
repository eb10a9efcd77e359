"""The "network" kind: promise/future pairs across processes (and hosts) through a
torch.distributed TCPStore, here on 127.0.0.1 (CPU, loopback): values, three processes, many
futures, graphs, two hosts. Its failures, untrusted handles and options: test_network_failures.py.

The module's store server runs in this process (the `store` fixture); this process is mostly the
consumer. Two spawned processes serve the module (started together): producers, which are
consumers too for the three-process tests. After every test no key of the kind but heartbeats
may be left in the store (the autouse `nothing_left_in_the_store`). The fixtures and helpers:
network_fixtures.py.
"""
import asyncio
import gc
import json
import os
import pickle
import shutil
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist

import dtorch_ops
import file_producers
import network_workers
from conftest import TESTS, WAIT_MS, wait_until
from dtorch_ops import errors
from network_fixtures import (CLEANUP_S, fields, leftover_keys, links_in, network_pair,
                              network_thread_bound, path, started_processes)
# The fixtures that the tests use by name: pytest registers those imported into a test module
# (the autouse nothing_left_in_the_store runs after each test of this module for this import).
from network_fixtures import address, other, producer, store  # noqa: F401
from network_fixtures import nothing_left_in_the_store  # noqa: F401

pytestmark = pytest.mark.timeout(120)


# ---- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def processes():
    """Two producers (consumers too)."""
    yield from started_processes(2)


# ---- values -------------------------------------------------------------------------------------

CASES = file_producers.CASES


@pytest.mark.parametrize("dtype,shape,layout", CASES, ids=lambda c: str(c).replace("torch.", ""))
def test_small_values_of_several_dtypes_and_layouts_arrive(store, producer, dtype, shape, layout):
    promise, future = network_pair(store)
    assert promise.kind() == future.kind() == "network"
    producer.call(network_workers.produce, promise, dtype, shape, layout)  # pickled: serialized
    value = future.wait(WAIT_MS)
    expected = network_workers.make_tensor(dtype, shape, layout)
    assert value.dtype == dtype and value.shape == expected.shape
    torch.testing.assert_close(value, expected.resolve_conj(), rtol=0, atol=0)
    assert future.valid() and future.get() is value  # (wait() took nothing; get() does)
    assert not future.valid() and future.done()


# Around the kind's 4 MiB inline limit and its 4 MiB chunks, the store's 8 MiB limit on a value,
# and a 64 MiB value (16 chunks).
SIZES = [(4 << 20, torch.uint8), ((4 << 20) + 1, torch.uint8), ((8 << 20) + 1, torch.uint8),
         (16 << 20, torch.float32)]


@pytest.mark.parametrize("numel,dtype", SIZES, ids=["4MiB", "4MiB+1", "8MiB+1", "64MiB"])
def test_large_values_arrive(store, producer, numel, dtype):
    promise, future = network_pair(store, device="cpu")
    assert promise.serialize().endswith(":device=cpu")
    producer.call(network_workers.produce_seeded, promise.serialize(), numel, dtype, numel)
    value = future.wait(WAIT_MS * 3)
    assert value.dtype == dtype and value.shape == (numel,)
    assert torch.equal(value, network_workers.seeded(numel, dtype, numel))
    value.add_(1)  # ours to write


def test_a_non_contiguous_large_value_arrives_dense(store, producer):
    promise, future = network_pair(store)
    base = network_workers.seeded(6 << 20, torch.float32, 7).reshape(2048, 3072)
    producer.call(network_workers.set_value, promise.serialize(), base.t()[::2])
    value = future.wait(WAIT_MS * 3)
    assert torch.equal(value, base.t()[::2])


def test_void_promises_and_errors(store, producer):
    promise, future = network_pair(store, dtorch_ops.VoidPromise)
    assert fields(promise.serialize())["type"] == "void"
    producer.call(network_workers.set_void, promise)
    assert future.wait(WAIT_MS) is None
    promise, future = network_pair(store, dtorch_ops.VoidPromise)
    producer.call(network_workers.set_exception, promise.serialize(), "no data", "VoidPromise")
    with pytest.raises(errors.ProducerError, match="producer error: no data"):
        future.wait(WAIT_MS)
    promise, future = network_pair(store)
    producer.call(network_workers.set_exception, promise.serialize(), "out of data")
    with pytest.raises(errors.ProducerError, match="out of data"):
        future.wait(WAIT_MS)


def test_the_store_given_as_a_prefix_store_an_address_or_a_spec_string(store, address, producer):
    prefixed = dist.PrefixStore("job", dist.PrefixStore("group", store))
    for given in (store, prefixed, address):
        promise, future = network_pair(given)
        assert fields(promise.serialize())["port"] == store.port
        producer.call(network_workers.set_value, promise, torch.arange(3.0))
        assert torch.equal(future.wait(WAIT_MS), torch.arange(3.0))
    raw = torch.classes.dtorch.TensorPromise(f"network://{address}?device=cpu")
    promise = dtorch_ops.TensorPromise(raw)
    future = promise.get_future()
    assert fields(promise.serialize())["options"] == ":device=cpu"
    producer.call(network_workers.set_value, pickle.loads(pickle.dumps(promise)), torch.ones(2))
    assert torch.equal(future.wait(WAIT_MS), torch.ones(2))


def test_the_future_api(store):
    promise, future = network_pair(store)
    called = threading.Event()
    future.add_done_callback(lambda f: called.set())
    chained = future.then(lambda f: f.value() * 2)
    with pytest.raises(errors.FutureTimeoutError):
        future.wait(50)
    assert not future.is_ready() and future.valid()
    promise.set_value(torch.arange(3.0))  # the creator's own promise, through the store too
    assert called.wait(WAIT_MS / 1000)
    assert future.is_ready()
    assert torch.equal(future.value(), torch.arange(3.0))
    assert torch.equal(chained.wait(WAIT_MS), torch.arange(3.0) * 2)
    assert torch.equal(future.get(), torch.arange(3.0))
    with pytest.raises(errors.FutureConsumedError):
        future.get()


# ---- three processes ----------------------------------------------------------------------------


def test_three_processes_consumer_producer_and_store_host(address, producer, other):
    # This process only hosts the store: `other` consumes what `producer` produces.
    handle = other.call(network_workers.make_pair, address, "chain")
    assert fields(handle)["consumer"] != fields(handle)["pair"]
    producer.call(network_workers.produce_seeded, handle, (8 << 20) + 1, torch.uint8, 3)
    value = other.call(network_workers.take, "chain", WAIT_MS)
    assert torch.equal(value, network_workers.seeded((8 << 20) + 1, torch.uint8, 3))
    # And the other way round, a void pair.
    handle = producer.call(network_workers.make_pair, address, "void", "VoidPromise")
    other.call(network_workers.set_void, handle)
    assert producer.call(network_workers.take, "void", WAIT_MS) is None
    assert other.call(network_workers.pending_network_pairs) == 0


def test_two_producers_fill_one_consumer(store, producer, other):
    pairs = [network_pair(store) for _ in range(4)]
    for i, (promise, _) in enumerate(pairs):
        (producer if i % 2 else other).call(network_workers.set_value, promise, torch.tensor(i))
    assert [int(f.wait(WAIT_MS)) for _, f in pairs] == [0, 1, 2, 3]


def _set_in_forked_child(promise) -> None:
    promise.set_value(torch.full((3,), 7.0))


def test_a_forked_child_fulfils_the_promise_it_inherited(store):
    import multiprocessing

    promise, future = network_pair(store)
    child = multiprocessing.get_context("fork").Process(target=_set_in_forked_child,
                                                          args=(promise,))
    child.start()
    # The promise left the process with the fork: dropping it here does not break the future.
    del promise
    try:
        assert torch.equal(future.wait(WAIT_MS), torch.full((3,), 7.0))
    finally:
        child.join(30)
    assert child.exitcode == 0


def _wait_in_forked_child(future, conn) -> None:
    try:
        future.wait(5_000)
        conn.send("got a value")
    except errors.DroppedAtForkError as e:
        conn.send("dropped at fork: " + str(e))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        conn.send(f"{type(e).__name__}: {e}")


def test_a_future_inherited_by_a_forked_child_fails_there_at_once(store):
    # The pair's watcher is the parent's: in the child the future fails (never waits for a value
    # that goes to the parent); the parent still gets it.
    import multiprocessing

    promise, future = network_pair(store)
    ours, theirs = multiprocessing.Pipe()
    child = multiprocessing.get_context("fork").Process(target=_wait_in_forked_child,
                                                          args=(future, theirs))
    child.start()
    try:
        assert ours.poll(30)
        said = ours.recv()
        assert said.startswith("dropped at fork: "), said
        promise.set_value(torch.ones(2))
        assert torch.equal(future.wait(WAIT_MS), torch.ones(2))
    finally:
        child.join(30)


# ---- many futures, asyncio, threads -------------------------------------------------------------


def test_1000_futures_from_one_producer_leave_no_key(store, producer):
    gc.collect()
    pairs = [network_pair(store) for _ in range(1000)]
    assert dtorch_ops._C.diagnostics()["network"]["pending_pairs"] >= 1000
    assert dtorch_ops.library_threads()["network"] <= network_thread_bound()
    producer.call(network_workers.produce_many, [p.serialize() for p, _ in pairs])
    assert dtorch_ops.library_threads()["network"] <= network_thread_bound()
    assert links_in() <= 2  # (one per producer process at most: this module has two)
    for i, pair in enumerate(pairs):
        assert torch.equal(pair[1].wait(WAIT_MS), torch.full((4,), float(i)))
    del pairs, pair
    gc.collect()
    assert wait_until(lambda: dtorch_ops._C.diagnostics()["network"]["pending_pairs"] == 0, CLEANUP_S)
    assert wait_until(lambda: not leftover_keys(store), CLEANUP_S), leftover_keys(store)[:10]


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def test_futures_awaited_from_asyncio_share_the_kinds_threads(store, producer):
    n = 200
    pairs = [network_pair(store) for _ in range(n)]
    threads_before = thread_count()
    most = {"network": 0, "all": 0}

    def sample():
        most["network"] = max(most["network"], dtorch_ops.library_threads()["network"])
        most["all"] = max(most["all"], thread_count() - threads_before)

    async def main():
        loop = asyncio.get_running_loop()
        handles = [p.serialize() for p, _ in pairs]
        produced = loop.run_in_executor(None, producer.call, network_workers.produce_many, handles)

        async def sampler():
            while not produced.done():
                sample()
                await asyncio.sleep(0.01)

        sampling = asyncio.create_task(sampler())
        values = await asyncio.gather(*(future for _, future in pairs))
        await produced
        await sampling
        sample()
        return values

    values = asyncio.run(asyncio.wait_for(main(), WAIT_MS / 1000 * 3))
    assert [v.tolist() for v in values] == [[float(i)] * 4 for i in range(n)]
    assert most["network"] <= network_thread_bound(), most
    # The executor's thread, the kind's two, and on the links' path Gloo's device thread and the
    # producer's receiving thread: none per future.
    assert most["all"] <= 6, most


# ---- graphs -------------------------------------------------------------------------------------


def test_a_torchscript_producer(store, producer):
    promise, future = network_pair(store)
    x = torch.arange(4.0)
    out = producer.call(network_workers.script_produce, promise.serialize(), x)
    assert torch.equal(out, x * 2 + 1)
    assert torch.equal(future.wait(WAIT_MS), x * 2)


@pytest.mark.timeout(240)
def test_a_compiled_producer_sends_the_value_as_of_the_call(store, producer):
    for i in range(2):  # the second call reuses the compiled graph
        promise, future = network_pair(store)
        x = torch.linspace(0, 1, 8) + i
        out = producer.call(network_workers.compiled_produce, promise, x, timeout_s=200)
        hidden = x.sin() * 2  # an intermediate of the graph, mutated in place after the call
        torch.testing.assert_close(future.wait(WAIT_MS), hidden)
        torch.testing.assert_close(out, (hidden * 10 + 1).sum())


# ---- two hosts ----------------------------------------------------------------------------------


def ip(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)


@pytest.fixture
def two_namespaces():
    """Two network namespaces joined by a veth pair: (namespace, its address) for each. Skipped
    where the tool is missing or creating them is not permitted."""
    if shutil.which("ip") is None:
        pytest.skip("the ip tool (iproute2) is not installed")
    tag = os.getpid() % 100_000
    names = (f"dtorch_a{tag}", f"dtorch_b{tag}")
    subnet = f"10.231.{tag % 250}"
    made = []
    try:
        for name in names:
            if ip("netns", "add", name).returncode != 0:
                pytest.skip("creating network namespaces is not permitted here")
            made.append(name)
        steps = [("link", "add", f"dta{tag}", "type", "veth", "peer", "name", f"dtb{tag}"),
                 ("link", "set", f"dta{tag}", "netns", names[0]),
                 ("link", "set", f"dtb{tag}", "netns", names[1])]
        for name, device, host in ((names[0], f"dta{tag}", 1), (names[1], f"dtb{tag}", 2)):
            steps += [("-n", name, "addr", "add", f"{subnet}.{host}/24", "dev", device),
                      ("-n", name, "link", "set", device, "up"),
                      ("-n", name, "link", "set", "lo", "up")]
        for step in steps:
            done = ip(*step)
            if done.returncode != 0:
                pytest.skip(f"could not set up the namespaces (ip {' '.join(step)}: "
                            f"{done.stderr.strip()})")
        yield (names[0], f"{subnet}.1"), (names[1], f"{subnet}.2")
    finally:
        for name in made:
            ip("netns", "del", name)


@pytest.mark.timeout(60)
def test_a_producer_in_another_network_namespace(two_namespaces, path):
    (consumer_ns, consumer_host), (producer_ns, _) = two_namespaces
    prologue = f"import sys; sys.path.insert(0, {TESTS!r}); import network_workers; "

    def start(namespace, call):
        return subprocess.Popen(["ip", "netns", "exec", namespace, sys.executable, "-c",
                                 prologue + call], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    pair_groups = int(path == "pairs")
    consumer = start(consumer_ns,
                     f"network_workers.netns_consumer_main({consumer_host!r}, {pair_groups})")
    producer = start(producer_ns, "network_workers.netns_producer_main()")  # (imports meanwhile)
    try:
        handle = consumer.stdout.readline().strip()
        assert fields_of_any_host(handle)["host"] == consumer_host, handle
        assert fields_of_any_host(handle)["links"] == "gs"[1 - pair_groups], handle
        out, err = producer.communicate(handle + "\n", timeout=45)
        # (Over a link between the namespaces on that path; through the store on the other.)
        assert producer.returncode == 0 and out.strip() == f"set links_out={pair_groups}", (
            out, err[-2000:])
        out, err = consumer.communicate(timeout=45)
        assert json.loads(out) == {"value": list(map(float, range(10)))}, (out, err[-2000:])
    finally:
        for process in (consumer, producer):
            process.kill()
            process.wait(10)


def fields_of_any_host(handle: str) -> dict:
    parts = handle.split(":")
    at = 5 if parts[3] == "v2" else 3  # (format 2 where the consumer takes links)
    return {"links": parts[4] if at == 5 else "s", "type": parts[at], "host": parts[at + 1],
            "port": int(parts[at + 2])}


def test_a_value_set_then_dropped_in_the_creating_process_arrives(store):
    # The creator sets its own promise and drops it at once: the value is on its way through
    # the store (the creator's drop must not break the pair first).
    for values in (torch.arange(5.0), torch.ones(3 << 20)):  # inline, then chunked
        promise, future = network_pair(store)
        promise.set_value(values)
        del promise
        gc.collect()
        assert torch.equal(future.wait(WAIT_MS), values)


@pytest.mark.timeout(90)
def test_a_producer_that_publishes_then_exits_delivers(store, address):
    # The producer is announced (its tick ran: it holds the promise for a second), publishes a
    # chunked value, and exits cleanly at once (its heartbeat key goes): the consumer gets the
    # value, not "producer exited" (its verdict comes after the queued value).
    promise, future = network_pair(store)
    code = (
        "import time, torch, dtorch_ops\n"
        f"p = dtorch_ops.TensorPromise.from_serialized({promise.serialize()!r})\n"
        "try:\n"
        "    dtorch_ops.get_tensor(torch.ones(2, device='meta'), p)  # refused: attaches only\n"
        "except Exception:\n"
        "    pass\n"
        "time.sleep(1.5)  # announced by its tick meanwhile\n"
        "dtorch_ops.get_tensor(torch.full((3 << 20,), 7.0), p)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = future.wait(WAIT_MS)
    assert torch.equal(got, torch.full((3 << 20,), 7.0))
