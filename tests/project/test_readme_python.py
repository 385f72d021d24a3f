"""The README's Python section, run as a user runs it: its code blocks as written (the
model files they name are small generated ones), then every claim its comments make."""

from __future__ import annotations

import asyncio
import re
import shutil
from pathlib import Path

import pytest

from pyllmrouter import Router

README = Path(__file__).resolve().parents[2] / "README.md"


def blocks() -> list[str]:
    text = README.read_text()
    section = text[text.index("## Python API"):]
    section = section[:section.index("\n## ", 5)]
    return re.findall(r"```python\n(.*?)```", section, re.S)


@pytest.fixture
def files(tmp_path, monkeypatch, tiny):
    for name in ("chat.gguf", "coder.gguf", "model.gguf"):
        shutil.copy(tiny["tiny-llama"], tmp_path / name)
    shutil.copy(tiny["tiny-bert"], tmp_path / "bge.gguf")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_readme_has_its_python_blocks():
    found = blocks()
    assert len(found) == 3, [b[:60] for b in found]
    assert "with Router(" in found[0] and "async def main(router)" in found[1] and "probe(spec)" in found[2]


def test_the_python_api_block_runs_and_says_true(files, monkeypatch):
    kept: list[Router] = []
    monkeypatch.setattr(Router, "__exit__", lambda self, *exc: kept.append(self))  # read what it made
    ns: dict = {}
    try:
        exec(compile(blocks()[0], "README.md", "exec"), ns)
        router = kept[0]
        assert isinstance(ns["reply"].json()["prompt"], str)  # the last `reply`: call()'s HttpReply
        ids = ns["ids"]
        assert ids and all(isinstance(i, int) for i in ids)
        assert router.detokenize("chat", ids) == " hi"  # a SentencePiece vocabulary's leading space
        for device in router.status()["devices"].values():
            assert {"total", "free", "held", "available", "margin"} <= set(device)
        names = {m.name for m in router.models()}
        assert "code" in names and "chat" in names
        assert "embed" not in names or router.status()["models"]["embed"]["state"] in ("unloading", "removing")
        # the awaited forms, as the second block writes them
        exec(compile(blocks()[1], "README.md", "exec"), ns)
        asyncio.run(ns["main"](router))
    finally:
        for r in kept:
            r.close()


def test_the_probe_block_runs_and_says_true(files):
    ns: dict = {}
    exec(compile(blocks()[2], "README.md", "exec"), ns)
    assert ns["est"].per_device() and all(v > 0 for v in ns["est"].per_device().values())
