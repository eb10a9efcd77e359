"""The "file" kind: promise/future pairs across processes of one host, over /dev/shm.

This process is the consumer; one producer process (spawn) serves the whole module, plus a few
short-lived ones for the start methods. Failures (killed producers) are in
test_file_failures.py, untrusted handles in test_file_untrusted.py, churn and resources at scale in
test_file_scale.py.
"""
import asyncio
import multiprocessing
import os
import pickle
import stat
import time

import pytest
import torch
import torch.multiprocessing as tmp

from torch._prims_common import is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense

import dtorch_ops
import file_producers
from producer_process import ProducerProcess
from conftest import WAIT_MS

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("nothing_left_in_dev_shm")]


@pytest.fixture(scope="module")
def producer():
    process = ProducerProcess(tmp.get_context("spawn"))
    yield process
    process.close()


def file_pair(cls=dtorch_ops.TensorPromise):
    promise = cls(kind="file")
    return promise, promise.get_future()


# ---- values ----

CASES = file_producers.CASES


@pytest.mark.parametrize("dtype,shape,layout", CASES, ids=lambda c: str(c).replace("torch.", ""))
def test_values_of_every_dtype_and_layout_arrive(producer, dtype, shape, layout):
    promise, future = file_pair()
    assert promise.kind() == future.kind() == "file"
    producer.call(file_producers.produce, promise, dtype, shape, layout)
    value = future.wait(WAIT_MS)
    expected = file_producers.make_tensor(dtype, shape, layout)
    assert value.dtype == dtype and value.shape == expected.shape
    torch.testing.assert_close(value, expected.resolve_conj(), rtol=0, atol=0)
    if is_non_overlapping_and_dense(expected):
        assert value.stride() == expected.stride()  # dense layouts keep their strides
    else:
        assert value.is_contiguous()
    assert future.valid() and future.get() is value  # (wait() took nothing; get() does)
    assert not future.valid() and future.done()


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_every_dtype_of_the_closed_set_round_trips():
    dtypes = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
              torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex32,
              torch.complex64, torch.complex128, torch.uint16, torch.uint32, torch.uint64,
              torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
              torch.float8_e8m0fnu, torch.float4_e2m1fn_x2]
    for dtype in dtypes:
        pattern = torch.arange(6, dtype=torch.uint8)
        if dtype == torch.bool:
            pattern = pattern % 2  # (copies canonicalise bools to 0 and 1)
        raw = pattern.repeat(dtype.itemsize)
        value = raw.view(dtype)  # bit patterns: no arithmetic needed on the exotic dtypes
        promise, future = file_pair()
        promise.set_value(value)
        received = future.wait(WAIT_MS)
        assert received.dtype == dtype and received.shape == value.shape
        assert torch.equal(received.view(torch.uint8), raw), dtype
    promise, future = file_pair()
    quantized = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8)
    with pytest.raises(RuntimeError, match="cannot carry dtype"):
        promise.set_value(quantized)
    # The refusal fails the pair too: a consumer elsewhere learns why no value comes.
    with pytest.raises(dtorch_ops.errors.ProducerError, match="refused the value: .*cannot carry"):
        future.get()


def test_a_64_mib_value_arrives_and_is_a_writable_view(producer):
    promise, future = file_pair()
    value = torch.randn(16 * 1024 * 1024)
    producer.call(file_producers.set_value, promise, value)
    received = future.wait(WAIT_MS)
    assert torch.equal(received, value)
    # A view of the payload, no longer named in /dev/shm; ours to write.
    received.add_(1)
    assert torch.equal(received, value + 1)
    del received


def test_the_value_is_copied_when_set():
    promise, future = file_pair()
    value = torch.arange(4.0)
    promise.set_value(value)
    value.zero_()
    assert torch.equal(future.wait(WAIT_MS), torch.arange(4.0))


def test_errors_and_second_sets(producer):
    promise, future = file_pair()
    producer.call(file_producers.set_exception, promise, "out of data")
    with pytest.raises(dtorch_ops.errors.ProducerError, match="producer error: out of data"):
        future.wait(WAIT_MS)
    promise, future = file_pair()
    message = producer.call(file_producers.set_twice, promise)
    assert "promise already satisfied" in message
    torch.testing.assert_close(future.wait(WAIT_MS), torch.ones(1))
    # The creator's own handle is refused too, here, at call time.
    with pytest.raises(dtorch_ops.PromiseAlreadySatisfiedError, match="claimed it first"):
        promise.set_value(torch.zeros(1))


def test_wait_times_out_and_stays_valid(producer):
    promise, future = file_pair()
    with pytest.raises(dtorch_ops.FutureTimeoutError, match="still valid"):
        future.wait(50)
    assert isinstance(dtorch_ops.FutureTimeoutError("x"), TimeoutError)
    assert future.valid() and not future.is_ready()
    producer.call(file_producers.set_value, promise, torch.ones(2))
    assert torch.equal(future.wait(WAIT_MS), torch.ones(2))


def test_a_blocked_get_is_woken_by_the_producer(producer):
    promise, future = file_pair()
    result = {}

    def consume():
        result["value"] = future.get()

    import threading

    waiter = threading.Thread(target=consume, daemon=True)
    waiter.start()
    time.sleep(0.1)
    assert waiter.is_alive()
    producer.call(file_producers.set_value, promise, torch.full((3,), 5.0))
    waiter.join(WAIT_MS / 1000)
    assert torch.equal(result["value"], torch.full((3,), 5.0))


# ---- serialization, pickling, start methods ----


def test_serialize_from_serialized_and_the_handle_format(producer):
    promise, future = file_pair()
    serialized = promise.serialize()
    magic, version, kind, value_type, segment, nonce, *options = serialized.split(":")
    assert (magic, version, kind, value_type) == ("dtorch-promise", "1", "file", "tensor")
    # The consumer's delivery of device values: "ipc" where this build opens CUDA IPC.
    assert options == (["ipc"] if dtorch_ops._C.has_device_ipc("cuda") else [])
    assert segment.startswith(f"dtorch_{os.getpid()}-") and len(nonce) == 32
    mode = os.stat(f"/dev/shm/{segment}").st_mode
    assert stat.S_IMODE(mode) == 0o600 and os.stat(f"/dev/shm/{segment}").st_uid == os.geteuid()
    producer.call(file_producers.produce_from_serialized, serialized, torch.arange(3))
    assert torch.equal(future.wait(WAIT_MS), torch.arange(3))
    # The segment is gone once the value is taken.
    assert not os.path.exists(f"/dev/shm/{segment}")
    # A void handle is no tensor one (refused before anything is opened).
    void, void_future = file_pair(dtorch_ops.VoidPromise)
    with pytest.raises(dtorch_ops.InvalidHandleError, match="not a tensor one"):
        dtorch_ops.TensorPromise.from_serialized(void.serialize())
    again = dtorch_ops.VoidPromise.from_serialized(void.serialize())
    assert not void_future.is_ready()
    again.set_value()
    assert void_future.wait(WAIT_MS) is None


def test_raw_promises_pickle_and_deserialize():
    raw = torch.classes.dtorch.TensorPromise("file")
    future = dtorch_ops.TensorFuture(raw.get_future())
    copy = pickle.loads(pickle.dumps(raw))
    assert copy.kind() == "file"
    copy.set_value(torch.ones(2))
    assert torch.equal(future.wait(WAIT_MS), torch.ones(2))
    raw2 = torch.classes.dtorch.TensorPromise.from_serialized(
        torch.classes.dtorch.TensorPromise("file").serialize())
    assert raw2.kind() == "file"


def _set_from_child(promise, value):
    promise.set_value(value)


@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_a_promise_as_a_process_argument(method):
    promise, future = file_pair()
    ctx = multiprocessing.get_context(method)
    child = ctx.Process(target=_set_from_child, args=(promise, torch.full((2,), 3.0)))
    child.start()
    try:
        assert torch.equal(future.wait(WAIT_MS * 3), torch.full((2,), 3.0))
    finally:
        child.join(30)
    assert child.exitcode == 0


def _serve_queue(queue):
    while (item := queue.get()) is not None:
        promise, value = item
        dtorch_ops.get_tensor(value, promise)


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_promises_through_a_torch_multiprocessing_queue(method):
    ctx = tmp.get_context(method)
    queue = ctx.Queue()
    child = ctx.Process(target=_serve_queue, args=(queue,))
    child.start()
    try:
        futures = []
        for i in range(5):
            promise, future = file_pair()
            queue.put((promise, torch.full((4,), float(i))))
            futures.append(future)
            del promise  # in flight: the producer attaches when it uses it
        for i, future in enumerate(futures):
            assert torch.equal(future.wait(WAIT_MS * 3), torch.full((4,), float(i)))
    finally:
        queue.put(None)
        child.join(30)
    assert child.exitcode == 0


def test_a_memory_promise_in_a_forked_child_raises_clearly():
    promise = dtorch_ops.TensorPromise()
    future = promise.get_future()
    ctx = multiprocessing.get_context("fork")
    parent, child_end = ctx.Pipe()

    def child():
        try:
            promise.set_value(torch.ones(1))
            child_end.send("set")
        except Exception as e:  # noqa: BLE001
            child_end.send(f"{type(e).__name__}: {e}")

    process = ctx.Process(target=child)
    process.start()
    assert parent.poll(WAIT_MS / 1000)
    message = parent.recv()
    process.join(10)
    assert "forked child" in message and "kind='file'" in message
    assert not future.is_ready()
    promise.set_value(torch.ones(1))  # the parent's own promise still works
    assert future.wait(WAIT_MS).item() == 1


# ---- graphs ----


def test_a_torchscript_producer(producer):
    promise, future = file_pair()
    x = torch.arange(4.0)
    out = producer.call(file_producers.script_produce, promise, x)
    assert torch.equal(out, x * 2 + 1)
    assert torch.equal(future.wait(WAIT_MS), x * 2)


def test_a_compiled_producer(producer):
    for i in range(2):  # the second call reuses the compiled graph
        promise, future = file_pair()
        x = torch.linspace(0, 1, 8) + i
        out = producer.call(file_producers.compiled_produce, promise, x, timeout_s=240)
        hidden = x.sin() * 2  # an intermediate of the graph, not its output
        torch.testing.assert_close(future.wait(WAIT_MS), hidden)
        torch.testing.assert_close(out, (hidden + 1).sum())


class _HoldsAPromise(torch.nn.Module):
    def __init__(self, promise):
        super().__init__()
        self.promise = promise

    def forward(self, x):
        torch.ops.dtorch.get_tensor(x + 1, self.promise)
        return x


def test_a_scripted_module_holding_a_file_promise_survives_save_and_load(producer, tmp_path):
    promise, future = file_pair()
    module = torch.jit.script(_HoldsAPromise(promise.raw))
    path = str(tmp_path / "module.pt")
    torch.jit.save(module, path)
    del module
    loaded = torch.jit.load(path)  # a copy here that never produces: it attaches nothing
    assert not future.is_ready()
    del loaded
    producer.call(file_producers.run_saved_module, path, torch.arange(3.0))
    assert torch.equal(future.wait(WAIT_MS), torch.arange(3.0) + 1)


class _Exported(torch.nn.Module):
    def forward(self, x, promise):
        out = x * 3
        torch.ops.dtorch.get_tensor(out, promise)
        return out


def test_an_exported_program_with_a_file_promise_input_saves_and_loads(producer, tmp_path):
    example = dtorch_ops.TensorPromise("file")
    ep = torch.export.export(_Exported(), (torch.ones(2), example.raw))
    path = str(tmp_path / "program.pt2")
    torch.export.save(ep, path)
    del ep, example
    promise, future = file_pair()
    out = producer.call(file_producers.run_saved_export, path, torch.arange(2.0), promise)
    assert torch.equal(out, torch.arange(2.0) * 3)
    assert torch.equal(future.wait(WAIT_MS), torch.arange(2.0) * 3)


# ---- waking ----


def test_await_file_futures_with_one_doorbell_thread(producer):
    async def main():
        pairs = [file_pair() for _ in range(20)]
        # The producer sets them one by one meanwhile (its calls block: off the loop).
        setting = asyncio.get_running_loop().run_in_executor(None, lambda: [
            producer.call(file_producers.set_value, promise, torch.full((1,), i))
            for i, (promise, _) in enumerate(pairs)])
        values = await asyncio.wait_for(
            asyncio.gather(*(future for _, future in pairs)), WAIT_MS / 1000)
        await setting
        return values, dtorch_ops.library_threads()

    values, threads = asyncio.run(main())
    assert [v.item() for v in values] == list(range(20))
    assert threads["doorbell"] == 1


def test_a_void_file_promise_through_sync_into(producer):
    promise, future = file_pair(dtorch_ops.VoidPromise)
    producer.call(file_producers.sync_into, promise)
    assert future.wait(WAIT_MS) is None


def test_promise_kind_for_and_for_tensor():
    meta = torch.empty(1, device="meta")  # stands in for a device tensor
    assert dtorch_ops.promise_kind_for(meta, per_device_per_process=True) == "file"
    promise = dtorch_ops.TensorPromise.for_tensor(meta, per_device_per_process=True)
    assert promise.kind() == "file"
    assert dtorch_ops.TensorPromise.for_tensor(torch.ones(1), True).kind() == "memory"


def test_a_value_larger_than_dev_shm_is_a_clear_error_not_sigbus():
    info = os.statvfs("/dev/shm")
    capacity = info.f_blocks * info.f_frsize
    # An expanded view: no memory here, but its copy needs more than /dev/shm holds. tmpfs
    # refuses such a reservation at once (ENOSPC), before touching a page.
    value = torch.zeros(1, dtype=torch.uint8).expand(capacity + 2**20)
    promise, future = file_pair()
    with pytest.raises(dtorch_ops.errors.SharedMemoryError, match="/dev/shm has no room"):
        promise.set_value(value)
    with pytest.raises(dtorch_ops.errors.SharedMemoryError, match="/dev/shm has no room"):
        future.wait(WAIT_MS)


def test_a_fork_does_not_complete_what_the_parent_claimed():
    """A worker forks while its sync_into(file promise) waits for a device: the child's fork
    handler drops the parent's pending device work there, but the pair is the parent's to
    complete; its consumer sees the device finish, not "dropped at fork"."""
    import devices

    device = devices.SimDev()
    release = device.hold()
    promise, future = file_pair(dtorch_ops.VoidPromise)
    dtorch_ops.sync_into([torch.device("simdev", 0)], promise)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    time.sleep(0.3)  # the child's handler has run
    assert not future.is_ready()
    release()
    assert future.wait(WAIT_MS) is None


def test_a_long_message_in_any_script_arrives_whole_or_cut_cleanly(producer):
    promise, future = file_pair()
    message = "é" * 2000  # 4000 bytes of UTF-8: cut at a character boundary
    producer.call(file_producers.set_exception, promise, message)
    with pytest.raises(dtorch_ops.errors.ProducerError) as failed:
        future.wait(WAIT_MS)
    detail = str(failed.value).split("producer error: ", 1)[1]
    assert detail == "é" * len(detail) and 400 < len(detail) < 2000


def _set_later_from_a_thread(promise):
    import threading

    def later():
        time.sleep(1.5)  # past run()'s return: multiprocessing joins the thread at exit
        promise.set_value(torch.full((2,), 9.0))

    threading.Thread(target=later).start()


def test_a_worker_thread_may_set_after_run_returns():
    """A fork-started worker says "exited" to its consumers at exit, before multiprocessing joins
    its threads: a live worker is not taken for gone meanwhile."""
    promise, future = file_pair()
    child = multiprocessing.get_context("fork").Process(target=_set_later_from_a_thread,
                                                        args=(promise,))
    child.start()
    try:
        assert torch.equal(future.wait(WAIT_MS), torch.full((2,), 9.0))
    finally:
        child.join(30)
    assert child.exitcode == 0


def _consume_own_pair():
    promise, future = file_pair()
    promise.set_value(torch.ones(1))
    future.get()


def test_a_fork_started_child_leaves_nothing_in_dev_shm():
    """Such a child ends in os._exit, past the library's exit handler: what it made (its pair,
    its doorbell) is gone all the same."""
    child = multiprocessing.get_context("fork").Process(target=_consume_own_pair)
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"dtorch_{child.pid}-")]


def test_a_file_future_pending_at_exit_fails_and_leaves_nothing():
    """At exit, as for device values: a later atexit handler's get() raises rather than hangs,
    a thread blocked in get() does not stop the exit, and the process's segments are unlinked."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import atexit, os, threading
        pending = {}

        def flush():
            try:
                pending["value"].get()
                print("flush: got a value")
            except RuntimeError as e:
                print(f"flush: {type(e).__name__}: {e}")

        atexit.register(flush)
        import dtorch_ops
        promise = dtorch_ops.TensorPromise("file")
        pending["value"] = promise.get_future()
        promise.serialize()  # in flight: nobody breaks it at its creator's drop
        other = dtorch_ops.TensorPromise("file")
        blocked = other.get_future()
        threading.Thread(target=blocked.get, daemon=True).start()
        print("pid", os.getpid())
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "flush: DroppedAtExitError: dtorch: dropped at interpreter exit" in out, out
    pid = int(out.split("pid ", 1)[1].split()[0])
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"dtorch_{pid}-")]
