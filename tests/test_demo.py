"""examples/demo.py runs as `make demo` runs it, in its short mode (timings are printed, never
asserted: they depend on the machine and on its load)."""
import os
import re
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(600)
def test_demo_short():
    # The demo compiles the simulated device on first use (tests/simdev/build), which the suite's
    # device tests share; the short run itself takes well under a minute.
    try:
        proc = subprocess.run([sys.executable, "examples/demo.py", "--short"], cwd=REPO,
                              capture_output=True, text=True, timeout=540)
    except subprocess.TimeoutExpired as e:  # (what it printed says where it stood)
        pytest.fail(f"the demo did not end within 540 s:\n{e.stdout or ''}{e.stderr or ''}")
    out = proc.stdout
    print(out)
    assert proc.returncode == 0, out + proc.stderr
    if torch.cuda.is_available():
        assert "== 1. Training loop on cuda" in out, out
        assert "simulated device is skipped" in out
    else:
        # The CPU part: both loops, the same losses, and why no gain is expected there.
        cpu = out[out.index("== 1a. Training loop on cpu"):out.index("== 1b.")]
        assert "loss.item() every step" in cpu and "to_torch_async + done-callback" in cpu
        assert "logged losses identical in both loops: True" in cpu
        assert "no gain expected on cpu: CPU ops are synchronous" in cpu
        assert re.search(r"futures / \.item\(\) loop time: \d+\.\d+x", cpu)
        assert re.search(r"logging one loss costs \d+\.\d+ us with a future, \d+\.\d+ us with "
                         r"\.item\(\): \d+\.\d+x a \d+\.\d+ ms step\n  \(target <= 1\.05x: ", cpu), cpu
        # The simulated device: both loops ran there and logged identical losses.
        sim = out[out.index("== 1b. Training loop on the simulated device"):out.index("== 2.")]
        assert "kernels that take real time on a stream" in sim
        assert re.search(r"loss\.cpu\(\)\.item\(\) every step +\d+\.\d+ +\d+\.\d+", sim), sim
        assert re.search(r"to_torch_async \+ done-callback +\d+\.\d+ +\d+\.\d+", sim), sim
        assert "logged losses identical in both loops: True" in sim
        assert re.search(r"=> futures: \d+\.\d+x (faster|slower) per step", sim), sim
    # The asyncio part: the plain-asyncio baseline and ours, each a row of numbers.
    service = out[out.index("== 2. asyncio service"):]
    for label in ("asyncio.Future + call_soon_threadsafe", "dtorch_ops futures"):
        assert re.search(re.escape(label) + r" +[\d,]+ +\d+\.\d+ +\d+\.\d+ +\d+\.\d+ +\d+",
                         service), service
    assert "200 requests, 64 in flight" in service
    assert out.rstrip().splitlines()[-1].startswith("demo: OK")
