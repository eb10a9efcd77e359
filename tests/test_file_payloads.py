"""File promises reuse their payload segments (csrc/core/kinds/file/payload_pool.h): a producer process
writes each value into a segment that it and the consumer keep mapped (and unlinked) from the
first value on, once the consumer's view of the previous value in it is gone.

Covered: reuse (nothing named in /dev/shm, mappings bounded), a held value never overwritten,
churn (10,000 values of mixed sizes), a producer killed while copying into a reused segment,
idle release by both processes, release when the consumer dies.

The producer is a forked child (file_workers.serve_values) per test; nothing of either process
may be left in /dev/shm after a test (the autouse fixture).
"""
import collections
import gc
import os
import random
import shutil
import time

import pytest
import torch

import dtorch_ops
import file_workers
from conftest import WAIT_MS
from dtorch_ops import errors
from file_failure_helpers import (CLEANUP_S, DEATH_NOTICED_S, FORK, Child, names_owned_by,
                                  shm_names, wait_until)

pytestmark = pytest.mark.timeout(120)

# config.file_payload_idle_s in both processes: nothing is released during a test, unless it
# says otherwise.
IDLE_S = 60.0
POOLED_PER_CLASS = 4  # payload::kPooledPerClass


def dtorch_mappings(pid: int) -> int:
    """Mappings of payload segments in process `pid` (file_workers.payload_mappings)."""
    with open(f"/proc/{pid}/maps") as maps:
        return file_workers.payload_mappings(maps)


def kept() -> dict:
    return file_workers.kept_payloads()


def nothing_kept() -> bool:
    return kept()["received"] == 0 and kept()["produced"] == 0


class Server(Child):
    """A forked producer (file_workers.serve_values)."""

    def __init__(self):
        super().__init__(FORK, file_workers.serve_values)
        self.set_idle(IDLE_S)

    def request(self, *message):
        self.conn.send(message)
        return self.recv()

    def set(self, values):
        """values: [(promise, numel, fill)]; returns once all are set."""
        assert self.request("set", [(p.serialize(), n, f) for p, n, f in values]) == \
            ("done", len(values))

    def kept(self) -> tuple:
        """(kept_payloads(), library_threads(), dtorch mappings) of the producer."""
        return self.request("kept")

    def set_idle(self, seconds: float) -> None:
        assert self.request("idle", seconds) == "ok"

    def close(self) -> None:
        if self.process.exitcode is None:
            self.conn.send(None)
            self.join()


@pytest.fixture(autouse=True)
def payload_setup():
    """Before the test, nothing kept here (what earlier tests kept is released), then IDLE_S;
    after it, nothing of this process in /dev/shm."""
    saved = dtorch_ops.config.file_payload_idle_s
    dtorch_ops.config.file_payload_idle_s = 0.0
    gc.collect()
    assert wait_until(nothing_kept, 10.0), kept()
    dtorch_ops.config.file_payload_idle_s = IDLE_S
    before = shm_names()
    yield
    dtorch_ops.config.file_payload_idle_s = saved
    gc.collect()
    doorbell = {dtorch_ops._C.diagnostics()["doorbell"]["doorbell_segment"]}
    assert wait_until(lambda: not names_owned_by({os.getpid()}, shm_names() - before - doorbell),
                      CLEANUP_S)


@pytest.fixture
def server():
    with Server() as process:
        yield process
        process.close()


def file_pair():
    promise = dtorch_ops.TensorPromise(kind="file")
    return promise, promise.get_future()


def named_payloads() -> set:
    """Segments named for this process in /dev/shm, other than its doorbell."""
    doorbell = {dtorch_ops._C.diagnostics()["doorbell"]["doorbell_segment"]}
    return names_owned_by({os.getpid()}, shm_names()) - doorbell


def test_values_reuse_one_payload_segment(server):
    """Value after value of one size, each dropped before the next: one segment, mapped once by
    each side, named only until the consumer first maps it."""
    maps_before = dtorch_mappings(os.getpid())
    producer_maps_before = server.kept()[2]  # (what the fork inherited)
    for i in range(50):
        promise, future = file_pair()
        server.set([(promise, 1000, i)])
        value = future.wait(WAIT_MS)
        assert torch.equal(value, torch.full((1000,), float(i)))
        del value, promise, future
        assert not named_payloads()
    assert kept() == {"produced": 0, "received": 1, "produced_bytes": 0,
                      "received_bytes": 64 << 10}
    producer_kept, _, producer_maps = server.kept()
    assert producer_kept["produced"] == 1 and producer_kept["received"] == 0
    # The payload segment: the promises' control segments are gone.
    assert producer_maps - producer_maps_before == 1
    assert dtorch_mappings(os.getpid()) - maps_before == 1


def test_a_held_value_is_never_overwritten(server):
    """Values the consumer holds keep their segments: later values of that size go to others
    (at most POOLED_PER_CLASS kept, then one-off segments), and every held value stays intact."""
    numel = 50_000
    held = []
    for i in range(12):
        promise, future = file_pair()
        server.set([(promise, numel, i)])
        value = future.wait(WAIT_MS)
        if i % 2 == 0:
            held.append((i, value))  # alive while the next values arrive
        del value
        assert kept()["received"] <= POOLED_PER_CLASS
    for i, value in held:
        assert torch.equal(value, torch.full((numel,), float(i))), i
    assert kept()["received"] == POOLED_PER_CLASS
    del held
    gc.collect()
    # Freed: the kept segments serve the next values again; no new one is made.
    for i in range(8):
        promise, future = file_pair()
        server.set([(promise, numel, 100 + i)])
        assert torch.equal(future.wait(WAIT_MS), torch.full((numel,), 100.0 + i))
        assert kept()["received"] == POOLED_PER_CLASS
    assert server.kept()[0]["produced"] == POOLED_PER_CLASS


@pytest.mark.timeout(180)
def test_reuse_under_churn_10000_values_of_mixed_sizes(server):
    """10,000 values of sizes from 4 B to 1.2 MB, set by the producer while the consumer takes
    them (batches of 200 in flight); the consumer keeps the last two values alive and every
    1000th to the end. Every value is right (spot-checked as it comes, fully for the held ones
    at the end); the segments kept and mapped by either process stay bounded; nothing stays
    named in /dev/shm."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    sizes = [1, 300, 4096, 70_000, 300_000]  # float32 elements: three payload size classes
    window = collections.deque(maxlen=2)
    kept_to_end = []
    most_received = most_produced = most_maps = most_producer_maps = 0
    total, batch = 10_000, 200
    for start in range(0, total, batch):
        pairs = [file_pair() for _ in range(batch)]
        numels = [rng.choice(sizes) for _ in range(batch)]
        server.conn.send(("set", [(promise.serialize(), numel, start + k)
                                  for k, ((promise, _), numel) in enumerate(zip(pairs, numels))]))
        for k, ((promise, future), numel) in enumerate(zip(pairs, numels)):
            i = start + k
            value = future.wait(WAIT_MS)
            assert value.shape == (numel,) and value[0] == i and value[-1] == i, (seed, i)
            if i % 50 == 0:
                assert torch.equal(value, torch.full((numel,), float(i))), (seed, i)
            window.append(value)
            if i % 1000 == 0:
                kept_to_end.append((i, value))
            del value
        assert server.recv() == ("done", batch)
        del pairs, promise, future
        # Bounded: per size class at most POOLED_PER_CLASS kept; the rest are one-off segments
        # of held values (mapped while held).
        held = len(window) + len(kept_to_end)
        # (A held value's segment stays mapped while held, also once its producer dropped it.)
        most_received = max(most_received, kept()["received"] - held)
        most_maps = max(most_maps, dtorch_mappings(os.getpid()) - held)
        producer_kept, _, producer_maps = server.kept()
        most_produced = max(most_produced, producer_kept["produced"])
        most_producer_maps = max(most_producer_maps, producer_maps)
        assert not named_payloads(), seed
    assert most_received <= 3 * POOLED_PER_CLASS, (seed, most_received)
    assert most_produced <= 3 * POOLED_PER_CLASS, (seed, most_produced)
    assert most_maps <= 3 * POOLED_PER_CLASS, (seed, most_maps)
    assert most_producer_maps <= 3 * POOLED_PER_CLASS, (seed, most_producer_maps)
    for i, value in kept_to_end:
        assert torch.equal(value, torch.full(value.shape, float(i))), (seed, i)


@pytest.mark.parametrize("attempt", range(3))
def test_producer_killed_while_copying_into_a_reused_segment(attempt):
    """A 128 MiB value, taken and dropped (its segment mapped on both sides and free), then the
    next one, whose producer is SIGKILLed at a random moment of copying it into that segment
    (which takes 10-15 ms here): the future yields the value or fails with "producer died"; the
    consumer then drops the dead producer's segment, and nothing is left in /dev/shm."""
    if shutil.disk_usage("/dev/shm").free < 512 << 20:
        pytest.skip("/dev/shm has no room for two 128 MiB values")
    numel = 32 << 20
    seed = random.randrange(2**32)
    with Server() as child:
        first, first_future = file_pair()
        child.set([(first, numel, 1)])
        assert first_future.wait(WAIT_MS)[-1] == 1
        del first, first_future
        gc.collect()
        assert kept()["received"] == 1
        promise, future = file_pair()
        child.conn.send(("set_reporting", [(promise.serialize(), numel, 2)]))
        assert child.recv() == ("start", 0)
        time.sleep(random.Random(seed).uniform(0.0005, 0.010))
        child.kill()
    try:
        value = future.wait(WAIT_MS)
    except errors.BrokenPromiseError as e:
        assert f"producer died (pid {child.pid})" in str(e), (seed, str(e))
    else:
        assert bool((value == 2).all()), seed
        del value
    del promise, future
    gc.collect()
    assert wait_until(lambda: kept()["received"] == 0, DEATH_NOTICED_S), (seed, kept())
    assert wait_until(lambda: dtorch_mappings(os.getpid()) == 0, CLEANUP_S)


def test_idle_payload_segments_are_released_by_both_processes(server):
    """Segments unused for config.file_payload_idle_s are released by producer and consumer
    (mappings gone); then the producer's watcher thread exits too."""
    dtorch_ops.config.file_payload_idle_s = 0.5
    server.set_idle(0.5)
    producer_maps_before = server.kept()[2]  # (what the fork inherited)
    for numel in (1000, 1000, 300_000):
        promise, future = file_pair()
        server.set([(promise, numel, 7)])
        assert future.wait(WAIT_MS)[0] == 7
        del promise, future
    assert kept()["received"] == 2
    producer_kept, threads, _ = server.kept()
    assert producer_kept["produced"] == 2 and threads["doorbell"] == 1
    assert wait_until(nothing_kept, 3.5), kept()
    assert wait_until(lambda: server.kept()[0]["produced"] == 0, 3.5), server.kept()
    assert wait_until(lambda: dtorch_mappings(os.getpid()) == 0, CLEANUP_S)
    # The watcher goes 2 s after its last pending pair, once nothing is kept.
    assert wait_until(lambda: server.kept()[1]["doorbell"] == 0, 5.0), server.kept()
    assert server.kept()[2] == producer_maps_before


def test_producer_threads_share_the_segments_without_overwriting_a_view(server):
    """Four producer threads set 2000 values of one size at once for this consumer, which takes
    each as it comes and keeps the last three alive: every value is its own, whole."""
    numel = 2000
    pairs = [file_pair() for _ in range(2000)]
    server.conn.send(("set_threads", [(promise.serialize(), numel, i)
                                      for i, (promise, _) in enumerate(pairs)], 4))
    window = collections.deque(maxlen=3)
    for i, (_, future) in enumerate(pairs):
        value = future.wait(WAIT_MS)
        assert torch.equal(value, torch.full((numel,), float(i))), i
        window.append((i, value))
        for j, held in window:
            assert held[0] == j and held[-1] == j, (i, j)
        del value
    assert server.recv() == ("done", 2000)
    assert kept()["received"] <= POOLED_PER_CLASS


def test_a_forked_child_keeps_only_the_segments_its_views_need(server):
    """A fork of a consumer that keeps payload segments unmaps them in the child (which would
    keep them in memory for as long as it lives), except the one behind a value it inherited,
    which it can still read."""
    promise, future = file_pair()
    server.set([(promise, 300_000, 5)])
    held = future.wait(WAIT_MS)
    del promise, future  # (its control segment: mapped while a handle lives)
    for numel in (1000, 70_000):  # two more classes: kept, free
        other, other_future = file_pair()
        server.set([(other, numel, 6)])
        assert other_future.wait(WAIT_MS)[0] == 6
        del other, other_future
    assert kept()["received"] == 3
    with Child(FORK, file_workers.report_mappings_and_sum, held) as child:
        assert child.recv() == (1, 5.0 * 300_000)
        assert child.join() == 0
    assert torch.equal(held, torch.full((300_000,), 5.0))


def test_a_dead_consumers_segments_are_released_at_once():
    """This process produces for a consumer that then dies: the segment it kept for that
    consumer goes at the next liveness check, not after the idle time."""
    dtorch_ops.config.file_payload_idle_s = 60.0
    with Child(FORK, file_workers.consumer_taking_one_value) as consumer:
        promise = dtorch_ops.TensorPromise.from_serialized(consumer.recv())
        dtorch_ops.get_tensor(torch.ones(5000), promise)
        assert consumer.recv() == 5000.0
        assert kept()["produced"] == 1
        consumer.kill()
    del promise
    assert wait_until(lambda: kept()["produced"] == 0, DEATH_NOTICED_S), kept()
    assert wait_until(lambda: dtorch_mappings(os.getpid()) == 0, CLEANUP_S)
