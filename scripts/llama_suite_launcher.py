"""Stands in for llama-server in llama.cpp's own server test suite (its utils.py starts
the binary named by LLAMA_SERVER_BIN_PATH): the command line the suite builds, served in
router mode with the same model and arguments, by

    PYLLMROUTER_SUITE_MODE=single   llama-server itself, on the very command line the suite
                                    built (what the suite was written for)
    PYLLMROUTER_SUITE_MODE=router   llama-server's router mode (LLAMA_SERVER_PATH: the binary)
    PYLLMROUTER_SUITE_MODE=ours     pyllmrouter serve

A single-model command line becomes a preset of one section (named by its --alias, as
llama-server names the model), whose keys are the command line's arguments as llama.cpp's
own preset machinery reads them (common_preset_context::load_from_args); a command line
already in router mode (--models-dir, --models-preset, or no model: llama.cpp's cache)
goes as it is.  The server's own options (--host, --port, --api-key, --models-*) stay the
server's.  The launcher replaces itself with the server (exec): the suite stops it.
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile

# the server's own options (not a model's), with whether each takes a value
_SERVER = {"--host": True, "--port": True, "--api-key": True, "--models-dir": True, "--models-preset": True,
           "--models-max": True, "--no-models-autoload": False, "--models-autoload": False}
_OURS_TOO = {"--models-dir", "--models-preset", "--models-max", "--no-models-autoload", "--models-autoload",
             "--host", "--port", "--api-key"}  # pyllmrouter serve takes these as they are
_MODEL = ("-m", "--model", "-hf", "-hfr", "--hf-repo", "-mu", "--model-url")


def split(argv: list[str]) -> tuple[list[str], list[str]]:
    server, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in _SERVER:
            server.append(arg)
            if _SERVER[arg]:
                server.append(argv[i + 1])
                i += 1
        elif arg != "--offline":  # a router reads the cache; it downloads nothing at load
            rest.append(arg)
        i += 1
    return server, rest


def preset_of(args: list[str]) -> str:
    """An INI section for a single-model command line: llama.cpp's reading of its arguments."""
    from pyllmrouter.engine.backend import native  # noqa: PLC0415

    keys = native().args_to_preset(args)
    alias = next((v for k, v in keys if k == "alias"), "default")
    lines = [f"[{alias.split(',')[0]}]"] + [f"{k} = {v}" for k, v in keys]
    fd, path = tempfile.mkstemp(prefix="suite-preset-", suffix=".ini")
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def main(argv: list[str]) -> None:
    mode = os.environ.get("PYLLMROUTER_SUITE_MODE", "ours")
    if mode == "single":
        binary = os.environ["LLAMA_SERVER_PATH"]
        os.execv(binary, [binary, *argv])
    server, rest = split(argv)
    router_mode = any(a in ("--models-dir", "--models-preset") for a in server) or not any(a in _MODEL for a in rest)
    if not router_mode:
        server += ["--models-preset", preset_of(rest)]
        rest = []
    if mode == "router":
        binary = os.environ["LLAMA_SERVER_PATH"]
        os.execv(binary, [binary, *server, *rest])
    extra = shlex.split(os.environ.get("PYLLMROUTER_SUITE_OURS_ARGS", ""))  # the runner's --ours-args
    ours = [sys.executable, "-m", "pyllmrouter.cli", "serve", *server, "--models-memory-margin", "0", *extra, *rest]
    os.execv(sys.executable, ours)


if __name__ == "__main__":
    main(sys.argv[1:])
