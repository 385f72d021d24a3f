"""Shared fixtures: tiny real GGUF models and an isolated probe cache."""

from __future__ import annotations

import os

import pytest

from pyllmrouter import tinymodels


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict:
    """The three tiny models (llama, qwen3moe, bert), written once per session."""
    return tinymodels.write_tiny_set(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def shape7b(tmp_path_factory):
    """A sparse file with the full layout of a 7B Q4_0 llama."""
    return tinymodels.write_shape(tmp_path_factory.mktemp("shape") / "shape-7b.gguf", tinymodels.SHAPE_7B)


# the cache the project's own setup filled (the pinned sdist lives there)
USER_CACHE = os.environ.get("PYLLMROUTER_CACHE")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Every test probes into its own cache directory."""
    monkeypatch.setenv("PYLLMROUTER_CACHE", str(tmp_path / "cache"))
