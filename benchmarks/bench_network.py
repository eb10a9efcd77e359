"""The "network" kind across two processes of this host, over loopback (127.0.0.1): one-way
latency of a 4 KiB tensor and bandwidth at 64 MiB (QUICK: 16 MiB) on both of its paths (through
the store, and over the point-to-point link: a 2-rank Gloo group per pair of processes), beside
what moves the same bytes between the same two processes:

- raw TCPStore, the same store and bytes by hand: the producer `set`s the value (in 4 MiB chunks,
  under the store's 8 MiB limit, as ours chunks it), the consumer's blocking `get`s each chunk
  in turn (it may read chunk i while chunk i+1 is being set: the best a user does by hand); and,
  for 4 KiB, `queue_push` / blocking `queue_pop`, what our one-message path uses. Each starts
  from the producer's tensor (its bytes taken inside the timing, as ours copies them) and ends
  with the bytes in the consumer's hands (no tensor built: ours builds one);
- Gloo send/recv (torch.distributed, backend gloo, world size 2 on a TCPStore of its own), the
  engine the point-to-point path runs on: its targets (issue 33) are 4 KiB one-way <= 1.5x Gloo,
  64 MiB bandwidth >= 0.8x Gloo, and the producer's set_value <= 1.5x a Gloo round trip (send,
  then the echo's recv). The store path's ratio to Gloo is reported, not judged. Report only:
  the time to the first value over a new link (its Gloo group made on the way).

The main figures are the store path against raw TCPStore, report only: every value of ours is a
fresh pair, so its 4 KiB latency holds the producer's claim (a compare_set, which also checks its
handle against the pair) before the value's message (two round trips to the store where the raw
anchors make one), and the consumer's watcher thread then wakes the waiter; at 64 MiB, ours sets
every chunk before its message and the consumer reads them only then (the raw anchor overlaps
the two), and checksums the bytes. The ratio says what the protocol costs over the store's own
calls. No target: the issue set none for the store path. The link's figures: the same cases with
the consumer's pairs made on the link path (their own section), judged against Gloo.

This process is the consumer and hosts the stores' servers (as rank 0 does in a job); one
persistent producer process (spawn), started once, serves every case. One-way time = the
consumer's time.perf_counter_ns() just after it has the value in hand minus the producer's just
before it sends. On Linux perf_counter is clock_gettime(CLOCK_MONOTONIC), one system-wide clock,
so the two processes' stamps compare: checked (time.get_clock_info in both, and every one-way
time must come out positive), else the benchmark refuses to run. Paced as bench_file: the
consumer says "go" over a pipe and blocks; the producer sleeps ~200 us before it stamps, so the
consumer is blocked in its wait when the value comes. Cases interleaved (rounds of batches for
latency, one value per case per repeat for bandwidth); medians. Timing is reported, never
asserted. Every wait is bounded and the producer is stopped (killed if need be) at the end.
"""
import datetime
import gc
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

import dtorch_ops
from bench_file import _die_with_parent, _p90, _recv
from common import Anchor, Figure, Report, Target

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import forged_messages  # noqa: E402  (the wire format as a forger writes it; shared with the tests)

SECTION = "Network kind across processes (store path, loopback)"
OURS = "network kind (store path), wait()"  # our series in both figures (and the plot)
PAIRS = "network kind (point-to-point link), wait()"
P2P_SECTION = "Network kind across processes (point-to-point link, loopback)"
RAW_SET = "TCPStore set + blocking get (4 MiB chunks)"
RAW_QUEUE = "TCPStore queue_push + blocking queue_pop"
GLOO = "Gloo send/recv"
GLOO_RTT = "Gloo round trip (send, then the echo's recv)"
HOST = "127.0.0.1"
WAIT_S = 30.0  # bound on every wait of the consumer and the producer
MiB = 1 << 20
CHUNK_BYTES = 4 * MiB  # the raw anchor's chunks (ours: kChunkBytes, the same)
LATENCY_BYTES = 4096
PACE_S = 200e-6  # the producer's sleep between "go" and its stamp
CLOCK = "clock_gettime(CLOCK_MONOTONIC)"  # what perf_counter must be in both processes
CASES = {"network": OURS, "pairs": PAIRS, "set": RAW_SET, "queue": RAW_QUEUE, "gloo": GLOO,
         "gloo_rtt": GLOO_RTT}
OF_OURS = ("network", "pairs")  # our two paths (the consumer's config.network_pair_groups)


def _clock():
    return time.get_clock_info("perf_counter").implementation


def _store(port, is_master):
    return dist.TCPStore(HOST, port, is_master=is_master, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=WAIT_S))


def _gloo(store, rank):
    """A 2-process Gloo group on `store` over loopback, not the default group (nothing global)."""
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
    options._timeout = datetime.timedelta(seconds=WAIT_S)
    return dist.ProcessGroupGloo(store, rank, 2, options)


def _chunks(nbytes):
    return [(at, min(nbytes, at + CHUNK_BYTES)) for at in range(0, nbytes, CHUNK_BYTES)]


# ---- the producer process ----


def _producer(ctl, store_port, gloo_port):
    """ctl: duplex pipe to the consumer (commands, "go"s, answers)."""
    _die_with_parent()
    store = _store(store_port, False)
    group = _gloo(_store(gloo_port, False), 1)
    ctl.send(("ready", _clock()))
    promises = []
    while True:
        message = _recv(ctl, 600)
        command = message[0]
        if command == "stop":
            break
        if command == "promises":
            # Deserializing connects nothing: the producer attaches on first use, in get_tensor.
            promises = [dtorch_ops.TensorPromise.from_serialized(s) for s in message[1]]
            ctl.send(("ok",))
        elif command == "run":
            _, how, nbytes, count, prefix = message
            src = torch.full((nbytes,), 7, dtype=torch.uint8)  # touched once, here
            view = src.numpy()
            calls = []  # ns spent sending (get_tensor, the sets, the push, send().wait())
            stamps = []
            for i in range(count):
                if not ctl.poll(WAIT_S):
                    raise TimeoutError("no 'go' from the consumer")
                ctl.recv_bytes()
                time.sleep(PACE_S)
                stamp = time.perf_counter_ns()
                if how in OF_OURS:
                    dtorch_ops.get_tensor(src, promises[i])  # publishes before it returns
                    promises[i] = None
                elif how == "set":
                    for c, (lo, hi) in enumerate(_chunks(nbytes)):
                        store.set(f"{prefix}/{i}/{c}", view[lo:hi].tobytes())
                elif how == "queue":
                    store.queue_push(prefix, view.tobytes())
                elif how == "gloo":
                    group.send([src], 0, 0).wait()
                else:  # gloo_rtt
                    group.send([src], 0, 0).wait()
                    group.recv([src], 0, 1).wait()
                calls.append(time.perf_counter_ns() - stamp)
                stamps.append(stamp)
            promises = []
            del src, view
            ctl.send(("done", calls, stamps))
    del group, store


class _Producer:
    def __init__(self, store_port, gloo_store):
        ctx = tmp.get_context("spawn")
        self.ctl, child_ctl = ctx.Pipe()
        self.process = ctx.Process(target=_producer, args=(child_ctl, store_port, gloo_store.port),
                                   daemon=True)
        self.process.start()
        child_ctl.close()
        self.group = None
        try:
            self.group = _gloo(gloo_store, 0)  # meets the producer's half
            theirs = self._answer("ready")[1]
        except BaseException:
            self.close()
            raise
        if theirs != CLOCK or _clock() != CLOCK:
            self.close()
            raise RuntimeError(f"one-way times need perf_counter to be {CLOCK} in both processes "
                               f"(the producer's: {theirs}, ours: {_clock()})")

    def ship(self, serialized):
        self.ctl.send(("promises", serialized))
        self._answer("ok")

    def start(self, how, nbytes, count, prefix):
        self.ctl.send(("run", how, nbytes, count, prefix))

    def go(self):
        self.ctl.send_bytes(b"g")

    def _answer(self, expected):
        if not self.process.is_alive() and not self.ctl.poll(0):
            raise RuntimeError(f"the producer exited (code {self.process.exitcode})")
        answer = _recv(self.ctl)
        assert answer[0] == expected, answer
        return answer

    def done(self):
        _, calls, stamps = self._answer("done")
        return calls, stamps

    def close(self):
        try:
            if self.process.is_alive():
                self.ctl.send(("stop",))
        except OSError:
            pass
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        self.group = None  # after the producer's half is gone


# ---- the consumer's side of one batch ----

_batches = 0
_OWN_ID = [None]  # this process's store id, once it made a network pair
_SERVERS = []  # the stores this process hosted for the kind, kept up until the interpreter exits


def _batch(producer, store, how, nbytes, count, before_go=None, flood=0):
    """count one-way times (ns) of values of nbytes, and the ns the producer spent sending each;
    how: network, set, queue or gloo. before_go(consumer, pair ids): called before each "go"
    (network); flood: junk messages a forger process pushes to the consumer's queue meanwhile,
    evenly over the batch (network)."""
    global _batches
    _batches += 1
    prefix = f"bench/{how}/{_batches}"
    futures = promises = None
    if how in OF_OURS:
        dtorch_ops.config.network_pair_groups = int(how == "pairs")  # (written in the handles)
        promises = [dtorch_ops.TensorPromise(kind="network", store=store) for _ in range(count)]
        dtorch_ops.config.network_pair_groups = 1
        futures = [p.get_future() for p in promises]
        serialized = [p.serialize() for p in promises]
        _OWN_ID[0] = serialized[0].split(":")[-2]  # this process's store id (see _beat_from_...)
        pair_ids = [s.split(":")[-1] for s in serialized]
        producer.ship(serialized)  # ahead of the timing
    forger = None
    if flood:
        started = tmp.get_context("spawn").Event()
        forger = tmp.get_context("spawn").Process(
            target=forged_messages.flood, daemon=True,
            args=(store.port, _OWN_ID[0], pair_ids, flood, count * 0.003, started))
        forger.start()
        if not started.wait(WAIT_S):
            raise RuntimeError("the forger did not start")
    buffer = torch.empty(nbytes, dtype=torch.uint8) if how.startswith("gloo") else None
    chunks = len(_chunks(nbytes))
    received = []  # the consumer's stamps
    producer.start(how, nbytes, count, prefix)
    for i in range(count):
        if before_go is not None:
            before_go(_OWN_ID[0], pair_ids)
        producer.go()
        if how in OF_OURS:
            value = futures[i].wait(int(WAIT_S * 1000))  # the tensor, built
            futures[i] = None
        elif how == "set":
            value = [store.get(f"{prefix}/{i}/{c}") for c in range(chunks)]
        elif how == "queue":
            value = store.queue_pop(prefix, block=True)
        else:
            producer.group.recv([buffer], 1, 0).wait()
            value = buffer
        received.append(time.perf_counter_ns())
        if how == "gloo_rtt":
            producer.group.send([buffer], 1, 1).wait()  # the echo
        if how == "set":
            for c in range(chunks):
                store.delete_key(f"{prefix}/{i}/{c}")
        del value  # dropped before the next value
    calls, sent = producer.done()
    if forger is not None:
        forger.join(WAIT_S)
        if forger.is_alive():
            forger.kill()
            forger.join(5)
    del promises
    times = [t1 - t0 for t0, t1 in zip(sent, received)]
    if min(times) <= 0:
        raise RuntimeError(f"a one-way time of {min(times)} ns ({how}): the two processes' "
                           f"perf_counter clocks do not compare")
    return times, calls


# ---- 1: 4 KiB one-way latency ----


def latency(report, producer, store, rounds, samples):
    first_value_us = None
    for how in CASES:  # warm-up: connections, attach paths, Gloo's pair (figures dropped)
        got, _ = _batch(producer, store, how, LATENCY_BYTES, 5)
        if how == "pairs":
            first_value_us = got[0] / 1000  # (the link made on its way)
    times = {how: [] for how in CASES}
    calls = {how: [] for how in CASES}
    for _ in range(rounds):  # interleaved
        for how in CASES:
            got, spent = _batch(producer, store, how, LATENCY_BYTES, samples)
            times[how] += [t / 1000 for t in got]
            calls[how] += [t / 1000 for t in spent]
    med = {how: statistics.median(v) for how, v in times.items()}
    p90 = {how: _p90(v) for how, v in times.items()}
    call = {how: statistics.median(v) for how, v in calls.items()}
    print(f"\nnetwork kind: 4 KiB tensor one-way, producer process -> consumer process over "
          f"loopback (us; {rounds} interleaved rounds x {samples} values)")
    for how, label in CASES.items():
        print(f"  {label:>58}: median {med[how]:8.1f} us   p90 {p90[how]:8.1f} us   "
              f"(producer's send: {call[how]:7.1f} us)")
    report.add(Figure(SECTION, "4 KiB one-way, consumer blocked in wait()", "us", OURS,
                      times["network"],
                      [Anchor(RAW_SET, times["set"]), Anchor(RAW_QUEUE, times["queue"]),
                       Anchor(GLOO, times["gloo"])],
                      size_bytes=LATENCY_BYTES))
    report.add(Figure(P2P_SECTION, "4 KiB one-way, consumer blocked in wait()", "us", PAIRS,
                      times["pairs"],
                      [Anchor(GLOO, times["gloo"], Target("<=", 1.5, issue=33)),
                       Anchor(RAW_QUEUE, times["queue"])],
                      size_bytes=LATENCY_BYTES))
    report.add(Figure(P2P_SECTION, "4 KiB set_value, the producer's call", "us", PAIRS,
                      calls["pairs"],
                      [Anchor(GLOO_RTT, calls["gloo_rtt"], Target("<=", 1.5, issue=33))],
                      size_bytes=LATENCY_BYTES))
    print(f"  time to the first value over a new link (its group made on the way): "
          f"{first_value_us:.0f} us (report only)")
    return {"latency_us": {how: {"median": med[how], "p90": p90[how], "producer_call": call[how]}
                           for how in CASES},
            "first_value_over_a_new_link_us": first_value_us}


# ---- 2: 4 KiB one-way beside forged messages ----

HOSTILE = {"quiet": "network kind, nothing forged (anchor: the same run)",
           "bad": "behind a forged message naming 2^32 - 1 chunks",
           "flood": "during a flood of junk messages from a forger process"}


def hostile(report, producer, store, rounds, samples, flood):
    """Issue 31: other pairs' values arrive on time (<= 2x their normal latency) while a bad
    message is handled. "bad": just before each "go" this process pushes, to its own queue, a
    value message for one of its pairs in flight naming 2^32 - 1 chunks (the pair it names fails;
    the next value is timed); "flood": a forger process pushes `flood` junk messages of every kind
    (tests/forged_messages.py) over the batch's span."""
    victims = []

    def push_bad(consumer, pair_ids):
        promise = dtorch_ops.TensorPromise(kind="network", store=store)
        victims.append((promise, promise.get_future()))
        victim = promise.serialize().split(":")[-1]
        store.queue_push(forged_messages.queue_key(consumer), forged_messages.value(
            victim, forged_messages.hex_id(), forged_messages.MAX_U32 * forged_messages.CHUNK_BYTES,
            forged_messages.MAX_U32,
            forged_messages.tensor_header([forged_messages.MAX_U32 * forged_messages.CHUNK_BYTES // 4])))

    times = {case: [] for case in HOSTILE}
    for _ in range(rounds):  # interleaved
        for case in HOSTILE:
            got, _ = _batch(producer, store, "network", LATENCY_BYTES, samples,
                            before_go=push_bad if case == "bad" else None,
                            flood=flood if case == "flood" else 0)
            times[case] += [t / 1000 for t in got]
    failed = 0
    for _, future in victims:  # every forged message failed its own pair (bounded wait)
        try:
            future.wait(int(WAIT_S * 1000))
        except dtorch_ops.errors.InvalidHandleError:
            failed += 1
    if failed != len(victims):
        raise RuntimeError(f"{len(victims) - failed} of {len(victims)} pairs named by a forged "
                           "message did not fail")
    victims.clear()
    med = {case: statistics.median(v) for case, v in times.items()}
    p90 = {case: _p90(v) for case, v in times.items()}
    print(f"\nnetwork kind: 4 KiB one-way beside forged messages (us; {rounds} interleaved rounds "
          f"x {samples} values; flood: {flood} junk messages per batch)")
    for case, label in HOSTILE.items():
        print(f"  {label:>58}: median {med[case]:8.1f} us   p90 {p90[case]:8.1f} us   "
              f"({med[case] / med['quiet']:.2f}x quiet)")
    bound = Target("<=", 2.0, 31)
    report.add(Figure(SECTION, "4 KiB one-way behind a forged message naming 2^32 - 1 chunks",
                      "us", HOSTILE["bad"], times["bad"],
                      [Anchor(HOSTILE["quiet"], times["quiet"], target=bound)],
                      size_bytes=LATENCY_BYTES))
    report.add(Figure(SECTION, f"4 KiB one-way during a flood of {flood} junk messages", "us",
                      HOSTILE["flood"], times["flood"],
                      [Anchor(HOSTILE["quiet"], times["quiet"], target=bound)],
                      size_bytes=LATENCY_BYTES))
    return {"hostile_latency_us": {case: {"median": med[case], "p90": p90[case]}
                                   for case in HOSTILE}}


# ---- 3: bandwidth ----


def bandwidth(report, producer, store, mib, repeats):
    nbytes = mib * MiB
    cases = ("network", "pairs", "set", "gloo")
    for how in cases:  # warm-up: the first value of a size (figures dropped)
        _batch(producer, store, how, nbytes, 1)
        gc.collect()
    seconds = {how: [] for how in cases}
    sending = {how: [] for how in cases}
    for _ in range(repeats):  # interleaved, one value each
        for how in cases:
            got, spent = _batch(producer, store, how, nbytes, 1)
            seconds[how].append(got[0] / 1e9)
            sending[how].append(spent[0] / 1e6)
            gc.collect()
    gbps = {how: [nbytes / s / 1e9 for s in v] for how, v in seconds.items()}
    med = {how: statistics.median(v) for how, v in gbps.items()}
    print(f"\nnetwork kind: {mib} MiB, producer's stamp before sending -> consumer has the value "
          f"(GB/s; {repeats} values per case, interleaved, after one warm-up each)")
    for how in cases:
        print(f"  {CASES[how]:>58}: median {med[how]:7.3f} GB/s ({nbytes / med[how] / 1e6:8.1f} "
              f"ms; producer's send: {statistics.median(sending[how]):7.1f} ms)")
    report.add(Figure(SECTION, f"{mib} MiB bandwidth", "GB/s", OURS, gbps["network"],
                      [Anchor(RAW_SET, gbps["set"]), Anchor(GLOO, gbps["gloo"])],
                      size_bytes=nbytes))
    report.add(Figure(P2P_SECTION, f"{mib} MiB bandwidth", "GB/s", PAIRS, gbps["pairs"],
                      [Anchor(GLOO, gbps["gloo"], Target(">=", 0.8, issue=33))],
                      size_bytes=nbytes))
    return {"bandwidth": {f"{mib}MiB": {"gbps": med}}}


# ---- all ----


def _settle(store, seconds=5.0):
    """Waits (bounded) for the kind's threads here to exit, nothing being in flight; returns the
    keys left in the store (ours only: dtorch/ and bench/), but for this process's heartbeat and
    identity keys, which go at its exit."""
    deadline = time.monotonic() + seconds
    # (A link's receiving thread and Gloo's device thread stay: the link until it is idle.)
    while (dtorch_ops.library_threads().get("network", 0) > 1 + dtorch_ops._C.diagnostics()[
            "network"]["links_in"] and time.monotonic() < deadline):
        time.sleep(0.05)
    try:
        keys = store.list_keys()
    except (AttributeError, RuntimeError):
        return None
    mine = {f"dtorch/n/hb/{_OWN_ID[0]}", f"dtorch/n/id/{_OWN_ID[0]}"}
    return sorted(k for k in keys if k.startswith(("dtorch/", "bench/")) and k not in mine)


def main(report, rounds=5, samples=100, mib=64, repeats=7):
    start = time.perf_counter()
    store = _store(0, True)  # this process hosts the servers
    gloo_store = _store(0, True)  # Gloo's own, on a port of its own
    result = {}
    producer = _Producer(store.port, gloo_store)
    try:
        result.update(latency(report, producer, store, rounds, samples))
        result.update(hostile(report, producer, store, rounds, samples, flood=100 * samples))
        result.update(bandwidth(report, producer, store, mib, repeats))
    finally:
        producer.close()
    left = _settle(store)
    print(f"  producer exit code {producer.process.exitcode}; our keys left in the store: "
          f"{left if left else 'none' if left is not None else 'unknown'}; "
          f"{time.perf_counter() - start:.1f} s")
    result["store_keys_left"] = left
    # The kind's sessions outlive their pairs: at exit this process's deletes its heartbeat key.
    # The store's server stays up until then (else c10d logs a failed deleteKey at exit).
    _SERVERS.append(store)
    return result


if __name__ == "__main__":
    quick = os.environ.get("QUICK") == "1"
    main(Report(), rounds=3 if quick else 5, samples=30 if quick else 100,
         mib=16 if quick else 64, repeats=5 if quick else 7)
