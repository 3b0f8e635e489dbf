/* AVX-512 helpers shared by the native kernels. */
#ifndef CORRAL_SIMD_H
#define CORRAL_SIMD_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#if !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "corral's native kernels need AVX-512 (F and BW)"
#endif

#define INLINE static inline __attribute__((always_inline))

/* Activation rows a matmul kernel computes per pass over a weight row. FOR_ROW_COUNT(rows, CALL)
 * runs CALL(R) with R the constant 1..ROW_TILE equal to `rows`: one inlined copy of a kernel's
 * loop per row count, whose per-row accumulators then stay in registers instead of spilling. */
#define ROW_TILE 8
#define FOR_ROW_COUNT(rows, CALL)                                                                                     \
    switch (rows) {                                                                                                   \
    case 1: CALL(1); break;                                                                                           \
    case 2: CALL(2); break;                                                                                           \
    case 3: CALL(3); break;                                                                                           \
    case 4: CALL(4); break;                                                                                           \
    case 5: CALL(5); break;                                                                                           \
    case 6: CALL(6); break;                                                                                           \
    case 7: CALL(7); break;                                                                                           \
    default: CALL(8); break;                                                                                          \
    }
/* How far ahead of a weight stream the matmul kernels prefetch on their first pass over a group:
 * with 8 rows the hardware prefetcher alone left int8 rows reading 10 GB/s from memory, and on an
 * Intel Xeon one-row decode steps were 10% slower without it (on Zen 4 at one row it measured
 * -5% to +1%). BENCHMARKS.md, "The vocabulary projection at several rows". */
#define PREFETCH_AHEAD 4096

/* Activation rows from which the kernels quantize them on all threads. */
#define PARALLEL_QUANTIZE_ROWS 32

/* Lanes of a row of `left` more values (all 16 when 16 or more are left). */
INLINE __mmask16 lanes_left(int64_t left)
{
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

/* 16 values from x[i] (float32, or bf16 when bf16 is set) as floats; masked lanes read as 0. */
INLINE __m512 load16(const void *x, int bf16, int64_t i, __mmask16 mask)
{
    if (!bf16)
        return _mm512_maskz_loadu_ps(mask, (const float *)x + i);
    __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)x + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 values from x[i], all lanes (no mask: the hot loops' form). */
INLINE __m512 load16_all(const void *x, int bf16, int64_t i)
{
    if (!bf16)
        return _mm512_loadu_ps((const float *)x + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The largest |value| of x[base .. base + n). */
INLINE float absmax(const void *x, int bf16, int64_t base, int64_t n)
{
    __m512 top = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16)
        top = _mm512_max_ps(top, _mm512_abs_ps(load16(x, bf16, base + i, lanes_left(n - i))));
    return _mm512_reduce_max_ps(top);
}

/* A row's int16 quantization: scale = absmax / 32767 and its reciprocal (0 for an all-zero row). */
INLINE float int16_scale(const void *x, int bf16, int64_t base, int64_t n, float *inverse)
{
    const float top = absmax(x, bf16, base, n);
    *inverse = top > 0.0f ? 32767.0f / top : 0.0f;
    return top / 32767.0f;
}

/* The int16 codes of x[i .. i + 16) times `inverse`, rounded to nearest even (|code| <= 32767). */
INLINE __m256i codes16(const void *x, int bf16, int64_t i, __m512 inverse)
{
    return _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(load16_all(x, bf16, i), inverse)));
}

/* e^x for x <= 0 (scores minus their maximum): 2^n e^r, |r| <= ln2 / 2, degree-6 Taylor (~1 ulp). */
INLINE __m512 exp_nonpositive(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Lane i: the sum of v[i]'s 16 lanes, in a fixed order of additions. */
INLINE __m512 sum16(const __m512 *v)
{
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    /* u[i]: each 128-bit chunk holds partial sums of v[4i .. 4i + 3] */
    __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44), _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
    __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44), _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, 0x88), _mm512_shuffle_f32x4(y01, y23, 0xDD));
}

/* DOT16: int32 lanes += sums of two int16 products; DOT8: += sums of four u8 (a) times s8 (b)
 * products (no saturation for |a| < 64: maddubs's int16 pairs stay in range). */
#ifdef __AVX512VNNI__
#define DOT16(acc, a, b) _mm512_dpwssd_epi32((acc), (a), (b))
#define DOT8(acc, a, b) _mm512_dpbusd_epi32((acc), (a), (b))
#else
#define DOT16(acc, a, b) _mm512_add_epi32((acc), _mm512_madd_epi16((a), (b)))
#define DOT8(acc, a, b) _mm512_add_epi32((acc), _mm512_madd_epi16(_mm512_maddubs_epi16((a), (b)), _mm512_set1_epi16(1)))
#endif

#endif
