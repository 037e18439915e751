// The fixed preamble of every generated kernel library (cpu_layout/codegen/cpp_kernels.py):
// the loop machinery, templates the generated per-element lambdas parameterise.
// PAR_MIN: below this many elements the OpenMP fork/join costs more than it saves.
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
// @SIMD_MATH@ (cpp_kernels.preamble puts the vector math declarations here)
namespace cl {
typedef uint16_t bf16;
// BLOCK: elements per tile; L: accumulator lanes; KB: elements per tile of a kept-inner
// reduction (outputs per block, or rows x outputs); RCHUNK: rows summed before they join the total;
// ROW_MIN: the shortest rows a pointwise op runs one call per row on (shorter rows go in tiles:
// a bf16 op over 32-channel rows took 137 us a call per row, 75 us in tiles; EPYC Zen 4).
// GROUP: elements per call when short dense rows go several to a call.
enum { BLOCK = 512, PAR_MIN = 16384, L = 16, KB = 1024, RCHUNK = 256, ROW_MIN = 128, PB = 64,
       GROUP = 2048 };

static inline float ld(float x) { return x; }
static inline float ld(bf16 h) {
  uint32_t u = (uint32_t)h << 16; float f; std::memcpy(&f, &u, 4); return f;
}
// uint8/int8: quantized tensors that dequantize/quantize ops (quant/) read and write;
// the value stored is already rounded and clamped by cl::quant.
static inline float ld(uint8_t x) { return (float)x; }
static inline float ld(int8_t x) { return (float)x; }
template <class T> static inline T cvt(float v);
template <> inline float cvt<float>(float v) { return v; }
template <> inline uint8_t cvt<uint8_t>(float v) { return (uint8_t)(int)v; }
template <> inline int8_t cvt<int8_t>(float v) { return (int8_t)(int)v; }
// quantize_per_tensor's value: round half to even (adding and subtracting 1.5 * 2^23
// rounds any |t| < 2^22, and vectorises where nearbyint may not; a larger |t| comes out
// near itself, far outside [lo, hi], where the clamp makes it exact), plus the zero point,
// clamped to [lo, hi]; a NaN becomes lo (torch's cast of NaN to uint8 is undefined).
static inline float quant(float x, float inv_scale, float zp, float lo, float hi) {
  const float t = x * inv_scale;
  float v = ((t + 12582912.f) - 12582912.f) + zp;
  v = v >= lo ? v : lo;
  return v <= hi ? v : hi;
}
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
// n floats, already rounded and clamped by cl::quant, to uint8/int8: a loop over floats
// alone, which vectorises where a loop mixing 1- and 4-byte loads and stores did not
// (dequantize -> BN -> ReLU -> quantize over 256x56x56: 0.70 ns an element in one loop).
static inline void narrow(uint8_t* d, const float* s, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = (uint8_t)(int)s[i];
}
static inline void narrow(int8_t* d, const float* s, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = (int8_t)(int)s[i];
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
// (exp staged on the stack for rows up to ROW_STAGE, computed twice for longer ones); otherwise IB lanes
// of inner at a time, the reductions vectorised across them. Threads take (outer, lane block).
template <class T, bool LOG>
static void softmax(int64_t outer, int64_t D, int64_t inner, const T* x, T* y) {
  if (outer * D * inner == 0) return;
  enum { IB = 64, ROW_STAGE = 1024 };
  const int64_t nb = (inner + IB - 1) / IB, items = outer * nb;
  auto work = [&](int64_t i0, int64_t i1) {
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t o = it / nb, j0 = (it % nb) * IB;
      const T* xo = x + o * D * inner;
      T* yo = y + o * D * inner;
      if (inner == 1) {
        float m = -INFINITY;
        int nan = 0;  // an int sum, not a bool or: GCC vectorises this loop only so
#pragma omp simd reduction(max : m) reduction(+ : nan)
        for (int64_t d = 0; d < D; ++d) { const float v = ld(xo[d]); m = v > m ? v : m; nan += v != v; }
        if (nan) m = NAN;
        if (!LOG && D <= ROW_STAGE) {  // a row that fits: exp once, staged
          float e[ROW_STAGE];
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t d = 0; d < D; ++d) { e[d] = std::exp(ld(xo[d]) - m); sum += e[d]; }
          const float inv = 1.f / sum;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) yo[d] = cvt<T>(e[d] * inv);
          continue;
        }
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
