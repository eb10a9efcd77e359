"""Helpers and fixtures shared by the failure tests of "file" promises (test_file_failures.py,
test_file_untrusted.py, test_file_scale.py): /dev/shm segment names and modes, waiting and process
state, child processes (Child, run_python), and the fixtures. Not a test module.

Pytest registers the fixtures a test module imports into its namespace, so each of those modules
imports the fixtures it uses by name, and always the autouse `nothing_left_in_shm` (autouse
applies only where it is imported). `producer` is module-scoped: one spawned producer process per
test module that uses it. `_child_pids` is shared by them all: the segments of every child
process any of them started are checked for leaks.
"""
import gc
import multiprocessing
import os
import re
import signal
import stat
import subprocess
import sys
import time

import pytest
import torch.multiprocessing as torch_mp

import dtorch_ops
import file_workers
from producer_process import ProducerProcess

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

# Every child process these modules started: their segments are checked for leaks too.
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
