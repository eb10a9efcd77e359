"""Worker-process functions for test_file_failures.py, test_file_untrusted.py and
test_file_scale.py ("file" promises across processes).

Importable by spawned children: multiprocessing's spawn start method hands the parent's sys.path
to the child, and pytest puts tests/ on it. Fork-context children run these functions directly.

Every child that waits for the test to kill it sleeps for a bounded time only, and asks the kernel
to kill it when its parent dies, so that a crashed test run leaves no orphans behind.
"""
import gc
import json
import os
import sys
import time

from producer_process import describe, die_with_parent

# How long a child that expects to be killed lives at most (s).
CHILD_LIFETIME_S = 120
# Promises a child keeps until interpreter exit (so that they are still held when atexit runs).
_KEPT = []


def kept_payloads() -> dict:
    """The payload segments this process keeps (the file kind's diagnostics: produced, received,
    produced_bytes, received_bytes)."""
    import dtorch_ops

    return {name[len("kept_"):]: value
            for name, value in dtorch_ops._C.diagnostics()["doorbell"].items()
            if name.startswith("kept_")}


def linger() -> None:
    """Waits (bounded) for the test to kill this process."""
    time.sleep(CHILD_LIFETIME_S)
    os._exit(3)


HOLDING = ("", "", "holding")


def _hold(promise) -> tuple:
    """This process holds `promise` (deserialized: a holder from that moment) without setting
    anything; returns HOLDING. (A value the kind refuses would fail the pair: no longer a way to
    attach without setting.)"""
    assert promise.kind() == "file"
    return HOLDING


# ---- what the module's producer process runs (producer_process.ProducerProcess.call) ----------


def produce(handle: str, fill: float, numel: int = 16, via: str = "get_tensor") -> None:
    import torch

    import dtorch_ops

    promise = dtorch_ops.TensorPromise.from_serialized(handle)
    value = torch.full((numel,), float(fill))
    if via == "get_tensor":
        dtorch_ops.get_tensor(value, promise)
    else:
        promise.set_value(value)


def produce_void(handle: str) -> None:
    import dtorch_ops

    dtorch_ops.VoidPromise.from_serialized(handle).set_value()


def fail(handle: str, message: str) -> None:
    import dtorch_ops

    dtorch_ops.TensorPromise.from_serialized(handle).set_exception(message)


# ---- producers the test kills or lets exit (fork context unless noted) --------------------------


def hold_then_linger(handle: str, conn) -> None:
    """Holds the promise (deserialized), reports it, waits to die."""
    die_with_parent()
    import dtorch_ops

    promise = dtorch_ops.TensorPromise.from_serialized(handle)
    conn.send(_hold(promise))
    linger()


def get_tensor_sparse_then_linger(handle: str, conn) -> None:
    """Calls get_tensor with a sparse tensor (its kernel runs; the file kind refuses the layout),
    reports the refusal, waits to die. (A meta tensor would not do: the Meta kernel refuses it
    before the promise is touched.)"""
    die_with_parent()
    import torch

    import dtorch_ops

    promise = dtorch_ops.TensorPromise.from_serialized(handle)
    try:
        dtorch_ops.get_tensor(torch.eye(3).to_sparse(), promise)
        conn.send(("", "", "not refused"))
    except Exception as e:  # noqa: BLE001 - reported to the test
        conn.send(describe(e))
    linger()


def hold_lock_forever(handle: str, conn) -> None:
    """Attaches, takes the promise's interprocess lock and never returns."""
    die_with_parent()
    import dtorch_ops

    conn.send(os.getpid())
    dtorch_ops._C.hold_file_promise_lock_for_testing(handle)
    conn.send("returned")  # never reached


def hold_then_os_exit(handle: str, conn) -> None:
    """Holds the promise (deserialized), then leaves with os._exit (no atexit, no destructors):
    to the library this producer died."""
    die_with_parent()
    import dtorch_ops

    promise = dtorch_ops.TensorPromise.from_serialized(handle)
    conn.send(_hold(promise))
    conn.close()
    os._exit(0)


def hold_then_drop_and_linger(handle: str, conn) -> None:
    """Holds the promise (deserialized), drops its only handle, stays alive."""
    die_with_parent()
    import dtorch_ops

    promise = dtorch_ops.TensorPromise.from_serialized(handle)
    refusal = _hold(promise)
    del promise
    gc.collect()
    conn.send(refusal)
    linger()


def hold_then_exit_normally(handle: str, conn) -> None:
    """(spawn context) Holds the promise (deserialized) and returns: the spawned interpreter
    then exits normally, with the promise still held (kept in a module global) when the
    library's atexit handler runs."""
    die_with_parent()
    import dtorch_ops

    promise = dtorch_ops.TensorPromise.from_serialized(handle)
    _KEPT.append(promise)
    conn.send(_hold(promise))


def produce_large_in_sequence(handles: list, numel: int, conn) -> None:
    """For each handle i: makes the value full(numel, i + 1), reports ("start", i), sets it with
    get_tensor and reports ("set", i, seconds get_tensor took); then waits to be killed (the test
    kills it at a moment of its choosing, mostly while it copies a value)."""
    die_with_parent()
    import torch

    import dtorch_ops

    # One thread: the parent may have used OpenMP's pool, which a forked child cannot (it hangs).
    torch.set_num_threads(1)
    for i, handle in enumerate(handles):
        value = torch.full((numel,), float(i + 1))
        promise = dtorch_ops.TensorPromise.from_serialized(handle)
        conn.send(("start", i))
        started = time.monotonic()
        dtorch_ops.get_tensor(value, promise)
        conn.send(("set", i, time.monotonic() - started))
        del promise, value
    linger()


def payload_mappings(maps_lines) -> int:
    """Mappings of payload segments among the lines of a /proc/<pid>/maps: those of dtorch
    segments larger than one page (control segments and doorbells are one page; a payload
    segment has at least one page of data and its trailer page)."""
    count = 0
    for line in maps_lines:
        if "/dev/shm/dtorch_" in line:
            start, end = (int(address, 16) for address in line.split()[0].split("-"))
            count += end - start > 4096
    return count


def _payload_mappings() -> int:
    with open("/proc/self/maps") as maps:
        return payload_mappings(maps)


def serve_values(conn) -> None:
    """A persistent producer for test_file_payloads.py, driven over `conn`:
    ("set", [(handle, numel, fill), ...]): sets each promise to full((numel,), fill) with
        get_tensor, in order, then replies ("done", count);
    ("set_reporting", [...]): the same, replying ("start", i) before each set (its value made
        and the promise attached already) and ("set", i, seconds the set took) after it;
    ("set_threads", [...], n): sets them from n threads at once (each its share, in order),
        then replies ("done", count);
    ("kept",): replies (kept_payloads(), library_threads(), dtorch mappings);
    ("idle", seconds): sets config.file_payload_idle_s, replies "ok";
    None: returns."""
    die_with_parent()
    import torch

    import dtorch_ops

    # One thread: the parent may have used OpenMP's pool, which a forked child cannot (it hangs).
    torch.set_num_threads(1)
    while True:
        if not conn.poll(CHILD_LIFETIME_S):
            os._exit(3)
        request = conn.recv()
        if request is None:
            return
        if request[0] in ("set", "set_reporting"):
            reporting = request[0] == "set_reporting"
            for i, (handle, numel, fill) in enumerate(request[1]):
                promise = dtorch_ops.TensorPromise.from_serialized(handle)
                value = torch.full((numel,), float(fill))
                if reporting:
                    _hold(promise)  # a holder: killed from now on, it "died"
                    conn.send(("start", i))
                started = time.monotonic()
                dtorch_ops.get_tensor(value, promise)
                if reporting:
                    conn.send(("set", i, time.monotonic() - started))
                del promise, value
            if not reporting:
                conn.send(("done", len(request[1])))
        elif request[0] == "set_threads":
            import threading

            values, count = request[1], request[2]

            def set_share(k):
                for handle, numel, fill in values[k::count]:
                    promise = dtorch_ops.TensorPromise.from_serialized(handle)
                    dtorch_ops.get_tensor(torch.full((numel,), float(fill)), promise)

            threads = [threading.Thread(target=set_share, args=(k,)) for k in range(count)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            conn.send(("done", len(values)))
        elif request[0] == "kept":
            conn.send((kept_payloads(), dtorch_ops.library_threads(),
                       _payload_mappings()))
        elif request[0] == "idle":
            dtorch_ops.config.file_payload_idle_s = request[1]
            conn.send("ok")


def report_mappings_and_sum(value, conn) -> None:
    """(fork context) Reports this child's dtorch mappings and the sum of `value`, inherited."""
    die_with_parent()
    import torch

    torch.set_num_threads(1)  # (a forked child cannot use the parent's OpenMP pool: it hangs)
    conn.send((_payload_mappings(), float(value.double().sum())))


def consumer_taking_one_value(conn) -> None:
    """A consumer: creates a tensor file pair, sends its serialized promise, takes the value the
    test sets (and drops it), replies its sum, then waits to be killed."""
    die_with_parent()
    import dtorch_ops

    promise = dtorch_ops.TensorPromise(kind="file")
    future = promise.get_future()
    conn.send(promise.serialize())
    conn.send(float(future.wait(60_000).sum()))
    linger()


def consumer_with_pairs(tensor_pairs: int, conn) -> None:
    """A consumer: creates `tensor_pairs` tensor file pairs and one void pair, keeps promises and
    futures, sends their serialized promises to the test, and waits to be killed."""
    die_with_parent()
    import dtorch_ops

    kept = []
    handles = []
    for _ in range(tensor_pairs):
        promise = dtorch_ops.TensorPromise(kind="file")
        kept.append((promise, promise.get_future()))
        handles.append(("tensor", promise.serialize()))
    void = dtorch_ops.VoidPromise(kind="file")
    kept.append((void, void.get_future()))
    handles.append(("void", void.serialize()))
    conn.send(handles)
    linger()


# ---- from_serialized fuzzing (run as `python -c`, reads JSON variants on stdin) ------------------


def fuzz_from_serialized_main() -> None:
    """Reads [[class name, string], ...] as JSON from stdin; for each, calls
    <class>.from_serialized(string) and, if that returns, set_value once (torch.ones(1) for a
    TensorPromise). Prints one JSON line per variant, flushed, so that a crash names the variant
    after the last line printed. Used by the file and network kinds' fuzz tests; "s" is each
    variant's time."""
    import torch

    import dtorch_ops

    classes = {"TensorPromise": dtorch_ops.TensorPromise, "VoidPromise": dtorch_ops.VoidPromise}
    variants = json.load(sys.stdin)

    def report(index, stage, started, error=None):
        line = {"i": index, "stage": stage, "s": round(time.monotonic() - started, 3)}
        if error is not None:
            line.update(module=type(error).__module__, cls=type(error).__qualname__,
                        message=str(error)[:400],
                        runtime=isinstance(error, RuntimeError),
                        value=isinstance(error, ValueError),
                        type=isinstance(error, TypeError),
                        dtorch=isinstance(error, dtorch_ops.errors.FutureError),
                        invalid_handle=isinstance(error, dtorch_ops.errors.InvalidHandleError))
        print(json.dumps(line), flush=True)

    for index, (class_name, text) in enumerate(variants):
        cls = classes[class_name]
        started = time.monotonic()
        try:
            promise = cls.from_serialized(text)
        except Exception as e:  # noqa: BLE001 - reported to the test
            report(index, "parse", started, e)
            continue
        try:
            if cls is dtorch_ops.TensorPromise:
                promise.set_value(torch.ones(1))
            else:
                promise.set_value()
        except Exception as e:  # noqa: BLE001 - reported to the test
            report(index, "use", started, e)
            continue
        finally:
            del promise
        report(index, "noop", started)
    sys.stdout.flush()


def sets_for_a_killed_consumer_main() -> None:
    """Run (as the whole interpreter) in a mount namespace whose /dev/shm is a small tmpfs: starts
    a consumer process that makes N pairs and prints their handles, SIGKILLs it, then sets an
    8 MiB value through each handle. Prints one JSON line per set (error, if any, and what of
    /dev/shm is used then), and the last line: the names the dead consumer left."""
    import json
    import signal
    import subprocess
    import sys

    import torch

    import dtorch_ops

    count = int(sys.argv[1])
    consumer = subprocess.Popen(
        [sys.executable, "-c",
         "import json, sys, time, dtorch_ops\n"
         f"pairs = [dtorch_ops.TensorPromise(kind='file') for _ in range({count})]\n"
         "futures = [p.get_future() for p in pairs]\n"
         "print(json.dumps([p.serialize() for p in pairs]), flush=True)\n"
         "time.sleep(120)\n"],
        stdout=subprocess.PIPE, text=True)
    # (Held before the kill: each set then finds the pair, not a name the first set unlinked.)
    promises = [dtorch_ops.TensorPromise.from_serialized(h)
                for h in json.loads(consumer.stdout.readline())]
    consumer.send_signal(signal.SIGKILL)
    consumer.wait(30)
    value = torch.ones(2 << 20)  # 8 MiB
    for promise in promises:
        error = None
        try:
            promise.set_value(value)
        except Exception as e:  # noqa: BLE001 (reported)
            error = f"{type(e).__name__}: {e}"
        usage = os.statvfs("/dev/shm")
        used = (usage.f_blocks - usage.f_bfree) * usage.f_frsize
        print(json.dumps({"error": error, "used_bytes": used}), flush=True)
    left = [n for n in os.listdir("/dev/shm") if n.startswith(f"dtorch_{consumer.pid}-")]
    print(json.dumps({"left": left}), flush=True)
