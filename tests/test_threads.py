"""The library's threads: detectors per device stream (capped, shared beyond the cap, woken one at a
time, exiting when idle), blocking waits or polling, and what happens at exit and fork. On the
simulated device (its streams are threads of their own, and it registers a blocking wait)."""
import time

import pytest
import torch

import dtorch_ops
from dtorch_ops import _C
from conftest import WAIT_MS, detector_threads, run_python



@pytest.fixture
def sim():
    import devices

    dev = devices.SimDev()
    dev.synchronize()
    yield dev
    dev.synchronize()


@pytest.fixture
def settings():
    """Restores dtorch_ops.config's thread settings after the test."""
    config = dtorch_ops.config
    saved = (config.max_detector_threads, config.detector_idle_exit_s, config.file_payload_idle_s)
    yield config
    (config.max_detector_threads, config.detector_idle_exit_s,
     config.file_payload_idle_s) = saved


@pytest.fixture(params=[True, False], ids=["blocking-wait", "polling"])
def wait_mode(request, sim):
    """Runs the test with simdev's blocking wait registered, and without (detectors poll)."""
    torch.ops.simdev.set_blocking_wait(request.param)
    yield request.param
    torch.ops.simdev.set_blocking_wait(True)


def _wait_until(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.005)
    return predicate()


def _held_streams(sim, count):
    """`count` new streams, each busy until its release() is called: [(stream, release)]."""
    streams = []
    for _ in range(count):
        stream = torch.ops.simdev.new_stream()
        with sim.using_stream(stream):
            streams.append((stream, sim.hold()))
    return streams


def _values_on(sim, streams, per_stream):
    """per_stream futures on each stream, behind its held work: {stream: [(future, expected)]}."""
    futures = {}
    for index, (stream, _) in enumerate(streams):
        with sim.using_stream(stream):
            futures[stream] = []
            for i in range(per_stream):
                value = float(index * 1000 + i)
                futures[stream].append(
                    (dtorch_ops.to_torch_async(torch.full((2,), value, device="simdev")), value))
    return futures


@pytest.mark.parametrize("cap", [32, 4])
def test_200_streams_use_at_most_the_cap_of_detectors(sim, settings, wait_mode, cap):
    settings.max_detector_threads = cap
    assert _wait_until(lambda: detector_threads() <= cap)  # idle ones beyond the cap exit
    streams = _held_streams(sim, 200)
    try:
        futures = _values_on(sim, streams, per_stream=3)
        assert _C.diagnostics()["detectors"]["active_streams"] == 200
        # Every detector started for these streams is busy: exactly the cap, counted by name.
        assert detector_threads() == cap == dtorch_ops.library_threads()["detectors"]
        assert not any(f.is_ready() for fs in futures.values() for f, _ in fs)
    finally:
        for _, release in streams:
            release()
    for fs in futures.values():
        for future, expected in fs:
            assert torch.equal(future.wait(WAIT_MS).cpu(), torch.full((2,), expected))
    assert _wait_until(lambda: _C.diagnostics()["detectors"]["pending"] == 0)
    assert detector_threads() <= cap


def test_completions_of_a_stream_stay_in_order(sim, settings, wait_mode):
    settings.max_detector_threads = 1  # three streams share one detector
    assert _wait_until(lambda: detector_threads() <= 1)
    streams = _held_streams(sim, 3)
    futures = []
    for stream, _ in streams:
        with sim.using_stream(stream):
            stream_futures = []
            for i in range(40):
                sim.sleep(1)  # the values land one by one
                stream_futures.append(dtorch_ops.to_torch_async(torch.full((1,), float(i),
                                                                           device="simdev")))
            futures.append(stream_futures)
    for _, release in streams:
        release()
    # Seen at any moment, each stream's ready values are a prefix of its values. Read from the last
    # to the first: a value ready when read implies (in order) every earlier one ready after it.
    deadline = time.monotonic() + WAIT_MS / 1000
    while time.monotonic() < deadline:
        snapshot = [[f.is_ready() for f in reversed(fs)][::-1] for fs in futures]
        for ready in snapshot:
            assert ready == sorted(ready, reverse=True), f"out of order: {ready}"
        if all(all(ready) for ready in snapshot):
            break
    for fs in futures:
        assert [f.get().cpu().item() for f in fs] == [float(i) for i in range(40)]


def _settled_wakeups():
    """The detectors' notified wake-ups, once no wake-up (a setting's, say) is still on its way."""
    count = _C.diagnostics()["detectors"]["notified_wakeups"]
    for _ in range(100):
        time.sleep(0.05)
        latest = _C.diagnostics()["detectors"]["notified_wakeups"]
        if latest == count:
            break
        count = latest
    return count


def test_a_submission_wakes_only_the_detector_it_goes_to(sim, settings):
    settings.detector_idle_exit_s = 60  # idle detectors stay for the test
    assert _wait_until(lambda: _C.diagnostics()["detectors"]["pending"] == 0)
    streams = _held_streams(sim, 4)  # four busy streams: four detectors, idle afterwards
    futures = _values_on(sim, streams, per_stream=1)
    for _, release in streams:
        release()
    for fs in futures.values():
        fs[0][0].wait(WAIT_MS)
    assert _wait_until(lambda: _C.diagnostics()["detectors"]["active_streams"] == 0)
    idle = detector_threads()
    assert idle >= 4
    before = _settled_wakeups()  # all are in their idle wait
    ((stream, release),) = _held_streams(sim, 1)
    with sim.using_stream(stream):
        futures = [dtorch_ops.to_torch_async(torch.ones(1, device="simdev"))]
        assert _wait_until(lambda: _C.diagnostics()["detectors"]["notified_wakeups"] == before + 1)
        # More values on the now active stream wake nobody; no thread is started either.
        futures += [dtorch_ops.to_torch_async(torch.ones(1, device="simdev")) for _ in range(50)]
    time.sleep(0.05)
    assert _C.diagnostics()["detectors"]["notified_wakeups"] == before + 1
    assert detector_threads() == idle
    release()
    for future in futures:
        future.wait(WAIT_MS)


def test_idle_detectors_exit(sim, settings):
    settings.detector_idle_exit_s = 0.1
    settings.file_payload_idle_s = 0.1  # (payload segments earlier tests kept: the watcher's)
    pool = dtorch_ops.library_threads()["pool"]  # (started on first use, then kept: 0 or 2)
    streams = _held_streams(sim, 3)
    futures = _values_on(sim, streams, per_stream=1)
    assert detector_threads() >= 3
    for _, release in streams:
        release()
    for fs in futures.values():
        fs[0][0].wait(WAIT_MS)
    assert _wait_until(lambda: detector_threads() == 0, timeout_s=5), "idle detectors stayed"
    # (The watcher also goes once no file pair is pending and the kept payloads were released.)
    # (The network kind's tick thread, once a network pair was made in this process, runs until
    # it exits: not a detector's business.)
    assert _wait_until(lambda: {k: v for k, v in dtorch_ops.library_threads().items()
                                if k != "network"} == {"detectors": 0, "pool": pool, "doorbell": 0},
                       timeout_s=5), dtorch_ops.library_threads()
    # A later value starts a detector again.
    assert torch.equal(dtorch_ops.to_torch(torch.ones(2, device="simdev") * 3).cpu(),
                       torch.full((2,), 3.0))


def test_values_complete_whether_the_device_blocks_or_is_polled(sim, wait_mode):
    x = torch.ones(8, device="simdev")
    sim.sleep(50)
    y = x * 5
    future = dtorch_ops.to_torch_async(y)
    sync = dtorch_ops.sync_async()
    assert not future.is_ready()
    assert torch.equal(future.wait(WAIT_MS).cpu(), torch.full((8,), 5.0))
    sync.wait(WAIT_MS)
    with sim.side_stream():
        sim.sleep(20)
        sim.fail("fault (simulated)")
        failed = dtorch_ops.to_torch_async(torch.ones(1, device="simdev"))
    with pytest.raises(RuntimeError, match="device error: simdev:0 reported: .*fault"):
        failed.wait(WAIT_MS)


def test_the_settings_check_their_values(settings):
    for name, bad, error in [("max_detector_threads", 0, ValueError),
                             ("max_detector_threads", 2.5, TypeError),
                             ("max_detector_threads", True, TypeError),
                             ("detector_idle_exit_s", 0, ValueError),
                             ("detector_idle_exit_s", float("nan"), ValueError),
                             ("pool_threads", 0, ValueError),
                             ("exit_timeout_s", -1, ValueError),
                             ("exit_timeout_s", float("-inf"), ValueError),
                             ("exit_timeout_s", "1", TypeError)]:
        before = getattr(settings, name)
        with pytest.raises(error, match=f"dtorch_ops.config.{name}"):
            setattr(settings, name, bad)
        assert getattr(settings, name) == before
    settings.detector_idle_exit_s = 0.5
    assert settings.detector_idle_exit_s == 0.5
    settings.max_detector_threads = 7
    assert settings.max_detector_threads == 7
    assert "max_detector_threads=7" in repr(settings)



def test_a_later_atexit_handler_gets_an_error_not_a_hang():
    # A handler registered before `import dtorch_ops` runs after dtorch_ops' own (atexit is last
    # in, first out): the value it waits for is still pending then (the stream is held and the
    # simulated device is not drained at exit here), so its get() must raise.
    proc = run_python("""
        import atexit, threading, time
        pending = {}

        def flush_metrics():
            started = time.monotonic()
            try:
                pending["loss"].get()
                print("flush: got a value")
            except RuntimeError as e:
                print(f"flush: {e}")
            print(f"flush: after {time.monotonic() - started:.2f} s")

        atexit.register(flush_metrics)
        import torch, dtorch_ops, devices, simdev
        dev = devices.SimDev()
        atexit.unregister(torch.ops.simdev.drain_at_exit)
        dtorch_ops.config.exit_timeout_s = 0.2
        dev.hold()  # never released
        pending["loss"] = dtorch_ops.to_torch_async(torch.ones(1, device="simdev") * 2)
        other = dtorch_ops.to_torch_async(torch.ones(1, device="simdev"))
        # A thread blocked in get() at exit is woken too (and parks instead of re-taking the GIL).
        threading.Thread(target=other.get, daemon=True).start()
        print("exiting")
    """)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "exiting" in out
    assert "flush: dtorch: dropped at interpreter exit: the value was still pending" in out, out
    assert "Fatal Python error" not in proc.stderr


def test_fork_with_pending_values():
    proc = run_python("""
        import os, threading, time, torch, dtorch_ops, devices
        dev = devices.SimDev()
        release = dev.hold()
        y = torch.ones(3, device="simdev") * 7
        future = dtorch_ops.to_torch_async(y)
        got = {}
        # Blocked in get() across the fork: the child must not wait for this thread.
        waiter = threading.Thread(target=lambda: got.setdefault("value", future.get()))
        waiter.start()
        assert dtorch_ops.library_threads()["detectors"] == 1
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                try:
                    future.wait(10_000)
                    print("child: got a value")
                    code = 1
                except RuntimeError as e:
                    print("child:", e)
                threads = dtorch_ops.library_threads()
                print("child threads:", threads)
                code |= 2 * (threads != {"detectors": 0, "pool": 0, "doorbell": 0, "network": 0})
                # The library works in the child for new values (the device's own threads did
                # not survive fork: new values there are on the CPU).
                promise = dtorch_ops.TensorPromise()
                child_future = promise.get_future()
                threading.Thread(target=promise.set_value, args=(torch.ones(2),)).start()
                code |= 4 * (not torch.equal(child_future.wait(10_000), torch.ones(2)))
                code |= 8 * (not torch.equal(dtorch_ops.to_torch(torch.ones(2) * 3),
                                             torch.full((2,), 3.0)))
                dtorch_ops.sync([torch.device("cpu")])
                # Nothing of the parent's is left to wait for at exit (the old poller's count of
                # threads in flight made each exit in a child wait its whole second).
                started = time.monotonic()
                dtorch_ops._C.stop_library_threads()
                code |= 16 * (time.monotonic() - started > 0.5)
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        release()
        waiter.join(10)
        print("parent value:", got["value"].cpu().tolist())
        print("child exit:", os.waitstatus_to_exitcode(status))
    """)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "child: dtorch: dropped at fork: the value was pending in the parent process" in out, out
    assert "child exit: 0" in out, out
    assert "parent value: [7.0, 7.0, 7.0]" in out
