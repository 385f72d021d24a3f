"""The probe predicts, byte for byte, what a real load allocates: the model's llama.cpp
server engine, loaded from the same arguments."""

import itertools

import pytest

from pyllmrouter import ModelSpec, ProbeError, probe
from pyllmrouter.engine.loader import load
from pyllmrouter.memory import aggregate
from pyllmrouter.engine.probe import live_breakdown

GRID = [
    ("-c", str(n_ctx), "-np", str(seqs), "--kv-unified" if unified else "--no-kv-unified", "-ctk", kv, "-ctv", kv,
     "-fa", fa)
    for n_ctx, (seqs, unified), (kv, fa) in itertools.product(
        (256, 1024), ((1, False), (3, False), (4, True)),
        (("f16", "off"), ("f16", "on"), ("q8_0", "on"), ("f16", "auto"))
    )
]


def _without_output(devices):
    return [(d.device, d.weights, d.kv, d.compute) for d in devices]


@pytest.fixture()
def loaded():
    """load(spec) -> (the live buffer rows, the context size) of an engine loaded for spec."""
    engines = []

    def rows(spec):
        engines.append(load(spec))
        return live_breakdown(engines[-1]), engines[-1].n_ctx

    yield rows
    for e in engines:
        e.close()


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-moe"])
@pytest.mark.parametrize("args", GRID, ids=lambda a: "-".join(a[1::2] + a[4:5]))
def test_decoder_probe_equals_live_allocation(tiny, loaded, model, args):
    spec = ModelSpec(tiny[model], args)
    est = probe(spec)
    live, n_ctx = loaded(spec)
    assert _without_output(est.devices) == _without_output(aggregate(live))
    assert est.n_seq_max == int(args[3]) and est.n_ctx == n_ctx


@pytest.mark.parametrize("fa", ["on", "off"])
@pytest.mark.parametrize("n_ctx", [128, 512])
def test_embedding_probe_equals_live_allocation(tiny, loaded, fa, n_ctx):
    spec = ModelSpec(tiny["tiny-bert"], ("--embedding", "-fa", fa), n_ctx=n_ctx)
    est = probe(spec)
    assert _without_output(est.devices) == _without_output(aggregate(loaded(spec)[0]))
    assert est.devices[0].kv == 0  # an encoder keeps no KV cache


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-moe", "tiny-bert"])
def test_buffer_types_match_exactly_without_mmap(tiny, loaded, model):
    spec = ModelSpec(tiny[model], ("-lm", "none", *(("--embedding",) if model == "tiny-bert" else ())), n_ctx=512)
    est = probe(spec)
    live = loaded(spec)[0]
    probed = {b.buffer_type: (b.model, b.context, b.compute) for b in est.buffers if b.buffer_type != "output"}
    assert probed == {b.buffer_type: (b.model, b.context, b.compute) for b in live}


def test_mmap_moves_weights_to_a_mapped_buffer_of_the_same_size(tiny, loaded):
    spec = ModelSpec(tiny["tiny-llama"], n_ctx=512)
    live = {b.buffer_type: b for b in loaded(spec)[0]}
    est = probe(spec)
    assert live["CPU_Mapped"].model == sum(b.model for b in est.buffers)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-moe"])
def test_kv_bytes_grow_linearly_with_context(tiny, model):
    kv = [probe(ModelSpec(tiny[model], ("-np", "1"), n_ctx=n)).devices[0].kv for n in (256, 512, 1024, 2048)]
    assert kv[0] > 0
    assert kv == [kv[0] * k for k in (1, 2, 4, 8)]


def test_quantized_cache_is_smaller(tiny):
    f16 = probe(ModelSpec(tiny["tiny-llama"], ("-fa", "on"), n_ctx=2048)).devices[0].kv
    q8 = probe(ModelSpec(tiny["tiny-llama"], ("-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"), n_ctx=2048))
    # q8_0 stores 32 values in 34 bytes, f16 in 64
    assert q8.devices[0].kv * 64 == f16 * 34


def test_output_buffer_is_counted_in_host_memory(tiny):
    one = probe(ModelSpec(tiny["tiny-llama"], ("-np", "1"), n_ctx=512))
    four = probe(ModelSpec(tiny["tiny-llama"], ("-np", "4"), n_ctx=512))
    n_vocab = one.facts.n_vocab
    assert one.devices[-1].output == n_vocab * 4
    assert four.devices[-1].output == 4 * n_vocab * 4
    assert one.total == sum(d.total for d in one.devices)


def test_quantized_v_cache_without_flash_attention_is_a_clear_error(tiny):
    spec = ModelSpec(tiny["tiny-llama"], ("-ctv", "q8_0", "-fa", "off"))
    with pytest.raises(ProbeError, match="tiny-llama.gguf: cannot create a context: .*flash") as e:
        probe(spec)
    assert e.value.path == str(tiny["tiny-llama"])


ENGINE_GRID = [("-np", "1", "--no-kv-unified"), ("-np", "4", "--kv-unified"), ("-np", "4", "--no-kv-unified")]


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-moe"])
@pytest.mark.parametrize("fa", ["on", "off"])
@pytest.mark.parametrize("settings", ENGINE_GRID,
                         ids=lambda s: f"np{s[1]}-{'kvu' if s[2] == '--kv-unified' else 'slots'}")
def test_probe_equals_the_engines_allocation_per_slot_layout(tiny, model, fa, settings):
    """llama-server's -np 1, -np 4 with a unified KV cache and with one per slot."""
    from pyllmrouter.engine.backend import native

    spec = ModelSpec(tiny[model], ("-fa", fa, *settings), n_ctx=1024)
    est = probe(spec)
    engine = native().Engine([*spec.to_args(), "--log-disable"])
    try:
        engine.load()
        assert _without_output(est.devices) == _without_output(aggregate(live_breakdown(engine)))
        assert engine.n_parallel == int(settings[1]) == est.n_seq_max
    finally:
        engine.close()


def test_the_host_prompt_cache_is_counted_at_its_cap(tiny, loaded):
    """llama-server's --cache-ram: host memory the engine may fill with prompt states, so
    admission reserves its cap; the engine gets the very same cap."""
    spec = ModelSpec(tiny["tiny-llama"], n_ctx=512)
    plain, cached = probe(spec), probe(spec.with_args("--cache-ram", "64"))
    assert cached.devices[-1].cache == 64 << 20 and plain.devices[-1].cache == 0
    assert cached.total - plain.total == 64 << 20
    assert "--cache-ram" in spec.to_args() and spec.to_args()[spec.to_args().index("--cache-ram") + 1] == "0"
    live, _ = loaded(spec.with_args("--cache-ram", "64"))  # the engine loads with it (the cache fills later)
    assert _without_output(aggregate(live)) == _without_output(plain.devices)
    with pytest.raises(ProbeError, match="--cache-ram -1 .* cannot be admitted"):
        probe(ModelSpec(tiny["tiny-llama"], ("--cache-ram", "-1")))
