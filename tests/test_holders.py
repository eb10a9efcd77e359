"""A process that received a promise holds it from that moment: a worker that dies, exits or
returns before it ever touches its promise fails the controller's future at once, with the
cause, for the file and network kinds, spawned and forked; a holder that passes the promise on
before it goes, or a TorchScript copy in a process that exits, breaks nothing.

Each controller case starts one worker (spawn: a fresh interpreter, the promise unpickled there;
fork: the promise among the Process arguments, never pickled) and measures from the worker's end
(its join) to the future's failure: at most FAILED_WITHIN_S.
"""
import io
import multiprocessing
import re
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import dtorch_ops
import holder_workers
from conftest import wait_until
from dtorch_ops import errors

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("nothing_left_in_dev_shm")]

FAILED_WITHIN_S = 2.0
KEY_PREFIX = "dtorch/n/"

# (behavior, the cause the future names: "died" / "exited" with the worker's pid)
BEHAVIORS = {
    "raise": "exited",    # an exception in the worker: its interpreter exits
    "os_exit": "died",    # os._exit(1): no exit handler runs
    "sigkill": "died",
    "return": "exited",   # returns without setting
}

_SERVERS = []


@pytest.fixture(scope="module")
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    _SERVERS.append(server)  # (kept until exit: the library deletes its keys there)
    yield server


def our_keys(store) -> list:
    return sorted(k for k in store.list_keys()
                  if k.startswith(KEY_PREFIX)
                  and not k.startswith((KEY_PREFIX + "hb/", KEY_PREFIX + "id/")))


@pytest.fixture
def no_key_left(store):
    """After the test: no key of the network kind's left in the store (heartbeats aside)."""
    yield
    import gc

    gc.collect()
    assert wait_until(lambda: not our_keys(store), 5.0), our_keys(store)


@pytest.fixture(params=["file", "network"])
def kind(request, store):
    if request.param == "network":
        request.getfixturevalue("no_key_left")
    yield request.param


def run_spawned(target, *args) -> int:
    """Runs target(*args) in a spawned process to its end; returns its exit code."""
    worker = multiprocessing.get_context("spawn").Process(target=target, args=args)
    worker.start()
    worker.join(60)
    return worker.exitcode


def ready_pipe(ctx):
    """(read end, write end): the worker sends its pid when it is ready."""
    return ctx.Pipe(duplex=False)


def receive(read_end, timeout_s: float = 60):
    assert read_end.poll(timeout_s), "the worker did not report"
    return read_end.recv()


def make_promise(kind, store, cls=dtorch_ops.TensorPromise):
    if kind == "network":
        return cls(kind="network", store=store)
    return cls(kind="file")


def expect_broken(future, cause: str, pid: int, since: float):
    """The future fails with BrokenPromiseError naming `cause` and `pid`, within FAILED_WITHIN_S
    of `since`."""
    with pytest.raises(errors.BrokenPromiseError) as info:
        future.wait(timeout=10)
    elapsed = time.monotonic() - since
    message = str(info.value)
    assert re.search(rf"producer {cause} \(pid {pid}\b", message), message
    assert elapsed <= FAILED_WITHIN_S, f"failed after {elapsed:.2f} s: {message}"
    return elapsed


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
@pytest.mark.parametrize("behavior", list(BEHAVIORS))
def test_a_worker_that_never_touches_its_promise_fails_the_future_at_once(
        kind, store, start_method, behavior):
    ctx = multiprocessing.get_context(start_method)
    promise = make_promise(kind, store)
    future = promise.get_future()  # the controller keeps its own promise handle throughout
    ready, report = ready_pipe(ctx)
    worker = ctx.Process(target=holder_workers.behave, args=(promise, behavior, report))
    worker.start()
    pid = receive(ready)
    worker.join(30)
    assert worker.exitcode is not None
    elapsed = expect_broken(future, BEHAVIORS[behavior], pid, time.monotonic())
    print(f"{kind} {start_method} {behavior}: failed {elapsed:.3f} s after the worker ended")
    assert promise.kind() == kind  # (still held here)


def test_a_worker_that_drops_the_promise_and_lives_on(kind, store):
    ctx = multiprocessing.get_context("spawn")
    promise = make_promise(kind, store)
    future = promise.get_future()
    (ready, report), release = ready_pipe(ctx), ctx.Queue()
    worker = ctx.Process(target=holder_workers.drop_and_wait,
                         args=(promise.serialize(), "TensorPromise", report, release))
    worker.start()
    pid = receive(ready)  # it deserialized the promise, dropped it, and waits
    started = time.monotonic()
    with pytest.raises(errors.BrokenPromiseError, match=rf"dropped the promise \(pid {pid}\)"):
        future.wait(timeout=10)
    assert time.monotonic() - started <= FAILED_WITHIN_S
    release.put(None)
    worker.join(30)


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_a_holder_that_drops_the_promise_and_returns_at_once_is_named_for_the_drop(
        kind, store, start_method):
    """The drop is told before the process ends (not taken for a death once it is gone)."""
    ctx = multiprocessing.get_context(start_method)
    for _ in range(3):  # (the exit came before the drop's message at times: a race, so 3 tries)
        promise = make_promise(kind, store)
        future = promise.get_future()
        ready, report = ready_pipe(ctx)
        worker = ctx.Process(target=holder_workers.drop_and_return,
                             args=(promise.serialize(), report))
        worker.start()
        pid = receive(ready)
        worker.join(30)
        assert worker.exitcode == 0
        with pytest.raises(errors.BrokenPromiseError) as info:
            future.wait(timeout=10)
        assert re.search(rf"dropped the promise \(pid {pid}\)", str(info.value)), info.value
        del info, future, promise


def test_a_holder_that_forwards_the_promise_and_returns_breaks_nothing(kind, store):
    """The worker puts the promise in a queue and returns at once; a third process reads it 2 s
    later (the worker long gone) and sets it: its value arrives, nothing broke meanwhile."""
    ctx = multiprocessing.get_context("spawn")
    promise = make_promise(kind, store)
    future = promise.get_future()
    queue, go = ctx.Queue(), ctx.Queue()
    grandchild = ctx.Process(target=holder_workers.receive_when_told, args=(queue, go, 7.0))
    grandchild.start()
    worker = ctx.Process(target=holder_workers.forward, args=(promise, queue))
    worker.start()
    worker.join(60)
    assert worker.exitcode == 0
    time.sleep(1.5)  # (longer than a break takes: the other cases fail in < 1 s)
    assert not future.done()  # the forwarded handle is in flight: no break
    go.put(None)
    value = future.wait(timeout=60)
    assert torch.equal(value, torch.full((3,), 7.0))
    grandchild.join(30)
    assert grandchild.exitcode == 0


def test_a_forwarded_handle_that_never_arrives_breaks_at_the_attach_deadline(kind, store):
    """A holder that serializes the promise (into a queue nobody reads) and exits: the pair holds
    while that handle is in flight, then fails at the attach deadline, saying so."""
    old = dtorch_ops.config.attach_timeout_s
    dtorch_ops.config.attach_timeout_s = 2.0
    try:
        ctx = multiprocessing.get_context("spawn")
        promise = make_promise(kind, store)
        future = promise.get_future()
        queue = ctx.Queue()
        worker = ctx.Process(target=holder_workers.forward, args=(promise, queue))
        worker.start()
        worker.join(60)
        ended = time.monotonic()
        with pytest.raises(errors.BrokenPromiseError, match="never deserialized"):
            future.wait(timeout=20)
        assert 1.5 <= time.monotonic() - ended <= 2.0 + FAILED_WITHIN_S
        queue.cancel_join_thread()
    finally:
        dtorch_ops.config.attach_timeout_s = old


def test_a_torchscript_copy_in_a_process_that_exits_breaks_nothing(kind, store):
    """torch.jit.load of a module holding the promise, in a third process that then exits, while
    the real producer holds the promise: no break; the producer's value arrives."""
    ctx = multiprocessing.get_context("spawn")
    promise = make_promise(kind, store)
    future = promise.get_future()
    go = ctx.Queue()
    producer = ctx.Process(target=holder_workers.hold_then_set, args=(promise, go, 5.0))
    producer.start()
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(holder_workers.PromiseHolder(promise.raw)), buffer)
    ready, report = ready_pipe(ctx)
    loader = ctx.Process(target=holder_workers.load_module_and_exit,
                         args=(buffer.getvalue(), report))
    loader.start()
    receive(ready)
    loader.join(60)
    assert loader.exitcode == 0
    time.sleep(1.5)  # (longer than a break takes: FAILED_WITHIN_S's cases fail in < 1 s)
    assert not future.done()
    go.put(None)
    assert torch.equal(future.wait(timeout=30), torch.full((2,), 5.0))
    producer.join(30)


def test_a_torchscript_copy_is_a_holder_while_its_process_lives(kind, store):
    """The loader's torch.jit.load made it a holder: with the real producer dead, the pair holds
    while the loader lives, and breaks once it exits (naming the death, which comes first in
    the cause)."""
    ctx = multiprocessing.get_context("spawn")
    promise = make_promise(kind, store)
    future = promise.get_future()
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(holder_workers.PromiseHolder(promise.raw)), buffer)
    (ready, report), release = ready_pipe(ctx), ctx.Queue()
    loader = ctx.Process(target=holder_workers.load_module_and_exit,
                         args=(buffer.getvalue(), report, release))
    loader.start()
    receive(ready)
    worker_ready, worker_report = ready_pipe(ctx)
    worker = ctx.Process(target=holder_workers.behave, args=(promise, "sigkill", worker_report))
    worker.start()
    worker_pid = receive(worker_ready)
    worker.join(30)
    time.sleep(1.5)
    assert not future.done()  # the loader holds it
    release.put(None)
    loader.join(60)
    expect_broken(future, "died", worker_pid, time.monotonic())


def test_fulfilling_sends_the_failure_with_its_type_and_traceback(kind, store):
    promise = make_promise(kind, store)
    future = promise.get_future()
    # (The exception went on: the worker's usual traceback, exit code 1.)
    assert run_spawned(holder_workers.fail_inside_fulfilling, promise) == 1
    with pytest.raises(KeyError) as info:
        future.wait(timeout=10)
    assert info.value.args == ("checkpoint/layer3.weight",)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "fail_inside_fulfilling" in notes and "set by the producer" in notes
    # value() and get() raise it too (consuming nothing before get)
    with pytest.raises(KeyError):
        future.value()
    with pytest.raises(KeyError):
        future.get()


@pytest.mark.parametrize("which,raised", [("value", ValueError), ("key", KeyError),
                                          ("custom", errors.ProducerError)])
def test_set_exception_across_processes_raises_the_builtin_type(kind, store, which, raised):
    promise = make_promise(kind, store)
    future = promise.get_future()
    assert run_spawned(holder_workers.set_exception_object, promise, which) == 0
    with pytest.raises(raised) as info:
        future.wait(timeout=10)
    if raised is errors.ProducerError:
        assert "holder_workers.CustomError: a custom failure" in str(info.value)
    else:
        assert type(info.value) is raised
    assert "set_exception_object" in "\n".join(info.value.__notes__)


def test_a_value_the_producer_refuses_reaches_the_consumer(kind, store):
    promise = make_promise(kind, store)
    future = promise.get_future()
    assert run_spawned(holder_workers.refused_value, promise) == 0
    with pytest.raises(errors.ProducerError, match=r"set_value in the producer \(pid \d+\) "
                                                    r"refused the value: .*strided"):
        future.wait(timeout=10)


def test_deserializing_in_the_creator_registers_nothing(kind, store):
    """The creator's own copies (a pickle round trip here) hold nothing: a worker that then dies
    still fails the future."""
    import pickle

    ctx = multiprocessing.get_context("spawn")
    promise = make_promise(kind, store)
    future = promise.get_future()
    copy = pickle.loads(pickle.dumps(promise))
    ready, report = ready_pipe(ctx)
    worker = ctx.Process(target=holder_workers.behave, args=(promise, "os_exit", report))
    worker.start()
    pid = receive(ready)
    worker.join(30)
    expect_broken(future, "died", pid, time.monotonic())
    del copy


def test_set_exception_in_the_creator_raises_that_very_instance(kind, store):
    """The creator fails its own cross-process pair with an exception: its future (this process)
    raises that object, as a memory pair's does; the same pair's handle elsewhere would see its
    type and message."""
    promise = make_promise(kind, store)
    future = promise.get_future()
    error = LookupError("no such checkpoint")
    promise.set_exception(error)
    with pytest.raises(LookupError) as info:
        future.wait(timeout=10)
    assert info.value is error
    assert future.exception() is error
    # (The future holds the exception, whose traceback now holds this frame, and so the future:
    # a cycle through C++ that the garbage collector cannot see, as torch.futures has it.)
    error.__traceback__ = None
    del info


def test_holding_a_promise_maps_no_payload_and_starts_no_thread_but_the_network_tick(kind, store):
    """Deserializing registers the process cheaply: for the file kind, one mapping (the control
    page: no doorbell, no payload) and no thread; for the network kind, its one tick thread
    (the heartbeat a consumer on another host watches), no watcher."""
    from conftest import run_python

    promise = make_promise(kind, store)
    future = promise.get_future()
    result = run_python(f"""
        import json, dtorch_ops
        held = dtorch_ops.TensorPromise.from_serialized({promise.serialize()!r})
        with open("/proc/self/maps") as maps:
            mapped = sum(1 for line in maps if "/dev/shm/dtorch_" in line)
        print(json.dumps([dtorch_ops.library_threads(), mapped]))
    """)
    assert result.returncode == 0, result.stderr
    import json

    threads, mapped = json.loads(result.stdout.strip().splitlines()[-1])
    expected = {"detectors": 0, "pool": 0, "doorbell": 0, "network": 1 if kind == "network" else 0}
    assert threads == expected
    assert mapped == (1 if kind == "file" else 0)
    # The holder exited (its interpreter ran the exit handler): the future says so, at once.
    with pytest.raises(errors.BrokenPromiseError, match=r"producer exited \(pid \d+\)"):
        future.wait(timeout=10)


@pytest.mark.parametrize("start_method,behavior,cause", [
    ("spawn", "sigkill", "died"), ("spawn", "return", "exited"), ("fork", "return", "exited")])
def test_a_holder_on_another_host_is_watched_by_its_heartbeat(store, no_key_left, monkeypatch,
                                                               start_method, behavior, cause):
    """A holder whose attach message names another kernel (as a process on another host does:
    DTORCH_BOOT_ID_FOR_TESTING) cannot be checked by pid: it is dead once its heartbeat stands
    still for the heartbeat timeout, and exited when it deleted its heartbeat (a clean exit) or
    said it was exiting (a multiprocessing child's end)."""
    saved = dtorch_ops.config.network_heartbeat_timeout_s
    dtorch_ops.config.network_heartbeat_timeout_s = 1.0
    try:
        ctx = multiprocessing.get_context(start_method)
        promise = make_promise("network", store)
        future = promise.get_future()
        ready, report = ready_pipe(ctx)
        worker = ctx.Process(target=holder_workers.behave, args=(promise, behavior, report))
        monkeypatch.setenv("DTORCH_BOOT_ID_FOR_TESTING", "0123456789abcdef" * 2)
        worker.start()
        monkeypatch.delenv("DTORCH_BOOT_ID_FOR_TESTING")
        pid = receive(ready)
        worker.join(30)
        ended = time.monotonic()
        with pytest.raises(errors.BrokenPromiseError) as info:
            future.wait(timeout=20)
        message = str(info.value)
        host = __import__("socket").gethostname()
        assert re.search(rf"producer {cause} \(pid {pid} on {re.escape(host)}", message), message
        if cause == "died":
            assert "its heartbeat stopped for 1000 ms" in message
        # (Died: the timeout, 1 s, plus a tick or two; exited: at the next tick or two.)
        elapsed = time.monotonic() - ended
        print(f"another host, {start_method} {behavior}: failed {elapsed:.3f} s after it ended")
        assert elapsed <= 1.0 + FAILED_WITHIN_S, message
    finally:
        dtorch_ops.config.network_heartbeat_timeout_s = saved
