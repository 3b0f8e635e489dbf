"""GGUF's codebook and ternary formats -> float32, exactly: IQ1_S..IQ4_XS, TQ1_0, TQ2_0, MXFP4, NVFP4.

Each function maps blocks [n_blocks, type_size] to float32 [n_blocks, block_size] with
vectorised ops, like dequantize.py's. A value is a block or group scale times a code's entry in
a small table (codebooks.py): grid points, +-1 signs, a ternary digit, a 4-bit codebook. Every
factor has few significant bits (an fp16 scale, 4-bit scale codes, grid values below 64), so
every product is exact in float32 and the order of the multiplications does not matter:
`gguf.quants.dequantize` gets the same bits.
"""

from __future__ import annotations

from collections.abc import Callable

import gguf
import torch

from corral.plugins.backends.torch import codebooks
from corral.plugins.backends.torch.block_fields import QK_K, bits, crumbs, f16, nibble_pairs, nibbles, words

Q = gguf.GGMLQuantizationType

# Shifts that take fields apart: four 7-bit sign codes (and a 4-bit scale above them) per
# 32-bit word; four 3-bit fields per 16 bits; 2-bit fields per 16 bits, and per byte.
SIGN_CODE_SHIFTS = torch.tensor([0, 7, 14, 21], dtype=torch.int32)
TRIPLET_SHIFTS = torch.tensor([0, 3, 6, 9], dtype=torch.int32)
PAIR_SHIFTS = torch.arange(0, 16, 2, dtype=torch.int32)
CRUMB_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
POWERS_OF_3 = torch.tensor([1, 3, 9, 27, 81], dtype=torch.uint8)
IQ1_DELTA = 0.125


def _lookup(table: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """table[codes]: integer codes [...] -> [..., *table.shape[1:]], a new tensor."""
    rows = table.index_select(0, codes.reshape(-1).int())
    return rows.view(*codes.shape, *table.shape[1:])


def _half_steps(codes: torch.Tensor, d: torch.Tensor, step: float) -> torch.Tensor:
    """IQ2/IQ3 sub-block scales: d * (code + 1/2) * step, float32 of codes' shape."""
    return codes.float().add_(0.5).mul_(step).mul_(d)


def _iq2_xxs(blocks: torch.Tensor) -> torch.Tensor:
    # Eight groups of 32: four 1-byte grid codes, then a word of four sign codes and a scale.
    d = f16(blocks, 0)
    groups = blocks[:, 2:].reshape(-1, 8, 8)
    aux = words(groups[..., 4:], 4).squeeze(-1)  # [n, 8]
    signs = _lookup(codebooks.parity_signs(), (aux[..., None] >> SIGN_CODE_SHIFTS) & 0x7F)
    scale = _half_steps(groups[..., 7] >> 4, d, 0.25)
    values = _lookup(codebooks.grid(Q.IQ2_XXS), groups[..., :4]).mul_(signs)
    return values.mul_(scale[..., None, None]).reshape(-1, QK_K)


def _iq2_xs(blocks: torch.Tensor) -> torch.Tensor:
    # 32 16-bit codes (9-bit grid code, 7-bit sign code), then a 4-bit scale per 16 values.
    d = f16(blocks, 0)
    codes = words(blocks[:, 2:66], 2)
    values = _lookup(codebooks.grid(Q.IQ2_XS), codes & 511)
    values.mul_(_lookup(codebooks.parity_signs(), codes >> 9))
    scale = _half_steps(nibble_pairs(blocks[:, 66:74]), d, 0.25)
    return values.view(-1, 16, 16).mul_(scale[..., None]).reshape(-1, QK_K)


def _iq2_s(blocks: torch.Tensor) -> torch.Tensor:
    # 10-bit grid codes (low bytes, then 2 high bits each), a sign byte per 8 values, scales.
    d = f16(blocks, 0)
    high = (blocks[:, 66:74, None] >> CRUMB_SHIFTS) & 3  # [n, 8, 4]
    codes = blocks[:, 2:34].int() | (high.reshape(-1, 32).int() << 8)
    values = _lookup(codebooks.grid(Q.IQ2_S), codes)
    values.mul_(_lookup(codebooks.byte_signs(), blocks[:, 34:66]))
    scale = _half_steps(nibble_pairs(blocks[:, 74:82]), d, 0.25)
    return values.view(-1, 16, 16).mul_(scale[..., None]).reshape(-1, QK_K)


def _iq3_xxs(blocks: torch.Tensor) -> torch.Tensor:
    # 64 1-byte codes of 4 values, then per group of 32 a word of four sign codes and a scale.
    d = f16(blocks, 0)
    aux = words(blocks[:, 66:98], 4)  # [n, 8]
    signs = _lookup(codebooks.parity_signs(), (aux[..., None] >> SIGN_CODE_SHIFTS) & 0x7F)
    scale = _half_steps((aux >> 28) & 0x0F, d, 0.5)
    values = _lookup(codebooks.grid(Q.IQ3_XXS), blocks[:, 2:66]).view(-1, 8, 4, 8)
    return values.mul_(signs).mul_(scale[..., None, None]).reshape(-1, QK_K)


def _iq3_s(blocks: torch.Tensor) -> torch.Tensor:
    # 9-bit codes of 4 values (low bytes, then a high bit each), sign bytes, odd 4-bit scales.
    d = f16(blocks, 0)
    high = bits(blocks[:, 66:74], 8).reshape(-1, 64)
    codes = blocks[:, 2:66].int() | (high.int() << 8)
    values = _lookup(codebooks.grid(Q.IQ3_S), codes).view(-1, 32, 8)
    values.mul_(_lookup(codebooks.byte_signs(), blocks[:, 74:106]))
    scale = nibble_pairs(blocks[:, 106:110]).float().mul_(2).add_(1).mul_(d)
    return values.view(-1, 8, 32).mul_(scale[..., None]).reshape(-1, QK_K)


def _iq1_s(blocks: torch.Tensor) -> torch.Tensor:
    # 11-bit codes of 8 values in {-1, 0, 1}; per 32 a 16-bit word of four 3-bit high code
    # parts, a 3-bit odd scale and the sign of a shift of 1/8.
    d = f16(blocks, 0)
    qh = words(blocks[:, 34:50], 2)  # [n, 8]
    codes = blocks[:, 2:34].view(-1, 8, 4).int() | (((qh[..., None] >> TRIPLET_SHIFTS) & 7) << 8)
    delta = torch.where((qh & 0x8000) == 0, IQ1_DELTA, -IQ1_DELTA)
    scale = ((qh >> 12) & 7).float().mul_(2).add_(1).mul_(d)
    values = _lookup(codebooks.grid(Q.IQ1_S), codes).add_(delta[..., None, None])
    return values.mul_(scale[..., None, None]).reshape(-1, QK_K)


def _iq1_m(blocks: torch.Tensor) -> torch.Tensor:
    # As IQ1_S, but a 4-bit high part (3 code bits, the shift's sign) per code, and 3-bit
    # scales per 16 values in four 16-bit words whose top nibbles hold the fp16 block scale.
    sc = blocks[:, 48:56]
    d_bytes = torch.stack(
        ((sc[:, 1] >> 4) | (sc[:, 3] & 0xF0), (sc[:, 5] >> 4) | (sc[:, 7] & 0xF0)),
        dim=-1,
    )
    d = f16(d_bytes, 0)
    high = nibble_pairs(blocks[:, 32:48])  # [n, 32]
    codes = blocks[:, 0:32].int() | ((high & 7).int() << 8)
    delta = torch.where((high & 8) == 0, IQ1_DELTA, -IQ1_DELTA)
    scale_codes = (words(sc, 2)[..., None] >> TRIPLET_SHIFTS) & 7  # [n, 4, 4]
    scale = scale_codes.reshape(-1, 16).float().mul_(2).add_(1).mul_(d)
    values = _lookup(codebooks.grid(Q.IQ1_M), codes).add_(delta[..., None])
    return values.view(-1, 16, 16).mul_(scale[..., None]).reshape(-1, QK_K)


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    d = f16(blocks, 0)
    return _lookup(codebooks.iq4_values(), nibbles(blocks[:, 2:])).mul_(d)


def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    # Eight groups of 32 with a 6-bit scale each: low 4 bits per nibble, high 2 bits per crumb.
    d = f16(blocks, 0)
    high = (words(blocks[:, 2:4], 2) >> PAIR_SHIFTS) & 3  # [n, 8]
    scale = (nibble_pairs(blocks[:, 4:8]).int() | (high << 4)).sub_(32).float().mul_(d)
    codes = nibbles(blocks[:, 8:].reshape(-1, 8, 16))  # [n, 8, 32]
    return _lookup(codebooks.iq4_values(), codes).mul_(scale[..., None]).reshape(-1, QK_K)


def _tq1_0(blocks: torch.Tensor) -> torch.Tensor:
    # Base-3 digits packed 5 (or 4) per byte as a fraction of 256: multiplying the byte by 3^k
    # (mod 256) brings digit k to the top, where * 3 >> 8 reads it.
    d = f16(blocks, 52)
    fives = blocks[:, :48].reshape(-1, 1, 48) * POWERS_OF_3.view(1, 5, 1)
    fours = blocks[:, 48:52].reshape(-1, 1, 4) * POWERS_OF_3[:4].view(1, 4, 1)
    shifted = torch.cat(
        (fives[..., :32].flatten(1), fives[..., 32:].flatten(1), fours.flatten(1)),
        dim=1,
    )
    return ((shifted.int() * 3) >> 8).sub_(1).float().mul_(d)


def _tq2_0(blocks: torch.Tensor) -> torch.Tensor:
    d = f16(blocks, 64)
    return crumbs(blocks[:, :64], 2).reshape(-1, QK_K).float().sub_(1).mul_(d)


def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    d = _lookup(codebooks.e8m0_halved(), blocks[:, 0:1])
    return _lookup(codebooks.e2m1_doubled(), nibbles(blocks[:, 1:])).mul_(d)


def _nvfp4(blocks: torch.Tensor) -> torch.Tensor:
    # Four groups of 16, each with an unsigned E4M3 scale byte.
    d = _lookup(codebooks.ue4m3_halved(), blocks[:, 0:4])  # [n, 4]
    codes = nibbles(blocks[:, 4:].reshape(-1, 4, 8))  # [n, 4, 16]
    return _lookup(codebooks.e2m1_doubled(), codes).mul_(d[..., None]).reshape(-1, 64)


DEQUANTIZERS: dict[Q, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.IQ1_S: _iq1_s,
    Q.IQ1_M: _iq1_m,
    Q.IQ2_XXS: _iq2_xxs,
    Q.IQ2_XS: _iq2_xs,
    Q.IQ2_S: _iq2_s,
    Q.IQ3_XXS: _iq3_xxs,
    Q.IQ3_S: _iq3_s,
    Q.IQ4_NL: _iq4_nl,
    Q.IQ4_XS: _iq4_xs,
    Q.TQ1_0: _tq1_0,
    Q.TQ2_0: _tq2_0,
    Q.MXFP4: _mxfp4,
    Q.NVFP4: _nvfp4,
}
