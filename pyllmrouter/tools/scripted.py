"""Scripted chat models: tiny GGUFs whose greedy answer is fixed by construction.

Random weights never produce a tool call or a reasoning block, so the serving
features built on them (tool-call parsing, ``reasoning_content``) cannot be
compared between two servers on random models.  A scripted model is
"bigram-programmed": its layers add nothing (attention and FFN outputs are
zero, so the residual stream is the token embedding), each token's embedding
is a one-hot vector, and the output matrix maps each token to one fixed
successor.  Greedy decoding after the generation prompt's last token ("\\n",
after ``<|im_start|>assistant``) therefore emits the script, piece by piece,
then ``<|im_end|>``:

    write_scripted(path, TOOL_TEMPLATE, ["<tool_call>", '\\n{"name": ...}\\n', "</tool_call>"])

The vocabulary is byte-level BPE (GPT-2's byte alphabet, pre-tokenizer qwen2),
with ChatML's control tokens and the script's pieces as single user-defined
tokens, as a Qwen model's ``<tool_call>`` and ``<think>`` are.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from pyllmrouter.tools.tinymodels import finish

__all__ = ["write_scripted", "TOOL_TEMPLATE", "THINK_TEMPLATE", "TOOL_SCRIPT", "THINK_SCRIPT", "STORY_SCRIPT"]

# Qwen 2.5's tool-calling template (Hermes style: one JSON object per <tool_call>)
TOOL_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- for message in messages %}
{%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# a Qwen 3 style thinking template: the answer's reasoning in <think></think>
THINK_TEMPLATE = """{%- for message in messages %}
{%- if message.role == "assistant" %}
{%- set content = message.content %}
{%- if message.reasoning_content is defined and message.reasoning_content %}
{%- set content = '<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') %}
{%- endif %}
{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

TOOL_SCRIPT = ["<tool_call>", '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', "</tool_call>"]
THINK_SCRIPT = ["<think>", "\nThe user says hello; a short greeting answers it.\n", "</think>", "\n\nHello there!"]
# a plain-text template's words, each one token: the looping model's endless answer
STORY_SCRIPT = [" Once", " upon", " a", " time,", " the", " router", " knew", " every", " byte", " of", " its", " GPUs."]

_CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_MARKERS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]
_N_HEAD, _N_FF = 4, 64  # the one layer's heads and feed-forward width


def _byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode: the printable stand-in of every byte, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def write_scripted(path: os.PathLike | str, template: str, script: list[str], loop: bool = False) -> Path:
    """A model whose greedy continuation of a chat's generation prompt is ``script``
    (each piece one token), then ``<|im_end|>``; with ``loop``, the script again and
    again until the context or ``max_tokens`` ends it (a long stream to stop)."""
    import gguf

    path = Path(path)
    tokens, types = _vocabulary(script)
    ids = {t: i for i, t in enumerate(tokens)}
    successor = _successors(ids, script, loop)
    n_embd = -(-len(tokens) // 64) * 64  # one dimension per token, whole heads
    writer = gguf.GGUFWriter(path, "llama")
    _add_header(writer, tokens, types, ids, template, n_embd)
    _add_tensors(writer, successor, ids["<|im_end|>"], len(tokens), n_embd)
    return finish(writer, path)


def _vocabulary(script: list[str]) -> tuple[list[str], list]:
    """The tokens (GPT-2's byte alphabet, "Ġt", ChatML's control tokens, the markers, then
    the script's pieces not among them) and their token types."""
    import gguf

    tokens = _byte_alphabet() + ["Ġt"] + _CONTROL + _MARKERS
    types = [gguf.TokenType.NORMAL] * 257 + [gguf.TokenType.CONTROL] * len(_CONTROL) + \
        [gguf.TokenType.USER_DEFINED] * len(_MARKERS)
    for piece in script:
        if piece not in tokens:
            tokens.append(piece)
            types.append(gguf.TokenType.USER_DEFINED)
    return tokens, types


def _successors(ids: dict[str, int], script: list[str], loop: bool) -> dict[int, int]:
    """Each token of the chain (the generation prompt's last token, the script's pieces,
    ``<|im_end|>``) to the next; with ``loop``, the last piece to the first."""
    start = ids[_byte_alphabet()[ord("\n")]]  # the generation prompt's last token
    chain = [start] + [ids[p] for p in script] + [ids["<|im_end|>"]]
    if len(set(chain)) != len(chain):
        raise ValueError("every piece of a script must be a distinct token (and not a newline alone)")
    successor = {a: b for a, b in zip(chain, chain[1:])}
    if loop:
        successor[chain[-2]] = chain[1]  # the last piece is followed by the first
    return successor


def _add_header(writer, tokens: list[str], types: list, ids: dict[str, int], template: str, n_embd: int) -> None:
    """A one-layer llama's hyper-parameters, the byte-level BPE vocabulary and the chat template."""
    writer.add_name("scripted-chat")
    writer.add_context_length(4096)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(1)
    writer.add_feed_forward_length(_N_FF)
    writer.add_head_count(_N_HEAD)
    writer.add_head_count_kv(_N_HEAD)
    writer.add_rope_dimension_count(n_embd // _N_HEAD)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([int(t) for t in types])
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(ids["<|endoftext|>"])
    writer.add_eos_token_id(ids["<|im_end|>"])
    writer.add_pad_token_id(ids["<|endoftext|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(template)


def _add_tensors(writer, successor: dict[int, int], im_end: int, n_vocab: int, n_embd: int) -> None:
    """One-hot token embeddings, an output matrix that maps each token to its successor
    (``<|im_end|>`` where it has none), and a layer that adds nothing (zero attention and
    FFN outputs; its other weights small, random and seeded)."""
    embd = np.zeros((n_vocab, n_embd), dtype=np.float32)  # numpy order: ggml's ne reversed
    embd[np.arange(n_vocab), np.arange(n_vocab)] = 1.0
    out = np.zeros((n_vocab, n_embd), dtype=np.float32)
    for t in range(n_vocab):
        out[successor.get(t, im_end), t] = 1.0
    rng = np.random.default_rng(0)

    def small(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    writer.add_tensor("token_embd.weight", embd.astype(np.float16))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("output.weight", out.astype(np.float16))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
    for name in ("attn_q", "attn_k", "attn_v"):
        writer.add_tensor(f"blk.0.{name}.weight", small(n_embd, n_embd))
    writer.add_tensor("blk.0.attn_output.weight", np.zeros((n_embd, n_embd), dtype=np.float16))
    writer.add_tensor("blk.0.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("blk.0.ffn_gate.weight", small(_N_FF, n_embd))
    writer.add_tensor("blk.0.ffn_up.weight", small(_N_FF, n_embd))
    writer.add_tensor("blk.0.ffn_down.weight", np.zeros((n_embd, _N_FF), dtype=np.float16))
