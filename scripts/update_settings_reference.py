"""Writes the settings table (csrc/core/settings.h, as dtorch_ops.config reads it) into
docs/reference/settings.md, between its markers. tests/test_settings_reference.py checks that the
page matches the table; run this after adding or changing a setting."""
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PAGE = os.path.join(HERE, "..", "docs", "reference", "settings.md")
BEGIN, END = "<!-- settings:begin -->", "<!-- settings:end -->"


def generated_block() -> str:
    import importlib

    # (The module: `dtorch_ops.config` the attribute is the Config object.)
    settings_module = importlib.import_module("dtorch_ops.config")
    return f"{BEGIN}\n{settings_module.reference_markdown()}{END}"


def page_with_block(text: str) -> str:
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        sys.exit(f"{PAGE} has no {BEGIN} ... {END} block")
    return pattern.sub(lambda _: generated_block(), text, count=1)


if __name__ == "__main__":
    with open(PAGE) as f:
        text = f.read()
    updated = page_with_block(text)  # (before opening for writing: a failure keeps the page)
    with open(PAGE, "w") as f:
        f.write(updated)
    print(f"wrote {os.path.normpath(PAGE)}")
