"""ModelSpec: the one description of a model load, shared by probe and loader.

A spec is plain data (no llama.cpp import), so the router process can hold,
hash and compare specs without touching a GPU backend.  ``params.py`` turns a
spec into the llama.cpp parameter structs; the probe and the loader both use
that one conversion, so the bytes probed are the bytes loaded.

Defaults follow llama-server rather than llama_cpp.Llama: all layers on the
GPU, flash attention ``auto``, n_batch 2048, n_ubatch 512, n_ctx 4096, four
parallel sequences sharing a unified KV cache.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelSpec", "SpecError", "KV_TYPES", "SPLIT_MODES", "FLASH_ATTN"]

# ggml_type ids of the cache types llama.cpp accepts for K and V
KV_TYPES = {
    "f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8,
    "iq4_nl": 20, "bf16": 30,
}
# enum llama_split_mode
SPLIT_MODES = {"none": 0, "layer": 1, "row": 2}
# enum llama_flash_attn_type
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}


class SpecError(ValueError):
    """A spec field has an impossible value; the message names the field."""


@dataclass(frozen=True)
class ModelSpec:
    """Everything that decides what loading ``path`` allocates, and where."""

    path: str
    n_ctx: int = 4096  # 0: the model's training context
    n_batch: int = 2048
    n_ubatch: int = 512
    n_seq_max: int = 4  # parallel sequences (llama-server --parallel); 1 for embedding models
    kv_unified: bool = True  # one KV buffer of n_ctx cells shared by the sequences (llama-server's default)
    n_gpu_layers: int = -1  # -1: every layer
    split_mode: str = "layer"
    main_gpu: int = 0
    tensor_split: tuple[float, ...] | None = None
    devices: tuple[str, ...] | None = None  # ggml device names; None: all visible
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: str = "auto"
    offload_kqv: bool = True
    op_offload: bool = True
    swa_full: bool = True
    embedding: bool = False
    pooling: int = -1  # enum llama_pooling_type; -1: from the model
    n_cpu_moe: int = 0  # keep the experts of the first N layers in host memory
    cpu_moe: bool = False  # keep every expert tensor in host memory
    tensor_overrides: tuple[tuple[str, str], ...] = ()  # (regex, buffer type) pairs
    fit: bool = True  # the router may move layers / MoE experts to the host to fit a device (llama-server --fit)
    use_mmap: bool = True
    # host prompt cache cap in MiB (llama-server's --cache-ram), counted as host memory at
    # its cap; 0 (ours by default, llama-server's is 8192 per model) keeps it off
    cache_ram: int = 0
    # multimodal projector GGUF (llama-server --mmproj): counted per device as llama.cpp
    # counts it (weights and a warm-up image's compute), on the model's first GPU unless
    # mmproj_offload is off (then in host memory)
    mmproj: str | None = None
    mmproj_offload: bool = True
    image_min_tokens: int = -1  # -1: the projector's own
    image_max_tokens: int = -1
    # a draft model for speculative decoding (llama-server --spec-draft-model), counted
    # with its own context (as long as the model's) where the engine puts it
    draft: str | None = None
    draft_n_gpu_layers: int = -1  # -1: every layer
    draft_type_k: str = "f16"
    draft_type_v: str = "f16"
    draft_n_max: int = -1  # tokens drafted per step (-1: llama.cpp's default); sizes the output buffers
    draft_devices: tuple[str, ...] | None = None  # the draft's devices (llama-server -devd; None: the model's)
    spec_type: str | None = None  # llama-server --spec-type (e.g. "draft-simple"): sizes the output buffers
    # LoRA adapters loaded with the model (llama-server --lora-scaled): (file, scale) pairs,
    # each adapter counted on the buffer types of the tensors it adapts
    lora: tuple[tuple[str, float], ...] = ()
    n_threads: int | None = None
    n_threads_batch: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", os.fspath(self.path))
        for name in ("mmproj", "draft"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        for name in ("tensor_split", "devices", "draft_devices"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))
        if not isinstance(self.tensor_overrides, tuple):
            object.__setattr__(self, "tensor_overrides", tuple(tuple(p) for p in self.tensor_overrides))
        object.__setattr__(self, "lora", tuple((os.fspath(p), float(s)) for p, s in self.lora))
        self.validate()

    def validate(self) -> None:
        def need(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise SpecError(f"{name}={getattr(self, name)!r}: {why}")

        need(self.n_ctx >= 0, "n_ctx", "must be >= 0 (0 = the model's training context)")
        need(self.n_batch >= 1, "n_batch", "must be >= 1")
        need(self.n_ubatch >= 1, "n_ubatch", "must be >= 1")
        need(1 <= self.n_seq_max <= 256, "n_seq_max", "must be between 1 and 256")
        need(self.n_gpu_layers >= -1, "n_gpu_layers", "must be >= -1 (-1 = all layers)")
        need(self.split_mode in SPLIT_MODES, "split_mode", f"must be one of {sorted(SPLIT_MODES)}")
        need(self.type_k in KV_TYPES, "type_k", f"must be one of {sorted(KV_TYPES)}")
        need(self.type_v in KV_TYPES, "type_v", f"must be one of {sorted(KV_TYPES)}")
        need(self.flash_attn in FLASH_ATTN, "flash_attn", f"must be one of {sorted(FLASH_ATTN)}")
        need(self.n_cpu_moe >= 0, "n_cpu_moe", "must be >= 0")
        need(self.main_gpu >= 0, "main_gpu", "must be >= 0")
        need(self.draft_n_gpu_layers >= -1, "draft_n_gpu_layers", "must be >= -1 (-1 = all layers)")
        need(self.draft_type_k in KV_TYPES, "draft_type_k", f"must be one of {sorted(KV_TYPES)}")
        need(self.draft_type_v in KV_TYPES, "draft_type_v", f"must be one of {sorted(KV_TYPES)}")
        need(self.draft_n_max >= -1, "draft_n_max", "must be >= -1 (-1 = llama.cpp's default)")
        need(all("," not in p and ":" not in p for p, _ in self.lora), "lora",
             "a LoRA file name may not contain ',' or ':' (llama.cpp's list separators)")
        need(self.cache_ram >= 0, "cache_ram",
             "must be >= 0 MiB: an unlimited prompt cache (-1) cannot be admitted; give its cap in MiB")
        if self.tensor_split is not None:
            need(all(x >= 0 for x in self.tensor_split) and sum(self.tensor_split) > 0,
                 "tensor_split", "needs non-negative proportions with a positive sum")

    def to_args(self) -> list[str]:
        """The spec as llama-server arguments: what the engine's llama.cpp parser is
        given, so that the engine allocates what the probe of this spec measured.
        llama.cpp's own fit is off: the router fits (and hands over the result)."""
        a = ["-m", self.path, "-c", str(self.n_ctx), "-b", str(self.n_batch), "-ub", str(self.n_ubatch),
             "-np", str(self.n_seq_max), "--kv-unified" if self.kv_unified else "--no-kv-unified",
             "-ngl", "all" if self.n_gpu_layers < 0 else str(self.n_gpu_layers),
             "-sm", self.split_mode, "-mg", str(self.main_gpu), "-ctk", self.type_k, "-ctv", self.type_v,
             "-fa", self.flash_attn, "-lm", "mmap" if self.use_mmap else "none", "--fit", "off",
             "--cache-ram", str(self.cache_ram)]
        if self.tensor_split is not None:
            a += ["-ts", ",".join(f"{x:g}" for x in self.tensor_split)]
        if self.devices is not None:
            a += ["-dev", ",".join(self.devices) if self.devices else "none"]
        if not self.offload_kqv:
            a.append("--no-kv-offload")
        if not self.op_offload:
            a.append("--no-op-offload")
        if self.swa_full:
            a.append("--swa-full")
        if self.embedding:
            a.append("--embedding")
        if self.pooling >= 0:
            a += ["--pooling", ("none", "mean", "cls", "last", "rank")[self.pooling]]
        if self.tensor_overrides:  # before the MoE rules: llama.cpp takes the first pattern that matches
            a += ["-ot", ",".join(f"{pattern}={buft}" for pattern, buft in self.tensor_overrides)]
        if self.cpu_moe:
            a.append("--cpu-moe")
        if self.n_cpu_moe:
            a += ["--n-cpu-moe", str(self.n_cpu_moe)]
        if self.mmproj is not None:
            a += ["--mmproj", self.mmproj]
            if not self.mmproj_offload:
                a.append("--no-mmproj-offload")
            if self.image_min_tokens >= 0:
                a += ["--image-min-tokens", str(self.image_min_tokens)]
            if self.image_max_tokens >= 0:
                a += ["--image-max-tokens", str(self.image_max_tokens)]
        if self.draft is not None:
            a += ["-md", self.draft, "-ngld", "all" if self.draft_n_gpu_layers < 0 else str(self.draft_n_gpu_layers),
                  "-ctkd", self.draft_type_k, "-ctvd", self.draft_type_v]
            if self.draft_devices is not None:
                a += ["-devd", ",".join(self.draft_devices) if self.draft_devices else "none"]
        if self.draft_n_max >= 0:
            a += ["--spec-draft-n-max", str(self.draft_n_max)]
        if self.spec_type:
            a += ["--spec-type", self.spec_type]
        if self.lora:
            a += ["--lora-scaled", ",".join(f"{p}:{s:g}" for p, s in self.lora)]
        if self.n_threads is not None:
            a += ["-t", str(self.n_threads)]
        if self.n_threads_batch is not None:
            a += ["-tb", str(self.n_threads_batch)]
        return a

    def replace(self, **changes: Any) -> "ModelSpec":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelSpec":
        return cls(**d)

