// What the extension's oneDNN primitives share: the engine, one stream per thread,
// per-thread scratchpad memory, the one cache of packed weights, the C ABI's error
// convention (defined in conv.cpp), and the caches and bindings each primitive
// family keeps (templates here): the float convs (conv.cpp) and int8 convs (qconv.cpp).
#pragma once

#include <oneapi/dnnl/dnnl.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

// After cl_api.h (its enums: it has no include guard, being cffi's declarations verbatim).

namespace cldnn {

dnnl::engine &cpu_engine();
dnnl::stream &thread_stream();

// Grow-only scratch of the calling thread, 64-byte aligned (a primitive's scratchpad).
uint8_t *thread_scratch(size_t bytes);

// The copy of the weight at `user_ptr` (described by `user_md`) packed into
// `packed_md` by `pack`, made once and kept while (id, version, user_ptr) are
// unchanged: an in-place change or new storage repacks, never serves stale.
// cl_weight_release(id) and cl_clear_caches() drop it.
dnnl::memory packed_weight(unsigned long long id, long long version, const void *user_ptr,
                           const dnnl::memory::desc &packed_md, const dnnl::memory::desc &user_md,
                           const std::function<void(dnnl::memory &)> &pack);

// Drops the int8 convolutions' primitives (qconv.cpp; cl_clear_caches calls it).
void clear_qconv_cache();

// Runs f; a C++ exception becomes return value 1 and the text cl_last_error() reports.
int guarded_call(const std::function<void()> &f);
void write_error_str(char *out, int outlen, const std::string &msg);

using tag = dnnl::memory::format_tag;

// Plain activation formats: channels-last (NWC/NHWC/NDHWC) or contiguous.
inline tag act_tag(int nsp, bool cl) {
    switch (nsp) {
        case 1: return cl ? tag::nwc : tag::ncw;
        case 2: return cl ? tag::nhwc : tag::nchw;
        case 3: return cl ? tag::ndhwc : tag::ncdhw;
    }
    throw std::invalid_argument("spatial rank must be 1, 2 or 3");
}

// PyTorch's weight layouts: [oc][ic/g][k...] ([oc][k...][ic/g] when cl), grouped as [g][oc/g]...
inline tag wei_tag(int nsp, bool grouped, bool cl) {
    switch (nsp) {
        case 1: return grouped ? (cl ? tag::gowi : tag::goiw) : (cl ? tag::owi : tag::oiw);
        case 2: return grouped ? (cl ? tag::gohwi : tag::goihw) : (cl ? tag::ohwi : tag::oihw);
        case 3: return grouped ? (cl ? tag::godhwi : tag::goidhw) : (cl ? tag::odhwi : tag::oidhw);
    }
    throw std::invalid_argument("spatial rank must be 1, 2 or 3");
}

// A 1x1 weight stored [ic][oc] (w_cl 2): a linear's [in, out] matrix, as GPT-2's
// Conv1D keeps it, read without a transposed copy.
inline dnnl::memory::desc transposed_wei_md(const dnnl::memory::dims &d, dnnl::memory::data_type t) {
    dnnl::memory::dims st(d.size(), d[0] * d[1]);  // d: [oc][ic][1...]
    st[0] = 1;
    st[1] = d[0];
    return dnnl::memory::desc(d, t, st);
}

// oneDNN's eltwise algorithm (and its alpha/beta) for a CL_PO_* activation post-op.
inline dnnl::algorithm eltwise_alg(int kind, float &alpha, float &beta) {
    switch (kind) {
        case CL_PO_RELU: beta = 0.f; return dnnl::algorithm::eltwise_relu;
        case CL_PO_SILU: alpha = 1.f; beta = 0.f; return dnnl::algorithm::eltwise_swish;
        case CL_PO_GELU_TANH: alpha = beta = 0.f; return dnnl::algorithm::eltwise_gelu_tanh;
        case CL_PO_GELU_ERF: alpha = beta = 0.f; return dnnl::algorithm::eltwise_gelu_erf;
        // torch: x * relu6(x + 3) / 6 == x * clamp(x/6 + 1/2, 0, 1)
        case CL_PO_HARDSWISH: alpha = 1.f / 6.f; beta = 0.5f; return dnnl::algorithm::eltwise_hardswish;
        case CL_PO_SIGMOID: alpha = beta = 0.f; return dnnl::algorithm::eltwise_logistic;
        case CL_PO_TANH: alpha = beta = 0.f; return dnnl::algorithm::eltwise_tanh;
        case CL_PO_CLAMP: return dnnl::algorithm::eltwise_clip_v2;
    }
    throw std::invalid_argument("not an eltwise post-op");
}

// ---- the geometry cl_conv_args and cl_qconv_args share (fields named alike) ----

// Throws std::invalid_argument(who + reason) unless the geometry is one oneDNN can take:
// rank, positive sizes, channels divisible by groups, and output sizes that follow
// from input, kernel, stride, padding and dilation.
template <class A>
void validate_geometry(const A &a, const std::string &who) {
    auto fail = [&](const std::string &m) { throw std::invalid_argument(who + m); };
    if (a.nsp < 1 || a.nsp > CL_MAX_SPATIAL) fail("spatial rank must be 1, 2 or 3");
    if (a.n <= 0 || a.ic <= 0 || a.oc <= 0) fail("batch and channel counts must be positive");
    if (a.groups <= 0) fail("groups must be positive");
    if (a.ic % a.groups || a.oc % a.groups) fail("channels must be divisible by groups");
    for (int i = 0; i < a.nsp; ++i) {
        if (a.in_sp[i] <= 0 || a.k_sp[i] <= 0 || a.out_sp[i] <= 0) fail("spatial sizes must be positive");
        if (a.stride[i] <= 0) fail("stride must be positive");
        if (a.dilation[i] <= 0) fail("dilation must be positive");
        if (a.pad_l[i] < 0 || a.pad_r[i] < 0) fail("padding must be non-negative");
        const long long span = a.dilation[i] * (a.k_sp[i] - 1) + 1;
        const long long padded = a.in_sp[i] + a.pad_l[i] + a.pad_r[i];
        if (padded < span || (padded - span) / a.stride[i] + 1 != a.out_sp[i])
            fail("output size " + std::to_string(a.out_sp[i]) + " in spatial dim " + std::to_string(i) +
                 " does not follow from input, kernel, stride, padding and dilation");
    }
    if (a.n_post_ops < 0 || a.n_post_ops > CL_MAX_POST_OPS) fail("too many post-ops");
}

// The geometry and post-ops of `in` into the zeroed key problem `k` (unused spatial
// slots and post-ops stay zero, so equal problems compare equal bytewise).
template <class A>
void copy_geometry(A &k, const A &in) {
    k.nsp = in.nsp;
    k.n = in.n;
    k.ic = in.ic;
    k.oc = in.oc;
    k.groups = in.groups;
    for (int i = 0; i < in.nsp && i < CL_MAX_SPATIAL; ++i) {
        k.in_sp[i] = in.in_sp[i];
        k.k_sp[i] = in.k_sp[i];
        k.out_sp[i] = in.out_sp[i];
        k.stride[i] = in.stride[i];
        k.pad_l[i] = in.pad_l[i];
        k.pad_r[i] = in.pad_r[i];
        k.dilation[i] = in.dilation[i];
    }
    k.n_post_ops = in.n_post_ops;
    for (int i = 0; i < in.n_post_ops && i < CL_MAX_POST_OPS; ++i) k.post_ops[i] = in.post_ops[i];
}

// oneDNN's dims of a convolution problem: activations [n][c][sp...], weights
// [oc][ic][k...] or [g][oc/g][ic/g][k...], strides, dilations (oneDNN counts them from
// 0) and paddings.
struct ConvDims {
    dnnl::memory::dims src, dst, wei, strides, dil, pad_l, pad_r;
};
template <class A>
ConvDims conv_dims(const A &a) {
    ConvDims d;
    d.src = {a.n, a.ic};
    d.dst = {a.n, a.oc};
    if (a.groups > 1) d.wei = {a.groups, a.oc / a.groups, a.ic / a.groups};
    else d.wei = {a.oc, a.ic};
    for (int i = 0; i < a.nsp; ++i) {
        d.src.push_back(a.in_sp[i]);
        d.dst.push_back(a.out_sp[i]);
        d.wei.push_back(a.k_sp[i]);
        d.strides.push_back(a.stride[i]);
        d.dil.push_back(a.dilation[i] - 1);
        d.pad_l.push_back(a.pad_l[i]);
        d.pad_r.push_back(a.pad_r[i]);
    }
    return d;
}

// Hash of a problem struct whose every byte is defined (zero padding): multiply-xorshift
// over its 64-bit words in four independent lanes (one serial chain over 84 words cost
// 0.13 us a call).
template <class T>
size_t hash_words(const T &v) {
    static_assert(sizeof(T) % sizeof(uint64_t) == 0, "key is word-sized");
    constexpr size_t n = sizeof(T) / sizeof(uint64_t);
    uint64_t w[n];
    std::memcpy(w, &v, sizeof(w));
    uint64_t h[4] = {0x9E3779B97F4A7C15ull, 0xC2B2AE3D27D4EB4Full, 0x165667B19E3779F9ull, 0x27D4EB2F165667C5ull};
    for (size_t i = 0; i < n; ++i) {
        uint64_t &x = h[i & 3];
        x ^= w[i];
        x *= 0xBF58476D1CE4E5B9ull;
        x ^= x >> 31;
    }
    uint64_t r = h[0] ^ (h[1] * 0x94D049BB133111EBull) ^ (h[2] >> 17) ^ (h[3] * 0x9E3779B97F4A7C15ull);
    r ^= r >> 29;
    return static_cast<size_t>(r);
}

// A problem struct as a cache key: compared and hashed bytewise (the caller zeroes
// unused fields and padding).
template <class T>
struct Key {
    T a;
    bool operator==(const Key &o) const { return std::memcmp(&a, &o.a, sizeof(a)) == 0; }
};
template <class T>
struct KeyHash {
    size_t operator()(const Key<T> &k) const { return hash_words(k.a); }
};

// Primitives by problem, least recently used dropped past `capacity`; thread-safe, and a
// miss builds outside the lock (JIT takes milliseconds; other threads' hits do not wait).
template <class T, class V>
class LruCache {
   public:
    // The entry of k (built by build() on a miss); *hit says which.
    template <class Build>
    std::shared_ptr<V> get(const Key<T> &k, Build build, bool *hit) {
        {
            std::lock_guard<std::mutex> g(mu_);
            auto it = map_.find(k);
            if (it != map_.end()) {
                lru_.splice(lru_.begin(), lru_, it->second);
                *hit = true;
                return it->second->second;
            }
        }
        *hit = false;
        std::shared_ptr<V> e = build();
        std::lock_guard<std::mutex> g(mu_);
        auto it = map_.find(k);
        if (it != map_.end()) return it->second->second;  // another thread won
        lru_.emplace_front(k, e);
        map_[k] = lru_.begin();
        trim();
        return e;
    }
    void clear() {
        std::lock_guard<std::mutex> g(mu_);
        map_.clear();
        lru_.clear();
    }
    void set_capacity(int c) {
        std::lock_guard<std::mutex> g(mu_);
        capacity_ = c < 1 ? 1 : static_cast<size_t>(c);
        trim();
    }
    int capacity() {
        std::lock_guard<std::mutex> g(mu_);
        return static_cast<int>(capacity_);
    }
    long long size() {
        std::lock_guard<std::mutex> g(mu_);
        return static_cast<long long>(map_.size());
    }

   private:
    void trim() {
        while (map_.size() > capacity_) {
            map_.erase(lru_.back().first);
            lru_.pop_back();
        }
    }
    using Item = std::pair<Key<T>, std::shared_ptr<V>>;
    std::mutex mu_;
    std::list<Item> lru_;
    std::unordered_map<Key<T>, typename std::list<Item>::iterator, KeyHash<T>> map_;
    size_t capacity_ = 512;
};

// Idle sets of the memory objects one execution of a primitive binds, re-pointed per
// call: made per call, with the argument map the C++ execute() takes, they cost 1.9 us
// per conv against 0.55 us (1x1 conv on 1x16x4x4, oneDNN 3.2, EPYC Zen 4), and about
// 19 us per int8 conv inside a forward (mobilenet_v3_large: 64 convs 3.2 ms against
// oneDNN's own 2.0 ms, EPYC Zen 5). A call takes one, so threads never share one.
template <class B>
struct IdleSets {
    mutable std::mutex mu;
    mutable std::vector<std::unique_ptr<B>> idle;
};

// Takes an idle set (or makes one with make()) and gives it back when done.
template <class B>
class Lease {
   public:
    template <class Make>
    Lease(const IdleSets<B> &sets, Make make) : sets_(sets) {
        {
            std::lock_guard<std::mutex> g(sets.mu);
            if (!sets.idle.empty()) {
                b_ = std::move(sets.idle.back());
                sets.idle.pop_back();
                return;
            }
        }
        b_ = make();
    }
    ~Lease() {
        std::lock_guard<std::mutex> g(sets_.mu);
        sets_.idle.push_back(std::move(b_));
    }
    B &operator*() { return *b_; }
    Lease(const Lease &) = delete;
    Lease &operator=(const Lease &) = delete;

   private:
    const IdleSets<B> &sets_;
    std::unique_ptr<B> b_;
};

}  // namespace cldnn
