"""The settings reference (docs/reference/settings.md) is the settings table: generated from it
(scripts/update_settings_reference.py), and dtorch_ops.config exposes exactly the table's
entries."""
import importlib.util
import os

import dtorch_ops
from dtorch_ops import _C

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _generator():
    spec = importlib.util.spec_from_file_location(
        "update_settings_reference", os.path.join(ROOT, "scripts", "update_settings_reference.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_page_is_the_table():
    generator = _generator()
    with open(generator.PAGE) as f:
        text = f.read()
    assert generator.page_with_block(text) == text, (
        "docs/reference/settings.md is not the settings table: run "
        "python3 scripts/update_settings_reference.py")


def test_config_has_one_attribute_per_table_entry():
    table = _C.settings()
    names = [entry["name"] for entry in table]
    assert len(names) == len(set(names)) >= 8
    for entry in table:
        assert entry["unit"] in ("s", "count") and entry["doc"]
        assert entry["minimum"] <= entry["default"] <= entry["maximum"]
        shown = getattr(dtorch_ops.config, entry["name"])
        assert shown == (entry["default"] / 1000 if entry["unit"] == "s" else entry["default"])
        assert entry["doc"] in type(dtorch_ops.config).__dict__[entry["name"]].__doc__
    text = repr(dtorch_ops.config)
    assert all(f"{name}=" in text for name in ["per_device_per_process", *names])
