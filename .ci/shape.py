"""The code's shape, checked by ``make lint``: sizes, import cycles, private touches in tests.

Usage: ``python .ci/shape.py [--root DIR] [--limits KEY=N,...] [--verbose]``. It prints
each figure and exits 1 when a limit is broken, 0 otherwise (2 on a usage error).

What it checks, in the library (the packages :data:`LIBRARY` under ``--root``):

1. **Module size.** No module over :data:`MAX_MODULE_LINES` lines (every line of the
   file, blank and comment lines too), the shipped kits (:data:`KITS`) aside.
2. **Class size.** No class over :data:`MAX_CLASS_LINES` lines, from its ``class`` line to
   its last line (nested classes are classes too), the kits aside.
3. **Import cycles.** No two library modules importing each other, directly or through a
   longer cycle. Every ``import`` and ``from ... import`` statement counts, at module level
   or inside a function or class, except those in the body of ``if TYPE_CHECKING:`` (or
   ``if typing.TYPE_CHECKING:``). Relative imports are resolved against the importing
   module's package. ``import a.b`` imports ``a.b``; ``from a import b`` imports ``a.b`` when
   that is a module of the tree, and ``a`` (its ``__init__``) otherwise. Importing a
   package counts as importing its ``__init__``; the parent packages Python also runs
   (``a`` for ``a.b``) are not counted, or every module would form a cycle with a package
   that re-exports it. The kits are part of this graph. Imports of modules outside the
   library are ignored.

And in the tests (every ``.py`` file under :data:`TESTS`):

4. **Private touches.** At most :data:`MAX_PRIVATE_TOUCHES` touches of another object's
   private attribute. A touch is

   - an ``ast.Attribute`` node (read, write or ``del``) whose ``attr`` is private, or
   - a call of ``getattr``, ``setattr``, ``hasattr`` or ``delattr``, or of
     ``<something>.setattr`` / ``<something>.delattr`` with two arguments or more (pytest's
     ``monkeypatch``), whose second argument is a string literal naming a private
     attribute (so a touch cannot hide in a string),

   whose object (the attribute's ``value``, the call's first argument) is none of:

   - the name ``self`` or ``cls`` (an object's own attributes), or ``super()``;
   - a module: a name the same file binds with ``import m`` / ``import m as n``, or with
     ``from p import m`` where ``p.m`` is a module of the tree; or a dotted name such as
     ``lease_core._structures`` that is a module of the tree (under ``--root``) or was
     imported as such (``import a.b``). So ``sys._getframe``, ``os._exit`` and
     ``lease_core._structures.X`` are no touches: they name a module's attributes, not an
     object's.

   A private name is one starting with ``_`` that is not a dunder (``__x__``).

The limits are the constants below; ``--limits module_lines=600,class_lines=400,
private_touches=20`` overrides any of them.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: Largest module of the library, in lines (the kits aside).
MAX_MODULE_LINES = 600
#: Largest class of the library, in lines (the kits aside).
MAX_CLASS_LINES = 400
#: Most touches of another object's private attribute in the tests.
MAX_PRIVATE_TOUCHES = 20
#: The library's packages (top-level directories under the root).
LIBRARY = ("lease_core", "backends", "adapters")
#: The shipped kits, whose modules and classes may be larger (paths under the root).
KITS = ("lease_core/testing", "lease_core/demo")
#: Where the tests live (a directory under the root).
TESTS = "tests"
#: Top-level directories whose modules count as "modules of the tree" (rule 4).
TREE = (*LIBRARY, TESTS, "benchmarks")
#: How many offenders each figure lists (``--verbose``: all of them).
TOP = 5

_ATTR_CALLS = frozenset({"getattr", "setattr", "hasattr", "delattr"})
_PATCH_METHODS = frozenset({"setattr", "delattr"})


# ---------------------------------------------------------------------------- modules


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    rel: str
    """The path relative to the root, with forward slashes."""
    is_package: bool
    tree: ast.Module
    lines: int


def module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def python_files(directory: Path) -> Iterator[Path]:
    for path in sorted(directory.rglob("*.py")):
        if "__pycache__" not in path.parts:
            yield path


def load(root: Path, top: Sequence[str]) -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for package in top:
        for path in python_files(root / package):
            rel = path.relative_to(root)
            text = path.read_text(encoding="utf-8")
            modules[module_name(rel)] = Module(
                name=module_name(rel), path=path, rel=rel.as_posix(),
                is_package=path.name == "__init__.py",
                tree=ast.parse(text, str(path)), lines=len(text.splitlines()),
            )
    return modules


def in_kit(module: Module) -> bool:
    return any(module.rel == kit or module.rel.startswith(kit.rstrip("/") + "/")
               for kit in KITS)


def resolve_from(module: Module, node: ast.ImportFrom) -> str:
    """The absolute name of the module a ``from ... import`` statement imports from."""
    if not node.level:
        return node.module or ""
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    parts = package.split(".") if package else []
    if node.level > 1:
        parts = parts[: len(parts) - (node.level - 1)]
    if node.module:
        parts.append(node.module)
    return ".".join(parts)


# ---------------------------------------------------------------------------- sizes


@dataclass(frozen=True)
class Sized:
    where: str
    lines: int


def module_sizes(modules: dict[str, Module]) -> list[Sized]:
    sizes = [Sized(m.rel, m.lines) for m in modules.values() if not in_kit(m)]
    return sorted(sizes, key=lambda s: (-s.lines, s.where))


def class_sizes(modules: dict[str, Module]) -> list[Sized]:
    sizes = []
    for m in modules.values():
        if in_kit(m):
            continue
        for cls, qualname in classes(m.tree):
            end = cls.end_lineno or cls.lineno
            sizes.append(Sized(f"{m.rel}:{qualname}", end - cls.lineno + 1))
    return sorted(sizes, key=lambda s: (-s.lines, s.where))


def classes(tree: ast.AST, prefix: str = "") -> Iterator[tuple[ast.ClassDef, str]]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.ClassDef):
            qualname = f"{prefix}{node.name}"
            yield node, qualname
            yield from classes(node, f"{qualname}.")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from classes(node, f"{prefix}{node.name}.<locals>.")
        else:
            yield from classes(node, prefix)


# ---------------------------------------------------------------------------- imports


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    scope: str
    """Where the import is: ``module level``, or the function holding it."""


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _ImportFinder(ast.NodeVisitor):
    """Every import statement of a module, the ``if TYPE_CHECKING:`` bodies aside."""

    def __init__(self) -> None:
        self.found: list[tuple[ast.Import | ast.ImportFrom, str]] = []
        self._scope: list[str] = []

    def visit_If(self, node: ast.If) -> None:
        self.visit(node.test)
        if not is_type_checking(node.test):
            for child in node.body:
                self.visit(child)
        for child in node.orelse:
            self.visit(child)

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._scope.append(node.name)
        self.generic_visit(node)
        self._scope.pop()

    visit_FunctionDef = _visit_function
    visit_AsyncFunctionDef = _visit_function

    def visit_Import(self, node: ast.Import) -> None:
        self.found.append((node, self._where()))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.found.append((node, self._where()))

    def _where(self) -> str:
        return f"in {'.'.join(self._scope)}()" if self._scope else "at module level"


def import_edges(modules: dict[str, Module]) -> list[Edge]:
    edges = []
    for m in modules.values():
        finder = _ImportFinder()
        finder.visit(m.tree)
        for node, scope in finder.found:
            targets: list[str] = []
            if isinstance(node, ast.Import):
                for alias in node.names:
                    name = alias.name
                    while name and name not in modules:
                        name = name.rpartition(".")[0]
                    targets.append(name)
            else:
                base = resolve_from(m, node)
                for alias in node.names:
                    sub = f"{base}.{alias.name}" if base else alias.name
                    targets.append(sub if alias.name != "*" and sub in modules else base)
            for target in dict.fromkeys(targets):  # one edge per statement and module
                if target in modules and target != m.name:
                    edges.append(Edge(m.name, target, node.lineno, scope))
    return edges


@dataclass(frozen=True)
class Cycle:
    """Modules that import each other (a strongly connected group of the import graph)."""

    members: list[str]
    shortest: list[Edge]
    """One shortest cycle through the first member."""
    edges: list[Edge]
    """Every import between two members."""


def cycles(names: Sequence[str], edges: Sequence[Edge]) -> list[Cycle]:
    """Every group of two modules or more that import each other."""
    graph: dict[str, dict[str, Edge]] = {name: {} for name in names}
    for edge in edges:
        graph[edge.source].setdefault(edge.target, edge)
    found = []
    for group in strongly_connected(graph):
        if len(group) < 2:
            continue
        members = sorted(group)
        inside = [e for e in edges if e.source in group and e.target in group]
        found.append(Cycle(members, shortest_cycle(graph, members[0], group),
                           sorted(inside, key=lambda e: (e.source, e.line, e.target))))
    return sorted(found, key=lambda c: c.members)


def strongly_connected(graph: dict[str, dict[str, Edge]]) -> list[set[str]]:
    """Tarjan's algorithm, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups: list[set[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
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
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                groups.append(group)
    return groups


def shortest_cycle(graph: dict[str, dict[str, Edge]], start: str, group: set[str]) -> list[Edge]:
    came: dict[str, Edge] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for target in sorted(graph[node]):
            if target not in group:
                continue
            edge = graph[node][target]
            if target == start:
                path = [edge]
                while path[0].source != start:
                    path.insert(0, came[path[0].source])
                return path
            if target not in came:
                came[target] = edge
                queue.append(target)
    raise AssertionError(f"no cycle through {start}")  # pragma: no cover - a group has one


# ---------------------------------------------------------------------------- private touches


@dataclass(frozen=True)
class Touch:
    where: str
    attr: str


def is_private(name: str) -> bool:
    return name.startswith("_") and not (len(name) > 4 and name.startswith("__")
                                         and name.endswith("__"))


def dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


@dataclass
class _ModuleNames:
    """The names one file binds to modules, and the dotted module names it imports."""

    names: set[str] = field(default_factory=set)
    dotted: set[str] = field(default_factory=set)


def module_names(module: Module, tree_modules: set[str]) -> _ModuleNames:
    found = _ModuleNames()
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.names.add(alias.asname or alias.name.partition(".")[0])
                parts = alias.name.split(".")
                found.dotted.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        elif isinstance(node, ast.ImportFrom):
            base = resolve_from(module, node)
            for alias in node.names:
                if f"{base}.{alias.name}" in tree_modules:
                    found.names.add(alias.asname or alias.name)
    return found


def is_module(node: ast.expr, names: _ModuleNames, tree_modules: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in names.names
    name = dotted(node)
    return name is not None and (name in names.dotted or name in tree_modules)


def is_exempt(node: ast.expr, names: _ModuleNames, tree_modules: set[str]) -> bool:
    if isinstance(node, ast.Name) and node.id in ("self", "cls"):
        return True
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "super"):
        return True
    return is_module(node, names, tree_modules)


def private_touches(tests: dict[str, Module], tree_modules: set[str]) -> list[Touch]:
    touches = []
    for m in tests.values():
        names = module_names(m, tree_modules)
        for node in ast.walk(m.tree):
            obj: ast.expr | None = None
            attr, line = "", 0
            if isinstance(node, ast.Attribute):
                obj, attr, line = node.value, node.attr, node.lineno
            elif isinstance(node, ast.Call) and len(node.args) >= 2:
                func = node.func
                called = (isinstance(func, ast.Name) and func.id in _ATTR_CALLS) or (
                    isinstance(func, ast.Attribute) and func.attr in _PATCH_METHODS)
                name = node.args[1]
                if called and isinstance(name, ast.Constant) and isinstance(name.value, str):
                    obj, attr, line = node.args[0], name.value, node.lineno
            if obj is None or not is_private(attr) or is_exempt(obj, names, tree_modules):
                continue
            touches.append(Touch(f"{m.rel}:{line}", attr))
    return sorted(touches, key=lambda t: (t.where.rpartition(":")[0],
                                          int(t.where.rpartition(":")[2])))


# ---------------------------------------------------------------------------- report


@dataclass(frozen=True)
class Limits:
    module_lines: int = MAX_MODULE_LINES
    class_lines: int = MAX_CLASS_LINES
    private_touches: int = MAX_PRIVATE_TOUCHES


def parse_limits(text: str) -> Limits:
    values: dict[str, int] = {}
    known = Limits.__dataclass_fields__
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in known or not value.strip().isdigit():
            raise argparse.ArgumentTypeError(
                f"{item!r}: expected KEY=N with KEY one of {', '.join(known)}")
        values[key] = int(value)
    return Limits(**values)


def check(root: Path, limits: Limits, *, verbose: bool = False) -> bool:
    """Print the figures of the tree under ``root``; return whether every limit holds."""
    library = load(root, [p for p in LIBRARY if (root / p).is_dir()])
    tests = load(root, [TESTS] if (root / TESTS).is_dir() else [])
    tree_modules = set(library) | set(tests) | set(
        load(root, [p for p in TREE if p not in LIBRARY and p != TESTS and (root / p).is_dir()]))
    top = None if verbose else TOP
    broken = []
    kits = ", ".join(f"{k}/" for k in KITS)

    def sizes(what: str, found: list[Sized], limit: int) -> None:
        over = [s for s in found if s.lines > limit]
        largest = f"{found[0].where}, {found[0].lines} lines" if found else "none"
        print(f"{what}: largest {largest} (limit {limit}; {kits} aside): "
              f"{len(over)} over the limit")
        for s in over[:top]:
            print(f"  {s.where}: {s.lines}")
        if top is not None and len(over) > top:
            print(f"  ... and {len(over) - top} more")
        if over:
            broken.append(what)

    sizes("modules", module_sizes(library), limits.module_lines)
    sizes("classes", class_sizes(library), limits.class_lines)

    found = cycles(sorted(library), import_edges(library))
    print(f"import cycles in {', '.join(LIBRARY)} (TYPE_CHECKING imports aside): {len(found)}")
    for cycle in found:
        print(f"  {', '.join(cycle.members)} import each other, for one: "
              + " -> ".join([e.source for e in cycle.shortest] + [cycle.members[0]]))
        for e in cycle.edges:
            print(f"    {library[e.source].rel}:{e.line} imports {e.target} ({e.scope})")
    if found:
        broken.append("import cycles")

    touches = private_touches(tests, tree_modules)
    print(f"private touches in {TESTS}/: {len(touches)} (limit {limits.private_touches})")
    if touches:
        by_attr = Counter(t.attr for t in touches).most_common(top)
        by_file = Counter(t.where.rpartition(":")[0] for t in touches).most_common(top)
        print("  attributes: " + ", ".join(f"{a} {n}" for a, n in by_attr))
        print("  files: " + ", ".join(f"{f} {n}" for f, n in by_file))
        if verbose:
            for t in touches:
                print(f"    {t.where}: .{t.attr}")
    if len(touches) > limits.private_touches:
        broken.append("private touches")

    print(f"shape: {'broken: ' + ', '.join(broken) if broken else 'ok'}")
    return not broken


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="the repository to check (default: this script's)")
    parser.add_argument("--limits", type=parse_limits, default=Limits(),
                        help="override limits: module_lines=N,class_lines=N,private_touches=N")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="list every offender, every private touch")
    args = parser.parse_args(argv)
    return 0 if check(args.root, args.limits, verbose=args.verbose) else 1


if __name__ == "__main__":
    sys.exit(main())
