"""The process boundary: the router side never imports llama.cpp."""

import json
import subprocess
import sys

SHARED = ["pyllmrouter", "pyllmrouter.config", "pyllmrouter.spec", "pyllmrouter.errors", "pyllmrouter.protocol",
          "pyllmrouter.tables", "pyllmrouter.devices", "pyllmrouter.memory", "pyllmrouter.presets",
          "pyllmrouter.engine_args", "pyllmrouter.cli"]
ROUTER_PACKAGES = ["pyllmrouter.router", "pyllmrouter.server", "pyllmrouter.ray"]  # every module in them


def test_importing_the_router_side_loads_no_llama_cpp():
    """In a fresh interpreter, every router-side module (the router, server and ray
    packages, whatever modules they hold, and the shared ones) imports without llama_cpp or the
    extension, and no libllama or libggml is mapped into the process."""
    code = f"""
import importlib, json, pkgutil, sys
names = {SHARED!r}
for pkg in {ROUTER_PACKAGES!r}:
    names += [pkg] + [m.name for m in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + ".")]
for m in names:
    importlib.import_module(m)
assert len(names) > 20, names
maps = open("/proc/self/maps").read()
print(json.dumps({{"modules": sorted(m for m in sys.modules if m.startswith(("llama_cpp", "pyllmrouter._native"))),
                  "libs": sorted({{l.split()[-1] for l in maps.splitlines() if "libllama" in l or "libggml" in l}})}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"modules": [], "libs": []}


def test_every_state_change_goes_through_the_one_checked_transition():
    """Only Book.move assigns a model's state (and it checks the transition), in the whole
    router package."""
    import ast
    import pkgutil
    from pathlib import Path

    import pyllmrouter.router as router

    assigners = []
    for mod in pkgutil.walk_packages(router.__path__, "pyllmrouter.router."):
        path = Path(router.__path__[0], *mod.name.split(".")[2:])
        source = (path / "__init__.py") if mod.ispkg else path.with_suffix(".py")
        tree = ast.parse(source.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef):
                for node in ast.walk(fn):
                    targets = node.targets if isinstance(node, ast.Assign) else []
                    for t in targets:
                        for leaf in (t.elts if isinstance(t, ast.Tuple) else [t]):
                            if isinstance(leaf, ast.Attribute) and leaf.attr == "state":
                                assigners.append(f"{mod.name}.{fn.name}")
    assert assigners == ["pyllmrouter.router.book.move"]
