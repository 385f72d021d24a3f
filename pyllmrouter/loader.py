"""Load a ModelSpec as a ``llama_cpp.Llama`` with exactly the probed parameters.

llama_cpp.Llama builds its own parameter structs from its keyword arguments and
cannot express some fields (devices, tensor buffer-type overrides, flash
attention ``auto``, n_seq_max, kv_unified).  ``load`` passes it the equivalent
keywords, and while it constructs, hands llama.cpp's two constructors
(``llama_model_load_from_file``, ``llama_init_from_model``) the structs that
``params.build`` made for the probe.  So probe and load share one parameter
path, and whatever the probe measured is what gets allocated.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

from ._llama import llama_cpp_module, native
from .params import LlamaParams, build
from .spec import ModelSpec

__all__ = ["load"]

# Construction swaps two module attributes of llama_cpp: one load at a time.
_LOAD_LOCK = threading.Lock()


@contextlib.contextmanager
def _exact_structs(p: LlamaParams) -> Iterator[None]:
    lc = llama_cpp_module()
    load_model, init_context = lc.llama_model_load_from_file, lc.llama_init_from_model

    def load_with_spec(path_model, _params):
        return load_model(path_model, p.model)

    def init_with_spec(model, _params):
        return init_context(model, p.context)

    lc.llama_model_load_from_file, lc.llama_init_from_model = load_with_spec, init_with_spec
    try:
        yield
    finally:
        lc.llama_model_load_from_file, lc.llama_init_from_model = load_model, init_context


def load(spec: ModelSpec, *, verbose: bool = False, **llama_kwargs: Any):
    """A ``llama_cpp.Llama`` for ``spec``; extra keywords (chat_format, seed...) pass through.

    Memory-relevant settings come from the spec only: a keyword that would
    contradict it is an error.
    """
    import llama_cpp  # noqa: PLC0415

    n_ctx_train = None
    if spec.n_ctx == 0:
        meta = native().metadata(spec.path)
        n_ctx_train = meta.get(f"{meta.get('general.architecture')}.context_length")
    p = build(spec, n_ctx_train)
    clash = sorted(set(llama_kwargs) & set(p.llama_kwargs))
    if clash:
        raise TypeError(f"{', '.join(clash)}: set these on the ModelSpec, not as load() keywords")
    with _LOAD_LOCK, _exact_structs(p):
        llm = llama_cpp.Llama(spec.path, verbose=verbose, **p.llama_kwargs, **llama_kwargs)
    # Llama keeps its own copies for bookkeeping; make them the structs in use.
    llm.model_params, llm.context_params = p.model, p.context
    llm._pyllmrouter_params = p  # noqa: SLF001 - keeps override strings and arrays alive
    return llm
