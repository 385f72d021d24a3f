"""Bad model files give a ProbeError naming the file and the reason; the process lives on."""

import os

import pytest

from pyllmrouter import ModelSpec, ProbeError, probe


def _check_still_probes(tiny):
    assert probe(ModelSpec(tiny["tiny-llama"], n_ctx=256), use_cache=False).total > 0


@pytest.mark.parametrize(
    "content, reason",
    [
        (None, "file not found"),
        (b"", "empty file"),
        (os.urandom(4096), "not a GGUF file"),
        (b"GGML" + b"\0" * 64, "not a GGUF file"),
        (b"GGUF\x03\x00\x00\x00", "failed to read header"),
        (b"GGUF\x03\x00\x00\x00" + b"\xff" * 16, "cannot load model"),
    ],
    ids=["missing", "empty", "random", "wrong-magic", "truncated-header", "garbage-counts"],
)
def test_bad_files(tmp_path, tiny, content, reason):
    path = tmp_path / "bad.gguf"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ProbeError, match=reason) as e:
        probe(ModelSpec(path))
    assert e.value.path == str(path)
    assert str(path) in str(e.value)
    _check_still_probes(tiny)


def test_truncated_tensor_data(tmp_path, tiny):
    path = tmp_path / "cut.gguf"
    data = tiny["tiny-llama"].read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ProbeError, match="not within the file bounds"):
        probe(ModelSpec(path))
    _check_still_probes(tiny)


def test_unknown_architecture(tmp_path, tiny):
    data = tiny["tiny-llama"].read_bytes()
    # same length, so every offset in the file stays valid
    path = tmp_path / "alien.gguf"
    path.write_bytes(data.replace(b"\x05\x00\x00\x00\x00\x00\x00\x00llama", b"\x05\x00\x00\x00\x00\x00\x00\x00zzzzz", 1))
    with pytest.raises(ProbeError, match="unknown model architecture: 'zzzzz'"):
        probe(ModelSpec(path))
    _check_still_probes(tiny)


def test_directory_is_not_a_model(tmp_path):
    with pytest.raises(ProbeError, match="not a regular file"):
        probe(ModelSpec(tmp_path))


def test_missing_shard_is_named(tmp_path):
    first = tmp_path / "big-00001-of-00002.gguf"
    first.write_bytes(b"GGUF")
    with pytest.raises(ProbeError, match="big-00002-of-00002.gguf: file not found"):
        probe(ModelSpec(first))


def test_unknown_device_lists_the_known_ones(tiny):
    with pytest.raises(ProbeError, match="invalid device: CUDA7; devices here: .*CPU"):
        probe(ModelSpec(tiny["tiny-llama"], ("-dev", "CUDA7")))


def test_with_several_bad_files_the_projector_is_named_first_then_the_model(tmp_path, tiny):
    # the projector, the model and the draft are measured at once; the error names the
    # same file whatever finishes first
    cut = tmp_path / "cut.gguf"
    data = tiny["tiny-llama"].read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    not_a_projector = str(tiny["tiny-moe"])
    for _ in range(3):
        with pytest.raises(ProbeError, match="cannot load it as a projector") as e:
            probe(ModelSpec(cut, ("--mmproj", str(not_a_projector), "-md", str(cut)), n_ctx=256), use_cache=False)
        assert e.value.path == not_a_projector
        with pytest.raises(ProbeError, match="not within the file bounds") as e:
            probe(ModelSpec(cut, ("-md", str(cut)), n_ctx=256), use_cache=False)
        assert e.value.path == str(cut) and "draft" not in str(e.value)  # the model's error, not the draft's
    _check_still_probes(tiny)
