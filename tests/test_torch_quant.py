"""GGUF bytes -> torch weights: bit-exact against gguf.quants, and torch's int4 kernels on the packing."""

import gguf
import numpy as np
import pytest
import torch

from corral.errors import UnsupportedTensorTypeError
from corral.plugins.backends.torch import dequantize as torch_quant, int4_packing

Q = gguf.GGMLQuantizationType

# Byte offsets of each block's fp16 scales (d, and dmin or m where the format has one).
FP16_FIELDS = {
    Q.Q4_0: [0],
    Q.Q4_1: [0, 2],
    Q.Q5_0: [0],
    Q.Q5_1: [0, 2],
    Q.Q8_0: [0],
    Q.Q2_K: [80, 82],
    Q.Q3_K: [108],
    Q.Q4_K: [0, 2],
    Q.Q5_K: [0, 2],
    Q.Q6_K: [208],
}
FLOATS = [Q.F32, Q.F16, Q.BF16]
INT4 = [Q.Q4_0, Q.Q4_1, Q.Q4_K]


def random_raw(qtype: Q, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """Random bytes [rows, row_bytes] of a tensor of `qtype`, every fp16 scale finite."""
    rng = np.random.default_rng(seed)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype in FLOATS:
        values = rng.normal(0, 1, (rows, blocks_per_row * block_size)).astype(np.float32)
        return gguf.quants.quantize(values, qtype).view(np.uint8)
    blocks = rng.integers(0, 256, (rows * blocks_per_row, type_size), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        scales = rng.normal(0, 0.05, rows * blocks_per_row).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, blocks_per_row * type_size)


def cols_of(qtype: Q, raw: np.ndarray) -> int:
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    return raw.shape[1] // type_size * block_size


def reference(qtype: Q, raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(raw.shape[0], -1))


@pytest.mark.parametrize("qtype", list(torch_quant.DEQUANTIZERS), ids=lambda q: q.name)
def test_dequantize_is_bit_exact_against_gguf(qtype):
    raw = random_raw(qtype, rows=6, blocks_per_row=3)
    got = torch_quant.dequantize(torch.from_numpy(raw), qtype, cols_of(qtype, raw))
    assert got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), reference(qtype, raw).view(torch.int32))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0], ids=lambda q: q.name)
def test_dequantize_is_bit_exact_on_blocks_gguf_quantized(qtype):
    values = np.random.default_rng(1).normal(0, 0.02, (8, 128)).astype(np.float32)
    raw = gguf.quants.quantize(values, qtype)
    got = torch_quant.dequantize(torch.from_numpy(raw), qtype, 128)
    assert torch.equal(got, reference(qtype, raw))


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_dequantize_to_bfloat16_rounds_the_exact_float32_values(qtype):
    raw = random_raw(qtype, rows=4, blocks_per_row=2)
    got = torch_quant.dequantize(torch.from_numpy(raw), qtype, cols_of(qtype, raw), torch.bfloat16)
    assert torch.equal(got, reference(qtype, raw).to(torch.bfloat16))


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q5_0, Q.Q5_K], ids=lambda q: q.name)
def test_dequantize_across_many_slabs_matches_one_pass(qtype, monkeypatch):
    monkeypatch.setattr(torch_quant, "SLAB_ELEMENTS", 1)  # one block per slab
    raw = random_raw(qtype, rows=5, blocks_per_row=3)
    got = torch_quant.dequantize(torch.from_numpy(raw), qtype, cols_of(qtype, raw))
    assert torch.equal(got, reference(qtype, raw))


def test_dequantize_returns_a_copy_and_leaves_raw_untouched():
    raw_np = random_raw(Q.F32, rows=2, blocks_per_row=8)
    raw = torch.from_numpy(raw_np.copy())
    got = torch_quant.dequantize(raw, Q.F32, 8)
    got.fill_(0)
    assert np.array_equal(raw.numpy(), raw_np)


def test_dequantize_of_an_unsupported_type_says_which_are():
    with pytest.raises(UnsupportedTensorTypeError, match="Q4_K"):
        torch_quant.dequantize(torch.zeros(1, 66, dtype=torch.uint8), Q.IQ2_XXS, 256)


@pytest.mark.parametrize("qtype", INT4, ids=lambda q: q.name)
def test_int4_codes_rebuild_the_dequantized_weights(qtype):
    raw = random_raw(qtype, rows=4, blocks_per_row=2)
    cols = cols_of(qtype, raw)
    codes, scales, zeros = torch_quant.int4_codes(torch.from_numpy(raw), qtype, cols)
    assert codes.shape == (4, cols) and scales.shape == zeros.shape == (4, cols // 32)
    assert 0 <= codes.min() and codes.max() <= 15
    rebuilt = (codes.float() - 8) * scales.repeat_interleave(32, 1) + zeros.repeat_interleave(32, 1)
    # Only the rounding of zero (m + 8d, or 8*d*sc - dmin*mn) separates the two in float32.
    exact = reference(qtype, raw)
    assert torch.allclose(rebuilt, exact, rtol=0, atol=4e-7 * exact.abs().max().item())


def test_int4_codes_of_a_type_without_an_int4_form_raise():
    raw = torch.from_numpy(random_raw(Q.Q8_0, rows=1, blocks_per_row=1))
    with pytest.raises(UnsupportedTensorTypeError, match="Q4_0, Q4_1, Q4_K"):
        torch_quant.int4_codes(raw, Q.Q8_0, 32)


def test_pack_int4_for_cpu_builds_the_kernel_layout():
    raw = torch.from_numpy(random_raw(Q.Q4_1, rows=32, blocks_per_row=3))
    packed, scales_and_zeros = int4_packing.pack_int4_for_cpu(*torch_quant.int4_codes(raw, Q.Q4_1, 96))
    assert packed.dtype == torch.uint8 and packed.shape == (32, 48)
    assert scales_and_zeros.dtype == torch.bfloat16 and scales_and_zeros.shape == (3, 32, 2)
    assert scales_and_zeros.is_contiguous()


@pytest.mark.parametrize("qtype", INT4, ids=lambda q: q.name)
@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)], ids=["bf16", "fp32"]
)
def test_cpu_int4_matmul_equals_matmul_with_dequantized_weights(qtype, dtype, tolerance):
    raw = random_raw(qtype, rows=32, blocks_per_row=2)
    cols = cols_of(qtype, raw)
    packed, scales_and_zeros = int4_packing.pack_int4_for_cpu(
        *torch_quant.int4_codes(torch.from_numpy(raw), qtype, cols), dtype=dtype
    )
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(0)).to(dtype)
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros).float()
    expected = x.float() @ reference(qtype, raw).T
    assert (got - expected).abs().max() <= tolerance * expected.abs().max()


def test_pack_int4_for_cpu_in_row_slabs_equals_torch_packing_the_whole_tensor(monkeypatch):
    monkeypatch.setattr(int4_packing, "SLAB_ELEMENTS", 1)  # 64 rows per slab
    codes = torch.randint(0, 16, (208, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    ones = torch.ones(208, 2)
    packed, _ = int4_packing.pack_int4_for_cpu(codes, ones, ones)
    assert torch.equal(packed, torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1))


def test_pack_int4_for_cpu_rejects_rows_the_kernel_cannot_take():
    raw = torch.from_numpy(random_raw(Q.Q4_0, rows=8, blocks_per_row=1))
    with pytest.raises(UnsupportedTensorTypeError, match="divisible by 16"):
        int4_packing.pack_int4_for_cpu(*torch_quant.int4_codes(raw, Q.Q4_0, 32))


@pytest.mark.parametrize(("cols", "tiles"), [(640, 8), (576, 4), (96, 2)])
def test_cuda_inner_k_tiles_is_the_widest_that_divides_cols(cols, tiles):
    assert int4_packing._inner_k_tiles(cols) == tiles


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", INT4, ids=lambda q: q.name)
def test_cuda_int4_matmul_equals_matmul_with_dequantized_weights(qtype):
    raw = random_raw(qtype, rows=64, blocks_per_row=4 if qtype == Q.Q4_K else 18)
    cols = cols_of(qtype, raw)
    codes, scales, zeros = torch_quant.int4_codes(torch.from_numpy(raw), qtype, cols)
    packed, scales_and_zeros = int4_packing.pack_int4_for_cuda(codes, scales, zeros)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    got = torch.ops.aten._weight_int4pack_mm(x.cuda(), packed, 32, scales_and_zeros).float().cpu()
    expected = x.float() @ reference(qtype, raw).T
    assert (got - expected).abs().max() <= 2e-2 * expected.abs().max()
