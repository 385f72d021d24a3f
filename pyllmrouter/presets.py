"""llama-server model presets (INI) and ``--models-dir`` scanning -> ModelConfigs.

A preset file is read as llama-server reads it: an optional ``version = 1``,
an optional ``[*]`` section of defaults, then one section per model.  Keys are
llama-server's: long option names (``ctx-size``), short ones (``c``) or
environment names (``LLAMA_ARG_CTX_SIZE``), with llama-server's preset-only keys
``load-on-startup``, ``stop-timeout`` and ``dedup-cache-models``; ours are ``devices``, ``ttl``,
``persistent``, ``priority``, ``max-queue``, ``replicas`` and ``memory-margin`` (router-wide, in ``[*]``).  Every
llama-server key becomes the model's llama-server arguments, as llama-server's
router passes them to a child, and is checked by llama.cpp's own parser
(``engine_args``), in a process that sees no GPU: there is no option table here.
The model file, its aliases and its devices come back out of them (the router
routes by aliases, and masks and renames devices).  An unknown key, or a bad
value, is a PresetError naming the file, the line and the key.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pyllmrouter.config import MiB, ModelConfig
from pyllmrouter.engine_args import ArgsError, resolve
from pyllmrouter.spec import ModelSpec, SpecError

__all__ = ["PresetError", "Preset", "read_preset", "scan_models_dir"]


class PresetError(ValueError):
    pass


def _bool(v: str) -> bool:
    low = v.strip().lower()
    if low in ("1", "true", "on", "yes", "enabled"):
        return True
    if low in ("0", "false", "off", "no", "disabled"):
        return False
    raise ValueError(f"expected a boolean (true/false), got {v!r}")


def _limit(v: str) -> int:
    n = int(v)
    if n < 1:
        raise ValueError(f"expected a number of requests of at least 1, got {v!r}")
    return n


def _names(v: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in v.split(",") if x.strip())


_COMMENT = re.compile(r"[;#]")

# the router's own keys (and llama-server's preset-only ones, which its router handles
# itself): key -> (where it goes, how its value reads)
_OURS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "devices": ("config.devices", _names),
    "load-on-startup": ("config.load_on_startup", _bool),
    "dedup-cache-models": ("preset.dedup", _bool),
    "stop-timeout": ("config.stop_timeout", float),
    "ttl": ("config.ttl", float),
    "persistent": ("config.persistent", _bool),
    "priority": ("config.priority", int),
    "max-queue": ("config.max_queue", _limit),
    "replicas": ("config.replicas", _limit),
    "memory-margin": ("router.margin", lambda v: int(float(v) * MiB)),
    "models-memory-margin": ("router.margin", lambda v: int(float(v) * MiB)),
}


@dataclass
class Preset:
    models: list[ModelConfig]
    router: dict[str, Any] = field(default_factory=dict)  # router-wide options (margin)
    # files of llama.cpp's cache that models with dedup-cache-models use (model and draft):
    # the cache models of those files are not listed, as llama-server's router hides them
    dedup: frozenset[str] = frozenset()


def _lines(path: Path):
    """(line number, section or None, key, value) for every setting; sections as (n, name, None, None).
    As llama.cpp's INI grammar (common/preset.cpp): a ';' or '#' ends a line's value (a comment)."""
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = _COMMENT.split(raw, 1)[0].strip()
        if not line:
            continue
        if line.startswith("["):
            if not line.endswith("]") or len(line) < 3:
                raise PresetError(f"{path}:{n}: malformed section header {line!r}")
            yield n, line[1:-1].strip(), None, None
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise PresetError(f"{path}:{n}: expected 'key = value', got {line!r}")
        yield n, None, key.strip(), value.strip().strip('"')


def read_preset(path: os.PathLike | str, base_args: tuple[str, ...] = ()) -> Preset:
    """Parse a llama-server preset file; relative model paths are relative to the CWD.
    ``base_args``: llama-server arguments laid over every model (the router's command line)."""
    path = Path(path)
    if not path.is_file():
        raise PresetError(f"{path}: preset file not found")
    sections: dict[str, list[tuple[int, str, str]]] = {}
    order: list[str] = []
    current: str | None = None
    for n, section, key, value in _lines(path):
        if section is not None:
            if section in sections:
                raise PresetError(f"{path}:{n}: section [{section}] appears twice")
            current = section
            sections[section] = []
            order.append(section)
            continue
        if current is None:
            if key != "version":
                raise PresetError(f"{path}:{n}: key {key!r} outside a section (only 'version' may be)")
            continue
        sections[current].append((n, key, value))
    glob = sections.pop("*", [])
    preset = Preset([])
    ours_glob, engine_glob = _split(path, glob, preset, where="[*]")
    ours: dict[str, dict[str, Any]] = {}
    engine: list[tuple[str, list[tuple[str, str, int]]]] = []
    for name in (s for s in order if s != "*"):
        mine, keys = _split(path, sections[name], preset, where=f"[{name}]")
        ours[name] = {**ours_glob, **mine}
        engine.append((name, engine_glob + keys))  # the section's after [*]'s: they win
    try:
        split = resolve(engine, base_args)
    except ArgsError as e:
        raise PresetError(f"{path}:{e.line}: {e}") from None
    dedup: set[str] = set()
    for name, _keys in engine:
        if ours[name].pop("dedup", False):
            dedup.update(split[name]["hf_paths"])
        preset.models.append(_config(path, name, split[name], ours[name]))
    preset.dedup = frozenset(dedup)
    return preset


def _split(path: Path, items, preset: Preset, where: str) -> tuple[dict[str, Any], list[tuple[str, str, int]]]:
    """A section's keys: ours, read (config field -> value), and llama-server's, as given."""
    mine: dict[str, Any] = {}
    keys: list[tuple[str, str, int]] = []
    for n, key, value in items:
        bare = key.strip().lstrip("-")
        if bare == "version":
            continue
        if bare not in _OURS:
            keys.append((bare, value, n))
            continue
        target, parse = _OURS[bare]
        try:
            parsed = parse(value)
        except ValueError as e:
            raise PresetError(f"{path}:{n}: key {key!r}: {e}") from None
        if target.startswith("preset."):  # llama-server's router reads it per model, [*] included
            mine[target[7:]] = parsed
        elif target.startswith("router."):
            if where != "[*]":
                raise PresetError(f"{path}:{n}: key {key!r} applies to the whole router: put it in [*]")
            preset.router[target[7:]] = parsed
        else:
            mine[target[7:]] = parsed
    return mine, keys


def _config(path: Path, name: str, split: dict[str, Any], ours: dict[str, Any]) -> ModelConfig:
    devices = ours.pop("devices", None) or (tuple(split["devices"]) if split["devices"] is not None else None)
    try:
        spec = ModelSpec(split["model"], tuple(split["args"]),
                         draft_devices=tuple(split["draft_devices"]) if split["draft_devices"] is not None else None)
        aliases = tuple(a for a in split["aliases"] if a != name)  # the name itself is no alias
        return ModelConfig(name=name, spec=spec, aliases=aliases, devices=devices, **ours)
    except (SpecError, ValueError) as e:
        raise PresetError(f"{path}: [{name}]: {e}") from None


_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def _companion(name: str) -> bool:
    """A projector (any name containing "mmproj") or a draft sidecar (mtp-, dspark-,
    dflash-): llama-server's models-dir never loads these as models."""
    return "mmproj" in name or name.startswith(("mtp-", "dspark-", "dflash-"))


def scan_models_dir(directory: os.PathLike | str, args: tuple[str, ...] = ()) -> list[ModelConfig]:
    """llama-server's --models-dir rules: each top-level .gguf file is a model named
    by its stem; each subdirectory is a model named by the directory, holding one
    GGUF (or the shards of one, loaded by the first) plus optionally a projector
    (a file whose name contains "mmproj": the model's ``--mmproj``).  ``args``: llama-server
    arguments for every model."""
    directory = Path(directory)
    if not directory.is_dir():
        raise PresetError(f"{directory}: models directory not found")
    out = []
    for entry in sorted(directory.iterdir()):
        if entry.is_file() and entry.suffix == ".gguf" and not _companion(entry.name):
            m = _SHARD.search(entry.name)
            if m and m.group(1) != "00001":
                continue
            name = entry.name[: m.start()] if m else entry.stem
            out.append(ModelConfig(name, ModelSpec(entry, args)))
        elif entry.is_dir():
            ggufs = sorted(p for p in entry.glob("*.gguf") if not _companion(p.name))
            firsts = [p for p in ggufs if not _SHARD.search(p.name) or _SHARD.search(p.name).group(1) == "00001"]
            projectors = sorted(p for p in entry.glob("*.gguf") if "mmproj" in p.name)
            if len(firsts) == 1:
                extra = ("--mmproj", str(projectors[-1])) if projectors else ()
                out.append(ModelConfig(entry.name, ModelSpec(firsts[0], (*extra, *args))))
    return out
