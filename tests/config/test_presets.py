import pytest

from pyllmrouter.config import MiB
from pyllmrouter.presets import PresetError, read_preset, scan_models_dir


def write(tmp_path, text):
    p = tmp_path / "models.ini"
    p.write_text(text)
    return p


def test_llama_server_preset_with_every_key_style(tmp_path):
    from pyllmrouter.engine.backend import native

    p = write(tmp_path, """version = 1
; comment
[*]
c = 8192                 ; an inline comment, as llama-server's INI grammar allows
n-gpu-layers = 8
jinja = true
memory-margin = 256

[chat]
model = /m/chat.gguf
alias = assistant, helper
ngl = all
LLAMA_ARG_CACHE_TYPE_K = q8_0
--cache-type-v = q8_0
flash-attn = on
np = 4
load-on-startup = true
stop-timeout = 3
ttl = 600
persistent = true
devices = CUDA0,CUDA1
tensor-split = 3,1
chat-template = chatml
reasoning-format = deepseek
temp = 0.5
no-context-shift = true
mmproj = /m/chat-mmproj.gguf
no-mmproj-offload = true
image-max-tokens = 256
model-draft = /m/chat-draft.gguf
ngld = 12
ctkd = q8_0
spec-type = draft-simple
spec-draft-n-max = 6
lora-scaled = /m/style.gguf:0.5,/m/tone.gguf:1
swa-full = true
ctx-checkpoints = 4

[embed]
model = /m/bge.gguf
embeddings = true
c = 512
lm = none
""")
    preset = read_preset(p)
    chat, embed = preset.models
    assert preset.router == {"margin": 256 * MiB}
    assert chat.name == "chat" and chat.aliases == ("assistant", "helper")
    assert chat.spec.path == "/m/chat.gguf" and embed.spec.path == "/m/bge.gguf"
    assert chat.devices == ("CUDA0", "CUDA1") and chat.persistent and chat.load_on_startup
    assert chat.ttl == 600 and chat.stop_timeout == 3
    # every llama-server key is an argument of the model, as llama-server's router passes it to
    # a child: llama.cpp says what it means (a negated key as the negated flag)
    args = chat.spec.args
    assert "--alias" not in args and "--model" not in args  # the router's: routing, and the file itself
    assert args[args.index("--chat-template") + 1] == "chatml" and "--jinja" in args
    assert "--no-context-shift" in args and "--context-shift" not in args
    nat = native()
    p = nat.server_params(chat.spec.to_args())
    assert (p["n_ctx"], p["n_gpu_layers"], p["type_k"], p["type_v"], p["flash_attn"], p["n_parallel"]) == \
        (8192, -2, "q8_0", "q8_0", "on", 4)
    assert (p["mmproj"], p["mmproj_offload"]) == ("/m/chat-mmproj.gguf", False)
    assert (p["draft"], p["draft_n_gpu_layers"]) == ("/m/chat-draft.gguf", 12)
    assert p["lora"] == ["/m/style.gguf", "/m/tone.gguf"]
    assert p["swa_full"] and p["ctx_checkpoints"] == 4 and not p["kv_unified"]  # -np 4 given: a cache per slot
    # [*] gives defaults, the section overrides them
    e = nat.server_params(embed.spec.to_args())
    assert (e["n_ctx"], e["n_gpu_layers"], e["embedding"]) == (512, 8, True)
    assert embed.spec.args[embed.spec.args.index("--load-mode") + 1] == "none"


def test_a_preset_that_names_only_the_model_means_llama_servers_defaults(tmp_path, tiny):
    from pyllmrouter.engine.backend import native

    (m,) = read_preset(write(tmp_path, f"[m]\nmodel = {tiny['tiny-llama']}\n")).models
    assert m.spec.args == () and m.devices is None and m.aliases == ()
    p = native().server_params(m.spec.to_args())
    # llama-server's own: slots auto (4, one unified KV cache), the training context (the fit may
    # shrink it), no full-size SWA cache, 32 checkpoints per slot; ours: no host prompt cache
    assert (p["n_parallel"], p["kv_unified"], p["n_ctx"], p["ctx_auto"], p["swa_full"], p["ctx_checkpoints"]) == \
        (4, True, 2048, True, False, 32)
    assert p["cache_ram"] == 0 and p["fit"]


@pytest.mark.parametrize("text, message", [
    ("[a]\nmodel = x.gguf\nwarp-speed = 9\n", r"models.ini:3: key 'warp-speed' in \[a\]: unknown key"),
    ("[a]\nmodel = x.gguf\ntemp = hot\n", r"models.ini:3: key 'temp' in \[a\]: argument --temp"),
    ("[a]\nmodel = x.gguf\nreasoning-format = loud\n", r"models.ini:3: key 'reasoning-format' in \[a\]"),
    ("[a]\nmodel = x.gguf\nc = lots\n", r"models.ini:3: key 'c' in \[a\]: argument -c = 'lots'"),
    ("[a]\nmodel = x.gguf\nctk = q3\n", r"models.ini:3: key 'ctk' in \[a\]: argument -ctk = 'q3'"),
    ("[a]\nmodel = x.gguf\nflash-attn = maybe\n", r"models.ini:3: key 'flash-attn' in \[a\]"),
    ("[a]\nc = 5\n", r"\[a\]: no 'model' key"),
    ("[a]\nmodel = x\n[a]\nmodel = y\n", r"models.ini:3: section \[a\] appears twice"),
    ("[a]\nmodel = x\nmemory-margin = 5\n", r"models.ini:3: key 'memory-margin' applies to the whole router"),
    ("c = 5\n[a]\nmodel = x\n", r"models.ini:1: key 'c' outside a section"),
    ("[a\nmodel = x\n", r"models.ini:1: malformed section header"),
    ("[a]\njust words\n", r"models.ini:2: expected 'key = value'"),
    ("[a]\nmodel = x\nttl = 0\n", r"ttl must be > 0"),
])
def test_bad_presets_name_file_line_and_key(tmp_path, text, message):
    with pytest.raises(PresetError, match=message):
        read_preset(write(tmp_path, text))


def test_missing_preset_file(tmp_path):
    with pytest.raises(PresetError, match="preset file not found"):
        read_preset(tmp_path / "nope.ini")


def test_models_dir_follows_llama_server_rules(tmp_path):
    (tmp_path / "llama-3b-Q4.gguf").write_bytes(b"GGUF")
    (tmp_path / "notes.txt").write_text("x")
    mm = tmp_path / "gemma-vision"
    mm.mkdir()
    (mm / "gemma-vision-Q8_0.gguf").write_bytes(b"GGUF")
    (mm / "mmproj-F16.gguf").write_bytes(b"GGUF")
    big = tmp_path / "kimi"
    big.mkdir()
    for i in (1, 2, 3):
        (big / f"kimi-{i:05d}-of-00003.gguf").write_bytes(b"GGUF")
    (tmp_path / "split-00001-of-00002.gguf").write_bytes(b"GGUF")
    (tmp_path / "split-00002-of-00002.gguf").write_bytes(b"GGUF")
    models = {m.name: m.spec.path for m in scan_models_dir(tmp_path)}
    assert models == {
        "llama-3b-Q4": str(tmp_path / "llama-3b-Q4.gguf"),
        "gemma-vision": str(mm / "gemma-vision-Q8_0.gguf"),
        "kimi": str(big / "kimi-00001-of-00003.gguf"),
        "split": str(tmp_path / "split-00001-of-00002.gguf"),
    }
    # the projector beside a model is its mmproj (and is measured with it); a stray
    # projector at the top level is no model
    (tmp_path / "gemma-mmproj-f16.gguf").write_bytes(b"GGUF")
    projectors = {m.name: m.spec.args for m in scan_models_dir(tmp_path)}
    assert projectors == {"llama-3b-Q4": (), "gemma-vision": ("--mmproj", str(mm / "mmproj-F16.gguf")), "kimi": (),
                          "split": ()}
