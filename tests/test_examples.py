"""The examples run as users run them (the demo in its short mode)."""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_example(*args):
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_demo_short():
    out = _run_example("examples/demo.py", "--short")
    assert "logged losses identical: True" in out
    assert "200 responses" in out
    assert "threads added while serving: 0" in out
    assert out.rstrip().endswith("demo: OK")


def test_quickstart():
    out = _run_example("examples/quickstart.py")
    assert "aliases y: True" in out and "broken promise" in out and "scripted: [0.0, 2.0, 4.0]" in out
    assert "host copies on cpu: loss" in out
    assert "value from another process: [4.0, 4.0, 4.0, 4.0]" in out
