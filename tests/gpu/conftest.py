"""tests/gpu: the GPU checks (scripts/device_check.sh runs them on a GPU machine), and which device
they run on, chosen by DTORCH_GPU_TESTS:

- unset, "" or "auto": CUDA where torch sees a GPU; elsewhere every test here skips (plain
  `pytest tests` in CI);
- "cuda": CUDA, and a usage error where torch sees no GPU (a GPU check must not pass by skipping);
- "simdev": the simulated device (tests/simdev), even where CUDA is present
  (`scripts/device_check.sh --simdev`, which `make test` runs in CI).

A test takes the device from the `gpu` fixture (a devices.Cuda or devices.SimDev: sleep, hold,
side_stream, new_stream, using_stream, synchronize, track, ...; `gpu.name` is the torch device
type). A test that only CUDA can run (CUDA graphs, torch.cuda's clock, CUDA IPC) is marked
`@cuda_only("why")`: it then skips on the simulated device, saying so. conftest.CUDA (the top-level
marker) still works here: it runs where CUDA is present, whatever the mode.

pytest imports every conftest.py of a folder without __init__.py as the module `conftest`, the last
one loaded winning: this one is loaded after tests/conftest.py, so `from conftest import ...`
anywhere (top-level tests too) gets this module. It therefore re-exports everything public of
tests/conftest.py (WAIT_MS, CUDA, require_tool, ...) unchanged, and adds GPU_MODE, cuda_only and
the `gpu` fixture."""
import importlib.util
import os

import pytest
import torch

_TOP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")
_spec = importlib.util.spec_from_file_location("dtorch_tests_conftest", _TOP)
_top = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_top)
# Hooks (pytest_*) are not copied: pytest already runs tests/conftest.py's own.
globals().update({name: value for name, value in vars(_top).items()
                  if not name.startswith(("_", "pytest_"))})

MODES = ("auto", "cuda", "simdev")


def _mode():
    """"cuda", "simdev", or None (nothing to run on: the tests skip)."""
    asked = os.environ.get("DTORCH_GPU_TESTS", "").strip().lower() or "auto"
    if asked not in MODES:
        raise pytest.UsageError(f"DTORCH_GPU_TESTS={asked!r}: expected one of {', '.join(MODES)}")
    if asked == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("DTORCH_GPU_TESTS=cuda, but torch sees no CUDA device "
                                f"(torch {torch.__version__}, CUDA {torch.version.cuda})")
    if asked == "auto":
        return "cuda" if torch.cuda.is_available() else None
    return asked


GPU_MODE = _mode()
_NO_DEVICE = ("needs a CUDA device (DTORCH_GPU_TESTS=simdev runs the tests that are not CUDA-only "
              "on the simulated device)")


def cuda_only(why: str):
    """Marks a test that only CUDA can run; `why` says what it needs of CUDA."""
    if GPU_MODE == "simdev":
        reason = f"CUDA only ({why}): DTORCH_GPU_TESTS=simdev runs the simulated device"
    else:
        reason = _NO_DEVICE
    return pytest.mark.skipif(GPU_MODE != "cuda", reason=reason)


_device = None


def gpu_device():
    """The device object of this run (one per process: CUDA's sleep calibrates once)."""
    global _device
    if _device is None:
        import devices

        _device = devices.Cuda() if GPU_MODE == "cuda" else devices.SimDev()
    return _device


@pytest.fixture
def gpu():
    """The device the GPU checks run on (see the module's docstring); skips where there is none."""
    if GPU_MODE is None:
        pytest.skip(_NO_DEVICE)
    device = gpu_device()
    device.synchronize()
    yield device
    device.synchronize()
