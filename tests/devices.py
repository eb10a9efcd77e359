"""The asynchronous devices the device tests run on: the simulated device (always) and CUDA
(when present). Each exposes the few controls the tests need."""
import contextlib

import torch

import simdev


class SimDev:
    name = "simdev"
    can_inject_faults = True

    def __init__(self):
        simdev.load()

    def sleep(self, ms):
        torch.ops.simdev.sleep(int(ms))

    @contextlib.contextmanager
    def side_stream(self):
        with simdev.stream(torch.ops.simdev.new_stream()):
            yield

    def device_count(self):
        return 2

    def on_device(self, index):
        return simdev.device(index)

    def new_stream(self):
        return torch.ops.simdev.new_stream()

    def using_stream(self, stream):
        return simdev.stream(stream)

    def hold(self):
        """Makes the current stream busy (work queued after this waits) until the returned
        release() is called."""
        gate = torch.ops.simdev.hold()
        return lambda: torch.ops.simdev.release(gate)

    @contextlib.contextmanager
    def busy(self):
        """The current stream is busy until the block ends."""
        release = self.hold()
        try:
            yield
        finally:
            release()

    def synchronize(self):
        torch.ops.simdev.synchronize()

    def track(self, tensor):
        """A callable telling whether tensor's memory is still allocated (not freed)."""
        address = tensor.data_ptr()
        return lambda: torch.ops.simdev.is_allocated(address)

    def fail(self, message):
        torch.ops.simdev.fail(message)


def _warm_kernels():
    """Launches once the CUDA kernels the tests queue behind a sleep (see Cuda.sleep)."""
    for dtype in (torch.float32, torch.int64, torch.uint8):
        x = torch.ones(8, device="cuda", dtype=dtype)
        y = x * 2 + x * 3
        y.fill_(-1 if dtype != torch.uint8 else 1)
        y.clone().copy_(x)
        torch.zeros(4, device="cuda", dtype=dtype)
        torch.arange(6, device="cuda", dtype=dtype).reshape(2, 3).t().contiguous()
        x[0] * 3
        x.sum()
    x = torch.randn(64, 64, device="cuda")
    (x @ x).mean().item()
    torch.cuda.synchronize()


class Cuda:
    name = "cuda"
    can_inject_faults = False  # a device-side fault poisons the CUDA context of the process

    def __init__(self):
        self._cycles_per_ms = None

    def sleep(self, ms):
        """A kernel that spins for at least `ms` (torch.cuda._sleep counts clock cycles).

        CUDA loads a kernel's module when it is first launched (lazy loading, the default), and
        that load waits for the kernels running: the first `x * 2` of a process queued behind a
        sleep blocks the host until the sleep ends, and the tests would then see finished work
        where they expect pending work (seen on the GPU machine). So the first sleep of a
        process first launches the kernels the tests compute behind sleeps."""
        if self._cycles_per_ms is None:
            _warm_kernels()
            # An idle GPU runs at a fraction of its boost clock: the fastest of a few timed runs
            # is the boost rate, so that a sleep lasts at least `ms` whatever the clock then.
            rates = []
            for _ in range(5):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                torch.cuda._sleep(20_000_000)
                end.record()
                end.synchronize()
                rates.append(20_000_000 / start.elapsed_time(end))
            self._cycles_per_ms = max(rates)
        torch.cuda._sleep(int(ms * self._cycles_per_ms))

    @contextlib.contextmanager
    def side_stream(self):
        with torch.cuda.stream(torch.cuda.Stream()):
            yield

    def device_count(self):
        return torch.cuda.device_count()

    def on_device(self, index):
        return torch.cuda.device(index)

    def new_stream(self):
        return torch.cuda.Stream()

    def using_stream(self, stream):
        return torch.cuda.stream(stream)

    def hold(self):
        """Makes the current stream busy for a while (a 2 s kernel: CUDA has no gate); the
        returned release() does nothing."""
        self.sleep(2000)
        return lambda: None

    @contextlib.contextmanager
    def busy(self):
        """The current stream is busy (at least) for the block."""
        self.hold()
        yield

    def synchronize(self):
        torch.cuda.synchronize()

    def track(self, tensor):
        """A callable telling whether tensor's memory is still allocated (not freed).

        The caching allocator does not say per block: compare the bytes in use with what was in
        use besides this (large) tensor."""
        others = torch.cuda.memory_allocated() - tensor.untyped_storage().nbytes()
        half = tensor.untyped_storage().nbytes() // 2
        return lambda: torch.cuda.memory_allocated() - others > half

    def fail(self, message):
        raise NotImplementedError


def available():
    """The devices the parametrized device tests (the `dev` fixture) run on in this process: CUDA
    where torch sees a GPU, else the simulated device (it must build: in CI a failure is an error).

    Never both by default: once a PrivateUse1 backend (the simulated device) is registered, torch
    takes it for the process's accelerator (at::getAccelerator), so CUDA's autograd nodes report no
    stream (the engine's "opt_ready_stream && opt_parent_stream" assert in a compiled step's
    backward) and pinned host memory comes from its allocator instead of CUDA's (a CUDA copy into
    it is not asynchronous). Seen on the GPU machine. DTORCH_TEST_DEVICES=simdev, =cuda or
    =simdev,cuda chooses (scripts/device_check.sh runs each test file in its own process)."""
    import os

    cuda = torch.cuda.is_available()
    asked = os.environ.get("DTORCH_TEST_DEVICES", "").replace(" ", "") or (
        "cuda" if cuda else "simdev")
    names = asked.split(",")
    unknown = set(names) - {"simdev", "cuda"}
    if unknown or not names:
        raise ValueError(f"DTORCH_TEST_DEVICES={asked!r}: expected simdev, cuda or simdev,cuda")
    if "cuda" in names and not cuda:
        raise RuntimeError(f"DTORCH_TEST_DEVICES={asked!r}, but torch sees no CUDA device")
    return [SimDev() if name == "simdev" else Cuda() for name in names]
