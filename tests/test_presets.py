import pytest

from pyllmrouter.config import MiB
from pyllmrouter.presets import PresetError, read_preset, scan_models_dir


def write(tmp_path, text):
    p = tmp_path / "models.ini"
    p.write_text(text)
    return p


def test_llama_server_preset_with_every_key_style(tmp_path):
    p = write(tmp_path, """version = 1
; comment
[*]
c = 8192
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

[embed]
model = /m/bge.gguf
embeddings = true
c = 512
no-mmap = true
""")
    preset = read_preset(p)
    chat, embed = preset.models
    assert preset.router == {"margin": 256 * MiB}
    assert chat.name == "chat" and chat.aliases == ("assistant", "helper")
    s = chat.spec
    assert (s.path, s.n_ctx, s.n_gpu_layers, s.type_k, s.type_v, s.flash_attn, s.n_seq_max) == \
        ("/m/chat.gguf", 8192, -1, "q8_0", "q8_0", "on", 4)
    assert s.tensor_split == (3.0, 1.0)
    assert chat.devices == ("CUDA0", "CUDA1") and chat.persistent and chat.load_on_startup
    assert chat.ttl == 600 and chat.stop_timeout == 3
    # the projector is memory: part of the spec the probe measures, and of the engine's arguments
    assert (s.mmproj, s.mmproj_offload, s.image_max_tokens) == ("/m/chat-mmproj.gguf", False, 256)
    assert "--mmproj" not in chat.args
    spec_args = s.to_args()
    assert spec_args[spec_args.index("--mmproj") + 1] == "/m/chat-mmproj.gguf" and "--no-mmproj-offload" in spec_args
    assert spec_args[spec_args.index("--image-max-tokens") + 1] == "256"
    # so is a draft model and what sizes its buffers
    assert (s.draft, s.draft_n_gpu_layers, s.draft_type_k, s.spec_type, s.draft_n_max) == \
        ("/m/chat-draft.gguf", 12, "q8_0", "draft-simple", 6)
    assert spec_args[spec_args.index("-md") + 1] == "/m/chat-draft.gguf" and "--spec-type" not in chat.args
    # and LoRA adapters
    assert s.lora == (("/m/style.gguf", 0.5), ("/m/tone.gguf", 1.0))
    assert spec_args[spec_args.index("--lora-scaled") + 1] == "/m/style.gguf:0.5,/m/tone.gguf:1"
    # llama-server's other keys reach the engine as llama-server's router passes them to a child
    # (a negated key as the negated flag), checked by llama.cpp's own parser
    args = chat.args
    assert args[args.index("--chat-template") + 1] == "chatml" and "--jinja" in args
    assert args[args.index("--reasoning-format") + 1] == "deepseek" and args[args.index("--temperature") + 1] == "0.5"
    assert "--no-context-shift" in args and "--context-shift" not in args
    # [*] gives defaults, the section overrides them
    assert embed.spec.n_ctx == 512 and embed.spec.n_gpu_layers == 8 and embed.spec.embedding
    assert embed.spec.use_mmap is False


@pytest.mark.parametrize("text, message", [
    ("[a]\nmodel = x.gguf\nwarp-speed = 9\n", r"models.ini:3: key 'warp-speed' in \[a\]: unknown key"),
    ("[a]\nmodel = x.gguf\ntemp = hot\n", r"models.ini:3: key 'temp' in \[a\]: argument --temp"),
    ("[a]\nmodel = x.gguf\nreasoning-format = loud\n", r"models.ini:3: key 'reasoning-format' in \[a\]"),
    ("[a]\nmodel = x.gguf\nc = lots\n", r"models.ini:3: key 'c': invalid literal"),
    ("[a]\nmodel = x.gguf\nctk = q3\n", r"models.ini:3: key 'ctk': expected one of"),
    ("[a]\nmodel = x.gguf\nflash-attn = maybe\n", r"models.ini:3: key 'flash-attn'"),
    ("[a]\nmodel = x.gguf\nc = -5\n", r"models.ini:3: key 'c' in \[a\]: n_ctx=-5"),
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
    projectors = {m.name: m.spec.mmproj for m in scan_models_dir(tmp_path)}
    assert projectors == {"llama-3b-Q4": None, "gemma-vision": str(mm / "mmproj-F16.gguf"), "kimi": None,
                          "split": None}
