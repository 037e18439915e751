// Winograd F(2x2, 3x3): a 3x3 stride-1 convolution as 16 matrix products over
// 4x4 input tiles, 2.25x fewer multiplications than the direct one. oneDNN 3.2
// has no Winograd kernel for this ISA (convolution_winograd is refused), and its
// direct kernels already run a 3x3 conv at the machine's FMA peak (64->64
// channels at 56x56, batch 1, one thread: 117 GFLOP/s on EPYC Zen 4), so fewer
// multiplications are the only way to make these convs faster. F(2x2, 3x3)
// rather than F(4x4, 3x3): its transforms add no error a float32 check sees
// (the values match the direct conv to a few ulps of the sums). bfloat16 data
// is transformed in float32 and rounded once to bfloat16 for the products,
// which accumulate in float32 as oneDNN's bf16 conv does.
//
// The transforms vectorise over channels (NHWC's innermost dim). The extension
// builds for any x86-64, so the loops are compiled for AVX-512, AVX2 and the
// baseline and the CPU picks one at load time (target_clones).

#include <cstdint>
extern "C" {
#include "cl_api.h"
}
#include "bf16.h"
#include "winograd.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <omp.h>
#include <vector>

namespace clwino {

#define CL_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))

std::string unsupported(const cl_conv_args &a) {
    if (a.nsp != 2) return "Winograd runs 2-D convolutions only";
    if ((a.dtype != CL_F32 && a.dtype != CL_BF16) ||
        (a.has_bias && a.bias_dtype != CL_F32 && a.bias_dtype != CL_BF16))
        return "Winograd runs float32 and bfloat16 only";
    if (a.groups != 1) return "Winograd runs ungrouped convolutions only";
    if (!a.src_cl || !a.dst_cl) return "Winograd runs channels-last input and output only";
    for (int i = 0; i < 2; ++i)
        if (a.k_sp[i] != 3 || a.stride[i] != 1 || a.dilation[i] != 1 || a.pad_l[i] != 1 || a.pad_r[i] != 1)
            return "Winograd runs 3x3 kernels with stride 1, dilation 1 and padding 1 only";
    for (int i = 0; i < a.n_post_ops; ++i) {
        const int k = a.post_ops[i].kind;
        if (k != CL_PO_RELU && k != CL_PO_CLAMP && k != CL_PO_ADD)
            return "Winograd fuses ReLU, clamp and residual adds only";
    }
    return "";
}

namespace {

// Loads and stores of either dtype, as float32.
typedef uint16_t bf16;
static inline float ld(float v) { return v; }
static inline float ld(bf16 h) { return clbf16::to_f32(h); }
template <class T> static inline T st(float v);
template <> inline float st<float>(float v) { return v; }
template <> inline bf16 st<bf16>(float v) { return clbf16::from_f32(v); }

template <class T>
void weight_impl(const T *w, bool w_cl, int64_t c, int64_t k, T *u) {
    for (int64_t o = 0; o < k; ++o)
        for (int64_t i = 0; i < c; ++i) {
            float g[3][3];
            for (int r = 0; r < 3; ++r)
                for (int s = 0; s < 3; ++s)
                    g[r][s] = ld(w_cl ? w[((o * 3 + r) * 3 + s) * c + i] : w[((o * c + i) * 3 + r) * 3 + s]);
            float t[4][3];  // G g
            for (int s = 0; s < 3; ++s) {
                t[0][s] = g[0][s];
                t[1][s] = 0.5f * (g[0][s] + g[1][s] + g[2][s]);
                t[2][s] = 0.5f * (g[0][s] - g[1][s] + g[2][s]);
                t[3][s] = g[2][s];
            }
            for (int r = 0; r < 4; ++r) {  // (G g) G^T
                const float e[4] = {t[r][0], 0.5f * (t[r][0] + t[r][1] + t[r][2]),
                                    0.5f * (t[r][0] - t[r][1] + t[r][2]), t[r][2]};
                for (int s = 0; s < 4; ++s) u[((int64_t)(r * 4 + s) * c + i) * k + o] = st<T>(e[s]);
            }
        }
}

struct Grid {
    int64_t n, h, w, th, tw, tiles;
    Grid(int64_t n_, int64_t h_, int64_t w_) : n(n_), h(h_), w(w_), th((h_ + 1) / 2), tw((w_ + 1) / 2) {
        tiles = n * th * tw;
    }
};

// B^T d B per tile, in float32 through `tmp` (16 rows of c), stored once in T.
template <class T>
static inline __attribute__((always_inline)) void input_impl(const T *x, const Grid &g, int64_t c, const T *zero,
                                                             int64_t base, int64_t i0, int64_t i1, int64_t block,
                                                             float *tmp, T *v) {
    const int64_t stride = block * c;  // between two of the 16 matrices
    for (int64_t b = i0; b < i1; ++b) {
        const int64_t t = base + b;  // past the last tile: zeros (the last block's padding)
        const int64_t img = t / (g.th * g.tw), ty = t / g.tw % g.th, tx = t % g.tw;
        const T *d[16];
        for (int i = 0; i < 4; ++i)
            for (int j = 0; j < 4; ++j) {
                const int64_t yy = ty * 2 - 1 + i, xx = tx * 2 - 1 + j;
                d[i * 4 + j] = (t < g.tiles && yy >= 0 && yy < g.h && xx >= 0 && xx < g.w)
                                   ? x + ((img * g.h + yy) * g.w + xx) * c : zero;
            }
        // B^T d, one column of the patch at a time.
        for (int j = 0; j < 4; ++j) {
            const T *__restrict r0 = d[j], *__restrict r1 = d[4 + j], *__restrict r2 = d[8 + j],
                    *__restrict r3 = d[12 + j];
            float *__restrict s0 = tmp + (0 + j) * c, *__restrict s1 = tmp + (4 + j) * c,
                              *__restrict s2 = tmp + (8 + j) * c, *__restrict s3 = tmp + (12 + j) * c;
#pragma omp simd
            for (int64_t ch = 0; ch < c; ++ch) {
                const float a0 = ld(r0[ch]), a1 = ld(r1[ch]), a2 = ld(r2[ch]), a3 = ld(r3[ch]);
                s0[ch] = a0 - a2;
                s1[ch] = a1 + a2;
                s2[ch] = a2 - a1;
                s3[ch] = a1 - a3;
            }
        }
        // (B^T d) B along each row of that.
        T *out = v + b * c;
        for (int i = 0; i < 4; ++i) {
            const float *__restrict q0 = tmp + (i * 4 + 0) * c, *__restrict q1 = tmp + (i * 4 + 1) * c,
                        *__restrict q2 = tmp + (i * 4 + 2) * c, *__restrict q3 = tmp + (i * 4 + 3) * c;
            T *__restrict e0 = out + (i * 4 + 0) * stride, *__restrict e1 = out + (i * 4 + 1) * stride,
                          *__restrict e2 = out + (i * 4 + 2) * stride, *__restrict e3 = out + (i * 4 + 3) * stride;
#pragma omp simd
            for (int64_t ch = 0; ch < c; ++ch) {
                e0[ch] = st<T>(q0[ch] - q2[ch]);
                e1[ch] = st<T>(q1[ch] + q2[ch]);
                e2[ch] = st<T>(q2[ch] - q1[ch]);
                e3[ch] = st<T>(q1[ch] - q3[ch]);
            }
        }
    }
}

CL_CLONES
void input_tiles_f32(const float *x, const Grid &g, int64_t c, const float *zero, int64_t base, int64_t i0,
                     int64_t i1, int64_t block, float *tmp, float *v) {
    input_impl(x, g, c, zero, base, i0, i1, block, tmp, v);
}
CL_CLONES
void input_tiles_bf16(const bf16 *x, const Grid &g, int64_t c, const bf16 *zero, int64_t base, int64_t i0,
                      int64_t i1, int64_t block, float *tmp, bf16 *v) {
    input_impl(x, g, c, zero, base, i0, i1, block, tmp, v);
}

// A^T m A per tile (m: float32) plus bias, the post-ops, stored in T.
template <class T>
static inline __attribute__((always_inline)) void output_impl(const float *m, const Grid &g, int64_t k,
                                                              const float *bias, const cl_post_op *po, int npo,
                                                              const T *const *res, int64_t base, int64_t i0,
                                                              int64_t i1, int64_t block, float *tmp, T *y) {
    const int64_t stride = block * k;
    for (int64_t b = i0; b < i1; ++b) {
        const int64_t t = base + b;
        if (t >= g.tiles) break;
        const int64_t img = t / (g.th * g.tw), ty = t / g.tw % g.th, tx = t % g.tw;
        const float *in = m + b * k;
        float *__restrict o0 = tmp, *__restrict o1 = tmp + k, *__restrict o2 = tmp + 2 * k,
                          *__restrict o3 = tmp + 3 * k;
        float *__restrict a = tmp + 4 * k;  // A^T m: 2 rows of 4, k each
        for (int j = 0; j < 4; ++j) {
            const float *__restrict m0 = in + j * stride, *__restrict m1 = in + (4 + j) * stride,
                        *__restrict m2 = in + (8 + j) * stride, *__restrict m3 = in + (12 + j) * stride;
            float *__restrict u = a + j * k, *__restrict l = a + (4 + j) * k;
#pragma omp simd
            for (int64_t ch = 0; ch < k; ++ch) {
                u[ch] = m0[ch] + m1[ch] + m2[ch];
                l[ch] = m1[ch] - m2[ch] - m3[ch];
            }
        }
        const float *__restrict u0 = a, *__restrict u1 = a + k, *__restrict u2 = a + 2 * k, *__restrict u3 = a + 3 * k;
        const float *__restrict l0 = a + 4 * k, *__restrict l1 = a + 5 * k, *__restrict l2 = a + 6 * k,
                    *__restrict l3 = a + 7 * k;
#pragma omp simd
        for (int64_t ch = 0; ch < k; ++ch) {  // (A^T m) A, plus bias
            const float bb = bias[ch];
            o0[ch] = u0[ch] + u1[ch] + u2[ch] + bb;
            o1[ch] = u1[ch] - u2[ch] - u3[ch] + bb;
            o2[ch] = l0[ch] + l1[ch] + l2[ch] + bb;
            o3[ch] = l1[ch] - l2[ch] - l3[ch] + bb;
        }
        for (int q = 0; q < 4; ++q) {
            const int64_t yy = ty * 2 + q / 2, xx = tx * 2 + q % 2;
            if (yy >= g.h || xx >= g.w) continue;
            const int64_t at = ((img * g.h + yy) * g.w + xx) * k;
            float *__restrict r = tmp + q * k;
            int next_res = 0;
            for (int p = 0; p < npo; ++p) {
                const float al = po[p].alpha, be = po[p].beta;
                if (po[p].kind == CL_PO_RELU) {
#pragma omp simd
                    for (int64_t ch = 0; ch < k; ++ch) r[ch] = r[ch] > 0.f ? r[ch] : r[ch] * al;
                } else if (po[p].kind == CL_PO_CLAMP) {
#pragma omp simd
                    for (int64_t ch = 0; ch < k; ++ch) r[ch] = std::min(std::max(r[ch], al), be);
                } else {  // CL_PO_ADD: read before y is written, which may be its storage
                    const T *__restrict s = res[next_res++] + at;
#pragma omp simd
                    for (int64_t ch = 0; ch < k; ++ch) r[ch] += ld(s[ch]);
                }
            }
            T *__restrict dst = y + at;
#pragma omp simd
            for (int64_t ch = 0; ch < k; ++ch) dst[ch] = st<T>(r[ch]);
        }
    }
}

CL_CLONES
void output_tiles_f32(const float *m, const Grid &g, int64_t k, const float *bias, const cl_post_op *po, int npo,
                      const float *const *res, int64_t base, int64_t i0, int64_t i1, int64_t block, float *tmp,
                      float *y) {
    output_impl(m, g, k, bias, po, npo, res, base, i0, i1, block, tmp, y);
}
CL_CLONES
void output_tiles_bf16(const float *m, const Grid &g, int64_t k, const float *bias, const cl_post_op *po, int npo,
                       const bf16 *const *res, int64_t base, int64_t i0, int64_t i1, int64_t block, float *tmp,
                       bf16 *y) {
    output_impl(m, g, k, bias, po, npo, res, base, i0, i1, block, tmp, y);
}

// body(i0, i1, tmp) over the block's tiles in chunks shared by the OpenMP team, each
// thread with `tmp_floats` floats of its own: enough tiles per chunk to amortise the
// call, and every thread busy.
template <class F>
void over_chunks(int64_t block, int64_t tmp_floats, F body) {
    const int64_t nt = omp_get_max_threads();
    const int64_t step = std::max<int64_t>(1, std::min<int64_t>(64, (block + nt - 1) / nt));
    const int64_t chunks = (block + step - 1) / step;
#pragma omp parallel if (chunks > 1)
    {
        std::unique_ptr<float[]> tmp(new float[(size_t)tmp_floats]);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < chunks; ++i) body(i * step, std::min(block, (i + 1) * step), tmp.get());
    }
}

}  // namespace

void transform_weight(const void *w, int dtype, bool w_cl, int64_t c, int64_t k, void *u) {
    if (dtype == CL_BF16) weight_impl(static_cast<const bf16 *>(w), w_cl, c, k, static_cast<bf16 *>(u));
    else weight_impl(static_cast<const float *>(w), w_cl, c, k, static_cast<float *>(u));
}

int64_t block_tiles(int64_t n, int64_t h, int64_t w, int64_t c, int64_t k) {
    const int64_t per_tile = 16 * 4 * (c + k);  // bytes of transformed input and output (at most)
    return std::min(tiles(n, h, w), std::max<int64_t>(16, SCRATCH_BYTES / per_tile));
}

void transform_input(const void *x, int dtype, int64_t n, int64_t h, int64_t w, int64_t c, int64_t first,
                     int64_t block, void *v) {
    const Grid g(n, h, w);
    const std::vector<float> zero((size_t)c, 0.f);  // all-zero bits: 0 in either dtype
    over_chunks(block, 16 * c, [&](int64_t i0, int64_t i1, float *tmp) {
        if (dtype == CL_BF16)
            input_tiles_bf16(static_cast<const bf16 *>(x), g, c, reinterpret_cast<const bf16 *>(zero.data()), first,
                             i0, i1, block, tmp, static_cast<bf16 *>(v));
        else
            input_tiles_f32(static_cast<const float *>(x), g, c, zero.data(), first, i0, i1, block, tmp,
                            static_cast<float *>(v));
    });
}

void transform_output(const float *m, int dtype, int64_t n, int64_t h, int64_t w, int64_t k, int64_t first,
                      int64_t block, const void *bias, int bias_dtype, const cl_post_op *post_ops, int n_post_ops,
                      const void *const *residuals, void *y) {
    const Grid g(n, h, w);
    std::vector<float> b32((size_t)k, 0.f);
    for (int64_t i = 0; bias && i < k; ++i)
        b32[(size_t)i] = bias_dtype == CL_BF16 ? ld(static_cast<const bf16 *>(bias)[i]) : static_cast<const float *>(bias)[i];
    over_chunks(block, 12 * k, [&](int64_t i0, int64_t i1, float *tmp) {
        if (dtype == CL_BF16)
            output_tiles_bf16(m, g, k, b32.data(), post_ops, n_post_ops, reinterpret_cast<const bf16 *const *>(residuals),
                              first, i0, i1, block, tmp, static_cast<bf16 *>(y));
        else
            output_tiles_f32(m, g, k, b32.data(), post_ops, n_post_ops,
                             reinterpret_cast<const float *const *>(residuals), first, i0, i1, block, tmp,
                             static_cast<float *>(y));
    });
}

}  // namespace clwino
