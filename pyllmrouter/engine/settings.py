"""``python -m pyllmrouter.engine.settings [llama-server arguments]``: what llama-server's
HTTP layer makes of the arguments (CORS, API keys, tools, MCP servers, the CORS proxy),
read by llama.cpp's parser, as one JSON line; exit code 2 and llama.cpp's reason on
stderr for a bad argument.  A short-lived process: the router loads no llama.cpp."""

from __future__ import annotations

import sys

from pyllmrouter.engine.backend import bindings_only, native


def main(argv: list[str]) -> int:
    bindings_only()
    try:
        print(native().router_settings(argv), flush=True)
    except ValueError as e:
        print(f"{e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
