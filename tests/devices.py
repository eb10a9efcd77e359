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

    def synchronize(self):
        torch.ops.simdev.synchronize()

    def live_allocations(self):
        return torch.ops.simdev.live_allocations()

    def fail(self, message):
        torch.ops.simdev.fail(message)


class Cuda:
    name = "cuda"
    can_inject_faults = False  # a device-side fault poisons the CUDA context of the process

    def __init__(self):
        self._cycles_per_ms = None

    def sleep(self, ms):
        if self._cycles_per_ms is None:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(10_000_000)
            end.record()
            end.synchronize()
            self._cycles_per_ms = 10_000_000 / start.elapsed_time(end)
        torch.cuda._sleep(int(ms * self._cycles_per_ms))

    @contextlib.contextmanager
    def side_stream(self):
        with torch.cuda.stream(torch.cuda.Stream()):
            yield

    def synchronize(self):
        torch.cuda.synchronize()

    def live_allocations(self):
        return torch.cuda.memory_allocated()

    def fail(self, message):
        raise NotImplementedError


def available():
    devices = [SimDev()]
    if torch.cuda.is_available():
        devices.append(Cuda())
    return devices
