/* AVX2 helpers shared by the AVX2 native kernels (CPUs with AVX2, FMA and F16C but no AVX-512;
 * AVX-VNNI where the CPU has it). The kernels beside this header take the same arguments as the
 * AVX-512 ones in native/ and keep their promises; their lanes are 8 floats wide instead of 16. */
#ifndef CORRAL_SIMD_AVX2_H
#define CORRAL_SIMD_AVX2_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "corral's AVX2 native kernels need AVX2, FMA and F16C"
#endif

#define INLINE static inline __attribute__((always_inline))

/* Activation rows a matmul kernel computes per pass over a weight row: 16 ymm registers hold a
 * row's accumulator each plus the unpacked weights (8 rows would spill). FOR_ROW_COUNT(rows, CALL)
 * runs CALL(R) with R the constant 1..ROW_TILE equal to `rows`. */
#define ROW_TILE 4
#define FOR_ROW_COUNT(rows, CALL)                                                                                     \
    switch (rows) {                                                                                                   \
    case 1: CALL(1); break;                                                                                           \
    case 2: CALL(2); break;                                                                                           \
    case 3: CALL(3); break;                                                                                           \
    default: CALL(4); break;                                                                                          \
    }
/* How far ahead of its reads a matmul kernel asks for its weight rows (software prefetch): the
 * rows stream from memory once a token, and at one activation row the hardware prefetcher alone
 * left 10-20% of the bandwidth unused (measured: BENCHMARKS.md, "Bound calls"). */
#define PREFETCH_BYTES 2048
/* Activation rows from which the kernels quantize them on all threads. */
#define PARALLEL_QUANTIZE_ROWS 32

/* 8 values from x[i] (float32, or bf16 when bf16 is set) as floats, all lanes. */
INLINE __m256 load8_all(const void *x, int bf16, int64_t i)
{
    if (!bf16)
        return _mm256_loadu_ps((const float *)x + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* 8 values from x[i] where only `left` may be read (all 8 when 8 or more are left); the rest read as 0. */
INLINE __m256 load8(const void *x, int bf16, int64_t i, int64_t left)
{
    if (left >= 8)
        return load8_all(x, bf16, i);
    uint16_t part[16] = {0}; /* room for 8 floats */
    memcpy(part, bf16 ? (const void *)((const uint16_t *)x + i) : (const void *)((const float *)x + i), (size_t)left * (bf16 ? 2 : 4));
    return load8_all(part, bf16, 0);
}

/* Stores the first `left` (at most 8) lanes of v at y. */
INLINE void store8(float *y, __m256 v, int64_t left)
{
    if (left >= 8) {
        _mm256_storeu_ps(y, v);
        return;
    }
    float all[8];
    _mm256_storeu_ps(all, v);
    memcpy(y, all, (size_t)left * sizeof(float));
}

INLINE __m256 abs8(__m256 v)
{
    return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
}

/* The sum of v's 8 lanes, in a fixed order of additions. */
INLINE float reduce_add8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

INLINE float reduce_max8(__m256 v)
{
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* The largest |value| of x[base .. base + n). */
INLINE float absmax(const void *x, int bf16, int64_t base, int64_t n)
{
    __m256 top = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8)
        top = _mm256_max_ps(top, abs8(load8(x, bf16, base + i, n - i)));
    return reduce_max8(top);
}

/* A row's int16 quantization: scale = absmax / 32767 and its reciprocal (0 for an all-zero row). */
INLINE float int16_scale(const void *x, int bf16, int64_t base, int64_t n, float *inverse)
{
    const float top = absmax(x, bf16, base, n);
    *inverse = top > 0.0f ? 32767.0f / top : 0.0f;
    return top / 32767.0f;
}

/* The int16 codes of x[i .. i + 16) times `inverse`, rounded to nearest even (|code| <= 32767). */
INLINE __m256i codes16(const void *x, int bf16, int64_t i, __m256 inverse)
{
    __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(load8_all(x, bf16, i), inverse));
    __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(load8_all(x, bf16, i + 8), inverse));
    /* packs interleaves the 128-bit halves (a0-3 b0-3 a4-7 b4-7): put them back in order */
    return _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
}

/* e^x for x <= 0 (scores minus their maximum): 2^n e^r, |r| <= ln2 / 2, degree-6 Taylor (~1 ulp). */
INLINE __m256 exp_nonpositive(__m256 x)
{
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    /* times 2^n: n in [-126, 0] here, so n + 127 is a normal float's exponent */
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* Lane i: the sum of v[i]'s 8 lanes, in a fixed order of additions. */
INLINE __m256 sum8(const __m256 *v)
{
    __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    /* u0: per 128-bit half, the half's sums of v[0..3]; u1: of v[4..7] */
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* DOT16: int32 lanes += sums of two int16 products; DOT8: += sums of four u8 (a) times s8 (b)
 * products (no saturation for |a| < 64: maddubs's int16 pairs stay in range). */
#ifdef __AVXVNNI__
#define DOT16(acc, a, b) _mm256_dpwssd_avx_epi32((acc), (a), (b))
#define DOT8(acc, a, b) _mm256_dpbusd_avx_epi32((acc), (a), (b))
#else
#define DOT16(acc, a, b) _mm256_add_epi32((acc), _mm256_madd_epi16((a), (b)))
#define DOT8(acc, a, b) _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((a), (b)), _mm256_set1_epi16(1)))
#endif

#endif
