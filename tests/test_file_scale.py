"""Resources of "file" promises at scale: memory, fds, threads and /dev/shm. 2000 round trips leak
nothing; a long-lived producer does not grow with the promises it served; deserialized promises
map at most 4096 control segments ahead; 10,000 pending futures cost at most one thread; sets for
a killed consumer leave nothing in a small /dev/shm. The contract is the comment at the top of
csrc/core/kinds/file/file_kind.h.

Part of the failure tests of test_file_failures.py, whose helpers and fixtures
(file_failure_helpers.py) it shares. The pairs are set in this process, or in a subprocess in a
mount namespace of its own. After every test nothing of the processes it used may be left in
/dev/shm (the autouse `nothing_left_in_shm`).
"""
import gc
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

import dtorch_ops
from conftest import WAIT_MS
from file_failure_helpers import (CLEANUP_S, ROOT, file_pair, names_owned_by, open_fds,
                                  python_env, rss_bytes, shm_names, thread_count, wait_until)
# The autouse fixture: pytest finds it in this module's namespace.
from file_failure_helpers import nothing_left_in_shm  # noqa: F401


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
