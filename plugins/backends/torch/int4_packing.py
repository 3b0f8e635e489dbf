"""int4 codes into the layouts of torch's int4 kernels: `_weight_int4pack_mm_for_cpu` (CPU) and
`_weight_int4pack_mm` (CUDA), each with its scales and zeros, w = (q - 8) * scale + zero."""

from __future__ import annotations

import torch

from corral.errors import UnsupportedTensorTypeError
from corral.plugins.backends.torch.dequantize import SLAB_ELEMENTS


def scales_and_zeros(scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[rows, groups] twice -> [groups, rows, 2] (scale, zero), the layout both int4 kernels read."""
    return torch.stack((scales.t(), zeros.t()), dim=-1).to(dtype).contiguous()


def pack_int4_for_cpu(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and group params -> (packed uint8 [rows, cols // 2], scales_and_zeros) for
    `torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros)`.

    `dtype` must be the activations' dtype (the kernel requires x and scales_and_zeros to match;
    float32 gives exact fp32 dequantization). The packed layout depends on the CPU's vector width
    (blocks of 64 rows on AVX-512, 32 on AVX2), so it is built by torch and never stored to disk.
    """
    return pack_int4_codes_for_cpu(codes), scales_and_zeros(scales, zeros, dtype)


def pack_int4_codes_for_cpu(codes: torch.Tensor) -> torch.Tensor:
    """Codes uint8 [rows, cols] -> torch's packed CPU layout uint8 [rows, cols // 2]."""
    rows = codes.shape[0]
    if rows % 16:
        raise UnsupportedTensorTypeError(f"torch's CPU int4 kernel needs rows divisible by 16, got {rows}")
    cols = codes.shape[1]
    packed = torch.empty(rows, cols // 2, dtype=torch.uint8)
    # torch packs each block of 64 rows (32 below AVX-512) on its own, so slabs of a multiple of 64
    # rows pack alike, and the int32 copy of the codes it insists on stays small.
    step = max(64, SLAB_ELEMENTS // cols // 64 * 64)
    for start in range(0, rows, step):
        slab = codes[start : start + step].to(torch.int32)
        packed[start : start + step] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(slab, 1)
    return packed


def _inner_k_tiles(cols: int) -> int:
    """The widest tile (8, 4 or 2 k-tiles of 16) that divides cols; 576 columns only take 4."""
    for tiles in (8, 4, 2):
        if cols % (tiles * 16) == 0:
            return tiles
    raise UnsupportedTensorTypeError(f"torch's CUDA int4 kernel needs cols divisible by 32, got {cols}")


def pack_int4_for_cuda(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and group params -> (packed int32 4-D, scales_and_zeros bf16 [cols // 32, rows, 2]) on
    `device` (default: the codes' GPU, else "cuda") for
    `torch.ops.aten._weight_int4pack_mm(x_bf16, packed, 32, scales_and_zeros)`.

    Written from torch's int4mm.cu and test_linalg.py; not yet run on a GPU. The kernel takes byte
    pairs with the even column in the high nibble, needs rows divisible by 8, and dequantizes in
    bf16 arithmetic (fma of bf16 scale and zero), unlike the CPU kernel, which dequantizes in fp32.
    """
    rows, cols = codes.shape
    if rows % 8:
        raise UnsupportedTensorTypeError(f"torch's CUDA int4 kernel needs rows divisible by 8, got {rows}")
    if device is None:
        device = codes.device if codes.is_cuda else "cuda"
    codes = codes.to(device=device, dtype=torch.uint8)
    pairs = (codes[:, 0::2] << 4) | codes[:, 1::2]
    packed = torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), _inner_k_tiles(cols))
    return packed, scales_and_zeros(scales.to(device), zeros.to(device), torch.bfloat16)
