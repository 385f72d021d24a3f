"""Where the models come from, read again on demand: a llama-server preset file, a
models directory, and llama.cpp's cache of downloads (what ``-hf`` and ``POST /models``
put there), as llama-server's router reads them.

    read() ──▶ the sources' ModelConfigs, each with its source; a name listed by several
               takes the highest: cache < models_dir < preset (llama-server's order); a
               cache model whose file a preset with dedup-cache-models uses is hidden
               (served, not listed), as llama-server's router hides it
           ──▶ the preset's router-wide options (memory-margin)
    stamp() ──▶ what changes when a source changes (modification times, listings): the
               watcher (--watch) reads the sources again when it moves

Reading a preset checks its keys, and listing the cache asks llama.cpp, both in a
short-lived process (engine_args.py): the router process loads no llama.cpp.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pyllmrouter.config import ModelConfig
from pyllmrouter.engine_args import cached_models, model_base_args
from pyllmrouter.presets import read_preset, scan_models_dir
from pyllmrouter.spec import ModelSpec

__all__ = ["Sources"]

PRESET, MODELS_DIR, CACHE = "preset", "models_dir", "cache"


def _with_source(cfg: ModelConfig, source: str) -> ModelConfig:
    return dataclasses.replace(cfg, source=source)


class Sources:
    def __init__(self, preset: str | None = None, models_dir: str | None = None, cache: bool = False,
                 base_args: tuple[str, ...] = ()):
        """``cache``: list llama.cpp's cache of downloads, as llama-server's router does;
        ``base_args``: llama-server arguments laid over every model (the router's own command
        line, as llama-server's router lays its own over every child's)."""
        self.preset, self.models_dir, self.cache = preset, models_dir, cache
        # what llama-server's router lays over a child: its command line without the
        # router's own options (API keys and key files, TLS, model sources...), which no
        # model gets and GET /models does not show
        self.base_args = model_base_args(base_args)
        self._cache_dir: Path | None = None  # where llama.cpp said its cache is, when it was listed

    def read(self) -> tuple[list[ModelConfig], dict[str, Any]]:
        """The models the sources list now, and the preset's router-wide options;
        PresetError for a bad preset (the cache, listed meanwhile, left unread)."""
        by_name: dict[str, ModelConfig] = {}
        router: dict[str, Any] = {}
        with ThreadPoolExecutor(1) as pool:  # the two checking processes side by side
            listing = pool.submit(cached_models) if self.cache else None
            preset = read_preset(self.preset, self.base_args) if self.preset else None
            cache = listing.result() if listing is not None else None
        dedup = preset.dedup if preset is not None else frozenset()
        if cache is not None:
            where, models = cache
            self._cache_dir = Path(where)
            for m in models:
                if m["path"] and not m["error"]:
                    args = ("--mmproj", m["mmproj"]) if m["mmproj"] else ()
                    by_name[m["name"]] = ModelConfig(m["name"], ModelSpec(m["path"], (*args, *self.base_args)),
                                                     source=CACHE, hidden=m["path"] in dedup)
        if self.models_dir:
            for cfg in scan_models_dir(self.models_dir, self.base_args):
                by_name[cfg.name] = _with_source(cfg, MODELS_DIR)
        if preset is not None:
            router.update(preset.router)
            for cfg in preset.models:
                by_name[cfg.name] = _with_source(cfg, PRESET)
        return list(by_name.values()), router

    def stamp(self) -> tuple:
        """Modification times and listings of the sources (changes when one changes)."""
        def mtimes(path: Path, depth: int) -> tuple:
            try:
                st = path.stat()
            except OSError:
                return (str(path), None)
            if depth == 0 or not path.is_dir():
                return (str(path), st.st_mtime_ns, st.st_size)
            return (str(path), st.st_mtime_ns, tuple(mtimes(p, depth - 1) for p in sorted(path.iterdir())))

        parts: list[tuple] = []
        if self.preset:
            parts.append(mtimes(Path(self.preset), 0))
        if self.models_dir:
            parts.append(mtimes(Path(self.models_dir), 2))
        if self.cache and self._cache_dir is not None:
            parts.append(mtimes(self._cache_dir, 1))
        return tuple(parts)

    def __bool__(self) -> bool:
        return bool(self.preset or self.models_dir or self.cache)
