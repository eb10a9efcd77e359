"""Failure and safety behaviour of "file" promises: pairs across processes of one host, over
POSIX shared memory (/dev/shm). The contract is the comment at the top of csrc/core/kinds/file/file_kind.h.

Covered: producers that die (SIGKILL, os._exit), exit, or drop the promise without setting it; a
producer killed while copying a large value or while holding the promise's interprocess lock; a
creator dropping its promise in flight; a consumer killed first; segment modes; untrusted
serialized handles (fuzzed in a subprocess); memory, fds, threads and /dev/shm at scale.

One spawned producer process serves the whole module (the `producer` fixture); tests that kill or
end a producer start their own, forked where the child needs no CUDA (fast). After every test
nothing of the processes it used may be left in /dev/shm (the autouse `nothing_left_in_shm`).
"""
import asyncio
import builtins
import gc
import json
import multiprocessing
import os
import queue
import random
import re
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as torch_mp

import dtorch_ops
import file_workers
from producer_process import ProducerProcess, remote_error
from conftest import WAIT_MS
from dtorch_ops import errors

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
SHM = "/dev/shm"
# The form of every dtorch segment name:
# dtorch_<owner pid>-<owner start time>-<owner pid namespace>_<128 random bits>.
SEGMENT_NAME = re.compile(r"^dtorch_(\d+)-(\d+)-(\d+)_[0-9a-f]{32}$")
# The contract: a dead producer is noticed "within about a second" (liveness every 250 ms plus a
# 500 ms grace); this is the generous bound the tests hold it to.
DEATH_NOTICED_S = 5.0
# How long the library gets to unlink what a finished test dropped.
CLEANUP_S = 2.0

FORK = multiprocessing.get_context("fork")
SPAWN = torch_mp.get_context("spawn")

# Every child process this module started: their segments are checked for leaks too.
_child_pids: set = set()


# ---- /dev/shm ------------------------------------------------------------------------------------


def shm_names() -> set:
    return {name for name in os.listdir(SHM) if name.startswith("dtorch_")}


def owner_pid(name: str):
    match = SEGMENT_NAME.match(name)
    return int(match.group(1)) if match else None


def names_owned_by(pids, names=None) -> set:
    """The dtorch segments (now, or among `names`) whose owner is one of `pids`."""
    pids = set(pids)
    return {name for name in (shm_names() if names is None else names) if owner_pid(name) in pids}


def own_name_prefix() -> str:
    """dtorch_<pid>-<start time>-<pid namespace>_ of this process (start time: /proc/self/stat
    field 22; pid namespace: the inode of /proc/self/ns/pid)."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return f"dtorch_{os.getpid()}-{fields[19]}-{os.stat('/proc/self/ns/pid').st_ino}_"


def segment_of(serialized: str) -> str:
    """The control segment a serialized file promise names."""
    return serialized.split(":")[4]


def assert_private_segment(name: str) -> None:
    info = os.lstat(os.path.join(SHM, name))
    assert stat.S_ISREG(info.st_mode), name
    assert stat.S_IMODE(info.st_mode) == 0o600, f"{name}: mode {oct(stat.S_IMODE(info.st_mode))}"
    assert info.st_uid == os.geteuid(), f"{name}: owner {info.st_uid}"


def remove_quietly(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


# ---- waiting and process state -------------------------------------------------------------------


def wait_until(predicate, timeout_s: float, period_s: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            return predicate()
        time.sleep(period_s)
    return True


def wait_until_paused(pid: int, timeout_s: float = 10.0) -> None:
    """Until the main thread of `pid` sleeps in pause(): hold_file_promise_lock_for_testing has
    taken the lock (it attaches, locks, then pauses for good). x86-64: pause is syscall 34."""

    def paused():
        try:
            with open(f"/proc/{pid}/syscall") as f:
                return f.read().split()[0] == "34"
        except (OSError, IndexError):
            return False

    if os.uname().machine != "x86_64" or not os.path.exists(f"/proc/{pid}/syscall"):
        time.sleep(1.0)  # no way to see it: give it ample time
        return
    assert wait_until(paused, timeout_s), f"pid {pid} never reached pause()"


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def python_env() -> dict:
    """The environment of a fresh `python -c` that imports dtorch_ops and file_workers."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT, TESTS] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def run_python(code: str, stdin: str = "", timeout_s: float = 120):
    """Runs `python -c code` (tracked for the leak check); returns (returncode, stdout, stderr)."""
    process = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=python_env(),
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    _child_pids.add(process.pid)
    try:
        out, err = process.communicate(stdin, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        pytest.fail(f"`python -c {code!r}` hung for {timeout_s} s; stderr:\n{err[-3000:]}")
    return process.returncode, out, err


class Child:
    """A child process running file_workers.<target>(*args, conn), `conn` being its end of a pipe
    to the test. A context manager: leaving it kills the child if it still runs."""

    def __init__(self, context, target, *args):
        self.conn, child_end = context.Pipe()
        self.process = context.Process(target=target, args=(*args, child_end), daemon=True)
        self.process.start()
        child_end.close()
        _child_pids.add(self.process.pid)

    @property
    def pid(self) -> int:
        return self.process.pid

    def recv(self, timeout_s: float = 60.0):
        if not self.conn.poll(timeout_s):
            pytest.fail(f"child {self.pid} sent nothing within {timeout_s} s")
        try:
            return self.conn.recv()
        except EOFError:
            self.process.join(10)
            pytest.fail(f"child {self.pid} ended (exit code {self.process.exitcode}) before "
                        "sending")

    def kill(self) -> float:
        """SIGKILLs the child and reaps it; returns the time of the kill (time.monotonic())."""
        killed_at = time.monotonic()
        os.kill(self.pid, signal.SIGKILL)
        self.process.join(30)
        assert self.process.exitcode == -signal.SIGKILL, self.process.exitcode
        return killed_at

    def join(self, timeout_s: float = 60.0) -> int:
        self.process.join(timeout_s)
        assert self.process.exitcode is not None, f"child {self.pid} did not end in {timeout_s} s"
        return self.process.exitcode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.process.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        self.process.join(30)
        self.conn.close()


# ---- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def producer():
    process = ProducerProcess(SPAWN)
    _child_pids.add(process.pid)
    yield process
    process.close()


@pytest.fixture(autouse=True)
def nothing_left_in_shm(request):
    """After the test, no dtorch segment of this process or of a child it started remains in
    /dev/shm beyond those present before (the library gets CLEANUP_S to unlink what the test
    dropped). Leaked segments are removed after being reported. Not checked after a failed test:
    pytest keeps its frame, and with it the test's promises and futures, alive."""
    before = shm_names()
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed != failed_before:
        return
    gc.collect()

    def leaked():
        # (This process's doorbell lives while it has pairs pending, and a while after.)
        doorbell = {dtorch_ops._C.diagnostics()["doorbell"]["doorbell_segment"]}
        return names_owned_by(_child_pids | {os.getpid()}, shm_names() - before - doorbell)

    if not wait_until(lambda: not leaked(), CLEANUP_S):
        gc.collect()
        if not wait_until(lambda: not leaked(), CLEANUP_S):
            left = sorted(leaked())
            for name in left:
                remove_quietly(os.path.join(SHM, name))
            pytest.fail(f"left in /dev/shm after the test: {left}")


@pytest.fixture
def attach_timeout():
    """Sets dtorch_ops.config.attach_timeout_s for the test (call it with seconds); restores it."""
    saved = dtorch_ops.config.attach_timeout_s

    def set_timeout(seconds: float) -> float:
        dtorch_ops.config.attach_timeout_s = seconds
        return seconds

    yield set_timeout
    dtorch_ops.config.attach_timeout_s = saved


def file_pair(cls=dtorch_ops.TensorPromise):
    promise = cls(kind="file")
    return promise, promise.get_future()


def assert_holding(report: tuple) -> None:
    """The worker holds the promise, set nothing (file_workers._hold)."""
    assert report == file_workers.HOLDING, report


# ---- 1. a producer killed before setting --------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("attached_by", ["deserialized", "held_lock"])
def test_producer_killed_before_setting_breaks_the_future(attached_by):
    promise, future = file_pair()
    target = {"deserialized": file_workers.hold_then_linger,
              "held_lock": file_workers.hold_lock_forever}[attached_by]
    with Child(FORK, target, promise.serialize()) as child:
        first = child.recv()
        if attached_by == "held_lock":
            assert first == child.pid
            wait_until_paused(child.pid)
        else:
            assert_holding(first)
        # The producer lives: the future stays pending, and a timed out wait leaves it valid.
        with pytest.raises(errors.FutureTimeoutError):
            future.wait(50)
        assert future.valid() and not future.is_ready()
        killed_at = child.kill()
    with pytest.raises(errors.BrokenPromiseError,
                       match=rf"producer died \(pid {child.pid}\) without setting a value"):
        future.wait(WAIT_MS)
    assert time.monotonic() - killed_at < DEATH_NOTICED_S
    assert future.valid() and future.done()  # (a wait consumes nothing, also when it raises)


@pytest.mark.timeout(60)
def test_refused_get_tensor_fails_the_future_with_the_refusal():
    """get_tensor with a value the promise refuses (a sparse tensor) raises in the producer and
    fails the pair with that refusal: the consumer learns why, while the producer lives on."""
    promise, future = file_pair()
    with Child(FORK, file_workers.get_tensor_sparse_then_linger, promise.serialize()) as child:
        module, qualname, message = child.recv()
        assert "carries strided (dense) tensors" in message, (module, qualname, message)
        with pytest.raises(errors.ProducerError,
                           match=rf"get_tensor in the producer \(pid {child.pid}\) refused the "
                                 r"value: .*carries strided \(dense\) tensors"):
            future.wait(WAIT_MS)
        assert child.process.is_alive()


@pytest.mark.timeout(60)
def test_await_fails_when_the_producer_is_killed():
    """`await` is served by the doorbell watcher: it too learns of the death."""
    promise, future = file_pair()

    async def consume():
        return await asyncio.wait_for(future, WAIT_MS / 1000)

    with Child(FORK, file_workers.hold_then_linger, promise.serialize()) as child:
        assert_holding(child.recv())
        killed_at = child.kill()
    with pytest.raises(errors.BrokenPromiseError, match=rf"producer died \(pid {child.pid}\)"):
        asyncio.run(consume())
    assert time.monotonic() - killed_at < DEATH_NOTICED_S


# ---- 2. a producer killed while copying a large value -------------------------------------------

LARGE_PAIRS = 4


def large_value_numel() -> int:
    """float32 elements of a 256 MiB value where /dev/shm has ample room for LARGE_PAIRS of
    them, else of a 64 MiB one."""
    for mib in (256, 64):
        if shutil.disk_usage(SHM).free >= 3 * LARGE_PAIRS * (mib << 20):
            return (mib << 20) // 4
    pytest.skip("/dev/shm has no room for 64 MiB values")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("attempt", range(3))
def test_producer_killed_while_copying_large_values(attempt, attach_timeout):
    """The producer sets LARGE_PAIRS large values in turn and is killed at a random moment of
    setting one of them (after the first: its duration scales the moment). Each future yields
    its value or fails; none hangs; no payload is left in /dev/shm.

    The creator drops its promises once the producer is dead, so that the promises it never
    reached fail ("no producer attached") rather than wait for a producer for good."""
    attach_timeout(1.0)
    numel = large_value_numel()
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    kill_during, fraction = rng.randrange(1, LARGE_PAIRS), rng.uniform(0.0, 1.2)
    before = shm_names()

    promises = [dtorch_ops.TensorPromise(kind="file") for _ in range(LARGE_PAIRS)]
    futures = [promise.get_future() for promise in promises]
    handles = [promise.serialize() for promise in promises]
    with Child(FORK, file_workers.produce_large_in_sequence, handles, numel) as child:
        assert child.recv() == ("start", 0)
        _, _, first_set_s = child.recv()
        assert child.recv() == ("start", 1)
        for i in range(1, kill_during):
            assert child.recv()[:2] == ("set", i)
            assert child.recv() == ("start", i + 1)
        delay_s = fraction * first_set_s
        time.sleep(delay_s)
        child.kill()
    del promises
    gc.collect()
    context = (f"seed {seed}: killed {delay_s:.3f} s into setting value {kill_during} (setting "
               f"value 0 took {first_set_s:.3f} s)")

    outcomes = []
    for i, future in enumerate(futures):
        try:
            value = future.wait(WAIT_MS)
        except errors.BrokenPromiseError as e:
            if f"producer died (pid {child.pid})" in str(e):
                outcomes.append("died")
            else:
                assert "no producer attached" in str(e), (context, str(e))
                outcomes.append("unattached")
        else:
            assert value.shape == (numel,) and value.dtype == torch.float32, context
            assert bool((value == i + 1).all()), context
            outcomes.append("value")
            del value
    # In order: the values set before the kill, then the one being set (a value, or broken: it
    # had claimed the promise or attached to it), then those never reached.
    assert outcomes[:kill_during] == ["value"] * kill_during, (context, outcomes)
    assert outcomes[kill_during + 1:] == ["unattached"] * (LARGE_PAIRS - kill_during - 1), \
        (context, outcomes)
    assert outcomes[kill_during] in ("value", "died"), (context, outcomes)

    del futures
    gc.collect()
    assert wait_until(lambda: not names_owned_by({os.getpid()}, shm_names() - before), CLEANUP_S), \
        (context, sorted(names_owned_by({os.getpid()}, shm_names() - before)))


# ---- 3. a producer killed holding the promise's lock --------------------------------------------


@pytest.mark.timeout(60)
def test_producer_killed_holding_the_promise_lock(producer):
    """The robust lock a killed producer held fails that promise (future and other producers)
    and nothing else: the consumer's other pairs, served by a live producer, complete."""
    poisoned, poisoned_future = file_pair()
    served = [file_pair() for _ in range(2)]
    with Child(FORK, file_workers.hold_lock_forever, poisoned.serialize()) as holder:
        assert holder.recv() == holder.pid
        wait_until_paused(holder.pid)
        # While it holds that promise's lock, another producer serves the consumer's other pairs.
        producer.call(file_workers.produce, served[0][0].serialize(), 1.0)
        assert served[0][1].wait(WAIT_MS).tolist() == [1.0] * 16
        killed_at = holder.kill()

    assert wait_until(poisoned_future.is_ready, DEATH_NOTICED_S), "the death went unnoticed"
    assert time.monotonic() - killed_at < DEATH_NOTICED_S
    # A second producer of the poisoned promise gets a clear error, not a hang (twice: the lock
    # is first found owner-dead, then not recoverable).
    for _ in range(2):
        with pytest.raises(errors.BrokenPromiseError, match="died holding this promise's lock"):
            producer.call(file_workers.produce, poisoned.serialize(), 2.0)
    with pytest.raises(errors.BrokenPromiseError,
                       match=rf"producer died \(pid {holder.pid}\) without setting a value"):
        poisoned_future.wait(WAIT_MS)
    # The consumer's other pairs are unaffected.
    producer.call(file_workers.produce, served[1][0].serialize(), 3.0)
    assert served[1][1].wait(WAIT_MS).tolist() == [3.0] * 16


# ---- 4. a producer gone without setting: exited, os._exit, dropped ------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["exits_normally", "os_exit", "drops_its_handle"])
def test_producer_gone_without_setting_breaks_the_future(how):
    """The only producer attached, then exited (atexit ran), left with os._exit (to the library:
    died), or dropped its handle while living on."""
    promise, future = file_pair()
    handle = promise.serialize()
    if how == "exits_normally":  # spawned: a forked child ends with os._exit, skipping atexit
        child = Child(SPAWN, file_workers.hold_then_exit_normally, handle)
    elif how == "os_exit":
        child = Child(FORK, file_workers.hold_then_os_exit, handle)
    else:
        child = Child(FORK, file_workers.hold_then_drop_and_linger, handle)
    expected = {
        "exits_normally": rf"producer exited \(pid {child.pid}\) without setting a value",
        "os_exit": rf"producer died \(pid {child.pid}\) without setting a value",
        "drops_its_handle": rf"producer dropped the promise \(pid {child.pid}\) without setting "
                            r"a value",
    }[how]
    with child:
        assert_holding(child.recv(timeout_s=120))
        if how == "drops_its_handle":
            gone_at = time.monotonic()
            assert child.process.is_alive()
        else:
            assert child.join() == 0
            gone_at = time.monotonic()
        with pytest.raises(errors.BrokenPromiseError, match=expected):
            future.wait(WAIT_MS)
        assert time.monotonic() - gone_at < DEATH_NOTICED_S


# ---- 5. the creator drops its promise -----------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shipped_by", ["serialize", "pickle_to_unread_queue"])
def test_creator_drops_a_promise_in_flight(attach_timeout, shipped_by):
    """The promise left the process but no producer ever attached: after attach_timeout_s."""
    timeout_s = attach_timeout(1.0)
    promise, future = file_pair()
    unread = FORK.SimpleQueue()
    try:
        if shipped_by == "serialize":
            assert promise.serialize().startswith("dtorch-promise:1:file:tensor:")
        else:
            unread.put(promise)  # pickled (through serialize()) into a pipe nobody reads
        del promise
        gc.collect()
        dropped_at = time.monotonic()
        assert not future.is_ready()  # it may still reach a producer
        with pytest.raises(errors.BrokenPromiseError,
                           match=r"no producer attached within 1000 ms after the creator dropped"):
            future.wait(WAIT_MS)
        assert time.monotonic() - dropped_at < timeout_s + DEATH_NOTICED_S
    finally:
        unread.close()


@pytest.mark.parametrize("cls", [dtorch_ops.TensorPromise, dtorch_ops.VoidPromise],
                         ids=["tensor", "void"])
def test_creator_drops_a_promise_that_never_left_the_process(cls):
    """Nobody else can ever set it: broken at once."""
    promise, future = file_pair(cls)
    del promise
    assert future.is_ready()  # at once: nobody else can ever set it
    with pytest.raises(errors.BrokenPromiseError,
                       match="the promise was destroyed before a value or an exception was set"):
        future.get()


# ---- 6. the consumer killed first ---------------------------------------------------------------


@pytest.mark.timeout(120)
def test_consumer_killed_first(producer):
    """A consumer killed with pairs pending: its producer's later sets neither raise nor hang, and
    the first that has a payload to make unlinks what the dead consumer left in /dev/shm."""
    with Child(FORK, file_workers.consumer_with_pairs, 3) as consumer:
        handles = consumer.recv()
        own = names_owned_by({consumer.pid})
        # 4 control segments (3 tensor pairs, 1 void pair) and its doorbell, all private.
        assert {segment_of(h) for _, h in handles} < own and len(own) == 5, sorted(own)
        for name in own:
            assert_private_segment(name)
        consumer.kill()

    # Its producer goes on: each use of its promises returns (nothing to deliver to, or a value
    # nobody reads), without an error or a hang.
    tensor_handles = [h for kind, h in handles if kind == "tensor"]
    (void_handle,) = [h for kind, h in handles if kind == "void"]
    assert producer.call(file_workers.produce, tensor_handles[0], 1.0, 16, "get_tensor") is None
    assert producer.call(file_workers.produce, tensor_handles[1], 2.0, 1 << 20, "set_value") is None
    assert producer.call(file_workers.fail, tensor_handles[2], "the consumer is gone anyway") is None
    assert producer.call(file_workers.produce_void, void_handle) is None

    # What the dead consumer left went with the first set that had a payload to make (the 16
    # bytes'; no payload was made for it).
    assert not names_owned_by({consumer.pid})


def test_what_a_killed_consumer_left_is_reaped_when_the_library_next_loads():
    """No producer set anything: the next import of the library (a fresh process) reaps it."""
    with Child(FORK, file_workers.consumer_with_pairs, 3) as consumer:
        consumer.recv()
        assert len(names_owned_by({consumer.pid})) == 5
        consumer.kill()
    assert names_owned_by({consumer.pid}), "nothing to reap: the test proves nothing"
    returncode, _, err = run_python("import dtorch_ops")
    assert returncode == 0, err[-3000:]
    assert not names_owned_by({consumer.pid})


# ---- 7. segment modes ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_segments_are_private_to_the_user(producer):
    """Control segments, payload and doorbell: regular files of this user, mode 0600."""
    before = shm_names()
    tensor, tensor_future = file_pair()
    void, void_future = file_pair(dtorch_ops.VoidPromise)
    controls = {segment_of(tensor.serialize()), segment_of(void.serialize())}
    assert controls <= shm_names()

    producer.call(file_workers.produce, tensor.serialize(), 5.0, 1024)
    assert wait_until(tensor_future.is_ready, WAIT_MS / 1000)
    doorbell = dtorch_ops._C.diagnostics()["doorbell"]["doorbell_segment"]  # (made anew if the last one went idle)
    assert doorbell
    payloads = names_owned_by({os.getpid()}, shm_names() - before) - controls - {doorbell}
    assert len(payloads) == 1, sorted(payloads)  # the value's payload, named for the consumer

    mine = names_owned_by({os.getpid()})  # the controls, the payload and this process's doorbell
    assert controls | payloads | {doorbell} == mine
    for name in mine | names_owned_by({producer.pid}):
        assert_private_segment(name)
    assert not names_owned_by({producer.pid})  # a producer makes nothing of its own

    assert tensor_future.wait(WAIT_MS).tolist() == [5.0] * 1024
    producer.call(file_workers.produce_void, void.serialize())
    assert void_future.wait(WAIT_MS) is None


@pytest.mark.parametrize("umask", [0o000, 0o277], ids=["umask-000", "umask-277"])
def test_segments_are_0600_whatever_the_umask(umask):
    """Mode 0600 exactly: not widened by a permissive umask, not narrowed (to read-only, which
    the producer's open would refuse) by a strict one."""
    # Payload segments kept for reuse released first: the value gets a new one.
    saved_idle = dtorch_ops.config.file_payload_idle_s
    dtorch_ops.config.file_payload_idle_s = 0.0
    try:
        assert wait_until(lambda: dtorch_ops._C.diagnostics()["doorbell"]["kept_produced"] == 0, 5.0)
    finally:
        dtorch_ops.config.file_payload_idle_s = saved_idle
    before = shm_names()
    old = os.umask(umask)
    try:
        promise, future = file_pair()
        value = torch.arange(1000, dtype=torch.float32)  # (a new payload segment: named until
                                                         # the consumer receives it)
        dtorch_ops.TensorPromise.from_serialized(promise.serialize()).set_value(value)
    finally:
        os.umask(old)
    doorbell = {dtorch_ops._C.diagnostics()["doorbell"]["doorbell_segment"]}  # (made now if there was none)
    made = names_owned_by({os.getpid()}, shm_names() - before - doorbell)
    assert len(made) == 2, sorted(made)  # the control segment and the payload
    for name in made:
        assert_private_segment(name)
    assert torch.equal(future.wait(WAIT_MS), value)


# ---- 8. untrusted serialized promises ----------------------------------------------------------


def single_character_variants(handle: str) -> list:
    """Every bit flip of every character, and its deletion, doubling and replacement by a few
    characters that matter to the parser."""
    variants = []
    for i, c in enumerate(handle):
        replacements = {chr(ord(c) ^ (1 << bit)) for bit in range(8)}
        replacements |= set(":0gA/.\x00")
        variants += [handle[:i] + r + handle[i + 1:] for r in sorted(replacements) if r != c]
        variants += [handle[:i] + handle[i + 1:], handle[:i] + c + handle[i:]]
    return variants


# Every value option a serialized tensor promise may carry ("" for none): TensorCodec's closed set.
VALUE_OPTIONS = ("", "ipc", "zero_copy", "device=cpu")


def with_other_value_options(handle: str) -> list:
    """`handle` with its value options stripped, replaced by each other valid one, or appended
    where it had none: valid handles naming the same pair, with a delivery its consumer did not
    choose."""
    base = ":".join(handle.split(":")[:6])
    variants = [base + (":" + options if options else "") for options in VALUE_OPTIONS]
    return [variant for variant in variants if variant != handle]


def make_decoy_segments(prefix: str) -> dict:
    """Files in /dev/shm with names of dtorch's form (owned by this live process, so nobody reaps
    them meanwhile) that are not control segments: kind -> name."""
    decoys = {}

    def path_for(kind):
        name = prefix + os.urandom(16).hex()
        decoys[kind] = name
        return os.path.join(SHM, name)

    def write(kind, data, mode):
        fd = os.open(path_for(kind), os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode)
        try:
            os.fchmod(fd, mode)  # not narrowed by the umask
            os.write(fd, data)
        finally:
            os.close(fd)

    write("mode_0644", bytes(4096), 0o644)
    write("garbage", os.urandom(4096), 0o600)
    write("wrong_size", bytes(100), 0o600)
    write("empty", b"", 0o600)
    os.mkdir(path_for("directory"), 0o700)
    os.mkfifo(path_for("fifo"), 0o600)
    os.symlink("/etc/passwd", path_for("symlink"))
    return decoys


@pytest.mark.timeout(180)
def test_from_serialized_refuses_untrusted_handles(producer):
    """Run in a subprocess, so that a crash shows as its exit status: each variant of a real
    handle either fails to parse (InvalidHandleError / ValueError / TypeError), or its first use
    (set_value) raises a dtorch error (a RuntimeError) or does nothing. No crash, no hang, and
    nothing reaches the real pairs: they stay pending and then take values through their
    genuine handles. A third real pair has explicit value options (as a CUDA build's default
    pair has "ipc"): its handle truncated at the options' field, or with other options, is a
    valid handle of another delivery, refused at use."""
    real, real_future = file_pair()
    void_real, void_future = file_pair(dtorch_ops.VoidPromise)
    cpu_real = dtorch_ops.TensorPromise(kind="file", device="cpu")
    cpu_future = cpu_real.get_future()
    handle, void_handle, cpu_handle = real.serialize(), void_real.serialize(), cpu_real.serialize()
    assert cpu_handle.endswith(":device=cpu")
    magic, version, kind, type_name, segment, nonce, *_ = handle.split(":")
    prefix = own_name_prefix()
    assert segment.startswith(prefix)
    doorbells = names_owned_by({os.getpid()}) - {segment, segment_of(void_handle),
                                                  segment_of(cpu_handle)}
    other_nonce = os.urandom(16).hex()
    non_dtorch = os.path.join(SHM, f"not_dtorch_fuzz_{os.getpid()}")
    with open(non_dtorch, "wb") as f:
        f.write(bytes(4096))
    os.chmod(non_dtorch, 0o600)
    decoys = make_decoy_segments(prefix)
    try:
        def with_segment(name, nonce_hex=nonce, type_name="tensor"):
            return f"{magic}:{version}:{kind}:{type_name}:{name}:{nonce_hex}"

        # The variants whose refusal must come at first use, with what the error must say.
        refused_at_use = {
            with_segment(segment, other_nonce): "the nonce does not match",
            with_segment(decoys["mode_0644"]): "mode 0600",
            with_segment(decoys["garbage"]): "no control block of this format",
            with_segment(decoys["wrong_size"]): "has 100 bytes, expected 4096",
            with_segment(decoys["empty"]): "has 0 bytes",
            with_segment(decoys["directory"]): "is not a shared memory segment",
            with_segment(decoys["fifo"]): "not a segment of this user with mode 0600",
            with_segment(decoys["symlink"]): "is not a shared memory segment",
        }
        for doorbell in doorbells:
            refused_at_use[with_segment(doorbell)] = "no control block of this format"
        # A real tensor pair named as a void one and the other way round: parsed, refused on use.
        typed_variants = [
            ("VoidPromise", with_segment(segment, type_name="void"),
             "its value type or creator does not match"),
            ("TensorPromise", with_segment(segment_of(void_handle), void_handle.split(":")[5]),
             "its value type or creator does not match"),
        ]
        # Valid handles of the real tensor pairs with other value options than the consumer's.
        altered_options = {variant for genuine in (handle, cpu_handle)
                           for variant in with_other_value_options(genuine)}
        malformed = [
            "", ":", "::::::", "dtorch-promise", "dtorch-promise:1", "dtorch-promise:1:file:",
            "dtorch-promise:1:file:tensor", "dtorch-promise:1:file:tensor::",
            "dtorch-promise:1:file:tensor:::", f"dtorch-promise:2:file:tensor:{segment}:{nonce}",
            f"dtorch-promise:1:memory:tensor:{segment}:{nonce}",
            f"dtorch-promise:1:network:tensor:{segment}:{nonce}",
            f"dtorch-promise:1:file:tensor:{segment}:{nonce}:",
            f"dtorch-promise:1:file:tensor:{segment}:{nonce.upper()}",
            f"dtorch-promise:1:file:tensor:{segment}:{nonce[:-1]}",
            f"dtorch-promise:1:file:tensor:{segment}:{nonce}0",
            f" {handle}", f"{handle} ", f"{handle}\n", handle.upper(),
            with_segment("/dev/shm/" + segment), with_segment("../../etc/passwd"),
            with_segment("/etc/passwd"), with_segment(os.path.basename(non_dtorch)),
            with_segment("dtorch_../../../../etc/passwd"),
            with_segment(prefix.replace(str(os.getpid()), "0") + "0" * 32),
            with_segment(f"dtorch_{2**31}-1_" + "0" * 32),
            with_segment(f"dtorch_1-{'9' * 21}_" + "0" * 32),
            with_segment(segment + "0"), with_segment(segment[:-1]),
            with_segment(segment.upper()), with_segment(segment + "\x00"),
            with_segment("dtorch_1-1-1_" + "0" * 32),  # well formed, names nothing: a no-op
            handle + "\x00", handle.replace(":", "\x00", 1), handle + "\ud800",
            handle + "é", "x" * 513, "dtorch-promise:1:file:" + "a" * 1_000_000,
            "dtorch-promise:1:file:tensor:" + ":".join(["x"] * 100),
        ]
        generated = [variant for genuine in (handle, cpu_handle)
                     for variant in [genuine[:k] for k in range(len(genuine))] +
                     single_character_variants(genuine)]
        variants = [("TensorPromise", text) for text in malformed + generated]
        variants += [("TensorPromise", text) for text in refused_at_use]
        variants += [("TensorPromise", text) for text in sorted(altered_options)]
        variants += [(cls, text) for cls, text, _ in typed_variants]
        variants += [("TensorPromise", void_handle)]  # a VoidPromise's handle
        variants = [(cls, text) for cls, text in dict.fromkeys(variants)
                    if (cls, text) not in {("TensorPromise", handle), ("VoidPromise", void_handle),
                                           ("TensorPromise", cpu_handle)}]

        code = "import file_workers; file_workers.fuzz_from_serialized_main()"
        returncode, out, err = run_python(code, stdin=json.dumps(variants), timeout_s=150)
        results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        crashed_on = variants[len(results)] if len(results) < len(variants) else None
        assert returncode == 0 and not crashed_on, (
            f"the fuzzing process ended with {returncode} at variant {crashed_on!r}; "
            f"stderr:\n{err[-3000:]}")
        assert [r["i"] for r in results] == list(range(len(variants)))

        wrong = []
        for (cls, text), result in zip(variants, results):
            stage = result["stage"]
            if stage == "parse" and not (result["value"] or result["type"]):
                wrong.append(("parse error of the wrong class", cls, text, result))
            elif stage == "use" and not (result["runtime"] and result["message"].startswith(
                    "dtorch")):
                wrong.append(("use error that is no dtorch error", cls, text, result))
        assert not wrong, wrong[:20]

        by_variant = {variant: result for variant, result in zip(variants, results)}
        for text, words in refused_at_use.items():
            result = by_variant[("TensorPromise", text)]
            assert result["stage"] == "use" and words in result["message"], (text, result)
            # (Code that filters untrusted input by type catches every one: a ValueError.)
            assert result["invalid_handle"], (text, result)
        for text in altered_options:
            result = by_variant[("TensorPromise", text)]
            assert result["stage"] == "use" and result["invalid_handle"], (text, result)
            assert "value options are not the consumer's" in result["message"], (text, result)
        for cls, text, words in typed_variants:
            result = by_variant[(cls, text)]
            assert result["stage"] == "use" and result["invalid_handle"], (text, result)
            assert words in result["message"], (text, result)
        result = by_variant[("TensorPromise", void_handle)]
        assert result["stage"] == "parse" and result["invalid_handle"], result
        assert "TensorPromise and VoidPromise are not interchangeable" in result["message"]
        assert by_variant[("TensorPromise", "x" * 513)]["invalid_handle"]
        noop = by_variant[("TensorPromise", with_segment("dtorch_1-1-1_" + "0" * 32))]
        assert noop["stage"] == "noop", noop

        # Non-str handles are refused before the library sees them.
        for bad in (handle.encode(), None, 42, [handle]):
            with pytest.raises(TypeError):
                dtorch_ops.TensorPromise.from_serialized(bad)
    finally:
        for name in decoys.values():
            remove_quietly(os.path.join(SHM, name))
        remove_quietly(non_dtorch)

    # Nothing reached the real pairs: still pending; their genuine handles still work.
    assert not real_future.is_ready() and not void_future.is_ready()
    assert not cpu_future.is_ready()
    producer.call(file_workers.produce, handle, 7.0)
    assert real_future.wait(WAIT_MS).tolist() == [7.0] * 16
    producer.call(file_workers.produce, cpu_handle, 8.0)
    assert cpu_future.wait(WAIT_MS).tolist() == [8.0] * 16
    producer.call(file_workers.produce_void, void_handle)
    assert void_future.wait(WAIT_MS) is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("options", [{}, {"device": "cpu"}, {"zero_copy": True}],
                         ids=["default", "device_cpu", "zero_copy"])
def test_a_handle_with_other_value_options_is_refused(producer, options):
    """The value options (the consumer's choice of delivery) are bound to the pair: a handle with
    them stripped, changed to another valid option or appended is refused with
    InvalidHandleError (at from_serialized or at first use) before anything is claimed, in a
    producer process and in this one, also once this process is attached through the genuine
    handle. The pair stays pending, and its genuine handle delivers."""
    if options.get("zero_copy") and not dtorch_ops._C.has_device_ipc("cuda"):
        pytest.skip("zero_copy needs a dtorch_ops built with CUDA")
    promise = dtorch_ops.TensorPromise(kind="file", **options)
    future = promise.get_future()
    handle = promise.serialize()
    variants = with_other_value_options(handle)
    assert len(variants) == len(VALUE_OPTIONS) - 1

    def refused_here(text):
        with pytest.raises(errors.InvalidHandleError):
            dtorch_ops.TensorPromise.from_serialized(text).set_value(torch.ones(1))

    for text in variants:
        with pytest.raises(errors.InvalidHandleError):
            producer.call(file_workers.produce, text, 1.0)
        refused_here(text)
    # This process attached through the genuine handle (serializing a deserialized copy uses it,
    # claiming nothing): a tampered handle of the same segment is still checked, not served the
    # attachment.
    genuine = dtorch_ops.TensorPromise.from_serialized(handle)
    assert genuine.serialize() == handle
    for text in variants:
        refused_here(text)

    assert not future.is_ready()
    producer.call(file_workers.produce, handle, 3.0)
    assert future.wait(WAIT_MS).tolist() == [3.0] * 16
    del genuine


# ---- 9, 10. resources at scale ------------------------------------------------------------------


def round_trip(i: int, via_handle: bool) -> None:
    promise, future = file_pair()
    target = (dtorch_ops.TensorPromise.from_serialized(promise.serialize()) if via_handle
              else promise)
    target.set_value(torch.full((64,), float(i)))
    value = future.wait(WAIT_MS)
    assert value[0].item() == i and value[-1].item() == i


@pytest.mark.timeout(120)
def test_2000_round_trips_leak_no_memory_fds_or_segments():
    """Half through a from_serialized handle in this process (the producer's path), half through
    the creator's own promise."""
    before = shm_names()
    for i in range(200):  # warm-up: allocator pools, the watcher, lazily made state
        round_trip(i, via_handle=i % 2 == 0)
    gc.collect()
    rss, fds = rss_bytes(), open_fds()
    for i in range(2000):
        round_trip(i, via_handle=i % 2 == 0)
    gc.collect()
    assert rss_bytes() - rss < 20 << 20, f"RSS grew by {(rss_bytes() - rss) >> 20} MiB"
    assert open_fds() - fds < 10
    assert wait_until(lambda: dtorch_ops._C.diagnostics()["doorbell"]["pending_pairs"] == 0, CLEANUP_S)
    # Nothing of the pairs is left; this process's doorbell, made during the test when none was
    # there before it, goes 2 s after its last pending pair (file_kind.h: "Nothing left behind").
    assert wait_until(lambda: not names_owned_by({os.getpid()}, shm_names() - before),
                      CLEANUP_S + 2.0), names_owned_by({os.getpid()}, shm_names() - before)


@pytest.mark.timeout(120)
def test_a_producer_does_not_grow_with_the_promises_it_served():
    """A long-lived producer process serves one promise after another: its memory must not grow
    per promise once the promise is done and dropped. Measured on the producer's path
    (from_serialized, attach, set, drop) in this process; 20,000 promises, < 1 MiB (50 bytes a
    promise; the creator's own path stays around 5 bytes a promise)."""
    def settled_rss() -> int:
        gc.collect()
        time.sleep(0.6)  # (the watcher unmaps the control segments of finished pairs in batches)
        return rss_bytes()

    for i in range(500):
        round_trip(i, via_handle=True)
    rss = settled_rss()
    for i in range(20_000):
        round_trip(i, via_handle=True)
    growth = settled_rss() - rss
    assert growth < 1 << 20, (f"RSS grew by {growth >> 10} KiB over 20,000 promises served "
                              f"({growth / 20_000:.0f} bytes a promise)")


def mappings_of(names: set) -> int:
    """How many mappings of these /dev/shm segments this process has."""
    with open("/proc/self/maps") as maps:
        return sum(line.split("/dev/shm/")[-1].split()[0] in names
                   for line in maps if "/dev/shm/dtorch_" in line)


@pytest.mark.timeout(120)
def test_promises_deserialized_ahead_map_at_most_4096_control_segments():
    """Deserializing maps a promise's control segment ahead of its first use (so that setting it
    makes no system call for it), up to 4096 at a time per process; beyond, promises attach on
    first use. Both kinds work."""
    pairs = [file_pair() for _ in range(5000)]
    handles = [promise.serialize() for promise, _ in pairs]
    names = {handle.split(":")[4] for handle in handles}
    assert mappings_of(names) == 5000  # the creators' own
    copies = [dtorch_ops.TensorPromise.from_serialized(handle) for handle in handles]
    # (Up to 4096 at a time: promises of earlier tests still alive may hold a few of them.)
    assert 5000 + 4000 <= mappings_of(names) <= 5000 + 4096
    for i in (0, 4999):  # mapped ahead; attached on first use
        dtorch_ops.get_tensor(torch.full((4,), float(i)), copies[i])
        assert pairs[i][1].wait(WAIT_MS).tolist() == [float(i)] * 4
    del copies
    gc.collect()
    # Only the creators' mappings are left. (The two used copies' are unmapped by the watcher,
    # in its next round.)
    assert wait_until(lambda: mappings_of(names) == 5000, CLEANUP_S)


@pytest.mark.timeout(120)
def test_10000_pending_futures_cost_at_most_one_thread():
    """Pending file futures share one doorbell watcher thread; dropped, they leave nothing."""
    before = shm_names()
    gc.collect()
    threads = thread_count()
    pairs = [file_pair() for _ in range(10_000)]
    assert dtorch_ops._C.diagnostics()["doorbell"]["pending_pairs"] >= 10_000
    assert dtorch_ops.library_threads()["doorbell"] == 1
    assert thread_count() - threads <= 1
    assert len(names_owned_by({os.getpid()}, shm_names() - before)) == 10_000
    assert not any(future.is_ready() for _, future in pairs[::500])

    del pairs
    gc.collect()
    assert wait_until(lambda: dtorch_ops._C.diagnostics()["doorbell"]["pending_pairs"] == 0, 10.0)
    assert wait_until(lambda: not names_owned_by({os.getpid()}, shm_names() - before), 10.0)


@pytest.mark.timeout(120)
def test_sets_for_a_killed_consumer_leave_nothing_in_a_small_dev_shm():
    """A controller SIGKILLed with pairs in flight, its worker setting them: no payload is made
    for the dead consumer and what it left is unlinked at the first set, so 20 values of 8 MiB
    fit a 64 MiB /dev/shm (a private tmpfs in a mount namespace of the test's) and nothing of
    it is left after the sets."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) (util-linux)")
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /dev/shm"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("mount namespaces are not permitted here: " + probe.stderr.decode()[-200:])
    script = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
              "import file_workers; file_workers.sets_for_a_killed_consumer_main()")
    run = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         'mount -t tmpfs -o size=64m,mode=1777 tmpfs /dev/shm && "$0" -c "$1" 20 && '
         'echo "LEFT $(ls /dev/shm | wc -l)"', sys.executable, script],
        capture_output=True, text=True, timeout=100, cwd=ROOT, env=python_env())
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    sets, left = lines[:-1], lines[-1]["left"]
    assert len(sets) == 20
    assert [s["error"] for s in sets] == [None] * 20
    # (Each set returns with nothing of the value left: at most a few pages of the pairs'.)
    assert max(s["used_bytes"] for s in sets) < 1 << 20, sets
    assert left == []
    assert run.stdout.splitlines()[-1] == "LEFT 0", run.stdout[-500:]
