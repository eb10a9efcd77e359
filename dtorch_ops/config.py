"""Process-wide settings of dtorch_ops: ``dtorch_ops.config.<name> = value``.

Every setting but ``per_device_per_process`` lives in the C++ library (C++ programs share them)
and is described there, in one table (csrc/core/settings.h): this module builds its attributes
from that table (``_C.settings()``), and so does the reference, docs/reference/settings.md
(``python -m dtorch_ops.config --markdown``). Setting one here checks it and applies it at once.
"""
import math
from typing import TYPE_CHECKING

from . import _C


def _format_value(value, unit):
    """A held value as Python shows it: seconds (a float) for a time, else the count."""
    if unit == "s":
        return value / 1000
    return value


class _LibrarySetting:
    """A setting held by the library, from one entry of its table: get/set through _C, scaled
    between Python's unit and the library's (seconds here, milliseconds there)."""

    def __init__(self, entry):
        self._name, self._unit = entry["name"], entry["unit"]
        self.entry = entry
        self.__doc__ = f"{entry['doc']} (default {_format_value(entry['default'], self._unit)})"

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        return _format_value(_C.get_setting(self._name), self._unit)

    def __set__(self, obj, value):
        seconds = self._unit == "s"
        if isinstance(value, bool) or not isinstance(value, (int, float) if seconds else int):
            raise TypeError(f"dtorch_ops.config.{self._name} must be "
                            f"{'a number' if seconds else 'an int'}, got {type(value).__name__}")
        native = value
        if seconds:
            native = value * 1000
            if math.isnan(native):
                raise ValueError(f"dtorch_ops.config.{self._name} must be a number, got nan")
            native = math.ceil(min(max(native, -1), 2**62))  # +-inf: the library judges
        try:
            _C.set_setting(self._name, int(native))
        except ValueError as e:
            raise ValueError(f"dtorch_ops.config.{self._name} = {value!r}: {e}") from None
        except RuntimeError as e:
            raise RuntimeError(f"dtorch_ops.config.{self._name} = {value!r}: {e}") from None


_TABLE = _C.settings()


class Config:
    # The seed's perDevicePerProcess: device tensors are produced by one worker process per device,
    # so a pair whose promise such a worker fulfils must be able to cross processes ("file" kind).
    # The default for promise_kind_for(..., per_device_per_process=None).
    per_device_per_process: bool = False

    if TYPE_CHECKING:
        # The library's settings, made below from its table (_C.settings()): seconds (a float;
        # an int is taken too) or a count. tests/test_typing.py checks the list against it.
        max_detector_threads: int
        detector_idle_exit_s: float
        pool_threads: int
        exit_timeout_s: float
        attach_timeout_s: float
        network_heartbeat_timeout_s: float
        network_store_timeout_s: float
        network_pair_groups: int
        network_pair_idle_s: float
        file_payload_idle_s: float

    def __repr__(self) -> str:
        names = ("per_device_per_process", *(entry["name"] for entry in _TABLE))
        return "dtorch_ops.Config(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in names) + ")"


for _entry in _TABLE:
    setattr(Config, _entry["name"], _LibrarySetting(_entry))
del _entry


def _bound(value, unit):
    # (Timeouts are bounded at 2^40 ms, about 35 years, so that deadlines cannot overflow.)
    if value >= 2**62 or (unit == "s" and value >= 2**40):
        return "no limit"
    return f"{_format_value(value, unit):g}"


def reference_markdown() -> str:
    """The settings reference (docs/reference/settings.md's generated part), from the table."""
    lines = ["| setting | unit | default | minimum | maximum |",
             "|---|---|---|---|---|",
             "| `per_device_per_process` | bool | False | | |"]
    for e in _TABLE:
        unit = "seconds" if e["unit"] == "s" else "count"
        lines.append(f"| `{e['name']}` | {unit} | {_format_value(e['default'], e['unit']):g} | "
                     f"{_bound(e['minimum'], e['unit'])} | {_bound(e['maximum'], e['unit'])} |")
    lines.append("")
    lines.append("- `per_device_per_process`: the seed's perDevicePerProcess: device tensors are "
                 "produced by one worker process per device, so a pair whose promise such a "
                 "worker fulfils must be able to cross processes (the \"file\" kind); the default "
                 "of `promise_kind_for(..., per_device_per_process=None)`. Held in Python.")
    for e in _TABLE:
        lines.append(f"- `{e['name']}`: {e['doc']}")
    return "\n".join(lines) + "\n"


config = Config()

if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m dtorch_ops.config --markdown")
    sys.stdout.write(reference_markdown())
