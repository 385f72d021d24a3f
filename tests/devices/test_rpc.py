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




@pytest.mark.parametrize("model, extra, args", [
    ("tiny-llama", "tensor_split=(1, 2)", ()),
    ("tiny-moe", "tensor_split=(1, 1)", ()),
    ("tiny-moe", "tensor_split=(1, 1)", ("--cpu-moe",)),
    ("tiny-llama", "n_gpu_layers=1, tensor_split=(1, 1)", ()),
])
def test_probe_equals_allocation_on_rpc_devices(rpc_servers, tiny, model, extra, args):
    out = run_py(f"""
        import json
        from pyllmrouter.engine.backend import native
        from pyllmrouter import ModelSpec, probe
        from pyllmrouter.engine.loader import load, request
        from pyllmrouter.engine.probe import live_breakdown
        names = native().add_rpc_servers({rpc_servers[:2]!r})
        spec = ModelSpec({str(tiny[model])!r}, ("-lm", "none", *{args!r}), n_ctx=512, {extra})
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
        r.scheduler.measure("b")  # measured ahead: the 1 s wait below is for memory, not a probe
        busy = r.complete("a", "hello", max_tokens=8, stream=True)
        next(busy)
        from pyllmrouter import QueueTimeout

        with pytest.raises(QueueTimeout):
            r.complete("b", "x", max_tokens=2, wait=1.0)  # never co-loaded next to a busy a
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


def test_a_projector_goes_to_a_device_or_to_the_host_as_the_engine_puts_it(rpc_servers, tiny, projector):
    """The probe puts the projector's bytes where llama-server's engine puts the projector:
    on the model's device (an rpc-server here) when offloaded, in host memory with
    --no-mmproj-offload; and a model so loaded answers an image request."""
    out = run_py(f"""
        import base64, json
        from pyllmrouter.engine.backend import native
        from pyllmrouter import ModelSpec, probe
        from pyllmrouter.engine.loader import load, request
        from pyllmrouter.tools import tinymodels
        native().add_rpc_servers({rpc_servers[:2]!r})
        result = {{}}
        for offload in (True, False):
            spec = ModelSpec({str(tiny["tiny-llama"])!r}, ("-np", "1", "-dev", "RPC1", "--mmproj", {str(projector)!r}), n_ctx=512, mmproj_offload=offload)
            est = probe(spec, use_cache=False)
            rows = [[b.device, b.host, b.projector] for b in est.buffers if b.projector]
            llm = load(spec)
            uri = "data:image/png;base64," + base64.b64encode(tinymodels.png()).decode()
            reply = request(llm, "/v1/chat/completions", {{"max_tokens": 2, "messages": [{{"role": "user",
                "content": [{{"type": "text", "text": "see"}}, {{"type": "image_url", "image_url": {{"url": uri}}}}]}}]}})
            llm.close()
            result[str(offload)] = {{"rows": rows, "prompt": reply["usage"]["prompt_tokens"],
                                    "model_on": sorted({{b.device for b in est.buffers if b.model and not b.host}})}}
        print(json.dumps(result))
    """)
    on, off = out["True"], out["False"]
    assert on["model_on"] == off["model_on"] == ["RPC1"]
    # offloaded: with the model, on its device (and a host part: the CPU side of its compute)
    device = [r for r in on["rows"] if not r[1]]
    assert [r[0] for r in device] == ["RPC1"] and device[0][2] > 0
    assert [r[:2] for r in off["rows"]] == [["CPU", True]]  # not offloaded: all in host memory
    assert off["rows"][0][2] > sum(r[2] for r in on["rows"] if r[1])
    assert on["prompt"] == off["prompt"] > 16


def test_a_lora_adapter_is_counted_on_the_devices_of_the_layers_it_adapts(rpc_servers, tiny, tmp_path):
    """Layer 0 on RPC0, layer 1 and the output on RPC1: each adapter pair is counted
    where its layer is, and the engine so loaded answers differently with the adapter on."""
    from pyllmrouter.tools import tinymodels

    lora = tinymodels.write_lora(tmp_path / "lora.gguf", targets=("attn_q", "output"))
    out = run_py(f"""
        import json
        from pyllmrouter.engine.backend import native
        from pyllmrouter import ModelSpec, probe
        from pyllmrouter.engine.loader import load, request
        native().add_rpc_servers({rpc_servers[:2]!r})
        spec = ModelSpec({str(tiny["tiny-llama"])!r}, ("-np", "1", "--lora", {str(lora)!r}), n_ctx=512,
                         tensor_split=(1, 2))
        rows = {{b.device: b.model for b in probe(spec, use_cache=False).buffers if b.component == "lora"}}
        llm = load(spec)
        texts = [request(llm, "/v1/completions", {{"prompt": "hello", "max_tokens": 8, "temperature": 0,
                                                   "lora": [{{"id": 0, "scale": scale}}]}})["choices"][0]["text"]
                 for scale in (0.0, 1.0)]
        llm.close()
        print(json.dumps({{"rows": rows, "sizes": dict(native().tensor_sizes({str(lora)!r})), "texts": texts}}))
    """)
    sizes = out["sizes"]
    layer0 = sizes["blk.0.attn_q.weight.lora_a"] + sizes["blk.0.attn_q.weight.lora_b"]
    rest = sum(sizes.values()) - layer0
    assert out["rows"] == {"RPC0": layer0, "RPC1": rest}
    off, on = out["texts"]
    assert off != on  # the adapter, split over both devices, changes what the model says


def test_a_draft_on_a_device_of_its_own(rpc_servers, tiny, draft):
    """The model on RPC0, its draft on RPC1 (-devd): each counted where it is, and the
    engine so loaded speculates."""
    out = run_py(f"""
        import json
        from pyllmrouter.engine.backend import native
        from pyllmrouter import ModelSpec, probe
        from pyllmrouter.engine.loader import load, request
        native().add_rpc_servers({rpc_servers[:2]!r})
        spec = ModelSpec({str(tiny["tiny-llama"])!r}, ("-np", "1", "-dev", "RPC0", "-md", {str(draft)!r}, "--spec-type", "draft-simple"), n_ctx=512,
                         draft_devices=("RPC1",))
        est = probe(spec, use_cache=False)
        where = lambda c: sorted({{b.device for b in est.buffers if b.component == c and not b.host and b.model}})
        llm = load(spec)
        reply = request(llm, "/v1/completions", {{"prompt": "hello", "max_tokens": 8, "temperature": 0}})
        llm.close()
        print(json.dumps({{"model": where("model"), "draft": where("draft"), "drafted": reply["timings"]["draft_n"]}}))
    """)
    assert out["model"] == ["RPC0"] and out["draft"] == ["RPC1"] and out["drafted"] > 0


@pytest.mark.parametrize("offload", [True, False])
def test_probe_equals_what_the_rpc_servers_hold_with_projector_and_draft(tiny, projector, draft, tmp_path, offload):
    """The model and its projector on RPC0, the draft on RPC1: each rpc-server's own log of
    the buffers it holds (GGML_RPC_DEBUG) sums to the probe's bytes for that device, after
    the load and after an image request that speculates."""
    from pyllmrouter.tools.loopback import RpcServers

    with RpcServers(2, RPC_SERVER, log_dir=tmp_path) as endpoints:
        out = run_py(f"""
            import base64, json
            from pathlib import Path
            from pyllmrouter.engine.backend import native
            from pyllmrouter import ModelSpec, probe
            from pyllmrouter.engine.loader import load, request
            from pyllmrouter.tools import tinymodels
            from pyllmrouter.tools.loopback import rpc_live_bytes
            native().add_rpc_servers({endpoints!r})
            held = lambda: {{f"RPC{{i}}": rpc_live_bytes(Path({str(tmp_path)!r}) / f"rpc{{i}}.log") for i in range(2)}}
            spec = ModelSpec({str(tiny["tiny-llama"])!r}, ("-np", "1", "-dev", "RPC0", "--mmproj", {str(projector)!r}, "-md", {str(draft)!r}, "--spec-type", "draft-simple"), n_ctx=512, mmproj_offload={offload},
                             draft_devices=("RPC1",))
            est = probe(spec, use_cache=False)
            before = held()
            llm = load(spec)
            loaded = held()
            uri = "data:image/png;base64," + base64.b64encode(tinymodels.png()).decode()
            reply = request(llm, "/v1/chat/completions", {{"max_tokens": 8, "temperature": 0, "messages": [
                {{"role": "user", "content": [{{"type": "text", "text": "see"}},
                                             {{"type": "image_url", "image_url": {{"url": uri}}}}]}}]}})
            answered = held()
            llm.close()
            native().devices()  # a reply from each server: the frees sent before it (no reply of their own) are done
            per = est.per_device()
            components = {{d: sorted({{b.component for b in est.buffers if b.device == d}}) for d in ("RPC0", "RPC1")}}
            print(json.dumps({{"probe": {{d: per.get(d, 0) for d in ("RPC0", "RPC1")}}, "components": components,
                              "before": before, "loaded": loaded, "answered": answered, "after": held(),
                              "drafted": reply["timings"]["draft_n"]}}))
        """)
    assert out["before"] == {"RPC0": 0, "RPC1": 0}
    assert out["loaded"] == out["probe"] == out["answered"]
    assert out["after"] == {"RPC0": 0, "RPC1": 0}  # closing the model frees it all
    assert out["components"]["RPC1"] == ["draft"]
    assert ("projector" in out["components"]["RPC0"]) == offload
    assert out["drafted"] > 0
