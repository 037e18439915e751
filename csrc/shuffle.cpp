// Channel shuffle (ShuffleNet's view-transpose-contiguous-view), optionally
// one channel range of it: the kernel both wrappers run for
// cpu_layout.ops.channel_shuffle. oneDNN has no such primitive, its
// reorder takes the (N, C/g, g, ...) gather as a strided copy with a
// two-element inner loop (3-4x slower than this), and ATen's
// native_channel_shuffle cannot write one range of the result densely.
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <vector>

extern "C" {
#include "cl_api.h"
}

namespace {

// One pixel's channels: out[q] = src[idx(start + q)], idx(c) = (c % g) * k + c / g,
// walked group by group so that g == 2 is an interleave of two contiguous runs
// the compiler vectorises (the clones below pick the widest the CPU has).
template <typename T>
static inline void gather_pixel(const T *__restrict sp, T *__restrict op, int64_t m, int64_t g, int64_t k,
                                int64_t start) {
    int64_t q = 0, c = start;
    for (; q < m && c % g; ++q, ++c) op[q] = sp[(c % g) * k + c / g];
    const int64_t full = (m - q) / g;
    if (g == 2) {
        const T *s0 = sp + c / 2, *s1 = sp + k + c / 2;
        T *o = op + q;
        for (int64_t j = 0; j < full; ++j) {
            o[2 * j] = s0[j];
            o[2 * j + 1] = s1[j];
        }
    } else {
        for (int64_t j = 0; j < full; ++j)
            for (int64_t i = 0; i < g; ++i) op[q + j * g + i] = sp[i * k + c / g + j];
    }
    q += full * g;
    c += full * g;
    for (; q < m; ++q, ++c) op[q] = sp[(c % g) * k + c / g];
}

template <typename T>
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("O3")))
void gather_pixels(const T *s, T *o, int64_t npix, int64_t sstep, int64_t dstep, int64_t m, int64_t g, int64_t k,
                   int64_t start) {
#pragma omp parallel for if (npix * m > 16384)
    for (int64_t p = 0; p < npix; ++p) gather_pixel(s + p * sstep, o + p * dstep, m, g, k, start);
}

template <typename T>
void shuffle(const char *src, char *dst, int nd, const int64_t *dd, const int64_t *ss, const int64_t *ds,
             const std::vector<int64_t> &idx, int64_t g, int64_t k, int64_t start) {
    const int64_t m = dd[1];
    // Pixels: every (n, spatial...) position, innermost spatial dim last.
    int64_t psz[12], pss[12], pds[12], npix = 1;
    int np = 0;
    for (int d = 0; d < nd; ++d) {
        if (d == 1) continue;
        psz[np] = dd[d];
        pss[np] = ss[d];
        pds[np] = ds[d];
        npix *= dd[d];
        ++np;
    }
    auto offsets = [&](int64_t p, int64_t &so, int64_t &o) {
        so = o = 0;
        for (int d = np - 1; d >= 0; --d) {
            const int64_t i = p % psz[d];
            p /= psz[d];
            so += i * pss[d];
            o += i * pds[d];
        }
    };
    const T *s = reinterpret_cast<const T *>(src);
    T *o = reinterpret_cast<T *>(dst);
    if (ss[1] == 1 && ds[1] == 1) {  // channels innermost on both sides: gather each pixel's channels
        // Pixels one run of equal steps on both sides (dense NHWC): size-1 dims
        // aside, each pixel dim steps over the whole of the next one.
        bool linear = true;
        int inner = -1;
        for (int d = np - 1; d >= 0; --d) {
            if (psz[d] == 1) continue;
            if (inner >= 0 && (pss[d] != pss[inner] * psz[inner] || pds[d] != pds[inner] * psz[inner]))
                linear = false;
            inner = d;
        }
        if (linear) {
            int last = np - 1;
            while (last > 0 && psz[last] == 1) --last;
            gather_pixels<T>(s, o, npix, pss[last], pds[last], m, g, k, start);
            return;
        }
#pragma omp parallel for if (npix * m > 16384)
        for (int64_t p = 0; p < npix; ++p) {
            int64_t so, oo;
            offsets(p, so, oo);
            gather_pixel(s + so, o + oo, m, g, k, start);
        }
        return;
    }
    // Otherwise one channel plane at a time (NCHW: a memcpy of each plane).
    const int64_t n = dd[0], plane = npix / (n ? n : 1);
    bool rows = true;  // spatial dims dense and equally laid out on both sides
    int64_t want = 1;
    for (int d = nd - 1; d >= 2; --d) {
        if (dd[d] != 1 && (ss[d] != want || ds[d] != want)) rows = false;
        want *= dd[d];
    }
#pragma omp parallel for collapse(2) if (npix * m > 16384)
    for (int64_t b = 0; b < n; ++b)
        for (int64_t q = 0; q < m; ++q) {
            const T *sp = s + b * ss[0] + idx[q] * ss[1];
            T *op = o + b * ds[0] + q * ds[1];
            if (rows) {
                memcpy(op, sp, (size_t)plane * sizeof(T));
                continue;
            }
            for (int64_t p = 0; p < plane; ++p) {  // p over spatial positions of image b
                int64_t so, oo;
                offsets(p, so, oo);  // dim 0 of the pixel index is the batch: p < plane keeps it 0
                op[oo] = sp[so];
            }
        }
}

}  // namespace

extern "C" int cl_channel_shuffle(uintptr_t src, uintptr_t dst, int ndims, const int64_t *dst_dims,
                                  const int64_t *src_strides, const int64_t *dst_strides, int64_t src_channels,
                                  int64_t groups, int64_t start, int elsize) {
    if (ndims < 3 || ndims > 12 || !dst_dims || !src_strides || !dst_strides || groups <= 0 ||
        src_channels % groups != 0 || start < 0 || start + dst_dims[1] > src_channels || (elsize != 2 && elsize != 4))
        return 1;
    for (int d = 0; d < ndims; ++d)
        if (dst_dims[d] == 0) return 0;
    const int64_t k = src_channels / groups;
    std::vector<int64_t> idx((size_t)dst_dims[1]);
    for (int64_t q = 0; q < dst_dims[1]; ++q) {  // result channel j*g + i is input channel i*k + j
        const int64_t c = start + q;
        idx[(size_t)q] = (c % groups) * k + c / groups;
    }
    const char *s = reinterpret_cast<const char *>(src);
    char *o = reinterpret_cast<char *>(dst);
    if (elsize == 4) shuffle<uint32_t>(s, o, ndims, dst_dims, src_strides, dst_strides, idx, groups, k, start);
    else shuffle<uint16_t>(s, o, ndims, dst_dims, src_strides, dst_strides, idx, groups, k, start);
    return 0;
}
