"""ModelSpec -> llama_cpp's parameter structs, for handing a spec to llama.cpp's own
``common_fit_params`` in the fit benchmark (which takes those structs).  The
product builds its llama params from llama-server arguments instead
(``ModelSpec.to_args``, parsed by llama.cpp in ``_native``).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from typing import Any

from pyllmrouter.engine.backend import llama_cpp_module, native
from pyllmrouter.spec import FLASH_ATTN, KV_TYPES, SPLIT_MODES, ModelSpec

__all__ = ["LlamaParams", "build", "EXPERT_TENSORS"]

# llama.cpp's LLM_FFN_EXPS_REGEX: the expert tensors of a MoE layer
EXPERT_TENSORS = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"


class _BuftOverride(ctypes.Structure):
    """struct llama_model_tensor_buft_override (llama_cpp has no binding for it)."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


@dataclass
class LlamaParams:
    """Resolved structs for one spec, plus what keeps their pointers valid."""

    spec: ModelSpec
    model: Any  # llama_cpp.llama_model_params
    context: Any  # llama_cpp.llama_context_params
    n_outputs: int  # output-buffer rows the loaded model will reserve
    llama_kwargs: dict[str, Any]
    keep: list[Any] = field(default_factory=list, repr=False)

    @property
    def model_address(self) -> int:
        return ctypes.addressof(self.model)

    @property
    def context_address(self) -> int:
        return ctypes.addressof(self.context)


def _overrides(spec: ModelSpec) -> list[tuple[str, str]]:
    pairs = list(spec.tensor_overrides)
    if spec.cpu_moe:
        pairs.append((EXPERT_TENSORS, "CPU"))
    else:
        pairs.extend((rf"blk\.{i}{EXPERT_TENSORS}", "CPU") for i in range(spec.n_cpu_moe))
    return pairs


def _model_params(spec: ModelSpec, keep: list[Any]):
    lc = llama_cpp_module()
    nat = native()
    mp = lc.llama_model_default_params()
    mp.n_gpu_layers = spec.n_gpu_layers
    mp.split_mode = SPLIT_MODES[spec.split_mode]
    mp.main_gpu = spec.main_gpu
    mp.load_mode = lc.LLAMA_LOAD_MODE_MMAP if spec.use_mmap else lc.LLAMA_LOAD_MODE_NONE
    if spec.tensor_split is not None:
        if len(spec.tensor_split) > lc.LLAMA_MAX_DEVICES:
            raise ValueError(f"tensor_split has {len(spec.tensor_split)} entries; "
                             f"llama.cpp supports {lc.LLAMA_MAX_DEVICES} devices")
        split = (ctypes.c_float * lc.LLAMA_MAX_DEVICES)(*spec.tensor_split)
        keep.append(split)
        mp.tensor_split = split
    if spec.devices is not None:
        handles = [nat.device_handle(name) for name in spec.devices] + [None]
        devs = (ctypes.c_void_p * len(handles))(*handles)
        keep.append(devs)
        mp.devices = ctypes.addressof(devs)  # llama_cpp declares the field as a plain void pointer
    pairs = _overrides(spec)
    if pairs:
        arr = (_BuftOverride * (len(pairs) + 1))()  # zeroed: the last entry ends the list
        for i, (pattern, buft) in enumerate(pairs):
            raw = ctypes.create_string_buffer(pattern.encode())
            keep.append(raw)
            arr[i].pattern = ctypes.cast(raw, ctypes.c_char_p)
            arr[i].buft = nat.buffer_type_handle(buft)
        keep.append(arr)
        mp.tensor_buft_overrides = ctypes.addressof(arr)
    return mp


def build(spec: ModelSpec, n_ctx_train: int | None = None) -> LlamaParams:
    """The structs for ``spec``.  ``n_ctx_train`` is needed only when n_ctx is 0."""
    lc = llama_cpp_module()
    if spec.n_ctx == 0 and not n_ctx_train:
        raise ValueError("n_ctx=0 needs the model's n_ctx_train to resolve")
    n_ctx = spec.n_ctx or int(n_ctx_train)
    n_batch = min(n_ctx, spec.n_batch)
    n_ubatch = min(n_batch, spec.n_ubatch)
    n_seq_max, kv_unified = spec.n_seq_max, spec.kv_unified
    if spec.embedding:  # as llama_cpp.Llama does for embedding models
        n_seq_max = min(n_batch, lc.llama_max_parallel_sequences())
        kv_unified = True
    cpus = os.cpu_count() or 1

    keep: list[Any] = []
    cp = lc.llama_context_default_params()
    cp.n_ctx = n_ctx
    cp.n_batch = n_batch
    cp.n_ubatch = n_ubatch
    cp.n_seq_max = n_seq_max
    cp.kv_unified = kv_unified
    cp.n_threads = spec.n_threads or max(cpus // 2, 1)
    cp.n_threads_batch = spec.n_threads_batch or cpus
    cp.flash_attn_type = FLASH_ATTN[spec.flash_attn]
    cp.type_k = KV_TYPES[spec.type_k]
    cp.type_v = KV_TYPES[spec.type_v]
    cp.offload_kqv = spec.offload_kqv
    cp.op_offload = spec.op_offload
    cp.swa_full = spec.swa_full
    cp.embeddings = spec.embedding
    cp.pooling_type = spec.pooling

    kwargs = dict(
        n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_gpu_layers=spec.n_gpu_layers,
        split_mode=SPLIT_MODES[spec.split_mode], main_gpu=spec.main_gpu, embedding=spec.embedding,
        flash_attn=spec.flash_attn == "on", offload_kqv=spec.offload_kqv, use_mmap=spec.use_mmap,
        n_threads=cp.n_threads, n_threads_batch=cp.n_threads_batch,
        type_k=cp.type_k, type_v=cp.type_v, pooling_type=spec.pooling,
        op_offload=spec.op_offload, swa_full=spec.swa_full,
    )
    return LlamaParams(
        spec=spec,
        model=_model_params(spec, keep),
        context=cp,
        n_outputs=n_batch if spec.embedding else n_seq_max,
        llama_kwargs=kwargs,
        keep=keep,
    )
