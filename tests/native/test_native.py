"""The extension links the very libllama that llama_cpp loads, and only on demand."""

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from pyllmrouter.engine.backend import native


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _libllama_paths() -> str:
    return """
        import os
        def libllama():
            paths = set()
            for line in open("/proc/self/maps"):
                path = line.split()[-1]
                if os.path.basename(path).startswith("libllama.so"):
                    paths.add(os.path.realpath(path))
            return sorted(paths)
    """


def test_one_libllama_per_process_with_llama_cpp_first(tiny):
    out = _run(_libllama_paths() + f"""
        import llama_cpp
        from pyllmrouter import ModelSpec, probe
        from pyllmrouter.engine.loader import load
        probe(ModelSpec({str(tiny["tiny-llama"])!r}, n_ctx=128), use_cache=False)
        load(ModelSpec({str(tiny["tiny-llama"])!r}, n_ctx=128))
        print(libllama())
    """)
    paths = eval(out)
    assert len(paths) == 1, paths
    assert "/llama_cpp/lib/" in paths[0]


def test_native_alone_finds_the_same_library_by_rpath():
    out = _run(_libllama_paths() + """
        import importlib.util, os
        from pyllmrouter import _native
        _native.devices()
        print(libllama())
        print(os.path.realpath(os.path.dirname(importlib.util.find_spec("llama_cpp").origin)))
    """)
    paths, pkg = out.splitlines()
    paths = eval(paths)
    assert len(paths) == 1 and paths[0].startswith(pkg + "/lib/"), (paths, pkg)


def test_importing_the_package_loads_no_backend():
    out = _run(_libllama_paths() + """
        import sys
        import pyllmrouter
        from pyllmrouter import ModelSpec
        from pyllmrouter.tools import tinymodels
        ModelSpec("x.gguf")
        print(libllama(), "llama_cpp" in sys.modules)
    """)
    assert out.strip() == "[] False"


def test_devices_lists_the_cpu_with_memory():
    devs = native().devices()
    cpu = [d for d in devs if d["type"] == "cpu"]
    assert len(cpu) == 1
    assert 0 < cpu[0]["free"] <= cpu[0]["total"]


def test_metadata_reads_scalars_without_tensor_data(tiny):
    meta = native().metadata(str(tiny["tiny-llama"]))
    assert meta["general.architecture"] == "llama"
    assert meta["llama.block_count"] == 2
    assert meta["tokenizer.ggml.tokens"][0] == "array"


def test_native_rejects_null_addresses(tiny):
    with pytest.raises(ValueError):
        native().probe(str(tiny["tiny-llama"]), 0, 0, 1)
    with pytest.raises(ValueError):
        native().live_breakdown(0)


def test_first_use_from_many_threads_installs_one_live_log_callback():
    # two log bridges created at once used to leave llama.cpp calling the dropped
    # one's trampoline: a crash at the next log line (llama_free's, say)
    out = _run("""
        import ctypes, threading
        from pyllmrouter.engine import backend
        start = threading.Barrier(8)
        def first_use():
            start.wait()
            backend.llama_cpp_module()
        threads = [threading.Thread(target=first_use) for _ in range(8)]
        for t in threads: t.start()
        for t in threads: t.join()
        lc = backend.llama_cpp_module()
        cb, ud = lc.llama_log_callback(), ctypes.c_void_p()
        lc.llama_log_get(ctypes.byref(cb), ctypes.byref(ud))
        live = backend._LogBridge._installed.callback
        print(ctypes.cast(cb, ctypes.c_void_p).value == ctypes.cast(live, ctypes.c_void_p).value)
    """)
    assert out.strip() == "True"


def test_probing_while_another_thread_loads_and_generates(tiny):
    # llama.cpp's log callback is process-wide: a probe must capture only its own lines
    out = _run(f"""
        import threading
        from pyllmrouter import ModelSpec, ProbeError, probe
        from pyllmrouter.engine.loader import load, request
        path = {str(tiny["tiny-llama"])!r}
        stop = []
        def busy():
            while not stop:
                llm = load(ModelSpec(path, n_ctx=256))
                request(llm, "/v1/completions", {{"prompt": "hello", "max_tokens": 4}})
                llm.close()
        t = threading.Thread(target=busy)
        t.start()
        reasons = set()
        for i in range(60):
            probe(ModelSpec(path, n_ctx=128 + i), use_cache=False)
            try:
                probe(ModelSpec(path, ("-ctv", "q8_0", "-fa", "off")), use_cache=False)
            except ProbeError as e:
                reasons.add(e.reason)
        stop.append(1)
        t.join()
        print(len(reasons), sorted(reasons)[0][:40])
    """)
    assert out.strip() == "1 cannot create a context: llama_init_from"


def test_llama_cpps_debug_lines_stop_in_cpp_unless_debug_logging_is_on(tiny):
    # llama.cpp logs debug lines on every decode: through the Python bridge, each took the
    # GIL; they reach Python only when asked for
    code = f"""
        import collections, logging, sys
        from pyllmrouter.engine import backend
        if sys.argv[1] == "debug":
            logging.getLogger("pyllmrouter.llama").setLevel(logging.DEBUG)
        levels = collections.Counter()
        real = backend.forward_log
        backend.forward_log = lambda lines: levels.update(line[:1] for line in lines) or real(lines)
        from pyllmrouter import ModelSpec
        from pyllmrouter.engine.loader import load, request
        llm = load(ModelSpec({str(tiny["tiny-llama"])!r}, n_ctx=256))
        before = dict(levels)
        request(llm, "/v1/completions", {{"prompt": "hello", "max_tokens": 8}})
        llm.close()
        print(before.get("I", 0) > 0, levels["D"] - before.get("D", 0))
    """
    runs = {}
    for mode in ("quiet", "debug"):
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(code), mode], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        runs[mode] = out.stdout.split()
    assert runs["quiet"] == ["True", "0"]  # the load's information lines still arrive
    assert runs["debug"][0] == "True" and int(runs["debug"][1]) >= 8  # a few per decoded token


def test_an_outbox_sends_tokens_that_come_faster_than_its_interval_together():
    def takes(interval: float) -> list[list[bytes]]:
        box, out = native().Outbox(interval), []
        box.push(1, b"a")
        out.append([c for _, c, _, _ in box.take(1.0)])  # after a pause: at once
        reader = threading.Thread(target=lambda: out.append([c for _, c, _, _ in box.take(1.0)]))
        reader.start()
        box.push(1, b"b")
        time.sleep(0.05)  # a token 50 ms later: within 0.5 s of the last take, not of 0
        box.push(1, b"c")
        reader.join()
        return out

    assert takes(0.5) == [[b"a"], [b"b", b"c"]]
    assert takes(0.0)[1] == [b"b"]


def test_llama_cpp_loads_with_openmps_active_wait_policy_unless_the_user_chose_one():
    # one OpenMP team per model's slot loop: with libgomp's default policy, more threads
    # than CPUs made idle models slow a busy one's steps (concurrency_bench --loaded)
    code = """
        import os
        from pyllmrouter.engine.backend import native
        native()
        print(os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"))
    """
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    runs = [subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**env, **extra}, capture_output=True,
                           text=True, timeout=120) for extra in ({}, {"OMP_WAIT_POLICY": "passive"})]
    assert [r.stdout.split() for r in runs] == [["active", "300000"], ["passive", "None"]], runs[0].stderr


def test_closing_an_engine_ends_the_requests_it_is_serving(tiny):
    """``Engine.close()`` while a whole reply is awaited and a stream is open (a model freed
    under its requests, as Serve's multiplexing evicts one): the awaited request returns
    (llama-server's reply to a client that left), the stream ends, and close returns; the
    context goes with the last reply.  Before, close freed the context under them: a hang
    in its destructor, or a double free.  In a process of its own, as a hang would
    otherwise hang the suite."""
    out = _run(f"""
        import json, threading, time
        from pyllmrouter import ModelSpec
        from pyllmrouter.engine.loader import load
        engine = load(ModelSpec({str(tiny["tiny-llama"])!r}, ("-np", "2"), n_ctx=16384))
        body = {{"prompt": "hi", "max_tokens": 8000, "ignore_eos": True, "temperature": 0}}
        stream = engine.handle("POST", "/v1/completions", {{}}, {{}}, json.dumps({{**body, "stream": True}}).encode())
        whole = []
        t = threading.Thread(target=lambda: whole.append(engine.handle(
            "POST", "/v1/completions", {{}}, {{}}, json.dumps(body).encode())))
        t.start()
        time.sleep(0.3)  # both under way
        t0 = time.monotonic()
        closer = threading.Thread(target=engine.close, daemon=True)
        closer.start()
        closer.join(30)
        t.join(30)
        chunks = 0
        while stream.next()[0]:
            chunks += 1
        print(json.dumps({{"closed": not closer.is_alive(), "returned": not t.is_alive(),
                          "status": whole[0].status if whole else None, "stream": stream.is_stream,
                          "seconds": time.monotonic() - t0}}), flush=True)
        del stream, whole
        import os; os._exit(0)
    """)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["closed"] and result["returned"] and result["stream"], result
    assert result["seconds"] < 10, result
