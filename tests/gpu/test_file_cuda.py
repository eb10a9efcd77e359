"""Device tensors in file promises across processes (issue 17), on a GPU: the producer's value is
snapshotted on its stream at call time and published after the event; the consumer receives its
own copy (CUDA: device-to-device through CUDA IPC), or the IPC view itself with zero_copy=True.

The device-generic cases run on the simulated device too (DTORCH_GPU_TESTS=simdev; values staged
through host shared memory); the CUDA IPC cases are CUDA only. tests/test_file_device.py covers the
simulated device in CI in more depth."""
import multiprocessing as mp
import time

import pytest
import torch

import dtorch_ops
import file_device_workers as workers
from conftest import WAIT_MS, cuda_only, wait_until
from producer_process import ProducerProcess


@pytest.fixture(scope="module")
def producer():
    process = ProducerProcess(mp.get_context("spawn"))
    yield process
    process.close()


def test_a_device_value_crosses_processes_as_of_the_call(gpu, producer):
    promise = dtorch_ops.TensorPromise(kind="file")
    future = promise.get_future()
    if gpu.name == "simdev":
        producer.call(workers.load_simdev, timeout_s=300)
        gate = producer.call(workers.produce_behind_held_stream, promise, 24)
        time.sleep(0.1)
        assert not future.is_ready()  # published only after the event
        producer.call(workers.release, gate)
        expected = torch.arange(24.0) * 2
    else:
        expected = torch.arange(24.0).reshape(4, 6)
        took = producer.call(workers.cuda_produce, promise, expected, 0, 100)
        assert took < 0.01, f"get_tensor took {took * 1e6:.0f} us to return behind 100 ms of work"
        assert not future.is_ready()  # published only after the event, ~100 ms later
    got = future.wait(WAIT_MS)
    assert got.device.type == gpu.name
    assert torch.equal(got.cpu(), expected)  # (CUDA: not the producer's later fill_(-1))


@cuda_only("CUDA IPC")
def test_default_copy_survives_a_producer_sigkill_and_frees_the_block():
    process = ProducerProcess(mp.get_context("spawn"))
    try:
        baseline = process.call(workers.cuda_allocated)
        promise = dtorch_ops.TensorPromise(kind="file")
        future = promise.get_future()
        values = torch.randn(1 << 20)
        process.call(workers.cuda_produce, promise, values, 0, 0)
        got = future.wait(WAIT_MS)  # a copy in this process's memory
        # The producer frees its block once the consumer copied it (its pool notices within
        # 250 ms).
        assert wait_until(lambda: process.call(workers.cuda_allocated) <= baseline, 10.0)
        process.requests.put((999, workers.die, ()))
        process.process.join(30)
        assert torch.equal(got.cpu(), values)  # ours, unaffected by the producer's death
    finally:
        process.close()


@cuda_only("CUDA IPC")
def test_zero_copy_gives_the_ipc_view_and_the_block_lives_until_it_goes(producer):
    baseline = producer.call(workers.cuda_allocated)
    promise = dtorch_ops.TensorPromise(kind="file", zero_copy=True)
    future = promise.get_future()
    values = torch.randn(1 << 20)
    producer.call(workers.cuda_produce, promise, values, 0, 20)
    view = future.wait(WAIT_MS)
    assert view.device == torch.device("cuda:0") and torch.equal(view.cpu(), values)
    time.sleep(0.6)
    assert producer.call(workers.cuda_allocated) > baseline  # held while the view lives
    del view, future
    assert wait_until(lambda: producer.call(workers.cuda_allocated) <= baseline, 10.0)


@cuda_only("CUDA IPC")
def test_a_dead_consumer_releases_the_producers_block():
    consumer = ProducerProcess(mp.get_context("spawn"))
    try:
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        serialized = consumer.call(workers.consumer_pair, {"zero_copy": True})
        promise = dtorch_ops.TensorPromise.from_serialized(serialized)
        values = torch.randn(1 << 20)
        t = values.cuda()
        dtorch_ops.get_tensor(t, promise)
        del t
        device, got = consumer.call(workers.consumer_take_view, WAIT_MS)
        assert device == "cuda:0" and torch.equal(got, values)
        assert torch.cuda.memory_allocated() > baseline  # the consumer's view holds our block
        consumer.requests.put((999, workers.die, ()))
        consumer.process.join(30)
        assert wait_until(lambda: torch.cuda.memory_allocated() <= baseline, 10.0)
    finally:
        consumer.close()


@cuda_only("CUDA IPC")
def test_a_cpu_consumer_of_a_cuda_value(producer):
    promise = dtorch_ops.TensorPromise(kind="file", device="cpu")
    future = promise.get_future()
    values = torch.randn(64, 3)
    producer.call(workers.cuda_produce, promise, values, 0, 10)
    got = future.wait(WAIT_MS)
    assert got.device.type == "cpu" and torch.equal(got, values)


@cuda_only("a second GPU")
def test_the_device_index_is_kept(producer):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    promise = dtorch_ops.TensorPromise(kind="file")
    future = promise.get_future()
    producer.call(workers.cuda_produce, promise, torch.ones(8), 1, 0)
    assert future.wait(WAIT_MS).device == torch.device("cuda:1")
