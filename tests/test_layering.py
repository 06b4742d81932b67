"""vfgraph's modules import each other in one direction: no cycle, and each layer only downwards.

The import graph is read from the source (``vfgraph/`` and ``rewrites/``, installed as
``vfgraph.rewrites``) with :mod:`ast`, imports inside functions included: a cycle hidden by a
function-local import is a cycle all the same, only one that breaks later. Imports under
``if TYPE_CHECKING:`` count too (they never run, but a type one layer takes from a higher one
ties it to that layer all the same). Nothing here imports TensorFlow.

The layers, from the bottom: ``vfgraph.errors`` and ``vfgraph.version`` (import no vfgraph
module); ``vfgraph.ir`` (imports only itself and those); ``vfgraph.io`` (reading and writing
models: never passes, rewrites, the runtime, the command line, the API or the test helpers);
``vfgraph.passes`` and ``vfgraph.rewrites`` (never the command line, the runtime, the API or
the test helpers); above them the API, the runtime and the rest of the test helpers
(``vfgraph.testing``: comparing models, the corpus, which the command line's ``compare`` uses;
they never import the command line); then the command line, ``vfgraph.cli``, imported only
by the top layer, ``vfgraph.testing.cli`` (running the command line in tests), which nothing
of vfgraph imports. The package itself (``vfgraph/__init__.py``) is the API: it imports
:mod:`vfgraph.api` when one of its functions is first looked up, so nothing that
:mod:`vfgraph.api` imports may import the package (``import vfgraph``, ``from vfgraph import
__version__``; the version is :mod:`vfgraph.version`'s).
"""
from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = (("vfgraph", "vfgraph"), ("vfgraph.rewrites", "rewrites"))  # pyproject.toml's package-dir


class Import(NamedTuple):
    source: str  # the importing module
    target: str  # the imported vfgraph module
    path: str    # the importing file, relative to the repository
    line: int
    local: bool  # inside a function: runs when the function is first called
    typed: bool = False  # under ``if TYPE_CHECKING:``: for the types only, never run

    def where(self) -> str:
        return (f"{self.path}:{self.line}{', in a function' if self.local else ''}"
                f"{', for types only' if self.typed else ''}")


def modules() -> Dict[str, str]:
    """vfgraph's modules by dotted name: their files, relative to the repository."""
    found = {}
    for package, directory in PACKAGES:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, directory)):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__")))
            for f in filenames:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), os.path.join(ROOT, directory))[:-3]
                parts = [p for p in rel.split(os.sep) if p != "__init__"]
                found[".".join([package] + parts)] = os.path.relpath(os.path.join(dirpath, f), ROOT)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(tree: ast.AST) -> Iterator[Tuple[ast.AST, bool, bool]]:
    """Every import statement of a module (and ``importlib.import_module("literal")`` call),
    with whether it is inside a function and whether it is under ``if TYPE_CHECKING:``."""
    def walk(node: ast.AST, local: bool, typed: bool):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from walk(child, local, True)
            for child in node.orelse:
                yield from walk(child, local, typed)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, local, typed
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node, local, typed
        inner = local or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            yield from walk(child, inner, typed)

    yield from walk(tree, False, False)


def _known(name: str, known: Dict[str, str]) -> Optional[str]:
    """``name`` if it is a vfgraph module, else its longest prefix that is one (a module
    imported for an attribute), else None (not vfgraph's)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, path: str, known: Dict[str, str]) -> List[Import]:
    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = []
    for node, local, typed in _statements(tree):
        targets: List[Optional[str]] = []
        if isinstance(node, ast.Import):
            targets = [_known(a.name, known) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                targets.append(sub if sub in known else _known(base, known))
        else:
            targets = [_known(node.args[0].value, known)]
        for t in targets:
            if t is not None and t != module:
                found.append(Import(module, t, path, node.lineno, local, typed))
    return found


@functools.lru_cache(maxsize=None)
def import_graph() -> Dict[str, List[Import]]:
    known = modules()
    return {m: imports_of(m, p, known) for m, p in sorted(known.items())}


def _components(graph: Dict[str, List[Import]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack = set()
    result = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted({i.target for i in graph[root]})))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted({i.target for i in graph.get(child, [])}))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    result.append(sorted(component))
    return result


def _cycle_through(start: str, members: Sequence[str], graph: Dict[str, List[Import]]) -> List[Import]:
    """The shortest cycle from ``start`` back to it within one component, as its imports."""
    inside = set(members)
    previous: Dict[str, Import] = {}
    frontier = [start]
    while frontier:
        following = []
        for m in frontier:
            for imp in sorted(graph[m], key=lambda i: (i.target, i.line)):
                if imp.target not in inside or imp.target in previous:
                    continue
                previous[imp.target] = imp
                if imp.target == start:
                    chain = [imp]
                    while chain[0].source != start:
                        chain.insert(0, previous[chain[0].source])
                    return chain
                following.append(imp.target)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # a component always has one


def describe(chain: Sequence[Import]) -> str:
    return chain[0].source + "".join(f" -> {i.target} ({i.where()})" for i in chain)


def test_the_graph_sees_function_local_and_type_only_imports():
    """The reader itself: it finds the package's lazy import of its API (inside
    ``__getattr__``), module-level imports, and the imports under ``if TYPE_CHECKING:``, as
    such (the records' import of the item, for its type)."""
    graph = import_graph()
    assert {"vfgraph", "vfgraph.api", "vfgraph.io.savedmodel", "vfgraph.rewrites.split_vnodes"} <= set(graph)
    lazy = [i for i in graph["vfgraph"] if i.target == "vfgraph.api"]
    assert lazy and all(i.local for i in lazy), graph["vfgraph"]
    assert any(i.target == "vfgraph.errors" and not i.local for i in graph["vfgraph"]), graph["vfgraph"]
    assert any(i.target == "vfgraph.passes.base" for i in graph["vfgraph.rewrites.split_vnodes"])
    typed = [i for i in graph["vfgraph.records"] if i.target == "vfgraph.item"]
    assert typed and all(i.typed and not i.local for i in typed), graph["vfgraph.records"]
    assert not any(i.typed for i in graph["vfgraph.api"]), graph["vfgraph.api"]


def test_no_import_cycle():
    graph = import_graph()
    cycles = [describe(_cycle_through(members[0], members, graph)) for members in _components(graph)]
    assert not cycles, "import cycles (move what both sides need into a lower module):\n  " + "\n  ".join(cycles)


def _violations(graph, layer: Sequence[str], allowed=None, forbidden=None) -> List[str]:
    def within(name, prefixes):
        return any(name == p or name.startswith(p + ".") and p != "vfgraph" for p in prefixes)

    bad = []
    for module, found in graph.items():
        if not within(module, layer):
            continue
        for i in found:
            if (allowed is not None and not within(i.target, allowed)) or (forbidden and within(i.target, forbidden)):
                bad.append(f"{module} imports {i.target} ({i.where()})")
    return bad


def test_errors_and_version_import_no_vfgraph_module():
    bad = _violations(import_graph(), ["vfgraph.errors", "vfgraph.version"], allowed=[])
    assert not bad, "\n".join(bad)


def test_ir_imports_nothing_above_it():
    bad = _violations(import_graph(), ["vfgraph.ir"], allowed=["vfgraph.ir", "vfgraph.errors", "vfgraph.version"])
    assert not bad, "vfgraph.ir imports a higher layer:\n" + "\n".join(bad)


ABOVE_IO = ["vfgraph", "vfgraph.api", "vfgraph.cli", "vfgraph.passes", "vfgraph.rewrites", "vfgraph.runtime",
            "vfgraph.testing"]


def test_io_imports_no_pass_runtime_or_command_line():
    bad = _violations(import_graph(), ["vfgraph.io"], forbidden=ABOVE_IO)
    assert not bad, "vfgraph.io imports a higher layer:\n" + "\n".join(bad)


def test_passes_and_rewrites_import_no_runtime_or_command_line():
    bad = _violations(import_graph(), ["vfgraph.passes", "vfgraph.rewrites"],
                      forbidden=["vfgraph", "vfgraph.api", "vfgraph.cli", "vfgraph.runtime", "vfgraph.testing"])
    assert not bad, "a pass imports a higher layer:\n" + "\n".join(bad)


TOP = "vfgraph.testing.cli"  # running the command line in tests


def test_only_the_top_layer_imports_the_command_line():
    bad = [f"{m} imports vfgraph.cli ({i.where()})" for m, found in import_graph().items() if m != TOP
           for i in found if i.target == "vfgraph.cli"]
    assert not bad, "the command line is imported below the top layer (vfgraph.testing.cli):\n" + "\n".join(bad)
    assert any(i.target == "vfgraph.cli" for i in import_graph()[TOP])  # the one it runs


def test_nothing_imports_the_top_layer():
    bad = [f"{m} imports {TOP} ({i.where()})" for m, found in import_graph().items() for i in found if i.target == TOP]
    assert not bad, f"{TOP} is the top layer; nothing of vfgraph may import it:\n" + "\n".join(bad)


def test_import_vfgraph_loads_only_its_package():
    """``import vfgraph`` imports no TensorFlow and no MPI, and adds one finder (the one that
    registers the ops once TensorFlow is imported); see the package's docstring."""
    code = ("import sys\n"
            "before = list(sys.meta_path)\n"
            "import vfgraph\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vfgraph', 'tensorflow', 'mpi4py', 'keras')))\n"
            "print([type(f).__name__ for f in sys.meta_path if f not in before])\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    loaded, finders = done.stdout.splitlines()
    assert loaded == str(["vfgraph", "vfgraph.errors", "vfgraph.version"]), loaded
    assert finders == str(["_AfterTensorFlow"]), finders
