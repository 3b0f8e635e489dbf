"""A bad model file fails with a typed error that says what is wrong; a good one reads like gguf's reader."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from tiny_gguf import write_tiny_llama

import corral
from corral.errors import (
    GGUFError,
    MissingTensorError,
    NotGGUFError,
    TruncatedGGUFError,
    UnknownArchitectureError,
    UnsupportedTensorTypeError,
)
from corral.gguf import GGUFFile

Q = gguf.GGMLQuantizationType


def truncate(path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def test_garbage_file_is_not_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"<html>404 not found</html>" * 10)
    with pytest.raises(NotGGUFError, match="not a GGUF file"):
        GGUFFile.open(path)


def test_empty_file_is_not_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"")
    with pytest.raises(NotGGUFError, match="0 bytes"):
        GGUFFile.open(path)


def test_file_cut_inside_the_header_is_truncated(tmp_path):
    path = write_tiny_llama(tmp_path / "model.gguf")
    truncate(path, 300)  # inside the metadata (the vocabulary alone is a few kB)
    with pytest.raises(TruncatedGGUFError, match="header"):
        GGUFFile.open(path)


def test_file_cut_after_the_magic_is_truncated(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    with pytest.raises(TruncatedGGUFError):
        GGUFFile.open(path)


def test_file_cut_inside_the_tensor_data_is_truncated(tmp_path):
    path = write_tiny_llama(tmp_path / "model.gguf")
    last = max(gguf.GGUFReader(path).tensors, key=lambda t: t.data_offset)
    truncate(path, last.data_offset + last.n_bytes // 2)
    with pytest.raises(TruncatedGGUFError, match=f"'{last.name}' extends past the end"):
        GGUFFile.open(path)


def test_unsupported_gguf_version_is_refused(tmp_path):
    path = write_tiny_llama(tmp_path / "model.gguf")
    with open(path, "r+b") as f:
        f.seek(4)
        f.write((99).to_bytes(4, "little"))
    with pytest.raises(GGUFError, match="version 99"):
        GGUFFile.open(path)


def test_unknown_architecture_names_the_known_ones_and_plugins(tmp_path):
    path = write_tiny_llama(tmp_path / "model.gguf", architecture="mamba9")
    with pytest.raises(UnknownArchitectureError, match="'mamba9'") as excinfo:
        corral.load_model(path)
    message = str(excinfo.value)
    assert "gemma3" in message and "llama" in message
    assert "plugin" in message


def test_missing_tensor_is_named(tmp_path):
    path = write_tiny_llama(tmp_path / "model.gguf", drop=["blk.1.ffn_up.weight"])
    with pytest.raises(MissingTensorError, match=r"'blk\.1\.ffn_up\.weight' is missing"):
        corral.load_model(path)


def test_missing_tensor_and_its_fallback_are_both_named(tmp_path):
    # Drops the tied embedding: the error for `output` must say its fallback is gone too.
    path = write_tiny_llama(tmp_path / "model.gguf", drop=["token_embd.weight"])
    with pytest.raises(MissingTensorError, match=r"token_embd\.weight"):
        corral.load_model(path)


def test_unsupported_tensor_type_is_named(tmp_path):
    path = write_tiny_llama(tmp_path / "model.gguf", tensor_types={"blk.0.attn_k.weight": Q.Q8_1})
    with pytest.raises(UnsupportedTensorTypeError, match=r"'blk\.0\.attn_k\.weight' has type Q8_1"):
        corral.load_model(path)


def write_every_value_type(path) -> None:
    writer = gguf.GGUFWriter(str(path), "test")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -(2**31))
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float32("t.f32", 0.1)
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.true", True)
    writer.add_bool("t.false", False)
    writer.add_string("t.string", "héllo ✓")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.25])
    writer.add_array("t.strings", ["x", "", "ünï"])
    writer.add_array("t.bools", [True, False])
    writer.add_tensor("weight", np.arange(64, dtype=np.float32).reshape(2, 32))
    packed = gguf.quants.quantize(np.linspace(-1, 1, 128, dtype=np.float32).reshape(2, 64), Q.Q8_0)
    writer.add_tensor("packed", packed, raw_dtype=Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def reader_metadata(path) -> dict:
    """What gguf.GGUFReader reads, less the header counts it reports as `GGUF.*` fields."""
    fields = gguf.GGUFReader(path).fields
    return {key: field.contents() for key, field in fields.items() if not key.startswith("GGUF.")}


def test_metadata_matches_gguf_reader_for_every_value_type(tmp_path):
    path = tmp_path / "values.gguf"
    write_every_value_type(path)
    assert GGUFFile.open(path).metadata == reader_metadata(path)


def test_metadata_matches_gguf_reader_for_a_tiny_model(tmp_path):
    path = write_tiny_llama(tmp_path / "model.gguf")
    assert GGUFFile.open(path).metadata == reader_metadata(path)


def test_tensor_shapes_types_and_bytes_match_gguf_reader(tmp_path):
    path = tmp_path / "values.gguf"
    write_every_value_type(path)
    opened = GGUFFile.open(path)
    for tensor in gguf.GGUFReader(path).tensors:
        info = opened.tensors[tensor.name]
        assert info.shape == tuple(int(d) for d in reversed(tensor.shape))
        assert info.qtype == tensor.tensor_type
        assert opened.raw(tensor.name).tobytes() == np.asarray(tensor.data).tobytes()


def test_dropping_resident_pages_keeps_every_tensors_bytes(tmp_path):
    opened = GGUFFile.open(write_tiny_llama(tmp_path / "tiny.gguf"))
    before = {name: opened.raw(name).copy() for name in opened.tensors}
    opened.drop_resident_pages()
    assert all(np.array_equal(opened.raw(name), data) for name, data in before.items())
