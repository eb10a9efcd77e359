"""The "network" kind's failures (killed producers, consumers and stores, refusals), untrusted
(tampered) handles and options; the rest of the kind: test_network.py.

The module's store server runs in this process (the `store` fixture); this process is mostly the
consumer. Four spawned processes serve the module (started together): two producers (which are
consumers too) and two that a test kills. The store that a test kills runs in a subprocess of its
own. After every test no key of the kind but heartbeats may be left in the store (the autouse
`nothing_left_in_the_store`). The fixtures and helpers: network_fixtures.py.
"""
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

import dtorch_ops
import network_workers
from conftest import TESTS, WAIT_MS, wait_until
from dtorch_ops import errors
from network_fixtures import (CLEANUP_S, DEATH_NOTICED_S, HANDLE, HEARTBEAT_S, KEY_PREFIX,
                              SILENT_STORE_FAILS_WITHIN_S, STORE_TIMEOUT_S, fields, kill,
                              leftover_keys, network_pair, our_keys, started_processes, victim)
# The fixtures that the tests use by name: pytest registers those imported into a test module
# (the autouse nothing_left_in_the_store runs after each test of this module for this import).
from network_fixtures import address, other, producer, store  # noqa: F401
from network_fixtures import nothing_left_in_the_store  # noqa: F401
from network_fixtures import short_attach_timeout, short_heartbeat  # noqa: F401
from network_fixtures import short_store_timeout  # noqa: F401
from network_fixtures import path  # noqa: F401  (every test on both paths)

pytestmark = pytest.mark.timeout(120)


# ---- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def processes():
    """Two producers (consumers too) and two processes that tests kill."""
    yield from started_processes(4)


# ---- failures -----------------------------------------------------------------------------------


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
def test_a_killed_consumers_keys_are_gone_once_a_prompt_producer_exits(store, address, killed,
                                                                        path):
    """The consumer SIGKILLed before the producer sets a chunked value (32 MiB), or after it (the
    consumer stopped meanwhile, so it reads nothing); the producer exits at once, long before
    the heartbeat timeout (5 s): nothing of the dead consumer's is left in the store, not its
    chunks, claim, queue, heartbeat or identity."""
    consumer = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, dtorch_ops\n"
         f"dtorch_ops.config.network_pair_groups = {int(path == 'pairs')}\n"
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
    prefix = tensor[:tensor.index(":tensor:") + 1]  # through the format and the links
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
