"""The network kind's point-to-point links (csrc/core/kinds/network/links.h): a value travels
over a 2-rank Gloo group per (consumer process, producer process) when both ends can. What both
paths share runs on both in test_network.py and test_network_failures.py (their `path` fixture);
here, what only the links have: one link and one receiving thread per producer process, idle
links closing, a producer that forces the store path (and a TorchScript one) interoperating with
a consumer that takes links, a peer that sends malformed frames or dies mid-value. (A hung producer on another host
has its link aborted when its heartbeat stops; on one host a stopped process is alive by its pid,
as on the store path, so that path is not exercised here.) The test process is the consumer.
"""
import os
import threading
import time

import pytest
import torch

import dtorch_ops
import network_workers
import pair_peers
from conftest import WAIT_MS, wait_until
from dtorch_ops import errors
from network_fixtures import (fields, links_in, network_pair, network_thread_bound, setting,
                              started_processes, started_processes_now)
from network_fixtures import address, producer, store  # noqa: F401
from network_fixtures import nothing_left_in_the_store  # noqa: F401

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def processes():
    """The producer, and one that a test may stop or reconfigure (made anew for each test)."""
    yield from started_processes(2)


@pytest.fixture
def spare(processes):
    """processes[1] with the default settings, started anew where an earlier test ended it."""
    if not processes[1].process.is_alive():
        processes[1] = started_processes_now(1)[0]
    processes[1].call(pair_peers.configure_links, 1, 60.0, 5.0)
    return processes[1]


@pytest.fixture(autouse=True)
def links_on():
    """This process's pairs take links (their handles say "g")."""
    yield from setting("network_pair_groups", 1)


def test_values_of_every_size_travel_over_one_link_per_producer_process(store, producer):
    values = [torch.arange(10.0), torch.ones(0), torch.randn(3, 4).t(),  # (non-contiguous)
              torch.arange(1 << 16, dtype=torch.int64), torch.rand(16 << 20)]  # 64 MiB
    pairs = [network_pair(store) for _ in values]
    handles = [p.serialize() for p, _ in pairs]
    assert all(fields(h) for h in handles) and all(":v2:g:" in h for h in handles)
    producer_links = producer.call(pair_peers.set_values, handles, values)
    for (_, future), value in zip(pairs, values):
        assert torch.equal(future.wait(WAIT_MS), value)
    assert producer_links["out"] == 1  # one link to this process, for every value
    assert links_in() == 1  # one receiving thread here, for that producer process
    assert dtorch_ops.library_threads()["network"] <= network_thread_bound()


def test_void_values_and_errors_travel_over_the_link(store, producer):
    void, void_future = network_pair(store, dtorch_ops.VoidPromise)
    failing, failing_future = network_pair(store)
    producer.call(network_workers.set_void, void.serialize())
    producer.call(network_workers.set_exception, failing.serialize(), "it went wrong")
    assert void_future.wait(WAIT_MS) is None
    with pytest.raises(Exception, match="it went wrong"):
        failing_future.wait(WAIT_MS)
    assert producer.call(pair_peers.links)["out"] == 1


def test_an_idle_link_closes_and_the_next_value_makes_a_new_one(store, spare):
    spare.call(pair_peers.configure_links, None, 0.5)
    first, first_future = network_pair(store)
    spare.call(pair_peers.set_values, [first.serialize()], [torch.ones(3)])
    assert torch.equal(first_future.wait(WAIT_MS), torch.ones(3))
    before = links_in()
    assert spare.call(pair_peers.wait_for_no_link_out, 5.0)["out"] == 0
    # Its receiving thread here ended with it (the producer's goodbye frame).
    assert wait_until(lambda: links_in() == before - 1, 5.0), links_in()
    second, second_future = network_pair(store)
    assert spare.call(pair_peers.set_values, [second.serialize()], [torch.zeros(2)])["out"] == 1
    assert torch.equal(second_future.wait(WAIT_MS), torch.zeros(2))


def test_a_producer_on_the_store_path_and_a_torchscript_one_interoperate(store, spare):
    # The handle says "g"; a producer with network_pair_groups = 0 (as one without Gloo, or a
    # C++-only process) sends through the store; the claim is the store's for both paths.
    spare.call(pair_peers.configure_links, None, 0.1)  # (its link of an earlier test goes)
    assert spare.call(pair_peers.wait_for_no_link_out, 5.0)["out"] == 0
    spare.call(pair_peers.configure_links, 0, 60.0)
    promise, future = network_pair(store)
    scripted, scripted_future = network_pair(store)
    assert ":v2:g:" in promise.serialize()
    spare.call(pair_peers.set_values, [promise.serialize()], [torch.arange(4.0)])
    assert spare.call(network_workers.script_produce, scripted.serialize(), torch.ones(2)).tolist() \
        == [3.0, 3.0]
    assert torch.equal(future.wait(WAIT_MS), torch.arange(4.0))
    assert torch.equal(scripted_future.wait(WAIT_MS), torch.full((2,), 2.0))
    assert spare.call(pair_peers.links)["out"] == 0
    # A second set, on the other path, is refused.
    with pytest.raises(errors.PromiseAlreadySatisfiedError):
        dtorch_ops.TensorPromise.from_serialized(promise.serialize()).set_value(torch.ones(1))


def _forged(store, spare, frames):
    """A genuine pair, and a peer that opens a link to this process and sends `frames`."""
    promise, future = network_pair(store)
    f = fields(promise.serialize())
    link, peer = os.urandom(16).hex(), os.urandom(16).hex()
    built = [frame(f["pair"], peer) if callable(frame) else frame for frame in frames]
    return promise, future, spare.call(pair_peers.send_on_a_forged_link,
                                       f"127.0.0.1:{store.port}", f["consumer"], link, peer,
                                       built)


@pytest.mark.parametrize("frame", [
    b"junk" * 16,  # no frame
    pair_peers.frame(b"Q", b""),  # a frame type there is none of
    lambda pair, peer: pair_peers.frame(b"V", pair_peers.value_message(pair, "0" * 32, b"", b"")),
], ids=["junk", "unknown-type", "another-producer"])
def test_a_malformed_frame_closes_only_its_link(store, producer, spare, frame):
    promise, future, sent = _forged(store, spare, [frame, frame])
    assert sent == 1  # (the consumer closed the link after the first)
    assert wait_until(lambda: links_in() <= 1, 5.0), links_in()  # (the producer's, at most)
    assert not future.is_ready()
    producer.call(pair_peers.set_values, [promise.serialize()], [torch.ones(2)])
    assert torch.equal(future.wait(WAIT_MS), torch.ones(2))


def test_an_oversized_or_lying_header_fails_its_pair_not_the_process(store, spare):
    header, _ = dtorch_ops._C.encode_tensor_for_testing(torch.ones(4))
    frames = [lambda pair, peer: pair_peers.payload_frame(pair, peer, b"bogus", 1 << 60)]
    _, future, _ = _forged(store, spare, frames)
    with pytest.raises(errors.InvalidHandleError, match="corrupt"):
        future.wait(WAIT_MS)
    # A header that implies 16 bytes, and a frame that says 1 TiB follow.
    frames = [lambda pair, peer: pair_peers.payload_frame(pair, peer, header, 1 << 40)]
    _, future, _ = _forged(store, spare, frames)
    with pytest.raises(errors.InvalidHandleError, match="corrupt"):
        future.wait(WAIT_MS)


def test_a_peer_gone_mid_value_breaks_the_pair_within_milliseconds(store, spare):
    # The peer announces a 4 MiB payload and closes its end before a byte of it (as a process
    # killed mid-send does: its sockets close).
    header, _ = dtorch_ops._C.encode_tensor_for_testing(torch.ones(1 << 20))
    frames = [lambda pair, peer: pair_peers.payload_frame(pair, peer, header, 4 << 20)]
    _, future, sent = _forged(store, spare, frames)
    closed_at = time.monotonic()
    assert sent == 1
    with pytest.raises(errors.BrokenPromiseError, match="link failed"):
        future.wait(WAIT_MS)
    assert time.monotonic() - closed_at < 1.0


@pytest.fixture(scope="module")
def eight():
    """Eight producer processes, for the concurrent test."""
    yield from started_processes(8)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("pair_groups", [0, 1], ids=["store", "pairs"])
def test_eight_producers_fill_one_consumer_concurrently(store, eight, pair_groups):
    dtorch_ops.config.network_pair_groups = pair_groups  # (links_on restores it)
    per_producer = 10
    pairs = [[network_pair(store) for _ in range(per_producer)] for _ in eight]
    values = [[torch.full((1 << 18,), float(100 * p + i)) for i in range(per_producer)]  # 1 MiB
              for p in range(len(eight))]
    results = [None] * len(eight)

    def produce(p):
        results[p] = eight[p].call(pair_peers.set_values,
                                   [promise.serialize() for promise, _ in pairs[p]], values[p])

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(len(eight))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for p, row in enumerate(pairs):
        for i, (_, future) in enumerate(row):
            assert torch.equal(future.wait(WAIT_MS), values[p][i]), (p, i)
    assert all(r is not None for r in results), results
    # One link per producer process on the links' path (none on the store's), each process's
    # values over its own.
    assert all(r["out"] == pair_groups for r in results), results
    if pair_groups:
        assert links_in() >= len(eight)
    assert dtorch_ops.library_threads()["network"] <= network_thread_bound()
