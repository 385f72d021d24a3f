"""The Python API as an app developer meets it: each mistake caught where it is made (in a
fresh interpreter, as a user's script runs), ``timeout`` bounding the whole request, an
error status raised, tokens and embeddings, types shipped."""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import pyllmrouter
from pyllmrouter.router.options import known_keys

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def script(*parts: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """The ``parts`` of a user's script (each indented as it likes) run as one: a fresh
    interpreter, the package as installed."""
    code = "".join(textwrap.dedent(p) for p in parts)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


def last_json(out: subprocess.CompletedProcess) -> dict:
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


PRELUDE = """
    import json, time
    from pyllmrouter import ModelConfig, ModelSpec, Router, RequestFailed, RequestTimeout
    from pyllmrouter.devices import EmulatedInventory
    def router(*configs):
        return Router(list(configs), inventory=EmulatedInventory({{"GPU0": 4 << 30}}), margin=0)
    M = {model!r}
"""


def test_a_misspelled_option_is_a_type_error_naming_the_nearest_and_extra_body_sends_anything(tiny):
    """``chat(..., max_token=4)``: before, ignored (a 2020-token answer in 27 s)."""
    out = last_json(script(PRELUDE.format(model=str(tiny["tiny-llama"])), """
        with router(ModelConfig("m", ModelSpec(M, ("-c", "512")))) as r:
            t0 = time.monotonic()
            try:
                r.chat("m", [{"role": "user", "content": "hi"}], max_token=4)
                refused = None
            except TypeError as e:
                refused = str(e)
            took = time.monotonic() - t0
            sent = r.complete("m", "hi", max_tokens=2, extra_body={"not_a_llama_key": 1})
            print(json.dumps({"refused": refused, "took": took, "loads": r.status()["counters"]["loads"],
                              "sent": sent["usage"]["completion_tokens"]}))
    """))
    assert out["refused"] and "'max_token'" in out["refused"] and "'max_tokens'" in out["refused"]
    assert out["took"] < 5 and out["sent"] == 2
    assert out["loads"] == 1  # the refused request loaded nothing: the load is the extra_body one's


def test_timeout_bounds_the_whole_request_and_stops_it(tiny):
    """``timeout=0.3`` on a long reply: RequestTimeout (a TimeoutError) soon after, the
    generation stopped (the model's lease back), for a whole reply and a stream (before:
    the timeout bounded the wait for the model only, and the reply took seconds)."""
    out = last_json(script(PRELUDE.format(model=str(tiny["tiny-llama"])), """
        long = dict(max_tokens=20000, ignore_eos=True)
        with router(ModelConfig("m", ModelSpec(M, ("-c", "32768", "-np", "1")))) as r:
            r.load("m")
            got = {}
            for stream in (False, True):
                t0 = time.monotonic()
                try:
                    out = r.complete("m", "hi", stream=stream, timeout=0.3, **long)
                    if stream:
                        for _ in out:
                            pass
                    got[str(stream)] = ["done", time.monotonic() - t0]
                except TimeoutError as e:
                    got[str(stream)] = [type(e).__name__, time.monotonic() - t0]
                deadline = time.monotonic() + 10
                while r.status()["models"]["m"]["leases"] and time.monotonic() < deadline:
                    time.sleep(0.05)
                got[str(stream)].append(r.status()["models"]["m"]["leases"])
            print(json.dumps(got))
    """))
    for kind in ("False", "True"):
        name, took, leases = out[kind]
        assert name == "RequestTimeout" and took < 2.5 and leases == 0, out


def test_configuration_mistakes_raise_value_error_when_the_router_is_made(tiny, tmp_path):
    out = last_json(script(PRELUDE.format(model=str(tiny["tiny-llama"])), f"""
        errors = {{}}
        def attempt(name, make):
            try:
                make()
                errors[name] = None
            except ValueError as e:
                errors[name] = str(e)
        attempt("spec", lambda: ModelConfig("z", "m.gguf"))
        attempt("item", lambda: Router(["m.gguf"]))
        attempt("args", lambda: router(ModelConfig("z", ModelSpec(M, ("-c 2048",)))))
        attempt("file", lambda: router(ModelConfig("z", ModelSpec({str(tmp_path / "nowhere.gguf")!r}))))
        print(json.dumps(errors))
    """))
    assert "'z'" in out["spec"] and "ModelSpec" in out["spec"]
    assert "item 0" in out["item"] and "ModelConfig" in out["item"]
    assert "'z'" in out["args"] and "-c 2048" in out["args"]
    assert "'z'" in out["file"] and "does not exist" in out["file"]


def test_call_raises_on_an_error_status_and_takes_a_dict(tiny):
    """``call()`` with a dict body; an error status raises RequestFailed (before: a 500
    HttpReply came back, and a dict body was a TypeError from the extension)."""
    out = last_json(script(PRELUDE.format(model=str(tiny["tiny-llama"])), """
        with router(ModelConfig("m", ModelSpec(M, ("-c", "512")))) as r:
            reply, _ = r.call("m", "POST", "/tokenize", {"content": "hi"})
            try:
                r.call("m", "POST", "/v1/chat/completions", {"messages": "not a list"})
                failed = None
            except RequestFailed as e:
                failed = [e.status, str(e)]
            kept, _ = r.call("m", "POST", "/v1/chat/completions", {"messages": "x"}, raise_for_status=False)
            print(json.dumps({"tokens": json.loads(reply.body)["tokens"], "failed": failed, "kept": kept.status}))
    """))
    assert out["tokens"] and out["failed"][0] >= 400 and out["kept"] == out["failed"][0]


def test_tokens_both_ways_and_embeddings_as_the_readme_shows_them(tiny):
    out = last_json(script(PRELUDE.format(model=str(tiny["tiny-llama"])), f"""
        import asyncio
        with router(ModelConfig("m", ModelSpec(M, ("-c", "512"))),
                    ModelConfig("e", ModelSpec({str(tiny["tiny-bert"])!r}, ("--embedding", "--pooling", "mean"))),
                    ModelConfig("none", ModelSpec(M, ("-c", "512", "--embedding")))) as r:
            ids = r.tokenize("m", "hello world")
            text = r.detokenize("m", ids)
            aids = asyncio.run(r.atokenize("m", "hello world"))
            vec = r.embed("e", ["a", "b"])["data"]
            try:
                r.embed("none", "a")
                hint = None
            except RequestFailed as e:
                hint = str(e)
            print(json.dumps({{"ids": ids, "aids": aids, "text": text, "vectors": len(vec), "hint": hint}}))
    """))
    assert out["ids"] == out["aids"] and all(isinstance(i, int) for i in out["ids"])
    assert "hello world" in out["text"] and out["vectors"] == 2
    assert "--pooling" in out["hint"]


def test_the_package_is_typed_and_exports_its_errors():
    assert (Path(pyllmrouter.__file__).parent / "py.typed").exists()
    for name in ("RouterClosed", "RequestTimeout", "QueueFull", "QueueTimeout", "RequestFailed"):
        assert issubclass(getattr(pyllmrouter, name), pyllmrouter.RouterError)
    assert issubclass(pyllmrouter.RequestTimeout, TimeoutError)
    from pyllmrouter import Router

    public = [n for n in dir(Router) if not n.startswith("_") and callable(getattr(Router, n))]
    assert [n for n in public if not (getattr(Router, n).__doc__ or "").strip()] == []


def test_a_ctrl_c_prints_no_worker_traceback(tiny, tmp_path):
    """SIGINT to the script's process group (a terminal's Ctrl-C): the script's own
    KeyboardInterrupt only (before, each worker printed a second traceback).  The script
    takes SIGINT as a terminal gives it, whatever the shell that runs the tests set (a
    background job's is ignored, and a child inherits that)."""
    code = textwrap.dedent(PRELUDE.format(model=str(tiny["tiny-llama"]))) + textwrap.dedent("""
        import signal, sys
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with router(ModelConfig("m", ModelSpec(M, ("-c", "512")))) as r:
            r.load("m")
            print("ready", flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert err.count("Traceback") <= 1 and "worker" not in err.lower(), err


def _sent_by_llama_cpps_own_tests() -> set[str]:
    """The request keys llama.cpp's server tests (tools/server/tests/unit of the pinned source)
    send in their request bodies."""
    src = subprocess.run([sys.executable, str(ROOT / "vendor" / "fetch.py"), "source"], capture_output=True,
                         text=True, timeout=300)
    if src.returncode != 0:
        pytest.skip(f"the pinned source is not here: {src.stderr.strip()[-200:]}")
    sent = set()
    for f in sorted(Path(src.stdout.strip(), "tools", "server", "tests", "unit").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("make_request", "make_stream_request",
                                                                                  "make_any_request"):
                for kw in node.keywords:
                    if kw.arg == "data" and isinstance(kw.value, ast.Dict):
                        sent |= {k.value for k in kw.value.keys if isinstance(k, ast.Constant)}
    return sent


def test_the_extracted_keys_are_those_llama_cpps_own_tests_send():
    sent = _sent_by_llama_cpps_own_tests()
    assert len(sent) > 30, sent  # the tests were found
    keys = known_keys()
    assert "max_tokens" in keys and "max_token" not in keys
    assert sent - keys == set()


def test_a_stream_asked_for_that_comes_whole_raises_request_failed(tiny):
    """``achat(stream=True)`` whose reply comes whole (``extra_body`` turned streaming off):
    RequestFailed saying so (not another error), and the model free after it."""
    out = last_json(script(PRELUDE.format(model=str(tiny["tiny-llama"])), """
        import asyncio
        msgs = [{"role": "user", "content": "hi"}]
        with router(ModelConfig("m", ModelSpec(M, ("-c", "512")))) as r:
            said = []
            async def awaited():
                try:
                    async for _ in r.achat("m", msgs, stream=True, max_tokens=2, extra_body={"stream": False}):
                        pass
                except RequestFailed as e:
                    said.append(str(e))
            asyncio.run(awaited())
            print(json.dumps({"said": said, "leases": r.status()["models"]["m"]["leases"]}))
    """))
    assert len(out["said"]) == 1 and "not a stream" in out["said"][0], out
    assert out["leases"] == 0
