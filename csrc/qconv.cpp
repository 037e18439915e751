// INT8 convolution on cpu_layout's oneDNN: PT2E's
//   dequantize(x) -> conv(dequantize(w)) -> post-ops -> quantize
// as one primitive (u8/s8 src, s8 weights packed once, per-channel weight
// scales, zero points, requantized or dequantized dst).
//
// Why not torch's onednn.qconv_pointwise (Inductor's lowering): it runs on
// torch's hidden oneDNN copy, takes a prepacked weight from its own packing op
// and checks and wraps every argument per call; owning the primitive lets the
// int8 conv share the float convs' weight cache, scratchpads and error rules.
// The primitive cache here is keyed like conv.cpp's; the two stay separate
// because their entries hold different conversions (float convs convert
// dtypes and formats at the edges, int8 ones never do).

#include <oneapi/dnnl/dnnl.hpp>

#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

extern "C" {
#include "cl_api.h"
}
#include "cl_dnnl.h"

namespace {

using dnnl::memory;
using tag = memory::format_tag;
using dt = memory::data_type;
using cldnn::cpu_engine;

dt qdt(int code) {
    switch (code) {
        case CL_U8: return dt::u8;
        case CL_S8: return dt::s8;
        case CL_F32: return dt::f32;
        case CL_BF16: return dt::bf16;
    }
    throw std::invalid_argument("unsupported int8 conv dtype code " + std::to_string(code));
}

bool is_int8(int code) { return code == CL_U8 || code == CL_S8; }

using cldnn::act_tag;

void validate(const cl_qconv_args &a) {
    auto bad = [](const std::string &m) { throw std::invalid_argument("int8 conv: " + m); };
    cldnn::validate_geometry(a, "int8 conv: ");
    if (!is_int8(a.src_dt)) bad("src must be u8 or s8");
    qdt(a.dst_dt);
    int adds = 0;
    for (int i = 0; i < a.n_post_ops; ++i) adds += a.post_ops[i].kind == CL_PO_ADD;
    if (adds > 1) bad("at most one residual add");
    if (!is_int8(a.dst_dt) && a.dst_zp) bad("a float dst has no zero point");
}

// The key: the problem with every byte defined (padding and unused fields zero).
using Key = cldnn::Key<cl_qconv_args>;

Key make_key(const cl_qconv_args &in) {
    Key k;
    std::memset(&k.a, 0, sizeof k.a);
    k.a.src_dt = in.src_dt;
    k.a.dst_dt = in.dst_dt;
    k.a.has_bias = in.has_bias ? 1 : 0;
    k.a.src_cl = in.src_cl ? 1 : 0;
    k.a.dst_cl = in.dst_cl ? 1 : 0;
    k.a.src_zp = in.src_zp;
    k.a.dst_zp = in.dst_zp;
    cldnn::copy_geometry(k.a, in);
    bool has_sum = false;
    for (int i = 0; i < k.a.n_post_ops && i < CL_MAX_POST_OPS; ++i) has_sum |= k.a.post_ops[i].kind == CL_PO_ADD;
    if (has_sum) {
        k.a.sum_scale = in.sum_scale;
        k.a.sum_zp = in.sum_zp;
    }
    return k;
}

struct Entry {
    dnnl::convolution_forward prim;
    memory::desc src_md, wei_md, user_wei_md, bias_md, dst_md, scratch_md;
    memory::desc scale1_md, wscale_md, zp_md;
    size_t scratch_bytes = 0;
    std::string impl;
    // The memory objects one execution binds (cldnn::IdleSets: made once, re-pointed per call).
    struct Bound {
        memory src, dst, scratch, bias, src_scale, wei_scale, dst_scale, src_zp, dst_zp;
    };
    cldnn::IdleSets<Bound> bound;
};

std::unique_ptr<Entry::Bound> make_bound(const Entry &e) {
    const dnnl::engine &eng = cpu_engine();
    auto b = std::make_unique<Entry::Bound>();
    b->src = memory(e.src_md, eng, DNNL_MEMORY_NONE);
    b->dst = memory(e.dst_md, eng, DNNL_MEMORY_NONE);
    b->scratch = memory(e.scratch_md, eng, DNNL_MEMORY_NONE);
    if (!e.bias_md.is_zero()) b->bias = memory(e.bias_md, eng, DNNL_MEMORY_NONE);
    b->src_scale = memory(e.scale1_md, eng, DNNL_MEMORY_NONE);
    b->wei_scale = memory(e.wscale_md, eng, DNNL_MEMORY_NONE);
    b->dst_scale = memory(e.scale1_md, eng, DNNL_MEMORY_NONE);
    b->src_zp = memory(e.zp_md, eng, DNNL_MEMORY_NONE);
    b->dst_zp = memory(e.zp_md, eng, DNNL_MEMORY_NONE);
    return b;
}

std::shared_ptr<Entry> build(const cl_qconv_args &a) {
    auto e = std::make_shared<Entry>();
    const int nsp = a.nsp;
    const bool grouped = a.groups > 1;
    const cldnn::ConvDims d = cldnn::conv_dims(a);
    e->src_md = memory::desc(d.src, qdt(a.src_dt), act_tag(nsp, a.src_cl));
    e->dst_md = memory::desc(d.dst, qdt(a.dst_dt), act_tag(nsp, a.dst_cl));
    e->user_wei_md = memory::desc(d.wei, dt::s8, cldnn::wei_tag(nsp, grouped, false));
    const memory::desc wei_any(d.wei, dt::s8, tag::any);
    if (a.has_bias) e->bias_md = memory::desc({a.oc}, dt::f32, tag::a);

    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    attr.set_scales_mask(DNNL_ARG_SRC, 0);
    // One scale per output channel: dim 0 of [oc][ic][k], dims 0 and 1 of [g][oc/g][ic/g][k].
    attr.set_scales_mask(DNNL_ARG_WEIGHTS, grouped ? 3 : 1);
    if (is_int8(a.dst_dt)) attr.set_scales_mask(DNNL_ARG_DST, 0);
    if (a.src_zp) attr.set_zero_points_mask(DNNL_ARG_SRC, 0);
    if (a.dst_zp) attr.set_zero_points_mask(DNNL_ARG_DST, 0);
    dnnl::post_ops po;
    for (int i = 0; i < a.n_post_ops; ++i) {
        const cl_post_op &p = a.post_ops[i];
        if (p.kind == CL_PO_ADD) {
            po.append_sum(a.sum_scale, a.sum_zp, qdt(a.dst_dt));
            continue;
        }
        if (p.kind == CL_PO_TANH) throw std::invalid_argument("int8 conv: unsupported post-op tanh");
        float alpha = p.alpha, beta = p.beta;
        const dnnl::algorithm alg = cldnn::eltwise_alg(p.kind, alpha, beta);
        po.append_eltwise(alg, alpha, beta);
    }
    attr.set_post_ops(po);

    using pd_t = dnnl::convolution_forward::primitive_desc;
    pd_t pd = a.has_bias
                  ? pd_t(cpu_engine(), dnnl::prop_kind::forward_inference, dnnl::algorithm::convolution_direct,
                         e->src_md, wei_any, e->bias_md, e->dst_md, d.strides, d.dil, d.pad_l, d.pad_r, attr)
                  : pd_t(cpu_engine(), dnnl::prop_kind::forward_inference, dnnl::algorithm::convolution_direct,
                         e->src_md, wei_any, e->dst_md, d.strides, d.dil, d.pad_l, d.pad_r, attr);
    e->impl = pd.impl_info_str();
    e->wei_md = pd.weights_desc();
    e->scratch_md = pd.scratchpad_desc();
    e->scratch_bytes = e->scratch_md.get_size();
    e->prim = dnnl::convolution_forward(pd);
    e->scale1_md = memory::desc({1}, dt::f32, tag::x);
    e->wscale_md = memory::desc({a.oc}, dt::f32, tag::x);
    e->zp_md = memory::desc({1}, dt::s32, tag::x);
    return e;
}

cldnn::LruCache<cl_qconv_args, Entry> &cache() {
    static cldnn::LruCache<cl_qconv_args, Entry> c;
    return c;
}

std::shared_ptr<Entry> get_entry(const cl_qconv_args &a) {
    const Key k = make_key(a);
    bool hit = false;
    return cache().get(k, [&] { return build(k.a); }, &hit);
}

size_t dt_bytes(int code) { return code == CL_F32 ? 4 : code == CL_BF16 ? 2 : 1; }

void run(const cl_qconv_args &a, const void *src, float src_scale, const void *weight, unsigned long long wid,
         long long wver, const float *wscales, const void *bias, void *dst, float dst_scale, const void *residual) {
    validate(a);
    if (!src || !weight || !wscales || !dst || (a.has_bias && !bias)) throw std::invalid_argument("int8 conv: null data pointer");
    bool has_sum = false;
    for (int i = 0; i < a.n_post_ops; ++i) has_sum |= a.post_ops[i].kind == CL_PO_ADD;
    if (has_sum != (residual != nullptr)) throw std::invalid_argument("int8 conv: a residual add needs exactly one residual");
    if (!(src_scale > 0.f) || (is_int8(a.dst_dt) && !(dst_scale > 0.f)))
        throw std::invalid_argument("int8 conv: scales must be positive");
    std::shared_ptr<Entry> ep = get_entry(a);
    const Entry &e = *ep;
    const dnnl::engine &eng = cpu_engine();
    memory wei = cldnn::packed_weight(wid, wver, weight, e.wei_md, e.user_wei_md, [&](memory &packed) {
        memory user(e.user_wei_md, eng, const_cast<void *>(weight));
        dnnl::stream &s = cldnn::thread_stream();
        dnnl::reorder(user, packed).execute(s, user, packed);
        s.wait();
    });
    if (residual && residual != dst) {
        size_t bytes = dt_bytes(a.dst_dt) * static_cast<size_t>(a.n * a.oc);
        for (int i = 0; i < a.nsp; ++i) bytes *= static_cast<size_t>(a.out_sp[i]);
        std::memcpy(dst, residual, bytes);
    }
    int32_t szp = a.src_zp, dzp = a.dst_zp;
    float ss = src_scale, ds = dst_scale;
    cldnn::Lease<Entry::Bound> lease(e.bound, [&] { return make_bound(e); });
    Entry::Bound &m = *lease;
    dnnl_exec_arg_t args[10];
    int n = 0;
    auto bind = [&](int arg, const memory &mem, const void *ptr) {
        mem.set_data_handle(const_cast<void *>(ptr));
        args[n++] = {arg, mem.get()};
    };
    args[n++] = {DNNL_ARG_WEIGHTS, wei.get()};
    bind(DNNL_ARG_SRC, m.src, src);
    bind(DNNL_ARG_DST, m.dst, dst);
    bind(DNNL_ARG_SCRATCHPAD, m.scratch, cldnn::thread_scratch(e.scratch_bytes));
    bind(DNNL_ARG_ATTR_SCALES | DNNL_ARG_SRC, m.src_scale, &ss);
    bind(DNNL_ARG_ATTR_SCALES | DNNL_ARG_WEIGHTS, m.wei_scale, wscales);
    if (a.has_bias) bind(DNNL_ARG_BIAS, m.bias, bias);
    if (is_int8(a.dst_dt)) bind(DNNL_ARG_ATTR_SCALES | DNNL_ARG_DST, m.dst_scale, &ds);
    if (a.src_zp) bind(DNNL_ARG_ATTR_ZERO_POINTS | DNNL_ARG_SRC, m.src_zp, &szp);
    if (a.dst_zp) bind(DNNL_ARG_ATTR_ZERO_POINTS | DNNL_ARG_DST, m.dst_zp, &dzp);
    dnnl::stream &s = cldnn::thread_stream();
    dnnl::error::wrap_c_api(dnnl_primitive_execute(e.prim.get(), s.get(), n, args),
                            "could not execute an int8 convolution");
    s.wait();
}

}  // namespace

void cldnn::clear_qconv_cache() { cache().clear(); }

extern "C" {

int cl_qconv_forward(const cl_qconv_args *args, uintptr_t src, float src_scale, uintptr_t weight,
                     unsigned long long weight_id, long long weight_version, uintptr_t weight_scales,
                     uintptr_t bias, uintptr_t dst, float dst_scale, uintptr_t residual) {
    return cldnn::guarded_call([&] {
        if (!args) throw std::invalid_argument("null arguments");
        run(*args, reinterpret_cast<const void *>(src), src_scale, reinterpret_cast<const void *>(weight), weight_id,
            weight_version, reinterpret_cast<const float *>(weight_scales), reinterpret_cast<const void *>(bias),
            reinterpret_cast<void *>(dst), dst_scale, reinterpret_cast<const void *>(residual));
    });
}

int cl_qconv_impl_name(const cl_qconv_args *args, char *out, int outlen) {
    return cldnn::guarded_call([&] {
        if (!args) throw std::invalid_argument("null arguments");
        validate(*args);
        cldnn::write_error_str(out, outlen, get_entry(*args)->impl);
    });
}

}  // extern "C"
