import pytest

from pyllmrouter import ModelSpec, SpecError


@pytest.mark.parametrize(
    "field, value",
    [("n_ctx", -1), ("n_gpu_layers", -2), ("n_cpu_moe", -1), ("tensor_split", (0.0, 0.0)),
     ("draft_n_gpu_layers", -3), ("path", "")],
)
def test_impossible_values_name_the_field(field, value):
    with pytest.raises(SpecError, match=field):
        ModelSpec(**{"path": "m.gguf", field: value})


def test_arguments_are_a_sequence_not_a_string():
    with pytest.raises(SpecError, match="args"):
        ModelSpec("m.gguf", "-c 8192")


def test_round_trip_through_dict_keeps_equality():
    spec = ModelSpec("m.gguf", ("-c", "1024", "-ctk", "q8_0"), tensor_split=[3, 1],
                     tensor_overrides=[("blk\\.0\\.", "CPU")], draft_devices=["CUDA1"])
    again = ModelSpec.from_dict(spec.to_dict())
    assert again == spec
    assert hash(again) == hash(spec)
    assert again.tensor_split == (3.0, 1.0)


def test_the_arguments_come_first_and_the_routers_settings_after():
    # llama.cpp's parser takes the last value: the router's own default goes before the
    # user's arguments (theirs wins), its fit after them (the fit's wins)
    spec = ModelSpec("m.gguf", ("--cache-ram", "512", "-c", "8192"), n_ctx=4096, n_gpu_layers=10)
    args = spec.to_args()
    assert args[:2] == ["-m", "m.gguf"]
    assert args.index("--cache-ram") < args.index("512")
    assert [a for a in args if a == "--cache-ram"] == ["--cache-ram", "--cache-ram"]
    assert args[-4:] == ["-c", "4096", "-ngl", "10"]
    assert ModelSpec("m.gguf").to_args() == ["-m", "m.gguf", "--cache-ram", "0"]  # llama-server's defaults, but one


def test_replace_validates():
    spec = ModelSpec("m.gguf")
    assert spec.replace(n_ctx=8192).n_ctx == 8192
    with pytest.raises(SpecError):
        spec.replace(n_ctx=-5)


def test_files_named_by_the_arguments(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"GGUF")
    b.write_bytes(b"GGUF")
    spec = ModelSpec("m.gguf", ("--mmproj", str(a), "--lora-scaled", f"{a}:0.5,{b}:1", "-c", "512",
                                "--chat-template", "chatml"))
    assert spec.files() == [str(a), str(a), str(b)]
