"""The package's shape, as docs/ARCHITECTURE.md draws it: no import circle, no module that
reaches into another object's underscored names, policy that does no I/O, one meaning per
name, every name a module reads bound in it, functions a reader can hold (at most MAX_FUNCTION_LINES lines and MAX_PARAMETERS
parameters; the few exceptions named, each with its reason).  Read from the source (ast), so a change that breaks a rule fails here."""

from __future__ import annotations

import ast
import builtins
import collections
from pathlib import Path
from typing import Iterator

import pyllmrouter

ROOT = Path(pyllmrouter.__file__).parent
MAX_FUNCTION_LINES = 60  # from ``def`` to its last line, a nested function counted in its parent's
MAX_PARAMETERS = 8  # self and cls not counted; *args and **kwargs one each
# the user's API, kept as llama-cpp-python and requests users know it: Router.call/acall take
# what an HTTP request is (model, method, path, body, query, timeout, autoload, headers, wait,
# raise_for_status), in the order they have always had
LONG_PARAMETER_LISTS = {"router/methods.py:Methods.call", "router/methods.py:Methods.acall"}
# what pure policy may import: no I/O, no clock, no threads
POLICY_MAY_IMPORT = {"__future__", "dataclasses", "enum", "typing", "collections", "math", "itertools", "functools",
                     "collections.abc",
                     "pyllmrouter.devices", "pyllmrouter.spec", "pyllmrouter.tables", "pyllmrouter.router.policy"}


def modules() -> dict[str, Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        rel = f.relative_to(ROOT.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = f
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules ``name`` imports (TYPE_CHECKING imports included: a circle is
    a circle to the reader)."""
    tree = ast.parse(path.read_text())
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            mod = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module or ""
            subs = {f"{mod}.{a.name}" for a in node.names}
            pkg_dir = ROOT.parent.joinpath(*mod.split("."))
            compiled = [a.name for a in node.names if [*pkg_dir.glob(a.name + ".*.so"), *pkg_dir.glob(a.name + ".pyi")]]
            out |= (subs & known) or (set() if compiled else {mod})  # the extension is no module of ours
    return {m for m in out if m in known and m != name}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_package_has_no_import_circle():
    mods = modules()
    graph = {m: imports(m, p, set(mods)) for m, p in mods.items()}
    assert circles(graph) == []


def test_circles_are_found_where_there_are_some():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_reaches_into_another_objects_underscored_names():
    reaches = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                v = node.value
                own = isinstance(v, ast.Name) and v.id in ("self", "cls")
                allowed = isinstance(v, ast.Name) and (v.id, node.attr) in {("os", "_exit"), ("sys", "_getframe")}
                sup = isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super"
                if not (own or allowed or sup):
                    reaches.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {ast.unparse(node)}")
    assert reaches == []


def test_policy_does_no_io_keeps_no_clock_and_starts_no_thread():
    mods = modules()
    for name, path in mods.items():
        if not name.startswith("pyllmrouter.router.policy"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) else []
            for n in names:
                assert any(n == ok or n.startswith(ok + ".") for ok in POLICY_MAY_IMPORT), f"{name} imports {n}"


def functions(source: str, where: str) -> Iterator[tuple[str, int, int]]:
    """(``where:Class.function``, its lines, its parameters) of every function in ``source``
    but those nested in another function (they count in its length)."""
    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, int, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = child.args
                named = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
                count = len(named) - (1 if named[:1] in (["self"], ["cls"]) else 0) \
                    + (a.vararg is not None) + (a.kwarg is not None)
                yield f"{where}:{prefix}{child.name}", child.end_lineno - child.lineno + 1, count
    yield from walk(ast.parse(source), "")


def package_functions() -> list[tuple[str, int, int]]:
    return [f for p in ROOT.rglob("*.py") for f in functions(p.read_text(), str(p.relative_to(ROOT)))]


def test_functions_are_short():
    assert [(name, n) for name, n, _ in package_functions() if n > MAX_FUNCTION_LINES] == []


def test_parameter_lists_are_short_but_for_the_named_few():
    long = {name for name, _, n in package_functions() if n > MAX_PARAMETERS}
    assert long == LONG_PARAMETER_LISTS  # an exception that is no longer needed is taken off the list


def test_the_bounds_find_a_long_function_and_a_long_parameter_list():
    """The measure itself, on a source that breaks both bounds (nested and method included)."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    params = ", ".join(f"p{i}" for i in range(MAX_PARAMETERS + 1))
    source = (f"def long():\n{body}\n\nclass C:\n    def m(self, {params}):\n        def inner(): pass\n"
              f"\n    def fine(self, *a, **k): pass\n")
    found = {name: (n, p) for name, n, p in functions(source, "x.py")}
    assert found == {"x.py:long": (MAX_FUNCTION_LINES + 1, 0), "x.py:C.m": (2, MAX_PARAMETERS + 1),
                     "x.py:C.fine": (1, 2)}


def test_one_meaning_per_name():
    """No two modules of the package share a name, nor two of its classes: a name read in a
    traceback, a doc or a review points at one thing."""
    stems = collections.Counter(p.stem for p in ROOT.rglob("*.py") if p.stem != "__init__")
    classes = collections.Counter(n.name for p in ROOT.rglob("*.py") for n in ast.parse(p.read_text()).body
                                  if isinstance(n, ast.ClassDef))
    assert [s for s, n in stems.items() if n > 1] == []
    assert [c for c, n in classes.items() if n > 1] == []


def unbound_names(source: str) -> list[tuple[int, str]]:
    """(line, name) of every name ``source`` reads that nothing in it binds (an import,
    a definition, an assignment, a parameter...) and no builtin is: a name a move left
    behind (a missing import is a NameError only when its line runs)."""
    tree = ast.parse(source)
    bound = set(dir(builtins)) | {"__file__", "__name__", "__doc__", "__spec__", "__path__"}
    for n in ast.walk(tree):
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in n.names)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(n.name)
        elif isinstance(n, ast.arg):
            bound.add(n.arg)
        elif isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
            bound.add(n.id)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            bound.add(n.name)
        elif isinstance(n, (ast.MatchAs, ast.MatchStar)) and n.name:
            bound.add(n.name)
    return [(n.lineno, n.id) for n in ast.walk(tree)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in bound]


def test_every_name_a_module_reads_is_bound_in_it():
    found = {str(p.relative_to(ROOT)): u for p in ROOT.rglob("*.py") if (u := unbound_names(p.read_text()))}
    assert found == {}


def test_a_name_read_but_never_bound_is_found():
    source = "import json\n\ndef f(x):\n    try:\n        return json.loads(x)\n    except ValueError as e:\n" \
             "        raise RequestFailed(str(e))\n"
    assert unbound_names(source) == [(7, "RequestFailed")]
