"""GGUF tensor bytes -> torch tensors, exactly: float weights, or int4 codes with their group scales and mins.

Every function takes the raw bytes of one GGUF tensor as a uint8 tensor [rows, row_bytes] (usually
`torch.frombuffer` over the file's memory map; never written to) and converts it with vectorised
ops over slabs of about a million elements. `dequantize` equals `gguf.quants.dequantize` bit for
bit in float32: every product of an fp16 scale with the small integer codes is exact in float32,
so the one rounding left (the add of a min, or Q6_K's last product) is the same as in gguf's numpy.
The formats here are ggml's scalar ones (floats, Q4_0..Q8_0, the k-quants); the codebook and
ternary ones (IQ*, TQ*, MXFP4, NVFP4) are in dequantize_iq.py, and `dequantize` takes them all.

Q4_0, Q4_1 and Q4_K map exactly onto torch's int4 group-32 format, w = (q - 8) * scale + zero:

    Q4_0  w = d * (q - 8)                  scale = d       zero = 0
    Q4_1  w = d * q + m                    scale = d       zero = m + 8 * d
    Q4_K  w = d * sc * q - dmin * mn       scale = d * sc  zero = 8 * d * sc - dmin * mn
"""

from __future__ import annotations

from collections.abc import Callable

import gguf
import torch

from corral.errors import UnsupportedTensorTypeError
from corral.plugins.backends.torch import dequantize_iq
from corral.plugins.backends.torch.block_fields import QK_K, bits, crumbs, f16, nibbles

Q = gguf.GGMLQuantizationType
INT4_GROUP = 32
SLAB_ELEMENTS = 1 << 20


def _blocks(raw: torch.Tensor, qtype: Q) -> torch.Tensor:
    """The tensor's bytes as [n_blocks, type_size] (a view, no copy)."""
    type_size = gguf.GGML_QUANT_SIZES[qtype][1]
    return raw.reshape(-1, type_size)


def _k_scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit mins, as float32 [n_blocks, 8, 1]."""
    d, m, m_d = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc.float().unsqueeze(-1), mn.float().unsqueeze(-1)


def _k_low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: 128 bytes -> [n_blocks, 8, 32]; sub-blocks 2j and 2j+1 share bytes 32j..32j+31."""
    qs = qs.reshape(-1, 4, 1, 32)
    return torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(-1, 8, 32)


# One function per format: blocks [n_blocks, type_size] -> float32 [n_blocks, block_size]. They work
# in place on one float32 buffer: a fresh allocation per op cost more than the arithmetic
# (measured: BENCHMARKS.md, Measurements behind code decisions).


def _f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32)


def _f16_values(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16).float()


def _bf16_values(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.bfloat16).float()


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = f16(blocks, 0)
    return nibbles(blocks[:, 2:]).float().sub_(8).mul_(d)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = f16(blocks, 0), f16(blocks, 2)
    return nibbles(blocks[:, 4:]).float().mul_(d).add_(m)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = f16(blocks, 0)
    q = nibbles(blocks[:, 6:]).bitwise_or_(bits(blocks[:, 2:6], 8).reshape(-1, 32) << 4)
    return q.float().sub_(16).mul_(d)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = f16(blocks, 0), f16(blocks, 2)
    q = nibbles(blocks[:, 8:]).bitwise_or_(bits(blocks[:, 4:8], 8).reshape(-1, 32) << 4)
    return q.float().mul_(d).add_(m)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = f16(blocks, 0)
    return blocks[:, 2:].view(torch.int8).float().mul_(d)


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    scales = blocks[:, 0:16]
    d, dmin = f16(blocks, 80), f16(blocks, 82)
    dl = (d * (scales & 0x0F).float()).unsqueeze(-1)
    ml = (dmin * (scales >> 4).float()).unsqueeze(-1)
    q = crumbs(blocks[:, 16:80], 2).reshape(-1, 16, 16).float()
    return q.mul_(dl).sub_(ml).reshape(-1, QK_K)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    hmask, packed = blocks[:, 0:32], blocks[:, 96:108]
    d = f16(blocks, 108)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 4, 1)
    high = (packed[:, 8:12].reshape(-1, 1, 4) >> shifts).bitwise_and_(3).reshape(-1, 16)
    scales = nibbles(packed[:, 0:8]).bitwise_or_(high << 4).float().sub_(32)
    # A clear high bit subtracts 4; a set one subtracts nothing.
    qh = (bits(hmask, 8).transpose(1, 2) ^ 1).reshape(-1, 16, 16)
    q = crumbs(blocks[:, 32:96], 2).reshape(-1, 16, 16).float().sub_(qh.float().mul_(4))
    return q.mul_((d * scales).unsqueeze(-1)).reshape(-1, QK_K)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    d, dmin = f16(blocks, 0).unsqueeze(-1), f16(blocks, 2).unsqueeze(-1)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    q = _k_low_nibbles(blocks[:, 16:]).float()
    return q.mul_(d * sc).sub_(dmin * mn).reshape(-1, QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    d, dmin = f16(blocks, 0).unsqueeze(-1), f16(blocks, 2).unsqueeze(-1)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    high = bits(blocks[:, 16:48], 8).transpose(1, 2)
    q = _k_low_nibbles(blocks[:, 48:]).bitwise_or_(high << 4).float()
    return q.mul_(d * sc).sub_(dmin * mn).reshape(-1, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    ql, scales = blocks[:, 0:128].reshape(-1, 2, 1, 64), blocks[:, 192:208]
    d = f16(blocks, 208)
    low = torch.cat((ql & 0x0F, ql >> 4), dim=2).reshape(-1, 8, 32)
    high = crumbs(blocks[:, 128:192], 2).reshape(-1, 8, 32)
    q = low.bitwise_or_(high << 4).reshape(-1, 16, 16).float().sub_(32)
    return q.mul_((d * scales.view(torch.int8).float()).unsqueeze(-1)).reshape(-1, QK_K)


DEQUANTIZERS: dict[Q, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.F32: _f32,
    Q.F16: _f16_values,
    Q.BF16: _bf16_values,
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
    Q.Q8_0: _q8_0,
    Q.Q2_K: _q2_k,
    Q.Q3_K: _q3_k,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
    **dequantize_iq.DEQUANTIZERS,
}


def dequantize(raw: torch.Tensor, qtype: Q, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Raw GGUF bytes [rows, row_bytes] -> a new weight tensor [rows, cols], never a view of raw."""
    convert = DEQUANTIZERS.get(qtype)
    if convert is None:
        raise UnsupportedTensorTypeError(
            f"cannot dequantize GGML type {Q(qtype).name}; supported: {', '.join(t.name for t in DEQUANTIZERS)}"
        )
    blocks = _blocks(raw, qtype)
    out = torch.empty(blocks.shape[0], gguf.GGML_QUANT_SIZES[qtype][0], dtype=dtype)
    # Slabs keep the float32 intermediates in cache: faster than whole-tensor ops on big tensors
    # (measured: BENCHMARKS.md, Measurements behind code decisions).
    step = max(1, SLAB_ELEMENTS // out.shape[1])
    for start in range(0, blocks.shape[0], step):
        out[start : start + step] = convert(blocks[start : start + step])
    return out.reshape(-1, cols)


# int4: codes 0..15 with one fp32 scale and min per group of 32, w = q * scale + min (torch's
# kernels take zero = min + 8 * scale: w = (q - 8) * scale + zero).


def _q4_0_int4(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d = f16(blocks, 0)
    return nibbles(blocks[:, 2:]), d, -8 * d


def _q4_1_int4(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d, m = f16(blocks, 0), f16(blocks, 2)
    return nibbles(blocks[:, 4:]), d, m


def _q4_k_int4(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d, dmin = f16(blocks, 0), f16(blocks, 2)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    return _k_low_nibbles(blocks[:, 16:]), d * sc.squeeze(-1), -dmin * mn.squeeze(-1)


INT4_CODERS: dict[Q, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {
    Q.Q4_0: _q4_0_int4,
    Q.Q4_1: _q4_1_int4,
    Q.Q4_K: _q4_k_int4,
}


def int4_blocks(raw: torch.Tensor, qtype: Q, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw Q4_0/Q4_1/Q4_K bytes -> (codes uint8 [rows, cols], scales, mins float32 [rows, cols // 32]), exact."""
    coder = INT4_CODERS.get(qtype)
    if coder is None:
        raise UnsupportedTensorTypeError(
            f"GGML type {Q(qtype).name} has no exact int4 form; use dequantize (int4: Q4_0, Q4_1, Q4_K)"
        )
    codes, scales, mins = coder(_blocks(raw, qtype))
    groups = cols // INT4_GROUP
    return codes.reshape(-1, cols), scales.reshape(-1, groups), mins.reshape(-1, groups)


def int4_codes(raw: torch.Tensor, qtype: Q, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw Q4_0/Q4_1/Q4_K bytes -> (codes uint8 [rows, cols], scales, zeros float32 [rows, cols // 32]), torch's form."""
    codes, scales, mins = int4_blocks(raw, qtype, cols)
    return codes, scales, mins + 8 * scales
