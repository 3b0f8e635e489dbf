/* 4-bit weights in blocks of 32 times 16-bit activations, AVX2 (AVX-VNNI where the CPU has it):
 * native/int4_blocks.c's arithmetic and layouts in 8-lane registers, for CPUs without AVX-512.
 *
 * As there: each activation row is quantized to int16 with one scale, a block's products are
 * summed exactly in int32 lanes (vpmaddwd, or vpdpwssd with AVX-VNNI), each block's sums are
 * scaled and accumulated in float lanes, and every output element is computed by the same
 * sequence of operations whatever the number of rows or threads. A 64-element chunk's two blocks
 * take one 8-lane register each (AVX-512 puts both in one 16-lane register): the float additions'
 * order differs from the AVX-512 build's, so the two builds may differ in the last bits.
 *
 * Layouts (native/int4_blocks.c): codes [N][K / 2], ggml's nibble order (not the AVX-512 chunks: layouts.Int4Blocks.pack
 * packs for the build this CPU runs); scales [N][K / 32]; mins
 * [N / 16][K / 32][16]; float16 or float32. Requires K % 64 == 0 and N % 16 == 0.
 */
#include <stdlib.h>
#include <string.h>

#include "simd.h"
#include "rms_norm.c" /* rms_norm: int4_blocks_normed norms its rows first with the same code */

/* One activation row -> int16 codes laid out like the unpacked weights (per 64 elements: the
 * first 16 of each block of 32, then the last 16 of each), the row's scale, and each block's sum
 * of the unquantized values (for the mins). */
static void quantize_row(const void *x, int bf16, int64_t row, int64_t K, int16_t *codes, float *scale, float *sums)
{
    const int64_t base = row * K;
    float inverse;
    *scale = int16_scale(x, bf16, base, K, &inverse);
    const __m256 inv = _mm256_set1_ps(inverse);
    for (int64_t p = 0; p < K / 64; p++) {
        const int64_t at = base + 64 * p;
        for (int half = 0; half < 2; half++) {
            const int64_t b = at + 32 * half;
            __m256 s = _mm256_add_ps(_mm256_add_ps(load8_all(x, bf16, b), load8_all(x, bf16, b + 8)),
                                     _mm256_add_ps(load8_all(x, bf16, b + 16), load8_all(x, bf16, b + 24)));
            sums[2 * p + half] = reduce_add8(s);
        }
        int16_t *c = codes + 64 * p;
        _mm256_storeu_si256((__m256i *)c, codes16(x, bf16, at, inv));
        _mm256_storeu_si256((__m256i *)(c + 16), codes16(x, bf16, at + 32, inv));
        _mm256_storeu_si256((__m256i *)(c + 32), codes16(x, bf16, at + 16, inv));
        _mm256_storeu_si256((__m256i *)(c + 48), codes16(x, bf16, at + 48, inv));
    }
}

/* Scales b .. b + count - 1 (count 2 or 4) as floats in lanes 0..count - 1 (the rest unused). */
INLINE __m128 scale_quad(const void *scales, int half, int64_t b, int count)
{
    if (half) {
        const __m128i h = count == 2 ? _mm_cvtsi32_si128(*(const int32_t *)((const uint16_t *)scales + b))
                                     : _mm_loadl_epi64((const __m128i *)((const uint16_t *)scales + b));
        return _mm_cvtph_ps(h);
    }
    if (count == 2)
        return _mm_castpd_ps(_mm_load_sd((const double *)((const float *)scales + b)));
    return _mm_loadu_ps((const float *)scales + b);
}

INLINE __m256 min8(const void *mins, int half, int64_t i)
{
    if (half)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)mins + i)));
    return _mm256_loadu_ps((const float *)mins + i);
}

/* Row t's 16 outputs: the sums of acc[t]'s lanes times the row's scale, plus the mins times the
 * row's block sums. */
INLINE void store_rows(__m256 acc[][16], const void *mins, int half, int64_t blocks, const float *xs, const float *xsums,
                       int rows, float *y, int64_t ldy)
{
    for (int t = 0; t < rows; t++) {
        /* mins are stored [blocks][16] per group: two vectors per block */
        __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; b++) {
            const __m256 s = _mm256_set1_ps(xsums[t * blocks + b]);
            m0 = _mm256_fmadd_ps(min8(mins, half, 16 * b), s, m0);
            m1 = _mm256_fmadd_ps(min8(mins, half, 16 * b + 8), s, m1);
        }
        const __m256 s0 = sum8(acc[t]), s1 = sum8(acc[t] + 8);
        const __m256 r = _mm256_set1_ps(xs[t]);
        _mm256_storeu_ps(y + t * ldy, _mm256_fmadd_ps(s0, r, m0));
        _mm256_storeu_ps(y + t * ldy + 8, _mm256_fmadd_ps(s1, r, m1));
    }
}

/* 16 output rows (a group) times up to ROW_TILE activation rows. Scales and mins are float16
 * when `half` (a constant in each inlined copy), else float32. `prefetch`: the group's first pass
 * over its weights (from memory), which asks for them ahead; later passes find them in cache. */
INLINE void group(const uint8_t *codes, const void *scales, const void *mins, int half, int64_t K, const int16_t *xq,
                  const float *xs, const float *xsums, int rows, int prefetch, float *y, int64_t ldy)
{
    const __m256i low = _mm256_set1_epi16(0x0F);
    const int64_t blocks = K / 32;
    __m256 acc[ROW_TILE][16];
    for (int n = 0; n < 16; n++) {
        const uint8_t *wc = codes + n * (K / 2);
        /* even blocks sum in a, odd ones in b: one multiply-add a block per chain, not two after
         * each other (at one row the chain's latency, not the arithmetic, set the pace) */
        __m256 a[ROW_TILE], b[ROW_TILE];
        for (int t = 0; t < ROW_TILE; t++)
            a[t] = b[t] = _mm256_setzero_ps();
        for (int64_t p = 0; p < K / 64; p++) {
            if (prefetch)
                _mm_prefetch((const char *)(wc + 32 * p) + PREFETCH_BYTES, _MM_HINT_T0);
            /* block 2p's 16 bytes, then block 2p + 1's: the low nibbles are a block's first 16 elements */
            __m256i w0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wc + 32 * p)));
            __m256i w1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wc + 32 * p + 16)));
            __m256i lo0 = _mm256_and_si256(w0, low), hi0 = _mm256_srli_epi16(w0, 4);
            __m256i lo1 = _mm256_and_si256(w1, low), hi1 = _mm256_srli_epi16(w1, 4);
            const __m128 pair = scale_quad(scales, half, n * blocks + 2 * p, 2);
            const __m256 sv0 = _mm256_broadcastss_ps(pair), sv1 = _mm256_broadcastss_ps(_mm_movehdup_ps(pair));
            for (int t = 0; t < rows; t++) {
                const int16_t *q = xq + t * K + 64 * p;
                __m256i s0 = DOT16(_mm256_setzero_si256(), lo0, _mm256_loadu_si256((const __m256i *)q));
                s0 = DOT16(s0, hi0, _mm256_loadu_si256((const __m256i *)(q + 32)));
                __m256i s1 = DOT16(_mm256_setzero_si256(), lo1, _mm256_loadu_si256((const __m256i *)(q + 16)));
                s1 = DOT16(s1, hi1, _mm256_loadu_si256((const __m256i *)(q + 48)));
                a[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), sv0, a[t]);
                b[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), sv1, b[t]);
            }
        }
        for (int t = 0; t < rows; t++)
            acc[t][n] = _mm256_add_ps(a[t], b[t]);
    }
    store_rows(acc, mins, half, blocks, xs, xsums, rows, y, ldy);
}

/* native/int4_blocks.c's int4_blocks_matmul, same arguments and results within the same bounds. */
void int4_blocks_matmul(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *codes, const void *scales,
                        const void *mins, int half, int64_t N, float *y, int threads)
{
    if (M <= 0)
        return;
    const size_t width = half ? 2 : 4;
    int16_t *xq = aligned_alloc(64, (size_t)(M * K * 2 + 63) / 64 * 64);
    float *xs = malloc((size_t)M * sizeof(float));
    float *xsums = malloc((size_t)(M * (K / 32)) * sizeof(float));
#pragma omp parallel for num_threads(threads) schedule(static) if (M >= PARALLEL_QUANTIZE_ROWS)
    for (int64_t m = 0; m < M; m++)
        quantize_row(x, x_bf16, m, K, xq + m * K, xs + m, xsums + m * (K / 32));
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < N / 16; g++) {
        const uint8_t *c = codes + 16 * g * (K / 2);
        const char *s = (const char *)scales + 16 * g * (K / 32) * width, *mn = (const char *)mins + 16 * g * (K / 32) * width;
        for (int64_t m = 0; m < M; m += ROW_TILE) {
            const int rows = M - m < ROW_TILE ? (int)(M - m) : ROW_TILE;
            const int16_t *q = xq + m * K;
            const float *qs = xs + m, *qsums = xsums + m * (K / 32);
            float *out = y + m * N + 16 * g;
            /* one copy of the loop per scale width too */
#define GROUP(R)                                                                                                      \
    do {                                                                                                              \
        if (half)                                                                                                     \
            group(c, s, mn, 1, K, q, qs, qsums, R, m == 0, out, N);                                                   \
        else                                                                                                          \
            group(c, s, mn, 0, K, q, qs, qsums, R, m == 0, out, N);                                                   \
    } while (0)
            FOR_ROW_COUNT(rows, GROUP);
#undef GROUP
        }
    }
    free(xq);
    free(xs);
    free(xsums);
}

/* int4_blocks_matmul of rms_norm(x) * w (rms_norm.c): one call where a norm feeds a linear, the same
 * bits as the two calls (the normed rows go through the same functions in the same order). */
int int4_blocks_normed(const void *x, int x_bf16, int64_t M, int64_t K, const float *w, float eps, const uint8_t *codes,
                       const void *scales, const void *mins, int half, int64_t N, float *y, int threads)
{
    if (M <= 0)
        return 0;
    float *normed = malloc((size_t)(M * K) * sizeof(float));
    if (!normed)
        return -1;
    rms_norm(x, x_bf16, M, K, w, eps, normed, threads);
    int4_blocks_matmul(normed, 0, M, K, codes, scales, mins, half, N, y, threads);
    free(normed);
    return 0;
}

/* residual + int4_blocks_matmul(x, ...), float32 [M][N], or with `norm`, residual + rms_norm(the product) *
 * norm (rms_norm.c; Gemma's post-norms): a linear whose output joins the residual stream, in one
 * call (join_residual, rms_norm.c). The same bits as the separate calls: each step is the same
 * function. Returns -1 where memory runs out. */
int int4_blocks_added(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *codes, const void *scales,
                      const void *mins, int half, int64_t N, const float *norm, float eps, const float *residual, float *y,
                      int threads)
{
    if (M <= 0)
        return 0;
    float *product = y;
    if (norm && !(product = malloc((size_t)(M * N) * sizeof(float))))
        return -1;
    int4_blocks_matmul(x, x_bf16, M, K, codes, scales, mins, half, N, product, threads);
    join_residual(product, norm, eps, residual, y, M, N, threads);
    if (product != y)
        free(product);
    return 0;
}
