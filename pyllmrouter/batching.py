"""Continuous batching for one model: many sequences, one ``llama_decode`` per step.

    put(Run) ──▶ waiting ──(between steps)──▶ a free slot (its own seq_id, KV and
                                               sampler chain), prefix of its cached
                                               tokens reused
    step:  batch = the last sampled token of every generating slot, then prompt
                   tokens in the order the prompts were admitted, n_batch in all (allot)
           llama_decode(batch)
           for each slot whose last token asked for logits:
               llama_sampler_sample ──▶ bytes ──▶ text ──▶ stop string? max_tokens?
               end of sequence? cancelled? ──▶ Chunk (stream) / Result

A step holds at most ``n_batch`` tokens and a token of every generating
sequence, so a long prompt never stalls the others for more than one chunk; the
prompt budget goes to the earliest admitted prompt first (as llama-server's
slots take it), so of several prompts arriving together the first is answered
after its own prefill, not after all of them.  Tools reach the chat template
as llama_cpp passes them.  A request this path cannot serve (a forced tool or
function, logprobs, mirostat, a chat format without a template formatter)
waits until no slot is busy and is served by llama_cpp's own methods
on the same context (``serial``), so it is served correctly, never approximately.
"""

from __future__ import annotations

import codecs
import itertools
import queue
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from .openai_params import check_tokens

__all__ = ["BatchEngine", "EngineStats", "allot", "needs_serial", "response_grammar"]

REUSE_MIN = 16  # shortest cached prefix worth reusing (tokens)
SERIAL_KEYS = ("logprobs", "top_logprobs", "mirostat_mode", "logits_processor", "grammar", "suffix", "echo")
TOOL_KEYS = ("tools", "functions", "tool_choice", "function_call")  # for the chat template
_DEFAULTS = {"chat": dict(temperature=0.2, top_p=0.95, top_k=40, min_p=0.05, repeat_penalty=1.0),
             "complete": dict(temperature=0.8, top_p=0.95, top_k=40, min_p=0.05, repeat_penalty=1.0)}


def needs_serial(method: str, kwargs: dict[str, Any]) -> bool:
    if method == "embed":
        return True
    if isinstance(kwargs.get("tool_choice"), dict) or isinstance(kwargs.get("function_call"), dict):
        return True  # a forced function: llama_cpp constrains it by its schema and returns a tool call
    for k in SERIAL_KEYS:
        v = kwargs.get(k)
        if v not in (None, False, 0, [], {}):
            return True
    return False


@dataclass
class EngineStats:
    """What one engine has done since its model was loaded (llama-server's /metrics
    counters, and where a step's time goes).  Written by the loop thread only."""

    n_decode: int = 0  # llama_decode calls
    busy_slots: int = 0  # slots busy at each of those calls, summed (as llama-server counts them)
    prompt_tokens: int = 0  # prompt tokens decoded (not reused)
    prompt_tokens_cached: int = 0  # prompt tokens reused from a slot's cache
    tokens_predicted: int = 0
    decode_seconds: float = 0.0  # inside llama_decode
    step_seconds: float = 0.0  # whole steps: batch, llama_decode, sampling, text, sending the chunks
    send_seconds: float = 0.0  # part of step_seconds: pickling each step's chunks, writing them to the pipe
    requests: int = 0  # finished on the batch
    serial_requests: int = 0  # served alone by llama_cpp's own methods

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(eq=False)
class _Request:
    req_id: int
    method: str
    stream: bool
    prompt: list[int]
    stop: list[str]
    max_tokens: int
    sampler: Any
    created: int = field(default_factory=lambda: int(time.time()))
    ident: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    generated: int = 0
    cached: int = 0  # prompt tokens whose KV was reused from the slot
    text: list[str] = field(default_factory=list)  # emitted pieces
    held: str = ""  # text that may be the start of a stop string
    decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))
    finish: str | None = None


@dataclass(eq=False)
class _Slot:
    seq: int
    cache: list[int] = field(default_factory=list)  # tokens whose KV this sequence holds
    pending: list[int] = field(default_factory=list)  # prompt tokens still to decode
    req: _Request | None = None
    logits_at: int = -1  # batch index of this slot's logits in the current step
    next_token: int = -1  # sampled, to be decoded in the next step
    admitted: int = 0  # when its request was admitted (orders the prompt budget)


def allot(busy: list[_Slot], n_batch: int) -> list[tuple[_Slot, int]]:
    """How many tokens each busy slot puts in this step's batch: one per generating
    slot, then what is left of ``n_batch`` to the prompts still to decode, earliest
    admitted first.  Pure policy: the batch never exceeds ``n_batch``."""
    out, left = [], n_batch
    for s in sorted(busy, key=lambda s: (bool(s.pending), s.admitted)):
        k = min(left, len(s.pending) if s.pending else 1)
        if k:
            out.append((s, k))
            left -= k
    return out


class BatchEngine:
    def __init__(self, name: str, llm: Any, send: Callable[[Any], None], cancelled: set[int],
                 serial: Callable[[Any, Any], None]):
        import llama_cpp.llama_cpp as lc  # noqa: PLC0415 - worker process only

        self.lc, self.llm, self.name, self.cancelled, self.serial = lc, llm, name, cancelled, serial
        self._send = send
        self._outbox: list[Any] = []  # replies of this loop iteration, sent as one Batch
        self.ctx = llm._ctx.ctx  # noqa: SLF001
        self.vocab = lc.llama_model_get_vocab(llm._model.model)  # noqa: SLF001
        self.mem = lc.llama_get_memory(self.ctx)
        self.n_vocab = llm.n_vocab()
        self.n_batch = llm.context_params.n_batch
        self.n_ctx_seq = lc.llama_n_ctx_seq(self.ctx)
        self.slots = [_Slot(i) for i in range(llm.context_params.n_seq_max)]
        self.batch = lc.llama_batch_init(self.n_batch, 0, 1)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.waiting: list[Any] = []
        self.formatter = _chat_formatter(llm)
        self._admissions = itertools.count()
        self._pieces: dict[int, tuple[bool, bytes]] = {}  # token -> (end of generation?, its bytes)
        self.stats = EngineStats()
        self.thread = threading.Thread(target=self._loop, name=f"batch-{name}", daemon=True)
        self.thread.start()

    def put(self, msg: Any) -> None:
        self.inbox.put(msg)

    def send(self, msg: Any) -> None:
        self._outbox.append(msg)

    def _flush(self) -> None:
        from .protocol import Batch  # noqa: PLC0415

        if self._outbox:
            out, self._outbox = self._outbox, []
            self._send(out[0] if len(out) == 1 else Batch(out))

    # -- the loop --------------------------------------------------------------

    def _loop(self) -> None:
        from .protocol import Failed, Unloaded, UnloadModel  # noqa: PLC0415

        unload = None
        while True:
            busy = any(s.req for s in self.slots)
            try:
                while True:  # take everything that arrived; block only when idle
                    msg = self.inbox.get(block=not busy and not self.waiting and unload is None)
                    if isinstance(msg, UnloadModel):
                        unload = msg
                    else:
                        self.waiting.append(msg)
                    busy = True
            except queue.Empty:
                pass
            self._admit()
            if any(s.req for s in self.slots):
                t0 = time.perf_counter()
                try:
                    self._step()
                except Exception as e:  # noqa: BLE001 - fail the requests in flight, keep serving
                    for s in self.slots:
                        if s.req:
                            self.send(Failed(s.req.req_id, type(e).__name__, str(e)))
                            self._release(s, clear=True)
                t1 = time.perf_counter()
                self._flush()
                t2 = time.perf_counter()
                self.stats.send_seconds += t2 - t1
                self.stats.step_seconds += t2 - t0
                continue
            if unload is not None and not self.waiting:
                self.lc.llama_batch_free(self.batch)
                self.llm.close()
                self.send(Unloaded(unload.req_id, self.name))
                self._flush()
                return
            self._flush()

    def _admit(self) -> None:
        from .protocol import Failed  # noqa: PLC0415

        while self.waiting:
            msg = self.waiting[0]
            if needs_serial(msg.method, msg.kwargs) or (msg.method == "chat" and self.formatter is None):
                if any(s.req for s in self.slots):
                    return  # served once every slot is idle, in arrival order
                self.waiting.pop(0)
                self.stats.serial_requests += 1  # before its reply goes out
                self._serial(msg)
                continue
            free = [s for s in self.slots if s.req is None]
            if not free:
                return
            self.waiting.pop(0)
            if msg.req_id in self.cancelled:
                self.cancelled.discard(msg.req_id)
                self.send(Failed(msg.req_id, "Cancelled", "request cancelled before it started"))
                continue
            try:
                req = self._request(msg)
            except Exception as e:  # noqa: BLE001 - a bad request fails alone
                self.send(Failed(msg.req_id, type(e).__name__, str(e)))
                continue
            self._assign(req, free)

    def _serial(self, msg: Any) -> None:
        self._flush()
        # llama_cpp's own methods track the KV of sequence 0 themselves: start them clean
        for s in self.slots:
            s.cache.clear()
        self.lc.llama_memory_clear(self.mem, True)
        self.llm.reset()
        try:
            self.serial(self.llm, msg)
        finally:
            self.lc.llama_memory_clear(self.mem, True)
            self.llm.reset()

    def _assign(self, req: _Request, free: list[_Slot]) -> None:
        """The free slot whose cached tokens share the longest prefix with the prompt."""
        def common(s: _Slot) -> int:
            n = 0
            for a, b in zip(s.cache, req.prompt):
                if a != b:
                    break
                n += 1
            return n

        shared, slot = max(((common(s), s) for s in free), key=lambda x: x[0])
        keep = min(shared, len(req.prompt) - 1)  # the last prompt token is decoded again for logits
        if keep < min(REUSE_MIN, len(req.prompt) // 2):
            # too short to be worth it, and KV computed in another batch can differ in the
            # last bits, which can flip a MoE router: a fresh prompt is computed fresh
            keep = 0
        self.lc.llama_memory_seq_rm(self.mem, slot.seq, keep, -1)
        slot.cache = slot.cache[:keep]
        slot.pending = req.prompt[keep:]
        slot.req = req
        slot.admitted = next(self._admissions)
        req.cached = keep
        self.stats.prompt_tokens_cached += keep

    def _step(self) -> None:
        """One llama_decode for every busy slot; a full KV cache ends the longest sequence."""
        while True:
            busy = [s for s in self.slots if s.req]
            if not busy:
                return
            plan = self._plan(busy)
            t0 = time.perf_counter()
            rc = self.lc.llama_decode(self.ctx, self.batch)
            st = self.stats
            st.decode_seconds += time.perf_counter() - t0
            st.n_decode += 1
            st.busy_slots += len(busy)
            if rc == 0:
                break
            for s, _take, _last in plan:  # undo whatever part of the batch was stored
                self.lc.llama_memory_seq_rm(self.mem, s.seq, len(s.cache), -1)
            if rc != 1 or len(busy) == 1:
                raise RuntimeError(f"llama_decode failed ({rc}) with {len(busy)} sequences: the context is full; "
                                   "lower max_tokens or raise --ctx-size")
            longest = max(busy, key=lambda s: len(s.cache))
            self._finish(longest, "length")  # the shared KV cache is full: it has had the most
            self._release(longest, clear=True)
        for s, take, last_prompt in plan:
            if s.pending:
                s.pending = s.pending[len(take):]
                st.prompt_tokens += len(take)
            s.cache.extend(take)
        for s, _take, last_prompt in plan:
            if last_prompt and s.req is not None:
                tok = self.lc.llama_sampler_sample(s.req.sampler, self.ctx, s.logits_at)
                self._emit(s, tok)

    def _plan(self, busy: list[_Slot]) -> list[tuple[_Slot, list[int], bool]]:
        """Fill the batch as ``allot`` says: prompt tokens, or the next token of a generating slot."""
        b = self.batch
        plan, n = [], 0
        for s, k in allot(busy, self.n_batch):
            take = s.pending[:k] if s.pending else [s.next_token]
            last_prompt = len(take) == len(s.pending) if s.pending else True
            for j, tok in enumerate(take):
                b.token[n] = tok
                b.pos[n] = len(s.cache) + j
                b.n_seq_id[n] = 1
                b.seq_id[n][0] = s.seq
                b.logits[n] = 1 if (last_prompt and j == len(take) - 1) else 0
                n += 1
            s.logits_at = n - 1
            plan.append((s, take, last_prompt))
        b.n_tokens = n
        return plan

    # -- tokens to text --------------------------------------------------------

    def _emit(self, s: _Slot, tok: int) -> None:
        req = s.req
        if req.req_id in self.cancelled:
            self._finish(s, "stop")
            return
        eog, raw = self._piece(tok)
        if eog:
            self._finish(s, "stop")
            return
        req.generated += 1
        self.stats.tokens_predicted += 1
        s.next_token = tok
        piece = req.decoder.decode(raw)
        text = req.held + piece
        for stop in req.stop:
            i = text.find(stop)
            if i >= 0:
                self._out(req, text[:i])
                req.held = ""
                self._finish(s, "stop", decoded=True)
                return
        hold = max((k for stop in req.stop for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
        self._out(req, text[: len(text) - hold])
        req.held = text[len(text) - hold:]
        if req.generated >= req.max_tokens or len(s.cache) + 1 >= self.n_ctx_seq:
            self._finish(s, "length", decoded=True)

    def _piece(self, tok: int) -> tuple[bool, bytes]:
        """Whether ``tok`` ends generation, and its bytes (llama_cpp's detokenize of one
        token), looked up once per token id."""
        piece = self._pieces.get(tok)
        if piece is None:
            piece = self._pieces[tok] = (bool(self.lc.llama_vocab_is_eog(self.vocab, tok)),
                                         self.llm.detokenize([tok]))
        return piece

    def _out(self, req: _Request, text: str) -> None:
        if not text:
            return
        req.text.append(text)
        if req.stream:
            self._chunk(req, text, None)

    def _chunk(self, req: _Request, text: str | None, finish: str | None, usage: dict | None = None) -> None:
        from .protocol import Chunk  # noqa: PLC0415

        if req.method == "chat":
            delta = {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            obj = {"id": "chatcmpl-" + req.ident, "object": "chat.completion.chunk"}
        else:
            choice = {"text": text or "", "index": 0, "logprobs": None, "finish_reason": finish}
            obj = {"id": "cmpl-" + req.ident, "object": "text_completion"}
        obj = {**obj, "created": req.created, "model": self.name, "choices": [choice]}
        if usage is not None:
            obj["usage"] = usage  # on the last chunk, as llama-server sends it
        self.send(Chunk(req.req_id, obj))

    def _finish(self, s: _Slot, reason: str, decoded: bool = False) -> None:
        from .protocol import Result  # noqa: PLC0415

        req = s.req
        if not decoded or reason == "length":
            self._out(req, req.held + req.decoder.decode(b"", final=True))
            req.held = ""
        usage = {"prompt_tokens": len(req.prompt), "completion_tokens": req.generated,
                 "total_tokens": len(req.prompt) + req.generated,
                 "prompt_tokens_details": {"cached_tokens": req.cached}}
        if req.stream:
            self._chunk(req, None, reason, usage)
            self.send(Result(req.req_id, {"chunks": True, "usage": usage, "cancelled": req.req_id in self.cancelled}))
        else:
            content = "".join(req.text)
            if req.method == "chat":
                choice = {"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None,
                          "finish_reason": reason}
                obj = {"id": "chatcmpl-" + req.ident, "object": "chat.completion"}
            else:
                choice = {"text": content, "index": 0, "logprobs": None, "finish_reason": reason}
                obj = {"id": "cmpl-" + req.ident, "object": "text_completion"}
            self.send(Result(req.req_id, {**obj, "created": req.created, "model": self.name, "choices": [choice],
                                          "usage": usage}))
        self.stats.requests += 1
        self._release(s)

    def _release(self, s: _Slot, clear: bool = False) -> None:
        if s.req is not None:
            self.lc.llama_sampler_free(s.req.sampler)
            self.cancelled.discard(s.req.req_id)
        s.req, s.pending, s.logits_at = None, [], -1
        if clear:
            self.lc.llama_memory_seq_rm(self.mem, s.seq, 0, -1)
            s.cache = []

    # -- requests --------------------------------------------------------------

    def _request(self, msg: Any) -> _Request:
        kw = {**_DEFAULTS[msg.method], **{k: v for k, v in msg.kwargs.items() if v is not None}}
        stop = list(kw.get("stop") or [])  # the router made it a list of strings
        if msg.method == "chat":
            # tools as llama_cpp passes them: to the template (tool_choice auto or none: text)
            result = self.formatter(messages=kw["messages"], **{k: kw.get(k) for k in TOOL_KEYS})
            prompt = self.llm.tokenize(result.prompt.encode("utf-8"), add_bos=not result.added_special,
                                       special=True)
            if result.stop is not None:
                stop += result.stop if isinstance(result.stop, list) else [result.stop]
        else:
            text = kw.get("prompt", "")
            if isinstance(text, list):  # token ids
                prompt = check_tokens(text, self.n_vocab)
            else:
                prompt = self.llm.tokenize(text.encode("utf-8"), special=True) if text else [self.llm.token_bos()]
        grammar = response_grammar(kw.get("response_format"))
        if len(prompt) >= self.n_ctx_seq:
            raise ValueError(f"Requested tokens ({len(prompt)}) exceed context window of {self.n_ctx_seq}")
        max_tokens = kw.get("max_tokens")
        if max_tokens is None or max_tokens <= 0:
            max_tokens = self.n_ctx_seq - len(prompt)
        return _Request(msg.req_id, msg.method, msg.stream, prompt, [s for s in stop if s], max_tokens,
                        self._sampler(kw, grammar))

    def _sampler(self, kw: dict[str, Any], grammar: str | None):
        lc = self.lc
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())

        def add(s):
            if not s:
                lc.llama_sampler_free(chain)
                raise ValueError("invalid sampling parameters or grammar")
            lc.llama_sampler_chain_add(chain, s)

        bias = kw.get("logit_bias") or {}
        if bias:
            arr = (lc.llama_logit_bias * len(bias))()
            for i, (t, v) in enumerate(bias.items()):
                arr[i].token, arr[i].bias = int(t), float(v)
            add(lc.llama_sampler_init_logit_bias(self.n_vocab, len(bias), arr))
        add(lc.llama_sampler_init_penalties(self.n_vocab, 64, float(kw["repeat_penalty"]),
                                            float(kw.get("frequency_penalty", 0.0)),
                                            float(kw.get("presence_penalty", 0.0))))
        if grammar:
            add(lc.llama_sampler_init_grammar(self.vocab, grammar.encode(), b"root"))
        temp = float(kw["temperature"])
        seed = kw.get("seed")
        seed = 0xFFFFFFFF if seed is None else int(seed) & 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: random
        if temp < 0:
            add(lc.llama_sampler_init_dist(seed))
        elif temp == 0:
            add(lc.llama_sampler_init_greedy())
        else:
            add(lc.llama_sampler_init_top_k(int(kw["top_k"])))
            add(lc.llama_sampler_init_typical(float(kw.get("typical_p", 1.0)), 1))
            add(lc.llama_sampler_init_top_p(float(kw["top_p"]), 1))
            add(lc.llama_sampler_init_min_p(float(kw["min_p"]), 1))
            add(lc.llama_sampler_init_temp(temp))
            add(lc.llama_sampler_init_dist(seed))
        return chain


def _chat_formatter(llm: Any):
    """The formatter llama_cpp itself would use for this model, or None (then: serial)."""
    from llama_cpp import llama_chat_format as cf  # noqa: PLC0415

    if llm.chat_handler is not None:
        return None
    name = llm.chat_format
    template = {"chat_template.default": llm.metadata.get("tokenizer.chat_template")}.get(name)
    if name and name.startswith("chat_template.") and template is None:
        template = llm.metadata.get("tokenizer." + name)
    if template:
        eos, bos = llm.token_eos(), llm.token_bos()
        return cf.Jinja2ChatFormatter(
            template=template,
            eos_token=llm._model.token_get_text(eos) if eos != -1 else "",  # noqa: SLF001
            bos_token=llm._model.token_get_text(bos) if bos != -1 else "",  # noqa: SLF001
            stop_token_ids=[eos],
        )
    fn = getattr(cf, "format_" + (name or "").replace("-", "_").replace(".", "_"), None)
    return fn if callable(fn) else None


def response_grammar(response_format: dict | None) -> str | None:
    """GBNF for OpenAI's JSON mode (``json_object``, with or without a schema; the
    router turns ``json_schema`` into that), as llama_cpp builds it."""
    if not response_format or response_format.get("type") != "json_object":
        return None
    from llama_cpp import llama_grammar  # noqa: PLC0415

    schema = response_format.get("schema")
    if schema:
        import json  # noqa: PLC0415

        return llama_grammar.json_schema_to_gbnf(json.dumps(schema))
    return llama_grammar.JSON_GBNF
