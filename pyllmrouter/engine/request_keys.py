"""``python -m pyllmrouter.engine.request_keys``: the request keys llama-server's handlers
read (``_native.request_keys()``, extracted from the pinned source when the extension was
built), as one JSON line.  A short-lived process: the router loads no llama.cpp."""

from __future__ import annotations

import json
import sys

from pyllmrouter.engine.backend import native


def main() -> int:
    print(json.dumps(native().request_keys()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
