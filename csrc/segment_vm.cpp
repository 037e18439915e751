/* The segment runtime: runs cpp_wrapper segments from a compact program.
 *
 * Compiled once per machine and torch (cpu_layout/codegen/program.py loads
 * it through the content-hashed build cache), after cl_api.h and
 * cl_wrapper.h. A graph's segments are programs for it: an array of int64
 * instructions (opcode, operand count, operands) built by program.py, so a
 * compile no longer runs g++ over per-graph glue (densenet121's took 5 s of
 * g++ for 5,500 lines of straight-line C++); only the graph's fused kernels
 * are compiled, and the program calls them through function pointers.
 *
 * Registers hold tensor handles (clw::H). A register may instead alias
 * another one: a layout conversion whose input already is in the order asked
 * for is that input itself. Every handle a call holds lives in the call's
 * register file, so an exception anywhere frees everything it allocated.
 */
#include <atomic>
#include <chrono>
#include <memory>

namespace clvm {

using clw::H;
using clw::fail;

// Opcodes; program.py's OP table must list the same numbers (checked when a
// program is made: cl_program_new rejects an opcode it does not know).
enum Op : int64_t {
  EXPECT = 1, BLOB, SYM_DIM, SYM_SCALAR, ORDERED, ORDERED_PERM, GIVE, RESET, CONV, KERNEL,
  REDUCTION, LAYER_NORM, RESHAPE, PERMUTE, UNSQUEEZE, REORDER, REORDER_PERM, POOL_KERNEL,
  MAX_POOL, AVG_POOL, CAT, CAT_SHIM, AS_STRIDED, UPSAMPLE, INDEX, MM, ADDMM, ALIAS, SLICE,
  CLONE, SHUFFLE, CHECK, OUT, ATEN_CONV, GROUP_NORM, SOFTMAX, OUT_EAGER, QCONV, QMAX_POOL, BMM, SELECT, ROLL, SDPA, EXPAND, N_OPS
};

// Size-expression tokens (program.py: sizes.rpn): a stack machine over int64.
enum Tok : int64_t { T_CONST = 0, T_SYM, T_ADD, T_MUL, T_FLOORDIV, T_MOD, T_MAX, T_MIN, T_CEILDIV };

typedef void (*kernel_fn)(const int64_t*, void* const*, const int64_t*);

struct Program {
  std::vector<int64_t> code;
  std::vector<double> reals;
  std::vector<std::string> names;
  std::vector<kernel_fn> kernels;
  int64_t n_regs = 0, n_syms = 0, n_in = 0;
  clw::PoolSlot pool;
  // Profiling on: wall time per instruction, at the index of its first word.
  std::unique_ptr<std::atomic<int64_t>[]> pc_ns;
  ~Program() { delete pool.p.exchange(nullptr); }
};

// cl_profile(1): wall time and count per opcode, summed over every program
// run in the process (slot N_OPS: whole runs). Off, it costs one load per run.
std::atomic<int> g_profile{0};
std::atomic<int64_t> g_op_ns[N_OPS + 1], g_op_count[N_OPS + 1];

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Reg {
  H h;
  int64_t alias = -1;  // >= 0: this register reads as that one
};

class Run {
 public:
  Run(const Program& p, const int64_t* consts, const int64_t* scalars, clw::Pool* pool)
      : p_(p), consts_(consts), scalars_(scalars), pool_(pool), regs_((size_t)p.n_regs),
        syms_((size_t)std::max<int64_t>(p.n_syms, 1)) {}

  void take_inputs(const uintptr_t* in) {
    for (int64_t i = 0; i < p_.n_in; ++i) regs_[(size_t)i].h = H((AtenTensorHandle)in[i]);
  }

  void run(uintptr_t* out);

 private:
  const Program& p_;
  const int64_t* consts_;
  const int64_t* scalars_;
  clw::Pool* pool_;
  std::vector<Reg> regs_;
  std::vector<int64_t> syms_;
  const int64_t* a_ = nullptr;  // operand cursor of the instruction being run

  int64_t A() { return *a_++; }
  const int64_t* P(int64_t n) { const int64_t* q = a_; a_ += n; return q; }
  const std::string& S(int64_t i) { return p_.names[(size_t)i]; }
  Reg& reg(int64_t r) { return regs_[(size_t)r]; }
  const H& R(int64_t r) {
    while (regs_[(size_t)r].alias >= 0) r = regs_[(size_t)r].alias;
    return regs_[(size_t)r].h;
  }
  void set(int64_t r, H&& h) { Reg& g = reg(r); g.alias = -1; g.h = std::move(h); }
  // A conversion's result: `got` is the source register's handle (dst aliases
  // it) or the copy held by `tmp` (dst owns it).
  void converted(int64_t dst, int64_t src, const H& got, H& tmp) {
    if (&got == &tmp) set(dst, std::move(tmp));
    else { reg(dst).h.reset(); reg(dst).alias = src; }
  }
  // `nd` operands: a permutation of the dims.
  void read_perm(int64_t nd, int* perm) {
    if (nd > 16) fail("segment program: more than 16 dims");
    const int64_t* p = P(nd);
    for (int64_t i = 0; i < nd; ++i) perm[i] = (int)p[i];
  }
  // A fresh dense result: pooled storage, or its own when it leaves the segment (fresh == 1).
  H alloc(int64_t fresh, int nd, const int64_t* sz, bool cl, int es) {
    return fresh ? clw::empty_dense(nd, sz, cl, es) : pool_->take(nd, sz, cl, es);
  }
  int64_t expr();
  void conv();
  void qconv();
  void qmax_pool();
  void kernel();
  void reduction();
  int affine_params(int64_t w, int64_t w_msg, int64_t b, int64_t b_msg, int64_t numel, void** data);
  void layer_norm();
  void group_norm();
};

int64_t Run::expr() {
  const int64_t n = A();
  const int64_t* t = P(n);
  std::vector<int64_t> st((size_t)n / 2 + 1);  // each operand is two tokens
  size_t sp = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = t[i];
    if (k == T_CONST || k == T_SYM) {
      if (sp == st.size() || i + 1 >= n) fail("corrupt size expression");
      st[sp++] = k == T_CONST ? t[++i] : syms_[(size_t)t[++i]];
      continue;
    }
    if (sp < 2) fail("corrupt size expression");
    const int64_t b = st[--sp], a = st[sp - 1];
    int64_t& r = st[sp - 1];
    switch (k) {
      case T_ADD: r = a + b; break;
      case T_MUL: r = a * b; break;
      case T_FLOORDIV: r = clw::floordiv(a, b); break;
      case T_MOD: r = clw::pymod(a, b); break;
      case T_MAX: r = std::max(a, b); break;
      case T_MIN: r = std::min(a, b); break;
      case T_CEILDIV: r = -clw::floordiv(-a, b); break;
      default: fail("corrupt size expression");
    }
  }
  if (sp != 1) fail("corrupt size expression");
  return st[0];
}

// The problem fields the float and int8 conv instructions share (cl_conv_args and
// cl_qconv_args name them alike): sizes from the input's, the spatial geometry from the
// program, the output's spatial sizes computed, the post-ops' kinds and parameters.
template <class Args>
void fill_conv(Args& a, const int64_t* xsz, int64_t oc, int64_t groups, int64_t ic, int64_t nsp, const int64_t* k,
               const int64_t* s, const int64_t* pd, const int64_t* dl, int64_t npost, const int64_t* post,
               const std::vector<double>& reals, const std::string& name) {
  a.nsp = (int)nsp;
  a.n = xsz[0];
  a.ic = xsz[1];
  a.oc = oc;
  a.groups = groups;
  if (a.ic != ic)
    fail(name + ": input has " + std::to_string(a.ic) + " channels, the weight expects " + std::to_string(ic));
  for (int64_t i = 0; i < nsp; ++i) {
    a.in_sp[i] = xsz[2 + i];
    a.k_sp[i] = k[i];
    a.stride[i] = s[i];
    a.pad_l[i] = a.pad_r[i] = pd[i];
    a.dilation[i] = dl[i];
    const int64_t span = dl[i] * (k[i] - 1) + 1;
    if (xsz[2 + i] + 2 * pd[i] < span) fail(name + ": kernel larger than the padded input");
    a.out_sp[i] = (xsz[2 + i] + 2 * pd[i] - span) / s[i] + 1;
  }
  a.n_post_ops = (int)npost;
  for (int64_t i = 0; i < npost; ++i) {
    a.post_ops[i].kind = (int)post[3 * i];
    a.post_ops[i].alpha = (float)reals[(size_t)post[3 * i + 1]];
    a.post_ops[i].beta = (float)reals[(size_t)post[3 * i + 2]];
  }
}

// CONV out x w_const w_es scale_const(-1) b_const(-1) nsp es dst_cl w_cl impl_rank oc groups ic k[nsp]
//      s[nsp] p[nsp] d[nsp] npost (kind alpha_real beta_real)*npost nres res[nres] inplace(-1) fresh name
// w_es: the weight's element size (a float32 weight of a bf16 conv is converted while
// packed); scale_const: per output channel, packed into the weight (a folded batch-norm).
void Run::conv() {
  const int64_t out = A(), x = A(), wi = A(), w_es = A(), si = A(), bi = A(), nsp = A(), es = A(), dst_cl = A(),
                w_cl = A();
  const int64_t impl_rank = A();
  const int64_t oc = A(), groups = A(), ic = A();
  const int64_t *k = P(nsp), *s = P(nsp), *pd = P(nsp), *dl = P(nsp);
  const int64_t npost = A();
  const int64_t* post = P(3 * npost);
  const int64_t nres = A();
  const int64_t* res = P(nres);
  const int64_t inplace = A(), fresh = A();
  const std::string& name = S(A());
  if (nsp < 1 || nsp > CL_MAX_SPATIAL || npost > CL_MAX_POST_OPS || nres > CL_MAX_POST_OPS)
    fail(name + ": conv instruction out of range");
  const H& xin = R(x);
  const H* xs = &xin;
  H xc;
  bool scl = dst_cl != 0;
  if (!clw::dense_in(xin, scl)) {
    if (clw::dense_in(xin, !scl)) scl = !scl;
    else { xc = clw::copy_in_order(xin, scl); xs = &xc; }
  }
  const int64_t* xsz = clw::sizes(*xs);
  cl_conv_args a;
  std::memset(&a, 0, sizeof a);
  a.dtype = a.bias_dtype = es == 4 ? CL_F32 : CL_BF16;
  a.has_bias = bi >= 0;
  a.src_cl = scl;
  a.dst_cl = (int)dst_cl;
  a.w_cl = (int)w_cl;
  a.impl_rank = (int)impl_rank;
  fill_conv(a, xsz, oc, groups, ic, nsp, k, s, pd, dl, npost, post, p_.reals, name);
  int64_t osz[5] = {a.n, a.oc, 0, 0, 0};
  for (int64_t i = 0; i < nsp; ++i) osz[2 + i] = a.out_sp[i];
  const int nd = (int)nsp + 2;
  H tmp_out;
  // The output takes over a dying residual's storage: oneDNN's sum post-op adds in place.
  if (inplace >= 0) tmp_out = clw::take_over(reg(inplace).h, nd, osz, dst_cl != 0);
  const bool in_place = static_cast<bool>(tmp_out);
  if (!in_place) tmp_out = alloc(fresh, nd, osz, dst_cl != 0, (int)es);
  std::vector<H> res_c((size_t)nres);
  uintptr_t res_addr[CL_MAX_POST_OPS] = {0};
  for (int64_t j = 0; j < nres; ++j) {
    const H& rj = (j == 0 && in_place) ? tmp_out : clw::ordered(R(res[j]), dst_cl != 0, res_c[(size_t)j]);
    if (clw::dim(rj) != nd || !std::equal(osz, osz + nd, clw::sizes(rj)))
      fail(name + ": the residual does not have the output's size");
    res_addr[j] = clw::addr(rj);
  }
  const uintptr_t bias = bi >= 0 ? (uintptr_t)consts_[3 * bi] : 0;
  // An empty batch has an empty result, as in eager (oneDNN takes no zero-sized problem).
  const uintptr_t scale = si >= 0 ? (uintptr_t)consts_[3 * si] : 0;
  const unsigned long long scale_id = si >= 0 ? (unsigned long long)consts_[3 * si + 1] : 0;
  if (a.n > 0 && clw::conv_forward(&a, clw::addr(*xs), (uintptr_t)consts_[3 * wi], w_es == 4 ? CL_F32 : CL_BF16,
                                   (unsigned long long)consts_[3 * wi + 1], consts_[3 * wi + 2], scale, scale_id,
                                   bias, clw::addr(tmp_out), nres ? res_addr : nullptr))
    fail(name + ": " + clw::conv_error());
  set(out, std::move(tmp_out));
}

// QCONV out x w_const scales_const b_const(-1) nsp dst_es oc groups ic k[nsp] s[nsp] p[nsp] d[nsp]
//       x_scale_real x_zp out_scale_real out_zp npost (kind alpha_real beta_real)*npost
//       sum_scale_real sum_zp res(-1) inplace(-1) fresh linear name
// An int8 conv (quant/cpp.py): uint8 x channels-last, s8 weight and f32 scales and bias from the
// constants, a uint8 (dst_es 1) or float32 (4) result channels-last. linear: x is [M, K] row-major,
// run as the 1x1 conv over [1, K, 1, M] that is its memory read channels-last; the result [M, N].
void Run::qconv() {
  const int64_t out = A(), x = A(), wi = A(), si = A(), bi = A(), nsp = A(), des = A();
  const int64_t oc = A(), groups = A(), ic = A();
  const int64_t *k = P(nsp), *s = P(nsp), *pd = P(nsp), *dl = P(nsp);
  const double x_scale = p_.reals[(size_t)A()];
  const int64_t x_zp = A();
  const double out_scale = p_.reals[(size_t)A()];
  const int64_t out_zp = A(), npost = A();
  const int64_t* post = P(3 * npost);
  const double sum_scale = p_.reals[(size_t)A()];
  const int64_t sum_zp = A(), res = A(), inplace = A(), fresh = A(), linear = A();
  const std::string& name = S(A());
  if (nsp < 1 || nsp > CL_MAX_SPATIAL || npost > CL_MAX_POST_OPS || (des != 1 && des != 4) || (linear && nsp != 2))
    fail(name + ": int8 conv instruction out of range");
  const H& xin = R(x);
  if (clw::elsize(xin) != 1) fail(name + ": the int8 conv's input is not uint8");
  if (clw::dim(xin) != (linear ? 2 : nsp + 2)) fail(name + ": the int8 conv's input has the wrong rank");
  H xc;
  const H* xs = &xin;
  // A linear's [M, K] row-major is the channels-last [1, K, 1, M] its conv reads.
  if (!clw::dense_in(xin, !linear)) { xc = clw::copy_in_order(xin, !linear); xs = &xc; }
  const int64_t* sz0 = clw::sizes(*xs);
  const int64_t lin_sz[4] = {1, linear ? sz0[1] : 0, 1, linear ? sz0[0] : 0};
  const int64_t* xsz = linear ? lin_sz : sz0;
  cl_qconv_args a;
  std::memset(&a, 0, sizeof a);
  a.src_dt = CL_U8;
  a.dst_dt = des == 1 ? CL_U8 : CL_F32;
  a.has_bias = bi >= 0;
  a.src_cl = a.dst_cl = 1;
  a.src_zp = (int)x_zp;
  a.dst_zp = (int)out_zp;
  fill_conv(a, xsz, oc, groups, ic, nsp, k, s, pd, dl, npost, post, p_.reals, name);
  int64_t osz[5] = {a.n, a.oc, 0, 0, 0};
  for (int64_t i = 0; i < nsp; ++i) osz[2 + i] = a.out_sp[i];
  a.sum_scale = (float)sum_scale;
  a.sum_zp = (int)sum_zp;
  int nd = (int)nsp + 2;
  if (linear) {  // the result [M, N] row-major: the conv's [1, N, 1, M] channels-last
    osz[0] = xsz[3];
    osz[1] = oc;
    nd = 2;
  }
  H tmp_out;
  // The output takes over a dying residual's storage: oneDNN's sum post-op adds in place.
  if (inplace >= 0 && !linear) tmp_out = clw::take_over(reg(inplace).h, nd, osz, true);
  const bool in_place = static_cast<bool>(tmp_out);
  if (!in_place) tmp_out = alloc(fresh, nd, osz, !linear, (int)des);
  H res_c;
  uintptr_t res_addr = 0;
  if (res >= 0) {
    const H& r = in_place ? tmp_out : clw::ordered(R(res), !linear, res_c);
    if (clw::dim(r) != nd || !std::equal(osz, osz + nd, clw::sizes(r)) || clw::elsize(r) != des)
      fail(name + ": the residual does not have the output's size and dtype");
    res_addr = clw::addr(r);
  }
  const uintptr_t bias = bi >= 0 ? (uintptr_t)consts_[3 * bi] : 0;
  if (a.n > 0 && clw::qconv_forward(&a, clw::addr(*xs), (float)x_scale, (uintptr_t)consts_[3 * wi],
                                    (unsigned long long)consts_[3 * wi + 1], consts_[3 * wi + 2],
                                    (uintptr_t)consts_[3 * si], bias, clw::addr(tmp_out), (float)out_scale,
                                    res_addr))
    fail(name + ": " + clw::conv_error());
  set(out, std::move(tmp_out));
}

// QMAX_POOL out x nsp k[nsp] s[nsp] p[nsp] d[nsp] ceil fresh name: max pooling of a uint8
// tensor on oneDNN (the max of quantized values is the quantized max), channels-last.
void Run::qmax_pool() {
  const int64_t out = A(), x = A(), nsp = A();
  const int64_t *k = P(nsp), *s = P(nsp), *pd = P(nsp), *dl = P(nsp);
  const int64_t ceil = A(), fresh = A();
  const std::string& name = S(A());
  if (nsp < 1 || nsp > CL_MAX_SPATIAL) fail(name + ": int8 max pool instruction out of range");
  const H& xin = R(x);
  if (clw::elsize(xin) != 1) fail(name + ": the int8 max pool's input is not uint8");
  H xc;
  const H* xs = &xin;
  if (!clw::dense_in(xin, true)) { xc = clw::copy_in_order(xin, true); xs = &xc; }
  const int64_t* xsz = clw::sizes(*xs);
  const int nd = (int)nsp + 2;
  long long sd[5], dd[5], kk[3], ss[3], pl[3], pr[3], dd_[3];
  for (int i = 0; i < nd; ++i) sd[i] = dd[i] = xsz[i];
  for (int64_t i = 0; i < nsp; ++i) {  // torch's output size (pooling_shape_check's formula)
    const int64_t in = xsz[2 + i], span = in + 2 * pd[i] - dl[i] * (k[i] - 1) - 1;
    if (span < 0) fail(name + ": pooling window larger than the padded input");
    int64_t o = (span + (ceil ? s[i] - 1 : 0)) / s[i] + 1;
    if (ceil && (o - 1) * s[i] >= in + pd[i]) --o;
    dd[2 + i] = o;
    kk[i] = k[i]; ss[i] = s[i]; pl[i] = pd[i]; dd_[i] = dl[i];
    pr[i] = std::max<long long>(0, (o - 1) * s[i] + dl[i] * (k[i] - 1) + 1 - in - pd[i]);
  }
  int64_t osz[5];
  for (int i = 0; i < nd; ++i) osz[i] = dd[i];
  H o = alloc(fresh, nd, osz, true, 1);
  if (clw::numel(o) > 0 &&
      clw::qmax_pool((int)nsp, CL_U8, 1, sd, dd, kk, ss, pl, pr, dd_, clw::addr(*xs), clw::addr(o)))
    fail(name + ": " + clw::conv_error());
  set(out, std::move(o));
}

// KERNEL out kernel nd ni in[ni] cl es fresh inplace(-1)
void Run::kernel() {
  const int64_t out = A(), ki = A(), nd = A(), ni = A();
  const int64_t* in = P(ni);
  const int64_t cl = A(), es = A(), fresh = A(), inplace = A();
  if (nd > 16) fail("kernel instruction: more than 16 dims");
  std::vector<const H*> ins((size_t)ni);
  for (int64_t i = 0; i < ni; ++i) ins[(size_t)i] = &R(in[i]);
  int64_t sz[16] = {0};
  clw::broadcast_sizes(ins.data(), (int)ni, (int)nd, sz);
  // The output takes over a dying input's storage when it is dense in the output's order
  // (the kernel loads every input of an element before storing it); the input then
  // reads through the output's handle, its own register being emptied.
  H t;
  if (inplace >= 0) {
    const H* dying = &reg(inplace).h;
    t = clw::take_over(reg(inplace).h, (int)nd, sz, cl != 0);
    if (t)
      for (auto& p : ins)
        if (p == dying) p = &t;
  }
  if (!t) t = alloc(fresh, (int)nd, sz, cl != 0, (int)es);
  std::vector<int64_t> st((size_t)std::max<int64_t>((ni + 1) * nd, 1));
  for (int64_t i = 0; i < ni; ++i) clw::broadcast_strides(*ins[(size_t)i], (int)nd, sz, st.data() + i * nd);
  const int64_t* os = clw::strides(t);
  for (int64_t d = 0; d < nd; ++d) st[(size_t)(ni * nd + d)] = os[d];
  std::vector<void*> data((size_t)ni + 1);
  for (int64_t i = 0; i < ni; ++i) data[(size_t)i] = clw::data(*ins[(size_t)i]);
  data[(size_t)ni] = clw::data(t);
  p_.kernels[(size_t)ki](sz, data.data(), st.data());
  set(out, std::move(t));
}

// REDUCTION out kernel x nd keepdim empty_msg(-1) ndims dims[ndims] cl es fresh
void Run::reduction() {
  const int64_t out = A(), ki = A(), x = A(), nd = A(), keepdim = A(), empty_msg = A(), ndims = A();
  const int64_t* dims = P(ndims);
  const int64_t cl = A(), es = A(), fresh = A();
  if (nd > 16) fail("reduction instruction: more than 16 dims");
  const H& xv = R(x);
  const int64_t* xs = clw::sizes(xv);
  bool reduced[16] = {false};
  for (int64_t i = 0; i < ndims; ++i) reduced[dims[i]] = true;
  if (empty_msg >= 0)
    for (int64_t i = 0; i < ndims; ++i)
      if (xs[dims[i]] == 0) fail(S(empty_msg));
  int64_t osz[16] = {1};
  int ond = 0;
  for (int64_t d = 0; d < nd; ++d)
    if (keepdim || !reduced[d]) osz[ond++] = reduced[d] ? 1 : xs[d];
  H t = alloc(fresh, ond, osz, cl != 0, (int)es);
  int64_t st[32];
  const int64_t* xst = clw::strides(xv);
  const int64_t* os = clw::strides(t);
  for (int64_t d = 0; d < nd; ++d) { st[d] = xst[d]; st[nd + d] = 0; }
  int j = 0;
  for (int64_t d = 0; d < nd; ++d) {
    if (!reduced[d]) st[nd + d] = xs[d] != 1 ? os[j] : 0;
    if (keepdim || !reduced[d]) ++j;
  }
  void* const data[] = {clw::data(xv), clw::data(t)};
  p_.kernels[(size_t)ki](xs, data, st);
  set(out, std::move(t));
}

// A norm's weight and bias registers (-1: none) into `data`, each checked dense of `numel`
// elements (else its message); returns how many it wrote.
int Run::affine_params(int64_t w, int64_t w_msg, int64_t b, int64_t b_msg, int64_t numel, void** data) {
  int n = 0;
  for (const int64_t* pm : {&w, &b}) {
    if (*pm < 0) continue;
    const H& p = R(*pm);
    if (clw::numel(p) != numel || !clw::dense_in(p, false)) fail(S(pm == &w ? w_msg : b_msg));
    data[n++] = clw::data(p);
  }
  return n;
}

// LAYER_NORM out kernel x nd n_norm w(-1) w_msg b(-1) b_msg es fresh
void Run::layer_norm() {
  const int64_t out = A(), ki = A(), x = A(), nd = A(), n_norm = A();
  const int64_t w = A(), w_msg = A(), b = A(), b_msg = A(), es = A(), fresh = A();
  // The plan reads a slice of a contiguous buffer as it is; the kernel walks dense rows.
  H tmp;
  const H& xv = clw::ordered(R(x), false, tmp);
  const int64_t* xs = clw::sizes(xv);
  int64_t rc[2] = {1, 1};
  for (int64_t d = 0; d < nd; ++d) rc[d < nd - n_norm ? 0 : 1] *= xs[d];
  H t = alloc(fresh, (int)nd, xs, false, (int)es);
  void* data[4];
  data[0] = clw::data(xv);
  int n = affine_params(w, w_msg, b, b_msg, rc[1], data + 1) + 1;
  data[n++] = clw::data(t);
  if (rc[0] * rc[1] > 0) p_.kernels[(size_t)ki](rc, data, nullptr);
  set(out, std::move(t));
}

// GROUP_NORM out kernel x cl groups w(-1) w_msg b(-1) b_msg chunk es fresh: x read dense,
// contiguous or with channels innermost (cl: the plan's), the result in the same order.
void Run::group_norm() {
  const int64_t out = A(), ki = A(), x = A(), cl = A(), groups = A();
  const int64_t w = A(), w_msg = A(), b = A(), b_msg = A(), chunk = A(), es = A(), fresh = A();
  H tmp;
  const H* xp = &R(x);
  bool xcl = false;
  if (clw::dense_in(*xp, false)) xcl = false;
  else if (clw::dim(*xp) >= 3 && clw::dense_in(*xp, true)) xcl = true;
  else { tmp = clw::copy_in_order(*xp, cl != 0); xp = &tmp; xcl = cl != 0; }  // a slice: counted
  const H& xv = *xp;
  const int nd = (int)clw::dim(xv);
  const int64_t* xs = clw::sizes(xv);
  int64_t positions = 1;
  for (int d = 2; d < nd; ++d) positions *= xs[d];
  const int64_t sz[6] = {xs[0], xs[1], positions, groups, xcl ? 1 : 0, chunk};
  H t = alloc(fresh, nd, xs, xcl, (int)es);
  const int64_t wsz[1] = {xs[0] * xs[1] * ((positions + chunk - 1) / chunk + 3)};  // GroupNormKernel.workspace
  H work = clw::empty_dense(1, wsz, false, 4);
  void* data[5];
  data[0] = clw::data(xv);
  int n = affine_params(w, w_msg, b, b_msg, xs[1], data + 1) + 1;
  data[n++] = clw::data(t);
  data[n++] = clw::data(work);
  p_.kernels[(size_t)ki](sz, data, nullptr);
  set(out, std::move(t));
}

void Run::run(uintptr_t* out) {
  const int64_t* code = p_.code.data();
  const int64_t ncode = (int64_t)p_.code.size();
  const bool prof = g_profile.load(std::memory_order_relaxed) != 0;
  for (int64_t pc = 0; pc < ncode;) {
    const int64_t op = code[pc], n = code[pc + 1];
    const int64_t t0 = prof ? now_ns() : 0, pc0 = pc;
    a_ = code + pc + 2;
    const int64_t* end = a_ + n;
    pool_->at(pc);
    pc += 2 + n;
    switch (op) {
      case EXPECT: {  // reg es nd want[nd] name: the dtype, rank and static sizes compiled for
        const int64_t r = A(), es = A(), nd = A();
        const int64_t* want = P(nd);
        clw::expect(R(r), (int)es, (int)nd, want, S(A()).c_str());
        break;
      }
      case BLOB: {  // reg const es nd sz[nd] st[nd]: a module constant's memory as a tensor
        const int64_t r = A(), ci = A(), es = A(), nd = A();
        const int64_t *sz = P(nd), *st = P(nd);
        set(r, clw::blob((uintptr_t)consts_[3 * ci], (int)nd, sz, st, (int)es));
        break;
      }
      case SYM_DIM: { const int64_t s = A(), r = A(), d = A(); syms_[(size_t)s] = clw::sizes(R(r))[d]; break; }
      case SYM_SCALAR: { const int64_t s = A(), i = A(); syms_[(size_t)s] = scalars_[i]; break; }
      case ORDERED: {  // dst src cl pooled: src itself when dense in that order, else a copy
        const int64_t d = A(), s = A(), cl = A(), pooled = A();
        H tmp;
        converted(d, s, clw::ordered(R(s), cl != 0, tmp, pooled ? pool_ : nullptr), tmp);
        break;
      }
      case ORDERED_PERM: {  // dst src nd perm[nd] pooled
        const int64_t d = A(), s = A(), nd = A();
        int perm[16];
        read_perm(nd, perm);
        const int64_t pooled = A();
        H tmp;
        converted(d, s, clw::ordered_perm(R(s), perm, tmp, pooled ? pool_ : nullptr), tmp);
        break;
      }
      case GIVE: {  // reg: back to the pool (an alias just stops aliasing)
        Reg& g = reg(A());
        if (g.alias >= 0) g.alias = -1;
        else pool_->give(std::move(g.h));
        break;
      }
      case RESET: { Reg& g = reg(A()); g.alias = -1; g.h.reset(); break; }
      case CONV: conv(); break;
      case KERNEL: kernel(); break;
      case REDUCTION: reduction(); break;
      case LAYER_NORM: layer_norm(); break;
      case GROUP_NORM: group_norm(); break;
      case SOFTMAX: {  // out kernel x dim es fresh: x read dense contiguous, the result contiguous
        const int64_t o = A(), ki = A(), x = A(), dim = A(), es = A(), fresh = A();
        H tmp;
        const H& xv = clw::ordered(R(x), false, tmp);  // a slice: made dense, counted
        const int nd = (int)clw::dim(xv);
        const int64_t* xs = clw::sizes(xv);
        int64_t sz[3] = {1, nd ? xs[dim] : 1, 1};
        for (int d = 0; d < nd; ++d)
          if (d != dim) sz[d < dim ? 0 : 2] *= xs[d];
        H t = alloc(fresh, nd, xs, false, (int)es);
        void* const data[] = {clw::data(xv), clw::data(t)};
        p_.kernels[(size_t)ki](sz, data, nullptr);
        set(o, std::move(t));
        break;
      }
      case RESHAPE: {  // out x rank (expr)*rank
        const int64_t o = A(), x = A(), rank = A();
        if (rank > 16) fail("segment program: more than 16 dims");
        int64_t nsz[16] = {1};
        for (int64_t i = 0; i < rank; ++i) nsz[i] = expr();
        set(o, clw::reshape(R(x), (int)rank, nsz));
        break;
      }
      case PERMUTE: {  // out x nd perm[nd]
        const int64_t o = A(), x = A(), nd = A();
        int perm[16];
        read_perm(nd, perm);
        set(o, clw::permute(R(x), (int)nd, perm));
        break;
      }
      case UNSQUEEZE: { const int64_t o = A(), x = A(), d = A(); set(o, clw::unsqueeze(R(x), (int)d)); break; }
      case REORDER: {  // reg cl: a view the plan wants in that order (a no-op when it already is)
        const int64_t r = A(), cl = A();
        H c;
        const H& got = clw::ordered(reg(r).h, cl != 0, c);
        if (&got == &c) reg(r).h = std::move(c);
        break;
      }
      case REORDER_PERM: {  // reg nd perm[nd]
        const int64_t r = A(), nd = A();
        int perm[16];
        read_perm(nd, perm);
        H c;
        const H& got = clw::ordered_perm(reg(r).h, perm, c);
        if (&got == &c) reg(r).h = std::move(c);
        break;
      }
      case POOL_KERNEL: {  // out kernel x ceil (k s p dl)*2 es fresh: the generated NHWC pool
        const int64_t o = A(), ki = A(), x = A(), ceil = A();
        const int64_t* w = P(8);
        const int64_t es = A(), fresh = A();
        // A slice along channels of a channels-last buffer is in order but not dense:
        // the kernel walks dense pixels.
        H tmp;
        const H& xv = clw::ordered(R(x), true, tmp);
        const int64_t* xs = clw::sizes(xv);
        int64_t od[2];
        for (int d = 0; d < 2; ++d) {
          const int64_t k = w[4 * d], st = w[4 * d + 1], p = w[4 * d + 2], dl = w[4 * d + 3];
          od[d] = (xs[2 + d] + 2 * p - dl * (k - 1) - 1 + (ceil ? st - 1 : 0)) / st + 1;
          if (ceil && (od[d] - 1) * st >= xs[2 + d] + p) od[d] -= 1;
        }
        const int64_t sz[] = {xs[0], xs[1], xs[2], xs[3], od[0], od[1]};
        const int64_t osz[] = {xs[0], xs[1], od[0], od[1]};
        H t = alloc(fresh, 4, osz, true, (int)es);
        void* const data[] = {clw::data(xv), clw::data(t)};
        p_.kernels[(size_t)ki](sz, data, nullptr);
        set(o, std::move(t));
        break;
      }
      case MAX_POOL: {  // out x k[2] s[2] p[2] dl[2] ceil msg
        const int64_t o = A(), x = A();
        const int64_t *k = P(2), *s = P(2), *p = P(2), *dl = P(2);
        const int64_t ceil = A();
        AtenTensorHandle t, idx;
        clw::shim(aoti_torch_cpu_max_pool2d_with_indices(R(x).get(), k, 2, s, 2, p, 2, dl, 2, (int32_t)ceil, &t, &idx),
                  S(A()).c_str());
        H drop(idx);
        set(o, H(t));
        break;
      }
      case AVG_POOL: {  // out x k[2] s[2] p[2] ceil include_pad has_div div msg
        const int64_t o = A(), x = A();
        const int64_t *k = P(2), *s = P(2), *p = P(2);
        const int64_t ceil = A(), incl = A(), has_div = A();
        int64_t div = A();
        AtenTensorHandle t;
        clw::shim(aoti_torch_cpu_avg_pool2d(R(x).get(), k, 2, s, 2, p, 2, (int32_t)ceil, (int32_t)incl,
                                            has_div ? &div : nullptr, &t),
                  S(A()).c_str());
        set(o, H(t));
        break;
      }
      case CAT: {  // out dim n parts[n] cl es fresh: clw::cat_into, the plan's layout
        const int64_t o = A(), dim = A(), np = A();
        const int64_t* pr = P(np);
        const int64_t cl = A(), es = A(), fresh = A();
        std::vector<const H*> parts((size_t)np);
        for (int64_t i = 0; i < np; ++i) parts[(size_t)i] = &R(pr[i]);
        const int nd = (int)clw::dim(*parts[0]);
        int64_t osz[16];
        clw::cat_sizes(parts.data(), (int)np, (int)dim, osz);
        H t = alloc(fresh, nd, osz, cl != 0, (int)es);
        clw::cat_into(t, parts.data(), (int)np, (int)dim, cl != 0);
        set(o, std::move(t));
        break;
      }
      case CAT_SHIM: {  // out dim n parts[n] msg
        const int64_t o = A(), dim = A(), np = A();
        const int64_t* pr = P(np);
        std::vector<AtenTensorHandle> parts((size_t)np);
        for (int64_t i = 0; i < np; ++i) parts[(size_t)i] = R(pr[i]).get();
        AtenTensorHandle t;
        clw::shim(aoti_torch_cpu_cat(parts.data(), np, dim, &t), S(A()).c_str());
        set(o, H(t));
        break;
      }
      case AS_STRIDED: {  // out x nd (size expr)*nd (stride expr)*nd offset(-1: the input's)
        const int64_t o = A(), x = A(), nd = A();
        if (nd > 16) fail("segment program: more than 16 dims");
        int64_t sz[16], st[16];
        for (int64_t i = 0; i < nd; ++i) sz[i] = expr();
        for (int64_t i = 0; i < nd; ++i) st[i] = expr();
        const int64_t off = A();
        set(o, clw::as_strided(R(x), (int)nd, sz, st, off));
        break;
      }
      case UPSAMPLE: {  // out x oh ow cl
        const int64_t o = A(), x = A(), oh = A(), ow = A(), cl = A();
        set(o, clw::upsample_nearest2d(R(x), oh, ow, cl != 0));
        break;
      }
      case INDEX: {  // out x n idx[n](-1: None) msg
        const int64_t o = A(), x = A(), ni = A();
        const int64_t* ir = P(ni);
        std::vector<AtenTensorHandle> hs((size_t)ni);
        std::vector<const AtenTensorHandle*> idx((size_t)ni);
        for (int64_t i = 0; i < ni; ++i) {
          hs[(size_t)i] = ir[i] >= 0 ? R(ir[i]).get() : nullptr;
          idx[(size_t)i] = ir[i] >= 0 ? &hs[(size_t)i] : nullptr;
        }
        AtenTensorHandle t;
        clw::shim(aoti_torch_cpu_index_Tensor(R(x).get(), idx.data(), ni, &t), S(A()).c_str());
        set(o, H(t));
        break;
      }
      case MM:      // out m1 m2 es fresh msg
      case BMM:     // out b1 b2 es fresh msg
      case ADDMM: {  // out bias m1 m2 beta_real alpha_real es fresh msg
        const int64_t o = A(), bias = op == ADDMM ? A() : -1, m1 = A(), m2 = A();
        const int64_t beta = op == ADDMM ? A() : -1, alpha = op == ADDMM ? A() : -1;
        const int64_t es = A(), fresh = A();
        // The operands are read in the strides they have: ATen's gemm takes a
        // transposed view (attention's K^T) as a transposed operand, not a copy.
        const int64_t* s1 = clw::sizes(R(m1));
        const int64_t* s2 = clw::sizes(R(m2));
        const int64_t osz[] = {s1[0], s1[op == BMM ? 1 : 0], s2[op == BMM ? 2 : 1]};
        H t = op == BMM ? alloc(fresh, 3, osz, false, (int)es) : alloc(fresh, 2, osz + 1, false, (int)es);
        const char* msg = S(A()).c_str();
        if (op == MM) clw::shim(aoti_torch_cpu_mm_out(t.get(), R(m1).get(), R(m2).get()), msg);
        else if (op == BMM) clw::shim(aoti_torch_cpu_bmm_out(t.get(), R(m1).get(), R(m2).get()), msg);
        else clw::shim(aoti_torch_cpu_addmm_out(t.get(), R(bias).get(), R(m1).get(), R(m2).get(),
                                                p_.reals[(size_t)beta], p_.reals[(size_t)alpha]), msg);
        set(o, std::move(t));
        break;
      }
      case ALIAS: {  // out x: a handle of x that a split's pieces view
        const int64_t o = A();
        const H& x = R(A());
        set(o, clw::alias(x, (int)clw::dim(x), clw::sizes(x), clw::strides(x)));
        break;
      }
      case SDPA: {  // out q k v mask(-1: none) is_causal scale_real(-1: none) msg
        const int64_t o = A(), q = A(), k = A(), v = A(), m = A(), causal = A(), sc = A();
        const char* msg = S(A()).c_str();
        AtenTensorHandle mh = m >= 0 ? R(m).get() : nullptr;
        double scale = sc >= 0 ? p_.reals[(size_t)sc] : 0.0;
        AtenTensorHandle out, lse;
        clw::shim(aoti_torch_cpu__scaled_dot_product_flash_attention_for_cpu(
                      R(q).get(), R(k).get(), R(v).get(), 0.0, (int32_t)causal, m >= 0 ? &mh : nullptr,
                      sc >= 0 ? &scale : nullptr, &out, &lse), msg);
        H keep(out), drop(lse);
        set(o, std::move(keep));
        break;
      }
      case EXPAND: {  // out x nd sizes[nd]
        const int64_t o = A(), x = A(), nd = A();
        if (nd > 16) fail("segment program: more than 16 dims");
        int64_t want[16];
        for (int64_t i = 0; i < nd; ++i) want[i] = A();
        set(o, clw::expand(R(x), (int)nd, want));
        break;
      }
      case SELECT: {  // out x dim index
        const int64_t o = A(), x = A(), d = A(), i = A();
        set(o, clw::select(R(x), (int)d, i));
        break;
      }
      case ROLL: {  // out x nd cl es fresh k dims[k] shifts[k]
        const int64_t o = A(), x = A(), nd = A(), cl = A(), es = A(), fresh = A(), k = A();
        if (k > 16) fail("segment program: roll over more than 16 dims");
        int64_t dims[16], shifts[16];
        for (int64_t j = 0; j < k; ++j) dims[j] = A();
        for (int64_t j = 0; j < k; ++j) shifts[j] = A();
        H t = alloc(fresh, (int)nd, clw::sizes(R(x)), cl != 0, (int)es);
        clw::roll_into(t, R(x), (int)k, dims, shifts);
        set(o, std::move(t));
        break;
      }
      case SLICE: {  // out x dim start end step
        const int64_t o = A(), x = A(), d = A(), s = A(), e = A(), st = A();
        if (st < 1) fail("segment program: slice step below 1");
        set(o, clw::slice(R(x), (int)d, s, e, st));
        break;
      }
      case CLONE: {  // out x nd cl es fresh
        const int64_t o = A(), x = A(), nd = A(), cl = A(), es = A(), fresh = A();
        H t = alloc(fresh, (int)nd, clw::sizes(R(x)), cl != 0, (int)es);
        clw::copy_into(t, R(x));
        set(o, std::move(t));
        break;
      }
      case SHUFFLE: {  // out x nd groups start end cl es fresh
        const int64_t o = A(), x = A(), nd = A(), g = A(), s = A(), e = A(), cl = A(), es = A(), fresh = A();
        int64_t osz[16];
        std::copy_n(clw::sizes(R(x)), nd, osz);
        osz[1] = e - s;
        H t = alloc(fresh, (int)nd, osz, cl != 0, (int)es);
        clw::channel_shuffle_into(t, R(x), g, s);
        set(o, std::move(t));
        break;
      }
      case CHECK: { const int64_t r = A(), cl = A(); clw::check_order(R(r), cl != 0, S(A()).c_str()); break; }
      case OUT: { const int64_t j = A(), r = A(); out[j] = (uintptr_t)reg(r).h.release(); break; }
      case OUT_EAGER: {  // j r nd perm[nd]: a graph output dense in eager's order, handed over with
        // torch's strides for that order on its size-1 dims too (they address nothing; a view
        // may have given them others). Python's restride would make that alias per call,
        // 30-40 us after a forward. Not dense in that order: as it is (restride converts it).
        const int64_t j = A(), r = A(), nd = A();
        int perm[16];
        read_perm(nd, perm);
        H& h = reg(r).h;
        const int64_t *sz = clw::sizes(h), *st = clw::strides(h);
        if (clw::dim(h) == nd && clw::dense_in_perm((int)nd, sz, st, perm)) {
          int64_t want[16];
          clw::perm_strides((int)nd, sz, perm, want);
          if (!std::equal(st, st + nd, want)) h = clw::alias(h, (int)nd, sz, want);
        }
        out[j] = (uintptr_t)h.release();
        break;
      }
      case QCONV: qconv(); break;
      case QMAX_POOL: qmax_pool(); break;
      case ATEN_CONV: {  // out x w b pad[2] stride[2] dil[2] groups attr n scalar_reals[n] alg msg
        const int64_t o = A(), x = A(), w = A(), b = A();
        const int64_t *pad = P(2), *st = P(2), *dl = P(2);
        const int64_t groups = A(), attr = A(), ns = A();
        const int64_t* sc = P(ns);
        const int64_t alg = A();
        const std::string& msg = S(A());
        if (ns > 4) fail(msg + ": more than 4 post-op scalars");
        double vals[4];
        const double* ptrs[4];
        for (int64_t i = 0; i < ns; ++i) { vals[i] = p_.reals[(size_t)sc[i]]; ptrs[i] = &vals[i]; }
        const H* xs = &R(x);
        H xc;  // a channel slice of NHWC: dense first, as the CONV instruction does
        if (!clw::dense_in(*xs, true)) { xc = clw::copy_in_order(*xs, true); xs = &xc; }
        AtenTensorHandle bias = b >= 0 ? R(b).get() : nullptr;
        const char* alg_s = alg >= 0 ? S(alg).c_str() : nullptr;
        AtenTensorHandle ret = nullptr;
        clw::shim(aoti_torch_cpu_mkldnn__convolution_pointwise(
                      xs->get(), R(w).get(), b >= 0 ? &bias : nullptr, pad, 2, st, 2, dl, 2, groups,
                      S(attr).c_str(), ptrs, ns, alg >= 0 ? &alg_s : nullptr, &ret), msg.c_str());
        H t(ret);
        if (!clw::dense_in(t, true)) fail(msg + ": torch's convolution returned a tensor that is not channels-last");
        set(o, std::move(t));
        break;
      }
      default: fail("segment program: unknown opcode " + std::to_string(op));
    }
    if (a_ != end) fail("segment program: instruction " + std::to_string(op) + " has the wrong operand count");
    if (prof) {  // op is known here: an unknown one failed above
      const int64_t dt = now_ns() - t0;
      g_op_ns[op].fetch_add(dt, std::memory_order_relaxed);
      p_.pc_ns[(size_t)pc0].fetch_add(dt, std::memory_order_relaxed);
      g_op_count[op].fetch_add(1, std::memory_order_relaxed);
    }
  }
}

}  // namespace clvm

extern "C" {

void* cl_program_new(const int64_t* code, int64_t ncode, const double* reals, int64_t nreals, const char* names,
                     int64_t names_len, const uintptr_t* kernels, int64_t nkernels, int64_t n_regs,
                     int64_t n_syms, int64_t n_in, int arena_layout, char* err, int errlen) {
  try {
    std::unique_ptr<clvm::Program> p(new clvm::Program);
    p->code.assign(code, code + ncode);
    p->reals.assign(reals, reals + nreals);
    for (int64_t i = 0, start = 0; i < names_len; ++i)
      if (names[i] == '\0') { p->names.emplace_back(names + start, names + i); start = i + 1; }
    for (int64_t i = 0; i < nkernels; ++i) p->kernels.push_back((clvm::kernel_fn)kernels[i]);
    p->n_regs = n_regs;
    p->n_syms = n_syms;
    p->n_in = n_in;
    if (arena_layout < 0 || arena_layout > 2) clw::fail("arena layout must be 0, 1 or 2");
    p->pool.layout = arena_layout;
    p->pc_ns.reset(new std::atomic<int64_t>[(size_t)std::max<int64_t>(ncode, 1)]());
    // Structure only (opcodes known, operands inside the program); each
    // instruction checks its own operand count when it runs.
    for (int64_t pc = 0; pc < ncode;) {
      if (pc + 2 > ncode || code[pc] <= 0 || code[pc] >= clvm::N_OPS || code[pc + 1] < 0 ||
          pc + 2 + code[pc + 1] > ncode)
        clw::fail("segment program is malformed at word " + std::to_string(pc));
      pc += 2 + code[pc + 1];
    }
    if (n_in > n_regs) clw::fail("segment program has more inputs than registers");
    return p.release();
  } catch (const std::exception& e) {
    clw::report(e, err, errlen);
    return nullptr;
  }
}

int cl_program_run(void* prog, const uintptr_t* in, const int64_t* consts, const int64_t* scalars, uintptr_t* out,
                   char* err, int errlen) {
  clvm::Program& p = *(clvm::Program*)prog;
  const bool prof = clvm::g_profile.load(std::memory_order_relaxed) != 0;
  const int64_t t0 = prof ? clvm::now_ns() : 0;
  try {
    clw::PoolLease lease(p.pool);
    clvm::Run run(p, consts, scalars, lease.get());
    run.take_inputs(in);
    run.run(out);
  } catch (const std::exception& e) {
    return clw::report(e, err, errlen);
  }
  if (prof) {  // the whole call, registers' release included
    clvm::g_op_ns[clvm::N_OPS].fetch_add(clvm::now_ns() - t0, std::memory_order_relaxed);
    clvm::g_op_count[clvm::N_OPS].fetch_add(1, std::memory_order_relaxed);
  }
  return 0;
}

void cl_profile(int on) { clvm::g_profile.store(on ? 1 : 0); }

long long cl_arena_takes(void) { return clw::g_arena_takes.load(); }
void cl_arena_enable(int on) { clw::g_arena_on.store(on ? 1 : 0); }

// Copies the counters into ns[]/count[] (opcode i at index i; index 0: whole
// runs) and zeroes them; returns how many slots there are.
int64_t cl_profile_take(int64_t* ns, int64_t* count, int64_t n) {
  const int64_t slots = clvm::N_OPS;
  for (int64_t i = 0; i < slots && i < n; ++i) {
    const int64_t src = i == 0 ? clvm::N_OPS : i;
    ns[i] = clvm::g_op_ns[src].exchange(0);
    count[i] = clvm::g_op_count[src].exchange(0);
  }
  return slots;
}

// Copies one program's time per instruction word (ns[pc]; 0 except at an
// instruction's first word) into ns[0..n) and zeroes it.
void cl_program_take_profile(void* prog, int64_t* ns, int64_t n) {
  clvm::Program& p = *(clvm::Program*)prog;
  for (int64_t i = 0; i < n && i < (int64_t)p.code.size(); ++i) ns[i] = p.pc_ns[(size_t)i].exchange(0);
}

void cl_program_free(void* prog) { delete (clvm::Program*)prog; }

// What the program's pool holds between calls: out[0] arena bytes, out[1] blocks kept
// for the next call, out[2] the largest set of arena buffers live at once. Zeros while
// a call has the pool leased.
void cl_program_held(void* prog, int64_t* out) {
  clvm::Program& p = *(clvm::Program*)prog;
  out[0] = out[1] = out[2] = 0;
  clw::Pool* pool = p.pool.p.exchange(nullptr);
  if (!pool) return;
  const clw::Pool::Held h = pool->held();
  out[0] = h.arena;
  out[1] = h.blocks;
  out[2] = h.live_peak;
  delete p.pool.p.exchange(pool);  // a call that started meanwhile made its own: keep one
}

// Frees the program's pool (arena and blocks); the next call lays one out again.
void cl_program_release(void* prog) {
  clvm::Program& p = *(clvm::Program*)prog;
  delete p.pool.p.exchange(nullptr);
}

}  // extern "C"
