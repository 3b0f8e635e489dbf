"""corral's block quantizers write the bytes ggml's reference quantizers write (what llama-quantize uses
without an importance matrix): the K-quants are corral's own, the 32-element types gguf-py's.

ggml-quants.c is compiled from the llama-cpp-python sdist at test time (ggml_reference.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import ggml_reference
from corral.quantize import kquants
from corral.quantize.driver import convert_tensor
from corral.gguf import GGUFFile


@pytest.fixture(scope="module")
def ggml(llama_cpp_dir) -> ggml_reference.GGMLQuants:
    return ggml_reference.load(llama_cpp_dir)


def awkward_rows(seed: int, columns: int = 1024) -> np.ndarray:
    """Rows that reach every branch: normal weights at many scales, heavy tails, all-zero, constant,
    all-positive and all-negative rows, tiny values, zero sub-blocks, outliers, quantized-looking grids,
    signed zeros."""
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((48, columns)) * np.exp(rng.uniform(-8, 4, (48, 1)))
    rows[0] = 0
    rows[1] = 3.0
    rows[2, :256] = 1e-20
    rows[3] = np.abs(rows[3]) + 1
    rows[4] = -np.abs(rows[4])
    rows[5, :16] = 0
    rows[5, 32:64] = 0
    rows[6, ::7] = 50
    rows[7] = rng.standard_t(1.5, columns)
    rows[8] = np.round(rows[8] * 4) / 4
    rows[9] = rng.integers(-3, 4, columns)
    rows[10, 100] = 1e4
    rows[11, :64] = np.where(np.arange(64) % 3 == 0, -0.0, 0.0)  # zero blocks of both signs of zero
    rows[11, 64:96] = np.where(np.arange(32) % 2, 1.0, -0.0)
    rows[12, :32] = -0.0
    return rows.astype(np.float32)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k_quant_bytes_equal_ggml(ggml, type_name, seed):
    rows = awkward_rows(seed)
    np.testing.assert_array_equal(kquants.quantize_k(rows, type_name), ggml.quantize(rows, type_name))


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_bytes_equal_ggml_across_chunks_and_threads(ggml, type_name, monkeypatch):
    monkeypatch.setattr(kquants, "CHUNK_BLOCKS", 7)  # chunks that end mid-row, on several threads
    rows = (np.random.default_rng(3).standard_normal((64, 768)) * 0.02).astype(np.float32)
    np.testing.assert_array_equal(kquants.quantize_k(rows, type_name), ggml.quantize(rows, type_name))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_driver_converts_a_tensor_as_ggml_does(ggml, qtype, tmp_path):
    """The driver's own path (F16 read exactly to float32, then the block quantizer) as llama-quantize's."""
    import gguf

    rows = awkward_rows(4, 512).astype(np.float16)
    writer = gguf.GGUFWriter(tmp_path / "f16.gguf", "llama")
    writer.add_tensor("w.weight", rows)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    source = GGUFFile.open(tmp_path / "f16.gguf")
    try:
        converted = convert_tensor(source, "w.weight", qtype)
    finally:
        source.close()
    np.testing.assert_array_equal(converted, ggml.quantize(rows.astype(np.float32), qtype.name))


def test_k_quants_reject_rows_that_are_not_whole_super_blocks():
    with pytest.raises(ValueError, match="multiple of 256"):
        kquants.quantize_k(np.zeros((2, 320), np.float32), "Q4_K")
