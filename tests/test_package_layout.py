"""The Python package's layout, read from its sources (nothing is imported): every module stays
small (at most 600 lines), the dtorch_ops modules import one another without a cycle, and the
promise kinds' option parsing lives in one module (dtorch_ops/kind_options.py).

The import graph has an edge A -> B for each import in A (at module level or nested in a function:
a deferred import is an edge too) that loads dtorch_ops module B:

- ``import dtorch_ops.x.y`` -> dtorch_ops.x.y; ``import dtorch_ops`` -> dtorch_ops (its __init__);
- ``from dtorch_ops.x import y`` / ``from .x import y`` / ``from . import y`` -> the submodule
  dtorch_ops.x.y where y is one, else the module it is taken from (dtorch_ops.x; for
  ``from dtorch_ops import TensorFuture`` that is the package's __init__, which imports every
  module: such an import in a submodule is a cycle);
- ``importlib.import_module("dtorch_ops.x")`` -> dtorch_ops.x.

The compiled extension (dtorch_ops._C) is no node. Nor is the edge Python adds from a submodule to
its package's __init__ (importing dtorch_ops.compile.tracing runs dtorch_ops/compile/__init__.py
first): a package's __init__ importing its own submodules is no cycle; one importing a module that
imports back into that package's submodules is caught where it imports one of them by name.
"""
import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "dtorch_ops"
PACKAGE_DIR = os.path.join(REPO, PACKAGE)
MAX_LINES = 600
# Not Python sources: the binding (a compiled extension module).
EXTENSIONS = {"dtorch_ops._C"}
# The one module that parses the kinds' options (and holds their table, KINDS).
KIND_OPTIONS_MODULE = "dtorch_ops.kind_options"


def _module_files(package_dir=PACKAGE_DIR, package=PACKAGE):
    """{dotted module name: path} of every .py file under the package (dtorch_ops/x/__init__.py is
    dtorch_ops.x)."""
    modules = {}
    for root, dirs, files in os.walk(package_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            parts = os.path.relpath(path, os.path.dirname(package_dir))[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_package(name, modules):
    return modules[name].endswith("__init__.py")


def _import_targets(name: str, source: str, modules: dict) -> set:
    """The dtorch_ops modules that the imports in `source` (module `name`) load, anywhere in it."""
    tree = ast.parse(source)
    targets = set()

    def known(dotted):
        """dotted, or the longest prefix of it that is a module of the package."""
        while dotted and dotted not in modules and dotted not in EXTENSIONS:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def add(dotted):
        if dotted is not None and dotted not in EXTENSIONS:
            targets.add(dotted)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    add(known(alias.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name if _is_package(name, modules) else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                if node.module:
                    base = f"{base}.{node.module}"
            else:
                base = node.module
                if not (base == PACKAGE or base.startswith(PACKAGE + ".")):
                    continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in modules or submodule in EXTENSIONS:
                    add(submodule)
                else:
                    add(known(base))
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and ast.unparse(node.func) in ("importlib.import_module", "import_module",
                                             "__import__")):
            dotted = node.args[0].value
            if dotted == PACKAGE or dotted.startswith(PACKAGE + "."):
                add(known(dotted))
    return targets


def _import_graph(modules: dict) -> dict:
    graph = {}
    for name, path in modules.items():
        with open(path, encoding="utf-8") as f:
            graph[name] = _import_targets(name, f.read(), modules)
    return graph


def _cycles(graph: dict) -> list:
    """Cycles (lists of modules, first == last) in the strongly connected components that have
    one (Tarjan's algorithm; a module importing itself is one too): a shortest one through each
    module of such a component, those over the same modules once."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    counter = [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                components.append(set(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)

    cycles = []
    for component in components:
        found = set()
        for start in sorted(component):
            cycle = _shortest_cycle(graph, component, start)
            key = frozenset(cycle)
            if key not in found:
                found.add(key)
                cycles.append(cycle)
    return cycles


def _shortest_cycle(graph, component, start) -> list:
    """start, ..., start: a shortest way back to start within its component (breadth first)."""
    parents, frontier, end = {start: None}, [start], None
    while end is None:
        following = []
        for node in frontier:
            if start in graph[node]:
                end = node
                break
            for succ in sorted(graph[node] & component):
                if succ not in parents:
                    parents[succ] = node
                    following.append(succ)
        frontier = following
    path = [start]
    while end is not None:
        path.append(end)
        end = parents[end]
    return path[1:][::-1] + [start]


MODULES = _module_files()


def test_the_package_is_found():
    # The checks below are only as good as what they read.
    assert {"dtorch_ops", "dtorch_ops.futures", "dtorch_ops.promises", KIND_OPTIONS_MODULE,
            "dtorch_ops.compile", "dtorch_ops.compile.graph_ops"} <= set(MODULES)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_is_at_most_600_lines(name):
    with open(MODULES[name], encoding="utf-8") as f:
        lines = sum(1 for _ in f)
    assert lines <= MAX_LINES, f"{MODULES[name]} has {lines} lines (at most {MAX_LINES}): split it"


def test_imports_are_read_as_edges():
    modules = {name: "x.py" for name in ("dtorch_ops.a", "dtorch_ops.b", "dtorch_ops.sub.c",
                                         "dtorch_ops.sub.d")}
    modules["dtorch_ops"] = modules["dtorch_ops.sub"] = "__init__.py"
    source = "\n".join([
        "import os",
        "from . import b, _C",                      # a submodule; the extension is no node
        "from .sub import c",                       # a submodule of a subpackage
        "from .sub.d import something",             # a name from a module
        "from dtorch_ops import TensorFuture",      # a name from the package: its __init__
        "def f():",
        "    import dtorch_ops.sub",                # nested: an edge too
        "    importlib.import_module('dtorch_ops.b')",
    ])
    assert _import_targets("dtorch_ops.a", source, modules) == {
        "dtorch_ops.b", "dtorch_ops.sub.c", "dtorch_ops.sub.d", "dtorch_ops", "dtorch_ops.sub"}
    # Relative imports in a package's __init__ are relative to the package itself.
    assert _import_targets("dtorch_ops.sub", "from . import c\nfrom .. import a, config",
                           modules) == {"dtorch_ops.sub.c", "dtorch_ops.a", "dtorch_ops"}


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"a"}}) == [["a", "a"]]
    assert _cycles({"a": {"b", "c"}, "b": {"a"}, "c": {"a"}}) == [["a", "b", "a"], ["c", "a", "c"]]


def test_the_modules_import_one_another_without_a_cycle():
    graph = _import_graph(MODULES)
    # What the graph must hold for the check to mean anything: the package's __init__ imports the
    # modules, the promises import the futures.
    assert "dtorch_ops.futures" in graph["dtorch_ops"]
    assert "dtorch_ops.futures" in graph["dtorch_ops.promises"]
    cycles = _cycles(graph)
    assert not cycles, "import cycles among the dtorch_ops modules (restructure; a deferred " \
        "import is one too):\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def _kind_names() -> set:
    """The kinds with options: the keys of the KINDS table in the kind-options module."""
    with open(MODULES[KIND_OPTIONS_MODULE], encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id == "KINDS" and isinstance(node.value,
                                                                                ast.Dict):
            return {key.value for key in node.value.keys if isinstance(key, ast.Constant)}
    raise AssertionError(f"{MODULES[KIND_OPTIONS_MODULE]} has no KINDS = {{...}} table")


def test_kind_options_are_parsed_in_one_module():
    """The names of the kinds that take options ("file", "network") and their spec strings
    ("network://...") appear as string values only in the kind-options module (docstrings and
    messages that mention them inside longer text are fine)."""
    kinds = _kind_names()
    assert {"file", "network"} <= kinds
    found = []
    for name, path in sorted(MODULES.items()):
        if name == KIND_OPTIONS_MODULE:
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                    node.value in kinds
                    or any(node.value.startswith(kind + "://") for kind in kinds)):
                found.append(f"{os.path.relpath(path, REPO)}:{node.lineno}: {node.value!r}")
    assert not found, ("kind names used outside dtorch_ops/kind_options.py (add the kind's "
                       "options to its KINDS table instead):\n" + "\n".join(found))
