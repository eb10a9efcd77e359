"""The package's typing, as IDEs and mypy see it: mypy type-checks the examples (every
examples/*.py present when the test runs) and tests/typing_usage.py, whose assert_type lines pin
the public API's types; the binding's stub (dtorch_ops/_C.pyi) declares what the compiled module
defines; dtorch_ops.config's settings (attributes made at import) are declared for checkers; and
the package ships py.typed and the stub.

mypy runs with its cache in build/mypy-cache (build/ is ignored by git; ~45 MB): a cold run
analyses torch's sources, ~25 s and ~0.8 GB on 2 cores; a warm one takes ~1 s. mypy comes with
`make build` (scripts/install_deps.sh).
"""
import ast
import glob
import importlib.util
import os
import subprocess
import sys

import pytest

import dtorch_ops
from dtorch_ops import _C

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_DIR = os.path.join(REPO, "dtorch_ops")
STUB = os.path.join(PACKAGE_DIR, "_C.pyi")
USAGE = os.path.join(REPO, "tests", "typing_usage.py")
CACHE_DIR = os.path.join(REPO, "build", "mypy-cache")

# The package is checked as users see it installed (py.typed): its own modules' errors are not
# reported (follow_imports = silent), their types are used. The stub is passed as a source file,
# so that an error in it is reported. The usage file's `# type: ignore[code]` lines must stay
# errors (warn_unused_ignores).
MYPY_CONFIG = f"""\
[mypy]
cache_dir = {CACHE_DIR}
show_error_codes = True
pretty = False

[mypy-dtorch_ops,dtorch_ops.*]
follow_imports = silent

[mypy-typing_usage]
warn_unused_ignores = True
"""


def _require_mypy() -> None:
    if importlib.util.find_spec("mypy") is None:
        pytest.fail(f"mypy is not installed for {sys.executable}: run `make build` (its "
                    "scripts/install_deps.sh installs it), or pip install mypy")


def _run_mypy(files, tmp_path):
    config = tmp_path / "mypy.ini"
    config.write_text(MYPY_CONFIG)
    # The checkout's dtorch_ops, whatever else is installed (MYPYPATH comes first).
    env = {**os.environ, "MYPYPATH": REPO}
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(config), *files],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=540)


@pytest.mark.timeout(600)
def test_mypy_passes_on_the_examples_and_the_typed_usage(tmp_path):
    _require_mypy()
    examples = sorted(glob.glob(os.path.join(REPO, "examples", "*.py")))
    assert examples, "no examples/*.py found"
    files = [os.path.relpath(p, REPO) for p in (*examples, USAGE, STUB)]
    proc = _run_mypy(files, tmp_path)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, (
        f"mypy {' '.join(files)} failed (exit {proc.returncode}). An error in examples/ is the "
        "example's own, or the package's typing is wrong or missing (dtorch_ops/_C.pyi, the "
        "installed methods declared under TYPE_CHECKING in dtorch_ops/futures.py, the functions' "
        "annotations); one in tests/typing_usage.py is a type that changed:\n" + report)
    assert f"no issues found in {len(files)} source files" in report, report


def _stub_names():
    """(module-level names, {class name: its members}) that _C.pyi declares, public ones."""
    with open(STUB, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    functions, classes = set(), {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            classes[node.name] = {item.name for item in node.body
                                  if isinstance(item, ast.FunctionDef)
                                  and not item.name.startswith("_")}
        elif isinstance(node, ast.FunctionDef):
            functions.add(node.name)
    return ({name for name in functions if not name.startswith("_")},
            {name: members for name, members in classes.items() if not name.startswith("_")})


def test_the_stub_declares_what_the_binding_defines():
    functions, classes = _stub_names()
    runtime = {name for name in dir(_C) if not name.startswith("_")}
    runtime_classes = {name for name in runtime if isinstance(getattr(_C, name), type)}
    assert runtime_classes == set(classes), (
        "dtorch_ops/_C.pyi's classes differ from the binding's (csrc/python/module.cpp): "
        f"missing from the stub {sorted(runtime_classes - set(classes))}, not in the binding "
        f"{sorted(set(classes) - runtime_classes)}")
    assert runtime - runtime_classes == functions, (
        "dtorch_ops/_C.pyi's functions differ from the binding's: missing from the stub "
        f"{sorted(runtime - runtime_classes - functions)}, not in the binding "
        f"{sorted(functions - (runtime - runtime_classes))}")
    for name, members in classes.items():
        defined = {m for m in vars(getattr(_C, name)) if not m.startswith("_")}
        assert defined == members, (
            f"dtorch_ops/_C.pyi's {name} differs from the binding's: missing from the stub "
            f"{sorted(defined - members)}, not in the binding {sorted(members - defined)}")


def test_the_installed_methods_are_declared_for_type_checkers():
    """Every method _C.install_wait_methods puts on a future class is declared in that class (or
    a base) under TYPE_CHECKING in dtorch_ops/futures.py."""
    with open(os.path.join(PACKAGE_DIR, "futures.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    declared = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names = set()
            for item in node.body:
                if (isinstance(item, ast.If) and isinstance(item.test, ast.Name)
                        and item.test.id == "TYPE_CHECKING"):
                    names |= {d.name for d in item.body if isinstance(d, ast.FunctionDef)}
                elif isinstance(item, ast.FunctionDef):
                    names.add(item.name)
            declared[node.name] = names
    for cls in (dtorch_ops.TensorFuture, dtorch_ops.TensorListFuture, dtorch_ops.VoidFuture,
                dtorch_ops.VoidFutureCollect, dtorch_ops.ObjectFuture):
        installed = {name for name, value in vars(cls).items()
                     if type(value).__name__ == "instancemethod"}
        assert installed, f"{cls.__name__}: no installed methods found"
        seen = set().union(*(declared.get(base.__name__, set()) for base in cls.__mro__))
        assert installed <= seen, (
            f"{cls.__name__}: installed by the binding but not declared for type checkers "
            f"(dtorch_ops/futures.py, under TYPE_CHECKING): {sorted(installed - seen)}")


def test_the_settings_are_declared_for_type_checkers():
    """dtorch_ops.config's settings are made at import from the library's table; Config
    declares them under TYPE_CHECKING, each with its type (seconds: float, counts: int)."""
    with open(os.path.join(PACKAGE_DIR, "config.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    (config_class,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Config"]
    declared = {}
    for item in config_class.body:
        if (isinstance(item, ast.If) and isinstance(item.test, ast.Name)
                and item.test.id == "TYPE_CHECKING"):
            declared.update({d.target.id: ast.unparse(d.annotation) for d in item.body
                             if isinstance(d, ast.AnnAssign) and isinstance(d.target, ast.Name)})
    table = {e["name"]: ("float" if e["unit"] == "s" else "int") for e in _C.settings()}
    assert declared == table, (
        "dtorch_ops/config.py's Config declares (under TYPE_CHECKING) other settings than the "
        f"library's table: declared {declared}, the table's {table}")


@pytest.mark.timeout(120)
def test_the_package_ships_py_typed_and_the_stub(tmp_path):
    """The package data (pyproject.toml) puts py.typed and _C.pyi next to the modules (build_py
    only: nothing is compiled; tests/test_packaging.py checks the wheel)."""
    assert os.path.isfile(os.path.join(PACKAGE_DIR, "py.typed"))
    proc = subprocess.run(
        [sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path), "build_py",
         "--build-lib", str(tmp_path / "lib")],
        cwd=REPO, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("py.typed", "_C.pyi", "__init__.py"):
        assert (tmp_path / "lib" / "dtorch_ops" / name).is_file(), name
