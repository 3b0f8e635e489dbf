/* Gated activations of a feed-forward layer, AVX2: native/gated.c in 8-lane registers, same
 * arguments: act(gate) * up in one pass (SwiGLU's silu, GeGLU's tanh-approximated gelu), each
 * element alone. */
#include "simd.h"

#define PARALLEL_ELEMENTS 32768

enum { SILU = 0, GELU_TANH = 1 };

/* 1 / (1 + e^-x), from e^-|x| (never overflows) */
INLINE __m256 sigmoid(__m256 x)
{
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_setzero_ps(), abs8(x)));
    const __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
    /* x < 0: e / (1 + e) */
    return _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
}

INLINE __m256 activation(__m256 x, int kind)
{
    if (kind == SILU)
        return _mm256_mul_ps(x, sigmoid(x));
    /* 0.5 x (1 + tanh(y)) = x * sigmoid(2y), y = sqrt(2 / pi) (x + 0.044715 x^3) */
    const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    const __m256 y = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));
    return _mm256_mul_ps(x, sigmoid(_mm256_add_ps(y, y)));
}

INLINE void gated_row(const float *g, const float *u, int64_t width, int kind, float *out)
{
    for (int64_t i = 0; i < width; i += 8) {
        const int64_t left = width - i;
        const __m256 a = activation(load8(g, 0, i, left), kind);
        store8(out + i, _mm256_mul_ps(a, load8(u, 0, i, left)), left);
    }
}

void gated(const float *gate, int64_t gate_stride, const float *up, int64_t up_stride, int64_t rows, int64_t width,
           int kind, float *out, int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * width >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        if (kind == SILU)
            gated_row(gate + r * gate_stride, up + r * up_stride, width, SILU, out + r * width);
        else
            gated_row(gate + r * gate_stride, up + r * up_stride, width, GELU_TANH, out + r * width);
    }
}
