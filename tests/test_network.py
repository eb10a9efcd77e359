"""The "network" kind: promise/future pairs across processes (and hosts) through a
torch.distributed TCPStore, here on 127.0.0.1 (CPU, loopback).

The module's store server runs in this process (the `store` fixture); this process is mostly the
consumer. Four spawned processes serve the module (started together): two producers (which are
consumers too, for the three-process tests) and two that a test kills. The store that a test
kills runs in a subprocess of its own. After every test no key of the kind but heartbeats may be
left in the store (the autouse `nothing_left_in_the_store`).
"""
import asyncio
import gc
import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

import dtorch_ops
import file_producers
import network_workers
import producer_process
from conftest import TESTS, WAIT_MS, wait_until
from dtorch_ops import errors
from producer_process import ProducerProcess

pytestmark = pytest.mark.timeout(120)

SPAWN = torch_mp.get_context("spawn")
KEY_PREFIX = "dtorch/n/"
HANDLE = re.compile(r"^dtorch-promise:1:network:(tensor|void):127\.0\.0\.1:(\d+):([0-9a-f]{32}):"
                    r"([0-9a-f]{32})(:device=cpu)?$")
# How long the library gets to delete the keys of pairs a test dropped (its tick runs every 0.5 s).
CLEANUP_S = 3.0
# The heartbeat timeout the failure tests use (the minimum), and the bound they hold the
# library to for noticing a death with it.
HEARTBEAT_S = 1.0
DEATH_NOTICED_S = 5.0


# ---- fixtures -----------------------------------------------------------------------------------


# The module's store servers, kept until the interpreter exits: the library deletes its keys
# there at exit (a server gone before would only make c10d log its failure).
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


@pytest.fixture(scope="module")
def processes():
    """Two producers (consumers too) and two processes that tests kill."""
    started = _Process.start_many(SPAWN, 4)
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
    process = processes[2 + index]
    if not process.process.is_alive():
        pytest.skip("this test's victim process was killed by an earlier run of it")
    return process


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
    assert dtorch_ops.library_threads()["network"] <= 2
    producer.call(network_workers.produce_many, [p.serialize() for p, _ in pairs])
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
    assert most["network"] <= 2, most
    assert most["all"] <= 4, most  # the executor's thread, the kind's two: none per future


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


# ---- failures -----------------------------------------------------------------------------------


def setting(name: str, value):
    """For a fixture: dtorch_ops.config.<name> is `value` during the test."""
    before = getattr(dtorch_ops.config, name)
    setattr(dtorch_ops.config, name, value)
    yield
    setattr(dtorch_ops.config, name, before)


@pytest.fixture
def short_heartbeat():
    yield from setting("network_heartbeat_timeout_s", HEARTBEAT_S)


@pytest.fixture
def short_attach_timeout():
    yield from setting("attach_timeout_s", 1.0)


STORE_TIMEOUT_S = 1.0
# A call on a store that stopped answering fails within the timeout, plus what a call queued
# behind one that timed out waits (one more timeout), plus slack for a loaded machine.
SILENT_STORE_FAILS_WITHIN_S = 2 * STORE_TIMEOUT_S + 2.0


@pytest.fixture
def short_store_timeout():
    yield from setting("network_store_timeout_s", STORE_TIMEOUT_S)


def test_the_store_killed_mid_wait_breaks_the_future(capfd):
    server = subprocess.Popen(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {TESTS!r}); import network_workers;"
                               f" network_workers.store_server_main()"],
        stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        promise, future = network_pair(f"127.0.0.1:{port}")
        called = threading.Event()
        future.add_done_callback(lambda f: called.set())
        with pytest.raises(errors.FutureTimeoutError):
            future.wait(200)
        server.kill()
        killed_at = time.monotonic()
        with pytest.raises(errors.BrokenPromiseError, match="went away"):
            future.wait(WAIT_MS)
        assert time.monotonic() - killed_at < DEATH_NOTICED_S
        assert called.wait(WAIT_MS / 1000)  # (run by the completing thread, after the waiters)
        # A new pair on the dead store fails at once, not after c10d's connection retries.
        started = time.monotonic()
        with pytest.raises(errors.BrokenPromiseError, match="cannot be reached"):
            network_pair(f"127.0.0.1:{port}")
        assert time.monotonic() - started < 2.0
        # The creator's promise cannot reach its store either: a dtorch error, no hang.
        with pytest.raises(errors.BrokenPromiseError):
            promise.set_value(torch.ones(1))
        # What we report is all that is printed (no C++ stack trace of c10d's on stderr).
        assert "Exception raised from" not in capfd.readouterr().err
    finally:
        server.kill()
        server.wait(10)


@pytest.mark.timeout(60)
def test_a_killed_producer_breaks_the_future(store, processes, short_heartbeat):
    process = victim(processes, 0)
    promise, future = network_pair(store)
    heartbeats = set(our_keys(store))
    held = process.call(network_workers.attach_and_keep, promise.serialize(), "held")
    assert held == network_workers.HOLDING, held
    # The producer's heartbeat, made as it announces itself (deserializing: at once). It runs on
    # this kernel, so the consumer checks the process itself; the heartbeat path of a holder on
    # another host: test_holders.py.
    assert wait_until(lambda: len(set(our_keys(store)) - heartbeats) == 1, 5)
    (heartbeat,) = set(our_keys(store)) - heartbeats
    assert heartbeat.startswith(KEY_PREFIX + "hb/")
    with pytest.raises(errors.FutureTimeoutError):
        future.wait(50)
    killed_at = kill(process)
    with pytest.raises(errors.BrokenPromiseError, match="producer died"):
        future.wait(WAIT_MS)
    assert time.monotonic() - killed_at < DEATH_NOTICED_S
    assert wait_until(lambda: heartbeat not in our_keys(store), CLEANUP_S)


@pytest.mark.timeout(60)
def test_a_killed_consumer_leaves_no_key(store, address, producer, processes):
    process = victim(processes, 1)
    producer.call(network_workers.configure, HEARTBEAT_S)
    try:
        handle = process.call(network_workers.make_pair, address, "doomed")
        small = process.call(network_workers.make_pair, address, "doomed too")
        consumer = fields(handle)["consumer"]
        assert KEY_PREFIX + "hb/" + consumer in our_keys(store)
        kill(process)
        # The producer's publishes still succeed (first a value in its message, then a chunked
        # one: its chunks are keys; the claims of both are the producer's to delete)...
        producer.call(network_workers.set_value, small, torch.ones(3))
        producer.call(network_workers.produce_seeded, handle, (8 << 20) + 1, torch.uint8, 1)
        # ...and once the consumer's heartbeat stood still for the timeout, the producer deletes
        # what it left: its queue, the pair's keys, the dead consumer's heartbeat.
        queue = KEY_PREFIX + "q/" + consumer
        assert wait_until(lambda: not leftover_keys(store) and store.queue_len(queue) == 0,
                          HEARTBEAT_S + DEATH_NOTICED_S), (leftover_keys(store),
                                                           store.queue_len(queue))
        assert wait_until(lambda: KEY_PREFIX + "hb/" + consumer not in our_keys(store),
                          CLEANUP_S)
    finally:
        producer.call(network_workers.configure, 5.0)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("killed", ["before_the_set", "after_the_set"])
def test_a_killed_consumers_keys_are_gone_once_a_prompt_producer_exits(store, address, killed):
    """The consumer SIGKILLed before the producer sets a chunked value (32 MiB), or after it (the
    consumer stopped meanwhile, so it reads nothing); the producer exits at once, long before
    the heartbeat timeout (5 s): nothing of the dead consumer's is left in the store, not its
    chunks, claim, queue, heartbeat or identity."""
    consumer = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, dtorch_ops\n"
         f"p = dtorch_ops.TensorPromise(kind='network', store={address!r}); f = p.get_future()\n"
         "print(p.serialize(), flush=True); sys.stdin.readline()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    producer = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, torch, dtorch_ops\n"
         "dtorch_ops.config.exit_timeout_s = 20.0  # (its clean-up at exit, on a loaded machine)\n"
         "p = dtorch_ops.TensorPromise.from_serialized(sys.stdin.readline().strip())\n"
         "print('held', flush=True); sys.stdin.readline()\n"
         "p.set_value(torch.ones(8 << 20))\n"
         "print('set', flush=True); sys.stdin.readline()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        handle = consumer.stdout.readline().strip()
        names = fields(handle)
        producer.stdin.write(handle + "\n")
        producer.stdin.flush()
        assert producer.stdout.readline().strip() == "held"

        def consumers_keys():
            return [k for k in our_keys(store) if names["consumer"] in k or names["pair"] in k]

        assert KEY_PREFIX + "id/" + names["consumer"] in consumers_keys()
        if killed == "before_the_set":
            consumer.kill()
            consumer.wait(10)
        else:
            consumer.send_signal(signal.SIGSTOP)
        producer.stdin.write("\n")
        producer.stdin.flush()
        assert producer.stdout.readline().strip() == "set"
        if killed == "after_the_set":
            assert any("/v/" in k for k in consumers_keys())  # (its chunks, unread)
            consumer.kill()
            consumer.wait(10)
        killed_at = time.monotonic()
        producer.stdin.close()
        assert producer.wait(30) == 0
        assert time.monotonic() - killed_at < dtorch_ops.config.network_heartbeat_timeout_s
        assert consumers_keys() == []
    finally:
        for process in (consumer, producer):
            process.kill()
            process.wait(10)


def test_a_promise_is_set_once_across_processes(store, producer, other):
    promise, future = network_pair(store)
    handle = promise.serialize()
    assert producer.call(network_workers.try_set, handle, torch.ones(1)) is None
    refusal = other.call(network_workers.try_set, handle, torch.zeros(1))
    assert refusal and refusal[1] == "PromiseAlreadySatisfiedError", refusal
    assert torch.equal(future.wait(WAIT_MS), torch.ones(1))
    # Still refused once the value arrived (the pair lives while its future does), and the
    # creator's own handle too.
    refusal = other.call(network_workers.try_set, handle, torch.zeros(1))
    assert refusal and refusal[1] == "PromiseAlreadySatisfiedError", refusal
    with pytest.raises(errors.PromiseAlreadySatisfiedError):
        promise.set_value(torch.zeros(1))


def test_two_handles_in_one_process_set_once(store, producer):
    promise, future = network_pair(store)
    handle = promise.serialize()
    refusal = producer.call(network_workers.set_through_two_handles, handle)
    assert refusal[1] == "PromiseAlreadySatisfiedError", refusal
    assert torch.equal(future.wait(WAIT_MS), torch.ones(1))
    # A later handle in that process, its first attachment gone: refused as well.
    refusal = producer.call(network_workers.set_again_later, handle)
    assert refusal and refusal[1] == "PromiseAlreadySatisfiedError", refusal


def test_no_producer_attached_by_the_deadline(store, producer, short_attach_timeout):
    promise, future = network_pair(store)
    handle = promise.serialize()
    del promise
    dropped_at = time.monotonic()
    with pytest.raises(errors.BrokenPromiseError, match="no producer attached"):
        future.wait(WAIT_MS)
    assert 1.0 <= time.monotonic() - dropped_at < 1.0 + DEATH_NOTICED_S
    # A producer that comes after is told, not silently ignored.
    refusal = producer.call(network_workers.try_set, handle, torch.ones(1))
    assert refusal and refusal[1] == "BrokenPromiseError" and "too late" in refusal[2], refusal


def test_a_producer_dropping_its_promise_unset_breaks_the_future(store, producer):
    promise, future = network_pair(store)
    held = producer.call(network_workers.attach_and_drop, promise.serialize())
    assert held == network_workers.HOLDING, held
    with pytest.raises(errors.BrokenPromiseError,
                       match=r"producer dropped the promise \(pid \d+\) without setting"):
        future.wait(WAIT_MS)


@pytest.mark.parametrize("cls", [dtorch_ops.TensorPromise, dtorch_ops.VoidPromise])
def test_a_promise_dropped_before_it_left_the_process_breaks_at_once(store, cls):
    promise, future = network_pair(store, cls)
    del promise
    with pytest.raises(errors.BrokenPromiseError, match="destroyed before"):
        future.wait(0)


# ---- untrusted handles --------------------------------------------------------------------------


def single_character_variants(text: str, start: int, end: int) -> list:
    """Every bit flip of each character of text[start:end], its deletion, doubling and
    replacement by a few characters that matter to the parser."""
    variants = []
    for i in range(start, end):
        c = text[i]
        replacements = {chr(ord(c) ^ (1 << bit)) for bit in range(8)} | set(":0gA/.[]\x00")
        variants += [text[:i] + r + text[i + 1:] for r in sorted(replacements) if r != c]
        variants += [text[:i] + text[i + 1:], text[:i] + c + text[i:]]
    return variants


# The longest a variant may take: a new address costs c10d a name lookup, which a resolver that
# does not answer holds for its timeout (5 s), or two.
SLOW_VARIANT_S = 12.0


def refused_port() -> int:
    """A port of 127.0.0.1 nobody listens on (bound, not listening, while the test runs)."""
    reserved = socket.socket()
    reserved.bind(("127.0.0.1", 0))
    refused_port.keep = reserved
    return reserved.getsockname()[1]


@pytest.mark.timeout(120)
def test_tampered_serialized_promises_are_refused(store, address, producer):
    genuine = {name: network_pair(store, cls, **options) for name, cls, options in [
        ("tensor", dtorch_ops.TensorPromise, {}),
        ("cpu", dtorch_ops.TensorPromise, {"device": "cpu"}),
        ("void", dtorch_ops.VoidPromise, {})]}
    handles = {name: promise.serialize() for name, (promise, _) in genuine.items()}
    tensor = handles["tensor"]
    f = fields(tensor)
    prefix = "dtorch-promise:1:network:"
    after_address = tensor.index(f["consumer"]) - 1  # the ':' before the ids
    port = str(store.port)
    bad_port = refused_port()

    def with_fields(type_name="tensor", host_port=address, consumer=f["consumer"],
                    pair=f["pair"], options=""):
        return f"{prefix}{type_name}:{host_port}:{consumer}:{pair}{options}"

    # (class, text, what it must give: "parse", "invalid" (InvalidHandleError at use), "use" (a
    # dtorch error at use), "noop" (names no pair in flight: a set is a no-op))
    cases = []
    for name, handle in handles.items():
        cls = "VoidPromise" if name == "void" else "TensorPromise"
        start = handle.index(address) + len(address) + 1
        for k in range(len(handle)):  # truncations
            cases.append((cls, handle[:k], "parse-or-invalid"))
        # Single-character changes of the ids and options (those of the address: below).
        for text in single_character_variants(handle, start, len(handle)):
            cases.append((cls, text, "any"))
    consumer, pair = f["consumer"], f["pair"]
    other_id = "0123456789abcdef" * 2
    cases += [
        # Valid forms naming the real pair with another consumer, type, options or address.
        ("TensorPromise", with_fields(consumer=other_id), "invalid"),
        ("TensorPromise", with_fields(options=":device=cpu"), "invalid"),
        ("TensorPromise", handles["cpu"][:-len(":device=cpu")], "invalid"),
        ("VoidPromise", with_fields(type_name="void"), "invalid"),
        ("TensorPromise", handles["void"].replace(":void:", ":tensor:"), "invalid"),
        ("TensorPromise", with_fields(host_port=f"localhost:{port}"), "invalid"),
        ("TensorPromise", with_fields(host_port=f"127.0.0.2:{port}"), "invalid"),
        ("TensorPromise", with_fields(host_port=f"[::1]:{port}"), "use"),  # (IPv6 may be off)
        # Pairs that do not exist on the real store: nothing to set.
        ("TensorPromise", with_fields(pair=other_id), "noop"),
        ("TensorPromise", with_fields(consumer=pair, pair=consumer), "noop"),
        # Stores that cannot be reached.
        ("TensorPromise", with_fields(host_port=f"127.0.0.1:{bad_port}"), "use"),
        ("TensorPromise", with_fields(host_port=f"[::1]:{bad_port}"), "use"),
        # Malformed.
        ("TensorPromise", "", "parse"), ("TensorPromise", ":" * 9, "parse"),
        ("TensorPromise", with_fields(host_port="127.0.0.1:0"), "parse"),
        ("TensorPromise", with_fields(host_port="127.0.0.1:65536"), "parse"),
        ("TensorPromise", with_fields(host_port="127.0.0.1:099"), "parse"),
        ("TensorPromise", with_fields(host_port=f"127.0.0.1:{port}0000"), "parse"),
        ("TensorPromise", with_fields(host_port=f"[::1:{port}"), "parse"),
        ("TensorPromise", with_fields(host_port=f"[127.0.0.1]:{port}"), "parse"),
        ("TensorPromise", with_fields(host_port=f"::1:{port}"), "parse"),
        ("TensorPromise", with_fields(host_port=f"h%st:{port}"), "parse"),
        ("TensorPromise", with_fields(host_port=f"{'a' * 254}:{port}"), "parse"),
        ("TensorPromise", with_fields(host_port=f":{port}"), "parse"),
        ("TensorPromise", with_fields(host_port="127.0.0.1"), "parse"),
        ("TensorPromise", with_fields(consumer=consumer.upper()), "parse"),
        ("TensorPromise", with_fields(pair=pair[:-1]), "parse"),
        ("TensorPromise", with_fields(pair=pair + "0"), "parse"),
        ("TensorPromise", with_fields(options=":"), "parse"),
        ("TensorPromise", with_fields(options=":device=cuda"), "parse"),
        ("TensorPromise", with_fields(options=":zero_copy"), "parse"),
        ("TensorPromise", with_fields(options=":ipc"), "parse"),
        ("TensorPromise", with_fields(options=":" + "a" * 33), "parse"),
        ("TensorPromise", with_fields(options=":device=cpu:device=cpu"), "parse"),
        ("VoidPromise", with_fields(type_name="void", options=":device=cpu"), "parse"),
        ("TensorPromise", tensor.replace("network", "file"), "parse"),
        ("TensorPromise", tensor.replace(":1:", ":2:", 1), "parse"),
        ("TensorPromise", tensor + "\x00", "parse"), ("TensorPromise", tensor + "\ud800", "parse"),
        ("TensorPromise", tensor + "é", "parse"), ("TensorPromise", " " + tensor, "parse"),
        ("TensorPromise", tensor.upper(), "parse"), ("TensorPromise", "x" * 513, "parse"),
        ("TensorPromise", prefix + "a" * 1_000_000, "parse"),
        ("TensorPromise", prefix + "tensor:" + ":".join(["x"] * 100), "parse"),
    ]
    # Changes of the address: those that still name a store only where it is the real one, as
    # 127.x.y.z on its port (another name for it), and a few of them: no host name (CI may not
    # answer DNS in time), no other port (some process of this host may listen there). (c10d
    # looks each new address up, even a numeric one, which a slow resolver makes take seconds.)
    suffix = tensor[after_address:]
    other_names = 0
    for text in single_character_variants(tensor, len(prefix) + len("tensor:"), after_address):
        if not text.endswith(suffix) or not text.startswith(prefix + "tensor:"):
            cases.append(("TensorPromise", text, "parse"))
            continue
        host_port = text[len(prefix) + len("tensor:"):len(text) - len(suffix)]
        if not re.fullmatch(r"(\[[0-9a-fA-F:.]*\]|[A-Za-z0-9._-]+):[1-9][0-9]{0,4}", host_port):
            cases.append(("TensorPromise", text, "parse"))
        elif re.fullmatch(rf"127\.[0-9]+\.[0-9]+\.[0-9]+:{port}", host_port) and other_names < 3:
            other_names += 1
            cases.append(("TensorPromise", text, "parse-or-invalid"))

    code = (f"import sys; sys.path.insert(0, {TESTS!r}); import file_workers; "
            f"file_workers.fuzz_from_serialized_main()")
    variants = [(cls, text) for cls, text, _ in cases]
    fuzzer = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = fuzzer.communicate(json.dumps(variants), timeout=90)
    except subprocess.TimeoutExpired:
        fuzzer.kill()
        out, err = fuzzer.communicate()
        pytest.fail(f"the fuzzer hung after {len(out.splitlines())} of {len(variants)} variants;"
                    f" stderr:\n{err[-3000:]}")
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    crashed_on = variants[len(results)] if len(results) < len(variants) else None
    assert fuzzer.returncode == 0 and not crashed_on, (
        f"the fuzzer ended with {fuzzer.returncode} at variant {crashed_on!r}; "
        f"stderr:\n{err[-3000:]}")

    real_pairs = {fields(handle)["pair"] for handle in handles.values()}
    wrong = []
    for (cls, text, expected), result in zip(cases, results):
        stage = result["stage"]
        parse_error = stage == "parse" and (result["value"] or result["type"])
        use_error = stage == "use" and result["dtorch"] and result["message"].startswith("dtorch")
        invalid = use_error and result["invalid_handle"]
        ok = {"parse": parse_error,
              "invalid": invalid,
              "use": use_error,
              "noop": stage == "noop",
              "parse-or-invalid": parse_error or invalid,
              "any": parse_error or use_error or stage == "noop"}[expected]
        # What names the real store: a no-op only for a pair that is not in flight, an error at
        # use only for the altered handle it is (any other error would mean it reached the pair).
        named = HANDLE.match(text)
        if named and int(named.group(2)) == store.port:
            if stage == "noop":
                ok = ok and named.group(4) not in real_pairs
            elif stage == "use" and named.group(4) in real_pairs:
                ok = ok and invalid
        if not ok or result["s"] > SLOW_VARIANT_S:
            wrong.append((expected, cls, text[:120], result["stage"], result["s"],
                          result.get("cls"), result.get("message", "")[:200]))
    assert not wrong, "\n".join(map(repr, wrong[:10]))
    # None of that completed or blocked the real pairs: their producer still sets them.
    for name, (promise, future) in genuine.items():
        assert not future.is_ready(), name
        if name == "void":
            producer.call(network_workers.set_void, handles[name])
            assert future.wait(WAIT_MS) is None
        else:
            producer.call(network_workers.set_value, handles[name], torch.full((2,), 5.0))
            assert torch.equal(future.wait(WAIT_MS), torch.full((2,), 5.0))


# ---- options ------------------------------------------------------------------------------------


def elapsed_raising(call, error, match):
    """Runs call(); it must raise `error` matching `match`: returns the seconds it took."""
    started = time.monotonic()
    with pytest.raises(error, match=match):
        call()
    return time.monotonic() - started


@pytest.mark.timeout(60)
def test_a_listener_that_never_answers_fails_every_call_within_the_store_timeout(
        store, short_store_timeout):
    """A socket that accepts connections (the kernel does) and never answers: a new promise
    there, and a producer's handle naming it, fail with BrokenPromiseError naming the store."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    where = f"127.0.0.1:{silent.getsockname()[1]}"
    try:
        took = elapsed_raising(lambda: dtorch_ops.TensorPromise(kind="network", store=where),
                               errors.BrokenPromiseError, rf"{where}.*did not answer within 1000")
        assert took <= SILENT_STORE_FAILS_WITHIN_S, took
        # A real handle with the silent address instead of the store's (the tampering case of an
        # untrusted handle): deserializing it, then setting it, end in bounded time.
        promise, future = network_pair(store)
        forged = promise.serialize().replace(f"127.0.0.1:{store.port}", where)
        started = time.monotonic()
        holder = dtorch_ops.TensorPromise.from_serialized(forged)
        with pytest.raises(errors.BrokenPromiseError, match=rf"{where}.*did not answer"):
            holder.set_value(torch.ones(1))
        assert time.monotonic() - started <= 2 * SILENT_STORE_FAILS_WITHIN_S
        assert not future.done()  # (the real pair is untouched)
        promise.set_value(torch.ones(2))
        assert torch.equal(future.wait(timeout=10), torch.ones(2))
    finally:
        silent.close()


@pytest.mark.timeout(90)
def test_a_frozen_store_fails_calls_and_pairs_within_the_store_timeout(short_store_timeout):
    """The store's server SIGSTOPped: a connected producer's next set, a new promise and the
    futures waiting on it fail within the timeout; a process exits within config.exit_timeout_s."""
    server = subprocess.Popen(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {TESTS!r}); import network_workers;"
                               f" network_workers.store_server_main()"],
        stdout=subprocess.PIPE, text=True)
    processes_to_kill = [None]
    try:
        where = f"127.0.0.1:{int(server.stdout.readline())}"
        first, first_future = network_pair(where)
        second, second_future = network_pair(where)
        first.set_value(torch.ones(3))  # (the connection works)
        assert torch.equal(first_future.wait(timeout=10), torch.ones(3))
        # A process with a pair in flight on the store, to exit once it is frozen.
        exiting = processes_to_kill[0] = subprocess.Popen(
            [sys.executable, "-c",
             "import sys, dtorch_ops\n"
             f"dtorch_ops.config.network_store_timeout_s = {STORE_TIMEOUT_S}\n"
             f"p = dtorch_ops.TensorPromise(kind='network', store={where!r}); f = p.get_future()\n"
             "print('ready', flush=True); sys.stdin.readline()\n"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert exiting.stdout.readline().strip() == "ready"
        server.send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        took = elapsed_raising(lambda: second.set_value(torch.ones(1)), errors.BrokenPromiseError,
                               rf"{where}")
        assert took <= SILENT_STORE_FAILS_WITHIN_S, took
        with pytest.raises(errors.BrokenPromiseError, match=rf"{where}"):
            second_future.wait(timeout=30)
        assert time.monotonic() - frozen_at <= 2 * SILENT_STORE_FAILS_WITHIN_S
        new_took = elapsed_raising(lambda: network_pair(where), errors.BrokenPromiseError,
                                   rf"{where} cannot be reached.*did not answer within 1000")
        assert new_took <= SILENT_STORE_FAILS_WITHIN_S, new_took
        started = time.monotonic()
        exiting.stdin.close()  # it exits
        assert exiting.wait(30) == 0
        exit_took = time.monotonic() - started
        # (Its exit: config.exit_timeout_s, 1 s, at most, plus an interpreter's teardown.)
        assert exit_took <= 1.0 + 3.0, exit_took
        print(f"frozen store: set failed after {took:.2f} s, a new promise after {new_took:.2f} s,"
              f" exit took {exit_took:.2f} s")
    finally:
        server.send_signal(signal.SIGCONT)
        for process in [server] + [p for p in processes_to_kill if p is not None]:
            process.kill()
            process.wait(10)


def test_bad_options_are_refused_with_the_right_error(store, address):
    for bad_store in (dist.HashStore(), 5, None, b"127.0.0.1:1"):
        with pytest.raises(TypeError, match="store= takes a torch.distributed.TCPStore"):
            dtorch_ops.TensorPromise(kind="network", store=bad_store)
    with pytest.raises(TypeError, match="needs store="):
        dtorch_ops.TensorPromise(kind="network")
    with pytest.raises(TypeError, match="zero_copy"):
        dtorch_ops.TensorPromise(kind="network", store=store, zero_copy=True)
    with pytest.raises(TypeError, match="device"):
        dtorch_ops.VoidPromise(kind="network", store=store, device="cpu")
    with pytest.raises(ValueError, match="device='cpu'"):
        dtorch_ops.TensorPromise(kind="network", store=store, device="cuda")
    for bad_address in ("nohost", "h:0", "h:65536", "h:0x10", "[::1:80", "::1:80", " h:1", "h:1 ",
                        "a/b:1", ""):
        with pytest.raises(ValueError, match="host:port"):
            dtorch_ops.TensorPromise(kind="network", store=bad_address)
    with pytest.raises(ValueError, match="device=cpu"):
        torch.classes.dtorch.TensorPromise(f"network://{address}?device=cuda")
    with pytest.raises(ValueError):
        torch.classes.dtorch.VoidPromise(f"network://{address}?device=cpu")
    # A store nobody serves: refused at once (no retrying for c10d's connection timeout).
    started = time.monotonic()
    with pytest.raises(errors.BrokenPromiseError, match="cannot be reached"):
        dtorch_ops.TensorPromise(kind="network", store=f"127.0.0.1:{refused_port()}")
    assert time.monotonic() - started < 2.0
    # Configuration.
    with pytest.raises(ValueError, match=">= 1000 ms"):
        dtorch_ops.config.network_heartbeat_timeout_s = 0.5
    with pytest.raises(ValueError, match=">= 100 ms"):
        dtorch_ops.config.network_store_timeout_s = 0.05
    assert dtorch_ops.config.network_store_timeout_s == 30.0
    # A value the codec refuses names no other kind.
    promise, future = network_pair(store)
    with pytest.raises(RuntimeError, match="a cross-process promise carries values") as info:
        promise.set_value(torch.ones(2, device="meta"))
    assert "file" not in str(info.value)
    assert dtorch_ops.config.network_heartbeat_timeout_s == 5.0


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
def test_a_producer_in_another_network_namespace(two_namespaces):
    (consumer_ns, consumer_host), (producer_ns, _) = two_namespaces
    prologue = f"import sys; sys.path.insert(0, {TESTS!r}); import network_workers; "

    def start(namespace, call):
        return subprocess.Popen(["ip", "netns", "exec", namespace, sys.executable, "-c",
                                 prologue + call], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    consumer = start(consumer_ns, f"network_workers.netns_consumer_main({consumer_host!r})")
    producer = start(producer_ns, "network_workers.netns_producer_main()")  # (imports meanwhile)
    try:
        handle = consumer.stdout.readline().strip()
        assert fields_of_any_host(handle)["host"] == consumer_host, handle
        out, err = producer.communicate(handle + "\n", timeout=45)
        assert producer.returncode == 0 and out.strip() == "set", err[-2000:]
        out, err = consumer.communicate(timeout=45)
        assert json.loads(out) == {"value": list(map(float, range(10)))}, (out, err[-2000:])
    finally:
        for process in (consumer, producer):
            process.kill()
            process.wait(10)


def fields_of_any_host(handle: str) -> dict:
    parts = handle.split(":")
    return {"type": parts[3], "host": parts[4], "port": int(parts[5])}


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
