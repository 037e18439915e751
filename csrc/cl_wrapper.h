/* Run-time support for cpp_wrapper segments: the helpers the segment runtime
 * (segment_vm.cpp; programs from cpu_layout/codegen/program.py) is built on,
 * compiled with it after cl_api.h, once per machine and torch.
 * Tensors are ATen tensors held through the C shim libtorch exports
 * for Inductor's own C++ wrapper (aoti_torch_*): allocation goes through
 * torch's CPU allocator, ATen ops the segment needs run without leaving C++,
 * and results are handed back to Python without a copy. The declarations are
 * written out here rather than included because torch's shim header pulls in
 * c10 headers that would multiply the runtime's compile time.
 */
#include <cmath>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <algorithm>
#include <atomic>
#include <utility>
#include <vector>

extern "C" {
struct AtenTensorOpaque;
typedef AtenTensorOpaque* AtenTensorHandle;
typedef int32_t AOTITorchError;
int32_t aoti_torch_device_type_cpu();
int32_t aoti_torch_dtype_float32();
int32_t aoti_torch_dtype_bfloat16();
int32_t aoti_torch_dtype_int64();
int32_t aoti_torch_dtype_uint8();
AOTITorchError aoti_torch_delete_tensor_object(AtenTensorHandle);
AOTITorchError aoti_torch_get_data_ptr(AtenTensorHandle, void**);
AOTITorchError aoti_torch_get_dim(AtenTensorHandle, int64_t*);
AOTITorchError aoti_torch_get_sizes(AtenTensorHandle, int64_t**);
AOTITorchError aoti_torch_get_strides(AtenTensorHandle, int64_t**);
AOTITorchError aoti_torch_get_storage_offset(AtenTensorHandle, int64_t*);
AOTITorchError aoti_torch_get_storage_size(AtenTensorHandle, int64_t*);
AOTITorchError aoti_torch_get_dtype(AtenTensorHandle, int32_t*);
AOTITorchError aoti_torch_empty_strided(int64_t, const int64_t*, const int64_t*, int32_t, int32_t,
                                        int32_t, AtenTensorHandle*);
AOTITorchError aoti_torch_create_tensor_from_blob(void*, int64_t, const int64_t*, const int64_t*,
                                                  int64_t, int32_t, int32_t, int32_t,
                                                  AtenTensorHandle*);
AOTITorchError aoti_torch__reinterpret_tensor(AtenTensorHandle, int64_t, const int64_t*,
                                              const int64_t*, int64_t, AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_max_pool2d_with_indices(
    AtenTensorHandle, const int64_t*, int64_t, const int64_t*, int64_t, const int64_t*, int64_t,
    const int64_t*, int64_t, int32_t, AtenTensorHandle*, AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_avg_pool2d(AtenTensorHandle, const int64_t*, int64_t,
                                         const int64_t*, int64_t, const int64_t*, int64_t, int32_t,
                                         int32_t, int64_t*, AtenTensorHandle*);
AOTITorchError aoti_torch_copy_(AtenTensorHandle, AtenTensorHandle, int32_t);
AOTITorchError aoti_torch_cpu_cat(const AtenTensorHandle*, int64_t, int64_t, AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_addmm_out(AtenTensorHandle, AtenTensorHandle, AtenTensorHandle,
                                        AtenTensorHandle, double, double);
AOTITorchError aoti_torch_cpu_mm_out(AtenTensorHandle, AtenTensorHandle, AtenTensorHandle);
AOTITorchError aoti_torch_cpu_bmm_out(AtenTensorHandle, AtenTensorHandle, AtenTensorHandle);
AOTITorchError aoti_torch_cpu__scaled_dot_product_flash_attention_for_cpu(
    AtenTensorHandle, AtenTensorHandle, AtenTensorHandle, double, int32_t, AtenTensorHandle*, double*,
    AtenTensorHandle*, AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_mkldnn__convolution_pointwise(
    AtenTensorHandle, AtenTensorHandle, AtenTensorHandle*, const int64_t*, int64_t, const int64_t*, int64_t,
    const int64_t*, int64_t, int64_t, const char*, const double**, int64_t, const char**, AtenTensorHandle*);
AOTITorchError aoti_torch_cpu_index_Tensor(AtenTensorHandle, const AtenTensorHandle**, int64_t,
                                           AtenTensorHandle*);
}

namespace clw {

typedef int (*conv_fn)(const cl_conv_args*, uintptr_t, uintptr_t, int, unsigned long long, long long,
                       uintptr_t, unsigned long long, uintptr_t, uintptr_t, const uintptr_t*);
typedef const char* (*error_fn)(void);
typedef int (*copy_fn)(uintptr_t, uintptr_t, int, const int64_t*, const int64_t*, const int64_t*, int);
static conv_fn conv_forward = nullptr;
static error_fn conv_error = nullptr;
static copy_fn copy_strided = nullptr;  // the extension's oneDNN reorder (cl_copy_strided)
typedef int (*shuffle_fn)(uintptr_t, uintptr_t, int, const int64_t*, const int64_t*, const int64_t*, int64_t,
                          int64_t, int64_t, int);
static shuffle_fn channel_shuffle_kernel = nullptr;  // the extension's cl_channel_shuffle
typedef int (*qconv_fn)(const cl_qconv_args*, uintptr_t, float, uintptr_t, unsigned long long, long long,
                        uintptr_t, uintptr_t, uintptr_t, float, uintptr_t);
static qconv_fn qconv_forward = nullptr;  // the extension's cl_qconv_forward (int8 convs)
typedef int (*qmax_pool_fn)(int, int, int, const long long*, const long long*, const long long*, const long long*,
                            const long long*, const long long*, const long long*, uintptr_t, uintptr_t);
static qmax_pool_fn qmax_pool = nullptr;  // the extension's cl_qmax_pool

[[noreturn]] static void fail(const std::string& what) { throw std::runtime_error(what); }

// The shim reports the exception text on stderr and returns non-zero.
static inline void shim(AOTITorchError rc, const char* what) {
  if (rc) fail(std::string(what) + " failed in ATen (its message is on stderr)");
}

// Owns one tensor reference; releases it when reset or destroyed, so an
// exception anywhere in a segment frees everything it allocated.
class H {
 public:
  H() = default;
  explicit H(AtenTensorHandle h) : h_(h) {}
  H(const H&) = delete;
  H& operator=(const H&) = delete;
  H(H&& o) noexcept : h_(o.h_) { o.h_ = nullptr; }
  H& operator=(H&& o) noexcept { if (this != &o) { reset(); h_ = o.h_; o.h_ = nullptr; } return *this; }
  ~H() { reset(); }
  void reset() { if (h_) { aoti_torch_delete_tensor_object(h_); h_ = nullptr; } }
  AtenTensorHandle get() const { return h_; }
  AtenTensorHandle release() { AtenTensorHandle h = h_; h_ = nullptr; return h; }
  explicit operator bool() const { return h_ != nullptr; }
 private:
  AtenTensorHandle h_ = nullptr;
};

static inline int64_t dim(const H& t) { int64_t d; shim(aoti_torch_get_dim(t.get(), &d), "dim"); return d; }
static inline const int64_t* sizes(const H& t) {
  int64_t* p; shim(aoti_torch_get_sizes(t.get(), &p), "sizes"); return p;
}
static inline const int64_t* strides(const H& t) {
  int64_t* p; shim(aoti_torch_get_strides(t.get(), &p), "strides"); return p;
}
static inline void* data(const H& t) { void* p; shim(aoti_torch_get_data_ptr(t.get(), &p), "data_ptr"); return p; }
static inline uintptr_t addr(const H& t) { return t ? (uintptr_t)data(t) : 0; }
static inline int64_t numel(const H& t) {
  int64_t n = 1, d = dim(t); const int64_t* s = sizes(t);
  for (int64_t i = 0; i < d; ++i) n *= s[i];
  return n;
}

// Segments carry float32 (4) and bfloat16 (2) data, uint8 (1) quantized activations
// (int8 convs: quant/cpp.py), and int64 (8) index tensors: the element size names the dtype.
static inline int32_t dtype_code(int es) {
  return es == 2 ? aoti_torch_dtype_bfloat16() : es == 8 ? aoti_torch_dtype_int64()
       : es == 1 ? aoti_torch_dtype_uint8() : aoti_torch_dtype_float32();
}

// Dense strides for a stride order `perm` (outermost dim first; layout.strides_for_order).
static inline void perm_strides(int nd, const int64_t* sz, const int* perm, int64_t* st) {
  int64_t acc = 1;
  for (int i = nd - 1; i >= 0; --i) { st[perm[i]] = acc; acc *= sz[perm[i]]; }
}
static inline void named_perm(int nd, bool cl, int* perm) {
  for (int i = 0; i < nd; ++i) perm[i] = i;
  if (cl && nd >= 3) { perm[nd - 1] = 1; for (int i = 1; i < nd - 1; ++i) perm[i] = i + 1; }
}
// Dense strides in torch's formula: contiguous, or channels-last (dim 1 innermost) when cl.
static inline void dense_strides(int nd, const int64_t* sz, bool cl, int64_t* st) {
  int perm[16];
  named_perm(nd, cl, perm);
  perm_strides(nd, sz, perm, st);
}

// The one order check: dense in that order, size-1 dims ignored (layout.is_in_order).
static inline bool dense_in_perm(int nd, const int64_t* sz, const int64_t* st, const int* perm) {
  int64_t want[16];
  perm_strides(nd, sz, perm, want);
  for (int i = 0; i < nd; ++i) {
    if (sz[i] == 0) return true;
    if (sz[i] != 1 && st[i] != want[i]) return false;
  }
  return true;
}
static inline bool dense_in(int nd, const int64_t* sz, const int64_t* st, bool cl) {
  int perm[16];
  named_perm(nd, cl, perm);
  return dense_in_perm(nd, sz, st, perm);
}
static inline bool dense_in(const H& t, bool cl) { return dense_in((int)dim(t), sizes(t), strides(t), cl); }

static inline H empty(int nd, const int64_t* sz, const int64_t* st, int es) {
  AtenTensorHandle h;
  shim(aoti_torch_empty_strided(nd, sz, st, dtype_code(es), aoti_torch_device_type_cpu(), 0, &h), "empty_strided");
  return H(h);
}
static inline H empty_dense(int nd, const int64_t* sz, bool cl, int es) {
  int64_t st[16];
  dense_strides(nd, sz, cl, st);
  return empty(nd, sz, st, es);
}

// A non-owning tensor over memory Python keeps alive (module constants).
static inline H blob(uintptr_t p, int nd, const int64_t* sz, const int64_t* st, int es) {
  AtenTensorHandle h;
  shim(aoti_torch_create_tensor_from_blob((void*)p, nd, sz, st, 0, dtype_code(es),
                                          aoti_torch_device_type_cpu(), 0, &h), "from_blob");
  return H(h);
}

// A view of `t` at its own storage offset. The shim's last argument is added
// to `t`'s offset (torch::inductor::_reinterpret_tensor), so it is 0 here.
static inline H alias(const H& t, int nd, const int64_t* sz, const int64_t* st) {
  AtenTensorHandle h;
  shim(aoti_torch__reinterpret_tensor(t.get(), nd, sz, st, 0, &h), "reinterpret_tensor");
  return H(h);
}

// Element size from the tensor's dtype (what segments carry: float32, bfloat16, int64).
static inline int elsize(const H& t) {
  int32_t d; shim(aoti_torch_get_dtype(t.get(), &d), "dtype");
  if (d == aoti_torch_dtype_float32()) return 4;
  if (d == aoti_torch_dtype_bfloat16()) return 2;
  if (d == aoti_torch_dtype_int64()) return 8;
  if (d == aoti_torch_dtype_uint8()) return 1;
  fail("segment tensor is not float32, bfloat16, uint8 or int64");
}

static inline int64_t storage_offset(const H& t) {
  int64_t off = -1;
  shim(aoti_torch_get_storage_offset(t.get(), &off), "storage_offset");
  return off;
}

// The allocator's free memory back to the system (glibc's malloc_trim; nothing elsewhere).
static inline void release_free_memory() {
#ifdef __GLIBC__
  malloc_trim(0);
#endif
}

// Buffers served from a segment's arena, over all segments (tests read it),
// and whether segments lay out arenas at all (measurements switch it).
static std::atomic<long long> g_arena_takes{0};
static std::atomic<int> g_arena_on{1};

// Storage a segment keeps from one call to the next. A fresh allocation
// costs page faults on every touched page of a large buffer (glibc maps and
// unmaps big blocks on each malloc/free): resnet50's 3 MB outputs ran at
// half speed. So a buffer that dies inside the segment, owned by no other
// handle (the encoder guarantees it: never an output, never viewed), goes back
// here, and a later allocation takes storage from here too.
//
// From the second call on, that storage is one arena laid out from the first
// call. The first call takes blocks (`block_take`) and records which
// instruction took how many bytes and which of those buffers came back; the
// layout (`lay_out`) puts each buffer that came back over the storage freed
// most recently that fits, merged with its neighbours, as OpenVINO's memory
// plan does: a 19 MB output then lands on the two 12.8 MB buffers that died
// just before it, still in cache, where a block pool can only offer a block
// of its size last touched a call ago (six convs of mnasnet1_0's first
// blocks at batch 8, 2 threads: 6.25 -> 5.61 ms, Sapphire Rapids-class Xeon).
// A later call takes the arena's buffers while it repeats the first call's
// allocations and releases event for event (same instruction, same bytes,
// same buffer released); from the first difference on (other sizes, other
// input strides) it takes blocks, and two such calls in a row lay out the
// arena again from the next call. A buffer that never came back (a view of it
// escapes the segment) is never in the arena: only blocks own storage.
class Pool {
 public:
  // layout: 0 recent unless 1/16 over the largest live set, 1 recent, 2 by size (config.arena_layout).
  explicit Pool(int layout = 0) : layout_(layout) {}
  // The instruction that runs next (its first word): what the layout keys on.
  void at(int64_t pc) { pc_ = pc; }

  H take(int nd, const int64_t* sz, bool cl, int es) {
    int64_t st[16];
    dense_strides(nd, sz, cl, st);
    return take(nd, sz, st, es);
  }
  // `st`: dense strides in some order.
  H take(int nd, const int64_t* sz, const int64_t* st, int es) {
    int64_t n = 1;
    for (int i = 0; i < nd; ++i) n *= sz[i];
    if (n == 0) return empty(nd, sz, st, es);
    if (!arena_on_) return block_take(nd, sz, st, es, n);
    const int64_t bytes = n * es;
    if (replaying_ && !diverged_) {
      if (k_ < trace_.size() && trace_[k_].bytes == bytes && trace_[k_].pc == pc_) {
        const int64_t id = trace_[k_++].id;
        if (offset_[(size_t)id] >= 0) {
          char* p = base_ + offset_[(size_t)id];
          live_[p] = id;
          g_arena_takes.fetch_add(1, std::memory_order_relaxed);
          return blob((uintptr_t)p, nd, sz, st, es);
        }
      } else {
        diverged_ = true;
      }
    }
    H t = block_take(nd, sz, st, es, n);
    if (!replaying_) {
      live_[data(t)] = next_id_;
      trace_.push_back(Event{pc_, bytes, next_id_++});
    }
    return t;
  }
  void give(H&& t) {
    if (!t) return;
    auto it = arena_on_ ? live_.find(data(t)) : live_.end();
    if (it != live_.end()) {
      const int64_t id = it->second;
      live_.erase(it);
      if (!replaying_) {
        trace_.push_back(Event{pc_, 0, id});
      } else {
        if (!diverged_ && k_ < trace_.size() && trace_[k_].bytes == 0 && trace_[k_].id == id) ++k_;
        else diverged_ = true;
        t.reset();  // the arena's storage: nothing to keep
        return;
      }
    }
    if (storage_offset(t) != 0) { t.reset(); return; }
    const int es = elsize(t);
    int64_t bytes = 0;
    shim(aoti_torch_get_storage_size(t.get(), &bytes), "storage_size");
    const int64_t cls = class_down(bytes / es);
    if (cls == 0) { t.reset(); return; }
    warm_.push_back(Block{std::move(t), es, cls});
  }
  // Bytes held between calls: the arena, the blocks kept for the next call, and
  // the largest set of arena buffers live at once in the call it was laid out from
  // (what the arena would be with no fragmentation).
  struct Held { int64_t arena, blocks, live_peak; };
  Held held() const { return Held{arena_top_, bytes(warm_) + bytes(cold_), live_peak_}; }
  // Call ends: what no allocation took in this call is freed; the first call's
  // record becomes the arena.
  void end_call() {
    const bool laid_out = arena_on_ && !replaying_;
    if (laid_out) {
      lay_out();
    } else if (arena_on_) {
      const bool repeated = !diverged_ && k_ == trace_.size();
      diverged_calls_ = repeated ? 0 : diverged_calls_ + 1;
      if (diverged_calls_ >= 2) forget_arena();
    }
    live_.clear();
    k_ = 0;
    diverged_ = false;
    // The first call's blocks go now that the arena serves: glibc keeps freed heap
    // memory, so give it back once (densenet121: 10 MB resident otherwise). Not for a
    // few MB: a trim walks the whole heap (~0.1 s in a fragmented GB).
    const bool trim = trim_ && !laid_out && bytes(cold_) >= (int64_t(8) << 20);
    if (!laid_out) trim_ = false;
    cold_.clear();
    if (trim) release_free_memory();
    std::swap(cold_, warm_);
    const bool on = g_arena_on.load(std::memory_order_relaxed) != 0;
    if (on != arena_on_) forget_arena();
    arena_on_ = on;
  }

 private:
  // Blocks come in size classes. A block released in this call (warm: still
  // in cache) serves any request up to half its class; one left from the
  // last call only a request of its own class. Taking a better-fitting last
  // call's block across classes let a request take the block a later,
  // larger request needed, which then allocated fresh memory (page faults)
  // every call while the block that fitted it was freed. With exact classes
  // for cold blocks, each class keeps the blocks it needs and from the
  // second call on a segment allocates only its results; warm blocks first
  // (mnasnet: 4.8 ms where cold-only exact classes took 5.3, both without
  // page faults, on Sapphire Rapids at one thread).
  H block_take(int nd, const int64_t* sz, const int64_t* st, int es, int64_t n) {
    const int64_t want = class_up(n);
    auto grab = [&](std::vector<Block>& v, std::vector<Block>::reverse_iterator it) {
      H block = std::move(it->t);
      v.erase(std::next(it).base());
      return alias(block, nd, sz, st);
    };
    auto hot = warm_.rend();
    for (auto it = warm_.rbegin(); it != warm_.rend(); ++it)
      if (it->es == es && it->cls >= want && it->cls <= 2 * want &&
          (hot == warm_.rend() || it->cls < hot->cls))
        hot = it;
    if (hot != warm_.rend()) return grab(warm_, hot);
    for (auto it = cold_.rbegin(); it != cold_.rend(); ++it)
      if (it->es == es && it->cls == want) return grab(cold_, it);
    const int64_t one = 1;
    return alias(empty(1, &want, &one, es), nd, sz, st);
  }

  // Offsets for the recorded buffers that came back, replaying the record:
  // each in the free range released most recently that fits (ranges merged
  // with free neighbours), at the piece of it released last (a merged range's
  // other part is older), else at the end (growing a free range that ends there).
  // That keeps a buffer where one just died (still in cache) but can fragment:
  // resnet50's arena came out 1.5x its largest live set. When it is more than
  // 1/16 larger than that set, a layout by size (`pack_by_size`) is used if smaller.
  void lay_out() {
    struct Range { int64_t off, size, when, hot; };  // hot: where the last piece released starts
    std::vector<Range> free;  // by offset
    std::vector<char> came_back((size_t)next_id_, 0);
    std::vector<int64_t> size((size_t)next_id_, 0);  // bytes in the arena
    offset_.assign((size_t)next_id_, -1);
    for (const Event& e : trace_)
      if (e.bytes == 0) came_back[(size_t)e.id] = 1;
    int64_t top = 0;
    for (size_t i = 0; i < trace_.size(); ++i) {
      const Event& e = trace_[i];
      const size_t id = (size_t)e.id;
      if (e.bytes > 0) {
        if (!came_back[id]) continue;
        const int64_t need = (e.bytes + 63) / 64 * 64;  // every buffer 64-byte aligned
        size[id] = need;
        size_t best = free.size();
        for (size_t f = 0; f < free.size(); ++f)
          if (free[f].size >= need && (best == free.size() || free[f].when > free[best].when)) best = f;
        if (best < free.size()) {
          const Range r = free[best];
          const int64_t at = std::min(std::max(r.hot, r.off), r.off + r.size - need);
          offset_[id] = at;
          free.erase(free.begin() + (std::ptrdiff_t)best);
          const Range after{at + need, r.off + r.size - at - need, r.when, at + need};
          if (after.size > 0) free.insert(free.begin() + (std::ptrdiff_t)best, after);
          if (at > r.off) free.insert(free.begin() + (std::ptrdiff_t)best, Range{r.off, at - r.off, r.when, r.off});
        } else if (!free.empty() && free.back().off + free.back().size == top) {
          offset_[id] = free.back().off;
          top = offset_[id] + need;
          free.pop_back();
        } else {
          offset_[id] = top;
          top += need;
        }
      } else {
        Range r{offset_[id], size[id], (int64_t)i, offset_[id]};
        auto at = std::lower_bound(free.begin(), free.end(), r,
                                   [](const Range& a, const Range& b) { return a.off < b.off; });
        at = free.insert(at, r);
        auto merge = [&](std::vector<Range>::iterator lo) {  // lo absorbs the range after it
          auto hi = std::next(lo);
          if (hi->when > lo->when) { lo->when = hi->when; lo->hot = hi->hot; }
          lo->size += hi->size;
          free.erase(hi);
        };
        if (std::next(at) != free.end() && at->off + at->size == std::next(at)->off) merge(at);
        if (at != free.begin() && std::prev(at)->off + std::prev(at)->size == at->off) merge(std::prev(at));
      }
    }
    int64_t live = 0;
    live_peak_ = 0;
    for (const Event& e : trace_) {
      if (!came_back[(size_t)e.id]) continue;
      live += e.bytes > 0 ? size[(size_t)e.id] : -size[(size_t)e.id];
      live_peak_ = std::max(live_peak_, live);
    }
    if (layout_ == 2 || (layout_ == 0 && top > live_peak_ + live_peak_ / 16)) {
      std::vector<int64_t> by_size;
      const int64_t packed_top = pack_by_size(came_back, size, by_size);
      if (packed_top < top || layout_ == 2) {
        offset_.swap(by_size);
        top = packed_top;
      }
    }
    arena_top_ = top;
    arena_.reset();
    base_ = nullptr;
    if (top > 0) {
      const int64_t words = top / 8, one = 1;
      arena_ = empty(1, &words, &one, 8);
      base_ = (char*)data(arena_);
    }
    replaying_ = true;
    trim_ = true;
  }
  // Greedy by size, as TFLite's and OpenVINO's memory solvers do: largest buffer
  // first, each at the lowest offset where it overlaps no placed buffer whose
  // lifetime (allocation to release in the record) meets its own. Returns the top.
  int64_t pack_by_size(const std::vector<char>& came_back, const std::vector<int64_t>& size,
                       std::vector<int64_t>& offset) const {
    const size_t n = (size_t)next_id_;
    std::vector<int64_t> start(n, -1), end(n, -1);
    for (size_t i = 0; i < trace_.size(); ++i) {
      const size_t id = (size_t)trace_[i].id;
      if (!came_back[id]) continue;
      (trace_[i].bytes > 0 ? start : end)[id] = (int64_t)i;
    }
    std::vector<size_t> order;
    for (size_t id = 0; id < n; ++id)
      if (came_back[id] && start[id] >= 0 && end[id] >= 0) order.push_back(id);
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return size[a] > size[b]; });
    offset.assign(n, -1);
    std::vector<size_t> placed;
    std::vector<std::pair<int64_t, int64_t>> busy;  // [offset, end) of placed buffers live at the same time
    int64_t top = 0;
    for (size_t id : order) {
      busy.clear();
      for (size_t q : placed)
        if (start[q] < end[id] && start[id] < end[q]) busy.emplace_back(offset[q], offset[q] + size[q]);
      std::sort(busy.begin(), busy.end());
      int64_t at = 0;
      for (const auto& b : busy) {
        if (b.first >= at + size[id]) break;
        at = std::max(at, b.second);
      }
      offset[id] = at;
      top = std::max(top, at + size[id]);
      placed.push_back(id);
    }
    return top;
  }
  void forget_arena() {
    trace_.clear();
    offset_.clear();
    arena_top_ = live_peak_ = 0;
    arena_.reset();
    base_ = nullptr;
    next_id_ = 0;
    diverged_calls_ = 0;
    replaying_ = false;
  }

  // Eight classes per octave (at most 12.5% slack): the smallest class size
  // at least n, and the largest at most n (0 below the smallest class).
  static int64_t class_step(int64_t n) { return int64_t(1) << ((63 - __builtin_clzll((uint64_t)n)) - 3); }
  static int64_t class_up(int64_t n) {
    if (n <= 16) return 16;
    const int64_t b = class_step(n);
    return (n + b - 1) / b * b;
  }
  static int64_t class_down(int64_t n) {
    if (n < 16) return 0;
    const int64_t b = class_step(n);
    return n / b * b;
  }
  struct Block { H t; int es; int64_t cls; };
  std::vector<Block> warm_, cold_;  // released in this call / left from the last one
  static int64_t bytes(const std::vector<Block>& v) {
    int64_t n = 0;
    for (const Block& b : v) n += b.cls * b.es;
    return n;
  }

  struct Event { int64_t pc, bytes, id; };  // an allocation (bytes > 0) or a release (bytes 0) of buffer `id`
  std::vector<Event> trace_;                // the first call's, which the arena is laid out from
  std::vector<int64_t> offset_;             // buffer id -> offset in the arena, -1: not in it
  std::unordered_map<const void*, int64_t> live_;  // storage -> buffer id, of recorded/arena buffers alive
  H arena_;
  int64_t arena_top_ = 0, live_peak_ = 0;
  int layout_ = 0;
  bool trim_ = false;  // the first call's blocks go at the end of the next: trim then
  char* base_ = nullptr;
  int64_t pc_ = -1, next_id_ = 0;
  size_t k_ = 0;                 // next event a replaying call must repeat
  bool replaying_ = false, diverged_ = false;
  bool arena_on_ = g_arena_on.load() != 0;  // changes between calls only
  int diverged_calls_ = 0;       // calls in a row that did not repeat the record
};

// `t` re-viewed as a dense tensor of sizes `sz` in the given order, taking
// over its storage (t is left empty), when it already is exactly that;
// otherwise an empty handle and `t` untouched.
static inline H take_over(H& t, int nd, const int64_t* sz, bool cl) {
  if (!t || dim(t) != nd || !std::equal(sz, sz + nd, sizes(t)) || !dense_in(t, cl) || storage_offset(t) != 0)
    return H();
  int64_t st[16];
  dense_strides(nd, sz, cl, st);
  H out = alias(t, nd, sz, st);
  t.reset();
  return out;
}

// One pool per segment, taken for the length of a call. A second thread
// running the segment at the same time finds the slot empty and works with a
// pool of its own; whichever returns last keeps its pool.
// The pool a program keeps between calls (never freed at exit: torch may be gone),
// and how its arena is laid out (Pool::lay_out).
struct PoolSlot { std::atomic<Pool*> p{nullptr}; int layout = 0; };
class PoolLease {
 public:
  explicit PoolLease(PoolSlot& s) : slot_(s), pool_(s.p.exchange(nullptr)) { if (!pool_) pool_ = new Pool(s.layout); }
  ~PoolLease() { pool_->end_call(); delete slot_.p.exchange(pool_); }
  Pool* get() { return pool_; }
  Pool* operator->() { return pool_; }
 private:
  PoolSlot& slot_;
  Pool* pool_;
};

// A tensor handed to a segment has the dtype, rank and static sizes it was
// compiled for (-1: a symbolic size): its program trusts them after this.
static inline void expect(const H& t, int es, int nd, const int64_t* want, const char* name) {
  if (dim(t) != nd) fail(std::string(name) + ": expected " + std::to_string(nd) + " dims, got " +
                         std::to_string(dim(t)));
  if (elsize(t) != es) fail(std::string(name) + ": unexpected dtype");
  const int64_t* s = sizes(t);
  for (int i = 0; i < nd; ++i)
    if (want[i] >= 0 && s[i] != want[i])
      fail(std::string(name) + ": size " + std::to_string(s[i]) + " at dim " + std::to_string(i) +
           ", compiled for " + std::to_string(want[i]));
}

// out = t for a layout conversion: a source dense in either named order goes
// through oneDNN's JIT reorder (ATen's copy_ walks a permuted copy 2-5x
// slower); anything else, or strides oneDNN's descriptors refuse (odd
// strides of size-1 dims), through ATen's copy_. Segments hold f32 or bf16.
static inline void convert_into(H& out, const H& t) {
  const int nd = (int)dim(t), es = elsize(t);
  if (copy_strided && (es == 4 || es == 2) && nd <= 12 && (dense_in(t, false) || dense_in(t, true)) &&
      copy_strided(addr(t), addr(out), nd, sizes(t), strides(t), strides(out), es == 4 ? 0 : 1) == 0)
    return;
  shim(aoti_torch_copy_(out.get(), t.get(), 0), "copy_");
}

// Layout copies made (runtime.COPIES counts them as the Python wrapper's own).
static std::atomic<long long> layout_copies{0};

// A copy of `t` dense in the stride order `perm` (outermost dim first), on
// `pool`'s storage when given one: the one place layout copies are made and counted.
static inline H copy_in_perm(const H& t, const int* perm, Pool* pool = nullptr) {
  const int nd = (int)dim(t);
  int64_t st[16];
  perm_strides(nd, sizes(t), perm, st);
  H out = pool ? pool->take(nd, sizes(t), st, elsize(t)) : empty(nd, sizes(t), st, elsize(t));
  convert_into(out, t);
  layout_copies.fetch_add(1, std::memory_order_relaxed);
  return out;
}
// The same for a named order (layout.to_order's conversion).
static inline H copy_in_order(const H& t, bool cl, Pool* pool = nullptr) {
  int perm[16];
  named_perm((int)dim(t), cl, perm);
  return copy_in_perm(t, perm, pool);
}
// `t` itself when it is dense in the order, else a copy held by `tmp`.
static inline const H& ordered(const H& t, bool cl, H& tmp, Pool* pool = nullptr) {
  if (dense_in(t, cl)) return t;
  tmp = copy_in_order(t, cl, pool);
  return tmp;
}
// Memory walks the dims in `perm` without overlap: dense tensors and slices
// of them (layout.is_in_order, the rule the plan and the Python wrapper use
// for an explicit order; size-1 dims ignored, a size-0 dim is in every order).
static inline bool in_order_perm(int nd, const int64_t* sz, const int64_t* st, const int* perm) {
  for (int i = 0; i < nd; ++i) if (sz[i] == 0) return true;
  int prev = -1;
  for (int i = 0; i < nd; ++i) {
    const int d = perm[i];
    if (sz[d] == 1) continue;
    if (prev >= 0 && st[prev] < st[d] * sz[d]) return false;
    prev = d;
  }
  return true;
}
// The same for an explicit stride order (eager's own permutation of the dims);
// a tensor already in that order is used as it is, as the Python wrapper does.
static inline const H& ordered_perm(const H& t, const int* perm, H& tmp, Pool* pool = nullptr) {
  const int nd = (int)dim(t);
  if (in_order_perm(nd, sizes(t), strides(t), perm)) return t;
  tmp = copy_in_perm(t, perm, pool);
  return tmp;
}

// Nearest 2-D upsampling to (oh, ow) in the output's planned layout. The C shim
// exports no upsample forward, so this is ours; the source index is ATen's
// (nearest_idx in UpSample.h) so results are bit-identical.
static inline int64_t nearest_src(int64_t o, int64_t in, int64_t out) {
  if (out == in) return o;
  if (out == 2 * in) return o >> 1;
  const float scale = (float)in / (float)out;
  const int64_t i = (int64_t)std::floor((float)o * scale);
  return i < in - 1 ? i : in - 1;
}

static inline H upsample_nearest2d(const H& x, int64_t oh, int64_t ow, bool cl) {
  const int es = elsize(x);
  const int64_t* s = sizes(x);
  const int64_t* ist = strides(x);
  const int64_t n = s[0], c = s[1], h = s[2], w = s[3];
  const int64_t osz[4] = {n, c, oh, ow};
  H out = empty_dense(4, osz, cl, es);
  const int64_t* ost = strides(out);
  std::vector<int64_t> iy(oh), ix(ow);
  for (int64_t o = 0; o < oh; ++o) iy[o] = nearest_src(o, h, oh);
  for (int64_t o = 0; o < ow; ++o) ix[o] = nearest_src(o, w, ow);
  const char* src = (const char*)data(x);
  char* dst = (char*)data(out);
  const bool rows = ist[1] == 1 && ost[1] == 1;  // channels innermost on both sides: copy C at once
#pragma omp parallel for collapse(2) if (n * oh * ow * c > 16384)
  for (int64_t b = 0; b < n; ++b)
    for (int64_t y = 0; y < oh; ++y)
      for (int64_t xo = 0; xo < ow; ++xo) {
        const char* sp = src + (b * ist[0] + iy[y] * ist[2] + ix[xo] * ist[3]) * es;
        char* dp = dst + (b * ost[0] + y * ost[2] + xo * ost[3]) * es;
        if (rows) { std::memcpy(dp, sp, (size_t)(c * es)); continue; }
        for (int64_t k = 0; k < c; ++k) std::memcpy(dp + k * ost[1] * es, sp + k * ist[1] * es, (size_t)es);
      }
  return out;
}

// Sizes broadcast right-aligned to nd dims (a kernel's output shape).
static inline void broadcast_sizes(const H* const* ins, int n, int nd, int64_t* out) {
  for (int d = 0; d < nd; ++d) out[d] = 1;
  for (int i = 0; i < n; ++i) {
    const int k = (int)dim(*ins[i]); const int64_t* s = sizes(*ins[i]);
    if (k > nd) fail("kernel input has more dims than its output");
    for (int d = 0; d < k; ++d) {
      int64_t& o = out[nd - k + d];
      if (s[d] != 1) {
        if (o != 1 && o != s[d]) fail("kernel inputs do not broadcast");
        o = s[d];
      }
    }
  }
}
// Strides of `t` viewed at `sz` (broadcast dims get stride 0).
static inline void broadcast_strides(const H& t, int nd, const int64_t* sz, int64_t* out) {
  const int k = (int)dim(t); const int64_t* s = sizes(t); const int64_t* st = strides(t);
  for (int d = 0; d < nd; ++d) out[d] = 0;
  for (int d = 0; d < k; ++d) out[nd - k + d] = (s[d] == sz[nd - k + d] && s[d] != 1) ? st[d] : 0;
}

// Strides of .view(new sizes), or false when eager view would need a copy
// (port of at::detail::computeStride, as layout.view_strides).
static inline bool view_strides(int nd, const int64_t* sz, const int64_t* st, int nn,
                                const int64_t* nsz, int64_t* nst) {
  int64_t numel = 1;
  for (int i = 0; i < nd; ++i) numel *= sz[i];
  if (nd == 0 || numel == 0) { dense_strides(nn, nsz, false, nst); return true; }
  int view_d = nn - 1;
  int64_t chunk_base = st[nd - 1], tensor_numel = 1, view_numel = 1;
  for (int d = nd - 1; d >= 0; --d) {
    tensor_numel *= sz[d];
    if (d == 0 || (sz[d - 1] != 1 && st[d - 1] != tensor_numel * chunk_base)) {
      while (view_d >= 0 && (view_numel < tensor_numel || nsz[view_d] == 1)) {
        nst[view_d] = view_numel * chunk_base;
        view_numel *= nsz[view_d];
        view_d--;
      }
      if (view_numel != tensor_numel) return false;
      if (d > 0) { chunk_base = st[d - 1]; tensor_numel = 1; view_numel = 1; }
    }
  }
  return view_d == -1;
}

static inline H view(const H& t, int nn, const int64_t* nsz) {
  int64_t nst[16];
  if (!view_strides((int)dim(t), sizes(t), strides(t), nn, nsz, nst))
    fail("view: the input's strides do not allow this view");
  return alias(t, nn, nsz, nst);
}

// aten::as_strided: sizes and strides over `t`'s storage, at storage offset `off` (-1: t's own).
static inline H as_strided(const H& t, int nd, const int64_t* sz, const int64_t* st, int64_t off) {
  AtenTensorHandle h;
  // reinterpret_tensor adds its offset to t's own.
  shim(aoti_torch__reinterpret_tensor(t.get(), nd, sz, st, off < 0 ? 0 : off - storage_offset(t), &h),
       "as_strided");
  return H(h);
}

// aten::slice with step 1 (also a split's piece), a view: start and end
// clamped to dim `d`'s size as ATen clamps them (negative: from the end).
static inline H slice(const H& t, int d, int64_t start, int64_t end, int64_t step = 1) {
  const int nd = (int)dim(t);
  const int64_t n = sizes(t)[d];
  auto clamp = [n](int64_t i) { if (i < 0) i += n; return i < 0 ? 0 : i > n ? n : i; };
  const int64_t lo = clamp(start), hi = std::max(lo, clamp(end));
  int64_t sz[16], st[16];
  std::copy(sizes(t), sizes(t) + nd, sz);
  std::copy(strides(t), strides(t) + nd, st);
  sz[d] = (hi - lo + step - 1) / step;
  st[d] *= step;
  AtenTensorHandle h;
  shim(aoti_torch__reinterpret_tensor(t.get(), nd, sz, st, lo * strides(t)[d], &h), "slice");
  return H(h);
}

// x.expand(want) as ATen's inferExpandGeometry: -1 keeps a size, a size-1 dim
// broadcast and every new leading dim get stride 0 (a view).
static inline H expand(const H& t, int nd, const int64_t* want) {
  const int td = (int)dim(t);
  if (nd < td || nd > 16) throw std::runtime_error("expand: fewer dims than the tensor's");
  int64_t sz[16], st[16];
  for (int i = nd - 1; i >= 0; --i) {
    const int j = i - (nd - td);
    int64_t size = j >= 0 ? sizes(t)[j] : 1;
    int64_t stride = j >= 0 ? strides(t)[j] : (i + 1 < nd ? sz[i + 1] * st[i + 1] : 1);
    const int64_t target = want[i] == -1 ? size : want[i];
    if (want[i] == -1 && j < 0) throw std::runtime_error("expand: -1 for a new dim");
    if (size != target) {
      if (size != 1) throw std::runtime_error("expand: a dim of size other than 1 cannot grow");
      size = target;
      stride = 0;
    }
    sz[i] = size; st[i] = stride;
  }
  return alias(t, nd, sz, st);
}

// x.select(d, i): the slice at i with dim d dropped (a view).
static inline H select(const H& t, int d, int64_t i) {
  const int nd = (int)dim(t);
  const int64_t n = sizes(t)[d];
  if (i < -n || i >= n) throw std::runtime_error("select: index out of range");
  if (i < 0) i += n;
  int64_t sz[16], st[16];
  for (int k = 0, j = 0; k < nd; ++k) {
    if (k == d) continue;
    sz[j] = sizes(t)[k]; st[j] = strides(t)[k]; ++j;
  }
  AtenTensorHandle h;
  shim(aoti_torch__reinterpret_tensor(t.get(), nd - 1, sz, st, i * strides(t)[d], &h), "select");
  return H(h);
}

// aten::cat's result size: the parts' sizes (all of out's rank), summed along `d`.
static inline void cat_sizes(const H* const* parts, int n, int d, int64_t* osz) {
  const int nd = (int)dim(*parts[0]);
  std::copy(sizes(*parts[0]), sizes(*parts[0]) + nd, osz);
  for (int i = 1; i < n; ++i) {
    if (dim(*parts[i]) != nd) fail("cat: parts of different ranks");
    for (int k = 0; k < nd; ++k)
      if (k != d && sizes(*parts[i])[k] != osz[k]) fail("cat: sizes differ outside the cat dim");
    osz[d] += sizes(*parts[i])[d];
  }
}

// One row of a cat's part: whole 64-byte blocks as fixed-size copies the
// compiler inlines as vector moves, the rest by memcpy. A libc memcpy call per
// row cost ~10 ns, and DenseNet's bf16 parts are one 64-byte row per pixel.
static inline void copy_row(char* d, const char* s, int64_t len) {
  for (; len >= 64; d += 64, s += 64, len -= 64) __builtin_memcpy(d, s, 64);
  if (len > 0) std::memcpy(d, s, (size_t)len);
}

// aten::cat along `d` into `out`, dense in the named order `cl` (the plan's).
// A part dense in that order is rows of bytes, one per index of the dims
// outside `d` in memory. Many rows (channels-last cats: one per pixel): threads
// over rows, each writing its output rows whole, part after part (densenet121's
// cats under AMP, batch 1, 1 thread: 2.30 -> 1.24 ms in the graph against a
// thread per row and part, which divided per row and called memcpy per part). Few long rows (contiguous cats):
// threads over rows x parts. ATen's serial cat kernel took twice OpenVINO's
// concat on squeezenet's channels-last cats. Any other part goes through ATen's
// copy_ into its slice.
static inline void cat_into(H& out, const H* const* parts, int n, int d, bool cl) {
  const int nd = (int)dim(out), es = elsize(out);
  const int64_t* osz = sizes(out);
  int perm[16];
  named_perm(nd, cl, perm);
  int k = 0;
  while (perm[k] != d) ++k;
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < k; ++i) outer *= osz[perm[i]];
  for (int i = k + 1; i < nd; ++i) inner *= osz[perm[i]];
  const int64_t orow = osz[d] * inner * es;
  char* dst = (char*)data(out);
  struct Run { const char* src; int64_t off, len; };
  std::vector<Run> runs;
  int64_t at = 0;
  for (int i = 0; i < n; ++i) {
    const H& p = *parts[i];
    const int64_t c = sizes(p)[d];
    if (c > 0 && dense_in_perm(nd, sizes(p), strides(p), perm)) {
      runs.push_back(Run{(const char*)data(p), at * inner * es, c * inner * es});
    } else if (c > 0) {
      H piece = slice(out, d, at, at + c);
      shim(aoti_torch_copy_(piece.get(), p.get(), 0), "cat");
    }
    at += c;
  }
  const bool big = outer * orow >= (1 << 16);
  if (outer >= 64) {
#pragma omp parallel for schedule(static) if (big)
    for (int64_t o = 0; o < outer; ++o) {
      char* row = dst + o * orow;
      for (const Run& r : runs) copy_row(row + r.off, r.src + o * r.len, r.len);
    }
    return;
  }
  const int64_t items = outer * (int64_t)runs.size();
#pragma omp parallel for schedule(static) if (items > 1 && big)
  for (int64_t it = 0; it < items; ++it) {
    const int64_t o = it / (int64_t)runs.size();
    const Run& r = runs[it % runs.size()];
    std::memcpy(dst + o * orow + r.off, r.src + o * r.len, (size_t)r.len);
  }
}

// ops.channel_shuffle(x, g, start, ...) into `out` (its channel range's sizes,
// laid out as the caller chose): csrc/shuffle.cpp in the extension.
static inline void channel_shuffle_into(H& out, const H& x, int64_t g, int64_t start) {
  if (channel_shuffle_kernel((uintptr_t)data(x), (uintptr_t)data(out), (int)dim(out), sizes(out), strides(x),
                             strides(out), sizes(x)[1], g, start, elsize(x)) != 0)
    fail("channel_shuffle: arguments the kernel refused");
}

// aten::clone into fresh storage `out` laid out as the caller chose.
static inline void copy_into(H& out, const H& t) { shim(aoti_torch_copy_(out.get(), t.get(), 0), "clone"); }

// torch.roll(t, shifts, dims) into `out` (t's sizes): every rolled dim splits into
// two blocks that trade places, so 2^k block copies, each a strided ATen copy.
static inline void roll_into(H& out, const H& t, int k, const int64_t* dims, const int64_t* shifts) {
  for (int64_t m = 0; m < (int64_t(1) << k); ++m) {
    H src = alias(t, (int)dim(t), sizes(t), strides(t));
    H dst = alias(out, (int)dim(out), sizes(out), strides(out));
    bool empty = false;
    for (int j = 0; j < k; ++j) {
      const int d = (int)dims[j];
      const int64_t n = sizes(t)[d];
      const int64_t s = n ? ((shifts[j] % n) + n) % n : 0;
      // block 0: t[0, n-s) -> out[s, n); block 1: t[n-s, n) -> out[0, s)
      const bool hi = (m >> j) & 1;
      if ((hi ? s : n - s) == 0) { empty = true; break; }
      src = slice(src, d, hi ? n - s : 0, hi ? n : n - s);
      dst = slice(dst, d, hi ? 0 : s, hi ? s : n);
    }
    if (!empty) copy_into(dst, src);
  }
}

// ATen's reshape: the view when the strides allow it, else a view of a contiguous copy.
static inline H reshape(const H& t, int nn, const int64_t* nsz) {
  int64_t nst[16];
  if (view_strides((int)dim(t), sizes(t), strides(t), nn, nsz, nst)) return alias(t, nn, nsz, nst);
  H c = copy_in_order(t, false);
  return view(c, nn, nsz);
}

static inline H permute(const H& t, int nd, const int* perm) {
  int64_t sz[16], st[16];
  const int64_t* s = sizes(t); const int64_t* r = strides(t);
  for (int i = 0; i < nd; ++i) { sz[i] = s[perm[i]]; st[i] = r[perm[i]]; }
  return alias(t, nd, sz, st);
}

static inline H unsqueeze(const H& t, int d) {
  const int nd = (int)dim(t);
  int64_t sz[16], st[16];
  const int64_t* s = sizes(t); const int64_t* r = strides(t);
  for (int i = 0, j = 0; i <= nd; ++i) {
    if (i == d) { sz[i] = 1; st[i] = d < nd ? r[d] * s[d] : 1; }
    else { sz[i] = s[j]; st[i] = r[j]; ++j; }
  }
  return alias(t, nd + 1, sz, st);
}

static inline void check_order(const H& t, bool cl, const char* name) {
  if (!dense_in(t, cl))
    fail(std::string("buffer ") + name + " was planned " + (cl ? "channels_last" : "contiguous") +
         " but the segment produced other strides");
}

static inline int64_t floordiv(int64_t a, int64_t b) {
  int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
static inline int64_t pymod(int64_t a, int64_t b) { int64_t r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }

static int report(const std::exception& e, char* err, int errlen) {
  std::snprintf(err, (size_t)errlen, "%s", e.what());
  return 1;
}

}  // namespace clw

extern "C" long long cl_layout_copies(void) { return clw::layout_copies.load(std::memory_order_relaxed); }

extern "C" void cl_segment_init(uintptr_t conv, uintptr_t error, uintptr_t copy, uintptr_t shuffle,
                                uintptr_t qconv, uintptr_t qmax_pool) {
  clw::conv_forward = (clw::conv_fn)conv;
  clw::qconv_forward = (clw::qconv_fn)qconv;
  clw::qmax_pool = (clw::qmax_pool_fn)qmax_pool;
  clw::conv_error = (clw::error_fn)error;
  clw::copy_strided = (clw::copy_fn)copy;
  clw::channel_shuffle_kernel = (clw::shuffle_fn)shuffle;
}
