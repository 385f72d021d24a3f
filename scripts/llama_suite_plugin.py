"""A pytest plugin for llama.cpp's server test suite, loaded by scripts/llama_server_suite.py
(``-p llama_suite_plugin``) for every target alike: a response's header names compared as
HTTP compares them, without regard to case.

The suite's utils.py copies a response's headers into a plain dict (``dict(response.headers)``),
so a test that reads ``res.headers["Process-Start-Time-Unix"]`` sees the spelling of the
name a server sent.  HTTP header names are case-insensitive (RFC 9110, 5.1; HTTP/2 sends
them in lower case): no correct client depends on their case, so the suite's ServerResponse
keeps them in requests' own case-insensitive mapping instead.
"""

from __future__ import annotations

from requests.structures import CaseInsensitiveDict


def pytest_configure(config) -> None:  # noqa: ARG001 - pytest's hook signature
    import utils  # the suite's own module (its rootdir is on sys.path)

    def set_attr(self, name, value):
        if name == "headers" and isinstance(value, dict) and not isinstance(value, CaseInsensitiveDict):
            value = CaseInsensitiveDict(value)
        object.__setattr__(self, name, value)

    utils.ServerResponse.__setattr__ = set_attr
