/* Rotary position embedding of q and k heads read in place from a fused projection's rows.
 *
 * Plain C for every variant: a decode step rotates a few hundred floats a layer, so the work is
 * nothing; what this saves is the dozen tensor views and kernels torch needs to cut q and k out of
 * the fused q/k/v output, rotate them and lay them out for the attention kernel.
 *
 * The products and sums are those of the torch graph it replaces, rounded the same way and summed in
 * the same order, so the bits are the same (tests/test_torch_native.py):
 *   adjacent pairs (a, b) turned by (c, s): (a*c - b*s, a*s + b*c), torch's complex product, each
 *   product and the sum rounded (built with -ffp-contract=off);
 *   halves (NeoX): x[i]*cos[i] + x[i +- dims/2]*sin[i], sin signed: torch's addcmul, which fuses the
 *   second product with the sum (one fmaf here too).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Row r of x starts at x + r * x_stride floats; its heads [0, heads) are head_dim floats apart.
 * Heads below `split` go to q_out [rows][split][head_dim], the others to k_out [rows][heads - split][head_dim].
 * The first `dims` features of a head rotate; the rest are copied. Table row r: dims / 2 (cos, sin)
 * pairs at table + r * dims. neox == 0: pair i turns features 2i and 2i + 1; else features i and
 * i + dims / 2. */
void rope_heads(const float *x, int64_t rows, int64_t x_stride, int64_t heads, int64_t split, int64_t head_dim,
                const float *table, int64_t dims, int neox, float *q_out, float *k_out)
{
    const int64_t half = dims / 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *t = table + r * dims;
        for (int64_t h = 0; h < heads; h++) {
            const float *in = x + r * x_stride + h * head_dim;
            float *out = h < split ? q_out + (r * split + h) * head_dim : k_out + (r * (heads - split) + h - split) * head_dim;
            if (neox) {
                for (int64_t i = 0; i < half; i++) /* the first half turns by -sin, the second by sin */
                    out[i] = fmaf(in[i + half], -t[2 * i + 1], in[i] * t[2 * i]);
                for (int64_t i = 0; i < half; i++)
                    out[i + half] = fmaf(in[i], t[2 * i + 1], in[i + half] * t[2 * i]);
            } else {
                /* Real and imaginary parts in two loops: in one, GCC's vectorizer recognises the complex
                 * product and emits vfmaddsub, a fused multiply-add, whatever -ffp-contract says. */
                for (int64_t i = 0; i < half; i++)
                    out[2 * i] = in[2 * i] * t[2 * i] - in[2 * i + 1] * t[2 * i + 1];
                for (int64_t i = 0; i < half; i++)
                    out[2 * i + 1] = in[2 * i] * t[2 * i + 1] + in[2 * i + 1] * t[2 * i];
            }
            if (dims < head_dim)
                memcpy(out + dims, in + dims, (size_t)(head_dim - dims) * sizeof(float));
        }
    }
}
