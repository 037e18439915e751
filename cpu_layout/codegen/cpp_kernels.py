"""OpenMP C++ for fused pointwise and reduction kernels.

Every generated kernel has the same C signature

    void <name>(const int64_t* sizes, void* const* data, const int64_t* strides);

  sizes    the iteration shape, ``ndim`` values (pointwise: the output shape; reduction: the
           input shape, before reducing)
  data     one pointer per tensor: inputs in order, then outputs
  strides  ``ndim`` strides per tensor (in elements), tensor-major: strides[t*ndim + d]. A
           broadcast dimension has stride 0. A reduction's output is described over the input's
           ``ndim`` dims with stride 0 on the reduced ones.

Shapes and strides are run-time values, so one compiled kernel serves every shape and layout.
The Python ``run`` wrappers validate tensors and build these arrays; a C++ wrapper can call the
function directly. All the loop machinery lives in a fixed preamble (templates parameterised by the
generated per-element lambdas), so the per-kernel code is only the expression.

Aliasing: an output may be the same memory as an input only with identical strides (in place:
each element is read before it is written, and no other element touches it). That is also what
makes ``#pragma omp simd`` legal without ``__restrict__``, which is therefore never emitted.
"""
import hashlib
import math
import operator
import os

import torch

from cpu_layout import build
from cpu_layout import layout as L
from cpu_layout.layout import channels_innermost
from cpu_layout.codegen.expr import OPS, Const, Load, Op, float_literal, loads

PARALLEL_MIN_NUMEL = 16384  # below this the OpenMP fork/join costs more than it saves
_MAX_NDIM = 16
_CTYPE = {torch.float32: "float", torch.bfloat16: "cl::bf16"}
_SHORT = {torch.float32: "f32", torch.bfloat16: "bf16"}
_REDUCTIONS = ("sum", "mean", "amax", "amin")

PREAMBLE = r"""
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <type_traits>
#include <omp.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#ifndef CL_KERNEL_PREAMBLE
#define CL_KERNEL_PREAMBLE
@SIMD_MATH@
namespace cl {
typedef uint16_t bf16;
// BLOCK: elements per tile; L: accumulator lanes; KB: elements per tile of a kept-inner
// reduction (outputs per block, or rows x outputs); RCHUNK: rows summed before they join the total;
// ROW_MIN: the shortest rows a pointwise op runs one call per row on (shorter rows go in tiles:
// a bf16 op over 32-channel rows took 137 us a call per row, 75 us in tiles; EPYC Zen 4).
// GROUP: elements per call when short dense rows go several to a call.
enum { BLOCK = 512, PAR_MIN = @PAR_MIN@, L = 16, KB = 1024, RCHUNK = 256, ROW_MIN = 128, PB = 64,
       GROUP = 2048 };

static inline float ld(float x) { return x; }
static inline float ld(bf16 h) {
  uint32_t u = (uint32_t)h << 16; float f; std::memcpy(&f, &u, 4); return f;
}
template <class T> static inline T cvt(float v);
template <> inline float cvt<float>(float v) { return v; }
// Round to nearest even, NaN -> canonical quiet NaN (as c10::BFloat16).
template <> inline bf16 cvt<bf16>(float v) {
  uint32_t u; std::memcpy(&u, &v, 4);
  return v != v ? (bf16)0x7fc0 : (bf16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
// n floats to bf16 as cvt<bf16> rounds them (to nearest even, denormals kept, as eager
// does). Kernels build with -march=native: with AVX512-BF16 one vcvtneps2bf16 rounds 16
// at a time (8 vector ops otherwise); it flushes denormals to zero, so a vector holding
// one takes cvt<bf16>. A NaN stays a NaN (its payload may differ).
static inline void narrow(bf16* d, const float* s, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512BF16__)
#if !defined(__AVX512DQ__)
  const __m512 tiny = _mm512_set1_ps(0x1p-126f), zero = _mm512_setzero_ps();
#endif
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(s + j);
#if defined(__AVX512DQ__)
    const __mmask16 denormal = _mm512_fpclass_ps_mask(v, 0x20);  // one instruction
#else
    const __mmask16 denormal = _mm512_cmp_ps_mask(_mm512_abs_ps(v), tiny, _CMP_LT_OQ) &
                               _mm512_cmp_ps_mask(v, zero, _CMP_NEQ_UQ);
#endif
    if (__builtin_expect(denormal, 0)) {
      for (int k = 0; k < 16; ++k) d[j + k] = cvt<bf16>(s[j + k]);
      continue;
    }
    _mm256_storeu_si256((__m256i*)(d + j), (__m256i)_mm512_cvtneps_pbh(v));
  }
#endif
#pragma omp simd
  for (int64_t i = j; i < n; ++i) d[i] = cvt<bf16>(s[i]);
}
// NaN-propagating max/min, like torch.maximum / clamp, written without short-circuits:
// `(a != a || a > b) ? a : b` made GCC branch per element where a loop stayed scalar
// (bf16 max pooling of 24x112x112 took 0.87 ms, 0.23 ms branch-free; EPYC Zen 4).
static inline float max_(float a, float b) { const float m = a > b ? a : b; return a != a ? a : m; }
static inline float min_(float a, float b) { const float m = a < b ? a : b; return a != a ? a : m; }
// x86's max instruction as written: NaN and -0 come through as eager's relu keeps them.
static inline float relu(float x) { return 0.f > x ? 0.f : x; }
static inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }
static inline float silu(float x) { return x / (1.f + std::exp(-x)); }
static inline float gelu(float x) { return x * 0.5f * (1.f + std::erf(x * 0.70710678118654752440f)); }
static inline float gelu_tanh(float x) {
  const float beta = 0.79788456080286535588f, kappa = 0.044715f;
  return 0.5f * x * (1.f + std::tanh(beta * (x + kappa * (x * x * x))));
}
static inline float hardsigmoid(float x) { return min_(max_(x + 3.f, 0.f), 6.f) / 6.f; }
static inline float hardswish(float x) { return x * min_(max_(x + 3.f, 0.f), 6.f) / 6.f; }

static inline void chunk(int64_t total, int64_t align, int64_t* b, int64_t* e) {
  const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
  *b = t == 0 ? 0 : (total * t / nt) / align * align;
  *e = t == nt - 1 ? total : (total * (t + 1) / nt) / align * align;
}
static inline bool go_parallel(int64_t numel, int64_t items) {
  return numel >= PAR_MIN && items > 1 && omp_get_max_threads() > 1;
}

// Element copies for gathers, broadcasts and scatters, by element size (2 or 4 bytes).
template <class U>
static inline void copy2d_t(char* dst, const char* src, int64_t rows, int64_t cols, int64_t sr,
                            int64_t sc) {
  U* d = (U*)dst; const U* s = (const U*)src;
  if ((sr == 0 || rows == 1) && (sc == 0 || cols == 1)) {  // a broadcast scalar: plain fill
    const U v = *s;
    for (int64_t i = 0; i < rows * cols; ++i) d[i] = v;
    return;
  }
  if (sc == 1) {
    for (int64_t r = 0; r < rows; ++r) std::memcpy(d + r * cols, s + r * sr, cols * sizeof(U));
    return;
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) *d++ = s[r * sr + c * sc];
}
template <class U>
static inline void scatter2d_t(char* dst, const char* src, int64_t rows, int64_t cols, int64_t sr,
                               int64_t sc) {
  U* d = (U*)dst; const U* s = (const U*)src;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) d[r * sr + c * sc] = *s++;
}
static inline void copy2d(int es, char* dst, const char* src, int64_t rows, int64_t cols,
                          int64_t sr, int64_t sc) {
  if (es == 4) copy2d_t<uint32_t>(dst, src, rows, cols, sr, sc);
  else copy2d_t<uint16_t>(dst, src, rows, cols, sr, sc);
}
static inline void scatter2d(int es, char* dst, const char* src, int64_t rows, int64_t cols,
                             int64_t sr, int64_t sc) {
  if (es == 4) scatter2d_t<uint32_t>(dst, src, rows, cols, sr, sc);
  else scatter2d_t<uint16_t>(dst, src, rows, cols, sr, sc);
}

// Run-time loop plan: the given dims in the reference tensor's memory order (outermost first),
// size-1 dims dropped, neighbours merged when they are contiguous in every tensor. A dense
// tensor set (any common permutation) collapses to one dim of stride 1.
template <int ND, int NT> struct Dims {
  int m = 0;
  int64_t sz[ND + 1];
  int64_t st[NT][ND + 1];
};
template <int ND, int NT>
static inline void plan(const int64_t* sizes, const int64_t* strides, const int* dims, int nd,
                        int ref, Dims<ND, NT>& p) {
  int order[ND + 1]; int n = 0;
  for (int i = 0; i < nd; ++i)
    if (sizes[dims[i]] != 1) order[n++] = dims[i];
  for (int i = 1; i < n; ++i) {  // stable insertion sort, larger stride first
    const int d = order[i]; const int64_t s = strides[ref * ND + d]; int j = i;
    for (; j > 0 && strides[ref * ND + order[j - 1]] < s; --j) order[j] = order[j - 1];
    order[j] = d;
  }
  p.m = 0;
  for (int i = 0; i < n; ++i) {
    const int d = order[i];
    bool merge = p.m > 0;
    for (int t = 0; t < NT && merge; ++t)
      merge = p.st[t][p.m - 1] == strides[t * ND + d] * sizes[d];
    if (merge) {
      p.sz[p.m - 1] *= sizes[d];
      for (int t = 0; t < NT; ++t) p.st[t][p.m - 1] = strides[t * ND + d];
    } else {
      p.sz[p.m] = sizes[d];
      for (int t = 0; t < NT; ++t) p.st[t][p.m] = strides[t * ND + d];
      ++p.m;
    }
  }
}

// Odometer over dims [0, k) of a plan, carrying one element offset per tensor.
template <int ND, int NT> struct Cursor {
  int64_t idx[ND + 1];
  int64_t off[NT];
  void seek(const Dims<ND, NT>& p, int k, int64_t linear) {
    for (int t = 0; t < NT; ++t) off[t] = 0;
    for (int d = k - 1; d >= 0; --d) {
      idx[d] = linear % p.sz[d]; linear /= p.sz[d];
      for (int t = 0; t < NT; ++t) off[t] += idx[d] * p.st[t][d];
    }
  }
  // n >= 1 steps along dim k-1, ending at most at its end (where it carries).
  void advance(const Dims<ND, NT>& p, int k, int64_t n) {
    if (k == 0) return;
    idx[k - 1] += n - 1;
    for (int t = 0; t < NT; ++t) off[t] += (n - 1) * p.st[t][k - 1];
    next(p, k);
  }
  void next(const Dims<ND, NT>& p, int k) {
    for (int d = k - 1; d >= 0; --d) {
      for (int t = 0; t < NT; ++t) off[t] += p.st[t][d];
      if (++idx[d] < p.sz[d]) return;
      for (int t = 0; t < NT; ++t) off[t] -= p.st[t][d] * p.sz[d];
      idx[d] = 0;
    }
  }
};

// A tile of `rows` x `cols` elements of tensor t handed to the element lambda as one dense run:
// the tensor's own memory when it is dense there, else a thread-local buffer (gathered, or
// filled once per distinct source for broadcasts, which repeat across tiles).
struct Staging {
  const char* last = nullptr;
  int64_t filled = 0;
  char* input(int es, char* p, char* buf, int64_t rows, int64_t cols, int64_t sr, int64_t sc,
              int64_t row_len) {
    if (sc == 1 && (rows == 1 || sr == row_len)) return p;
    const bool bcast = sr == 0 || rows == 1;
    if (bcast && (sc == 0 || cols == 1) && last == p && filled >= rows * cols) return buf;
    if (sr == 0 && rows > 1) {  // one row, repeated
      if (!(last == p && filled >= rows * cols)) {
        copy2d(es, buf, p, 1, cols, 0, sc);
        for (int64_t r = 1; r < rows; ++r) std::memcpy(buf + r * cols * es, buf, cols * es);
        last = p; filled = rows * cols;
      }
      return buf;
    }
    copy2d(es, buf, p, rows, cols, sr, sc);
    if (bcast && (sc == 0 || cols == 1)) { last = p; filled = rows * cols; }
    else last = nullptr;
    return buf;
  }
};

// out[i] = f(in[i]) over `sizes`; Body(n, q) processes n dense elements at q[0..NT).
template <int ND, int NI, int NO, class Body>
static void pointwise(const int64_t* sizes, void* const* data, const int64_t* strides,
                      const int* es, Body body) {
  constexpr int NT = NI + NO;
  int64_t numel = 1;
  for (int d = 0; d < ND; ++d) numel *= sizes[d];
  if (numel == 0) return;
  int dims[ND + 1];
  for (int d = 0; d < ND; ++d) dims[d] = d;
  Dims<ND, NT> p;
  plan<ND, NT>(sizes, strides, dims, ND, NI, p);
  bool flat = p.m <= 1;
  for (int t = 0; t < NT && flat && p.m == 1; ++t) flat = p.st[t][0] == 1;
  if (flat) {  // every tensor dense in the output's order: one flat loop
    auto run = [&](int64_t b, int64_t e) {
      char* q[NT];
      for (int t = 0; t < NT; ++t) q[t] = (char*)data[t] + b * es[t];
      body(e - b, q);
    };
    if (!go_parallel(numel, numel)) { run(0, numel); return; }
#pragma omp parallel
    { int64_t b, e; chunk(numel, 16, &b, &e); if (b < e) run(b, e); }
    return;
  }
  // Every tensor dense along the last dim (a broadcast one repeating a row, as a channels-last
  // tensor times a per-channel scale), or an input constant along it (an NCHW tensor times a
  // per-channel scale: rows of H*W, one scale value each): a call per row on the tensors' own
  // memory; a constant input is read from a buffer holding its row's value, BLOCK at a time.
  bool rows_dense = p.m >= 2 && p.sz[p.m - 1] >= ROW_MIN, row_const = false;
  bool konst[NT];  // an input constant along the rows
  for (int t = 0; t < NT && rows_dense; ++t) {
    konst[t] = t < NI && p.st[t][p.m - 1] == 0;
    row_const |= konst[t];
    rows_dense = konst[t] || p.st[t][p.m - 1] == 1;
  }
  if (rows_dense) {
    const int64_t n1 = p.sz[p.m - 1], span = row_const ? BLOCK : n1;
    int64_t nrows = 1;
    for (int d = 0; d + 1 < p.m; ++d) nrows *= p.sz[d];
    // Short rows go several to a call when every tensor runs on densely into the next row
    // or repeats one row (a per-channel scale over channels-last pixels): the repeated row
    // copied into a buffer as many times, refilled when its source changes (a new image).
    // A call per 192-channel row cost more than the arithmetic of an affine pass.
    bool grouped = !row_const && n1 * 2 <= GROUP;
    bool repeats[NT];  // an input repeating one row over several rows
    for (int t = 0; t < NT && grouped; ++t) {
      repeats[t] = t < NI && p.st[t][p.m - 2] == 0 && p.sz[p.m - 2] > 1;
      grouped = p.st[t][p.m - 2] == n1 || (t < NI && p.st[t][p.m - 2] == 0);
    }
    if (grouped) {
      const int64_t per = GROUP / n1;
      auto run_grouped = [&](int64_t b, int64_t e) {
        alignas(64) char rbuf[NI > 0 ? NI : 1][GROUP * 4];
        const char* src[NI > 0 ? NI : 1] = {nullptr};
        Cursor<ND, NT> cur;
        cur.seek(p, p.m - 1, b);
        for (int64_t r = b; r < e;) {
          int64_t k = per < e - r ? per : e - r;
          const int64_t left = p.sz[p.m - 2] - cur.idx[p.m - 2];
          k = k < left ? k : left;
          char* q[NT];
          for (int t = 0; t < NT; ++t) {
            q[t] = (char*)data[t] + cur.off[t] * es[t];
            if (repeats[t]) {
              if (src[t] != q[t]) {
                for (int64_t i = 0; i < per; ++i) std::memcpy(rbuf[t] + i * n1 * es[t], q[t], n1 * es[t]);
                src[t] = q[t];
              }
              q[t] = rbuf[t];
            }
          }
          body(k * n1, q);
          cur.advance(p, p.m - 1, k);
          r += k;
        }
      };
      if (!go_parallel(numel, nrows)) { run_grouped(0, nrows); return; }
#pragma omp parallel
      { int64_t b, e; chunk(nrows, 1, &b, &e); if (b < e) run_grouped(b, e); }
      return;
    }
    auto run = [&](int64_t b, int64_t e) {
      alignas(64) char cbuf[NI > 0 ? NI : 1][BLOCK * 4];
      Cursor<ND, NT> cur;
      cur.seek(p, p.m - 1, b);
      for (int64_t r = b; r < e; ++r, cur.next(p, p.m - 1)) {
        char* q[NT];
        for (int t = 0; t < NT; ++t) {
          q[t] = (char*)data[t] + cur.off[t] * es[t];
          if (konst[t]) {  // the row's value, BLOCK times
            if (es[t] == 4) { float v; std::memcpy(&v, q[t], 4); for (int i = 0; i < BLOCK; ++i) ((float*)cbuf[t])[i] = v; }
            else { uint16_t v; std::memcpy(&v, q[t], 2); for (int i = 0; i < BLOCK; ++i) ((uint16_t*)cbuf[t])[i] = v; }
          }
        }
        for (int64_t c0 = 0; c0 < n1; c0 += span) {
          char* qc[NT];
          for (int t = 0; t < NT; ++t) qc[t] = konst[t] ? cbuf[t] : q[t] + c0 * es[t];
          body(n1 - c0 < span ? n1 - c0 : span, qc);
        }
      }
    };
    if (!go_parallel(numel, nrows)) { run(0, nrows); return; }
#pragma omp parallel
    { int64_t b, e; chunk(nrows, 1, &b, &e); if (b < e) run(b, e); }
    return;
  }
  // General: tiles of (rows of dim m-2) x (dim m-1), outer dims by odometer.
  const int64_t n1 = p.sz[p.m - 1], n2 = p.m >= 2 ? p.sz[p.m - 2] : 1;
  const int ko = p.m >= 2 ? p.m - 2 : 0;  // dims [0, ko) are outer
  const int64_t rb = n1 >= BLOCK ? 1 : BLOCK / n1;
  const int64_t cb = n1 >= BLOCK ? BLOCK : n1;
  const int64_t nrb = (n2 + rb - 1) / rb, ncb = (n1 + cb - 1) / cb;
  int64_t outer = 1;
  for (int d = 0; d < ko; ++d) outer *= p.sz[d];
  const int64_t items = outer * nrb * ncb;
  auto work = [&](int64_t b, int64_t e) {
    alignas(64) char buf[NT][BLOCK * 4];
    Staging stg[NT];
    Cursor<ND, NT> cur;
    cur.seek(p, ko, b / (nrb * ncb));
    int64_t w = b % (nrb * ncb);
    for (int64_t it = b; it < e; ++it) {
      const int64_t r0 = (w / ncb) * rb, c0 = (w % ncb) * cb;
      const int64_t rows = n2 - r0 < rb ? n2 - r0 : rb, cols = n1 - c0 < cb ? n1 - c0 : cb;
      char* q[NT]; char* dst[NT];
      for (int t = 0; t < NT; ++t) {
        const int64_t sr = p.m >= 2 ? p.st[t][p.m - 2] : 0, sc = p.st[t][p.m - 1];
        char* ptr = (char*)data[t] + (cur.off[t] + r0 * sr + c0 * sc) * es[t];
        if (t < NI) q[t] = stg[t].input(es[t], ptr, buf[t], rows, cols, sr, sc, n1);
        else if (sc == 1 && (rows == 1 || sr == n1)) { q[t] = ptr; dst[t] = nullptr; }
        else { q[t] = buf[t]; dst[t] = ptr; }
      }
      body(rows * cols, q);
      for (int t = NI; t < NT; ++t)
        if (dst[t]) scatter2d(es[t], dst[t], buf[t], rows, cols,
                              p.m >= 2 ? p.st[t][p.m - 2] : 0, p.st[t][p.m - 1]);
      if (++w == nrb * ncb) { w = 0; cur.next(p, ko); }
    }
  };
  if (!go_parallel(numel, items)) { work(0, items); return; }
#pragma omp parallel
  { int64_t b, e; chunk(items, 1, &b, &e); if (b < e) work(b, e); }
}

template <int KIND> static inline float red_init() {
  return KIND == 2 ? -INFINITY : KIND == 3 ? INFINITY : 0.f;
}
template <int KIND> static inline float red_op(float a, float v) {
  return KIND == 2 ? max_(a, v) : KIND == 3 ? min_(a, v) : a + v;
}

// Reduce f(inputs) over dims `rd` (KIND: 0 sum, 1 mean, 2 amax, 3 amin) and store
// Fin(value, out_ptr). Pro(n, q, v) writes f at n dense elements to v. Accumulation is float32,
// in a fixed order (results do not depend on the thread count).
template <int ND, int NI, int KIND, class Pro, class Fin>
static void reduction(const int64_t* sizes, void* const* data, const int64_t* strides,
                      const int* es, const int* kd, int nk, const int* rd, int nr,
                      Pro pro, Fin fin) {
  constexpr int NT = NI + 1;
  int64_t numel = 1, rcount = 1, ocount = 1;
  for (int d = 0; d < ND; ++d) numel *= sizes[d];
  for (int i = 0; i < nr; ++i) rcount *= sizes[rd[i]];
  for (int i = 0; i < nk; ++i) ocount *= sizes[kd[i]];
  if (ocount == 0) return;
  // Reference for memory order: the first input not broadcast anywhere.
  int ref = 0;
  for (int t = NI - 1; t >= 0; --t) {
    bool full = true;
    for (int d = 0; d < ND; ++d) full = full && (sizes[d] == 1 || strides[t * ND + d] != 0);
    if (full) ref = t;
  }
  Dims<ND, NT> K, R;
  plan<ND, NT>(sizes, strides, kd, nk, ref, K);
  plan<ND, NT>(sizes, strides, rd, nr, ref, R);
  auto finish = [&](float acc, char* out) {
    fin(KIND == 1 ? acc / (float)rcount : acc, out);
  };
  // Vectorise along the reduced dim when it is innermost in memory, else along the kept one.
  const bool inner = K.m == 0 || (R.m > 0 && R.st[ref][R.m - 1] < K.st[ref][K.m - 1]);
  if (inner) {
    const int64_t n1 = R.m ? R.sz[R.m - 1] : 1;
    int64_t nro = 1;
    for (int d = 0; d + 1 < R.m; ++d) nro *= R.sz[d];
    auto work = [&](int64_t b, int64_t e) {
      alignas(64) char buf[NI][BLOCK * 4];
      alignas(64) float v[BLOCK];
      Staging stg[NI];
      Cursor<ND, NT> kc, rc;
      kc.seek(K, K.m, b);
      for (int64_t o = b; o < e; ++o, kc.next(K, K.m)) {
        float tot[L];
        for (int l = 0; l < L; ++l) tot[l] = red_init<KIND>();
        rc.seek(R, R.m - 1, 0);
        for (int64_t ro = 0; ro < nro; ++ro, rc.next(R, R.m - 1)) {
          for (int64_t c0 = 0; c0 < n1; c0 += BLOCK) {
            const int64_t n = n1 - c0 < BLOCK ? n1 - c0 : BLOCK;
            char* q[NI];
            for (int t = 0; t < NI; ++t) {
              const int64_t sc = R.m ? R.st[t][R.m - 1] : 0;
              char* ptr = (char*)data[t] + (kc.off[t] + rc.off[t] + c0 * sc) * es[t];
              q[t] = stg[t].input(es[t], ptr, buf[t], 1, n, 0, sc, n);
            }
            pro(n, q, v);
            float acc[L];
            for (int l = 0; l < L; ++l) acc[l] = red_init<KIND>();
            int64_t j = 0;
            for (; j + L <= n; j += L)
              for (int l = 0; l < L; ++l) acc[l] = red_op<KIND>(acc[l], v[j + l]);
            for (int l = 0; j < n; ++j, ++l) acc[l] = red_op<KIND>(acc[l], v[j]);
            for (int l = 0; l < L; ++l) tot[l] = red_op<KIND>(tot[l], acc[l]);
          }
        }
        for (int w = L / 2; w > 0; w /= 2)
          for (int l = 0; l < w; ++l) tot[l] = red_op<KIND>(tot[l], tot[l + w]);
        finish(tot[0], (char*)data[NI] + kc.off[NI] * es[NI]);
      }
    };
    if (!go_parallel(numel, ocount)) { work(0, ocount); return; }
#pragma omp parallel
    { int64_t b, e; chunk(ocount, 1, &b, &e); if (b < e) work(b, e); }
    return;
  }
  // Kept dim innermost (e.g. channels-last mean over H,W): each reduced position adds a run of
  // up to KB adjacent outputs, walking the reduced dims outside. Rows are summed in chunks of
  // RCHUNK (a two-level sum keeps float32 error growth in check) and the chunk sums combined in
  // order, so when the chunks are shared among threads (too few output blocks to share) the
  // result is the same as on one thread.
  const int64_t n1 = K.sz[K.m - 1];
  int64_t outer = 1;
  for (int d = 0; d + 1 < K.m; ++d) outer *= K.sz[d];
  const int64_t ncb = (n1 + KB - 1) / KB, blocks = outer * ncb;
  const int64_t nch = (rcount + RCHUNK - 1) / RCHUNK;
  // acc[0, n) = the reduction of rows [r0, r1) at outputs c0.. of kept position kc.
  auto rows_sum = [&](const Cursor<ND, NT>& kc, int64_t c0, int64_t n, int64_t r0, int64_t r1,
                   float* acc) {
    alignas(64) char buf[NI][KB * 4];
    alignas(64) float v[KB];
    Staging stg[NI];
    for (int64_t j = 0; j < n; ++j) acc[j] = red_init<KIND>();
    // Several rows per call when every input is dense over them or repeats one row.
    bool tiles = R.m > 0;
    for (int t = 0; t < NI && tiles; ++t) {
      const int64_t sr = R.st[t][R.m - 1], sc = K.st[t][K.m - 1];
      tiles = (sc == 1 || n == 1) && (sr == n || sr == 0);
    }
    const int64_t per = tiles ? (KB / n > 0 ? KB / n : 1) : 1;
    Cursor<ND, NT> rc;
    rc.seek(R, R.m, r0);
    for (int64_t r = r0; r < r1;) {
      int64_t rows = 1;
      if (per > 1) {
        const int64_t left = R.sz[R.m - 1] - rc.idx[R.m - 1];
        rows = per < left ? per : left;
        if (rows > r1 - r) rows = r1 - r;
      }
      char* q[NI];
      for (int t = 0; t < NI; ++t) {
        const int64_t sc = K.st[t][K.m - 1], sr = R.m ? R.st[t][R.m - 1] : 0;
        char* ptr = (char*)data[t] + (kc.off[t] + rc.off[t] + c0 * sc) * es[t];
        q[t] = stg[t].input(es[t], ptr, buf[t], rows, n, sr, sc, n);
      }
      pro(rows * n, q, v);
      for (int64_t i = 0; i < rows; ++i) {
        const float* vi = v + i * n;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) acc[j] = red_op<KIND>(acc[j], vi[j]);
      }
      r += rows;
      rc.advance(R, R.m, rows);
    }
  };
  // Block b: outputs [c0, c0 + n) of kept position kc; its total from the chunk sums in order.
  auto locate = [&](int64_t b, Cursor<ND, NT>& kc, int64_t& c0, int64_t& n) {
    kc.seek(K, K.m - 1, b / ncb);
    c0 = (b % ncb) * KB;
    n = n1 - c0 < KB ? n1 - c0 : KB;
  };
  auto store = [&](const Cursor<ND, NT>& kc, int64_t c0, int64_t n, const float* tot) {
    char* out = (char*)data[NI] + (kc.off[NI] + c0 * K.st[NI][K.m - 1]) * es[NI];
    for (int64_t j = 0; j < n; ++j) finish(tot[j], out + j * K.st[NI][K.m - 1] * es[NI]);
  };
  auto chunk_rows = [&](int64_t ch, int64_t& r0, int64_t& r1) {
    r0 = ch * RCHUNK;
    r1 = r0 + RCHUNK < rcount ? r0 + RCHUNK : rcount;
  };
  // Too few output blocks to share among threads: the row chunks are shared, their sums kept
  // (W floats each, up to 16 MB in all) and combined in chunk order afterwards.
  const int64_t W = n1 < KB ? n1 : KB;
  float* part = nullptr;
  if (nch > 1 && blocks < 2 * omp_get_max_threads() && blocks * nch * W <= (int64_t(1) << 22) &&
      go_parallel(numel, blocks * nch))
    part = (float*)std::malloc(sizeof(float) * blocks * nch * W);  // null: one block per thread
  if (part != nullptr) {
#pragma omp parallel
    {
      int64_t b, e;
      chunk(blocks * nch, 1, &b, &e);
      for (int64_t it = b; it < e; ++it) {
        Cursor<ND, NT> kc;
        int64_t c0, n, r0, r1;
        locate(it / nch, kc, c0, n);
        chunk_rows(it % nch, r0, r1);
        rows_sum(kc, c0, n, r0, r1, part + it * W);
      }
    }
  }
  auto work = [&](int64_t b, int64_t e) {  // blocks [b, e): totals, then the outputs
    alignas(64) float acc[KB], tot[KB];
    for (int64_t blk = b; blk < e; ++blk) {
      Cursor<ND, NT> kc;
      int64_t c0, n;
      locate(blk, kc, c0, n);
      for (int64_t j = 0; j < n; ++j) tot[j] = red_init<KIND>();
      for (int64_t ch = 0; ch < nch; ++ch) {
        const float* sum = acc;
        if (part != nullptr) {
          sum = part + (blk * nch + ch) * W;
        } else {
          int64_t r0, r1;
          chunk_rows(ch, r0, r1);
          rows_sum(kc, c0, n, r0, r1, acc);
        }
        for (int64_t j = 0; j < n; ++j) tot[j] = red_op<KIND>(tot[j], sum[j]);
      }
      store(kc, c0, n, tot);
    }
  };
  if (part != nullptr || !go_parallel(numel, blocks)) {
    work(0, blocks);
  } else {
#pragma omp parallel
    { int64_t b, e; chunk(blocks, 1, &b, &e); if (b < e) work(b, e); }
  }
  std::free(part);
}

// Layer norm of `rows` dense rows of `cols` elements: float32 statistics in two passes over
// the row (mean, then the centred sum of squares, as exact as ATen's moments), then
// (x - mean) * rstd * w + b. Rows are independent, so threads take whole rows.
template <class T, class P, bool HW, bool HB>
static void layer_norm(int64_t rows, int64_t cols, const T* x, const P* w, const P* b, T* y,
                       float eps) {
  if (rows == 0) return;
  auto work = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * cols;
      T* yr = y + r * cols;
      float s = 0.f, v = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t c = 0; c < cols; ++c) s += ld(xr[c]);
      const float mean = cols ? s / (float)cols : 0.f;
#pragma omp simd reduction(+ : v)
      for (int64_t c = 0; c < cols; ++c) { const float d = ld(xr[c]) - mean; v += d * d; }
      const float rstd = 1.f / std::sqrt((cols ? v / (float)cols : 0.f) + eps);
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) {
        float o = (ld(xr[c]) - mean) * rstd;
        if (HW) o *= ld(w[c]);
        if (HB) o += ld(b[c]);
        yr[c] = cvt<T>(o);
      }
    }
  };
  if (!go_parallel(rows * cols, rows)) { work(0, rows); return; }
#pragma omp parallel
  { int64_t b0, e0; chunk(rows, 1, &b0, &e0); if (b0 < e0) work(b0, e0); }
}

// Group norm of N images of C channels at S positions (the spatial dims flattened), dense with
// channels innermost (CL: x[(n*S + s)*C + c]) or contiguous (x[(n*C + c)*S + s]); y in the same
// order. float32 statistics in two passes as layer_norm's (the mean, then the centred sum of
// squares): each channel sums R positions at a time into `part`, the chunks join in order, then
// a group's channels in order, so the result has the same bits on any thread count.
// Then y = (x - mean) * a + b per channel with a = rstd * w (x * a + (b - mean * a), ATen's
// form, loses the digits of x - mean to rounding when rstd is large: a group of one element).
// Threads share (image, chunk) blocks in every pass: one image of one group still uses them all.
// `work`: N * C * (ceil(S / R) + 3) floats from the caller (an allocation that can fail is the
// caller's, where failing is an error and not a crash).
template <class T, class P, bool HW, bool HB>
static void group_norm(int64_t N, int64_t C, int64_t S, int64_t G, bool CL, int64_t R, const T* x,
                       const P* w, const P* b, T* y, float* work, float eps) {
  if (N * C * S == 0) return;
  const int64_t K = (S + R - 1) / R, blocks = N * K, Cg = C / G;
  // part: per (image, chunk) and channel; per (image, channel): m the group's mean, a, d the bias.
  float* part = work;
  float* m = part + blocks * C;
  float* ac = m + N * C;
  float* d = ac + N * C;
  const bool par = go_parallel(N * C * S, blocks);
  auto each_block = [&](auto&& fn) {
    if (!par) { for (int64_t i = 0; i < blocks; ++i) fn(i / K, (i % K) * R); return; }
#pragma omp parallel
    {
      int64_t b0, e0;
      chunk(blocks, 1, &b0, &e0);
      for (int64_t i = b0; i < e0; ++i) fn(i / K, (i % K) * R);
    }
  };
  // Per-channel sums over one chunk of (x - centre)^P (P = 1, or 2 with the group's mean).
  auto sums = [&](bool centred) {
    each_block([&](int64_t n, int64_t s0) {
      const int64_t s1 = s0 + R < S ? s0 + R : S;
      float* acc = part + (n * K + s0 / R) * C;
      const float* mc = m + n * C;
      if (CL) {
        for (int64_t c = 0; c < C; ++c) acc[c] = 0.f;
        for (int64_t s = s0; s < s1; ++s) {
          const T* xr = x + (n * S + s) * C;
          if (centred) {
#pragma omp simd
            for (int64_t c = 0; c < C; ++c) { const float v = ld(xr[c]) - mc[c]; acc[c] += v * v; }
          } else {
#pragma omp simd
            for (int64_t c = 0; c < C; ++c) acc[c] += ld(xr[c]);
          }
        }
      } else {
        for (int64_t c = 0; c < C; ++c) {
          const T* xr = x + (n * C + c) * S;
          const float mu = centred ? mc[c] : 0.f;
          float v = 0.f;
          if (centred) {
#pragma omp simd reduction(+ : v)
            for (int64_t s = s0; s < s1; ++s) { const float t = ld(xr[s]) - mu; v += t * t; }
          } else {
#pragma omp simd reduction(+ : v)
            for (int64_t s = s0; s < s1; ++s) v += ld(xr[s]);
          }
          acc[c] = v;
        }
      }
    });
  };
  // The chunks' sums of a group, in order, over its Cg * S elements.
  auto group_mean = [&](int64_t n, int64_t g) {
    float t = 0.f;
    for (int64_t c = g * Cg; c < (g + 1) * Cg; ++c) {
      float u = 0.f;
      for (int64_t k = 0; k < K; ++k) u += part[(n * K + k) * C + c];
      t += u;
    }
    return t / (float)(Cg * S);
  };
  sums(false);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t g = 0; g < G; ++g) {
      const float mu = group_mean(n, g);
      for (int64_t c = g * Cg; c < (g + 1) * Cg; ++c) m[n * C + c] = mu;
    }
  sums(true);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t g = 0; g < G; ++g) {
      const float rstd = 1.f / std::sqrt(group_mean(n, g) + eps);
      for (int64_t c = g * Cg; c < (g + 1) * Cg; ++c) {
        ac[n * C + c] = HW ? rstd * ld(w[c]) : rstd;
        d[n * C + c] = HB ? ld(b[c]) : 0.f;
      }
    }
  each_block([&](int64_t n, int64_t s0) {
    const int64_t s1 = s0 + R < S ? s0 + R : S;
    const float* mu = m + n * C;
    const float* a = ac + n * C;
    const float* dd = d + n * C;
    if (CL) {
      for (int64_t s = s0; s < s1; ++s) {
        const T* xr = x + (n * S + s) * C;
        T* yr = y + (n * S + s) * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) yr[c] = cvt<T>((ld(xr[c]) - mu[c]) * a[c] + dd[c]);
      }
    } else {
      for (int64_t c = 0; c < C; ++c) {
        const T* xr = x + (n * C + c) * S;
        T* yr = y + (n * C + c) * S;
        const float mc = mu[c], a1 = a[c], dc = dd[c];
#pragma omp simd
        for (int64_t s = s0; s < s1; ++s) yr[s] = cvt<T>((ld(xr[s]) - mc) * a1 + dc);
      }
    }
  });
}

// Softmax (LOG: log_softmax) along the middle dim of a contiguous [outer, D, inner] tensor,
// as ATen computes it: the float32 maximum (NaN propagates), the sum of exp(x - max) in order,
// then exp(x - max) / sum (log: x - max - log(sum)). inner == 1: one dense row per outer index
// (exp computed twice rather than staged: no scratch for rows of any length); otherwise IB lanes
// of inner at a time, the reductions vectorised across them. Threads take (outer, lane block).
template <class T, bool LOG>
static void softmax(int64_t outer, int64_t D, int64_t inner, const T* x, T* y) {
  if (outer * D * inner == 0) return;
  enum { IB = 64 };
  const int64_t nb = (inner + IB - 1) / IB, items = outer * nb;
  auto work = [&](int64_t i0, int64_t i1) {
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t o = it / nb, j0 = (it % nb) * IB;
      const T* xo = x + o * D * inner;
      T* yo = y + o * D * inner;
      if (inner == 1) {
        float m = -INFINITY;
        bool nan = false;
#pragma omp simd reduction(max : m) reduction(| : nan)
        for (int64_t d = 0; d < D; ++d) { const float v = ld(xo[d]); m = v > m ? v : m; nan |= v != v; }
        if (nan) m = NAN;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t d = 0; d < D; ++d) sum += std::exp(ld(xo[d]) - m);
        if (LOG) {
          const float shift = m + std::log(sum);
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) yo[d] = cvt<T>(ld(xo[d]) - shift);
        } else {
          const float inv = 1.f / sum;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) yo[d] = cvt<T>(std::exp(ld(xo[d]) - m) * inv);
        }
        continue;
      }
      const int64_t w = inner - j0 < IB ? inner - j0 : IB;
      float m[IB], sum[IB];
      for (int64_t j = 0; j < w; ++j) { m[j] = -INFINITY; sum[j] = 0.f; }
      for (int64_t d = 0; d < D; ++d) {
        const T* xr = xo + d * inner + j0;
#pragma omp simd
        for (int64_t j = 0; j < w; ++j) m[j] = max_(ld(xr[j]), m[j]);
      }
      for (int64_t d = 0; d < D; ++d) {
        const T* xr = xo + d * inner + j0;
#pragma omp simd
        for (int64_t j = 0; j < w; ++j) sum[j] += std::exp(ld(xr[j]) - m[j]);
      }
      for (int64_t j = 0; j < w; ++j) sum[j] = LOG ? m[j] + std::log(sum[j]) : 1.f / sum[j];
      for (int64_t d = 0; d < D; ++d) {
        const T* xr = xo + d * inner + j0;
        T* yr = yo + d * inner + j0;
        if (LOG) {
#pragma omp simd
          for (int64_t j = 0; j < w; ++j) yr[j] = cvt<T>(ld(xr[j]) - sum[j]);
        } else {
#pragma omp simd
          for (int64_t j = 0; j < w; ++j) yr[j] = cvt<T>(std::exp(ld(xr[j]) - m[j]) * sum[j]);
        }
      }
    }
  };
  if (!go_parallel(outer * D * inner, items)) { work(0, items); return; }
#pragma omp parallel
  { int64_t b0, e0; chunk(items, 1, &b0, &e0); if (b0 < e0) work(b0, e0); }
}

// A bf16 as an int16 that orders as its value does: negative values get their magnitude bits
// flipped (two's complement order), every NaN becomes the largest key, so the largest key of a
// window is its maximum, or NaN if it holds one (as ATen's max pooling propagates it).
// of_max_key maps a key back to the same bits (a NaN to the quiet NaN 0x7fff); -0 orders
// below +0, where a float max keeps whichever came first.
static inline int16_t max_key(bf16 h) {
  const int16_t s = (int16_t)h;
  const int16_t k = (int16_t)(s ^ ((s >> 15) & 0x7fff));
  return (h & 0x7fff) > 0x7f80 ? (int16_t)0x7fff : k;
}
static inline bf16 of_max_key(int16_t k) { return (bf16)(k ^ ((k >> 15) & 0x7fff)); }
enum : int16_t { MAX_KEY_INIT = (int16_t)0x807f };  // the key of -inf

// 2-D max (KIND 0) or average (KIND 1) pooling of a channels-last (NHWC-dense) tensor, with
// ATen's window rules (dilation for max; count_include_pad / divisor for avg; NaN propagates
// through max). Vectorised over channels, the innermost dim; threads take output pixels.
// sz: N, C, H, W, OH, OW.
template <class T, int KIND>
static void pool2d_nhwc(const int64_t* sz, const T* x, T* y, int64_t kh, int64_t kw, int64_t sh,
                        int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw, bool incl,
                        int64_t div) {
  const int64_t N = sz[0], C = sz[1], H = sz[2], W = sz[3], OH = sz[4], OW = sz[5];
  const int64_t items = N * OH * OW;
  if (items == 0 || C == 0) return;
  auto work = [&](int64_t b, int64_t e) {
    for (int64_t it = b; it < e; ++it) {
      const int64_t ow = it % OW, oh = (it / OW) % OH, n = it / (OW * OH);
      int64_t h0 = oh * sh - ph, w0 = ow * sw - pw, h1, w1, sth = 1, stw = 1;
      float cnt = 1.f;
      if (KIND == 0) {
        h1 = h0 + (kh - 1) * dh + 1 < H ? h0 + (kh - 1) * dh + 1 : H;
        w1 = w0 + (kw - 1) * dw + 1 < W ? w0 + (kw - 1) * dw + 1 : W;
        while (h0 < 0) h0 += dh;
        while (w0 < 0) w0 += dw;
        sth = dh; stw = dw;
      } else {
        h1 = h0 + kh < H + ph ? h0 + kh : H + ph;
        w1 = w0 + kw < W + pw ? w0 + kw : W + pw;
        const int64_t psize = (h1 - h0) * (w1 - w0);
        h0 = h0 > 0 ? h0 : 0; w0 = w0 > 0 ? w0 : 0;
        h1 = h1 < H ? h1 : H; w1 = w1 < W ? w1 : W;
        cnt = (float)(div > 0 ? div : incl ? psize : (h1 - h0) * (w1 - w0));
      }
      T* yo = y + it * C;
      const bool empty = KIND == 1 && (h0 >= h1 || w0 >= w1);
      // Channels PB at a time, a width known to the compiler, so the accumulators stay in
      // registers across the window (they went through memory at every tap: 3x3/2 max pooling
      // of 128x55x55 fp32 72 -> 43 us; with bf16 order keys, 64x111x111 bf16 211 -> 104 us;
      // EPYC Zen 4); fewer than PB channels left in one runtime-width block.
      // One window pass: accumulators of init's type, `load` turns an element into one,
      // `add` combines, `out` makes the output element.
      auto block = [&](int64_t c0, auto width, auto init, auto load, auto add, auto out) {
        constexpr int64_t NB = decltype(width)::value;
        const int64_t nc = NB > 0 ? NB : C - c0;
        decltype(init) a[NB > 0 ? NB : PB];
#pragma omp simd
        for (int64_t j = 0; j < (NB > 0 ? NB : nc); ++j) a[j] = init;
        for (int64_t ih = h0; ih < h1; ih += sth)
          for (int64_t iw = w0; iw < w1; iw += stw) {
            const T* xi = x + ((n * H + ih) * W + iw) * C + c0;
#pragma omp simd
            for (int64_t j = 0; j < (NB > 0 ? NB : nc); ++j) a[j] = add(a[j], load(xi[j]));
          }
#pragma omp simd
        for (int64_t j = 0; j < (NB > 0 ? NB : nc); ++j) yo[c0 + j] = out(a[j]);
      };
      auto pass = [&](int64_t c0, auto width) {
        if constexpr (KIND == 0 && std::is_same<T, bf16>::value) {
          // bf16 max on order keys, 32 lanes a vector instead of 16 floats (see max_key).
          block(c0, width, (int16_t)MAX_KEY_INIT, [](bf16 h) { return max_key(h); },
                [](int16_t m, int16_t k) { return k > m ? k : m; },
                [](int16_t m) { return of_max_key(m); });
        } else {
          block(c0, width, KIND == 0 ? -INFINITY : 0.f, [](T v) { return ld(v); },
                [](float m, float v) { return KIND == 0 ? max_(v, m) : m + v; },
                [&](float m) { return cvt<T>(KIND == 0 ? m : empty ? 0.f : m / cnt); });
        }
      };
      int64_t c0 = 0;
      for (; c0 + PB <= C; c0 += PB) pass(c0, std::integral_constant<int64_t, PB>());
      if (c0 < C) pass(c0, std::integral_constant<int64_t, 0>());  // fewer than PB left
    }
  };
  if (!go_parallel(items * C, items)) { work(0, items); return; }
#pragma omp parallel
  { int64_t b0, e0; chunk(items, 1, &b0, &e0); if (b0 < e0) work(b0, e0); }
}
}  // namespace cl
#endif  // CL_KERNEL_PREAMBLE
"""


# Vector forms of the math functions kernels call: glibc's libmvec has them
# (x86-64 ABI names _ZGV<isa>N<lanes>v_<name>), and a declaration with GCC's
# simd attribute lets the loops that call them vectorise. Without it every
# exp/erf/tanh/log is a scalar call: a silu kernel ran 7x slower than ATen's
# (1.39 vs 0.19 ms for 144x56x56 on an EPYC Zen 4). The variants of each ISA
# GCC may call must all be present, or the library would not load: functions
# this glibc lacks (erff and tanhf came in 2.35) stay scalar.
_SIMD_VARIANTS = ("bN4v", "cN8v", "dN8v", "eN16v")
_SIMD_FUNCS = ("expf", "logf", "erff", "tanhf")
_simd = None


def _simd_math():
    """(declarations, link flags) for the vector math this machine's libmvec has."""
    global _simd
    if _simd is None:
        import ctypes

        try:
            mvec = ctypes.CDLL("libmvec.so.1")
            have = [f for f in _SIMD_FUNCS
                    if all(hasattr(mvec, f"_ZGV{v}_{f}") for v in _SIMD_VARIANTS)]
        except OSError:
            have = []
        decls = "".join(f'extern "C" float {f}(float) throw() __attribute__((__simd__("notinbranch")));\n'
                        for f in have)
        _simd = (decls, ("-l:libmvec.so.1",) if have else ())
    return _simd


def preamble() -> str:
    return PREAMBLE.replace("@PAR_MIN@", str(PARALLEL_MIN_NUMEL)).replace("@SIMD_MATH@", _simd_math()[0])


def kernel_flags() -> tuple:
    """Compiler flags of kernel libraries: the build's, 512-bit vectors where the
    machine has them, and libmvec when kernels use it. GCC's -march=native
    vectorises with 256-bit vectors on Intel's AVX-512 parts (its tuning's
    preference), half the width of every generated loop and of libmvec's calls:
    a bf16 BN-ReLU over 256x56x56 channels-last took 174 us, 132 us with 512-bit
    vectors; efficientnet_b0 AMP 8.89 -> 7.45 ms, fp32 12.06 -> 11.17 ms,
    densenet121 AMP 12.5 -> 11.7 ms (Sapphire Rapids, batch 1, 1 thread,
    interleaved). The flag changes which libmvec variant computes exp: last-ulp
    differences in fp32, none seen in bf16."""
    wide = ("-mprefer-vector-width=512",) if build.native_isa("avx512f") else ()
    return build.CXXFLAGS + wide + _simd_math()[1]


class _Emitter:
    """Emits an expression as straight-line C++ with common subexpressions shared."""

    def __init__(self, loads_as):
        self.loads_as = loads_as  # Load index -> C++ expression
        self.lines = []
        self.memo = {}

    def __call__(self, e) -> str:
        if isinstance(e, Const):
            return float_literal(e.value)
        if e in self.memo:
            return self.memo[e]
        if isinstance(e, Load):
            code = self.loads_as(e.index)
        else:
            code = self._op(e, [self(a) for a in e.args])
        name = f"t{len(self.memo)}"
        self.lines.append(f"const float {name} = {code};")
        self.memo[e] = name
        return name

    @staticmethod
    def _op(e: Op, a):
        cpp = OPS[e.name].cpp  # expr.Op validated the name
        return cpp.format(*a) if isinstance(cpp, str) else cpp(a, e.params)


def _calls_vector_math(e) -> bool:
    if isinstance(e, Op):
        return OPS[e.name].vector_math or any(_calls_vector_math(a) for a in e.args)
    return False


def _check_expr(e, what):
    if not isinstance(e, (Load, Const, Op)):
        raise ValueError(f"{what} is not an expression (Load, Const or Op): {e!r}")


def _check_dtype(dt, what):
    if dt not in _CTYPE:
        raise ValueError(f"{what}: dtype must be torch.float32 or torch.bfloat16, got {dt}")
    return dt


def _span(t, sizes, strides):
    """Byte range [lo, hi) a tensor touches when viewed with these sizes and strides."""
    lo = t.data_ptr()
    n = 1
    for size, st in zip(sizes, strides):
        if size == 0:
            return lo, lo
        n += (size - 1) * st
    return lo, lo + n * t.element_size()


def _check_tensors(ts, dtypes, kind):
    for i, (t, dt) in enumerate(zip(ts, dtypes)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{kind} {i} is not a tensor: {type(t).__name__}")
        if t.dtype != dt:
            raise ValueError(f"{kind} {i} has dtype {t.dtype}, the kernel expects {dt}")
        if not t.is_cpu or t.layout != torch.strided:
            raise ValueError(f"{kind} {i} must be a strided CPU tensor")


def _check_sizes(sizes, ndim):
    sizes = tuple(sizes)
    if len(sizes) != ndim:
        raise ValueError(f"sizes must have {ndim} entries, got {sizes}")
    for s in sizes:
        if type(s) is not int or s < 0:
            try:
                return _check_sizes([operator.index(x) for x in sizes], ndim) \
                    if any(type(x) is not int for x in sizes) else _bad_sizes(sizes, ndim)
            except TypeError:
                _bad_sizes(sizes, ndim)
    return sizes


def _bad_sizes(sizes, ndim):
    raise ValueError(f"sizes must be {ndim} non-negative ints, got {sizes!r}")


def _check_aliasing(ins, in_st, outs, out_st, out_sizes):
    """Outputs must not overlap each other, nor an input unless it is the same elements."""
    if not outs:
        return
    stor = [t.untyped_storage().data_ptr() for t in outs]
    in_stor = [t.untyped_storage().data_ptr() for t in ins]
    for i, o in enumerate(outs):  # only tensors on one storage can overlap: cheap common case
        shared_out = [j for j in range(i + 1, len(outs)) if stor[j] == stor[i]]
        shared_in = [j for j, sp in enumerate(in_stor) if sp == stor[i]]
        if not shared_out and not shared_in:
            continue
        lo, hi = _span(o, out_sizes[i], out_st[i])
        for j in shared_out:
            lo2, hi2 = _span(outs[j], out_sizes[j], out_st[j])
            if lo < hi2 and lo2 < hi:
                raise ValueError(f"outputs {i} and {j} overlap")
        for j in shared_in:
            b = ins[j]
            lo2, hi2 = _span(b, out_sizes[i], in_st[j])
            # A size-1 dim's stride is 0 in the input's broadcast strides, the
            # tensor's own in the output's: it addresses one element either way.
            same = all(a == c or n == 1 for a, c, n in zip(in_st[j], out_st[i], out_sizes[i]))
            if lo < hi2 and lo2 < hi and not (
                    o.data_ptr() == b.data_ptr() and same and o.element_size() == b.element_size()):
                raise ValueError(f"output {i} overlaps input {j} without being the same "
                                 "elements (in place needs identical strides)")


class _Compiled:
    """Validating Python entry point around a compiled kernel: ``run(sizes, ins, outs)``."""

    def __init__(self, kernel, library):
        self.kernel = kernel
        self.library = library
        self.fn = getattr(library.lib, kernel.name)
        self._ffi = library.ffi

    def call_unchecked(self, sizes, tensors, strides):
        """Call the kernel without validation: ``tensors`` are inputs then outputs, ``strides``
        the flat per-tensor list of the C signature (broadcast dims 0). For wrappers that have
        already proved the layouts; anything wrong here is memory corruption, not an error."""
        # One buffer holds sizes | data pointers | strides (pointers are 64-bit on x86-64).
        ffi, nd, nt = self._ffi, len(sizes), len(tensors)
        buf = ffi.new("int64_t[]", [*sizes, *[t.data_ptr() for t in tensors], *strides])
        self.fn(buf, ffi.cast("void* const*", buf + nd), buf + nd + nt)

    def _check_counts(self, ins, outs, n_in, n_out):
        if len(ins) != n_in or len(outs) != n_out:
            raise ValueError(f"{self.kernel.name}: expected {n_in} input and {n_out} output "
                             f"tensors, got {len(ins)} and {len(outs)}")


class CompiledPointwise(_Compiled):
    def __call__(self, sizes, in_tensors, out_tensors):
        k = self.kernel
        sizes = _check_sizes(sizes, k.ndim)
        self._check_counts(in_tensors, out_tensors, len(k.inputs), len(k.outputs))
        _check_tensors(in_tensors, k.inputs, "input")
        _check_tensors(out_tensors, k.out_dtypes, "output")
        in_st = [L.broadcast_strides(t, sizes, f"input {i}") for i, t in enumerate(in_tensors)]
        out_st = []
        for i, t in enumerate(out_tensors):
            if t.shape != sizes:
                raise ValueError(f"output {i} has shape {tuple(t.shape)}, expected {sizes}")
            st = t.stride()
            if 0 in st and any(s == 0 and n > 1 for s, n in zip(st, sizes)):
                raise ValueError(f"output {i} is broadcast (stride 0); outputs must not overlap")
            out_st.append(list(st))
        _check_aliasing(in_tensors, in_st, out_tensors, out_st, [sizes] * len(out_st))
        self.call_unchecked(sizes, [*in_tensors, *out_tensors], [s for st in in_st + out_st for s in st])


class CompiledReduction(_Compiled):
    def __call__(self, sizes, in_tensors, out_tensors):
        k = self.kernel
        sizes = _check_sizes(sizes, k.ndim)
        self._check_counts(in_tensors, out_tensors, len(k.input_dtypes), 1)
        _check_tensors(in_tensors, k.input_dtypes, "input")
        _check_tensors(out_tensors, (k.out_dtype,), "output")
        in_st = [L.broadcast_strides(t, sizes, f"input {i}") for i, t in enumerate(in_tensors)]
        out = out_tensors[0]
        want = k.output_shape(sizes)
        if out.shape != want:
            raise ValueError(f"output has shape {tuple(out.shape)}, expected {want}")
        if k.kind in ("amax", "amin") and any(sizes[d] == 0 for d in k.reduce_dims) \
                and all(want):
            raise ValueError(f"{k.kind} over an empty dimension has no identity")
        if any(s == 0 and n > 1 for s, n in zip(out.stride(), out.shape)):
            raise ValueError("output is broadcast (stride 0); outputs must not overlap")
        ost = k.output_strides_over_input(sizes, out.stride())
        so = out.untyped_storage().data_ptr()
        for i, t in enumerate(in_tensors):
            if t.untyped_storage().data_ptr() == so:
                lo, hi = _span(out, out.shape, out.stride())
                lo2, hi2 = _span(t, sizes, in_st[i])
                if lo < hi2 and lo2 < hi:
                    raise ValueError(f"reduction output overlaps input {i}")
        self.call_unchecked(sizes, [*in_tensors, out], [s for st in in_st for s in st] + ost)


class _Kernel:
    _prefix = "k"

    @property
    def name(self) -> str:
        """C symbol, derived from the generated body so equal kernels share it."""
        if self._name is None:
            digest = hashlib.sha256(self._body("NAME").encode()).hexdigest()[:16]
            self._name = f"cl_{self._prefix}_{digest}"
        return self._name

    def source(self) -> str:
        """A self-contained translation unit (the preamble is include-guarded, so several
        kernels' sources can be concatenated into one file)."""
        return preamble() + self._body(self.name)

    def cdef(self) -> str:
        return f"void {self.name}(const int64_t* sizes, void* const* data, const int64_t* strides);"

    def compile(self):
        if self._compiled is None:
            compile_library([self], name_hint=self.describe())
        return self._compiled

    def __eq__(self, other):
        return type(self) is type(other) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())


def _es_array(dtypes):
    return ", ".join("4" if d == torch.float32 else "2" for d in dtypes)


class PointwiseKernel(_Kernel):
    """Computes each output expression at every element of an ``ndim``-dim output shape.

    ``inputs``: dtypes of the inputs (float32/bfloat16), read by ``Load(i)``; ``outputs``:
    ``(expr, dtype)`` pairs. ``compile()`` returns ``run(sizes, in_tensors, out_tensors)``:
    outputs must have shape ``sizes``; inputs broadcast to it (right-aligned, size-1 dims).
    """
    _prefix = "pw"
    _runner = CompiledPointwise

    def __init__(self, inputs, outputs, ndim: int):
        self.inputs = tuple(_check_dtype(d, f"input {i}") for i, d in enumerate(inputs))
        self.outputs = tuple((e, _check_dtype(d, f"output {i}")) for i, (e, d) in enumerate(outputs))
        self.out_dtypes = tuple(d for _, d in self.outputs)
        if not self.outputs:
            raise ValueError("a pointwise kernel needs at least one output")
        if not isinstance(ndim, int) or not 0 <= ndim <= _MAX_NDIM:
            raise ValueError(f"ndim must be an int in [0, {_MAX_NDIM}], got {ndim!r}")
        self.ndim = ndim
        for i, (e, _) in enumerate(self.outputs):
            _check_expr(e, f"output {i}")
            bad = [j for j in loads(e) if j >= len(self.inputs)]
            if bad:
                raise ValueError(f"output {i} reads input {bad[0]} of {len(self.inputs)}")
        self._compiled = None
        self._name = None

    def _key(self):
        return ("pw", self.inputs, self.outputs, self.ndim)

    def _body(self, name):
        ni = len(self.inputs)
        lines = [f"const {_CTYPE[d]}* i{i} = (const {_CTYPE[d]}*)q[{i}];"
                 for i, d in enumerate(self.inputs)]
        lines += [f"{_CTYPE[d]}* o{i} = ({_CTYPE[d]}*)q[{ni + i}];"
                  for i, (_, d) in enumerate(self.outputs)]
        bf_in = [i for i, d in enumerate(self.inputs) if d == torch.bfloat16]
        bf_out = [k for k, (_, d) in enumerate(self.outputs) if d == torch.bfloat16]
        if (bf_in or bf_out) and any(_calls_vector_math(e) for e, _ in self.outputs):
            loop = self._staged_loop(bf_in, bf_out)
        elif bf_out and build.native_isa("avx512bf16"):
            loop = self._staged_loop([], bf_out)  # for cl::narrow's one-instruction rounding
        else:
            em = _Emitter(lambda i: f"cl::ld(i{i}[j])")
            results = [em(e) for e, _ in self.outputs]
            # All loads and math before any store: an in-place output may be one of the inputs.
            inner = em.lines + [f"o{i}[j] = cl::cvt<{_CTYPE[d]}>({r});"
                                for i, (r, (_, d)) in enumerate(zip(results, self.outputs))]
            loop = ("#pragma omp simd\n    for (int64_t j = 0; j < n; ++j) {\n"
                    + "".join(f"      {ln}\n" for ln in inner) + "    }\n")
        return (
            f"\n// {self.describe()}\n"
            f'extern "C" void {name}(const int64_t* sizes, void* const* data, const int64_t* strides) {{\n'
            f"  static const int es[] = {{{_es_array(self.inputs + tuple(d for _, d in self.outputs))}}};\n"
            f"  cl::pointwise<{self.ndim}, {ni}, {len(self.outputs)}>(sizes, data, strides, es,\n"
            f"      [](int64_t n, char* const* q) {{\n"
            + "".join(f"    {ln}\n" for ln in lines)
            + loop
            + "  });\n}\n"
        )

    def _staged_loop(self, bf_in, bf_out):
        """The element loop through float buffers, a block at a time: the inputs in
        `bf_in` widened first, the math on floats, bf16 outputs narrowed last
        (`cl::narrow`). Over bf16 data GCC vectorises 32 lanes at a time and the
        vector-math calls' register spills cost more than the conversions; staged,
        the math runs 16-wide as in fp32 (silu over 144x56x56 bf16: 239 -> 210 us,
        fp32 177 us; EPYC Zen 4). Without vector math a kernel is staged only for
        its bf16 stores, where AVX512-BF16 rounds 16 in one instruction: a bf16 add
        over 128x56x56 80 -> 55 us; efficientnet_b0 AMP 2.9% and densenet121 AMP
        1.4% faster at batch 1 (EPYC Zen 4, interleaved A/B). The same float
        operations; only the loops' scalar remainders (libm's exp, not libmvec's)
        fall on other elements, a last-ulp difference there. A block's inputs are
        all read before any of its outputs is written, so an output may still be
        one of the inputs."""
        em = _Emitter(lambda i: f"s{i}[j]" if i in bf_in else f"cl::ld(i{i}[b + j])")
        results = [em(e) for e, _ in self.outputs]
        math = em.lines + [f"r{k}[j] = {r};" if k in bf_out else f"o{k}[b + j] = {r};"
                           for k, r in enumerate(results)]
        out = [f"alignas(64) float s{i}[cl::BLOCK];" for i in bf_in]
        out += [f"alignas(64) float r{k}[cl::BLOCK];" for k in bf_out]
        out += ["for (int64_t b = 0; b < n; b += cl::BLOCK) {",
                "  const int64_t m = n - b < cl::BLOCK ? n - b : cl::BLOCK;"]
        for i in bf_in:
            out += ["#pragma omp simd", f"  for (int64_t j = 0; j < m; ++j) s{i}[j] = cl::ld(i{i}[b + j]);"]
        out += ["#pragma omp simd", "  for (int64_t j = 0; j < m; ++j) {"]
        out += [f"    {ln}" for ln in math] + ["  }"]
        out += [f"  cl::narrow(o{k} + b, r{k}, m);" for k in bf_out]
        out += ["}"]
        return "".join(("" if ln.startswith("#") else "    ") + ln + "\n" for ln in out)

    def describe(self) -> str:
        ins = ",".join(_SHORT[d] for d in self.inputs)
        outs = "; ".join(f"{_SHORT[d]} {e}" for e, d in self.outputs)
        return f"pointwise ndim={self.ndim} in=({ins}) -> {outs}"


class ReductionKernel(_Kernel):
    """``epilogue(reduce(prologue(inputs), reduce_dims))`` with float32 accumulation.

    ``input_dtype``: one dtype for every input, or a list (one per input); the number of inputs is
    1 + the largest ``Load`` index in ``prologue``. ``kind``: 'sum', 'mean', 'amax' or 'amin'.
    ``epilogue`` reads the reduced value as ``Load(0)``. ``run(sizes, in_tensors, [out])`` takes
    the *input* shape as ``sizes``; ``out`` has the reduced shape (size-1 dims kept if
    ``keepdim``). Input 0 (or the first unbroadcast input) sets the loop order.
    """
    _prefix = "red"
    _runner = CompiledReduction

    def __init__(self, input_dtype, prologue, kind, ndim, reduce_dims, keepdim=False,
                 out_dtype=torch.float32, epilogue=None):
        if kind not in _REDUCTIONS:
            raise ValueError(f"kind must be one of {_REDUCTIONS}, got {kind!r}")
        if not isinstance(ndim, int) or not 0 <= ndim <= _MAX_NDIM:
            raise ValueError(f"ndim must be an int in [0, {_MAX_NDIM}], got {ndim!r}")
        _check_expr(prologue, "prologue")
        if epilogue is not None:
            _check_expr(epilogue, "epilogue")
        n_in = max(loads(prologue), default=-1) + 1
        if isinstance(input_dtype, torch.dtype):
            dts = (input_dtype,) * max(n_in, 1)
        else:
            dts = tuple(input_dtype)
            if len(dts) < n_in or not dts:
                raise ValueError(f"prologue reads {n_in} inputs, {len(dts)} dtypes given")
        self.input_dtypes = tuple(_check_dtype(d, f"input {i}") for i, d in enumerate(dts))
        dims = sorted({d % ndim if ndim and -ndim <= d < ndim else _bad_dim(d, ndim)
                       for d in reduce_dims})
        self.reduce_dims = tuple(dims)
        self.prologue, self.kind, self.ndim, self.keepdim = prologue, kind, ndim, bool(keepdim)
        self.out_dtype = _check_dtype(out_dtype, "output")
        if epilogue is not None and loads(epilogue) - {0}:
            raise ValueError("the epilogue may only read Load(0), the reduced value")
        self.epilogue = epilogue
        self._compiled = None
        self._name = None

    def output_shape(self, sizes):
        return tuple(1 if d in self.reduce_dims else s for d, s in enumerate(sizes)
                     if self.keepdim or d not in self.reduce_dims)

    def output_strides_over_input(self, sizes, out_stride):
        """The output's strides described over the input's dims (0 along reduced ones), as the
        kernel's signature takes them."""
        ost, j = [0] * self.ndim, 0
        for d in range(self.ndim):
            if d not in self.reduce_dims:
                ost[d] = out_stride[j] if sizes[d] != 1 else 0
            if self.keepdim or d not in self.reduce_dims:
                j += 1
        return ost

    def _key(self):
        return ("red", self.input_dtypes, self.prologue, self.kind, self.ndim, self.reduce_dims,
                self.keepdim, self.out_dtype, self.epilogue)

    def _body(self, name):
        ni = len(self.input_dtypes)
        kd = [d for d in range(self.ndim) if d not in self.reduce_dims]
        em = _Emitter(lambda i: f"cl::ld(i{i}[j])")
        r = em(self.prologue)
        pro = [f"const {_CTYPE[d]}* i{i} = (const {_CTYPE[d]}*)q[{i}];"
               for i, d in enumerate(self.input_dtypes)]
        ep = _Emitter(lambda i: "acc")
        res = ep(self.epilogue) if self.epilogue is not None else "acc"
        ct = _CTYPE[self.out_dtype]
        arr = lambda xs: "{" + ", ".join(map(str, xs or [0])) + "}"
        return (
            f"\n// {self.describe()}\n"
            f'extern "C" void {name}(const int64_t* sizes, void* const* data, const int64_t* strides) {{\n'
            f"  static const int es[] = {{{_es_array(self.input_dtypes + (self.out_dtype,))}}};\n"
            f"  static const int kd[] = {arr(kd)}, rd[] = {arr(self.reduce_dims)};\n"
            f"  cl::reduction<{self.ndim}, {ni}, {_REDUCTIONS.index(self.kind)}>(sizes, data, strides,"
            f" es, kd, {len(kd)}, rd, {len(self.reduce_dims)},\n"
            f"      [](int64_t n, char* const* q, float* v) {{\n"
            + "".join(f"    {ln}\n" for ln in pro)
            + "#pragma omp simd\n    for (int64_t j = 0; j < n; ++j) {\n"
            + "".join(f"      {ln}\n" for ln in em.lines)
            + f"      v[j] = {r};\n    }}\n  }},\n"
            f"      [](float acc, char* out) {{\n"
            + "".join(f"    {ln}\n" for ln in ep.lines)
            + f"    *({ct}*)out = cl::cvt<{ct}>({res});\n  }});\n}}\n"
        )

    def describe(self) -> str:
        ins = ",".join(_SHORT[d] for d in self.input_dtypes)
        epi = f" then {self.epilogue}" if self.epilogue is not None else ""
        return (f"reduction {self.kind}{list(self.reduce_dims)} keepdim={self.keepdim} "
                f"ndim={self.ndim} in=({ins}) of {self.prologue}{epi} -> {_SHORT[self.out_dtype]}")


class _AffineNorm(_Kernel):
    """A normalisation kernel with optional weight and bias of the input's dtype or float32
    (ATen's mixed form under autocast); its C entry takes data (x, weight?, bias?, out, ...)."""

    def __init__(self, dtype, has_weight: bool, has_bias: bool, eps: float, param_dtype=None):
        self.dtype = _check_dtype(dtype, "input")
        self.param_dtype = _check_dtype(param_dtype or dtype, "weight")
        self.has_weight, self.has_bias = bool(has_weight), bool(has_bias)
        self.eps = float(eps)
        self._compiled = None
        self._name = None

    def checked_params(self, weight, bias, numel: int, op: str) -> list:
        """The weight and bias the kernel takes, each checked contiguous, of the parameter
        dtype, with `numel` elements."""
        params = []
        for t, has, what in ((weight, self.has_weight, "weight"), (bias, self.has_bias, "bias")):
            if has:
                if t is None or t.dtype != self.param_dtype or not t.is_contiguous() or t.numel() != numel:
                    raise ValueError(f"{op}: {what} must be contiguous {self.param_dtype} of {numel} elements")
                params.append(t)
        return params

    def _entry(self, name, fn: str, sizes: str, scratch: str) -> str:
        """The C entry calling cl::`fn`<T, P, weight?, bias?>(`sizes`, x, w, b, out, `scratch`eps)."""
        ct, pt = _CTYPE[self.dtype], _CTYPE[self.param_dtype]
        i = iter(range(1, 3))
        w = f"(const {pt}*)data[{next(i)}]" if self.has_weight else "nullptr"
        b = f"(const {pt}*)data[{next(i)}]" if self.has_bias else "nullptr"
        o = 1 + self.has_weight + self.has_bias
        return (
            f"\n// {self.describe()}\n"
            f'extern "C" void {name}(const int64_t* sizes, void* const* data, const int64_t* strides) {{\n'
            f"  (void)strides;\n"
            f"  cl::{fn}<{ct}, {pt}, {str(self.has_weight).lower()}, {str(self.has_bias).lower()}>("
            f"{sizes}, (const {ct}*)data[0], {w}, {b}, ({ct}*)data[{o}], {scratch}{float_literal(self.eps)});\n}}\n")


class CompiledLayerNorm(_Compiled):
    def __call__(self, x, weight, bias, out):
        """Validating entry point: x and out dense row-major with the same shape; weight/bias
        (when the kernel has them) dense with the normalised shape."""
        k = self.kernel
        _check_tensors([x], (k.dtype,), "input")
        _check_tensors([out], (k.dtype,), "output")
        if tuple(out.shape) != tuple(x.shape) or not x.is_contiguous() or not out.is_contiguous():
            raise ValueError("layer_norm: input and output must be contiguous and of one shape")
        cols = math.prod(x.shape[x.dim() - k.n_norm:]) if x.dim() >= k.n_norm else -1
        params = k.checked_params(weight, bias, cols, "layer_norm")
        if cols < 0:
            raise ValueError(f"layer_norm: input of rank {x.dim()} for {k.n_norm} normalised dims")
        self.call_unchecked(k.sizes_of(tuple(x.shape)), [x, *params, out], [])


class LayerNormKernel(_AffineNorm):
    """layer_norm over the last ``n_norm`` dims of a contiguous tensor, with optional weight
    and bias of the input's dtype; float32 statistics. The C entry takes sizes (rows, cols)
    and data (x, weight?, bias?, out)."""
    _prefix = "ln"
    _runner = CompiledLayerNorm

    def __init__(self, dtype, n_norm: int, has_weight: bool, has_bias: bool, eps: float,
                 param_dtype=None):
        super().__init__(dtype, has_weight, has_bias, eps, param_dtype)
        self.n_norm = int(n_norm)

    def sizes_of(self, shape):
        """(rows, cols) of an input of `shape`."""
        cols = math.prod(shape[len(shape) - self.n_norm:])
        return (math.prod(shape) // cols if cols else math.prod(shape[:len(shape) - self.n_norm]), cols)

    def _key(self):
        return ("ln", self.dtype, self.n_norm, self.has_weight, self.has_bias, self.eps, self.param_dtype)

    def _body(self, name):
        return self._entry(name, "layer_norm", "sizes[0], sizes[1]", "")

    def describe(self) -> str:
        return (f"layer_norm over {self.n_norm} dims {_SHORT[self.dtype]} params {_SHORT[self.param_dtype]} "
                f"weight={self.has_weight} "
                f"bias={self.has_bias} eps={self.eps!r}")


class CompiledGroupNorm(_Compiled):
    def __call__(self, x, weight, bias, out, groups: int):
        """Validating entry point: x and out of one shape [N, C, *], both contiguous or both
        dense with channels innermost; weight/bias (when the kernel has them) dense of C
        elements; C divisible by `groups`."""
        k = self.kernel
        _check_tensors([x], (k.dtype,), "input")
        _check_tensors([out], (k.dtype,), "output")
        if x.dim() < 2 or tuple(out.shape) != tuple(x.shape):
            raise ValueError("group_norm: input and output must be of one shape [N, C, *]")
        cl = channels_innermost(x)
        if cl is None or (cl and not out.permute(0, *range(2, out.dim()), 1).is_contiguous()) or (
                not cl and not out.is_contiguous()):
            raise ValueError("group_norm: input and output must both be contiguous or both be "
                             "dense with channels innermost")
        c = x.shape[1]
        if type(groups) is not int or groups <= 0 or c % groups:
            raise ValueError(f"group_norm: {c} channels do not split into {groups!r} groups")
        params = k.checked_params(weight, bias, c, "group_norm")
        self.call_unchecked(k.sizes_of(tuple(x.shape), groups, cl),
                            [x, *params, out, k.workspace(tuple(x.shape))], [])


class GroupNormKernel(_AffineNorm):
    """group_norm of [N, C, *] dense contiguous or with channels innermost (the output in the
    same order), with optional weight and bias; float32 statistics. The C entry takes sizes
    (N, C, positions, groups, channels innermost, CHUNK) and data (x, weight?, bias?, out,
    workspace of `workspace(shape)` float32 elements)."""
    _prefix = "gn"
    _runner = CompiledGroupNorm
    CHUNK = 256  # positions a channel sums before they join its total

    def sizes_of(self, shape, groups: int, channels_last: bool):
        return (shape[0], shape[1], math.prod(shape[2:]), groups, int(channels_last), self.CHUNK)

    def workspace(self, shape) -> torch.Tensor:
        """The kernel's scratch: per image and channel, a sum per chunk, then mean, scale, bias."""
        n, c, s = shape[0], shape[1], math.prod(shape[2:])
        return torch.empty(n * c * (-(-s // self.CHUNK) + 3), dtype=torch.float32)

    def _key(self):
        return ("gn", self.dtype, self.has_weight, self.has_bias, self.eps, self.param_dtype)

    def _body(self, name):
        o = 1 + self.has_weight + self.has_bias
        return self._entry(name, "group_norm", "sizes[0], sizes[1], sizes[2], sizes[3], sizes[4] != 0, sizes[5]",
                           f"(float*)data[{o + 1}], ")

    def describe(self) -> str:
        return (f"group_norm {_SHORT[self.dtype]} params {_SHORT[self.param_dtype]} "
                f"weight={self.has_weight} bias={self.has_bias} eps={self.eps!r}")


class CompiledSoftmax(_Compiled):
    def __call__(self, x, out, dim: int):
        """Validating entry point: x and out contiguous of one shape."""
        k = self.kernel
        _check_tensors([x], (k.dtype,), "input")
        _check_tensors([out], (k.dtype,), "output")
        if tuple(out.shape) != tuple(x.shape) or not x.is_contiguous() or not out.is_contiguous():
            raise ValueError("softmax: input and output must be contiguous and of one shape")
        if type(dim) is not int or not -max(x.dim(), 1) <= dim < max(x.dim(), 1):
            raise ValueError(f"softmax: dim {dim!r} out of range for rank {x.dim()}")
        self.call_unchecked(k.sizes_of(tuple(x.shape), dim), [x, out], [])


class SoftmaxKernel(_Kernel):
    """softmax or log_softmax along one dim of a contiguous tensor, float32 inside. The C
    entry takes sizes (outer, size of the dim, inner) and data (x, out)."""
    _prefix = "sm"
    _runner = CompiledSoftmax

    def __init__(self, dtype, log: bool):
        self.dtype = _check_dtype(dtype, "input")
        self.log = bool(log)
        self._compiled = None
        self._name = None

    @staticmethod
    def sizes_of(shape, dim: int):
        """(outer, D, inner) of a contiguous tensor of `shape` along `dim` (a 0-d tensor: one)."""
        if not shape:
            return (1, 1, 1)
        dim %= len(shape)
        return (math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1:]))

    def _key(self):
        return ("sm", self.dtype, self.log)

    def _body(self, name):
        ct = _CTYPE[self.dtype]
        return (
            f"\n// {self.describe()}\n"
            f'extern "C" void {name}(const int64_t* sizes, void* const* data, const int64_t* strides) {{\n'
            f"  (void)strides;\n"
            f"  cl::softmax<{ct}, {str(self.log).lower()}>(sizes[0], sizes[1], sizes[2], "
            f"(const {ct}*)data[0], ({ct}*)data[1]);\n}}\n")

    def describe(self) -> str:
        return f"{'log_' if self.log else ''}softmax {_SHORT[self.dtype]}"


def pool_output_size(size: int, k: int, s: int, p: int, d: int, ceil: bool) -> int:
    """ATen's pooling_output_shape."""
    out = (size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil else 0)) // s + 1
    if ceil and (out - 1) * s >= size + p:
        out -= 1
    return out


class CompiledPool(_Compiled):
    def __call__(self, x, out):
        """Validating entry point: x and out channels-last dense [N, C, H, W], out of the
        pooled size."""
        k = self.kernel
        _check_tensors([x], (k.dtype,), "input")
        _check_tensors([out], (k.dtype,), "output")
        want = k.output_shape(tuple(x.shape))
        cl = torch.channels_last
        if (x.dim() != 4 or tuple(out.shape) != want or not x.is_contiguous(memory_format=cl)
                or not out.is_contiguous(memory_format=cl)):
            raise ValueError(f"pool: input and output must be channels-last 4-D, output {want}")
        self.call_unchecked(tuple(x.shape) + want[2:], [x, out], [])


class PoolKernel(_Kernel):
    """2-D max or avg pooling (ATen's semantics) of a channels-last tensor, parameters
    fixed at compile time. The C entry takes sizes (N, C, H, W, OH, OW), data (x, out)."""
    _prefix = "pool"
    _runner = CompiledPool

    def __init__(self, dtype, kind, kernel, stride, padding, dilation=(1, 1), ceil_mode=False,
                 count_include_pad=True, divisor=None):
        if kind not in ("max", "avg"):
            raise ValueError(f"pool kind must be max or avg, got {kind!r}")
        self.dtype = _check_dtype(dtype, "input")
        self.kind = kind
        self.kernel, self.stride, self.padding, self.dilation = (
            tuple(int(v) for v in t) for t in (kernel, stride, padding, dilation))
        self.ceil_mode, self.count_include_pad = bool(ceil_mode), bool(count_include_pad)
        self.divisor = int(divisor) if divisor else 0
        self._compiled = None
        self._name = None

    def output_shape(self, shape):
        n, c, h, w = shape
        return (n, c) + tuple(pool_output_size(v, *a, self.ceil_mode) for v, a in zip(
            (h, w), zip(self.kernel, self.stride, self.padding, self.dilation)))

    def _key(self):
        return ("pool", self.dtype, self.kind, self.kernel, self.stride, self.padding, self.dilation,
                self.ceil_mode, self.count_include_pad, self.divisor)

    def _body(self, name):
        ct = _CTYPE[self.dtype]
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = self.kernel, self.stride, self.padding, self.dilation
        return (
            f"\n// {self.describe()}\n"
            f'extern "C" void {name}(const int64_t* sizes, void* const* data, const int64_t* strides) {{\n'
            f"  (void)strides;\n"
            f"  cl::pool2d_nhwc<{ct}, {int(self.kind == 'avg')}>(sizes, (const {ct}*)data[0], ({ct}*)data[1], "
            f"{kh}, {kw}, {sh}, {sw}, {ph}, {pw}, {dh}, {dw}, {str(self.count_include_pad).lower()}, "
            f"{self.divisor});\n}}\n")

    def describe(self) -> str:
        return (f"{self.kind}_pool2d nhwc {_SHORT[self.dtype]} k{self.kernel} s{self.stride} "
                f"p{self.padding} d{self.dilation} ceil={self.ceil_mode} "
                f"incl={self.count_include_pad} div={self.divisor}")


def _bad_dim(d, ndim):
    raise ValueError(f"reduce dim {d} out of range for ndim {ndim}")


# A translation unit per this many kernels at least. A unit's fixed cost (the
# preamble) is ~0.15 s of g++; one kernel takes 0.05-0.5 s (densenet121's 4
# kernels: 1.27 s in one unit, 0.77 s in two on two cores, EPYC Zen 4).
KERNELS_PER_UNIT = 2


def _units(n_kernels: int) -> int:
    """Translation units to compile `n_kernels` in, one per core this process may use."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, n_kernels // KERNELS_PER_UNIT))


def compile_library(kernels, name_hint: str = "graph"):
    """Compile several kernels into shared libraries: one compiler run per core
    (not one per kernel, most of a graph's compile time otherwise), in parallel.
    Returns the runners in order; equal kernels share one symbol."""
    unique = list(dict.fromkeys(kernels))
    todo = [k for k in unique if k._compiled is None]
    n = _units(len(todo))
    chunks = [todo[i::n] for i in range(n)] if todo else []

    def build_unit(i, chunk):
        source = "".join(k.source() for k in chunk)
        cdef = "\n".join(k.cdef() for k in chunk)
        hint = name_hint if n == 1 else f"{name_hint} ({i + 1}/{n})"
        return build.load_library(source, cdef, name_hint=hint, flags=kernel_flags())

    if len(chunks) > 1:  # g++ runs in subprocesses: threads are enough to overlap them
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(chunks)) as pool:
            libraries = list(pool.map(build_unit, range(len(chunks)), chunks))
    else:
        libraries = [build_unit(0, c) for c in chunks]
    for chunk, library in zip(chunks, libraries):
        for k in chunk:
            k._compiled = k._runner(k, library)
    by_key = {k: k._compiled for k in unique}
    return [by_key[k] for k in kernels]
