"""Messages of the network kind's wire format, forged as a hostile store client would write them
(csrc/core/kinds/network/messages.cc: Decode), and the process that floods a consumer's queue with them
(test_network_forged.py, benchmarks/bench_network.py). Byte order: the host's (little-endian
here), as the kind writes its messages."""
import datetime
import os
import random
import struct
import time

KEY_PREFIX = "dtorch/n/"
CHUNK_BYTES = 4 << 20
MAX_U32 = (1 << 32) - 1
FLOAT32_CODE = 8  # the tensor codec's wire code of torch.float32


def hex_id(n: int = 32) -> str:
    return os.urandom(n // 2).hex()


def queue_key(consumer: str) -> str:
    return KEY_PREFIX + "q/" + consumer


def head(kind: bytes, pair: str, producer: str) -> bytes:
    return kind + pair.encode() + producer.encode()


def tensor_header(sizes) -> bytes:
    """A CPU float32 tensor's header (contiguous strides)."""
    strides, step = [], 1
    for size in reversed(sizes):
        strides.insert(0, step)
        step *= max(size, 1)
    return (struct.pack("<IIiiII", FLOAT32_CODE, len(sizes), 0, -1, 0, 0) +
            struct.pack(f"<{len(sizes)}q", *sizes) + struct.pack(f"<{len(sizes)}q", *strides))


def value(pair: str, producer: str, payload_bytes: int, chunks: int, header: bytes = b"",
          inline: bytes = b"", checksum: int = 0) -> bytes:
    return (head(b"V", pair, producer) +
            struct.pack("<BIQIQI", 0, 0, payload_bytes, chunks, checksum, len(header)) + header +
            inline)


def error(pair: str, producer: str, code: int, text: bytes) -> bytes:
    """An error message: its code, and its text (u8 type bytes | type | u16 detail bytes |
    detail | traceback) as the kind encodes it."""
    return (head(b"V", pair, producer) +
            struct.pack("<BIQIQI", 1, code, 0, 0, 0, len(text)) + text)


def chunked(pair: str, producer: str, payload_bytes: int) -> bytes:
    """A value message naming as many chunks as `payload_bytes` needs (none written), with a
    header that implies that size (float32 elements)."""
    chunks = (payload_bytes + CHUNK_BYTES - 1) // CHUNK_BYTES
    return value(pair, producer, payload_bytes, chunks, tensor_header([payload_bytes // 4]))


def attach(pair: str, producer: str, pid: int = 4242, boot_id: str = None,
           pid_namespace: int = 1) -> bytes:
    """An attach message (by default from a process on another host: a random boot id)."""
    boot = (boot_id or hex_id()).encode()
    host = b"forger"
    return (head(b"A", pair, producer) +
            struct.pack("<BiQQB", 0, pid, 1, pid_namespace, len(boot)) + boot +
            struct.pack("<B", len(host)) + host + hex_id(16).encode())


def junk(rng: random.Random, genuine_pairs: list) -> bytes:
    """One junk message: none decodes as a value of a genuine pair (those cost their pair by
    design, and are tried on their own): random bytes, messages for pairs that do not exist, and
    messages of every other type for genuine pairs from producers that do not exist."""
    pair = rng.choice(genuine_pairs) if genuine_pairs else hex_id()
    producer = hex_id()
    choice = rng.randrange(10)
    if choice == 0:
        return os.urandom(rng.randrange(0, 96))
    if choice == 1:
        return b"W" + os.urandom(rng.randrange(1, 8))
    if choice == 2:
        return attach(pair, producer)
    if choice == 3:
        return head(b"D", pair, producer) + hex_id(16).encode()
    if choice == 4:
        return head(b"S", pair, producer)
    if choice == 5:
        return head(b"X", pair, producer)
    if choice == 6:
        return head(b"R", pair, producer)
    if choice == 7:  # a pair that does not exist, the largest chunk count
        return value(hex_id(), producer, MAX_U32 * CHUNK_BYTES, MAX_U32,
                     tensor_header([MAX_U32 * CHUNK_BYTES // 4]))
    if choice == 8:  # a genuine pair, a chunk count that disagrees with the size: not a message
        return value(pair, producer, 5 * CHUNK_BYTES, 7, tensor_header([5 * CHUNK_BYTES // 4]))
    return value(pair, producer, 9, 0, b"", b"12345678")  # inline size disagrees: not a message


def flood(port: int, consumer: str, genuine_pairs: list, count: int, seconds: float,
          started, seed: int = 0) -> int:
    """Pushes `count` junk messages to `consumer`'s queue, evenly over about `seconds` (in
    batches of 50); sets `started` (a multiprocessing Event) first. Returns how many it pushed."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=30))
    rng = random.Random(seed)
    messages = [junk(rng, genuine_pairs) for _ in range(count)]
    key = queue_key(consumer)
    started.set()
    begin = time.monotonic()
    for i, message in enumerate(messages):
        store.queue_push(key, message)
        if i % 50 == 49:
            lag = begin + seconds * (i + 1) / count - time.monotonic()
            if lag > 0:
                time.sleep(lag)
    return len(messages)
