"""The process boundary: the router side never imports llama.cpp."""

import json
import subprocess
import sys

ROUTER_SIDE = ["pyllmrouter", "pyllmrouter.router", "pyllmrouter.scheduler", "pyllmrouter.pool",
               "pyllmrouter.placement", "pyllmrouter.presets", "pyllmrouter.engine_args", "pyllmrouter.measure",
               "pyllmrouter.devices", "pyllmrouter.server.app", "pyllmrouter.server.run", "pyllmrouter.cli"]


def test_importing_the_router_side_loads_no_llama_cpp():
    """In a fresh interpreter, every router-side module imports without llama_cpp or the
    extension, and no libllama or libggml is mapped into the process."""
    code = f"""
import importlib, json, sys
for m in {ROUTER_SIDE!r}:
    importlib.import_module(m)
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

    from pyllmrouter import scheduler

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
