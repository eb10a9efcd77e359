"""Functions that test_network_pairs.py runs in its other processes: a peer that speaks the link
protocol by hand (frames as links.h in csrc/core/kinds/network describes them, some malformed on
purpose), and producers whose settings the test chooses.
"""
import datetime
import os
import struct
import time

import torch
import torch.distributed as dist

import dtorch_ops
from dtorch_ops import _pair_groups

KEY_PREFIX = "dtorch/n/"
FRAME_MAGIC = 0x31746c64
FRAME_TAG = 1


def frame(kind: bytes, body: bytes) -> bytes:
    return struct.pack("<I", FRAME_MAGIC) + kind + struct.pack("<I", len(body)) + body


def value_message(pair: str, producer: str, header: bytes, payload: bytes = b"",
                  payload_bytes: int = None) -> bytes:
    """A value message (EncodeValue): its payload inline, or none where payload_bytes says how
    many follow."""
    size = len(payload) if payload_bytes is None else 0
    return (b"V" + pair.encode() + producer.encode() +
            struct.pack("<BIQIQI", 0, 0, size, 0, 0, len(header)) + header + payload)


def payload_frame(pair: str, producer: str, header: bytes, payload_bytes: int) -> bytes:
    """A 'P' frame: the payload's size, then the value message without it."""
    return frame(b"P", struct.pack("<Q", payload_bytes) + value_message(pair, producer, header,
                                                                         payload_bytes=0))


def send_on_a_forged_link(address: str, consumer: str, link: str, producer: str,
                          frames: list) -> int:
    """Asks `consumer` for link `link` as producer `producer` (its link request on its queue),
    makes the producer's end and sends `frames` on it; returns how many the consumer took (a
    send fails once it closed the link). The peer's end is closed before this returns (its
    sockets close, as a killed process's do)."""
    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False)
    store.queue_push(KEY_PREFIX + "q/" + consumer, ("G" + link + producer).encode())
    group = _pair_groups.make_pair_group(host, int(port), KEY_PREFIX + "p/" + link, 1, 10_000)
    sent = 0
    for f in frames:
        try:
            group.send([torch.frombuffer(bytearray(f), dtype=torch.uint8)], 0, FRAME_TAG).wait(
                datetime.timedelta(seconds=5))
        except RuntimeError:
            break
        sent += 1
    del group
    return sent


def configure_links(pair_groups: int = None, idle_s: float = None,
                    heartbeat_timeout_s: float = None) -> None:
    if pair_groups is not None:
        dtorch_ops.config.network_pair_groups = pair_groups
    if idle_s is not None:
        dtorch_ops.config.network_pair_idle_s = idle_s
    if heartbeat_timeout_s is not None:
        dtorch_ops.config.network_heartbeat_timeout_s = heartbeat_timeout_s


def links() -> dict:
    network = dtorch_ops._C.diagnostics()["network"]
    return {"in": network["links_in"], "out": network["links_out"]}


def set_values(handles: list, values: list) -> dict:
    """Sets each handle's promise to its value; returns this process's links afterwards."""
    for handle, value in zip(handles, values):
        dtorch_ops.TensorPromise.from_serialized(handle).set_value(value)
    return links()


_HELD = {}


def hold(handle: str) -> None:
    """Deserializes the handle (this process is a holder the consumer watches) and keeps it."""
    _HELD[handle] = dtorch_ops.TensorPromise.from_serialized(handle)


def wait_for_no_link_out(timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while links()["out"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return links()
