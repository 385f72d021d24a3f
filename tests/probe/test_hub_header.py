"""A hub model's exact bytes from its headers (hubfiles.py, engine/hubprobe.py): equal to the
probe of the downloaded files per buffer, for a small part of their bytes; the errors; the
fit table; the server refusing a pull that can never fit."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from pyllmrouter import hubfiles, probe
from pyllmrouter.cli import main
from pyllmrouter.engine.hubprobe import hub_options, probe_hub
from pyllmrouter.memory import ProbeError
from pyllmrouter.spec import ModelSpec
from pyllmrouter.tools import tinymodels
from pyllmrouter.tools.hub import LocalHub

SMALL = tinymodels.Shape("llama", n_embd=256, n_layer=2, n_head=4, n_head_kv=2, n_ff=512)


@pytest.fixture(scope="module")
def repos(tiny, tmp_path_factory):
    """Hub repositories of generated models: real tiny ones (f16), sparse ones of real
    quants (Q4_0, Q8_0, a 7B), a split model and a model with its projector."""
    d = tmp_path_factory.mktemp("hub")
    split = tinymodels.write_llama_split(d / "split" / "tiny-split-F16.gguf", 2)
    return {
        "org/tiny": {"tiny-llama-F16.gguf": tiny["tiny-llama"],
                     "tiny-llama-Q4_0.gguf": tinymodels.write_shape(d / "q4.gguf", SMALL, "Q4_0"),
                     "tiny-llama-Q8_0.gguf": tinymodels.write_shape(d / "q8.gguf", SMALL, "Q8_0"),
                     "README.md": tiny["tiny-llama"]},
        "org/moe": {"tiny-moe-F16.gguf": tiny["tiny-moe"]},
        "org/bert": {"tiny-bert-F16.gguf": tiny["tiny-bert"]},
        "org/big": {"shape-7b-Q4_0.gguf": tinymodels.write_shape(d / "7b.gguf", tinymodels.SHAPE_7B)},
        "org/split": {p.name: p for p in split},
        "org/vision": {"tiny-llama-F16.gguf": tiny["tiny-llama"],
                       "mmproj-tiny-F16.gguf": tinymodels.write_projector(d / "mmproj.gguf")},
    }


@pytest.fixture
def hub(repos, monkeypatch, tmp_path):
    monkeypatch.setenv("PYLLMROUTER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with LocalHub(repos) as endpoint:
        monkeypatch.setenv("MODEL_ENDPOINT", endpoint)
        yield


@pytest.fixture
def local_hub(repos, monkeypatch, tmp_path):
    """The hub object itself (its byte counts)."""
    monkeypatch.setenv("PYLLMROUTER_CACHE", str(tmp_path / "cache"))
    h = LocalHub(repos)
    with h as endpoint:
        monkeypatch.setenv("MODEL_ENDPOINT", endpoint)
        yield h


# (hub reference, llama-server arguments, the downloaded files: model, then projector)
CASES = {
    "llama-f16": ("org/tiny:F16", ("-c", "512"), ("org/tiny", "tiny-llama-F16.gguf"), None),
    "llama-q4_0": ("org/tiny:Q4_0", ("-c", "1024", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"),
                   ("org/tiny", "tiny-llama-Q4_0.gguf"), None),
    "llama-q8_0": ("org/tiny:q8_0", ("-np", "2"), ("org/tiny", "tiny-llama-Q8_0.gguf"), None),
    "moe": ("org/moe:F16", ("-c", "256"), ("org/moe", "tiny-moe-F16.gguf"), None),
    "bert": ("org/bert", ("--embedding", "-c", "512"), ("org/bert", "tiny-bert-F16.gguf"), None),
    "7b": ("org/big:Q4_0", ("-c", "8192"), ("org/big", "shape-7b-Q4_0.gguf"), None),
    "split": ("org/split:F16", ("-c", "512"), ("org/split", "tiny-split-F16-00001-of-00002.gguf"), None),
    "projector": ("org/vision:F16", ("-c", "512"), ("org/vision", "tiny-llama-F16.gguf"),
                  ("org/vision", "mmproj-tiny-F16.gguf")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_header_probe_equals_the_downloaded_files_to_the_byte(case, repos, local_hub):
    ref, args, (repo, name), projector = CASES[case]
    hp = probe_hub(hub_options(["-hf", ref, *args]))
    extra = ("--mmproj", str(repos[projector[0]][projector[1]])) if projector else ()
    local = probe(ModelSpec(str(repos[repo][name]), (*extra, *args)), use_cache=False)
    assert hp.estimate.buffers == local.buffers  # every device and buffer type, to the byte
    assert (hp.estimate.n_ctx, hp.estimate.n_seq_max) == (local.n_ctx, local.n_seq_max)
    assert hp.plan.model[0].path == name and (hp.plan.mmproj is not None) == bool(projector)
    for f, h in hp.reading.heads.items():  # each file's first bytes only, as the hub counts them
        assert h.read == local_hub.served[f.path] <= max(hubfiles.FIRST_READ, 2 * len(h.data)) < f.size
        assert h.read < f.size / 4 or f.size < 4 * hubfiles.FIRST_READ
    if case == "7b":
        assert hp.reading.bytes_read < hp.reading.size / 1000


def test_a_split_model_reads_every_part(local_hub):
    hp = probe_hub(hub_options(["-hf", "org/split:F16"]))
    assert [f.path for f in hp.plan.model] == ["tiny-split-F16-00001-of-00002.gguf",
                                               "tiny-split-F16-00002-of-00002.gguf"]
    assert set(local_hub.served) == {f.path for f in hp.plan.model}


def test_headers_are_cached_by_oid(local_hub, repos):
    first = probe_hub(hub_options(["-hf", "org/tiny:F16"]))
    served = dict(local_hub.served)
    again = probe_hub(hub_options(["-hf", "org/tiny:F16"]))
    assert local_hub.served == served and again.reading.bytes_read == 0
    assert all(h.cached for h in again.reading.heads.values()) and again.estimate.buffers == first.estimate.buffers
    assert probe_hub(hub_options(["-hf", "org/tiny:F16"]), use_cache=False).reading.bytes_read > 0


def test_a_hub_without_range_is_read_only_as_far_as_the_header(repos, monkeypatch, tmp_path):
    monkeypatch.setenv("PYLLMROUTER_CACHE", str(tmp_path))
    with LocalHub(repos, ranges=False) as endpoint:
        monkeypatch.setenv("MODEL_ENDPOINT", endpoint)
        hp = probe_hub(hub_options(["-hf", "org/tiny:F16", "-c", "512"]))
    local = probe(ModelSpec(str(repos["org/tiny"]["tiny-llama-F16.gguf"]), ("-c", "512")), use_cache=False)
    assert hp.estimate.buffers == local.buffers
    assert hp.reading.bytes_read == hubfiles.FIRST_READ < hp.reading.size


def test_a_token_is_sent_and_a_refusal_named(repos, monkeypatch, tmp_path):
    monkeypatch.setenv("PYLLMROUTER_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with LocalHub(repos, token="s3cret") as endpoint:
        monkeypatch.setenv("MODEL_ENDPOINT", endpoint)
        with pytest.raises(ProbeError, match=r"access refused \(HTTP 401.*no token given"):
            probe_hub(hub_options(["-hf", "org/tiny:F16"]))
        with pytest.raises(ProbeError, match="the token given was refused"):
            probe_hub(hub_options(["-hf", "org/tiny:F16", "-hft", "wrong"]))
        assert probe_hub(hub_options(["-hf", "org/tiny:F16", "-hft", "s3cret"])).estimate.total > 0
        monkeypatch.setenv("HF_TOKEN", "s3cret")
        assert probe(hub="org/tiny:F16").total > 0


def test_bad_input_is_named(repos, monkeypatch, tmp_path):
    text = tmp_path / "notes.gguf"
    text.write_text("not a model at all\n" * 100)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(open(repos["org/tiny"]["tiny-llama-F16.gguf"], "rb").read(3000))
    monkeypatch.setenv("PYLLMROUTER_CACHE", str(tmp_path / "cache"))
    with LocalHub({**repos, "org/bad": {"notes-Q8_0.gguf": text, "cut-Q4_0.gguf": cut}}) as endpoint:
        monkeypatch.setenv("MODEL_ENDPOINT", endpoint)
        for ref, reason in [("org/absent:Q8_0", "org/absent: no such repository"),
                            ("org/tiny:Q2_K", r"no GGUF file of quant 'Q2_K'.*tiny-llama-F16.gguf"),
                            ("org/bad:Q8_0", r"not a GGUF file: it starts with b'not '"),
                            ("org/bad:Q4_0", "a truncated GGUF file"),
                            ("noslash", "not a hub repository")]:
            with pytest.raises((ProbeError, hubfiles.HubError), match=reason):
                probe_hub(hub_options(["-hf", ref]))
        with pytest.raises(ProbeError, match="no file 'nope.gguf'"):
            probe_hub(hub_options(["-hf", "org/tiny", "-hff", "nope.gguf"]))
    monkeypatch.setenv("MODEL_ENDPOINT", "http://127.0.0.1:9/")  # nothing listens
    with pytest.raises(ProbeError, match="cannot be reached"):
        probe_hub(hub_options(["-hf", "org/tiny"]))


def test_llama_servers_spellings_and_nothing_in_llamas_cache(hub, repos):
    assert hub_options(["-c", "512"]) is None
    for args in (["-hf", "org/tiny", "-hff", "tiny-llama-Q8_0.gguf"], ["-hfr", "org/tiny:Q8_0"],
                 ["--hf-repo", "org/tiny:Q8_0"]):
        assert probe_hub(hub_options(args)).plan.model[0].path == "tiny-llama-Q8_0.gguf"
    assert probe_hub(hub_options(["-hf", "org/vision", "--no-mmproj"])).plan.mmproj is None
    draft = probe_hub(hub_options(["-hf", "org/tiny:F16", "-hfd", "org/vision:F16"]))
    assert [f.name for f in draft.plan.draft] == ["org/vision/tiny-llama-F16.gguf"]
    assert any(d.draft for d in draft.estimate.devices)
    assert not os.listdir(os.environ["LLAMA_CACHE"])  # llama.cpp's downloader never ran
    hub_dir = os.path.join(os.environ["PYLLMROUTER_CACHE"], "hub")
    assert not [p for p in os.listdir(hub_dir) if p.startswith("stand-ins")]  # the stand-ins are gone


def test_the_cli_probes_and_tables_a_hub_model(hub, capsys):
    assert main(["probe", "-hf", "org/tiny:F16", "-c", "512", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["spec"]["hub"] == "org/tiny:F16" and 0 < out["hub"]["bytes_read"] < out["hub"]["size"]
    assert main(["probe", "-hf", "org/tiny:F16"]) == 0
    assert "read from the hub" in capsys.readouterr().out
    assert main(["fit", "-hf", "org/tiny", "--table", "--json", "--contexts", "512,2048",
                 "--cache-types", "f16,q8_0", "--budget", "CPU=1030MiB"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {(r["quant"], r["n_ctx"], r["cache_type"]) for r in rows} == {
        (q, c, t) for q in ("F16", "Q4_0", "Q8_0") for c in (512, 2048) for t in ("f16", "q8_0")}
    assert {r["verdict"] for r in rows} <= {"fits", "fits moved", "never"}
    small = [r for r in rows if sum(r["per_device"].values()) <= 6 * 2**20]
    assert small and all(r["verdict"] == "fits" for r in small)
    assert [r["verdict"] for r in rows if sum(r["per_device"].values()) > 6 * 2**20] == \
        ["never"] * (len(rows) - len(small))
    assert main(["fit", "-hf", "org/big:Q4_0", "-c", "4096", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hub"]["files"] == ["org/big/shape-7b-Q4_0.gguf"]
    assert main(["probe", "-hf", "org/absent"]) == 2
    assert "org/absent: no such repository" in capsys.readouterr().err


def test_the_server_refuses_a_pull_that_can_never_fit(repos, local_hub):
    from pyllmrouter import NeverFits, Router
    from pyllmrouter.devices import EmulatedInventory
    from pyllmrouter.router.services.sources import Sources
    from pyllmrouter.server.api_errors import from_router_error

    with Router([], inventory=EmulatedInventory({"GPU0": 1 << 30}, host=2 << 30), margin=0,
                sources=Sources(cache=True)) as r:
        with pytest.raises(NeverFits) as e:
            r.pull("org/big:Q4_0")
        assert e.value.need > e.value.capacity and "nothing was downloaded" in str(e.value)
        assert r.status()["downloads"] == {}
        err = from_router_error(e.value)
        assert err.status == 507 and err.extra["needed_bytes"] == e.value.need
    assert local_hub.served["shape-7b-Q4_0.gguf"] <= 2 << 20  # of its 3.8 GiB
    assert not os.listdir(os.environ["LLAMA_CACHE"])
    shutil.rmtree(os.environ["PYLLMROUTER_CACHE"], ignore_errors=True)
