"""The point-to-point links of network promises: 2-rank Gloo groups, made here for the C++ kind.

A value of a network pair travels over a link between its consumer's process and its producer's
when both run Python with torch.distributed's Gloo (else, and with
``dtorch_ops.config.network_pair_groups = 0``, through the store). The kind asks for a group
through the maker registered below: ``ProcessGroupGloo(PrefixStore(prefix, store), rank, 2)`` on a
client of the pair's store, with no default process group and nothing for the user to set up.
Every group of a process shares one Gloo device (one thread), bound to the address this host
reaches the store from (``GLOO_SOCKET_IFNAME`` names an interface instead), and runs no worker
threads of its own (send and recv need none). A fork child makes its own clients and device.
"""
import datetime
import os
import socket
import threading

import torch.distributed as dist

_lock = threading.Lock()  # (made anew in a fork child: another thread may hold it at the fork)
_stores = {}   # (pid, host, port) -> a TCPStore client
_devices = {}  # (pid, address or interface) -> a Gloo device


def _local_address(host: str, port: int) -> str:
    """The address this host reaches host:port from (a connected UDP socket sends nothing)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def _device(host: str, port: int):
    interface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    key = (os.getpid(), interface or _local_address(host, port))
    with _lock:
        device = _devices.get(key)
        if device is None:
            if interface:
                device = dist.ProcessGroupGloo.create_device(interface=interface)
            else:
                device = dist.ProcessGroupGloo.create_device(hostname=key[1])
            _devices[key] = device
        return device


def _store(host: str, port: int, timeout: datetime.timedelta):
    key = (os.getpid(), host, port)
    with _lock:
        store = _stores.get(key)
        if store is None:
            store = dist.TCPStore(host, port, is_master=False, timeout=timeout,
                                  wait_for_workers=False)
            _stores[key] = store
        return store


def make_pair_group(host: str, port: int, prefix: str, rank: int, timeout_ms: int):
    """This process's end (rank 0: the consumer, 1: the producer) of the 2-rank group whose
    rendezvous keys start with ``prefix`` on the store at host:port."""
    timeout = datetime.timedelta(milliseconds=timeout_ms)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [_device(host, port)]
    options._threads = 0
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, _store(host, port, timeout)), rank, 2,
                                 options)


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def register(binding) -> None:
    """Hands the maker to the binding where this torch has Gloo."""
    if dist.is_available() and dist.is_gloo_available():
        binding.set_pair_group_maker(make_pair_group)
