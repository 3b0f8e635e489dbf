"""The tables the codebook formats (IQ*, MXFP4, NVFP4) map their codes through, built once.

The IQ grids are gguf-py's own (`gguf.quants` unpacks them from ggml's), so corral and its
reference read one codebook; every other table follows from its format's rule.
"""

from __future__ import annotations

import functools

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType

_GRID_OWNERS = {
    Q.IQ1_S: gguf.quants.IQ1_S,
    Q.IQ1_M: gguf.quants.IQ1_M,
    Q.IQ2_XXS: gguf.quants.IQ2_XXS,
    Q.IQ2_XS: gguf.quants.IQ2_XS,
    Q.IQ2_S: gguf.quants.IQ2_S,
    Q.IQ3_XXS: gguf.quants.IQ3_XXS,
    Q.IQ3_S: gguf.quants.IQ3_S,
}


@functools.cache
def grid(qtype: Q) -> torch.Tensor:
    """float32 [codes, 8] (IQ1_*, IQ2_*) or [codes, 4] (IQ3_*): the values of each grid code."""
    owner = _GRID_OWNERS[qtype]
    owner.init_grid()
    return torch.from_numpy(owner.grid.reshape(owner.grid_shape).astype(np.float32))


@functools.cache
def parity_signs() -> torch.Tensor:
    """[128, 8] of +-1 (IQ2_XXS, IQ2_XS, IQ3_XXS): a 7-bit code gives the signs of the first
    seven values; the eighth's makes the count of negative ones even."""
    sign_bits = (torch.arange(128)[:, None] >> torch.arange(7)) & 1
    sign_bits = torch.cat((sign_bits, sign_bits.sum(-1, keepdim=True) & 1), dim=-1)
    return 1 - 2 * sign_bits.float()


@functools.cache
def byte_signs() -> torch.Tensor:
    """[256, 8] of +-1 (IQ2_S, IQ3_S): bit j of the byte set makes value j negative."""
    return 1 - 2 * ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).float()


@functools.cache
def iq4_values() -> torch.Tensor:
    """float32 [16] (IQ4_NL, IQ4_XS): the non-linear 4-bit codebook."""
    return torch.tensor(gguf.quants.IQ4_NL.kvalues, dtype=torch.float32)


@functools.cache
def e2m1_doubled() -> torch.Tensor:
    """float32 [16] (MXFP4, NVFP4): the E2M1 values (sign, 2-bit exponent, 1-bit
    mantissa) doubled, to whole numbers; the block scales are halved to match."""
    code = torch.arange(16)
    exponent, mantissa = (code >> 1) & 3, code & 1
    normal = (2 + mantissa) << (exponent - 1).clamp(min=0)
    magnitude = torch.where(exponent == 0, mantissa, normal)
    return torch.where(code >= 8, -magnitude, magnitude).float()


@functools.cache
def e8m0_halved() -> torch.Tensor:
    """float32 [256] (MXFP4): an E8M0 scale byte e stands for 2^(e - 127); halved, 2^(e - 128).
    ggml gives 0xFF no NaN: it reads as 2^127."""
    return torch.exp2(torch.arange(256, dtype=torch.float64) - 128).float()


@functools.cache
def ue4m3_halved() -> torch.Tensor:
    """float32 [256] (NVFP4): an unsigned E4M3 scale byte (bias 7; ggml ignores bit 7 and
    reads 0x7F, E4M3's NaN, as 0), halved."""
    code = torch.arange(256)
    exponent, mantissa = (code >> 3) & 15, (code & 7).double()
    normal = (1 + mantissa / 8) * torch.exp2(exponent - 7.0)
    value = torch.where(exponent == 0, mantissa * 2.0**-9, normal)
    value[(code == 0) | (code == 0x7F)] = 0
    return (value / 2).float()
