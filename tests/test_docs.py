"""The docs hold together: every relative link in README.md and docs/ resolves, the README stays
the front door (small, naming the kinds and the test command), and no page carries measured
figures (those live only in the generated benchmarks/REPORT.md)."""
import glob
import os
import re

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PAGES = [os.path.join(ROOT, "README.md"),
         *sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
MEASURED = [
    re.compile(r"\b\d+(\.\d+)?\s*(µs|us|GB/s|GiB/s|MB/s|futures/s)(?![\w/])"),
    re.compile(r"\b\d+(\.\d+)?\s*[x×] (faster|slower)\b"),
    re.compile(r"\b\d+(\.\d+)?[x×] (the |a )"),
]


def _name(page):
    return os.path.relpath(page, ROOT)


def test_the_pages_exist():
    names = {_name(p) for p in PAGES}
    for expected in ["docs/guide/python-api.md", "docs/guide/cross-process.md",
                     "docs/guide/network.md", "docs/guide/compile.md", "docs/guide/cpp.md",
                     "docs/reference/ops.md", "docs/reference/errors.md",
                     "docs/reference/settings.md", "docs/design/architecture.md",
                     "docs/design/threads-exit-fork.md", "docs/development/testing.md",
                     "docs/development/benchmarks.md", "docs/development/layout.md",
                     "docs/design/file-protocol.md", "docs/design/network-protocol.md",
                     "docs/README.md"]:
        assert expected in names


def test_the_settings_page_is_one_generated_block():
    with open(os.path.join(ROOT, "docs", "reference", "settings.md"), encoding="utf-8") as f:
        text = f.read()
    assert text.count("<!-- settings:begin -->") == 1
    assert text.count("<!-- settings:end -->") == 1
    assert text.index("<!-- settings:begin -->") < text.index("<!-- settings:end -->")


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_relative_link_resolves(page):
    with open(page, encoding="utf-8") as f:
        text = f.read()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # (code is not links)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = os.path.normpath(os.path.join(os.path.dirname(page), target.split("#")[0]))
        assert os.path.exists(path), f"{_name(page)} links to {target}, which does not exist"


def test_the_readme_is_the_front_door():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    assert len(text.encode()) < 20_000
    assert "make test" in text
    for kind in ("memory", "file", "network"):
        assert f"`{kind}`" in text
    assert "docs/design/architecture.md" in text
    for word in ("get_tensor_async", ".wait(", ".get(", "await ", "torch.compile", "make build"):
        assert word in text, f"the README's tour lacks {word!r}"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_no_measured_figures(page):
    with open(page, encoding="utf-8") as f:
        text = f.read()
    for pattern in MEASURED:
        match = pattern.search(text)
        assert match is None, (
            f"{_name(page)} states a measured figure ({match.group(0)!r}): figures live only in "
            "the generated benchmarks/REPORT.md")


def test_the_figure_patterns_catch_figures():
    assert any(p.search("47-56 us one way") for p in MEASURED)
    assert any(p.search("12.4 GB/s at 512 MiB") for p in MEASURED)
    assert any(p.search("9.4x faster than") for p in MEASURED)
    assert not any(p.search("exit_timeout_s (1 s), 4 KiB control segment") for p in MEASURED)
