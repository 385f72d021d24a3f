"""Typed stub of the native extension (csrc/module.cpp)."""

from typing import TypedDict

class LlamaError(RuntimeError):
    """Any llama.cpp failure; the message names the file and the reason."""

class BufferRow(TypedDict):
    buffer_type: str
    device: str
    host: bool
    model: int
    context: int
    compute: int
    output: int

class Facts(TypedDict):
    architecture: str
    name: str
    n_layer: int
    n_ctx_train: int
    n_embd: int
    n_head: int
    n_expert: int
    n_vocab: int
    n_params: int
    model_size: int
    devices: list[str]

class ProbeResult(TypedDict):
    rows: list[BufferRow]
    facts: Facts
    n_ctx: int
    n_seq_max: int
    log: list[str]

class Device(TypedDict):
    index: int
    name: str
    description: str
    type: str
    free: int
    total: int

def probe(path: str, model_params: int, context_params: int, n_outputs: int) -> ProbeResult: ...
def live_breakdown(ctx: int) -> list[BufferRow]: ...
def devices() -> list[Device]: ...
def metadata(path: str) -> dict[str, int | float | bool | str | tuple[str, int]]: ...
def device_handle(name: str) -> int: ...
def buffer_type_handle(name: str) -> int: ...
def tensor_sizes(path: str) -> list[tuple[str, int]]: ...
def add_rpc_servers(endpoints: list[str]) -> list[str]: ...
def buffer_type_name(buft: int) -> str: ...
def device_buffer_type(name: str) -> str: ...
def max_devices() -> int: ...
def max_tensor_buft_overrides() -> int: ...
