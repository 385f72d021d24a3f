"""Tiny random-weight GGUF models for tests, the demo and benchmarks.

Every writer here produces a real GGUF file that llama.cpp loads and runs:

    write_llama(path)   dense llama, SentencePiece (SPM) vocabulary, chat template
    write_llama_split(path, parts)  the same llama in parts, as gguf-split writes them
    write_projector(path)  a LLaVA-style vision projector (mmproj) for the llama
    write_lora(path)    a LoRA adapter for the llama
    write_moe(path)     qwen3moe mixture of experts, same SPM vocabulary
    write_bert(path)    bert encoder with a WordPiece vocabulary (embeddings)
    write_shape(path)   a large model *shape* (7B dense, 30B-A3B MoE): header and
                        tensor table only; the data region is a sparse hole that
                        is never written, so probes can be timed on real layouts

Weights are random (seeded), so the text they generate is noise; what matters
is that every tensor, key and buffer llama.cpp allocates is real.
"""

from __future__ import annotations

import os
import string
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "Shape",
    "VisionShape",
    "LLAMA",
    "DRAFT",
    "MOE",
    "BERT",
    "SHAPE_7B",
    "SHAPE_30B_A3B",
    "write_llama",
    "write_llama_split",
    "write_projector",
    "write_lora",
    "png",
    "write_moe",
    "write_bert",
    "write_shape",
    "write_tiny_set",
]

_CHATML = (
    "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class Shape:
    """Hyper-parameters of a generated model (ggml naming)."""

    arch: str
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx_train: int = 2048
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_vocab: int = 0  # 0: the size of the built-in vocabulary

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


@dataclass(frozen=True)
class VisionShape:
    """Hyper-parameters of a generated projector's vision tower (a CLIP ViT), tiny by default."""

    n_embd: int = 32
    n_layer: int = 2
    image_size: int = 32
    patch_size: int = 8
    n_ff: int | None = None  # None: twice n_embd
    n_head: int = 4

    @property
    def ff(self) -> int:
        return self.n_ff or 2 * self.n_embd


LLAMA = Shape("llama", n_embd=128, n_layer=2, n_head=4, n_head_kv=2, n_ff=256)
MOE = Shape(
    "qwen3moe", n_embd=128, n_layer=2, n_head=4, n_head_kv=2, n_ff=256,
    n_expert=4, n_expert_used=2, n_ff_exp=64,
)
# the benchmarks' "100M" llama: a step that costs what a small real model's does on a CPU
LLAMA_100M = Shape("llama", n_embd=768, n_layer=8, n_head=12, n_head_kv=4, n_ff=2048, n_ctx_train=4096)
DRAFT = Shape("llama", n_embd=64, n_layer=1, n_head=2, n_head_kv=1, n_ff=128)  # a draft for LLAMA (its vocabulary)
BERT = Shape("bert", n_embd=64, n_layer=2, n_head=4, n_head_kv=4, n_ff=128, n_ctx_train=512)
SHAPE_7B = Shape(
    "llama", n_embd=4096, n_layer=32, n_head=32, n_head_kv=8, n_ff=14336,
    n_ctx_train=32768, n_vocab=32000,
)
SHAPE_30B_A3B = Shape(
    "qwen3moe", n_embd=2048, n_layer=48, n_head=32, n_head_kv=4, n_ff=6144,
    n_ctx_train=40960, n_expert=128, n_expert_used=8, n_ff_exp=768, n_vocab=151936,
)


# -- vocabularies -----------------------------------------------------------

def _spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """<unk> <s> </s>, chat markers, 256 byte tokens, then letters and words."""
    import gguf

    tokens = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    types = [gguf.TokenType.UNKNOWN] + [gguf.TokenType.CONTROL] * 4
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    words = ["the", "a", "of", "and", "to", "is", "in", "it", "you", "that", "hello", "world",
             "model", "router", "memory", "GPU", "token", "fast"]
    pieces = ["\u2581"] + list(string.ascii_letters + string.digits + ".,!?'")
    pieces += ["\u2581" + c for c in string.ascii_lowercase] + ["\u2581" + w for w in words] + words
    seen = set(tokens)
    for p in pieces:
        if p not in seen:
            seen.add(p)
            tokens.append(p)
            types.append(gguf.TokenType.NORMAL)
    scores = [0.0] * 261 + [-float(i) for i in range(len(tokens) - 261)]
    return tokens, scores, [int(t) for t in types]


def _wpm_vocab() -> list[str]:
    """BERT WordPiece as llama.cpp stores it: word starts carry U+2581, "##" pieces are bare.

    [PAD] [UNK] [CLS] [SEP] [MASK], then word-initial characters and words,
    then continuation characters.
    """
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = ["the", "of", "and", "to", "is", "in", "hello", "world", "embedding", "model"]
    tokens += ["\u2581" + c for c in string.ascii_lowercase + string.digits + ".,!?'-"]
    tokens += ["\u2581" + w for w in words]
    tokens += list(string.ascii_lowercase + string.digits)
    assert len(set(tokens)) == len(tokens), "llama.cpp aborts on duplicate tokens"
    return tokens


# -- writers ----------------------------------------------------------------

class _Weights:
    """Seeded random tensors, stored f16 for matrices and f32 for norms."""

    def __init__(self, writer, seed: int):
        self.writer = writer
        self.rng = np.random.default_rng(seed)

    def mat(self, name: str, *ne: int, f32: bool = False) -> None:
        # ne is in ggml order (fastest dimension first); numpy wants it reversed
        data = self.rng.standard_normal(tuple(reversed(ne)), dtype=np.float32) * 0.02
        self.writer.add_tensor(name, data if f32 else data.astype(np.float16))

    def vec(self, name: str, n: int, value: float | None = None) -> None:
        if value is None:
            data = self.rng.standard_normal(n, dtype=np.float32) * 0.02
        else:
            data = np.full(n, value, dtype=np.float32)
        self.writer.add_tensor(name, data)


def finish(writer, path: Path) -> Path:
    """Write a GGUFWriter's header, metadata and tensors to ``path`` and close it."""
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_transformer_hparams(writer, shape: Shape) -> None:
    writer.add_context_length(shape.n_ctx_train)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)


def _add_decoder_hparams(writer, shape: Shape, n_vocab: int) -> None:
    _add_transformer_hparams(writer, shape)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    if shape.n_expert:
        writer.add_expert_count(shape.n_expert)
        writer.add_expert_used_count(shape.n_expert_used)
        writer.add_expert_feed_forward_length(shape.n_ff_exp)
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)


def _add_spm_tokenizer(writer) -> int:
    tokens, scores, types = _spm_vocab()
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(4)  # <|im_end|> ends a chat turn
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_chat_template(_CHATML)
    return len(tokens)


def _write_decoder(path: os.PathLike | str, shape: Shape, seed: int, split_max_tensors: int = 0) -> Path:
    import gguf

    path = Path(path)
    writer = gguf.GGUFWriter(path, shape.arch, split_max_tensors=split_max_tensors)
    writer.add_name(f"tiny-{shape.arch}")
    n_vocab = _add_spm_tokenizer(writer)
    _add_decoder_hparams(writer, shape, n_vocab)
    w = _Weights(writer, seed)
    e, hd = shape.n_embd, shape.head_dim
    w.mat("token_embd.weight", e, n_vocab)
    w.vec("output_norm.weight", e, 1.0)
    w.mat("output.weight", e, n_vocab)
    for i in range(shape.n_layer):
        b = f"blk.{i}."
        w.vec(b + "attn_norm.weight", e, 1.0)
        w.mat(b + "attn_q.weight", e, hd * shape.n_head)
        w.mat(b + "attn_k.weight", e, hd * shape.n_head_kv)
        w.mat(b + "attn_v.weight", e, hd * shape.n_head_kv)
        w.mat(b + "attn_output.weight", hd * shape.n_head, e)
        w.vec(b + "ffn_norm.weight", e, 1.0)
        if shape.n_expert:
            w.vec(b + "attn_q_norm.weight", hd, 1.0)
            w.vec(b + "attn_k_norm.weight", hd, 1.0)
            w.mat(b + "ffn_gate_inp.weight", e, shape.n_expert)
            w.mat(b + "ffn_gate_exps.weight", e, shape.n_ff_exp, shape.n_expert)
            w.mat(b + "ffn_down_exps.weight", shape.n_ff_exp, e, shape.n_expert)
            w.mat(b + "ffn_up_exps.weight", e, shape.n_ff_exp, shape.n_expert)
        else:
            w.mat(b + "ffn_gate.weight", e, shape.n_ff)
            w.mat(b + "ffn_down.weight", shape.n_ff, e)
            w.mat(b + "ffn_up.weight", e, shape.n_ff)
    return finish(writer, path)


def write_llama(path: os.PathLike | str, shape: Shape = LLAMA, seed: int = 0) -> Path:
    """A dense llama model with an SPM vocabulary and a ChatML template."""
    return _write_decoder(path, shape, seed)


def write_llama_split(path: os.PathLike | str, parts: int = 2, shape: Shape = LLAMA, seed: int = 0) -> list[Path]:
    """The dense llama split into ``parts`` files as gguf-split writes them
    (``<stem>-00001-of-0000N.gguf``..., split.* keys); the parts' paths, the first first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n_tensors = 3 + shape.n_layer * 9
    _write_decoder(path, shape, seed, split_max_tensors=-(-n_tensors // parts))
    stem = path.name.removesuffix(".gguf")
    return [path.with_name(f"{stem}-{i:05d}-of-{parts:05d}.gguf") for i in range(1, parts + 1)]


def write_moe(path: os.PathLike | str, shape: Shape = MOE, seed: int = 0) -> Path:
    """A qwen3moe mixture-of-experts model (experts in 3-D ``*_exps`` tensors)."""
    if not shape.n_expert:
        raise ValueError("a MoE shape needs n_expert > 0")
    return _write_decoder(path, shape, seed)


def write_bert(path: os.PathLike | str, shape: Shape = BERT, seed: int = 0) -> Path:
    """A bert embedding model with a WordPiece vocabulary and mean pooling."""
    import gguf

    path = Path(path)
    tokens = _wpm_vocab()
    writer = gguf.GGUFWriter(path, "bert")
    writer.add_name("tiny-bert")
    _add_transformer_hparams(writer, shape)
    writer.add_layer_norm_eps(1e-12)
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType.MEAN)
    writer.add_tokenizer_model("bert")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * 5 + [gguf.TokenType.NORMAL] * (len(tokens) - 5))
    writer.add_token_type_count(2)
    writer.add_pad_token_id(0)
    writer.add_unk_token_id(1)
    writer.add_bos_token_id(2)
    writer.add_uint32("tokenizer.ggml.cls_token_id", 2)
    writer.add_sep_token_id(3)
    writer.add_mask_token_id(4)
    w = _Weights(writer, seed)
    e = shape.n_embd
    w.mat("token_embd.weight", e, len(tokens))
    # added to activations, not multiplied: ggml's CPU add wants f32 here
    w.mat("token_types.weight", e, 2, f32=True)
    w.mat("position_embd.weight", e, shape.n_ctx_train, f32=True)
    w.vec("token_embd_norm.weight", e, 1.0)
    w.vec("token_embd_norm.bias", e, 0.0)
    for i in range(shape.n_layer):
        b = f"blk.{i}."
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.mat(b + part + ".weight", e, e)
            w.vec(b + part + ".bias", e)
        w.vec(b + "attn_output_norm.weight", e, 1.0)
        w.vec(b + "attn_output_norm.bias", e, 0.0)
        w.mat(b + "ffn_up.weight", e, shape.n_ff)
        w.vec(b + "ffn_up.bias", shape.n_ff)
        w.mat(b + "ffn_down.weight", shape.n_ff, e)
        w.vec(b + "ffn_down.bias", e)
        w.vec(b + "layer_output_norm.weight", e, 1.0)
        w.vec(b + "layer_output_norm.bias", e, 0.0)
    return finish(writer, path)


def write_shape(path: os.PathLike | str, shape: Shape = SHAPE_7B, quant: str = "Q4_0") -> Path:
    """Write a model's header and tensor table; leave the data region a sparse hole.

    The file has the full size of the real model (so llama.cpp's bounds checks
    pass) but occupies only a few kilobytes of disk.  It can be probed, not run.
    """
    import gguf

    qtype = gguf.GGMLQuantizationType[quant.upper()]
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    path = Path(path)
    n_vocab = shape.n_vocab or len(_spm_vocab()[0])
    writer = gguf.GGUFWriter(path, shape.arch)
    writer.add_name(f"shape-{shape.arch}-{shape.n_layer}L")
    tokens, scores, types = _spm_vocab()
    pad = n_vocab - len(tokens)
    if pad < 0:
        raise ValueError(f"n_vocab {n_vocab} is smaller than the built-in vocabulary ({len(tokens)})")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens + [f"<unused{i}>" for i in range(pad)])
    writer.add_token_scores(scores + [-1e4] * pad)
    writer.add_token_types(types + [int(gguf.TokenType.UNUSED)] * pad)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    _add_decoder_hparams(writer, shape, n_vocab)

    def add(name: str, *ne: int, f32: bool = False) -> None:
        n = int(np.prod(ne))
        if f32:
            writer.add_tensor_info(name, tuple(reversed(ne)), np.dtype(np.float32), n * 4)
        else:
            nbytes = n // block * type_size
            writer.add_tensor_info(name, tuple(reversed(ne)), np.dtype(np.float32), nbytes, raw_dtype=qtype)

    e, hd = shape.n_embd, shape.head_dim
    add("token_embd.weight", e, n_vocab)
    add("output_norm.weight", e, f32=True)
    add("output.weight", e, n_vocab)
    for i in range(shape.n_layer):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", e, f32=True)
        add(b + "attn_q.weight", e, hd * shape.n_head)
        add(b + "attn_k.weight", e, hd * shape.n_head_kv)
        add(b + "attn_v.weight", e, hd * shape.n_head_kv)
        add(b + "attn_output.weight", hd * shape.n_head, e)
        add(b + "ffn_norm.weight", e, f32=True)
        if shape.n_expert:
            add(b + "attn_q_norm.weight", hd, f32=True)
            add(b + "attn_k_norm.weight", hd, f32=True)
            add(b + "ffn_gate_inp.weight", e, shape.n_expert, f32=True)
            add(b + "ffn_gate_exps.weight", e, shape.n_ff_exp, shape.n_expert)
            add(b + "ffn_down_exps.weight", shape.n_ff_exp, e, shape.n_expert)
            add(b + "ffn_up_exps.weight", e, shape.n_ff_exp, shape.n_expert)
        else:
            add(b + "ffn_gate.weight", e, shape.n_ff)
            add(b + "ffn_down.weight", shape.n_ff, e)
            add(b + "ffn_up.weight", e, shape.n_ff)
    return _finish_sparse(writer, path)


def _finish_sparse(writer, path: Path) -> Path:
    """Write the header and tensor table; the data region becomes a sparse hole of its
    full size (llama.cpp's bounds checks pass, the disk holds kilobytes)."""
    import gguf

    data_bytes = sum(
        gguf.GGUFWriter.ggml_pad(ti.nbytes, writer.data_alignment) for ti in writer.tensors[0].values()
    )
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.flush()
    header_end = writer.fout[0].tell()
    writer.close()
    data_start = gguf.GGUFWriter.ggml_pad(header_end, writer.data_alignment)
    os.truncate(path, data_start + data_bytes)
    return path


class _Holes:
    """Tensor table entries without data (f16 matrices, f32 vectors), for sparse files."""

    def __init__(self, writer):
        self.writer = writer

    def mat(self, name: str, *ne: int, f32: bool = False) -> None:
        n = int(np.prod(ne))
        dtype = np.dtype(np.float32 if f32 else np.float16)
        self.writer.add_tensor_info(name, tuple(reversed(ne)), dtype, n * dtype.itemsize)

    def vec(self, name: str, n: int, value: float | None = None) -> None:
        self.mat(name, n, f32=True)


def write_projector(path: os.PathLike | str, n_embd_text: int = LLAMA.n_embd, seed: int = 0,
                    vision: VisionShape = VisionShape(), sparse: bool = False) -> Path:
    """A LLaVA-style multimodal projector (mmproj): a CLIP ViT of ``vision``'s shape and the
    two-layer MLP ("mlp" projector) into a text model of width ``n_embd_text``, as mtmd
    reads it.  ``sparse``: header and tensor table only, over a hole (probe, not run)."""
    import gguf

    path = Path(path)
    writer = gguf.GGUFWriter(path, "clip")
    ff = vision.ff
    writer.add_name("tiny-projector")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", "mlp")
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.image_size", vision.image_size)
    writer.add_uint32("clip.vision.patch_size", vision.patch_size)
    writer.add_uint32("clip.vision.embedding_length", vision.n_embd)
    writer.add_uint32("clip.vision.feed_forward_length", ff)
    writer.add_uint32("clip.vision.block_count", vision.n_layer)
    writer.add_uint32("clip.vision.projection_dim", n_embd_text)
    writer.add_uint32("clip.vision.attention.head_count", vision.n_head)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    w = _Holes(writer) if sparse else _Weights(writer, seed)
    e, n_pos = vision.n_embd, (vision.image_size // vision.patch_size) ** 2 + 1
    w.mat("v.patch_embd.weight", vision.patch_size, vision.patch_size, 3, e)
    w.vec("v.class_embd", e)
    w.mat("v.position_embd.weight", e, n_pos, f32=True)
    w.vec("v.pre_ln.weight", e, 1.0)
    w.vec("v.pre_ln.bias", e, 0.0)
    for i in range(vision.n_layer):
        b = f"v.blk.{i}."
        for t in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.mat(b + t + ".weight", e, e)
            w.vec(b + t + ".bias", e)
        for t in ("ln1", "ln2"):
            w.vec(b + t + ".weight", e, 1.0)
            w.vec(b + t + ".bias", e, 0.0)
        w.mat(b + "ffn_up.weight", e, ff)
        w.vec(b + "ffn_up.bias", ff)
        w.mat(b + "ffn_down.weight", ff, e)
        w.vec(b + "ffn_down.bias", e)
    w.mat("mm.0.weight", e, n_embd_text)
    w.vec("mm.0.bias", n_embd_text)
    w.mat("mm.2.weight", n_embd_text, n_embd_text)
    w.vec("mm.2.bias", n_embd_text)
    return _finish_sparse(writer, path) if sparse else finish(writer, path)


def write_lora(path: os.PathLike | str, shape: Shape = LLAMA, rank: int = 8, seed: int = 0,
               targets: tuple[str, ...] = ("attn_q", "attn_v", "output")) -> Path:
    """A LoRA adapter for a model of ``shape``: lora_a/lora_b pairs of ``rank`` for the
    named tensors of every layer (and ``output``), as convert_lora_to_gguf writes them.
    Its weights are large (not 0.02-small): applied, it changes what the model says."""
    import gguf

    path = Path(path)
    writer = gguf.GGUFWriter(path, shape.arch)
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(rank))
    rng = np.random.default_rng(seed)
    n_vocab = shape.n_vocab or len(_spm_vocab()[0])
    e, hd = shape.n_embd, shape.head_dim
    out_dims = {"attn_q": hd * shape.n_head, "attn_k": hd * shape.n_head_kv, "attn_v": hd * shape.n_head_kv,
                "attn_output": e, "output": n_vocab}
    names = [("output.weight", e, n_vocab)] if "output" in targets else []
    names += [(f"blk.{i}.{t}.weight", hd * shape.n_head if t == "attn_output" else e, out_dims[t])
              for i in range(shape.n_layer) for t in targets if t != "output"]
    for name, n_in, n_out in names:
        # ggml order: a is (n_in, rank), b is (rank, n_out); numpy wants them reversed
        writer.add_tensor(name + ".lora_a", (rng.standard_normal((rank, n_in)) * 0.5).astype(np.float32))
        writer.add_tensor(name + ".lora_b", (rng.standard_normal((n_out, rank)) * 0.5).astype(np.float32))
    return finish(writer, path)


def png(width: int = 16, height: int = 16, seed: int = 0) -> bytes:
    """A small RGB PNG of seeded noise (for image requests to a projector)."""
    import struct
    import zlib

    rng = np.random.default_rng(seed)
    rows = b"".join(b"\x00" + rng.integers(0, 256, width * 3, dtype=np.uint8).tobytes() for _ in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def write_tiny_set(directory: os.PathLike | str, seed: int = 0) -> dict[str, Path]:
    """Write (or reuse) the three tiny models into ``directory``; name -> path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    writers = {"tiny-llama": write_llama, "tiny-moe": write_moe, "tiny-bert": write_bert}
    out = {}
    for name, write in writers.items():
        path = directory / f"{name}.gguf"
        if not path.exists():
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            write(tmp, seed=seed)
            os.replace(tmp, path)
        out[name] = path
    return out

