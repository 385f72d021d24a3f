"""The docs name only what exists: every ``Class.method``, ``module.name``, file path and
``file.py:function`` written in README.md, docs/ and the package's module docstrings resolves
to the source (read with ast, nothing imported).  A name that is not ours (another project's
file, a JSON field of a reply) is left alone where it cannot be taken for one of ours, or is
named below with why."""

from __future__ import annotations

import ast
import collections
import functools
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "pyllmrouter"
# what is written like a name of ours but is not one
NOT_OURS = {
    "memory.parts", "memory.held", "memory.kept", "memory.components",  # fields of GET /models' JSON
    "concurrent/futures/process.py",  # CPython's: the model the package follows
    "server.cpp", "llama-ext.h",  # llama.cpp's and llama-cpp-python's sources
}


@functools.cache
def index() -> "Index":
    return Index()


class Index:
    """Classes (with their attributes, through their bases), modules' top-level names, files."""

    def __init__(self):
        self.attrs: dict[str, set[str]] = collections.defaultdict(set)
        self.bases: dict[str, set[str]] = collections.defaultdict(set)
        self.modules: dict[str, set[str]] = collections.defaultdict(set)
        for f in PKG.rglob("*.py"):
            self._read(f, ast.parse(f.read_text()))
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                                capture_output=True, text=True, check=True).stdout.split()
        self.files = [REPO / p for p in listed]

    def _read(self, f: Path, tree: ast.Module) -> None:
        top = self.modules[f.stem if f.stem != "__init__" else f.parent.name]
        body = [*tree.body, *(m for n in tree.body if isinstance(n, ast.If) for m in n.body)]  # TYPE_CHECKING too
        for n in body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                top.add(n.name)
            for target in (n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign)
                           else []):
                if isinstance(target, ast.Name):
                    top.add(target.id)
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                top.update((a.asname or a.name).split(".")[0] for a in n.names)
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets):
                top.update(e.value for e in getattr(n.value, "elts", ()) if isinstance(e, ast.Constant))
        for c in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            self.bases[c.name] |= {b.id for b in c.bases if isinstance(b, ast.Name)}
            for m in ast.walk(c):
                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    self.attrs[c.name].add(m.name)
                elif isinstance(m, ast.Attribute) and isinstance(m.value, ast.Name) and m.value.id == "self":
                    self.attrs[c.name].add(m.attr)
                elif isinstance(m, ast.AnnAssign) and isinstance(m.target, ast.Name):
                    self.attrs[c.name].add(m.target.id)
                elif isinstance(m, ast.Assign):
                    self.attrs[c.name] |= {t.id for t in m.targets if isinstance(t, ast.Name)}

    def has_attr(self, cls: str, name: str, seen: frozenset[str] = frozenset()) -> bool:
        if name in self.attrs[cls]:
            return True
        return any(self.has_attr(b, name, seen | {cls}) for b in self.bases[cls] - seen)

    def file(self, path: str) -> Path | None:
        return next((f for f in self.files if f.as_posix().endswith("/" + path.lstrip("/"))), None)

    def resolves(self, token: str) -> bool | None:
        """True or False for a name of ours; None: not written as one."""
        token = token.strip().removesuffix("()")
        if token in NOT_OURS:
            return None
        m = re.fullmatch(r"([\w./-]+\.(?:py|cpp|h|md|sh|toml|cmake|js|html))(?::(\w+))?", token)
        if m:
            f = self.file(m.group(1))
            return f is not None and (m.group(2) is None or re.search(rf"\b{m.group(2)}\b", f.read_text()) is not None)
        m = re.fullmatch(r"([A-Za-z_]\w*)\.([A-Za-z_]\w*)", token)
        if m and m.group(1) in self.attrs:
            return self.has_attr(*m.groups())
        if m and m.group(1) in self.modules:
            sub = (f"{m.group(1)}/{m.group(2)}.py", f"{m.group(1)}/{m.group(2)}/__init__.py")
            return m.group(2) in self.modules[m.group(1)] or any(f.as_posix().endswith(sub) for f in self.files)
        return None


def _written() -> list[tuple[str, str]]:
    """(where, token) for every name-like token in the docs and module docstrings."""
    out = []
    for doc in [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("**/*.md"))]:
        out += [(str(doc.relative_to(REPO)), t) for t in re.findall(r"`([^`\n]+)`", doc.read_text())]
    for f in sorted(PKG.rglob("*.py")):
        text = ast.get_docstring(ast.parse(f.read_text())) or ""
        where = str(f.relative_to(REPO))
        out += [(where, t) for t in re.findall(r"``([^`\n]+)``", text)]
        out += [(where, t) for t in re.findall(r"(?<![\w/])((?:\w+/)+\w+\.py(?::\w+)?)", text)]
        out += [(where, t) for t in re.findall(r"\b([A-Z]\w+\.[a-z_]\w*)\b", text)]
    return out


def test_every_name_the_docs_write_exists():
    missing = sorted({f"{where}: {token}" for where, token in _written() if index().resolves(token) is False})
    assert missing == []


@pytest.mark.parametrize("token,ok", [
    ("Book.move", True), ("Book.nothing_here", False), ("Router.chat", True),  # through the mixin
    ("router/workers/sets.py", True), ("router/workers/nowhere.py", False),
    ("server/app.py:create_app", True), ("server/app.py:no_such_function", False),
    ("placement.with_shares", True), ("placement.gone", False), ("memory.held", None), ("e.g", None),
])
def test_the_check_tells_a_name_that_exists_from_one_that_does_not(token, ok):
    assert index().resolves(token) is ok
