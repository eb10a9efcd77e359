"""The promise kinds' keyword options in Python, and the one string TorchScript and C++ take that
they make ("file://device=cpu", "network://host:port?device=cpu"); and promise_kind_for.

``KINDS`` is the one table of them: a kind whose promises take keyword options has one entry,
naming the options each promise class takes, those it needs, its object-valued ones (a Python
object the library cannot take, such as the network kind's ``store=``: what turns it into text),
and how the checked options become the kind's string. A kind without an entry takes no options
(its string is its name); the library checks the kind's name and the string's options.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from .compile.tracing import _check_local_tensor
from .config import config


@dataclass(frozen=True)
class KindOptions:
    """The keyword options of one promise kind (an entry of KINDS)."""

    # Promise class name -> the options it takes; a class not named takes none.
    takes: Mapping[str, tuple[str, ...]]
    # (class name, options) -> the kind's string; the object-valued options are their text by
    # then. Checks the values (TypeError, ValueError).
    spec: Callable[[str, dict], str]
    # Options that must be given -> what to pass (said when one is missing).
    needs: Mapping[str, str] = field(default_factory=dict)
    # Options with a default found at call time -> what finds it (None: none found, so the
    # option is needed after all).
    defaults: Mapping[str, Callable[[], object]] = field(default_factory=dict)
    # Object-valued options -> what turns the object into its text (a TypeError if it cannot).
    objects: Mapping[str, Callable[[object], str]] = field(default_factory=dict)
    # The message for options the class does not take: a str.format of name, kind, allowed,
    # unknown; None: "dtorch_ops.<name>(kind=...) takes the options a=, b=; got [...]".
    unknown_options: str | None = None


def _kind_spec(name: str, kind: str, options: dict) -> str:
    """A promise kind with its options in the one string TorchScript and C++ take
    ("file://device=cpu"), for ``<name>(kind=kind, **options)`` (name: "TensorPromise",
    "VoidPromise"). The kinds' options: KINDS."""
    entry = KINDS.get(kind)
    allowed = () if entry is None else entry.takes.get(name, ())
    if not allowed:
        if options:
            raise TypeError(f"dtorch_ops.{name}(kind={kind!r}) got options {sorted(options)} "
                            f"that this kind does not take")
        return kind
    if not options and not entry.needs:
        return kind
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        if entry.unknown_options is not None:
            message = entry.unknown_options.format(name=name, kind=kind, allowed=allowed,
                                                   unknown=unknown)
        else:
            message = (f"dtorch_ops.{name}(kind={kind!r}) takes the options "
                       f"{', '.join(sorted(a + '=' for a in allowed))}; got {unknown}")
        raise TypeError(message)
    for option, find_default in entry.defaults.items():
        if option not in options and option in allowed:
            default = find_default()
            if default is not None:
                options = {**options, option: default}
    for option, what in entry.needs.items():
        if option not in options:
            raise TypeError(f"dtorch_ops.{name}(kind={kind!r}) needs {option}=: {what}")
    texts = {option: (entry.objects[option](value) if option in entry.objects else value)
             for option, value in options.items()}
    return entry.spec(name, texts)


def _file_spec(name: str, options: dict) -> str:
    """TensorPromise(kind="file") takes device="cpu" (the consumer receives CPU tensors) and
    zero_copy=True (a CUDA value arrives as the IPC view of the producer's memory, not copied)."""
    device, zero_copy = options.get("device"), options.get("zero_copy", False)
    if not isinstance(zero_copy, bool):
        raise TypeError(f"zero_copy must be a bool, got {zero_copy!r}")
    if device is not None and torch.device(device) != torch.device("cpu"):
        raise ValueError(
            f"TensorPromise(kind='file', device=...) takes device='cpu' (the consumer then "
            f"receives CPU tensors), got {device!r}; without device=, a device tensor arrives on "
            f"the same device when this process has it")
    if device is not None and zero_copy:
        raise ValueError("TensorPromise(kind='file'): zero_copy=True shares device memory, "
                         "device='cpu' asks for CPU tensors: pass one of them")
    if device is not None:
        return "file://device=cpu"
    return "file://zero_copy" if zero_copy else "file"


def _store_address(store) -> str:
    """"host:port" of the TCPStore `store` is (or wraps, as a PrefixStore does), or `store` itself
    when it is that string already."""
    if isinstance(store, str):
        return store  # checked by the library
    import torch.distributed as dist

    seen = store
    while isinstance(seen, dist.PrefixStore):
        seen = seen.underlying_store
    if isinstance(seen, dist.TCPStore):
        host = seen.host
        return f"[{host}]:{seen.port}" if ":" in host else f"{host}:{seen.port}"
    raise TypeError(
        f"store= takes a torch.distributed.TCPStore (or a PrefixStore over one, as the default "
        f"group's store is) or its address \"host:port\", got {type(store).__name__}: the "
        f"network kind needs a store that other hosts can reach")


def _default_group_store():
    """The store of torch.distributed's default process group, once init_process_group has run
    (None before, or where torch has no distributed package)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    # torch names no public accessor of the default group's store; this one has the same name
    # and meaning from torch 2.0 to 2.15 (a store of its own is always accepted as store=).
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    seen = store
    while isinstance(seen, dist.PrefixStore):
        seen = seen.underlying_store
    if not isinstance(seen, dist.TCPStore):
        raise TypeError(
            f"dtorch: the default process group's store is a {type(seen).__name__}, which other "
            f"hosts cannot reach; the network kind needs a TCPStore: pass store= (a "
            f"torch.distributed.TCPStore, or \"host:port\" of one), or init the group with a "
            f"tcp:// or env:// init_method")
    return store


def _network_spec(name: str, options: dict) -> str:
    """"network://host:port[?device=cpu]" from TensorPromise(kind="network", store=...,
    device="cpu") (store: its address by then)."""
    spec = "network://" + options["store"]
    device = options.get("device")
    if device is not None:
        if torch.device(device) != torch.device("cpu"):
            raise ValueError(
                f"TensorPromise(kind='network', device=...) takes device='cpu' (the consumer then "
                f"receives CPU tensors), got {device!r}; without device=, a device tensor arrives "
                f"on the same device type when this process has it")
        spec += "?device=cpu"
    return spec


# The kinds whose promises take keyword options (the others, "memory", take none).
KINDS: dict[str, KindOptions] = {
    "file": KindOptions(
        takes={"TensorPromise": ("device", "zero_copy")},
        spec=_file_spec,
        unknown_options=("dtorch_ops.TensorPromise(kind='file') takes the options device= and "
                         "zero_copy=, got {unknown}")),
    "network": KindOptions(
        takes={"TensorPromise": ("store", "device"), "VoidPromise": ("store",)},
        spec=_network_spec,
        needs={"store": "a torch.distributed.TCPStore (or a PrefixStore over one) or "
                        "\"host:port\"; after torch.distributed.init_process_group() the "
                        "default group's store serves without store="},
        defaults={"store": _default_group_store},
        objects={"store": _store_address}),
}


def promise_kind_for(t: torch.Tensor, per_device_per_process: bool | None = None) -> str:
    """The promise kind for a pair whose promise a worker fulfils with t.

    CPU tensor -> "memory"; device tensor with per_device_per_process -> "file" (one worker
    process per device); otherwise "memory". per_device_per_process=None takes
    dtorch_ops.config.per_device_per_process.
    """
    _check_local_tensor(t, "promise_kind_for")
    if per_device_per_process is None:
        per_device_per_process = config.per_device_per_process
    if t.device.type == "cpu":
        return "memory"
    return "file" if per_device_per_process else "memory"
