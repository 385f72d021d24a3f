import pytest

from pyllmrouter import ModelSpec, SpecError


@pytest.mark.parametrize(
    "field, value",
    [("n_ctx", -1), ("n_batch", 0), ("n_ubatch", 0), ("n_seq_max", 0), ("n_seq_max", 1000),
     ("n_gpu_layers", -2), ("split_mode", "diagonal"), ("type_k", "q3_k"), ("type_v", "int4"),
     ("flash_attn", "maybe"), ("n_cpu_moe", -1), ("tensor_split", (0.0, 0.0))],
)
def test_impossible_values_name_the_field(field, value):
    with pytest.raises(SpecError, match=field):
        ModelSpec("m.gguf", **{field: value})


def test_round_trip_through_dict_keeps_equality():
    spec = ModelSpec("m.gguf", n_ctx=1024, tensor_split=[3, 1], devices=["CUDA0", "CUDA1"],
                     tensor_overrides=[("blk\\.0\\.", "CPU")], type_k="q8_0")
    again = ModelSpec.from_dict(spec.to_dict())
    assert again == spec
    assert hash(again) == hash(spec)
    assert again.tensor_split == (3.0, 1.0)


def test_replace_validates():
    spec = ModelSpec("m.gguf")
    assert spec.replace(n_ctx=8192).n_ctx == 8192
    with pytest.raises(SpecError):
        spec.replace(n_ctx=-5)
