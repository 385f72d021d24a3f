"""llama-server model presets (INI) and ``--models-dir`` scanning -> ModelConfigs.

A preset file is read as llama-server reads it: an optional ``version = 1``,
an optional ``[*]`` section of defaults, then one section per model. Keys are
long option names (``ctx-size``), short ones (``c``) or environment names
(``LLAMA_ARG_CTX_SIZE``).  Preset-only keys: ``load-on-startup``,
``stop-timeout``; ours: ``devices``, ``ttl``, ``persistent``, ``memory-margin``
(router-wide, in ``[*]``).  Keys that decide what a load allocates are read
into the ModelSpec (the probe measures them); every other key goes to the
model's engine as llama-server's router would pass it to a child (chat
template, reasoning format, sampling defaults...), turned into arguments and
checked by llama.cpp's own parser (``engine_args``).  An unknown key, or a bad
value, is a PresetError naming the file, the line and the key.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pyllmrouter.config import MiB, ModelConfig
from pyllmrouter.engine_args import ArgsError, resolve
from pyllmrouter.spec import FLASH_ATTN, KV_TYPES, SPLIT_MODES, ModelSpec, SpecError

__all__ = ["PresetError", "Preset", "read_preset", "scan_models_dir", "OPTIONS"]


class PresetError(ValueError):
    pass


def _bool(v: str) -> bool:
    low = v.strip().lower()
    if low in ("1", "true", "on", "yes", "enabled"):
        return True
    if low in ("0", "false", "off", "no", "disabled"):
        return False
    raise ValueError(f"expected a boolean (true/false), got {v!r}")


def _choice(choices) -> Callable[[str], str]:
    def parse(v: str) -> str:
        if v not in choices:
            raise ValueError(f"expected one of {', '.join(sorted(choices))}, got {v!r}")
        return v
    return parse


def _flash(v: str) -> str:
    low = v.strip().lower()
    low = {"true": "on", "1": "on", "false": "off", "0": "off"}.get(low, low)
    return _choice(FLASH_ATTN)(low)


def _layers(v: str) -> int:
    return -1 if v.strip().lower() in ("all", "auto", "-1") else int(v)


def _floats(v: str) -> tuple[float, ...]:
    return tuple(float(x) for x in re.split(r"[,/]", v) if x.strip())


def _names(v: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in v.split(",") if x.strip())


def _scaled(v: str) -> tuple[tuple[str, float], ...]:
    """llama-server's --lora-scaled: FNAME:SCALE,..."""
    out = []
    for item in _names(v):
        path, sep, scale = item.rpartition(":")
        if not sep or not path:
            raise ValueError(f"{item!r}: expected FNAME:SCALE")
        out.append((path, float(scale)))
    return tuple(out)


_POOLING = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}


@dataclass(frozen=True)
class Option:
    names: tuple[str, ...]
    env: str | None
    target: str  # "spec.<field>", "config.<field>", "router.<name>"
    parse: Callable[[str], Any]


OPTIONS: tuple[Option, ...] = (
    Option(("model", "m"), "LLAMA_ARG_MODEL", "spec.path", str),
    Option(("alias", "a"), "LLAMA_ARG_ALIAS", "config.aliases", _names),
    Option(("ctx-size", "c"), "LLAMA_ARG_CTX_SIZE", "spec.n_ctx", int),
    Option(("batch-size", "b"), "LLAMA_ARG_BATCH", "spec.n_batch", int),
    Option(("ubatch-size", "ub"), "LLAMA_ARG_UBATCH", "spec.n_ubatch", int),
    Option(("parallel", "np"), "LLAMA_ARG_N_PARALLEL", "spec.n_seq_max", int),
    Option(("kv-unified", "kvu"), "LLAMA_ARG_KV_UNIFIED", "spec.kv_unified", _bool),
    Option(("n-gpu-layers", "gpu-layers", "ngl"), "LLAMA_ARG_N_GPU_LAYERS", "spec.n_gpu_layers", _layers),
    Option(("split-mode", "sm"), "LLAMA_ARG_SPLIT_MODE", "spec.split_mode", _choice(SPLIT_MODES)),
    Option(("main-gpu", "mg"), "LLAMA_ARG_MAIN_GPU", "spec.main_gpu", int),
    Option(("tensor-split", "ts"), "LLAMA_ARG_TENSOR_SPLIT", "spec.tensor_split", _floats),
    Option(("cache-type-k", "ctk"), "LLAMA_ARG_CACHE_TYPE_K", "spec.type_k", _choice(KV_TYPES)),
    Option(("cache-type-v", "ctv"), "LLAMA_ARG_CACHE_TYPE_V", "spec.type_v", _choice(KV_TYPES)),
    Option(("flash-attn", "fa"), "LLAMA_ARG_FLASH_ATTN", "spec.flash_attn", _flash),
    Option(("embedding", "embeddings"), "LLAMA_ARG_EMBEDDINGS", "spec.embedding", _bool),
    Option(("pooling",), "LLAMA_ARG_POOLING", "spec.pooling", lambda v: _POOLING[_choice(_POOLING)(v)]),
    Option(("cpu-moe", "cmoe"), "LLAMA_ARG_CPU_MOE", "spec.cpu_moe", _bool),
    Option(("n-cpu-moe", "ncmoe"), "LLAMA_ARG_N_CPU_MOE", "spec.n_cpu_moe", int),
    Option(("kv-offload",), "LLAMA_ARG_KV_OFFLOAD", "spec.offload_kqv", _bool),
    Option(("no-kv-offload", "nkvo"), None, "spec.offload_kqv", lambda v: not _bool(v)),
    Option(("mmap",), None, "spec.use_mmap", _bool),
    Option(("no-mmap",), None, "spec.use_mmap", lambda v: not _bool(v)),
    Option(("swa-full",), "LLAMA_ARG_SWA_FULL", "spec.swa_full", _bool),
    Option(("fit",), "LLAMA_ARG_FIT", "spec.fit", _bool),
    Option(("cache-ram", "cram"), "LLAMA_ARG_CACHE_RAM", "spec.cache_ram", int),
    Option(("mmproj", "mm"), "LLAMA_ARG_MMPROJ", "spec.mmproj", str),
    Option(("mmproj-offload",), "LLAMA_ARG_MMPROJ_OFFLOAD", "spec.mmproj_offload", _bool),
    Option(("no-mmproj-offload",), None, "spec.mmproj_offload", lambda v: not _bool(v)),
    Option(("image-min-tokens",), "LLAMA_ARG_IMAGE_MIN_TOKENS", "spec.image_min_tokens", int),
    Option(("image-max-tokens",), "LLAMA_ARG_IMAGE_MAX_TOKENS", "spec.image_max_tokens", int),
    Option(("spec-draft-model", "model-draft", "md"), "LLAMA_ARG_SPEC_DRAFT_MODEL", "spec.draft", str),
    Option(("spec-draft-ngl", "gpu-layers-draft", "n-gpu-layers-draft", "ngld"), "LLAMA_ARG_N_GPU_LAYERS_DRAFT",
           "spec.draft_n_gpu_layers", _layers),
    Option(("spec-draft-type-k", "cache-type-k-draft", "ctkd"), "LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K",
           "spec.draft_type_k", _choice(KV_TYPES)),
    Option(("spec-draft-type-v", "cache-type-v-draft", "ctvd"), "LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V",
           "spec.draft_type_v", _choice(KV_TYPES)),
    Option(("spec-draft-n-max",), "LLAMA_ARG_SPEC_DRAFT_N_MAX", "spec.draft_n_max", int),
    Option(("spec-draft-device", "device-draft", "devd"), None, "spec.draft_devices", _names),
    Option(("spec-type",), "LLAMA_ARG_SPEC_TYPE", "spec.spec_type", str),
    Option(("lora",), None, "spec.lora", lambda v: tuple((p, 1.0) for p in _names(v))),
    Option(("lora-scaled",), None, "spec.lora", _scaled),
    Option(("threads", "t"), "LLAMA_ARG_THREADS", "spec.n_threads", int),
    Option(("threads-batch", "tb"), None, "spec.n_threads_batch", int),
    Option(("device", "dev", "devices"), "LLAMA_ARG_DEVICE", "config.devices", _names),
    Option(("load-on-startup",), None, "config.load_on_startup", _bool),
    Option(("stop-timeout",), None, "config.stop_timeout", float),
    Option(("ttl",), None, "config.ttl", float),
    Option(("persistent",), None, "config.persistent", _bool),
    Option(("memory-margin", "models-memory-margin"), None, "router.margin", lambda v: int(float(v) * MiB)),
)

_BY_NAME = {n: o for o in OPTIONS for n in o.names} | {o.env: o for o in OPTIONS if o.env}


@dataclass
class Preset:
    models: list[ModelConfig]
    router: dict[str, Any] = field(default_factory=dict)  # router-wide options (margin)


def _option(key: str) -> Option | None:
    k = key.strip()
    return _BY_NAME.get(k) or _BY_NAME.get(k.lstrip("-"))


def _lines(path: Path):
    """(line number, section or None, key, value) for every setting; sections as (n, name, None, None)."""
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in ";#":
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


def read_preset(path: os.PathLike | str, defaults: dict[str, Any] | None = None) -> Preset:
    """Parse a llama-server preset file; relative model paths are relative to the CWD."""
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
    base = _apply(path, glob, defaults or {}, preset, where="[*]")
    engine_keys = []
    for name in (s for s in order if s != "*"):
        fields = _apply(path, sections[name], dict(base), preset, where=f"[{name}]")
        cfg = _config(path, name, fields, preset)
        preset.models.append(cfg)
        keys = [(v[1], v[2], v[0]) for t, v in fields.items() if t.startswith("engine.")]
        if keys:
            engine_keys.append((name, cfg.spec.to_args(), keys))
    try:
        args = resolve(engine_keys)
    except ArgsError as e:
        raise PresetError(f"{path}:{e.line}: {e}") from None
    preset.models = [dataclasses.replace(c, args=tuple(args.get(c.name, ()))) for c in preset.models]
    return preset


def _apply(path: Path, items, fields: dict[str, Any], preset: Preset, where: str) -> dict[str, Any]:
    for n, key, value in items:
        opt = _option(key)
        if opt is None:  # llama-server's: checked by llama.cpp (engine_args)
            if key != "version":
                fields[f"engine.{key.lstrip('-')}"] = (n, key.lstrip("-"), value)
            continue
        try:
            parsed = opt.parse(value)
        except (ValueError, KeyError) as e:
            raise PresetError(f"{path}:{n}: key {key!r}: {e}") from None
        if opt.target.startswith("router."):
            if where != "[*]":
                raise PresetError(f"{path}:{n}: key {key!r} applies to the whole router: put it in [*]")
            preset.router[opt.target[7:]] = parsed
            continue
        fields[opt.target] = (n, key, parsed)
    return fields


def _config(path: Path, name: str, fields: dict[str, Any], preset: Preset) -> ModelConfig:
    if "spec.path" not in fields:
        raise PresetError(f"{path}: [{name}]: no 'model' key: give the GGUF path (model = /path/to/file.gguf)")
    spec_kw = {t[5:]: v[2] for t, v in fields.items() if t.startswith("spec.")}
    cfg_kw = {t[7:]: v[2] for t, v in fields.items() if t.startswith("config.")}
    try:
        spec = ModelSpec(**spec_kw)
    except SpecError as e:
        field_name = str(e).split("=", 1)[0]
        line, key = next(((v[0], v[1]) for t, v in fields.items() if t == f"spec.{field_name}"), (0, field_name))
        raise PresetError(f"{path}:{line}: key {key!r} in [{name}]: {e}") from None
    try:
        return ModelConfig(name=name, spec=spec, **cfg_kw)
    except ValueError as e:
        raise PresetError(f"{path}: [{name}]: {e}") from None


_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def _companion(name: str) -> bool:
    """A projector (any name containing "mmproj") or a draft sidecar (mtp-, dspark-,
    dflash-): llama-server's models-dir never loads these as models."""
    return "mmproj" in name or name.startswith(("mtp-", "dspark-", "dflash-"))


def scan_models_dir(directory: os.PathLike | str, spec_defaults: dict[str, Any] | None = None) -> list[ModelConfig]:
    """llama-server's --models-dir rules: each top-level .gguf file is a model named
    by its stem; each subdirectory is a model named by the directory, holding one
    GGUF (or the shards of one, loaded by the first) plus optionally a projector
    (a file whose name contains "mmproj": the model's ``mmproj``)."""
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
            out.append(ModelConfig(name, ModelSpec(entry, **(spec_defaults or {}))))
        elif entry.is_dir():
            ggufs = sorted(p for p in entry.glob("*.gguf") if not _companion(p.name))
            firsts = [p for p in ggufs if not _SHARD.search(p.name) or _SHARD.search(p.name).group(1) == "00001"]
            projectors = sorted(p for p in entry.glob("*.gguf") if "mmproj" in p.name)
            if len(firsts) == 1:
                extra = {"mmproj": str(projectors[-1])} if projectors else {}
                out.append(ModelConfig(entry.name, ModelSpec(firsts[0], **{**(spec_defaults or {}), **extra})))
    return out
