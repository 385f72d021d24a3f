"""llama-server preset keys -> a model's file, aliases, devices and arguments, checked by
llama.cpp; and the models of llama.cpp's cache, as llama.cpp lists them.

    read_preset ──[(model, [(key, value, line)])]──▶ python -m pyllmrouter.engine_args
                ◀── per model: {model, aliases, devices, draft_devices, args}
                    | the first bad key, its line and llama.cpp's reason ──┘
    cached_models ──▶ the same process ──▶ [{name, path, mmproj, error}]

The router process never imports llama.cpp, so the keys are turned into
arguments (``common_preset::to_args``, as llama-server's router does for a
child) and parsed (``common_params_parse`` and llama-server's own rules, as the
child does) in a short-lived process that sees no GPU.  A key then means what
it means to llama-server, aliases and ``LLAMA_ARG_*`` names included, and keys
added to llama.cpp later too.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from typing import Any

from pyllmrouter import gguf_header
from pyllmrouter.spec import ROUTER_DEFAULTS

__all__ = ["ArgsError", "resolve", "cached_models", "model_base_args", "check_specs"]

# a checking process must not open a GPU context
_NO_GPU = {"CUDA_VISIBLE_DEVICES": "-1", "HIP_VISIBLE_DEVICES": "-1", "ROCR_VISIBLE_DEVICES": "-1",
           "GGML_VK_VISIBLE_DEVICES": "-1"}


class ArgsError(ValueError):
    """llama.cpp refused a model's key: ``model``, ``line`` (0 if unknown) and its reason."""

    def __init__(self, model: str, key: str | None, line: int, reason: str):
        where = f"key {key!r}" if key else "arguments"
        super().__init__(f"{where} in [{model}]: {reason}")
        self.model, self.key, self.line, self.reason = model, key, line, reason


def _run(request: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", __name__], input=json.dumps(request), capture_output=True,
                          text=True, env={**os.environ, **_NO_GPU}, timeout=120)
    try:
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RuntimeError(f"asking llama.cpp failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}") from None
    if "error" in out:
        raise ArgsError(**out["error"])
    return out


def resolve(models: list[tuple[str, list[tuple[str, str, int]]]],
            base_args: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """Per model, its llama-server keys as {model, aliases, devices, draft_devices, args},
    then ``base_args`` (the router's own llama-server arguments, which win, as llama-server's
    router lays its command line over every model), checked by llama.cpp's parser;
    ArgsError names the first key it refuses."""
    if not models:
        return {}
    return _run({"models": models, "base_args": list(base_args)})["models"]


def model_base_args(args: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The router's own llama-server arguments as llama-server's router lays them over every
    model: without the options that are the router's (its API keys and key files, TLS
    files, model sources and limit, a model's file and alias), read by llama.cpp's preset
    machinery; ArgsError for an argument llama.cpp does not know."""
    if not args:
        return ()
    return tuple(_run({"model_base_args": list(args)})["base_args"])


def check_specs(specs: list[tuple[str, str, tuple[str, ...]]]) -> None:
    """Each (model name, file, llama-server arguments) as llama-server would take it: ValueError
    naming the model and the problem (a file that is not there, not a GGUF file or cut short:
    its header read, gguf_header.check; an argument llama.cpp's parser refuses).  The parse runs in a short-lived process, once per file and arguments
    (what passed is remembered in the cache directory)."""
    from pyllmrouter.memory import cache_dir  # noqa: PLC0415

    todo = []
    for name, path, args in specs:
        if not os.path.isfile(path):
            raise ValueError(f"model {name!r}: its file {path} does not exist" if not os.path.exists(path)
                             else f"model {name!r}: {path} is not a file")
        st = os.stat(path)
        key = json.dumps([os.path.realpath(path), st.st_size, st.st_mtime_ns, list(args)])
        mark = cache_dir() / "checked" / (hashlib.sha256(key.encode()).hexdigest()[:24])
        if not mark.exists():
            try:
                gguf_header.check(path)  # a file that is not a GGUF, or not whole: no load finds it out later
            except ValueError as e:
                raise ValueError(f"model {name!r}: {e}") from None
            todo.append((name, path, list(args), mark))
    if not todo:
        return
    try:
        _run({"specs": [[name, path, args] for name, path, args, _ in todo]})
    except ArgsError as e:
        raise ValueError(f"model {e.model!r}: llama.cpp's parser refused its arguments: {e.reason}") from None
    for *_, mark in todo:
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.touch()


def cached_models() -> tuple[str, list[dict[str, str]]]:
    """Where llama.cpp's cache of downloads (-hf) is, and its models resolved offline by
    llama.cpp: [{name, path, mmproj, error}]."""
    out = _run({"cache": True})
    return out["cache_dir"], out["cache"]


def _check(native: Any, name: str, keys: list[list[Any]], base_args: list[str]) -> dict[str, Any]:
    for key, value, line in keys:  # one at a time first: the error names its key and line
        try:
            alone = native.preset_model([(key, value)])
            native.server_params(["-m", alone["model"] or "model.gguf", *alone["args"]])
        except ValueError as e:
            raise ArgsError(name, key, line, str(e)) from None
    try:
        split = native.preset_model([(k, v) for k, v, _ in keys])
    except ValueError as e:
        raise ArgsError(name, None, 0, str(e)) from None
    split["hf_paths"] = [p for p in native.preset_hf_paths([(k, v) for k, v, _ in keys]) if p]
    split["args"] = [*split["args"], *base_args]
    if not split["model"] and split["hf_repo"]:  # a model of llama.cpp's cache, resolved as llama-server does
        try:
            found = native.resolve_cached(split["hf_repo"], split["hf_file"])
        except (RuntimeError, ValueError) as e:
            raise ArgsError(name, "hf-repo", 0, str(e)) from None
        split["model"] = found["path"]
        if found["mmproj"] and not any("mmproj" in a for a in split["args"]):  # its projector comes with it
            split["args"] = [*split["args"], "--mmproj", found["mmproj"]]
    if not split["model"]:
        raise ArgsError(name, None, 0, "no 'model' key: give the GGUF path (model = /path/to/file.gguf), "
                                       "or hf-repo for a model of llama.cpp's cache")
    try:
        native.server_params(["-m", split["model"], *ROUTER_DEFAULTS, *split["args"]])
    except ValueError as e:
        raise ArgsError(name, None, 0, str(e)) from None
    return split


def _main() -> None:
    from pyllmrouter.engine.backend import bindings_only, native  # noqa: PLC0415 - this process only

    bindings_only()
    request = json.loads(sys.stdin.read())
    try:
        base = request.get("base_args", [])
        out: dict[str, Any] = {"models": {name: _check(native(), name, keys, base)
                                          for name, keys in request.get("models", [])}}
        if "model_base_args" in request:
            try:
                out["base_args"] = native().model_base_args(request["model_base_args"])
            except ValueError as e:
                raise ArgsError("router", None, 0, str(e)) from None
        if request.get("cache"):
            out["cache"], out["cache_dir"] = native().cached_models(), native().cache_dir()
        for name, path, args in request.get("specs", []):
            try:
                native().server_params(["-m", path, *ROUTER_DEFAULTS, *args])
            except ValueError as e:
                raise ArgsError(name, None, 0, str(e)) from None
    except ArgsError as e:
        out = {"error": {"model": e.model, "key": e.key, "line": e.line, "reason": e.reason}}
    sys.stdout.write("\n" + json.dumps(out) + "\n")


if __name__ == "__main__":
    _main()
