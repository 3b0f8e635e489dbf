"""GGUF bytes -> torch weights: bit-exact against gguf.quants, and torch's int4 kernels on the packing."""

import gguf
import numpy as np
import pytest
import torch

from tiny_gguf import random_blocks

from corral.errors import UnsupportedTensorTypeError
from corral.plugins.backends.torch import codebooks, int4_packing
from corral.plugins.backends.torch import dequantize as torch_quant

Q = gguf.GGMLQuantizationType

FLOATS = [Q.F32, Q.F16, Q.BF16]
INT4 = [Q.Q4_0, Q.Q4_1, Q.Q4_K]
QUANTIZED = [qtype for qtype in torch_quant.DEQUANTIZERS if qtype not in FLOATS]


def random_raw(qtype: Q, rows: int, blocks_per_row: int, seed: int = 0, any_scale: bool = False) -> np.ndarray:
    """Random bytes [rows, row_bytes] of a tensor of `qtype`, every block scale finite: about
    0.05, or drawn from every finite value of its format if `any_scale`."""
    rng = np.random.default_rng(seed)
    block_size = gguf.GGML_QUANT_SIZES[qtype][0]
    if qtype in FLOATS:
        values = rng.normal(0, 1, (rows, blocks_per_row * block_size)).astype(np.float32)
        return gguf.quants.quantize(values, qtype).view(np.uint8)
    n_blocks = rows * blocks_per_row
    scales = None if any_scale else rng.normal(0, 0.05, n_blocks)
    return random_blocks(qtype, n_blocks, rng, scales).reshape(rows, -1)


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


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda q: q.name)
def test_dequantize_is_bit_exact_against_gguf_for_any_finite_scale(qtype):
    # 512 blocks: every grid code of the IQ types is drawn (IQ1_S's 2048 with high probability)
    raw = random_raw(qtype, rows=64, blocks_per_row=8, seed=3, any_scale=True)
    got = torch_quant.dequantize(torch.from_numpy(raw), qtype, cols_of(qtype, raw))
    with np.errstate(over="ignore"):  # MXFP4's largest scales times 12 overflow, in both
        expected = reference(qtype, raw)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.MXFP4], ids=lambda q: q.name)
def test_dequantize_is_bit_exact_on_blocks_gguf_quantized(qtype):
    values = np.random.default_rng(1).normal(0, 0.02, (8, 128)).astype(np.float32)
    raw = gguf.quants.quantize(values, qtype)
    got = torch_quant.dequantize(torch.from_numpy(raw), qtype, 128)
    assert torch.equal(got, reference(qtype, raw))


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.IQ4_XS, Q.MXFP4], ids=lambda q: q.name)
def test_dequantize_to_bfloat16_rounds_the_exact_float32_values(qtype):
    raw = random_raw(qtype, rows=4, blocks_per_row=2)
    got = torch_quant.dequantize(torch.from_numpy(raw), qtype, cols_of(qtype, raw), torch.bfloat16)
    assert torch.equal(got, reference(qtype, raw).to(torch.bfloat16))


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q5_0, Q.Q5_K, Q.IQ2_S, Q.TQ1_0, Q.NVFP4], ids=lambda q: q.name)
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
    with pytest.raises(UnsupportedTensorTypeError, match="Q8_1; supported: .*IQ2_XXS"):
        torch_quant.dequantize(torch.zeros(1, 40, dtype=torch.uint8), Q.Q8_1, 32)


def test_parity_signs_are_ggmls_sign_table():
    # ggml's ksigns: the byte of sign bits for each 7-bit code (bit j set: value j negative)
    ksigns = np.frombuffer(gguf.quants.IQ2_XXS.ksigns, dtype=np.uint8)
    expected = 1 - 2 * ((ksigns[:, None] >> np.arange(8)) & 1).astype(np.float32)
    assert torch.equal(codebooks.parity_signs(), torch.from_numpy(expected))


def test_fp4_tables_are_ggufs_for_every_code():
    codes = np.arange(256, dtype=np.uint8)
    assert codebooks.e2m1_doubled().tolist() == list(gguf.quants.MXFP4.kvalues)
    e8m0 = torch.from_numpy(gguf.quants.MXFP4.e8m0_to_fp32_half(codes).astype(np.float32))
    ue4m3 = torch.from_numpy(gguf.quants.NVFP4.ue4m3_to_fp32(codes).astype(np.float32))
    assert torch.equal(codebooks.e8m0_halved().view(torch.int32), e8m0.view(torch.int32))
    assert torch.equal(codebooks.ue4m3_halved().view(torch.int32), ue4m3.view(torch.int32))


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
