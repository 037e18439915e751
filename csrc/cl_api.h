/* C ABI of the cpu_layout oneDNN extension.
 *
 * This header is parsed by cffi (csrc/build_ffi.py reads it verbatim), so it
 * must stay plain C declarations: no macros in declarations, no includes.
 * Every function returns 0 on success; on failure it returns non-zero and
 * writes a NUL-terminated reason into `err` (at most `errlen` bytes).
 */

enum {
    CL_F32 = 0,
    CL_BF16 = 1
};

enum {
    CL_PO_RELU = 1,      /* alpha: negative slope (0 for ReLU) */
    CL_PO_SILU = 2,
    CL_PO_GELU_TANH = 3,
    CL_PO_GELU_ERF = 4,
    CL_PO_HARDSWISH = 5,
    CL_PO_SIGMOID = 6,
    CL_PO_TANH = 7,
    CL_PO_CLAMP = 8,     /* alpha: low, beta: high */
    CL_PO_ADD = 9        /* residual tensor of dst's shape, dtype and format */
};

enum {
    CL_MAX_SPATIAL = 3,
    CL_MAX_POST_OPS = 8
};

/* impl_rank: cpu_layout's own Winograd F(2x2, 3x3) instead of a oneDNN convolution
 * (float32, 3x3, stride 1, padding 1, channels-last, ungrouped; post-ops ReLU,
 * clamp and residual adds). CL_IMPL_MERGE_GROUPS + m (m = 2, 4, 8 or 16, dividing
 * groups): a grouped conv run as one of groups / m groups of m times the channels,
 * on a block-diagonal weight (zeros between the merged groups). */
enum {
    CL_IMPL_WINOGRAD = 16,
    CL_IMPL_MERGE_GROUPS = 32
};

typedef struct {
    int kind;
    float alpha;
    float beta;
} cl_post_op;

/* Everything that identifies a convolution problem; no data pointers, so a
 * filled struct can be cached and shared by threads. Spatial arrays use the
 * first `nsp` entries. */
typedef struct {
    int nsp;             /* spatial rank: 1, 2 or 3 */
    int dtype;           /* CL_F32 or CL_BF16: src, weights, dst and residual */
    int bias_dtype;      /* dtype of bias when has_bias */
    int has_bias;
    int src_cl;          /* 1: src is channels-last (NWC/NHWC/NDHWC), 0: NCW/NCHW/NCDHW */
    int dst_cl;
    int w_cl;            /* 1: weight is channels-last (O..I), 0: contiguous (OI..), 2: a 1x1 weight
                            stored [ic][oc] (a linear's [in, out] matrix; groups 1) */
    int impl_rank;       /* 0: oneDNN's first acceptable implementation; k (up to 8): the
                            k-th one after it when there is one (measured faster), else the
                            first; CL_IMPL_WINOGRAD: cpu_layout's Winograd;
                            CL_IMPL_MERGE_GROUPS + m: groups merged m at a time */
    long long n;
    long long ic;
    long long oc;
    long long groups;
    long long in_sp[3];
    long long k_sp[3];
    long long out_sp[3];
    long long stride[3];
    long long pad_l[3];
    long long pad_r[3];
    long long dilation[3];   /* PyTorch convention: 1 means no dilation */
    int n_post_ops;
    cl_post_op post_ops[8];
} cl_conv_args;

typedef struct {
    long long primitives_created;
    long long primitive_cache_hits;
    long long primitive_cache_size;
    long long weight_reorders;
    long long weight_cache_size;
    long long converted_calls;  /* calls that converted dtype or format at the edges */
    long long ref_primitives;   /* primitives that only had a reference kernel */
    long long calls;
} cl_stats;

/* weight_id names the weight tensor with a number that is never reused;
 * together with its version counter and data pointer it keys the reordered
 * copy, so an in-place change or new storage is never served stale.
 * residuals: one pointer per CL_PO_ADD post-op, in post-op order (NULL if none). */
/* Tensors are passed as addresses (uintptr_t) so Python can hand over
 * data_ptr() values without building pointer objects on every call. */
int cl_conv_forward(const cl_conv_args *args, uintptr_t src, uintptr_t weight,
                    unsigned long long weight_id, long long weight_version,
                    uintptr_t bias, uintptr_t dst, const uintptr_t *residuals);
/* The same with work done while the weight is packed, so that no folded or cast
 * copy of it is kept: weight_dtype (CL_F32 or CL_BF16) is the dtype of the tensor at
 * `weight` (converted to args->dtype: a float32 parameter under bf16 autocast), and
 * output channel o is multiplied by weight_scale[o] (oc floats, NULL for none: a
 * folded batch-norm). scale_id names the scale tensor as weight_id names the weight:
 * a new id repacks. */
int cl_conv_forward_packing(const cl_conv_args *args, uintptr_t src, uintptr_t weight, int weight_dtype,
                            unsigned long long weight_id, long long weight_version,
                            uintptr_t weight_scale, unsigned long long scale_id,
                            uintptr_t bias, uintptr_t dst, const uintptr_t *residuals);

/* Memory the extension holds between calls: the packed copies of the weights
 * ids[0..n) (n < 0: all of them), and every thread's scratch buffers. */
long long cl_weight_bytes(const unsigned long long *ids, long long n);
long long cl_thread_buffer_bytes(void);
/* Frees the calling thread's scratch buffers (the next conv grows them again). */
void cl_release_thread_buffers(void);

/* ---- int8 convolution (csrc/qconv.cpp) ----
 * PT2E's dequantize -> conv -> post-ops -> quantize as one oneDNN primitive:
 * src u8/s8 with a per-tensor scale and zero point, weights s8 with one scale
 * per output channel (symmetric), bias f32, dst u8/s8 (requantized with
 * dst_scale and dst_zp) or f32/bf16 (dequantized: dst_scale 1, dst_zp 0).
 * Post-ops in order: CL_PO_RELU, CL_PO_CLAMP, CL_PO_HARDSWISH, CL_PO_SILU,
 * CL_PO_GELU_*, and at most one CL_PO_ADD: oneDNN's sum, the residual (dst's
 * dtype and layout) copied into dst and added as sum_scale * (r - sum_zp). */
enum {
    CL_U8 = 2,
    CL_S8 = 3
};

typedef struct {
    int nsp;             /* spatial rank: 1, 2 or 3 */
    int src_dt;          /* CL_U8 or CL_S8 */
    int dst_dt;          /* CL_U8, CL_S8, CL_F32 or CL_BF16 */
    int has_bias;        /* f32 bias */
    int src_cl;          /* 1: src channels-last, 0: contiguous */
    int dst_cl;
    int src_zp;          /* zero points: part of the problem (oneDNN builds other kernels for them) */
    int dst_zp;
    long long n;
    long long ic;
    long long oc;
    long long groups;
    long long in_sp[3];
    long long k_sp[3];
    long long out_sp[3];
    long long stride[3];
    long long pad_l[3];
    long long pad_r[3];
    long long dilation[3];   /* PyTorch convention: 1 means no dilation */
    int n_post_ops;
    cl_post_op post_ops[8];
    float sum_scale;     /* the CL_PO_ADD residual's scale and zero point */
    int sum_zp;
} cl_qconv_args;

/* weight: s8 [oc][ic/groups][k...] contiguous; weight_scales: oc floats; residual: NULL
 * without CL_PO_ADD. Scales are run-time arguments (one primitive serves every layer of
 * the same shape); weight_id/version key the packed weight as for cl_conv_forward. */
int cl_qconv_forward(const cl_qconv_args *args, uintptr_t src, float src_scale, uintptr_t weight,
                     unsigned long long weight_id, long long weight_version, uintptr_t weight_scales,
                     uintptr_t bias, uintptr_t dst, float dst_scale, uintptr_t residual);

/* Implementation name oneDNN chose for this int8 problem (builds it if needed). */
int cl_qconv_impl_name(const cl_qconv_args *args, char *out, int outlen);

/* Max pooling of a u8/s8 tensor (dtype CL_U8 or CL_S8), NCHW or NHWC (cl), on oneDNN's
 * pooling primitive: what int8 tensors flow through between int8 convs (ATen's
 * channels-last uint8 max pool fails on large inputs). dst has the same dtype and layout.
 * k, s, pad_l, pad_r, dilation (PyTorch's: 1 is none): nsp values each. */
int cl_qmax_pool(int nsp, int dtype, int cl, const long long *src_dims, const long long *dst_dims,
                 const long long *k, const long long *s, const long long *pad_l, const long long *pad_r,
                 const long long *dilation, uintptr_t src, uintptr_t dst);

const char *cl_last_error(void);

/* Implementation name oneDNN chose for this problem (builds it if needed). */
int cl_conv_impl_name(const cl_conv_args *args, char *out, int outlen);

/* Drop every reordered copy of one weight (called when the tensor dies). */
void cl_weight_release(unsigned long long weight_id);

void cl_get_stats(cl_stats *out);
void cl_clear_caches(void);
void cl_set_primitive_cache_capacity(int capacity);
int cl_primitive_cache_capacity(void);

/* dst = src for one tensor between two strided layouts (a layout conversion:
 * NCHW <-> NHWC and the like) on oneDNN's JIT reorder, primitives cached by
 * (dims, strides, dtype). ATen's copy_ walks a permuted copy element-wise,
 * 2-5x slower on these. dtype: CL_F32 or CL_BF16. */
int cl_copy_strided(uintptr_t src, uintptr_t dst, int ndims, const int64_t *dims,
                    const int64_t *src_strides, const int64_t *dst_strides, int dtype);

/* dst = native_channel_shuffle(src, groups)[:, start:start + dst_dims[1]]
 * for float32/bfloat16 (elsize 4/2) in any strides of either tensor; src has
 * dst's dims but src_channels channels. Returns 0, or 1 for invalid arguments. */
int cl_channel_shuffle(uintptr_t src, uintptr_t dst, int ndims, const int64_t *dst_dims,
                       const int64_t *src_strides, const int64_t *dst_strides, int64_t src_channels,
                       int64_t groups, int64_t start, int elsize);

/* Pins the worker threads of a `threads`-wide OpenMP team (thread numbers
 * 1..threads-1) to one CPU each of the caller's affinity set, other than the
 * CPU the caller runs on; the caller stays unpinned. Returns the number
 * pinned: 0 when threads <= 1 or there are fewer CPUs than threads, -1 when
 * the affinity set cannot be read. pin = 0 gives the workers the caller's
 * whole set back (returns the number unpinned). */
int cl_pin_omp_workers(int threads, int pin);

/* Runtime facts. */
int cl_dnnl_version(int *major, int *minor, int *patch);
int cl_cpu_isa(char *out, int outlen);
int cl_native_bf16(void);
