"""The examples run as users run them (the demo: tests/test_demo.py): each as a script, from the
repository's root, within a bounded time, printing what it checked and ending "<name>: OK"."""
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_example(*args, timeout=240):
    try:
        proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(args)} ran past {timeout} s:\n{e.stdout}\n{e.stderr}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _ends_ok(out, name):
    assert out.rstrip().splitlines()[-1] == f"{name}: OK", out


def test_quickstart():
    out = _run_example("examples/quickstart.py")
    assert "aliases y: True" in out and "broken promise" in out
    assert "scripted: [0.0, 2.0, 4.0]" in out
    assert "host copies on cpu: loss" in out
    assert "value from another process: [4.0, 4.0, 4.0, 4.0]" in out


def test_training_logging():
    """Eager (host copies + callbacks) and compiled (an in-graph future, and a metric that is not
    a graph output through a promise): the logged values are .item()'s. The first run on a
    machine compiles inductor's kernels (torch caches them)."""
    out = _run_example("examples/training_logging.py", timeout=280)
    assert "eager: 12 losses logged by callbacks, equal to .item()" in out, out
    assert "compiled: 12 losses from in-graph futures, equal to .item()" in out, out
    assert "compiled: 12 mean absolute errors through promises (not graph outputs), equal to " \
           "eager" in out, out
    _ends_ok(out, "training_logging")


def test_controller_workers():
    """A worker crashes before fulfilling its promise: the controller's future fails with
    BrokenPromiseError within seconds, and the task is reissued to a healthy worker."""
    out = _run_example("examples/controller_workers.py", timeout=180)
    crash = re.search(r"task 1: worker 1 crashed \(exit code 1\); BrokenPromiseError ([\d.]+) s "
                      r"after the task was sent: dtorch: broken promise: producer died "
                      r"\(pid \d+\)", out)
    assert crash, out
    assert float(crash.group(1)) < 10, out  # the library notices a death within about a second
    assert re.search(r"task 1: reissued to worker [02]\n", out), out
    for task, total in ((0, 0), (1, 64), (2, 256)):
        assert re.search(rf"task {task}: value from worker \d, sum {total}\n", out), out
    assert "all 3 results correct" in out, out
    _ends_ok(out, "controller_workers")


def test_asyncio_server():
    out = _run_example("examples/asyncio_server.py", timeout=120)
    assert re.search(r"200 responses in [\d.]+ s, from \d+ batches", out), out
    assert "responses equal the model's output: True" in out, out
    assert "(no thread per request)" in out and "event loop free: the heartbeat ticked" in out, out
    _ends_ok(out, "asyncio_server")


def test_network_two_processes():
    out = _run_example("examples/network_two_processes.py", timeout=180)
    assert "rank 1: promise fulfilled" in out, out
    assert "rank 0: value from rank 1: [[0.0, 10.0, 20.0], [30.0, 40.0, 50.0]]" in out, out
    _ends_ok(out, "network_two_processes")


def test_torchscript_to_cpp(tmp_path):
    """The example saves the module examples/cpp loads (tests/cpp_programs.py saves it with the
    example's own function, for the C++ tests); here: the script, given a path, as a user runs
    it, and the saved module reloaded in a fresh process."""
    path = str(tmp_path / "doubler.pt")
    out = _run_example("examples/torchscript_to_cpp.py", path, timeout=120)
    assert f"saved the scripted module to {path}" in out, out
    assert "reloaded in Python: forward([0.0, 1.0, 2.0, 3.0]) = [0.0, 2.0, 4.0, 6.0]" in out, out
    assert f"build/cpp/dtorch_cpp_example {path}" in out, out
    _ends_ok(out, "torchscript_to_cpp")
    check = ("import sys, torch, dtorch_ops\n"
             "m = torch.jit.load(sys.argv[1])\n"
             "print(m(torch.arange(3.0)).tolist())\n")
    assert _run_example("-c", check, path, timeout=120).strip() == "[0.0, 2.0, 4.0]"


def test_host_copy():
    out = _run_example("examples/host_copy.py", timeout=120)
    assert re.search(r"loss on cpu: [\d.]+ \(requires_grad False\); \[loss, acc\]", out), out
    assert "on the CPU the future yields the tensor itself: True" in out, out
    assert "5 steps logged from host copies" in out, out
    _ends_ok(out, "host_copy")
