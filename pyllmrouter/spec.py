"""ModelSpec: the one description of a model load, shared by probe and loader.

A spec is a GGUF file and llama-server's arguments for it, exactly as a user
gives them to llama-server (a command line, or a preset's keys as llama-server's
router turns them into a child's arguments).  What they mean is llama.cpp's to
say: the probe and the engine parse ``to_args()`` with llama.cpp's own parser and
llama-server's own rules (``_native.server_params`` reads the result back), so
no default or option table is restated here.

On top of the arguments come the few settings the router itself decides (its fit:
layers, tensor split, experts and parts in host memory, a shrunk context; its
placement: a draft's devices), as typed fields; ``None`` leaves a setting to the
arguments.  They go after the arguments, where llama.cpp's parser lets the last
value win.  The spec is plain data (no llama.cpp import): the router process
holds, hashes and compares specs without touching a GPU backend.

Where the router deliberately differs from llama-server's defaults, it says so
first, so that an argument given overrides it: ``--cache-ram 0`` (llama-server
reserves up to 8 GiB of host prompt cache per model, which admission would
count in full).  The engine loads with llama.cpp's fit off: the router fits.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelSpec", "SpecError", "ROUTER_DEFAULTS"]

# the router's own defaults, given before the user's arguments (which win)
ROUTER_DEFAULTS = ("--cache-ram", "0")


class SpecError(ValueError):
    """A spec field has an impossible value; the message names the field."""


@dataclass(frozen=True)
class ModelSpec:
    """A model file and llama-server's arguments for it, plus the router's fit and placement."""

    path: str
    args: tuple[str, ...] = ()  # llama-server arguments (not -m), as the user gave them
    # set by the router's fit (or an API caller); None: as the arguments say
    n_ctx: int | None = None  # a context (the fit shrinks one left to llama.cpp; 0: the training context)
    n_gpu_layers: int | None = None  # -1: every layer
    tensor_split: tuple[float, ...] | None = None
    n_cpu_moe: int | None = None  # the experts of the first N layers in host memory
    tensor_overrides: tuple[tuple[str, str], ...] = ()  # (regex, buffer type), before any of the arguments'
    mmproj_offload: bool | None = None  # False: the projector in host memory
    draft_n_gpu_layers: int | None = None  # 0: the draft model in host memory
    # placement: the draft's devices, by the inventory's names (the router translates them
    # into the names its worker sees); None: the arguments' (or the model's devices)
    draft_devices: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", os.fspath(self.path))
        if isinstance(self.args, (str, bytes)):
            raise SpecError(f"args={self.args!r}: a sequence of arguments, not one string")
        object.__setattr__(self, "args", tuple(os.fspath(a) if isinstance(a, os.PathLike) else str(a)
                                               for a in self.args))
        for name in ("tensor_split", "draft_devices"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))
        if self.tensor_split is not None:
            object.__setattr__(self, "tensor_split", tuple(float(x) for x in self.tensor_split))
        if not isinstance(self.tensor_overrides, tuple) or any(not isinstance(p, tuple) for p in self.tensor_overrides):
            object.__setattr__(self, "tensor_overrides", tuple(tuple(p) for p in self.tensor_overrides))
        self.validate()

    def validate(self) -> None:
        def need(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise SpecError(f"{name}={getattr(self, name)!r}: {why}")

        need(bool(self.path), "path", "the model's GGUF file is required")
        need(self.n_ctx is None or self.n_ctx >= 0, "n_ctx", "must be >= 0 (0 = the model's training context)")
        need(self.n_gpu_layers is None or self.n_gpu_layers >= -1, "n_gpu_layers", "must be >= -1 (-1 = all layers)")
        need(self.n_cpu_moe is None or self.n_cpu_moe >= 0, "n_cpu_moe", "must be >= 0")
        need(self.draft_n_gpu_layers is None or self.draft_n_gpu_layers >= -1, "draft_n_gpu_layers",
             "must be >= -1 (-1 = all layers)")
        if self.tensor_split is not None:
            need(all(x >= 0 for x in self.tensor_split) and sum(self.tensor_split) > 0,
                 "tensor_split", "needs non-negative proportions with a positive sum")

    def to_args(self) -> list[str]:
        """The spec as llama-server arguments: what the engine's llama.cpp parser is
        given, so that the engine allocates what the probe of this spec measured."""
        a = ["-m", self.path, *ROUTER_DEFAULTS, *self.args]
        if self.n_ctx is not None:
            a += ["-c", str(self.n_ctx)]
        if self.n_gpu_layers is not None:
            a += ["-ngl", "all" if self.n_gpu_layers < 0 else str(self.n_gpu_layers)]
        if self.tensor_split is not None:
            a += ["-ts", ",".join(f"{x:g}" for x in self.tensor_split)]
        if self.tensor_overrides:  # llama.cpp takes the first pattern that matches: these, then the MoE rules
            a += ["-ot", ",".join(f"{pattern}={buft}" for pattern, buft in self.tensor_overrides)]
        if self.n_cpu_moe:
            a += ["--n-cpu-moe", str(self.n_cpu_moe)]
        if self.mmproj_offload is not None:
            a.append("--mmproj-offload" if self.mmproj_offload else "--no-mmproj-offload")
        if self.draft_n_gpu_layers is not None:
            a += ["-ngld", "all" if self.draft_n_gpu_layers < 0 else str(self.draft_n_gpu_layers)]
        if self.draft_devices is not None:
            a += ["-devd", ",".join(self.draft_devices) if self.draft_devices else "none"]
        return a

    def with_args(self, *more: str) -> "ModelSpec":
        """The same spec with more llama-server arguments (after its own: they win)."""
        return dataclasses.replace(self, args=(*self.args, *more))

    def replace(self, **changes: Any) -> "ModelSpec":
        return dataclasses.replace(self, **changes)

    def files(self) -> list[str]:
        """The spec's arguments that name existing files (a projector, a draft, adapters,
        a template...): what a load reads besides the model."""
        return [f for a in self.args for f in _named_files(a)]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelSpec":
        d = dict(d)
        d["args"] = tuple(d.get("args", ()))
        d["tensor_overrides"] = tuple(tuple(p) for p in d.get("tensor_overrides", ()))
        return cls(**d)


def _named_files(arg: str) -> list[str]:
    """The existing files an argument names: itself, or the items of a list
    (``a.gguf,b.gguf``, ``a.gguf:0.5,b.gguf:1`` as --lora-scaled takes them)."""
    if arg.startswith("-"):
        return []
    out = []
    for item in (arg, *arg.split(",")):
        for candidate in (item, item.rpartition(":")[0]):
            try:
                if candidate and os.path.isfile(candidate) and candidate not in out:
                    out.append(candidate)
            except (OSError, ValueError):
                pass
    return out
