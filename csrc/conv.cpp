// Forward convolution on oneDNN, owned by cpu_layout.
//
// Why not torch's mkldnn ops: torch hides its oneDNN copy (no dnnl_* symbols
// exported), and its prepacked path pays per-call overhead we can avoid by
// caching primitives and reordered weights ourselves.

#include <oneapi/dnnl/dnnl.hpp>
#include <oneapi/dnnl/dnnl_version.h>

// torch/include ships newer oneDNN headers; make sure the build used the 3.2
// headers that match the library we link and load.
static_assert(DNNL_VERSION_MAJOR == 3 && DNNL_VERSION_MINOR == 2,
              "cpu_layout must be compiled against oneDNN 3.2 headers");

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <omp.h>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

extern "C" {
#include "cl_api.h"
}
#include "bf16.h"
#include "cl_dnnl.h"
#include "winograd.h"

namespace cldnn {

dnnl::engine &cpu_engine() {
    static dnnl::engine eng(dnnl::engine::kind::cpu, 0);
    return eng;
}

// One stream per calling thread: streams are cheap, and sharing one across
// threads would serialise independent Python threads.
dnnl::stream &thread_stream() {
    thread_local dnnl::stream s(cpu_engine());
    return s;
}

}  // namespace cldnn

namespace {

using dnnl::memory;
using tag = dnnl::memory::format_tag;
using dt = dnnl::memory::data_type;

using cldnn::cpu_engine;
using cldnn::thread_stream;

// Bytes rounded up to a whole number of 64-byte lines: where temporaries packed
// into one buffer start, so that each is aligned for vector loads.
size_t align64(size_t n) { return (n + 63) & ~size_t(63); }

// Bytes all threads' ThreadBuffers hold (cl_thread_buffer_bytes reports them).
std::atomic<long long> g_thread_buffer_bytes{0};

// Grow-only per-thread buffer for scratchpads and bf16-emulation temporaries,
// so the steady state allocates nothing per call (cl_release_thread_buffers frees it).
struct ThreadBuffer {
    std::unique_ptr<uint8_t[]> data;
    size_t size = 0;
    ~ThreadBuffer() { release(); }
    void release() {
        g_thread_buffer_bytes -= static_cast<long long>(size);
        data.reset();
        size = 0;
    }
    uint8_t *get(size_t n) {
        if (n > size) {
            release();
            data.reset(new uint8_t[n + 64]);
            size = n + 64;
            g_thread_buffer_bytes += static_cast<long long>(size);
        }
        // 64-byte alignment for vector loads.
        uintptr_t p = reinterpret_cast<uintptr_t>(data.get());
        return reinterpret_cast<uint8_t *>((p + 63) & ~uintptr_t(63));
    }
};
thread_local ThreadBuffer t_scratch;
thread_local ThreadBuffer t_temps;
thread_local ThreadBuffer t_mid;

struct Stats {
    std::atomic<long long> primitives_created{0}, primitive_cache_hits{0}, weight_reorders{0},
        converted_calls{0}, calls{0}, ref_primitives{0};
} g_stats;

bool native_bf16() {
    static const bool v = dnnl::get_effective_cpu_isa() >= dnnl::cpu_isa::avx512_core;
    return v;
}

dt to_dt(int d) {
    if (d == CL_F32) return dt::f32;
    if (d == CL_BF16) return dt::bf16;
    throw std::invalid_argument("unsupported dtype code " + std::to_string(d));
}

size_t dt_size(dt d) { return d == dt::f32 ? 4 : 2; }

using cldnn::act_tag;
using cldnn::wei_tag;

// The primitive-cache key: the problem without pointers or weight identity,
// normalised so unused fields and padding bytes are zero.
using Key = cldnn::Key<cl_conv_args>;

Key make_key(const cl_conv_args &in) {
    Key k;
    std::memset(&k.a, 0, sizeof(k.a));
    cl_conv_args &a = k.a;
    a.dtype = in.dtype;
    a.has_bias = in.has_bias ? 1 : 0;
    a.bias_dtype = in.has_bias ? in.bias_dtype : 0;
    a.src_cl = in.src_cl ? 1 : 0;
    a.dst_cl = in.dst_cl ? 1 : 0;
    a.w_cl = in.w_cl;  // 0, 1 or 2 (validated)
    a.impl_rank = in.impl_rank;
    cldnn::copy_geometry(a, in);
    // With every spatial size 1 (squeeze-excitation and classifier convs), NCHW
    // and NHWC address memory identically; NHWC runs oneDNN's brgemm 1x1
    // kernel, NCHW its GEMM, which in a forward (weights coming from memory)
    // took 1.7x as long on the same weights (mobilenet_v3, EPYC Zen 4).
    bool unit = true;
    for (int i = 0; i < a.nsp; ++i) unit = unit && a.in_sp[i] == 1 && a.out_sp[i] == 1;
    if (unit) a.src_cl = a.dst_cl = 1;
    return k;
}

void validate(const cl_conv_args &a) {
    auto fail = [](const std::string &m) { throw std::invalid_argument(m); };
    cldnn::validate_geometry(a, "");
    if (a.dtype != CL_F32 && a.dtype != CL_BF16) fail("dtype must be float32 or bfloat16");
    if (a.has_bias && a.bias_dtype != CL_F32 && a.bias_dtype != CL_BF16)
        fail("bias dtype must be float32 or bfloat16");
    if (a.impl_rank == CL_IMPL_WINOGRAD) {
        const std::string why = clwino::unsupported(a);
        if (!why.empty()) fail(why);
        // Without bf16 instructions oneDNN's bf16 matmul is emulated: no faster than the conv.
        if (a.dtype == CL_BF16 && !native_bf16()) fail("Winograd runs bfloat16 only on CPUs with native bf16");
    } else if (a.impl_rank > CL_IMPL_MERGE_GROUPS) {
        const long long m = a.impl_rank - CL_IMPL_MERGE_GROUPS;
        if ((m != 2 && m != 4 && m != 8 && m != 16) || a.groups % m)
            fail("CL_IMPL_MERGE_GROUPS + m needs m in 2, 4, 8, 16 dividing groups");
    } else if (a.impl_rank < 0 || a.impl_rank > 8) {
        fail("impl_rank must be 0..8, CL_IMPL_WINOGRAD or CL_IMPL_MERGE_GROUPS + m");
    }
    for (int i = 0; i < a.n_post_ops; ++i) {
        int k = a.post_ops[i].kind;
        if (k < CL_PO_RELU || k > CL_PO_ADD) fail("unknown post-op kind " + std::to_string(k));
    }
    if (a.w_cl < 0 || a.w_cl > 2) fail("w_cl must be 0, 1 or 2");
    if (a.w_cl == 2) {
        bool unit = a.groups == 1 && (a.impl_rank >= 0 && a.impl_rank <= 8);
        for (int i = 0; i < a.nsp; ++i) unit = unit && a.k_sp[i] == 1;
        if (!unit) fail("a transposed weight (w_cl 2) is for 1x1 convs without groups on oneDNN's kernels");
    }
}

// ---- dtype casts: our own loops (bf16.h) ------------------------------------
// oneDNN converts formats with fast JIT reorders, but on CPUs without bf16
// instructions (AVX2) it converts bf16<->f32 with a generic scalar kernel
// (~100 ns per element). These loops vectorise with plain SSE2/AVX2 integer ops.

constexpr size_t kParallelCast = 1 << 15;

void cast_bf16_to_f32(const uint16_t *in, float *out, size_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelCast)
    for (size_t i = 0; i < n; ++i) out[i] = clbf16::to_f32(in[i]);
}

void cast_f32_to_bf16(const float *in, uint16_t *out, size_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelCast)
    for (size_t i = 0; i < n; ++i) out[i] = clbf16::from_f32(in[i]);
}

// Moves a tensor between the caller's memory (dense, plain format) and the
// memory a primitive computes on: a dtype cast (ours, in the caller's format)
// and/or a format reorder (oneDNN's, in the primitive's dtype).
struct Edge {
    bool active = false, cast = false, reorder = false, to_user = false;
    memory::desc from_md, to_md, mid_md;
    dnnl::reorder prim;
    size_t mid_bytes = 0;

    void init(const memory::desc &from, const memory::desc &to, bool towards_user) {
        from_md = from;
        to_md = to;
        to_user = towards_user;
        active = !(from == to);
        if (!active) return;
        cast = from.get_data_type() != to.get_data_type();
        // The cast happens on the caller's side, in the caller's format.
        const memory::desc &user = towards_user ? to : from;
        const memory::desc &prim_side = towards_user ? from : to;
        mid_md = cast ? memory::desc(user.get_dims(), prim_side.get_data_type(), user.get_strides())
                      : user;
        reorder = !(mid_md == prim_side);
        if (reorder)
            prim = towards_user ? make_reorder_pd(from, mid_md) : make_reorder_pd(mid_md, to);
        if (cast && reorder) mid_bytes = mid_md.get_size();
    }

    static dnnl::reorder make_reorder_pd(const memory::desc &a, const memory::desc &b) {
        return dnnl::reorder(dnnl::reorder::primitive_desc(cpu_engine(), a, cpu_engine(), b));
    }

    void do_cast(const void *src, void *dst, dt src_dt) const {
        size_t n = static_cast<size_t>(mid_md.get_size() / (mid_md.get_data_type() == dt::f32 ? 4 : 2));
        if (src_dt == dt::bf16)
            cast_bf16_to_f32(static_cast<const uint16_t *>(src), static_cast<float *>(dst), n);
        else
            cast_f32_to_bf16(static_cast<const float *>(src), static_cast<uint16_t *>(dst), n);
    }

    // `mid`: scratch of mid_bytes; reorders run synchronously on CPU streams.
    void run(dnnl::stream &s, const void *from, void *to, void *mid) const {
        dnnl::engine &eng = cpu_engine();
        if (!to_user) {
            const void *cur = from;
            if (cast) {
                void *dst = reorder ? mid : to;
                do_cast(from, dst, from_md.get_data_type());
                cur = dst;
            }
            if (reorder) {
                memory a(mid_md, eng, const_cast<void *>(cur)), b(to_md, eng, to);
                prim.execute(s, a, b);
                s.wait();
            }
        } else {
            const void *cur = from;
            if (reorder) {
                void *dst = cast ? mid : to;
                memory a(from_md, eng, const_cast<void *>(from)), b(mid_md, eng, dst);
                prim.execute(s, a, b);
                s.wait();
                cur = dst;
            }
            if (cast) do_cast(cur, to, from_md.get_data_type());
        }
    }
};

struct ConvEntry {
    dnnl::convolution_forward prim;
    memory::desc src_md, wei_md, bias_md, dst_md;  // what the primitive computes on
    memory::desc scratch_md;
    memory::desc user_wei_md;               // torch's weight layout and dtype
    memory::desc user_src_md, user_dst_md;  // the caller's tensors (residuals share dst's)
    // Set when the primitive's src/dst differ from the caller's in dtype
    // (bf16 computed in f32) or format (no fast kernel for mixed layouts).
    Edge src_in, dst_out, res_in;  // .active: a conversion is needed on that side
    bool bias_to_f32 = false;
    int sum_slot = -1;           // the residual add done as a sum post-op into dst
    std::vector<int> add_slots;  // post-op indices of the other residual adds (binary)
    size_t scratch_bytes = 0;
    std::string impl;
    // Winograd (impl_rank CL_IMPL_WINOGRAD): prim is unused; the 16 products run on
    // `products`, a block of tiles at a time (clwino::block_tiles), over transformed
    // inputs [16][block][ic] (wino_in_md) and weights [16][ic][oc] (wei_md, made by
    // clwino::transform_weight), into [16][block][oc].
    bool wino = false;
    bool wino_w_cl = false;
    // Groups merged (impl_rank CL_IMPL_MERGE_GROUPS + merge): the primitive is the merged
    // problem's; the user's weight is spread block-diagonally into a zeroed plain weight
    // of merged_wei_md, which is reordered to wei_md. user_wei_md stays the user's.
    int merge = 1;
    bool merge_w_cl = false;
    memory::desc merged_wei_md;
    dnnl::matmul products;
    memory::desc wino_in_md, wino_out_md;
    // The memory objects one execution binds (cldnn::IdleSets: made once, re-pointed per call).
    struct Bound {
        memory src, dst, scratch, bias;
        std::vector<memory> adds;  // one per add_slots entry
    };
    cldnn::IdleSets<Bound> bound;
};

std::unique_ptr<ConvEntry::Bound> make_bound(const ConvEntry &e) {
    const dnnl::engine &eng = cpu_engine();
    auto b = std::make_unique<ConvEntry::Bound>();
    b->src = memory(e.src_md, eng, DNNL_MEMORY_NONE);
    b->dst = memory(e.dst_md, eng, DNNL_MEMORY_NONE);
    b->scratch = memory(e.scratch_md, eng, DNNL_MEMORY_NONE);
    if (!e.bias_md.is_zero()) b->bias = memory(e.bias_md, eng, DNNL_MEMORY_NONE);
    for (size_t r = 0; r < e.add_slots.size(); ++r) b->adds.push_back(memory(e.dst_md, eng, DNNL_MEMORY_NONE));
    return b;
}

using cldnn::eltwise_alg;

bool is_ref(const char *impl) { return std::strstr(impl, "ref") != nullptr; }

// A kernel we accept without trying other formats first. oneDNN's
// im2col+GEMM convolution applies post-ops in a slow separate pass (relu:
// 6x, gelu: 40x the conv's own time on AVX2), so with post-ops it counts as
// a last resort like a reference kernel.
bool acceptable(const char *impl, const cl_conv_args &a) {
    if (is_ref(impl)) return false;
    return !(a.n_post_ops > 0 && std::strstr(impl, "gemm") != nullptr);
}

// oneDNN 3.2's AMX bf16 brgconv gives wrong values when the kernel tiles the
// input without overlap (stride == kernel > 1: ConvNeXt's 2x2/s2 downsampling,
// 4x4/s4 stems) and the input channels per group are not a multiple of 32
// (tests/test_conv.py holds the shapes found). The next implementation is taken.
bool known_wrong(const char *impl, const cl_conv_args &a, dt compute) {
    if (compute != dt::bf16 || std::strstr(impl, "avx512_core_amx") == nullptr ||
        std::strstr(impl, "brg") == nullptr)
        return false;
    bool tiles = true;
    for (int i = 0; i < a.nsp; ++i) tiles = tiles && a.k_sp[i] > 1 && a.stride[i] == a.k_sp[i];
    return tiles && (a.ic / a.groups) % 32 != 0;
}

// Activation formats a primitive can be asked for.
enum Fmt { FMT_CF = 0, FMT_CL = 1, FMT_BLOCKED = 2 };

memory::desc act_md(const memory::dims &dims, dt d, int nsp, Fmt f) {
    if (f == FMT_BLOCKED) return memory::desc(dims, d, tag::any);
    return memory::desc(dims, d, act_tag(nsp, f == FMT_CL));
}

// Build the primitive descriptor computing in `compute` with the given
// activation formats; empty when oneDNN has nothing for it, or only kernels
// `acceptable` rejects and `reject_ref` is set.
dnnl::convolution_forward::primitive_desc make_pd(const cl_conv_args &a, dt compute, Fmt src_fmt,
                                                  Fmt dst_fmt, bool reject_ref, int sum_slot) {
    const int nsp = a.nsp;
    const cldnn::ConvDims cd = cldnn::conv_dims(a);
    const memory::dims &src_dims = cd.src, &dst_dims = cd.dst, &wei_dims = cd.wei, &strides = cd.strides,
                       &dil = cd.dil, &pl = cd.pad_l, &pr = cd.pad_r;
    memory::desc src_md = act_md(src_dims, compute, nsp, src_fmt);
    memory::desc dst_md = act_md(dst_dims, compute, nsp, dst_fmt);
    memory::desc wei_md(wei_dims, compute, tag::any);
    memory::desc bias_md;
    if (a.has_bias) {
        dt bdt = compute == dt::f32 ? dt::f32 : to_dt(a.bias_dtype);
        bias_md = memory::desc({a.oc}, bdt, tag::a);
    }

    dnnl::post_ops ops;
    for (int i = 0; i < a.n_post_ops; ++i) {
        const cl_post_op &po = a.post_ops[i];
        if (i == sum_slot) {
            ops.append_sum(1.f);
        } else if (po.kind == CL_PO_ADD) {
            ops.append_binary(dnnl::algorithm::binary_add, dst_md);
        } else {
            float alpha = po.alpha, beta = po.beta;
            dnnl::algorithm alg = eltwise_alg(po.kind, alpha, beta);
            ops.append_eltwise(alg, alpha, beta);
        }
    }
    dnnl::primitive_attr attr;
    attr.set_post_ops(ops);
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);

    // allow_empty: an unsupported combination yields an empty pd, not a throw.
    dnnl::convolution_forward::primitive_desc pd;
    if (a.has_bias)
        pd = dnnl::convolution_forward::primitive_desc(
            cpu_engine(), dnnl::prop_kind::forward_inference, dnnl::algorithm::convolution_direct,
            src_md, wei_md, bias_md, dst_md, strides, dil, pl, pr, attr, true);
    else
        pd = dnnl::convolution_forward::primitive_desc(
            cpu_engine(), dnnl::prop_kind::forward_inference, dnnl::algorithm::convolution_direct,
            src_md, wei_md, dst_md, strides, dil, pl, pr, attr, true);
    if (!pd) return pd;
    // Implementations come best first; skip known-wrong ones always and
    // unacceptable ones when asked. oneDNN's order is a heuristic: for some
    // shapes a later one is faster (NHWC depthwise: jit_dw against brdgmm_dw,
    // either way round by up to 1.6x), so the caller may ask for the rank-th
    // acceptable one after the first. Ranks count distinct names: once a
    // primitive of the problem is in oneDNN's cache, the iteration yields that
    // implementation twice.
    int skip = reject_ref ? a.impl_rank : 0;
    std::vector<std::string> seen;
    for (;;) {
        const char *name = pd.impl_info_str();
        if (!known_wrong(name, a, compute) && (!reject_ref || acceptable(name, a)) &&
            std::find(seen.begin(), seen.end(), name) == seen.end()) {
            if (skip-- == 0) return pd;
            seen.emplace_back(name);
        }
        if (!pd.next_impl()) break;
    }
    if (reject_ref && a.impl_rank > 0) {  // fewer implementations than asked: the first
        cl_conv_args first = a;
        first.impl_rank = 0;
        return make_pd(first, compute, src_fmt, dst_fmt, reject_ref, sum_slot);
    }
    return dnnl::convolution_forward::primitive_desc();
}

std::shared_ptr<ConvEntry> build_winograd(const cl_conv_args &a) {
    const long long t = clwino::block_tiles(a.n, a.out_sp[0], a.out_sp[1], a.ic, a.oc);
    auto e = std::make_shared<ConvEntry>();
    e->wino = true;
    e->wino_w_cl = a.w_cl != 0;
    const dt data_dt = to_dt(a.dtype);  // the products' inputs; they accumulate and write in f32
    e->wino_in_md = memory::desc({16, t, a.ic}, data_dt, tag::abc);
    e->wei_md = memory::desc({16, a.ic, a.oc}, data_dt, tag::abc);
    e->wino_out_md = memory::desc({16, t, a.oc}, dt::f32, tag::abc);
    e->user_wei_md = memory::desc({a.oc, a.ic, 3, 3}, data_dt, a.w_cl ? tag::ohwi : tag::oihw);
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    dnnl::matmul::primitive_desc pd(cpu_engine(), e->wino_in_md, e->wei_md, e->wino_out_md, attr);
    e->products = dnnl::matmul(pd);
    e->scratch_md = pd.scratchpad_desc();
    e->scratch_bytes = e->scratch_md.get_size();
    e->impl = std::string("cpu_layout winograd F(2x2,3x3), products on matmul ") + pd.impl_info_str();
    return e;
}

std::shared_ptr<ConvEntry> build_entry(const cl_conv_args &a);

// oneDNN 3.2 has AMX kernels only for groups of 16 input channels or more: ResNeXt's
// 4 and 8 (bf16, Sapphire Rapids, batch 1) ran on jit_bf16 in 1.09 and 0.51 ms, merged
// into groups of 32 channels on brgconv AMX in 0.17 and 0.08 ms despite m times the MACs.
std::shared_ptr<ConvEntry> build_merged(const cl_conv_args &a) {
    const int m = a.impl_rank - CL_IMPL_MERGE_GROUPS;
    cl_conv_args b = a;
    b.groups = a.groups / m;
    b.impl_rank = 0;
    auto e = build_entry(b);
    e->merge = m;
    e->merge_w_cl = a.w_cl != 0;
    memory::dims dims{a.groups, a.oc / a.groups, a.ic / a.groups};
    for (int i = 0; i < a.nsp; ++i) dims.push_back(a.k_sp[i]);
    e->merged_wei_md = e->user_wei_md;
    e->user_wei_md = memory::desc(dims, to_dt(a.dtype), wei_tag(a.nsp, true, a.w_cl));
    e->impl += " (groups merged " + std::to_string(m) + " at a time)";
    return e;
}

// The user's grouped weight [oc][icg][k] (w_cl: [oc][k][icg]; user_wei_md's dims are
// [groups][ocg][icg][k...]) as the merged problem's plain weight [oc][icg * m][k] (or
// [oc][k][icg * m]): output channel o of group g reads input slot g % m of its merged
// group; every other slot is zero.
template <class T>
void spread_block_diagonal(const T *w, T *out, const ConvEntry &e) {
    const memory::dims d = e.user_wei_md.get_dims();
    const long long m = e.merge, ocg = d[1], icg = d[2], oc = d[0] * ocg, wide = icg * m;
    const long long K = std::accumulate(d.begin() + 3, d.end(), 1LL, std::multiplies<long long>());
    std::memset(out, 0, sizeof(T) * oc * wide * K);
    for (long long o = 0; o < oc; ++o) {
        const long long slot = (o / ocg) % m;
        for (long long k = 0; k < K; ++k)
            for (long long i = 0; i < icg; ++i) {
                if (e.merge_w_cl) out[(o * K + k) * wide + slot * icg + i] = w[(o * K + k) * icg + i];
                else out[(o * wide + slot * icg + i) * K + k] = w[(o * icg + i) * K + k];
            }
    }
}

std::shared_ptr<ConvEntry> build_entry(const cl_conv_args &a) {
    if (a.impl_rank == CL_IMPL_WINOGRAD) return build_winograd(a);
    if (a.impl_rank > CL_IMPL_MERGE_GROUPS) return build_merged(a);
    const dt data_dt = to_dt(a.dtype);
    const bool scl = a.src_cl, dcl = a.dst_cl;

    // Candidates, best first: the caller's dtype and formats; then one
    // format for both sides (mixed NCHW/NHWC has only reference kernels);
    // then f32 compute for bf16 data on CPUs without fast bf16 kernels,
    // which accumulates in f32 like eager does. A reference kernel is the
    // last resort and shows in the implementation name.
    struct Choice {
        dt compute;
        Fmt src, dst;
    };
    std::vector<Choice> choices;
    std::vector<dt> computes;
    if (data_dt == dt::f32 || native_bf16()) computes.push_back(data_dt);
    if (data_dt != dt::f32) computes.push_back(dt::f32);
    const Fmt us = scl ? FMT_CL : FMT_CF, ud = dcl ? FMT_CL : FMT_CF;
    // Plain NCHW gets only im2col+GEMM kernels, which lose badly on spatial
    // and depthwise convs; oneDNN's blocked format (nChw8c/16c) has direct
    // kernels, worth a reorder at each edge. A 1x1 stride-1 conv is a plain
    // GEMM in NCHW, so it stays. Residual adds keep plain formats (the
    // binary post-op needs a concrete layout), via NHWC.
    bool pointwise = a.groups == 1;
    for (int i = 0; i < a.nsp; ++i) pointwise = pointwise && a.k_sp[i] == 1 && a.stride[i] == 1;
    const bool has_add = std::any_of(a.post_ops, a.post_ops + a.n_post_ops,
                                     [](const cl_post_op &p) { return p.kind == CL_PO_ADD; });
    for (dt c : computes) {
        std::vector<Choice> cs;
        if (!scl && !dcl && !pointwise)
            cs.push_back(has_add ? Choice{c, FMT_CL, FMT_CL} : Choice{c, FMT_BLOCKED, FMT_BLOCKED});
        cs.push_back({c, us, ud});
        cs.push_back({c, ud, ud});
        cs.push_back({c, us, us});
        // Last resorts before a reference kernel: some post-op combinations
        // have fast kernels only in NHWC or blocked formats.
        cs.push_back({c, FMT_CL, FMT_CL});
        if (!has_add) cs.push_back({c, FMT_BLOCKED, FMT_BLOCKED});
        for (const Choice &ch : cs) {
            bool dup = std::any_of(choices.begin(), choices.end(), [&](const Choice &o) {
                return o.compute == ch.compute && o.src == ch.src && o.dst == ch.dst;
            });
            if (!dup) choices.push_back(ch);
        }
    }
    // The first residual add as oneDNN's sum post-op: the residual is copied
    // into dst (or already is dst: the C++ wrapper hands a dying residual's
    // storage as the output) and accumulated in place. A binary add post-op
    // reads a third tensor in the kernel's inner loop: on AVX-512 it made
    // resnet50's 1x1 convs with residuals 15-30% slower, bf16 ones 2x.
    int sum_slot = -1;
    for (int i = 0; i < a.n_post_ops && sum_slot < 0; ++i)
        if (a.post_ops[i].kind == CL_PO_ADD) sum_slot = i;
    dnnl::convolution_forward::primitive_desc pd;
    Choice chosen{};
    auto first_fit = [&](int slot) {  // the first acceptable kernel with the residual as `slot`
        for (const Choice &c : choices) {
            pd = make_pd(a, c.compute, c.src, c.dst, true, slot);
            if (pd) {
                chosen = c;
                return true;
            }
        }
        return false;
    };
    if (sum_slot < 0 || !first_fit(sum_slot)) {
        sum_slot = -1;
        first_fit(-1);
    }
    if (!pd) {
        chosen = choices.front();
        sum_slot = -1;
        pd = make_pd(a, chosen.compute, chosen.src, chosen.dst, false, -1);
    }
    if (!pd) throw std::runtime_error("oneDNN has no convolution implementation for this problem");

    auto e = std::make_shared<ConvEntry>();
    e->prim = dnnl::convolution_forward(pd);
    e->src_md = pd.src_desc();
    e->wei_md = pd.weights_desc();
    e->dst_md = pd.dst_desc();
    if (a.has_bias) e->bias_md = pd.bias_desc();
    e->scratch_md = pd.scratchpad_desc();
    e->scratch_bytes = e->scratch_md.get_size();
    e->impl = pd.impl_info_str();
    if (is_ref(e->impl.c_str())) g_stats.ref_primitives++;
    e->sum_slot = sum_slot;
    for (int i = 0; i < a.n_post_ops; ++i)
        if (a.post_ops[i].kind == CL_PO_ADD && i != sum_slot) e->add_slots.push_back(i);

    e->user_wei_md = a.w_cl == 2 ? cldnn::transposed_wei_md(cldnn::conv_dims(a).wei, data_dt)
                                 : memory::desc(cldnn::conv_dims(a).wei, data_dt, wei_tag(a.nsp, a.groups > 1, a.w_cl));
    e->user_src_md = memory::desc(e->src_md.get_dims(), data_dt, act_tag(a.nsp, scl));
    e->user_dst_md = memory::desc(e->dst_md.get_dims(), data_dt, act_tag(a.nsp, dcl));
    e->src_in.init(e->user_src_md, e->src_md, false);
    e->dst_out.init(e->dst_md, e->user_dst_md, true);
    if (e->dst_out.active && (!e->add_slots.empty() || sum_slot >= 0))
        e->res_in.init(e->user_dst_md, e->dst_md, false);
    e->bias_to_f32 = a.has_bias && chosen.compute == dt::f32 && a.bias_dtype == CL_BF16;
    if (chosen.compute != data_dt) e->impl += " (bf16 data, f32 compute)";
    if (chosen.src != us || chosen.dst != ud) e->impl += " (layout converted)";
    return e;
}

// ---- primitive cache: LRU over problem keys --------------------------------

cldnn::LruCache<cl_conv_args, ConvEntry> &prim_cache() {
    static cldnn::LruCache<cl_conv_args, ConvEntry> c;
    return c;
}

std::shared_ptr<ConvEntry> get_entry(const cl_conv_args &a) {
    const Key k = make_key(a);
    bool hit = false;
    auto e = prim_cache().get(k, [&] { return build_entry(k.a); }, &hit);
    (hit ? g_stats.primitive_cache_hits : g_stats.primitives_created)++;
    return e;
}

// The user's weight (in `src_dt`) in the primitive's dtype and the user's format,
// output channel o multiplied by scale[o] when a scale is given (a batch-norm folded
// in): a temporary the packing reads, so no folded or cast copy is kept beside the
// packed one. Rounded as runtime.fold_batch_norm and a cast to bf16 round: the float
// product, then to nearest even.
std::unique_ptr<uint8_t[]> converted_copy(const memory::desc &user_md, long long oc, bool oc_inner,
                                          const void *user_ptr, int src_dt, const float *scale) {
    const size_t bytes = user_md.get_size();
    const bool bf_out = user_md.get_data_type() == dt::bf16, bf_in = src_dt == CL_BF16;
    const size_t n = bytes / (bf_out ? 2 : 4);
    if (oc <= 0 || n % static_cast<size_t>(oc) != 0)
        throw std::invalid_argument("weight scale: the weight does not split into its output channels");
    // Output channels are outermost in every user format but the transposed 1x1
    // one (w_cl 2: [ic][oc]), where they are innermost.
    const size_t per = n / static_cast<size_t>(oc), noc = static_cast<size_t>(oc);
    std::unique_ptr<uint8_t[]> out(new uint8_t[bytes]);
    for (size_t j = 0; j < n; ++j) {
        const float w = bf_in ? clbf16::to_f32(static_cast<const uint16_t *>(user_ptr)[j])
                              : static_cast<const float *>(user_ptr)[j];
        const float v = scale ? w * scale[oc_inner ? j % noc : j / per] : w;
        if (bf_out) reinterpret_cast<uint16_t *>(out.get())[j] = clbf16::from_f32(v);
        else reinterpret_cast<float *>(out.get())[j] = v;
    }
    return out;
}

// The user's weight packed into what the primitive computes on (Winograd's transform,
// merged groups' block-diagonal spread, or oneDNN's reorder).
void pack_weight(const ConvEntry &e, const void *user_ptr, memory &packed) {
    if (e.wino) {
        const memory::dims d = e.wei_md.get_dims();  // [16][ic][oc]
        clwino::transform_weight(user_ptr, e.wei_md.get_data_type() == dt::bf16 ? CL_BF16 : CL_F32,
                                 e.wino_w_cl, d[1], d[2], packed.get_data_handle());
        return;
    }
    dnnl::stream &s = thread_stream();
    if (e.merge > 1) {
        memory wide(e.merged_wei_md, cpu_engine());
        if (e.merged_wei_md.get_data_type() == dt::bf16)
            spread_block_diagonal(static_cast<const uint16_t *>(user_ptr),
                                  static_cast<uint16_t *>(wide.get_data_handle()), e);
        else
            spread_block_diagonal(static_cast<const float *>(user_ptr),
                                  static_cast<float *>(wide.get_data_handle()), e);
        dnnl::reorder(wide, packed).execute(s, wide, packed);
    } else {
        memory user(e.user_wei_md, cpu_engine(), const_cast<void *>(user_ptr));
        dnnl::reorder(user, packed).execute(s, user, packed);
    }
    s.wait();
}

// ---- weight cache: one packed copy per (weight, target format) -------------
// Every packed weight of the extension lives here (float convs and int8 convs
// alike, see cldnn::packed_weight), keyed by the source's identity.

class WeightCache {
   public:
    // scale_id: the per-output-channel scale packed in (a folded batch-norm), 0 for none.
    // A slot packed with another scale is replaced: the scale changed.
    memory get(unsigned long long id, long long version, const void *user_ptr, const memory::desc &wei_md,
               const memory::desc &user_md, unsigned long long scale_id,
               const std::function<void(memory &)> &pack) {
        {
            std::lock_guard<std::mutex> g(mu_);
            Record &r = records_[id];
            if (r.version != version || r.ptr != user_ptr) {
                // Changed in place, or storage replaced: every copy is stale.
                r.slots.clear();
                r.version = version;
                r.ptr = user_ptr;
            }
            for (auto &s : r.slots)
                if (s.md == wei_md && s.user_md == user_md && s.scale_id == scale_id) return s.mem;
        }
        memory packed(wei_md, cpu_engine());
        pack(packed);
        g_stats.weight_reorders++;
        std::lock_guard<std::mutex> g(mu_);
        Record &r = records_[id];
        if (r.version == version && r.ptr == user_ptr) {
            for (auto &sl : r.slots)
                if (sl.md == wei_md && sl.user_md == user_md) {
                    if (sl.scale_id != scale_id) {
                        sl.scale_id = scale_id;
                        sl.mem = packed;
                    }
                    return sl.mem;
                }
            r.slots.push_back({wei_md, user_md, scale_id, packed});
        }
        return packed;
    }
    // Bytes of the packed copies of the weights in ids[0..n) (n < 0: of every weight).
    long long bytes(const unsigned long long *ids, long long n) {
        std::lock_guard<std::mutex> g(mu_);
        long long total = 0;
        auto add = [&](const Record &r) {
            for (auto &s : r.slots) total += static_cast<long long>(s.md.get_size());
        };
        if (n < 0) {
            for (auto &kv : records_) add(kv.second);
        } else {
            for (long long i = 0; i < n; ++i) {
                auto it = records_.find(ids[i]);
                if (it != records_.end()) add(it->second);
            }
        }
        return total;
    }
    void release(unsigned long long id) {
        std::lock_guard<std::mutex> g(mu_);
        records_.erase(id);
    }
    void clear() {
        std::lock_guard<std::mutex> g(mu_);
        records_.clear();
    }
    long long size() {
        std::lock_guard<std::mutex> g(mu_);
        long long n = 0;
        for (auto &kv : records_) n += static_cast<long long>(kv.second.slots.size());
        return n;
    }

   private:
    struct Slot {
        memory::desc md, user_md;
        unsigned long long scale_id;
        memory mem;
    };
    struct Record {
        long long version = -1;
        const void *ptr = nullptr;
        std::vector<Slot> slots;
    };
    std::mutex mu_;
    std::unordered_map<unsigned long long, Record> records_;
};

WeightCache &weight_cache() {
    static WeightCache c;
    return c;
}

// memcpy over the OpenMP team when the block is large enough to pay for it.
void parallel_copy(void *dst, const void *src, size_t bytes) {
    const size_t chunk = size_t(1) << 18;
    const long long n = static_cast<long long>((bytes + chunk - 1) / chunk);
    if (n <= 1 || omp_get_max_threads() == 1) {
        std::memcpy(dst, src, bytes);
        return;
    }
#pragma omp parallel for schedule(static)
    for (long long i = 0; i < n; ++i) {
        const size_t off = static_cast<size_t>(i) * chunk;
        std::memcpy(static_cast<char *>(dst) + off, static_cast<const char *>(src) + off,
                    std::min(chunk, bytes - off));
    }
}

// Winograd: transformed input -> 16 matrix products -> output transform with bias and post-ops.
void run_winograd(const cl_conv_args &a, const ConvEntry &e, const void *src, const memory &wei, const void *bias,
                  void *dst, const uintptr_t *residuals) {
    const size_t in_b = align64(e.wino_in_md.get_size()), out_b = align64(e.wino_out_md.get_size());
    uint8_t *tmp = t_temps.get(in_b + out_b);
    void *v = tmp;
    float *m = reinterpret_cast<float *>(tmp + in_b);
    const long long h = a.in_sp[0], w = a.in_sp[1];
    const long long all = clwino::tiles(a.n, h, w), block = e.wino_in_md.get_dims()[1];
    const dnnl::engine &eng = cpu_engine();
    memory vm(e.wino_in_md, eng, v), mm(e.wino_out_md, eng, m), sm(e.scratch_md, eng, t_scratch.get(e.scratch_bytes));
    dnnl::stream &s = thread_stream();
    const void *res[CL_MAX_POST_OPS];
    int n_res = 0;
    for (int i = 0; i < a.n_post_ops; ++i)
        if (a.post_ops[i].kind == CL_PO_ADD) {
            res[n_res] = reinterpret_cast<const void *>(residuals[n_res]);
            ++n_res;
        }
    for (long long first = 0; first < all; first += block) {
        clwino::transform_input(src, a.dtype, a.n, h, w, a.ic, first, block, v);
        e.products.execute(s, {{DNNL_ARG_SRC, vm}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DST, mm}, {DNNL_ARG_SCRATCHPAD, sm}});
        s.wait();
        clwino::transform_output(m, a.dtype, a.n, h, w, a.oc, first, block, bias, a.bias_dtype, a.post_ops,
                                 a.n_post_ops, res, dst);
    }
}

void run_conv(const cl_conv_args &a, const void *src, const void *weight, int weight_dt, unsigned long long weight_id,
              long long weight_version, const float *scale, unsigned long long scale_id, const void *bias,
              void *dst, const uintptr_t *residuals) {
    validate(a);
    if (!src || !weight || !dst || (a.has_bias && !bias))
        throw std::invalid_argument("null data pointer");

    // residuals[] holds one tensor per add post-op, in order (the first may be the sum's).
    for (int i = 0, r = 0; i < a.n_post_ops; ++i)
        if (a.post_ops[i].kind == CL_PO_ADD && (!residuals || !residuals[r++]))
            throw std::invalid_argument("residual add without a tensor");

    g_stats.calls++;
    std::shared_ptr<ConvEntry> ep = get_entry(a);
    const ConvEntry &e = *ep;
    const size_t first_binary = e.sum_slot >= 0 ? 1 : 0;
    if (scale && !scale_id) throw std::invalid_argument("a weight scale without its id");
    if (weight_dt != CL_F32 && weight_dt != CL_BF16) throw std::invalid_argument("weight dtype must be f32 or bf16");
    memory wei = weight_cache().get(weight_id, weight_version, weight, e.wei_md, e.user_wei_md,
                                    scale ? scale_id : 0, [&](memory &packed) {
                                        if (!scale && weight_dt == a.dtype) return pack_weight(e, weight, packed);
                                        auto tmp = converted_copy(e.user_wei_md, a.oc, a.w_cl == 2, weight,
                                                                  weight_dt, scale);
                                        pack_weight(e, tmp.get(), packed);
                                    });
    if (e.wino) {
        run_winograd(a, e, src, wei, a.has_bias ? bias : nullptr, dst, residuals);
        return;
    }
    dnnl::stream &s = thread_stream();

    // Temporaries, only when converting: [src][dst][residual...][bias f32]
    const size_t n_res = e.dst_out.active ? e.add_slots.size() : 0;
    const size_t src_b = e.src_in.active ? align64(e.src_md.get_size()) : 0;
    const size_t dst_b = e.dst_out.active ? align64(e.dst_md.get_size()) : 0;
    const size_t bias_b = e.bias_to_f32 ? align64(static_cast<size_t>(a.oc) * 4) : 0;
    uint8_t *tmp = (src_b + dst_b * (1 + n_res) + bias_b) ? t_temps.get(src_b + dst_b * (1 + n_res) + bias_b)
                                                           : nullptr;
    uint8_t *scratch = t_scratch.get(e.scratch_bytes);
    uint8_t *mid = t_mid.get(std::max({e.src_in.mid_bytes, e.dst_out.mid_bytes, e.res_in.mid_bytes}));
    if (e.src_in.active || e.dst_out.active || e.bias_to_f32) g_stats.converted_calls++;

    cldnn::Lease<ConvEntry::Bound> lease(e.bound, [&] { return make_bound(e); });
    ConvEntry::Bound &m = *lease;
    dnnl_exec_arg_t args[5 + CL_MAX_POST_OPS];
    int n = 0;
    auto bind = [&](int arg, const memory &mem, const void *ptr) {
        mem.set_data_handle(const_cast<void *>(ptr));
        args[n++] = {arg, mem.get()};
    };
    args[n++] = {DNNL_ARG_WEIGHTS, wei.get()};
    bind(DNNL_ARG_SCRATCHPAD, m.scratch, scratch);

    if (e.src_in.active) {
        e.src_in.run(s, src, tmp, mid);
        bind(DNNL_ARG_SRC, m.src, tmp);
    } else {
        bind(DNNL_ARG_SRC, m.src, src);
    }
    void *prim_dst = e.dst_out.active ? static_cast<void *>(tmp + src_b) : dst;
    bind(DNNL_ARG_DST, m.dst, prim_dst);
    if (e.sum_slot >= 0) {  // the sum post-op accumulates into what dst holds
        const void *r0 = reinterpret_cast<const void *>(residuals[0]);
        if (e.dst_out.active) e.res_in.run(s, r0, prim_dst, mid);
        else if (r0 != prim_dst) parallel_copy(prim_dst, r0, e.dst_md.get_size());
    }
    if (a.has_bias) {
        if (e.bias_to_f32) {
            float *b32 = reinterpret_cast<float *>(tmp + src_b + dst_b * (1 + n_res));
            cast_bf16_to_f32(static_cast<const uint16_t *>(bias), b32, static_cast<size_t>(a.oc));
            bind(DNNL_ARG_BIAS, m.bias, b32);
        } else {
            bind(DNNL_ARG_BIAS, m.bias, bias);
        }
    }
    for (size_t r = 0; r < e.add_slots.size(); ++r) {
        int slot = e.add_slots[r];
        void *data = reinterpret_cast<void *>(residuals[first_binary + r]);
        int arg = DNNL_ARG_ATTR_MULTIPLE_POST_OP(slot) | DNNL_ARG_SRC_1;
        if (e.dst_out.active) {
            uint8_t *conv = tmp + src_b + dst_b * (1 + r);
            e.res_in.run(s, data, conv, mid);
            bind(arg, m.adds[r], conv);
        } else {
            bind(arg, m.adds[r], data);
        }
    }
    dnnl::error::wrap_c_api(dnnl_primitive_execute(e.prim.get(), s.get(), n, args),
                            "could not execute a convolution");
    s.wait();
    if (e.dst_out.active) e.dst_out.run(s, tmp + src_b, dst, mid);
}

// ---- layout copies: one cached reorder per (dims, strides, dtype) ----------

struct CopyKey {
    int dtype;
    std::vector<int64_t> v;  // dims, src strides, dst strides
    bool operator==(const CopyKey &o) const { return dtype == o.dtype && v == o.v; }
};
struct CopyKeyHash {
    size_t operator()(const CopyKey &k) const {
        size_t h = std::hash<int>()(k.dtype);
        for (int64_t x : k.v) h = h * 1000003u ^ std::hash<int64_t>()(x);
        return h;
    }
};

struct CopyEntry {
    dnnl::reorder prim;
    memory::desc src, dst;
};

class CopyCache {
   public:
    CopyEntry get(const CopyKey &k, int nd) {
        {
            std::lock_guard<std::mutex> g(mu_);
            auto it = map_.find(k);
            if (it != map_.end()) return it->second;
        }
        const dt t = k.dtype == CL_BF16 ? dt::bf16 : dt::f32;
        memory::dims dims(k.v.begin(), k.v.begin() + nd), ss(k.v.begin() + nd, k.v.begin() + 2 * nd),
            ds(k.v.begin() + 2 * nd, k.v.end());
        CopyEntry e{{}, memory::desc(dims, t, ss), memory::desc(dims, t, ds)};
        e.prim = dnnl::reorder(dnnl::reorder::primitive_desc(cpu_engine(), e.src, cpu_engine(), e.dst));
        std::lock_guard<std::mutex> g(mu_);
        if (map_.size() >= 1024) map_.clear();  // shapes of one process's graphs: bounded in practice
        return map_.emplace(k, e).first->second;
    }
    void clear() {
        std::lock_guard<std::mutex> g(mu_);
        map_.clear();
    }

   private:
    std::mutex mu_;
    std::unordered_map<CopyKey, CopyEntry, CopyKeyHash> map_;
};

CopyCache &copy_cache() {
    static CopyCache c;
    return c;
}

void copy_strided(const void *src, void *dst, int nd, const int64_t *dims, const int64_t *ss,
                  const int64_t *ds, int dtype) {
    if (nd < 1 || nd > 12) throw std::invalid_argument("cl_copy_strided: 1 to 12 dims");
    if (dtype != CL_F32 && dtype != CL_BF16) throw std::invalid_argument("cl_copy_strided: f32 or bf16 only");
    CopyKey k{dtype, {}};
    k.v.reserve(3 * nd);
    for (int i = 0; i < nd; ++i) {
        if (dims[i] < 0) throw std::invalid_argument("cl_copy_strided: negative size");
        if (dims[i] == 0) return;
        k.v.push_back(dims[i]);
    }
    k.v.insert(k.v.end(), ss, ss + nd);
    k.v.insert(k.v.end(), ds, ds + nd);
    CopyEntry e = copy_cache().get(k, nd);
    memory a(e.src, cpu_engine(), const_cast<void *>(src)), b(e.dst, cpu_engine(), dst);
    dnnl::stream &s = thread_stream();
    e.prim.execute(s, a, b);
    s.wait();
}

thread_local std::string t_last_error;

void write_str(char *out, int outlen, const std::string &msg) {
    if (!out || outlen <= 0) return;
    std::snprintf(out, static_cast<size_t>(outlen), "%s", msg.c_str());
}

// Every entry point funnels C++ exceptions into a return code: an exception
// crossing the C ABI would abort the Python process.
template <typename F>
int guarded(F &&f) {
    try {
        f();
        return 0;
    } catch (const dnnl::error &ex) {
        t_last_error = std::string("oneDNN error (status ") + std::to_string(ex.status) + "): " + ex.what();
    } catch (const std::bad_alloc &) {
        t_last_error = "out of memory";
    } catch (const std::exception &ex) {
        t_last_error = ex.what();
    } catch (...) {
        t_last_error = "unknown C++ exception";
    }
    return 1;
}

}  // namespace

namespace cldnn {

uint8_t *thread_scratch(size_t bytes) { return t_scratch.get(bytes); }

dnnl::memory packed_weight(unsigned long long id, long long version, const void *user_ptr,
                           const dnnl::memory::desc &packed_md, const dnnl::memory::desc &user_md,
                           const std::function<void(dnnl::memory &)> &pack) {
    return weight_cache().get(id, version, user_ptr, packed_md, user_md, 0, pack);
}

int guarded_call(const std::function<void()> &f) { return guarded(f); }

void write_error_str(char *out, int outlen, const std::string &msg) { write_str(out, outlen, msg); }

}  // namespace cldnn

extern "C" {

int cl_conv_forward_packing(const cl_conv_args *args, uintptr_t src, uintptr_t weight, int weight_dtype,
                            unsigned long long weight_id, long long weight_version, uintptr_t weight_scale,
                            unsigned long long scale_id, uintptr_t bias, uintptr_t dst, const uintptr_t *residuals) {
    return guarded([&] {
        if (!args) throw std::invalid_argument("null arguments");
        run_conv(*args, reinterpret_cast<const void *>(src), reinterpret_cast<const void *>(weight), weight_dtype,
                 weight_id, weight_version, reinterpret_cast<const float *>(weight_scale), scale_id,
                 reinterpret_cast<const void *>(bias), reinterpret_cast<void *>(dst), residuals);
    });
}

int cl_conv_forward(const cl_conv_args *args, uintptr_t src, uintptr_t weight, unsigned long long weight_id,
                    long long weight_version, uintptr_t bias, uintptr_t dst, const uintptr_t *residuals) {
    return cl_conv_forward_packing(args, src, weight, args ? args->dtype : CL_F32, weight_id, weight_version, 0, 0,
                                   bias, dst, residuals);
}

const char *cl_last_error(void) { return t_last_error.c_str(); }

int cl_copy_strided(uintptr_t src, uintptr_t dst, int ndims, const int64_t *dims, const int64_t *src_strides,
                    const int64_t *dst_strides, int dtype) {
    return guarded([&] {
        if (!dims || !src_strides || !dst_strides) throw std::invalid_argument("null arguments");
        copy_strided(reinterpret_cast<const void *>(src), reinterpret_cast<void *>(dst), ndims, dims, src_strides,
                     dst_strides, dtype);
    });
}

int cl_conv_impl_name(const cl_conv_args *args, char *out, int outlen) {
    return guarded([&] {
        if (!args) throw std::invalid_argument("null arguments");
        validate(*args);
        write_str(out, outlen, get_entry(*args)->impl);
    });
}

void cl_weight_release(unsigned long long weight_id) {
    try {
        weight_cache().release(weight_id);
    } catch (...) {
    }
}

long long cl_weight_bytes(const unsigned long long *ids, long long n) {
    try {
        return weight_cache().bytes(ids, n);
    } catch (...) {
        return -1;
    }
}

long long cl_thread_buffer_bytes(void) { return g_thread_buffer_bytes.load(); }

void cl_release_thread_buffers(void) {
    t_scratch.release();
    t_temps.release();
    t_mid.release();
}

void cl_get_stats(cl_stats *out) {
    if (!out) return;
    out->primitives_created = g_stats.primitives_created.load();
    out->primitive_cache_hits = g_stats.primitive_cache_hits.load();
    out->primitive_cache_size = prim_cache().size();
    out->weight_reorders = g_stats.weight_reorders.load();
    out->weight_cache_size = weight_cache().size();
    out->converted_calls = g_stats.converted_calls.load();
    out->ref_primitives = g_stats.ref_primitives.load();
    out->calls = g_stats.calls.load();
}

void cl_clear_caches(void) {
    prim_cache().clear();
    weight_cache().clear();
    copy_cache().clear();
    cldnn::clear_qconv_cache();
}

void cl_set_primitive_cache_capacity(int capacity) { prim_cache().set_capacity(capacity); }
int cl_primitive_cache_capacity(void) { return prim_cache().capacity(); }

int cl_dnnl_version(int *major, int *minor, int *patch) {
    const dnnl_version_t *v = dnnl_version();
    if (major) *major = v->major;
    if (minor) *minor = v->minor;
    if (patch) *patch = v->patch;
    return 0;
}

int cl_cpu_isa(char *out, int outlen) {
    const char *name = "unknown";
    switch (dnnl::get_effective_cpu_isa()) {
        case dnnl::cpu_isa::sse41: name = "sse41"; break;
        case dnnl::cpu_isa::avx: name = "avx"; break;
        case dnnl::cpu_isa::avx2: name = "avx2"; break;
        case dnnl::cpu_isa::avx2_vnni: name = "avx2_vnni"; break;
        case dnnl::cpu_isa::avx2_vnni_2: name = "avx2_vnni_2"; break;
        case dnnl::cpu_isa::avx512_core: name = "avx512_core"; break;
        case dnnl::cpu_isa::avx512_core_vnni: name = "avx512_core_vnni"; break;
        case dnnl::cpu_isa::avx512_core_bf16: name = "avx512_core_bf16"; break;
        case dnnl::cpu_isa::avx512_core_fp16: name = "avx512_core_fp16"; break;
        case dnnl::cpu_isa::avx512_core_amx: name = "avx512_core_amx"; break;
        case dnnl::cpu_isa::avx512_core_amx_fp16: name = "avx512_core_amx_fp16"; break;
        default: break;
    }
    write_str(out, outlen, name);
    return 0;
}

int cl_native_bf16(void) { return native_bf16() ? 1 : 0; }

}  // extern "C"
