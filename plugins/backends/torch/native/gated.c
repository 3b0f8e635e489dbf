/* Gated activations of a feed-forward layer, AVX-512: act(gate) * up in one pass (SwiGLU's silu,
 * GeGLU's tanh-approximated gelu) instead of torch's two kernels and the intermediate between them.
 * gate and up are float32 rows of `width` with any row strides (column slices of the fused
 * gate/up output are read in place); out is float32 [rows][width]. Each element alone. */
#include "simd.h"

#define PARALLEL_ELEMENTS 32768

enum { SILU = 0, GELU_TANH = 1 };

/* 1 / (1 + e^-x), from e^-|x| (never overflows) */
INLINE __m512 sigmoid(__m512 x)
{
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
    const __m512 inv = _mm512_div_ps(one, _mm512_add_ps(one, e));
    return _mm512_mask_mul_ps(inv, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), e, inv); /* x < 0: e / (1 + e) */
}

INLINE __m512 activation(__m512 x, int kind)
{
    if (kind == SILU)
        return _mm512_mul_ps(x, sigmoid(x));
    /* 0.5 x (1 + tanh(y)) = x * sigmoid(2y), y = sqrt(2 / pi) (x + 0.044715 x^3) */
    const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    const __m512 y = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f), _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), x3, x));
    return _mm512_mul_ps(x, sigmoid(_mm512_add_ps(y, y)));
}

INLINE void gated_row(const float *g, const float *u, int64_t width, int kind, float *out)
{
    for (int64_t i = 0; i < width; i += 16) {
        const __mmask16 m = lanes_left(width - i);
        const __m512 a = activation(_mm512_maskz_loadu_ps(m, g + i), kind);
        _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(a, _mm512_maskz_loadu_ps(m, u + i)));
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
