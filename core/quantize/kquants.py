"""The K-quant block quantizers Q4_K, Q5_K and Q6_K, bit-identical to ggml's reference ones.

llama-quantize without an importance matrix quantizes with ggml's `quantize_row_q{4,5,6}_K_ref`
(ggml-quants.c). These functions follow the same algorithm, vectorised over every group of a chunk:
an array holds one element of each group per row (`[element, group]`), so a group's sums are taken
element by element in the order ggml adds them. Float sums are not associative, and the search picks
its scale by comparing sums, so summing in another order (numpy's pairwise `sum`) would choose a
different scale now and then. Everything is float32, as in C on x86-64 (ggml-base is built without
-march flags, so no fused multiply-add contracts a product into a sum).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

F32 = np.float32
QK_K = 256  # elements per super-block
GROUP_MAX_EPS = F32(1e-15)
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
# Super-blocks quantized together: large enough to amortise numpy's per-call cost, small enough
# that a chunk's working arrays stay in cache.
CHUNK_BLOCKS = 512


def nearest_int(value: np.ndarray) -> np.ndarray:
    """ggml's `nearest_int`: adding 1.5 * 2^23 rounds to an integer (ties to even) in the low mantissa bits."""
    bits = (value.astype(F32, copy=False) + F32(12582912.0)).view(np.int32)
    return (bits & 0x007FFFFF) - 0x00400000


def _round_clip(value: np.ndarray, low: int, high: int) -> np.ndarray:
    """`MAX(low, MIN(high, nearest_int(value)))` as float32, in place. np.rint rounds ties to even like
    `nearest_int`, which ggml asserts is only given |value| <= 4194303 (where the two agree)."""
    np.rint(value, out=value)
    return np.clip(value, low, high, out=value)


def _weighted_error(scale, offset, codes, x, weights):
    """sum(weights * (scale * codes + offset - x)^2) per group, float32, in ggml's order of operations."""
    diff = scale * codes
    diff += offset
    diff -= x
    diff *= diff
    diff *= weights
    return sequential_sum(diff)


def sequential_sum(values: np.ndarray) -> np.ndarray:
    """The sum over axis 0 of an [element, group] array, adding element after element as a C loop does.

    numpy reduces a C-contiguous array over its outer axis row by row (pairwise summation only applies
    along the contiguous axis), which is that order; the tests against ggml's bytes would catch a change.
    """
    return np.add.reduce(np.ascontiguousarray(values), axis=0)


def make_qkx2_quants(x: np.ndarray, weights: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """Scale, min and levels of each group (columns of `x`) for `x ~ scale * L - min`: ggml's make_qkx2_quants.

    Starts from the group's range, then tries `nstep + 1` stretched ranges, keeping the least weighted
    squared error of a least-squares fit. As in ggml, a better candidate's min moves the range of the
    candidates after it. The winning levels are recomputed at the end from the winner's scale and offset.
    """
    hi = x.max(axis=0)
    lo = x.min(axis=0)
    lo = np.where(lo > 0, F32(0), lo)
    flat = hi == lo
    sum_w = sequential_sum(weights)
    sum_x = sequential_sum(weights * x)
    iscale = F32(nmax) / (hi - lo)
    scale = F32(1) / iscale
    best_iscale, best_offset = iscale, lo  # what the kept levels were rounded from
    trial = _round_clip(iscale * (x - lo), 0, nmax)
    best_error = _weighted_error(scale, lo, trial, x, weights)
    for step in range(nstep + 1):
        iscale = (F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / (hi - lo)
        trial = x - lo
        trial *= iscale
        _round_clip(trial, 0, nmax)
        weighted = weights * trial
        sum_l = sequential_sum(weighted)
        sum_xl = sequential_sum(weighted * x)
        weighted *= trial
        sum_l2 = sequential_sum(weighted)
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        positive = this_min > 0
        this_min = np.where(positive, F32(0), this_min)
        this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
        error = _weighted_error(this_scale, this_min, trial, x, weights)
        better = (det > 0) & (error < best_error)
        best_iscale = np.where(better, iscale, best_iscale)
        best_offset = np.where(better, lo, best_offset)
        best_error = np.where(better, error, best_error)
        scale = np.where(better, this_scale, scale)
        lo = np.where(better, this_min, lo)
    levels = _round_clip(best_iscale * (x - best_offset), 0, nmax)
    levels[:, flat] = 0
    scale = np.where(flat, F32(0), scale)
    return scale, -lo, levels


def make_qx_quants(x: np.ndarray, nmax: int):
    """Signed scale and levels `L + nmax` of each group (columns of `x`) for `x ~ scale * L`: ggml's
    make_qx_quants with rmse_type 1 (weights x^2), trying 18 scales around `-nmax / max`."""
    groups = np.arange(x.shape[1])
    peak = x[np.argmax(np.abs(x), axis=0), groups]  # the first element of largest magnitude, signed
    zero = np.abs(peak) < GROUP_MAX_EPS
    weights = x * x
    weighted_x = weights * x

    def fit(iscale):
        trial = _round_clip(iscale * x, -nmax, nmax - 1)
        sum_lx = sequential_sum(weighted_x * trial)
        weighted = weights * trial
        weighted *= trial
        return sum_lx, sequential_sum(weighted)

    best_iscale = F32(-nmax) / peak
    sum_lx, sum_l2 = fit(best_iscale)
    scale = np.where(sum_l2 != 0, sum_lx / sum_l2, F32(0))
    best = scale * sum_lx
    for step in (*range(-9, 0), *range(1, 10)):
        iscale = -(F32(nmax) + F32(0.1) * F32(step)) / peak
        sum_lx, sum_l2 = fit(iscale)
        better = (sum_l2 > 0) & (sum_lx * sum_lx > best * sum_l2)
        best_iscale = np.where(better, iscale, best_iscale)
        scale = np.where(better, sum_lx / sum_l2, scale)
        best = np.where(better, scale * sum_lx, best)
    levels = _round_clip(best_iscale * x, -nmax, nmax - 1)
    levels[:, zero] = -nmax  # ggml leaves a zero group's codes at 0, i.e. L = -nmax
    scale = np.where(zero, F32(0), scale)
    return scale, (levels + F32(nmax)).astype(np.uint8)


def _fp16(values: np.ndarray) -> np.ndarray:
    """float32 -> IEEE half (round to nearest even, as ggml's GGML_FP32_TO_FP16) and back to float32."""
    return values.astype(np.float16)


def _pack_scales_mins(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins ([block, 8] each) into the 12 bytes of a Q4_K/Q5_K super-block."""
    packed = np.empty((ls.shape[0], 12), np.uint8)
    packed[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    return packed


def _six_bits(inverse: np.ndarray, values: np.ndarray) -> np.ndarray:
    """`MIN(63, (uint8_t)nearest_int(inverse * value))` as ggml stores a sub-block scale or min."""
    return np.minimum(nearest_int(inverse[:, None] * values).astype(np.uint8), 63)


def _scale_min_blocks(blocks: np.ndarray, nmax: int, rmin: float, nstep: int):
    """The shared part of Q4_K and Q5_K: [block, 256] floats -> d, dmin, packed scales, levels [block, 256]."""
    count = blocks.shape[0]
    x = np.ascontiguousarray(blocks.reshape(count * 8, 32).T)  # [element, group]
    av_x = np.sqrt(sequential_sum(x * x) / F32(32))
    weights = av_x + np.abs(x)
    scales, mins, levels = make_qkx2_quants(x, weights, nmax, rmin, 0.1, nstep)
    scales, mins = scales.reshape(count, 8), mins.reshape(count, 8)
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0))
        inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0))
    ls, lm = _six_bits(inv_scale, scales), _six_bits(inv_min, mins)
    d, dmin = _fp16(max_scale / F32(63)), _fp16(max_min / F32(63))
    # The codes again, against the scales as stored: 6-bit multiples of the fp16 super-block scales.
    sub_d = (d.astype(F32)[:, None] * ls.astype(F32)).reshape(-1)
    sub_m = (dmin.astype(F32)[:, None] * lm.astype(F32)).reshape(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = np.clip(nearest_int((x + sub_m) / sub_d), 0, nmax).astype(F32)
    levels = np.where(sub_d != 0, requant, levels)  # a zero scale keeps the search's codes, as ggml does
    return d, dmin, _pack_scales_mins(ls, lm), levels.T.reshape(count, QK_K).astype(np.uint8)


def _head(d: np.ndarray, dmin: np.ndarray) -> np.ndarray:
    return np.stack([d, dmin], axis=1).view(np.uint8)


def quantize_q4_k_blocks(blocks: np.ndarray) -> np.ndarray:
    """[block, 256] float32 -> [block, 144] bytes of block_q4_K (d, dmin, scales[12], qs[128])."""
    d, dmin, scales, levels = _scale_min_blocks(blocks, 15, -1.0, 20)
    quads = levels.reshape(-1, 4, 2, 32)  # 64-element chunks: low nibbles the first 32, high the next
    qs = (quads[:, :, 0] | (quads[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_head(d, dmin), scales, qs], axis=1)


def quantize_q5_k_blocks(blocks: np.ndarray) -> np.ndarray:
    """[block, 256] float32 -> [block, 176] bytes of block_q5_K (d, dmin, scales[12], qh[32], qs[128])."""
    d, dmin, scales, levels = _scale_min_blocks(blocks, 31, -0.5, 15)
    quads = levels.reshape(-1, 4, 2, 32)
    qs = ((quads[:, :, 0] & 0xF) | ((quads[:, :, 1] & 0xF) << 4)).reshape(-1, 128)
    high = (quads >> 4).astype(np.uint8)  # [block, chunk, half, 32]: bit 4 of each code
    shifts = (2 * np.arange(4)[:, None] + np.arange(2)[None, :]).astype(np.uint8)  # chunk c, half h -> bit 2c+h
    qh = np.bitwise_or.reduce((high << shifts[None, :, :, None]).reshape(-1, 8, 32), axis=1)
    return np.concatenate([_head(d, dmin), scales, qh, qs], axis=1)


def quantize_q6_k_blocks(blocks: np.ndarray) -> np.ndarray:
    """[block, 256] float32 -> [block, 210] bytes of block_q6_K (ql[128], qh[64], scales[16], d)."""
    count = blocks.shape[0]
    x = np.ascontiguousarray(blocks.reshape(count * 16, 16).T)  # [element, group]
    scales, levels = make_qx_quants(x, 32)
    scales = scales.reshape(count, 16)
    peak = scales[np.arange(count), np.argmax(np.abs(scales), axis=1)]  # first largest magnitude, signed
    zero = np.abs(peak) < GROUP_MAX_EPS
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(zero, F32(0), F32(-128) / peak)
        d = _fp16(F32(1) / iscale)
        stored = np.minimum(nearest_int(iscale[:, None] * scales), 127).astype(np.int8)
        sub_d = (d.astype(F32)[:, None] * stored.astype(F32)).reshape(-1)
        requant = (np.clip(nearest_int(x / sub_d), -32, 31) + 32).astype(np.uint8)
    levels = np.where(sub_d != 0, requant, levels).T.reshape(count, 2, 4, 32)  # [block, half, quarter, 32]
    ql = np.concatenate(
        [levels[:, :, 0] & 0xF | (levels[:, :, 2] & 0xF) << 4, levels[:, :, 1] & 0xF | (levels[:, :, 3] & 0xF) << 4], axis=2
    ).reshape(count, 128)
    qh = (levels[:, :, 0] >> 4 | (levels[:, :, 1] >> 4) << 2 | (levels[:, :, 2] >> 4) << 4 | (levels[:, :, 3] >> 4) << 6)
    out = np.concatenate([ql, qh.reshape(count, 64), stored.view(np.uint8), d[:, None].view(np.uint8)], axis=1)
    out[zero] = 0  # ggml writes an all-zero super-block when every scale is (nearly) zero
    return out


_BLOCK_QUANTIZERS = {"Q4_K": quantize_q4_k_blocks, "Q5_K": quantize_q5_k_blocks, "Q6_K": quantize_q6_k_blocks}


def quantize_k(values: np.ndarray, type_name: str) -> np.ndarray:
    """float32 rows (last dim a multiple of 256) -> uint8 rows of `type_name` (Q4_K, Q5_K or Q6_K) blocks.

    Chunks of super-blocks are quantized on a thread per core: numpy releases the GIL inside each
    operation, and every chunk writes its own rows of the output.
    """
    quantize_blocks = _BLOCK_QUANTIZERS[type_name]
    values = np.ascontiguousarray(values, dtype=F32)
    if values.shape[-1] % QK_K:
        raise ValueError(f"{type_name} needs rows of a multiple of {QK_K} values, not {values.shape[-1]}")
    blocks = values.reshape(-1, QK_K)
    out = np.empty((blocks.shape[0], BLOCK_BYTES[type_name]), np.uint8)

    def run(start: int) -> None:
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            out[start : start + CHUNK_BLOCKS] = quantize_blocks(blocks[start : start + CHUNK_BLOCKS])

    starts = range(0, blocks.shape[0], CHUNK_BLOCKS)
    if len(starts) == 1:
        run(0)
    else:
        with ThreadPoolExecutor(max_workers=min(len(starts), len(os.sched_getaffinity(0)))) as pool:
            list(pool.map(run, starts))
    row_blocks = values.shape[-1] // QK_K
    return out.reshape(*values.shape[:-1], row_blocks * BLOCK_BYTES[type_name])
