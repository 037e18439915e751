// Module-state check for cpu_layout.state_key.StateKey: are these tensors'
// version counters and data pointers what they were? The Python loop touches
// each tensor's objects one after another; after a forward has evicted them
// from cache every touch waits for memory (mobilenet_v3, 312 state tensors:
// 250 us per call inside a forward loop, 40 us when hot). Here the loads of
// different tensors overlap. Built against torch's own c10 headers, with the
// torch version in the source so a cache never serves another torch's build.
#include <c10/core/TensorImpl.h>
#include <cstdint>

// -1: all unchanged; i >= 0: tensor i changed; -2: a tensor's state cannot be
// read here (no storage): the caller checks in Python.
extern "C" int64_t cl_state_changed(const uintptr_t* impls, const int64_t* versions,
                                    const uintptr_t* ptrs, int64_t n, int64_t inference_version) {
  // The TensorImpls first, all at once (a few lines each): the loop below then
  // finds them in cache and its dependent loads overlap across tensors.
  for (int64_t i = 0; i < n; ++i) {
    const char* p = reinterpret_cast<const char*>(impls[i]);
    for (size_t off = 0; off < sizeof(c10::TensorImpl); off += 64) __builtin_prefetch(p + off);
  }
  try {
    for (int64_t i = 0; i < n; ++i) {
      auto* t = reinterpret_cast<c10::TensorImpl*>(impls[i]);
      // Inference tensors have no version counter (ops.content_version).
      int64_t v = t->is_inference() ? inference_version
                                    : static_cast<int64_t>(t->version_counter().current_version());
      if (v != versions[i] || reinterpret_cast<uintptr_t>(t->data()) != ptrs[i]) return i;
    }
  } catch (...) {
    return -2;
  }
  return -1;
}
