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
    names += [pkg] + [m.name for m in pkgutil.iter_modules(importlib.import_module(pkg).__path__, pkg + ".")]
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
    """Only Scheduler._move assigns a model's state (and it checks the transition)."""
    import ast
    import inspect

    from pyllmrouter.router import scheduler

    tree = ast.parse(inspect.getsource(scheduler))
    assigners = []
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef):
            for node in ast.walk(fn):
                targets = node.targets if isinstance(node, ast.Assign) else []
                for t in targets:
                    for leaf in (t.elts if isinstance(t, ast.Tuple) else [t]):
                        if isinstance(leaf, ast.Attribute) and leaf.attr == "state":
                            assigners.append(fn.name)
    assert assigners == ["_move"]
