"""llama-server preset keys -> a model's engine arguments, checked by llama.cpp itself.

    read_preset ──[(model, spec args, [(key, value, line)])]──▶ python -m pyllmrouter.engine_args
                 ◀── per model: its arguments | the first bad key and llama.cpp's reason ──┘

The router process never imports llama.cpp, so the keys are turned into
arguments (``common_preset::to_args``, as llama-server's router does for a
child) and parsed (``common_params_parse``, as the child does) in a
short-lived process that sees no GPU.  A key then means what it means to
llama-server, including keys added to llama.cpp later.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

__all__ = ["ArgsError", "resolve"]

# a checking process must not open a GPU context
_NO_GPU = {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "", "ROCR_VISIBLE_DEVICES": "",
           "GGML_VK_VISIBLE_DEVICES": ""}


class ArgsError(ValueError):
    """llama.cpp refused a model's key: ``model``, ``line`` (0 if unknown) and its reason."""

    def __init__(self, model: str, key: str | None, line: int, reason: str):
        where = f"key {key!r}" if key else "arguments"
        super().__init__(f"{where} in [{model}]: {reason}")
        self.model, self.key, self.line, self.reason = model, key, line, reason


def resolve(models: list[tuple[str, list[str], list[tuple[str, str, int]]]]) -> dict[str, list[str]]:
    """Each model's llama-server arguments for its preset keys, checked by llama.cpp's parser
    together with its spec's arguments; ArgsError names the first key it refuses."""
    if not models:
        return {}
    proc = subprocess.run([sys.executable, "-m", __name__], input=json.dumps(models), capture_output=True,
                          text=True, env={**os.environ, **_NO_GPU}, timeout=120)
    try:
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RuntimeError(f"checking the preset's keys failed (exit {proc.returncode}): "
                           f"{proc.stderr.strip()[-2000:]}") from None
    if "error" in out:
        raise ArgsError(**out["error"])
    return out["args"]


def _check(native: Any, name: str, spec_args: list[str], keys: list[list[Any]]) -> list[str]:
    for key, value, line in keys:  # one at a time first: the error names its key
        try:
            native.Engine(spec_args + native.preset_args([(key, value)]))
        except ValueError as e:
            raise ArgsError(name, key, line, str(e)) from None
    args = native.preset_args([(k, v) for k, v, _ in keys])
    try:
        native.Engine(spec_args + args)
    except ValueError as e:
        raise ArgsError(name, None, 0, str(e)) from None
    return args


def _main() -> None:
    from pyllmrouter.engine.backend import native  # noqa: PLC0415 - this process only

    models = json.loads(sys.stdin.read())
    try:
        out: dict[str, Any] = {"args": {name: _check(native(), name, spec_args, keys)
                                        for name, spec_args, keys in models}}
    except ArgsError as e:
        out = {"error": {"model": e.model, "key": e.key, "line": e.line, "reason": e.reason}}
    sys.stdout.write("\n" + json.dumps(out) + "\n")


if __name__ == "__main__":
    _main()
