/* int8 weights with one scale per output row times 16-bit activations, AVX2 (AVX-VNNI where the
 * CPU has it): native/int8_rows.c's arithmetic and layouts in 8-lane registers, for CPUs without
 * AVX-512 (codes int8 [N][K], scales bf16 [N]).
 *
 * As there: each activation row is quantized to int16 with one scale, and a row's products are
 * summed exactly in int32 lanes (vpmaddwd, or vpdpwssd with AVX-VNNI: int16 times int16, so
 * vpmaddubsw's int16 saturation never enters), flushed to float every FLUSH columns. Each 32
 * columns take two 8-lane registers, the first holding the AVX-512 build's lanes 0-7 and the
 * second its lanes 8-15, and `sum16` adds the 16 lanes in that build's order: every output is the
 * AVX-512 build's, bit for bit, and the same whatever the number of rows or threads. Requires
 * K % 32 == 0 and N % 16 == 0. The two-level quantization for torch._int_mm is the AVX-512
 * build's too (the same roundings, the same codes and scales).
 */
#include <stdlib.h>

#include "simd.h"
#include "rms_norm.c" /* rms_norm: int8_rows_normed norms its rows first with the same code */

/* Columns summed in int32 lanes before converting: each lane then holds FLUSH / 16 products of
 * at most 128 * 32767, below 2^31 (and the AVX-512 build's lanes: the same flushes). */
#define FLUSH 2048

static void quantize_row(const void *x, int bf16, int64_t row, int64_t K, int16_t *codes, float *scale)
{
    const int64_t base = row * K;
    float inverse;
    *scale = int16_scale(x, bf16, base, K, &inverse);
    const __m256 inv = _mm256_set1_ps(inverse);
    for (int64_t k = 0; k < K; k += 16)
        _mm256_storeu_si256((__m256i *)(codes + k), codes16(x, bf16, base + k, inv));
}

/* Per 128-bit half, lane i: v[i]'s four lanes of that half as (x0 + x2) + (x1 + x3), the order of
 * the AVX-512 sum16's first two steps. */
INLINE __m256 quad_sums(const __m256 *v)
{
    const __m256 t0 = _mm256_add_ps(_mm256_unpacklo_ps(v[0], v[1]), _mm256_unpackhi_ps(v[0], v[1]));
    const __m256 t1 = _mm256_add_ps(_mm256_unpacklo_ps(v[2], v[3]), _mm256_unpackhi_ps(v[2], v[3]));
    const __m256d a = _mm256_castps_pd(t0), b = _mm256_castps_pd(t1);
    return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
}

/* Lane i: the sum of the 16 lanes (lo[i]: lanes 0-7, hi[i]: lanes 8-15) in the AVX-512 sum16's
 * order, ((c0 + c2) + (c1 + c3)) over the four quads c, so that both builds round alike. */
INLINE __m256 sum16(const __m256 *lo, const __m256 *hi)
{
    /* r: per 128-bit half h, quads h + (h + 2) of 4 outputs */
    const __m256 r03 = _mm256_add_ps(quad_sums(lo), quad_sums(hi));
    const __m256 r47 = _mm256_add_ps(quad_sums(lo + 4), quad_sums(hi + 4));
    return _mm256_add_ps(_mm256_permute2f128_ps(r03, r47, 0x20), _mm256_permute2f128_ps(r03, r47, 0x31));
}

/* 8 output rows times up to ROW_TILE activation rows; `prefetch`: the weight rows' first pass (from
 * memory), which asks for them ahead. Later passes find them in cache, where the prefetches only
 * took issue slots (prompt rows 8-13% slower with them; BENCHMARKS.md, "AVX2 prompt kernels"). */
INLINE void octet(const int8_t *codes, const uint16_t *scales, int64_t K, const int16_t *xq, const float *xs, int rows,
                  int prefetch, float *y, int64_t ldy)
{
    __m256 lo[ROW_TILE][8], hi[ROW_TILE][8];
    for (int n = 0; n < 8; n++) {
        const int8_t *w = codes + n * K;
        __m256 sums_lo[ROW_TILE], sums_hi[ROW_TILE];
        for (int t = 0; t < ROW_TILE; t++)
            sums_lo[t] = sums_hi[t] = _mm256_setzero_ps();
        for (int64_t k0 = 0; k0 < K; k0 += FLUSH) {
            const int64_t k1 = K - k0 < FLUSH ? K : k0 + FLUSH;
            __m256i dots_lo[ROW_TILE], dots_hi[ROW_TILE];
            for (int t = 0; t < ROW_TILE; t++)
                dots_lo[t] = dots_hi[t] = _mm256_setzero_si256();
            for (int64_t k = k0; k < k1; k += 32) {
                if (prefetch)
                    _mm_prefetch((const char *)(w + k) + PREFETCH_BYTES, _MM_HINT_T0);
                const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + k)));
                const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + k + 16)));
                for (int t = 0; t < rows; t++) {
                    const int16_t *q = xq + t * K + k;
                    dots_lo[t] = DOT16(dots_lo[t], w0, _mm256_loadu_si256((const __m256i *)q));
                    dots_hi[t] = DOT16(dots_hi[t], w1, _mm256_loadu_si256((const __m256i *)(q + 16)));
                }
            }
            for (int t = 0; t < rows; t++) {
                sums_lo[t] = _mm256_add_ps(sums_lo[t], _mm256_cvtepi32_ps(dots_lo[t]));
                sums_hi[t] = _mm256_add_ps(sums_hi[t], _mm256_cvtepi32_ps(dots_hi[t]));
            }
        }
        for (int t = 0; t < rows; t++) {
            lo[t][n] = sums_lo[t];
            hi[t][n] = sums_hi[t];
        }
    }
    const __m256 ws = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)scales)), 16));
    for (int t = 0; t < rows; t++)
        _mm256_storeu_ps(y + t * ldy, _mm256_mul_ps(_mm256_mul_ps(sum16(lo[t], hi[t]), _mm256_set1_ps(xs[t])), ws));
}

/* y[M][N] (float) = x[M][K] (float, or bf16 when x_bf16) times (codes * scales)^T. */
void int8_rows_matmul(const void *x, int x_bf16, int64_t M, int64_t K, const int8_t *codes, const uint16_t *scales,
                      int64_t N, float *y, int threads)
{
    if (M <= 0)
        return;
    int16_t *xq = aligned_alloc(64, (size_t)(M * K * sizeof(int16_t) + 63) / 64 * 64);
    float *xs = malloc((size_t)M * sizeof(float));
#pragma omp parallel for num_threads(threads) schedule(static) if (M >= PARALLEL_QUANTIZE_ROWS)
    for (int64_t m = 0; m < M; m++)
        quantize_row(x, x_bf16, m, K, xq + m * K, xs + m);
    /* groups of 16 output rows, as the AVX-512 build shares them out (N % 16 == 0), 8 at a time */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < N / 16; g++) {
        for (int64_t m = 0; m < M; m += ROW_TILE) {
            const int rows = M - m < ROW_TILE ? (int)(M - m) : ROW_TILE;
            const int16_t *q = xq + m * K;
            for (int64_t o = 16 * g; o < 16 * g + 16; o += 8) {
                const int8_t *c = codes + o * K;
                float *out = y + m * N + o;
#define OCTET(R) octet(c, scales + o, K, q, xs + m, R, 1, out, N)
#define WARM_OCTET(R) octet(c, scales + o, K, q, xs + m, R, 0, out, N)
                if (m == 0)
                    FOR_ROW_COUNT(rows, OCTET)
                else
                    FOR_ROW_COUNT(rows, WARM_OCTET)
#undef OCTET
#undef WARM_OCTET
            }
        }
    }
    free(xq);
    free(xs);
}

/* v rounded to the nearest integer, ties to even (as the AVX-512 build's roundscale). */
INLINE __m256 nearest(__m256 v)
{
    return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* The int8 codes of 8 integral floats q, saturated; stores the first `left` (at most 8). */
INLINE void store_codes8(int8_t *to, __m256 q, int64_t left)
{
    /* |q| <= 127 here; packs saturate as vpmovsdb does, then take the low 8 bytes of each half */
    const __m256i w = _mm256_packs_epi32(_mm256_cvtps_epi32(q), _mm256_setzero_si256()); /* a0-3 0 | a4-7 0 */
    const __m128i b = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)); /* a0-3 0 a4-7 0 */
    const __m128i bytes = _mm_unpacklo_epi32(b, _mm_srli_si128(b, 8));                              /* a0-7 ... */
    int8_t all[16];
    _mm_storeu_si128((__m128i *)all, bytes);
    for (int64_t i = 0; i < (left < 8 ? left : 8); i++)
        to[i] = all[i];
}

/* Prompt rows for torch._int_mm (int8 x int8, exact): each row in two levels, x ~ s1 q1 + s2 q2,
 * the second rounding what the first left (error ~1/32000 of the row's largest value). codes:
 * int8 [2M][K] (all first levels, then all second levels); scales: float [2][M]. */
void int8_two_levels(const void *x, int x_bf16, int64_t M, int64_t K, int8_t *codes, float *scales, int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const int64_t base = m * K;
        const float top = absmax(x, x_bf16, base, K);
        const float s1 = top / 127.0f, inv1 = top > 0.0f ? 127.0f / top : 0.0f;
        const __m256 vs1 = _mm256_set1_ps(s1), vinv1 = _mm256_set1_ps(inv1);
        __m256 rest_top = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 8) { /* the first level's leftovers, for the second's scale */
            const __m256 v = load8(x, x_bf16, base + k, K - k);
            const __m256 q = nearest(_mm256_mul_ps(v, vinv1));
            rest_top = _mm256_max_ps(rest_top, abs8(_mm256_fnmadd_ps(q, vs1, v)));
        }
        const float top2 = reduce_max8(rest_top);
        const float s2 = top2 / 127.0f, inv2 = top2 > 0.0f ? 127.0f / top2 : 0.0f;
        const __m256 vinv2 = _mm256_set1_ps(inv2);
        for (int64_t k = 0; k < K; k += 8) {
            const __m256 v = load8(x, x_bf16, base + k, K - k);
            const __m256 q = nearest(_mm256_mul_ps(v, vinv1));
            const __m256 r = nearest(_mm256_mul_ps(_mm256_fnmadd_ps(q, vs1, v), vinv2));
            store_codes8(codes + base + k, q, K - k);
            store_codes8(codes + M * K + base + k, r, K - k);
        }
        scales[m] = s1;
        scales[M + m] = s2;
    }
}

/* y[M][N] = (s1 * first[m] + s2 * second[m]) * weight scale, from _int_mm's int32 [2M][N]. */
void int8_two_level_out(const int32_t *products, const float *scales, const uint16_t *weight_scales, int64_t M, int64_t N,
                        float *y, int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const __m256 s1 = _mm256_set1_ps(scales[m]), s2 = _mm256_set1_ps(scales[M + m]);
        for (int64_t n = 0; n < N; n += 8) {
            const int64_t left = N - n;
            __m256 a, b, w;
            if (left >= 8) {
                a = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(products + m * N + n)));
                b = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(products + (M + m) * N + n)));
                w = load8_all(weight_scales, 1, n);
            } else { /* a tail of fewer than 8 columns */
                int32_t pa[8] = {0}, pb[8] = {0};
                for (int64_t i = 0; i < left; i++) {
                    pa[i] = products[m * N + n + i];
                    pb[i] = products[(M + m) * N + n + i];
                }
                a = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)pa));
                b = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)pb));
                w = load8(weight_scales, 1, n, left);
            }
            store8(y + m * N + n, _mm256_mul_ps(_mm256_fmadd_ps(b, s2, _mm256_mul_ps(a, s1)), w), left);
        }
    }
}

/* int8_rows_matmul of rms_norm(x) * w (rms_norm.c): one call where a norm feeds a linear, the same
 * bits as the two calls (the normed rows go through the same functions in the same order). */
int int8_rows_normed(const void *x, int x_bf16, int64_t M, int64_t K, const float *w, float eps, const int8_t *codes,
                     const uint16_t *scales, int64_t N, float *y, int threads)
{
    if (M <= 0)
        return 0;
    float *normed = malloc((size_t)(M * K) * sizeof(float));
    if (!normed)
        return -1;
    rms_norm(x, x_bf16, M, K, w, eps, normed, threads);
    int8_rows_matmul(normed, 0, M, K, codes, scales, N, y, threads);
    free(normed);
    return 0;
}

/* residual + int8_rows_matmul(x, ...), float32 [M][N], or with `norm`, residual + rms_norm(the product) *
 * norm (rms_norm.c; Gemma's post-norms): a linear whose output joins the residual stream, in one
 * call (join_residual, rms_norm.c). The same bits as the separate calls: each step is the same
 * function. Returns -1 where memory runs out. */
int int8_rows_added(const void *x, int x_bf16, int64_t M, int64_t K, const int8_t *codes, const uint16_t *scales,
                    int64_t N, const float *norm, float eps, const float *residual, float *y, int threads)
{
    if (M <= 0)
        return 0;
    float *product = y;
    if (norm && !(product = malloc((size_t)(M * N) * sizeof(float))))
        return -1;
    int8_rows_matmul(x, x_bf16, M, K, codes, scales, N, product, threads);
    join_residual(product, norm, eps, residual, y, M, N, threads);
    if (product != y)
        free(product);
    return 0;
}
