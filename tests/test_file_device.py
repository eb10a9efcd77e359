"""Device tensors in file promises (issue 17), on the simulated device in two processes: the
producer (a spawned process that loads simdev) snapshots the value on its stream and publishes it
after the event; the consumer (this process, which loads simdev too) receives it on the same
device, or on the CPU when it asks for that or lacks the device (a third process without simdev).
The simulated device has no IPC: its values are staged through host shared memory."""
import multiprocessing as mp
import random
import struct
import time

import pytest
import torch

import dtorch_ops
import file_device_workers as workers
import simdev
from conftest import WAIT_MS
from producer_process import ProducerProcess


simdev.load()
pytestmark = pytest.mark.usefixtures("nothing_left_in_dev_shm")


@pytest.fixture(scope="module")
def producer():
    process = ProducerProcess(mp.get_context("spawn"))
    assert process.call(workers.load_simdev, timeout_s=300) == "simdev"
    yield process
    process.close()


@pytest.fixture(scope="module")
def consumer_without_simdev():
    process = ProducerProcess(mp.get_context("spawn"))
    yield process
    process.close()


def values(shape=(4, 6), dtype=torch.float32):
    return torch.arange(shape[0] * shape[1], dtype=torch.float64).reshape(shape).to(dtype)


def expected(layout, v):
    return {"contiguous": v, "transposed": v.t(), "sliced": v[:, ::2]}[layout]


@pytest.mark.parametrize("via", ["get_tensor", "set_value"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
def test_a_device_value_arrives_on_the_same_device_as_of_the_call(producer, layout, via):
    promise = dtorch_ops.TensorPromise(kind="file")
    future = promise.get_future()
    producer.call(workers.produce_on_device, promise, values(), 0, layout, via)
    got = future.wait(WAIT_MS)
    assert got.device == torch.device("simdev:0")
    assert torch.equal(got.cpu(), expected(layout, values()))  # not the later fill_(-1)
    if layout == "transposed":
        assert got.stride() == expected(layout, values()).stride()  # dense strides are kept


@pytest.mark.parametrize("dtype", [torch.float16, torch.int64, torch.bool, torch.complex64])
def test_dtypes_and_device_index(producer, dtype):
    promise = dtorch_ops.TensorPromise(kind="file")
    future = promise.get_future()
    v = values((3, 4), dtype)
    producer.call(workers.produce_on_device, promise, v, 1, "contiguous", "get_tensor")
    got = future.wait(WAIT_MS)
    assert got.device == torch.device("simdev:1") and got.dtype == dtype
    assert torch.equal(got.cpu(), v)


def test_device_cpu_delivers_a_cpu_view_of_shared_memory(producer):
    promise = dtorch_ops.TensorPromise(kind="file", device="cpu")
    assert promise.serialize().endswith(":device=cpu")
    future = promise.get_future()
    producer.call(workers.produce_on_device, promise, values(), 0, "transposed", "get_tensor")
    got = future.wait(WAIT_MS)
    assert got.device.type == "cpu"
    assert torch.equal(got, values().t())


def test_not_published_while_the_producer_stream_is_held(producer):
    promise = dtorch_ops.TensorPromise(kind="file")
    future = promise.get_future()
    started = time.monotonic()
    gate = producer.call(workers.produce_behind_held_stream, promise, 1000)
    try:
        assert time.monotonic() - started < 5  # get_tensor returned at once behind the hold
        time.sleep(0.3)
        assert not future.is_ready()
        with pytest.raises(dtorch_ops.FutureTimeoutError):
            future.wait(200)
        assert future.valid()
    finally:
        producer.call(workers.release, gate)  # (the module's producer serves later tests)
    got = future.wait(WAIT_MS)
    assert torch.equal(got.cpu(), torch.arange(1000, dtype=torch.float32) * 2)


def test_a_producer_killed_while_its_stream_is_held_fails_the_consumer_clearly():
    process = ProducerProcess(mp.get_context("spawn"))
    try:
        process.call(workers.load_simdev, timeout_s=300)
        promise = dtorch_ops.TensorPromise(kind="file")
        future = promise.get_future()
        process.call(workers.produce_behind_held_stream, promise, 10)
        assert not future.is_ready()
        process.requests.put((999, workers.die, ()))
        process.process.join(30)
        started = time.monotonic()
        with pytest.raises(dtorch_ops.BrokenPromiseError, match="died"):
            future.wait(WAIT_MS)
        assert time.monotonic() - started < 5
    finally:
        process.close()


def test_a_consumer_without_the_device_receives_a_cpu_tensor(consumer_without_simdev):
    serialized = consumer_without_simdev.call(workers.consumer_pair, {})
    promise = dtorch_ops.TensorPromise.from_serialized(serialized)
    t = values().to("simdev:1")
    dtorch_ops.get_tensor(t, promise)
    t.fill_(0)
    device_type, got, backend = consumer_without_simdev.call(workers.consumer_take, WAIT_MS)
    assert (device_type, backend) == ("cpu", "privateuseone")  # no simdev there
    assert torch.equal(got, values())


def test_this_process_as_producer_to_a_cpu_consumer(consumer_without_simdev):
    serialized = consumer_without_simdev.call(workers.consumer_pair, {"device": "cpu"})
    promise = dtorch_ops.TensorPromise.from_serialized(serialized)
    promise.set_value(values().to("simdev"))
    device_type, got, _ = consumer_without_simdev.call(workers.consumer_take, WAIT_MS)
    assert device_type == "cpu" and torch.equal(got, values())


def test_a_second_set_of_a_device_value_raises_and_the_first_stays(producer):
    promise = dtorch_ops.TensorPromise(kind="file")
    future = promise.get_future()
    dtorch_ops.get_tensor(torch.ones(3, device="simdev"), promise)
    with pytest.raises(dtorch_ops.PromiseAlreadySatisfiedError):
        promise.set_value(torch.zeros(3).to("simdev"))
    assert torch.equal(future.wait(WAIT_MS).cpu(), torch.ones(3))


def test_a_device_error_reaches_the_consumer(producer):
    promise = dtorch_ops.TensorPromise(kind="file")
    future = promise.get_future()
    with simdev.stream(torch.ops.simdev.new_stream()):  # a fault poisons its stream only
        torch.ops.simdev.sleep(20)
        torch.ops.simdev.fail("injected fault")
        dtorch_ops.get_tensor(torch.ones(3, device="simdev"), promise)
    with pytest.raises(dtorch_ops.errors.DeviceError, match="injected fault"):
        future.wait(WAIT_MS)


def test_options_and_bad_input():
    with pytest.raises(ValueError, match="device='cpu'"):
        dtorch_ops.TensorPromise(kind="file", device="cuda")
    with pytest.raises(ValueError, match="pass one of them"):
        dtorch_ops.TensorPromise(kind="file", device="cpu", zero_copy=True)
    with pytest.raises(TypeError, match="takes the options"):
        dtorch_ops.TensorPromise(kind="file", pinned=True)
    with pytest.raises(TypeError, match="does not take"):
        dtorch_ops.TensorPromise(kind="memory", device="cpu")
    with pytest.raises(TypeError, match="does not take"):
        dtorch_ops.VoidPromise(kind="file", device="cpu")
    # zero_copy shares device memory through the device's IPC: none in this process.
    if not dtorch_ops._C.has_device_ipc("cuda"):
        with pytest.raises(ValueError, match="built without CUDA"):
            dtorch_ops.TensorPromise(kind="file", zero_copy=True)
    # The same options in the one string TorchScript and C++ pass.
    raw = torch.classes.dtorch.TensorPromise("file://device=cpu")
    assert raw.serialize().endswith(":device=cpu")
    with pytest.raises(ValueError, match="takes the options"):
        torch.classes.dtorch.TensorPromise("file://pinned")
    # A serialized promise's options are checked like the rest of it.
    good = dtorch_ops.TensorPromise(kind="file", device="cpu")
    for bad in (good.serialize().replace("device=cpu", "device=gpu"),
                good.serialize() + ":more", good.serialize().replace(":device=cpu", ":"),
                good.serialize().replace("device=cpu", "DEVICE")):
        with pytest.raises(dtorch_ops.InvalidHandleError):
            dtorch_ops.TensorPromise.from_serialized(bad)
    void = dtorch_ops.VoidPromise(kind="file")
    with pytest.raises(dtorch_ops.InvalidHandleError):
        dtorch_ops.VoidPromise.from_serialized(void.serialize() + ":device=cpu")


def test_tensors_without_data_or_dense_layout_are_refused_clearly():
    promise = dtorch_ops.TensorPromise(kind="file")
    future = promise.get_future()
    with pytest.raises(RuntimeError, match="meta tensor has none"):
        promise.set_value(torch.empty(2, device="meta"))
    # The refusal failed the pair too (so that a consumer elsewhere learns why): a later set
    # is refused, and the future raises the first refusal.
    with pytest.raises(dtorch_ops.PromiseAlreadySatisfiedError):
        promise.set_value(torch.ones(1))
    with pytest.raises(dtorch_ops.errors.ProducerError, match="refused the value: .*meta tensor"):
        future.wait(WAIT_MS)
    promise = dtorch_ops.TensorPromise(kind="file")
    future = promise.get_future()
    with pytest.raises(RuntimeError, match="strided"):
        promise.set_value(torch.eye(2).to_sparse())
    with pytest.raises(dtorch_ops.errors.ProducerError, match="refused the value: .*strided"):
        future.wait(WAIT_MS)


def _patched(header: bytes, offset: int, value: int, fmt: str = "<i") -> bytes:
    out = bytearray(header)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def test_what_a_producer_publishes_is_checked_before_a_tensor_is_built():
    """The header and payload come from another process (untrusted): the new fields (the
    producer's device, the transport, an IPC record) get clear errors, never a crash."""
    encode = dtorch_ops._C.encode_tensor_for_testing
    decode = dtorch_ops._C.decode_tensor_for_testing
    header, payload = encode(values((2, 3)).to("simdev:1"))
    got = decode(header, payload, "")
    assert got.device == torch.device("simdev:1") and torch.equal(got.cpu(), values((2, 3)))
    assert decode(header, payload, "device=cpu").device.type == "cpu"
    cpu_header, cpu_payload = encode(values((2, 3)))
    ipc = struct.pack("<I", 8) + bytes(256)
    bad = [
        (_patched(header, 8, 999), payload, "names no device"),  # device type out of range
        (_patched(header, 8, -1), payload, "names no device"),
        (_patched(header, 12, -2), payload, "names no device"),  # device index
        (_patched(cpu_header, 12, 0), cpu_payload, "names no device"),  # a CPU value with an index
        (_patched(header, 8, 14), payload, "names no device"),  # c10::DeviceType::Meta: no data
        (_patched(header, 16, 7, "<I"), payload, "unknown transport"),
        (_patched(header, 20, 1, "<I"), payload, "not of this format"),
        (_patched(cpu_header, 16, 1, "<I"), cpu_payload, "names no device"),  # a CPU value by IPC
        (_patched(header, 16, 1, "<I"), payload, "bad IPC record"),  # payload of the wrong size
        (_patched(header, 16, 1, "<I"), struct.pack("<I", 0) + bytes(256), "bad IPC record"),
        (_patched(header, 16, 1, "<I"), struct.pack("<I", 300) + bytes(256), "bad IPC record"),
        # The simulated device has no IPC: its memory cannot be opened here.
        (_patched(header, 16, 1, "<I"), ipc, "cannot open"),
        (header[:10], payload, "truncated"),
        (header + b"x", payload, "bad size"),
        (header, payload[:-1], "does not fit its payload"),
    ]
    for bad_header, bad_payload, match in bad:
        with pytest.raises(dtorch_ops.InvalidHandleError, match=match):
            decode(bad_header, bad_payload, "")
    rng = random.Random(17)
    for _ in range(3000):
        mutated = bytearray(header)
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        try:
            decode(bytes(mutated), payload, rng.choice(["", "ipc", "zero_copy", "device=cpu"]))
        except dtorch_ops.InvalidHandleError:
            pass
    with pytest.raises(dtorch_ops.InvalidHandleError, match="value options"):
        decode(header, payload, "device=gpu")
