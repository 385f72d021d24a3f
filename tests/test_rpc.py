"""Real multi-device tests: ggml rpc-servers on loopback are devices RPC0, RPC1, RPC2.

The rpc-server is llama.cpp's own, built from the pinned sdist by
``scripts/build_llama_tools.sh ggml-rpc-server`` (``scripts/setup.sh --test``
does it). Checks that attach rpc-servers run in subprocesses: attached devices
stay attached for the life of a process.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import RPC_SERVER, run_py

from pyllmrouter import ModelConfig, ModelSpec, Router
from pyllmrouter.devices import RpcInventory

SHARE_PROBE_CACHE = True


pytestmark = [pytest.mark.slow,  # rpc-servers and worker processes
              pytest.mark.skipif(not RPC_SERVER.exists(),
                                 reason="rpc-server not built: scripts/build_llama_tools.sh ggml-rpc-server")]




@pytest.mark.parametrize("model, extra", [
    ("tiny-llama", "tensor_split=(1, 2)"),
    ("tiny-moe", "tensor_split=(1, 1)"),
    ("tiny-moe", "tensor_split=(1, 1), cpu_moe=True"),
    ("tiny-llama", "n_gpu_layers=1, tensor_split=(1, 1)"),
])
def test_probe_equals_allocation_on_rpc_devices(rpc_servers, tiny, model, extra):
    out = run_py(f"""
        import json
        from pyllmrouter.engine.backend import native
        from pyllmrouter import ModelSpec, probe
        from pyllmrouter.engine.loader import load, request
        from pyllmrouter.engine.probe import live_breakdown
        names = native().add_rpc_servers({rpc_servers[:2]!r})
        spec = ModelSpec({str(tiny[model])!r}, n_ctx=512, use_mmap=False, {extra})
        est = probe(spec, use_cache=False)
        llm = load(spec)
        live = live_breakdown(llm)  # as allocated by the load (a decode may shrink compute buffers later)
        text = request(llm, "/v1/completions", {{"prompt": "hello", "max_tokens": 4}})["choices"][0]["text"]
        row = lambda b: [b.device, b.host, b.model, b.context, b.compute]
        print(json.dumps({{"names": names, "probe": sorted(row(b) for b in est.buffers if b.buffer_type != "output"),
                          "live": sorted(row(b) for b in live), "text": text}}))
    """)
    assert out["names"] == ["RPC0", "RPC1"]
    # weights and KV byte for byte; compute too, except that llama.cpp's no_alloc sizing
    # of an uneven split's last device can come out larger (never smaller) than the real one
    assert [r[:4] for r in out["probe"]] == [r[:4] for r in out["live"]]
    assert all(p[4] >= l[4] for p, l in zip(out["probe"], out["live"]))
    if "(1, 1)" in extra:
        assert out["probe"] == out["live"]
    on_devices = {r[0] for r in out["probe"] if not r[1] and r[2] > 0}
    if "n_gpu_layers=1" in extra:  # partial offload: one layer on one device, the rest on the host
        assert len(on_devices) == 1 and any(r[1] and r[2] > 0 for r in out["probe"])
    else:
        assert on_devices == {"RPC0", "RPC1"}  # weights really went to both devices
    if "cpu_moe" in extra:  # experts stay in host memory: most weights are on the host
        host = sum(r[2] for r in out["probe"] if r[1])
        assert host > sum(r[2] for r in out["probe"] if not r[1])


def test_two_device_incident_on_rpc_devices(rpc_servers, tiny):
    a, b = ModelSpec(tiny["tiny-llama"], n_ctx=512), ModelSpec(tiny["tiny-moe"], n_ctx=512)
    probe_cmd = run_py(f"""
        import json
        from pyllmrouter.engine.backend import native
        from pyllmrouter import ModelSpec, probe
        native().add_rpc_servers({rpc_servers[:1]!r})
        print(json.dumps({{n: probe(ModelSpec(p, n_ctx=512), use_cache=False).per_device().get("RPC0", 0)
                          for n, p in (("a", {str(tiny["tiny-llama"])!r}), ("b", {str(tiny["tiny-moe"])!r}))}}))
    """)
    size = max(probe_cmd.values()) + min(probe_cmd.values()) // 2  # one model at a time on RPC0
    inv = RpcInventory({rpc_servers[0]: size, rpc_servers[1]: 1 << 30})
    models = [ModelConfig("a", a, devices=("RPC0",)), ModelConfig("b", b, devices=("RPC0",)),
              ModelConfig("c", a)]
    with Router(models, inventory=inv, margin=0) as r:
        busy = r.complete("a", "hello", max_tokens=8, stream=True)
        next(busy)
        from pyllmrouter import QueueTimeout

        with pytest.raises(QueueTimeout):
            r.complete("b", "x", max_tokens=2, timeout=1.0)  # never co-loaded next to a busy a
        list(busy)
        assert r.complete("b", "x", max_tokens=2)["choices"]
        st = r.status()
        assert st["models"]["a"]["state"] == "unloaded" and st["models"]["b"]["devices"] == ["RPC0"]
        assert st["models"]["b"]["requirement"]["RPC0"]["RPC0"] == probe_cmd["b"]  # bytes from llama.cpp
        r.complete("c", "x", max_tokens=2)
        assert r.status()["models"]["c"]["devices"] == ["RPC1"]  # the unpinned one goes to the idle device
        r.scheduler.check_invariant()


def test_cli_probe_on_rpc_devices(rpc_servers, tiny):
    out = subprocess.run([sys.executable, "-m", "pyllmrouter.cli", "probe", str(tiny["tiny-llama"]), "-c", "512",
                          "--rpc", ",".join(rpc_servers[:2]), "-ts", "1,1", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert [x["device"] for x in d["devices"]] == ["RPC0", "RPC1", "CPU"]
