"""vendor/fetch.py: the build refuses a different llama-cpp-python and a tampered header."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture()
def fetch(monkeypatch):
    from conftest import USER_CACHE

    if USER_CACHE is None:
        monkeypatch.delenv("PYLLMROUTER_CACHE")
    else:
        monkeypatch.setenv("PYLLMROUTER_CACHE", USER_CACHE)
    spec = importlib.util.spec_from_file_location("fetch", ROOT / "vendor" / "fetch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_locate_accepts_the_pinned_version(fetch):
    version, site, libdir = fetch.locate().split(";")
    assert version == fetch.PIN["version"]
    assert pathlib.Path(libdir, "libllama.so").exists() or list(pathlib.Path(libdir).glob("libllama.so*"))


def test_locate_refuses_another_version(fetch, monkeypatch):
    monkeypatch.setattr(fetch.importlib.metadata, "version", lambda name: "0.3.99")
    with pytest.raises(SystemExit, match="built against llama-cpp-python 0.3.99, but this source pins 0.3.36"):
        fetch.locate()


def test_tampered_header_is_refused(fetch, monkeypatch, tmp_path):
    if not (fetch.cache_dir() / "sdist" / fetch.PIN["sdist"]).exists():
        pytest.skip("pinned sdist not in the cache")
    header = next(iter(fetch.PIN["headers"]))
    monkeypatch.setitem(fetch.PIN, "headers", {header: "0" * 64})
    with pytest.raises(SystemExit, match="pin.json expects 0000"):
        fetch.headers(tmp_path)


def test_pinned_header_extracts(fetch, tmp_path):
    if not (fetch.cache_dir() / "sdist" / fetch.PIN["sdist"]).exists():
        pytest.skip("pinned sdist not in the cache")
    fetch.headers(tmp_path)
    assert "llama_get_memory_breakdown" in (tmp_path / "llama-ext.h").read_text()
