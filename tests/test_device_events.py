"""A device type's own events (dtorch::RegisterDeviceEvents) and its graph-capture check
(dtorch::RegisterCaptureCheck), on the simulated device: its events can be waited for with a
timeout (the default), untimed like CUDA's cudaEventSynchronize, or polled; and a stream can be
marked as capturing, like one inside torch.cuda.graph(). tests/test_threads.py covers the timed and
polled waits; here the untimed ones (the cap, exit, fork) and the refusal under capture."""
import time

import pytest
import torch

import dtorch_ops
from conftest import WAIT_MS, detector_threads, run_python



@pytest.fixture
def sim():
    import devices

    dev = devices.SimDev()
    dev.synchronize()
    yield dev
    torch.ops.simdev.set_blocking_wait(True)
    dev.synchronize()


@pytest.fixture
def untimed(sim):
    """The simulated device's events wait untimed (as CUDA's) during the test."""
    torch.ops.simdev.set_blocking_wait(True, timed=False)
    yield sim


@pytest.fixture
def cap():
    """Sets dtorch_ops.config.max_detector_threads for the test (idle detectors beyond it exit)."""
    config = dtorch_ops.config
    saved = config.max_detector_threads

    def set_cap(n):
        config.max_detector_threads = n
        assert _wait_until(lambda: detector_threads() <= n)

    yield set_cap
    config.max_detector_threads = saved


def _wait_until(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.005)
    return predicate()


def _held_value(sim, value):
    """A new stream held busy, and a future for `value` behind its held work: (future, release)."""
    stream = torch.ops.simdev.new_stream()
    with sim.using_stream(stream):
        release = sim.hold()
        future = dtorch_ops.to_torch_async(torch.full((2,), float(value), device="simdev"))
    return future, release


def test_untimed_waits_complete_values_in_order(untimed):
    x = torch.ones(4, device="simdev")
    release = untimed.hold()
    futures = []
    try:
        for i in range(20):
            untimed.sleep(1)
            futures.append(dtorch_ops.to_torch_async(x * i))
        time.sleep(0.05)
        assert not any(f.is_ready() for f in futures)
    finally:
        release()  # (a failure above must not leave the stream held: teardown syncs it)
    for i, future in enumerate(futures):
        assert torch.equal(future.wait(WAIT_MS).cpu(), torch.full((4,), float(i)))
    # A device fault reaches the value through the untimed wait too.
    with untimed.side_stream():
        untimed.sleep(20)
        untimed.fail("fault (simulated)")
        failed = dtorch_ops.to_torch_async(torch.ones(1, device="simdev"))
    with pytest.raises(RuntimeError, match="device error: simdev:0 reported: .*fault"):
        failed.wait(WAIT_MS)


def test_below_the_cap_a_new_stream_is_not_queued_behind_an_untimed_wait(untimed, cap):
    cap(3)
    held = [_held_value(untimed, i) for i in range(2)]
    try:
        time.sleep(0.1)  # both detectors are in their untimed waits
        free = dtorch_ops.to_torch_async(torch.full((2,), 7.0, device="simdev"))
        assert torch.equal(free.wait(WAIT_MS).cpu(), torch.full((2,), 7.0))
        assert not any(f.is_ready() for f, _ in held)
    finally:
        for _, release in held:
            release()
    for i, (future, _) in enumerate(held):
        assert torch.equal(future.wait(WAIT_MS).cpu(), torch.full((2,), float(i)))


@pytest.mark.parametrize("timed", [True, False], ids=["timed", "untimed"])
def test_at_the_cap_a_new_stream_shares_a_detector(sim, cap, timed):
    torch.ops.simdev.set_blocking_wait(True, timed=timed)
    cap(2)
    held = [_held_value(sim, i) for i in range(2)]
    try:
        time.sleep(0.1)  # both detectors are in their waits
        free = dtorch_ops.to_torch_async(torch.full((2,), 7.0, device="simdev"))
        if timed:
            # A timed wait sees the new stream when its slice ends.
            assert _wait_until(free.is_ready)
        else:
            # Every detector is in an untimed wait: the last choice, the new stream waits for the
            # wait it was given to (documented: an untimed wait sees nothing else meanwhile).
            time.sleep(0.3)
            assert not free.is_ready()
        assert detector_threads() <= 2
    finally:
        for _, release in held:
            release()
    assert torch.equal(free.wait(WAIT_MS).cpu(), torch.full((2,), 7.0))
    for i, (future, _) in enumerate(held):
        assert torch.equal(future.wait(WAIT_MS).cpu(), torch.full((2,), float(i)))



def test_exit_does_not_wait_for_an_untimed_wait():
    # The detector sleeps in an untimed wait on a stream held forever: exit cannot wake it, drops
    # the value at once (not after exit_timeout_s) and abandons the detector.
    proc = run_python("""
        import atexit, time
        state = {}

        def after_dtorch_stopped():  # registered first: runs after dtorch_ops' handler
            try:
                state["loss"].get()
                print("late: got a value")
            except RuntimeError as e:
                print(f"late: {e}")
            print(f"exit took {time.monotonic() - state['exiting']:.2f} s")

        atexit.register(after_dtorch_stopped)
        import torch, dtorch_ops, devices
        dev = devices.SimDev()
        atexit.unregister(torch.ops.simdev.drain_at_exit)
        torch.ops.simdev.set_blocking_wait(True, timed=False)
        dtorch_ops.config.exit_timeout_s = 5
        dev.hold()  # never released
        state["loss"] = dtorch_ops.to_torch_async(torch.ones(1, device="simdev") * 2)
        time.sleep(0.1)  # the detector is in its wait
        state["exiting"] = time.monotonic()
    """)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "late: dtorch: dropped at interpreter exit" in out, out
    took = float(out.split("exit took ")[1].split(" s")[0])
    assert took < 2.0, out
    assert "Fatal Python error" not in proc.stderr


def test_fork_with_a_detector_in_an_untimed_wait():
    proc = run_python("""
        import os, time, torch, dtorch_ops, devices
        dev = devices.SimDev()
        torch.ops.simdev.set_blocking_wait(True, timed=False)
        release = dev.hold()
        future = dtorch_ops.to_torch_async(torch.ones(3, device="simdev") * 7)
        time.sleep(0.1)  # the detector is in its wait
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                try:
                    future.wait(10_000)
                    code = 1
                except RuntimeError as e:
                    print("child:", e, flush=True)
                started = time.monotonic()
                dtorch_ops._C.stop_library_threads()
                code |= 2 * (time.monotonic() - started > 0.5)
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        release()
        print("parent value:", future.wait(10_000).cpu().tolist())
        print("child exit:", os.waitstatus_to_exitcode(status))
    """)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "child: dtorch: dropped at fork" in out, out
    assert "child exit: 0" in out, out
    assert "parent value: [7.0, 7.0, 7.0]" in out, out


class _Capturing:
    """Marks the current simdev stream as being captured into a graph inside the block."""

    def __enter__(self):
        torch.ops.simdev.set_capturing(True)

    def __exit__(self, *exc):
        torch.ops.simdev.set_capturing(False)


def test_calls_on_a_capturing_stream_are_refused(sim):
    x = torch.ones(3, device="simdev") * 2
    refused = "cannot run while the current stream of simdev:0 is being captured"
    with _Capturing():
        with pytest.raises(RuntimeError, match=refused + ".*after graph.replay"):
            dtorch_ops.to_torch_async(x)
        with pytest.raises(RuntimeError, match="copy_to_host_async " + refused):
            dtorch_ops.to_torch_async(x, device="cpu")
        with pytest.raises(RuntimeError, match="copy_list_to_host_async " + refused):
            dtorch_ops.to_torch_async([x, x], device="cpu")
        with pytest.raises(RuntimeError, match=refused):
            dtorch_ops.sync([torch.device("simdev:0")])
        promise = dtorch_ops.TensorPromise()
        future = promise.get_future()
        with pytest.raises(RuntimeError, match="get_tensor " + refused):
            dtorch_ops.get_tensor(x, promise)
        # Refused before anything was claimed (memory and file promises alike): the promise
        # can still be set.
        assert not future.is_ready()
        file_promise = dtorch_ops.TensorPromise(kind="file")
        file_future = file_promise.get_future()
        with pytest.raises(RuntimeError, match="get_tensor " + refused):
            dtorch_ops.get_tensor(x, file_promise)
        # Another stream, not captured, is served as usual.
        with sim.side_stream():
            assert torch.equal(dtorch_ops.to_torch_async(x).wait(WAIT_MS).cpu(),
                               torch.full((3,), 2.0))
    # Outside the captured region: served, the refused promises too.
    dtorch_ops.get_tensor(x, promise)
    dtorch_ops.get_tensor(x, file_promise)
    assert torch.equal(future.wait(WAIT_MS).cpu(), torch.full((3,), 2.0))
    assert torch.equal(file_future.wait(WAIT_MS).cpu(), torch.full((3,), 2.0))
    assert torch.equal(dtorch_ops.to_torch_async(x).wait(WAIT_MS).cpu(), torch.full((3,), 2.0))
    assert torch.equal(dtorch_ops.to_torch_async(x, device="cpu").wait(WAIT_MS),
                       torch.full((3,), 2.0))
    dtorch_ops.sync([torch.device("simdev:0")])
