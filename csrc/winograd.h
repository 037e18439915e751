// Winograd F(2x2, 3x3) transforms for cpu_layout's own 3x3 stride-1 convolution
// (conv.cpp runs the 16 matrix products on oneDNN's matmul between them).
// Include after cl_api.h (it has no include guard: cffi reads it verbatim).
#pragma once

#include <cstdint>
#include <string>

namespace clwino {

// Empty when the problem is one the Winograd path computes, else why not.
std::string unsupported(const cl_conv_args &a);

// Tiles of 2x2 outputs over a batch of HxW images.
inline int64_t tiles(int64_t n, int64_t h, int64_t w) { return n * ((h + 1) / 2) * ((w + 1) / 2); }

// u[16][c][k] = G g G^T of each (k, c) 3x3 filter of w: [k][c][3][3] (OIHW), or
// [k][3][3][c] when w_cl (OHWI); dtype (CL_F32 or CL_BF16) of both, computed in float32.
void transform_weight(const void *w, int dtype, bool w_cl, int64_t c, int64_t k, void *u);

// The products run a block of tiles at a time: the transformed input and output are
// 4x the size of the input and output, and per thread at most this much scratch is
// kept (batch 1 at 224 px needs a single block: 64 channels at 56x56 take 6.4 MB).
constexpr int64_t SCRATCH_BYTES = int64_t(32) << 20;
int64_t block_tiles(int64_t n, int64_t h, int64_t w, int64_t c, int64_t k);

// v[16][block][c] (x's dtype) = B^T d B of the 4x4 input patch of tiles [first, first + block)
// (zero outside the image, and for tiles past the last); x: [n][h][w][c] (NHWC), padding 1.
void transform_input(const void *x, int dtype, int64_t n, int64_t h, int64_t w, int64_t c, int64_t first,
                     int64_t block, void *v);

// y[n][h][w][k] (NHWC, `dtype`) at tiles [first, first + block) = A^T m A of each tile (m:
// [16][block][k], float32) plus bias, then the post-ops in order: CL_PO_RELU (alpha:
// negative slope), CL_PO_CLAMP, CL_PO_ADD (the next of `residuals`, like y; the first may
// be y's own storage).
void transform_output(const float *m, int dtype, int64_t n, int64_t h, int64_t w, int64_t k, int64_t first,
                      int64_t block, const void *bias, int bias_dtype, const cl_post_op *post_ops, int n_post_ops,
                      const void *const *residuals, void *y);

}  // namespace clwino
