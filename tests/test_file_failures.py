"""Failure and safety behaviour of "file" promises: pairs across processes of one host, over
POSIX shared memory (/dev/shm). The contract is the comment at the top of csrc/core/kinds/file/file_kind.h.

Covered: producers that die (SIGKILL, os._exit), exit, or drop the promise without setting it; a
producer killed while copying a large value or while holding the promise's interprocess lock; a
creator dropping its promise in flight; a consumer killed first; segment modes. Untrusted
serialized handles are in test_file_untrusted.py, memory, fds, threads and /dev/shm at scale in
test_file_scale.py; the helpers and fixtures of all three are in file_failure_helpers.py.

One spawned producer process serves the whole module (the `producer` fixture); tests that kill or
end a producer start their own, forked where the child needs no CUDA (fast). After every test
nothing of the processes it used may be left in /dev/shm (the autouse `nothing_left_in_shm`).
"""
import asyncio
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
from file_failure_helpers import (CLEANUP_S, DEATH_NOTICED_S, FORK, SHM, SPAWN, Child,
                                  assert_holding, assert_private_segment, file_pair,
                                  names_owned_by, run_python, segment_of, shm_names, wait_until,
                                  wait_until_paused)
# Fixtures: pytest finds them in this module's namespace (nothing_left_in_shm is autouse).
from file_failure_helpers import attach_timeout, nothing_left_in_shm, producer  # noqa: F401, F811


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
