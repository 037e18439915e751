// Max pooling of int8 tensors on oneDNN's pooling primitive (see cl_api.h):
// a max of quantized values is the quantized max, so int8 tensors pool
// without dequantizing. Primitives are cached by problem.
#include <oneapi/dnnl/dnnl.hpp>

#include <cstring>
#include <map>
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

struct Entry {
    dnnl::pooling_forward prim;
    memory::desc src_md, dst_md, scratch_md;
};

std::mutex g_mu;
std::map<std::vector<long long>, std::shared_ptr<Entry>> g_cache;

std::shared_ptr<Entry> get(int nsp, int dtype, int cl, const long long *sd, const long long *dd, const long long *k,
                           const long long *s, const long long *pl, const long long *pr, const long long *dl) {
    if (nsp < 1 || nsp > 3) throw std::invalid_argument("int8 max pool: spatial rank must be 1, 2 or 3");
    if (dtype != CL_U8 && dtype != CL_S8) throw std::invalid_argument("int8 max pool: dtype must be u8 or s8");
    std::vector<long long> key{nsp, dtype, cl != 0};
    for (int i = 0; i < nsp + 2; ++i) key.insert(key.end(), {sd[i], dd[i]});
    for (int i = 0; i < nsp; ++i) key.insert(key.end(), {k[i], s[i], pl[i], pr[i], dl[i]});
    {
        std::lock_guard<std::mutex> g(g_mu);
        auto it = g_cache.find(key);
        if (it != g_cache.end()) return it->second;
    }
    const memory::data_type d = dtype == CL_U8 ? memory::data_type::u8 : memory::data_type::s8;
    const tag t = nsp == 1 ? (cl ? tag::nwc : tag::ncw) : nsp == 2 ? (cl ? tag::nhwc : tag::nchw)
                                                                   : (cl ? tag::ndhwc : tag::ncdhw);
    memory::dims src_d(sd, sd + nsp + 2), dst_d(dd, dd + nsp + 2), kd(k, k + nsp), st(s, s + nsp), pad_l(pl, pl + nsp),
        pad_r(pr, pr + nsp), dil;
    for (int i = 0; i < nsp; ++i) {
        if (dl[i] < 1 || k[i] < 1 || s[i] < 1) throw std::invalid_argument("int8 max pool: bad kernel, stride or dilation");
        dil.push_back(dl[i] - 1);
    }
    auto e = std::make_shared<Entry>();
    e->src_md = memory::desc(src_d, d, t);
    e->dst_md = memory::desc(dst_d, d, t);
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    dnnl::pooling_forward::primitive_desc pd(cldnn::cpu_engine(), dnnl::prop_kind::forward_inference,
                                             dnnl::algorithm::pooling_max, e->src_md, e->dst_md, st, kd, dil,
                                             pad_l, pad_r, attr);
    e->scratch_md = pd.scratchpad_desc();
    e->prim = dnnl::pooling_forward(pd);
    std::lock_guard<std::mutex> g(g_mu);
    return g_cache.emplace(key, e).first->second;
}

}  // namespace

extern "C" int cl_qmax_pool(int nsp, int dtype, int cl, const long long *src_dims, const long long *dst_dims,
                            const long long *k, const long long *s, const long long *pad_l, const long long *pad_r,
                            const long long *dilation, uintptr_t src, uintptr_t dst) {
    return cldnn::guarded_call([&] {
        if (!src || !dst) throw std::invalid_argument("int8 max pool: null data pointer");
        auto e = get(nsp, dtype, cl, src_dims, dst_dims, k, s, pad_l, pad_r, dilation);
        const dnnl::engine &eng = cldnn::cpu_engine();
        memory ms(e->src_md, eng, reinterpret_cast<void *>(src)), md(e->dst_md, eng, reinterpret_cast<void *>(dst));
        memory scratch(e->scratch_md, eng, cldnn::thread_scratch(e->scratch_md.get_size()));
        dnnl::stream &st = cldnn::thread_stream();
        e->prim.execute(st, {{DNNL_ARG_SRC, ms}, {DNNL_ARG_DST, md}, {DNNL_ARG_SCRATCHPAD, scratch}});
        st.wait();
    });
}
