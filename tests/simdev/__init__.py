"""The simulated asynchronous device ("simdev", PrivateUse1), built on first use for the tests.

``load()`` compiles tests/simdev/simdev.cpp (once; ninja rebuilds it when it changes), loads it
and renames PrivateUse1 to "simdev". Not part of the dtorch_ops package.
"""
import atexit
import contextlib
import os
import time
import types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
_loaded = False
STALE_LOCK_S = 300


def load() -> None:
    global _loaded
    if _loaded:
        return
    from torch.utils.cpp_extension import load as load_extension

    build_dir = os.path.join(HERE, "build")
    os.makedirs(build_dir, exist_ok=True)
    # torch's build lock (a file it waits on without a limit): one left by a build that was killed
    # would block every later load. A build takes well under a minute here.
    lock = os.path.join(build_dir, "lock")
    try:
        if time.time() - os.path.getmtime(lock) > STALE_LOCK_S:
            os.unlink(lock)
    except FileNotFoundError:
        pass
    import dtorch_ops  # simdev registers a blocking wait with the library, which must be loaded

    library_dir = os.path.dirname(dtorch_ops.library_path())
    load_extension(name="simdev", sources=[os.path.join(HERE, "simdev.cpp")],
                   build_directory=build_dir, is_python_module=False,
                   extra_cflags=["-O1"],
                   extra_include_paths=[os.path.join(REPO, "csrc"),
                                        os.path.join(REPO, "csrc", "include")],
                   extra_ldflags=[f"-L{library_dir}", "-l:libdtorch_ops.so",
                                  f"-Wl,-rpath,{library_dir}"],
                   verbose=False)
    torch.utils.rename_privateuse1_backend("simdev")
    torch._register_device_module("simdev", _device_module())
    # Runs before dtorch_ops' own handler (atexit is last in, first out): the device's work ends,
    # and dtorch's pollers complete what it produced, while Python can still serve them.
    atexit.register(torch.ops.simdev.drain_at_exit)
    _loaded = True


def _device_module():
    """torch.simdev: what torch looks up for a PrivateUse1 backend."""
    module = types.ModuleType("torch.simdev")
    module.is_available = lambda: True
    module.device_count = lambda: 2
    module.current_device = lambda: torch.ops.simdev.get_device()
    module.is_initialized = lambda: True
    module._lazy_init = lambda: None
    module.synchronize = lambda device=None: torch.ops.simdev.synchronize()
    # simdev has no random number generator; torch.random.fork_rng (used by AOT tracing) asks
    # every registered device module for its state.
    module.get_rng_state = lambda device="simdev": torch.empty(0, dtype=torch.uint8)
    module.set_rng_state = lambda new_state, device="simdev": None
    module.manual_seed = module.manual_seed_all = lambda seed: None
    module.initial_seed = lambda: 0
    module._is_in_bad_fork = lambda: False
    return module


@contextlib.contextmanager
def _current(setter, value):
    """Calls setter(value), which returns the previous value, and restores that on exit."""
    previous = setter(value)
    try:
        yield
    finally:
        setter(previous)


def device(index: int):
    """Makes simdev:`index` the current device on this thread inside the block."""
    return _current(torch.ops.simdev.set_device, index)


def stream(stream_id: int):
    """Makes simdev stream `stream_id` current (for the current device) on this thread inside the
    block."""
    return _current(torch.ops.simdev.set_stream, stream_id)
