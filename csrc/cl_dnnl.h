// What the extension's oneDNN primitives share (defined in conv.cpp): the
// engine, one stream per thread, per-thread scratchpad memory, the one cache
// of packed weights, and the C ABI's error convention.
#pragma once

#include <oneapi/dnnl/dnnl.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

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

}  // namespace cldnn
