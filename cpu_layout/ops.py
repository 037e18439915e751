"""Forward convolutions on cpu_layout's own oneDNN primitives.

    y = cpu_layout.ops.conv2d(x, w, b, stride=2, padding=1,
                              post_ops=[("add", residual), "relu"],
                              out_layout="nhwc")

Inference only. Inputs may have any strides: NCHW- and NHWC-dense tensors are
used in place, anything else is copied once into the layout of the output.
Weights are reordered once per (tensor, version) and kept in the extension's
cache; primitives are cached by problem shape (LRU, see `set_cache_capacity`).
"""
from __future__ import annotations

import itertools
import math
import threading
import weakref
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from cpu_layout import _native
from cpu_layout.layout import (CHANNELS_LAST, channels_last_strides, contiguous_strides, eager_memory_format,
                               is_in_order, same_sizes)
from cpu_layout._native import ffi, lib

# impl_rank of cpu_layout's own Winograd F(2x2, 3x3) convolution (csrc/winograd.cpp).
WINOGRAD = lib.CL_IMPL_WINOGRAD
# impl_rank MERGE_GROUPS + m: a grouped conv as one of groups / m groups on a block-diagonal
# weight (csrc/conv.cpp, build_merged), where oneDNN has fast kernels only for wider groups.
MERGE_GROUPS = lib.CL_IMPL_MERGE_GROUPS
_MERGE_FACTORS = (2, 4, 8, 16)


def merged_groups(impl_rank: int) -> int:
    """m of an impl_rank MERGE_GROUPS + m, else 1."""
    return impl_rank - MERGE_GROUPS if impl_rank > MERGE_GROUPS else 1


def merge_candidates(dtype, in_channels: int, out_channels: int, groups: int) -> tuple:
    """The merge factors worth timing for a grouped conv: groups of fewer than 16 input
    or output channels widened to 16 and to 32 (where oneDNN's AMX and brgemm kernels
    start), m dividing groups; none for depthwise convs (their own kernels are fast)."""
    icg, ocg = in_channels // groups, out_channels // groups
    if groups == 1 or icg == 1 or dtype not in (torch.float32, torch.bfloat16) or min(icg, ocg) >= 16:
        return ()
    return tuple(m for m in _MERGE_FACTORS
                 if groups % m == 0 and min(icg, ocg) * m in (16, 32))

__all__ = [
    "conv1d",
    "conv2d",
    "conv3d",
    "POST_OPS",
    "cache_stats",
    "clear_caches",
    "set_cache_capacity",
    "impl_name",
]

_DTYPES = {torch.float32: lib.CL_F32, torch.bfloat16: lib.CL_BF16}

# name -> (kind, default alpha, default beta, number of float parameters)
POST_OPS = {
    "relu": (lib.CL_PO_RELU, 0.0, 0.0, 0),
    "leaky_relu": (lib.CL_PO_RELU, 0.01, 0.0, 1),
    "silu": (lib.CL_PO_SILU, 1.0, 0.0, 0),
    "gelu": (lib.CL_PO_GELU_ERF, 0.0, 0.0, 0),
    "gelu_erf": (lib.CL_PO_GELU_ERF, 0.0, 0.0, 0),
    "gelu_tanh": (lib.CL_PO_GELU_TANH, 0.0, 0.0, 0),
    "hardswish": (lib.CL_PO_HARDSWISH, 0.0, 0.0, 0),
    "sigmoid": (lib.CL_PO_SIGMOID, 0.0, 0.0, 0),
    "tanh": (lib.CL_PO_TANH, 0.0, 0.0, 0),
    "relu6": (lib.CL_PO_CLAMP, 0.0, 6.0, 0),
    "clamp": (lib.CL_PO_CLAMP, float("-inf"), float("inf"), 2),
    "add": (lib.CL_PO_ADD, 0.0, 0.0, 0),
}

PostOp = Union[str, tuple]

_CL_FORMAT = {1: None, 2: torch.channels_last, 3: torch.channels_last_3d}


# ---- weight identity ---------------------------------------------------------

# Bumped by refresh(): part of every key that says "module state unchanged".
_state_epoch = 0
# Inference tensors keep no version counter; this stands in for it (negative,
# so it never equals a real counter).
INFERENCE_VERSION = -2


def content_version(t: torch.Tensor) -> int:
    """The tensor's version counter, which PyTorch bumps on every in-place change.

    Inference tensors (made under torch.inference_mode()) have none, and an
    in-place change made to one inside inference mode leaves no trace:
    their contents are taken as unchanged until refresh() says otherwise.
    """
    return INFERENCE_VERSION if t.is_inference() else t._version


def state_epoch() -> int:
    return _state_epoch


def refresh() -> None:
    """Declare that module state may have changed where PyTorch cannot tell
    (an inference tensor modified in place inside inference mode, a write
    through `tensor.data`): every folded or reordered weight is recomputed
    from the current parameters on the next call."""
    global _state_epoch
    with _serial_lock:
        _state_epoch += 1
    lib.cl_clear_caches()


_serials = itertools.count(1)
_serial_lock = threading.Lock()


def _weight_serial(w: torch.Tensor) -> int:
    """A number that names this tensor object for as long as it lives.

    Unlike id() or data_ptr(), it is never reused, so a new tensor that lands
    at a dead one's address cannot pick up the dead one's reordered copy. When
    the tensor dies, the extension drops its copies.
    """
    serial = getattr(w, "_cpu_layout_serial", None)
    if serial is None:
        with _serial_lock:
            serial = getattr(w, "_cpu_layout_serial", None)
            if serial is None:
                serial = next(_serials)
                w._cpu_layout_serial = serial
                weakref.finalize(w, lib.cl_weight_release, serial)
    return serial


# ---- argument handling -------------------------------------------------------


def _tuple(v, n, name):
    if isinstance(v, int) and not isinstance(v, bool):
        return (v,) * n
    try:
        t = tuple(int(i) for i in v)
    except TypeError:
        raise TypeError(f"{name} must be an int or a sequence of {n} ints, got {v!r}") from None
    if len(t) == 1:
        t = t * n
    if len(t) != n:
        raise ValueError(f"{name} must have {n} values for a {n}-d convolution, got {v!r}")
    return t


def _layout_flag(out_layout, nsp):
    """Return True for channels-last output, False for contiguous, None for 'like torch'."""
    if out_layout is None or out_layout == "auto":
        return None
    if out_layout in ("nchw", "ncw", "ncdhw", "contiguous", torch.contiguous_format):
        return False
    if out_layout in ("nhwc", "nwc", "ndhwc", "channels_last", torch.channels_last, torch.channels_last_3d):
        return True
    raise ValueError(
        f"out_layout must be None, 'contiguous'/'nchw' or 'channels_last'/'nhwc', got {out_layout!r}"
    )


def is_channels_last_dense(t: torch.Tensor) -> bool:
    """Memory is dense with channels innermost (NWC / NHWC / NDHWC).

    Sizes of 1 are ignored, as torch's own contiguity checks do: such a
    dimension's stride never addresses memory.
    """
    if t.dim() == 3:
        return t.transpose(1, 2).is_contiguous()
    return t.is_contiguous(memory_format=_CL_FORMAT[t.dim() - 2])


def torch_prefers_channels_last(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The output memory format eager `torch.nn.functional.convNd` picks on CPU:
    channels-last when input or weight suggests it (torch's own rule, ported once
    in `layout.eager_memory_format`)."""
    if x.dim() == 3:
        return False
    return CHANNELS_LAST in (eager_memory_format(x.shape, x.stride()),
                             eager_memory_format(w.shape, w.stride()))


def empty_dense(size, dtype, channels_last: bool) -> torch.Tensor:
    """A new tensor dense in NCHW, or in NWC/NHWC/NDHWC when `channels_last`."""
    if not channels_last:
        return torch.empty(size, dtype=dtype)
    if len(size) == 3:
        n, c, w = size
        return torch.empty((n, w, c), dtype=dtype).transpose(1, 2)
    return torch.empty(size, dtype=dtype, memory_format=_CL_FORMAT[len(size) - 2])


_COPY_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # CL_F32, CL_BF16


def copy_strided(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """out.copy_(t) for tensors of one size and dtype (float32/bfloat16) on
    oneDNN's JIT reorder: a layout conversion between dense orders runs 2-5x
    faster than ATen's element-wise permuted copy. Strides must be ones a
    oneDNN memory descriptor takes (each dim's stride at least the span of the
    dims inside it: permutations and slices, not interleaved step slices);
    anything else raises RuntimeError."""
    if out.shape != t.shape or out.dtype != t.dtype or t.dtype not in _COPY_DTYPES:
        raise ValueError("copy_strided needs tensors of one size and dtype, float32 or bfloat16")
    nd = t.dim()
    buf = ffi.new("int64_t[]", [*t.shape, *t.stride(), *out.stride()] or [0])
    _native.check(lib.cl_copy_strided(t.data_ptr(), out.data_ptr(), nd, buf, buf + nd, buf + 2 * nd,
                                      _COPY_DTYPES[t.dtype]))
    return out


def channel_shuffle(x: torch.Tensor, groups: int, start: int = 0, end=None) -> torch.Tensor:
    """`torch.native_channel_shuffle(x, groups)[:, start:end]` as a dense tensor
    in x's memory format (channels-last when x is channels-last dense), by
    csrc/shuffle.cpp for float32/bfloat16 CPU tensors (ATen's ops otherwise).
    Result channel j*groups + i is input channel i*(C/groups) + j."""
    if x.dim() < 3:
        raise ValueError(f"channel_shuffle needs a tensor of 3 or more dims, got {x.dim()}")
    c = x.shape[1]
    end = c if end is None else end
    if groups <= 0 or c % groups or not 0 <= start <= end <= c:
        raise ValueError(f"channel_shuffle: {c} channels in {groups} groups, range [{start}, {end})")
    cl = x.dim() in (4, 5) and not x.is_contiguous() and is_channels_last_dense(x)
    fmt = _CL_FORMAT[x.dim() - 2] if cl else torch.contiguous_format
    if x.dtype not in _COPY_DTYPES or x.device.type != "cpu":
        return torch.native_channel_shuffle(x, groups)[:, start:end].contiguous(memory_format=fmt)
    size = (x.shape[0], end - start, *x.shape[2:])
    out = torch.empty(size, dtype=x.dtype, memory_format=fmt)
    nd = x.dim()
    buf = ffi.new("int64_t[]", [*size, *x.stride(), *out.stride()])
    if lib.cl_channel_shuffle(x.data_ptr(), out.data_ptr(), nd, buf, buf + nd, buf + 2 * nd, c, groups, start,
                              x.element_size()) != 0:
        raise ValueError(f"channel_shuffle: arguments the kernel refused (size {tuple(x.shape)})")
    return out


def to_dense(t: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """`t` dense in NCHW or in channels-last (a no-op when it already is; size-1 dims ignored).
    Between the two dense orders of a 4-D/5-D float tensor: oneDNN's reorder."""
    if channels_last:
        if is_channels_last_dense(t):
            return t
        if t.dim() == 3:
            return t.transpose(1, 2).contiguous().transpose(1, 2)
        fmt = _CL_FORMAT[t.dim() - 2]
        if t.is_contiguous():
            out = _reordered(t, fmt)
            if out is not None:
                return out
        return t.contiguous(memory_format=fmt)
    if t.is_contiguous():
        return t
    if t.dim() in (4, 5) and is_channels_last_dense(t):
        out = _reordered(t, torch.contiguous_format)
        if out is not None:
            return out
    return t.contiguous()


def _reordered(t: torch.Tensor, fmt):
    """`t` copied into `fmt` by oneDNN's reorder, or None where it does not apply
    (dtype, device, strides of size-1 dims its descriptors refuse): ATen then."""
    if t.dtype not in _COPY_DTYPES or t.device.type != "cpu":
        return None
    try:
        return copy_strided(torch.empty_like(t, memory_format=fmt), t)
    except RuntimeError:
        return None


def _parse_post_ops(post_ops: Sequence[PostOp]):
    parsed = []
    for po in post_ops or ():
        if isinstance(po, str):
            name, params = po, ()
        elif isinstance(po, (tuple, list)) and po and isinstance(po[0], str):
            name, params = po[0], tuple(po[1:])
        else:
            raise ValueError(f"post-op must be a name or a (name, *params) tuple, got {po!r}")
        if name not in POST_OPS:
            raise ValueError(f"unknown post-op {name!r}; supported: {', '.join(sorted(POST_OPS))}")
        kind, alpha, beta, nparams = POST_OPS[name]
        if name == "add":
            if len(params) != 1 or not isinstance(params[0], torch.Tensor):
                raise ValueError("post-op 'add' takes exactly one tensor: ('add', residual)")
            parsed.append((kind, 0.0, 0.0, params[0]))
            continue
        if len(params) > nparams:
            raise ValueError(f"post-op {name!r} takes {nparams} parameter(s), got {len(params)}")
        if name == "clamp":
            lo = params[0] if len(params) > 0 and params[0] is not None else alpha
            hi = params[1] if len(params) > 1 and params[1] is not None else beta
            if lo > hi:
                raise ValueError(f"clamp needs low <= high, got {lo} > {hi}")
            alpha, beta = float(lo), float(hi)
        elif nparams == 1 and params:
            alpha = float(params[0])
        parsed.append((kind, alpha, beta, None))
    if len(parsed) > lib.CL_MAX_POST_OPS:
        raise ValueError(f"at most {lib.CL_MAX_POST_OPS} post-ops, got {len(parsed)}")
    return parsed


@dataclass(frozen=True)
class _Problem:
    """A validated convolution: the C struct (shared, read-only) and what the
    Python side needs per call. Cached by the call's shapes and options."""

    args: object  # cdata `cl_conv_args *`
    out_size: tuple
    dst_cl: bool
    src_cl: bool
    copy_src: bool  # input memory is neither NCHW- nor NHWC-dense
    w_cl: bool
    copy_w: bool


_problems: dict = {}
_problems_lock = threading.Lock()
_PROBLEM_CACHE_MAX = 4096


def _fmt_class(t):
    """0: dense contiguous, 1: dense channels-last, 2: both (size-1 dims), 3: neither."""
    cf = t.is_contiguous()
    cl = is_channels_last_dense(t)
    return 2 if cf and cl else 0 if cf else 1 if cl else 3


TRANSPOSED_1X1 = 4  # a weight class beside _fmt_class's: 1x1, stored [in][out]


def is_transposed_1x1(size, stride) -> bool:
    """A 1x1 conv weight [out, in, 1...] stored [in][out] (a linear's [in, out]
    matrix read transposed, GPT-2's Conv1D): oneDNN packs it as it is (w_cl 2)."""
    return (len(size) >= 3 and all(k == 1 for k in size[2:]) and size[0] > 1 and size[1] > 1
            and stride[0] == 1 and stride[1] == size[0])


def weight_format(size, stride) -> Optional[int]:
    """oneDNN's w_cl flag for a weight of these sizes and strides (0 contiguous, 1
    channels-last, 2 a 1x1 weight stored [in][out]), None if none of those."""
    if same_sizes(stride, contiguous_strides(size)):
        return 0
    if len(size) in (4, 5) and is_in_order(size, stride, CHANNELS_LAST):
        return 1
    if all(type(s) is int for s in size) and is_transposed_1x1(size, stride):
        return 2
    return None


def _weight_fmt_class(w):
    c = _fmt_class(w)
    return TRANSPOSED_1X1 if c == 3 and is_transposed_1x1(tuple(w.shape), w.stride()) else c


def _hashable(v):
    return tuple(v) if isinstance(v, (list, tuple)) else v


def _post_op_key(post_ops):
    """Post-ops without their tensors, plus the residuals in order."""
    if not post_ops:
        return (), ()
    key, tensors = [], []
    for po in post_ops:
        if isinstance(po, str):
            key.append(po)
        elif isinstance(po, (tuple, list)) and po and po[0] == "add":
            key.append(("add", len(po)) + tuple(type(t).__name__ for t in po[1:]))
            tensors.extend(t for t in po[1:] if isinstance(t, torch.Tensor))
        else:
            key.append(tuple(po) if isinstance(po, (tuple, list)) else (po,))
    return tuple(key), tuple(tensors)


def conv_out_spatial(in_sp, kernel, stride, pad_l, pad_r, dilation) -> tuple:
    """A convolution's output spatial sizes, as torch computes them (one formula for the
    conv calls and the planner's graphs)."""
    return tuple((i + a + b - d * (k - 1) - 1) // s + 1
                 for i, k, s, a, b, d in zip(in_sp, kernel, stride, pad_l, pad_r, dilation))


def _validate(nsp, x, weight, bias, stride, padding, dilation, groups, post_ops, out_layout, xfmt, wfmt,
              impl_rank=0):
    """Check everything about a call that does not change between calls with the same key."""
    for name, t in (("input", x), ("weight", weight), ("bias", bias)):
        if t is not None and t.device.type != "cpu":
            raise ValueError(f"{name} is on {t.device}; cpu_layout runs on the CPU only")
    if x.dtype not in _DTYPES:
        raise TypeError(f"input dtype must be float32 or bfloat16, got {x.dtype}")
    # A float32 weight of a bf16 conv is converted while packed (no bf16 copy kept).
    if weight.dtype != x.dtype and not (weight.dtype == torch.float32 and x.dtype == torch.bfloat16):
        raise TypeError(f"input ({x.dtype}) and weight ({weight.dtype}) must have the same dtype "
                        "(or a float32 weight for a bfloat16 input)")
    if bias is not None and bias.dtype != x.dtype:
        raise TypeError(f"input ({x.dtype}) and bias ({bias.dtype}) must have the same dtype")
    if x.numel() == 0 and (x.shape[0] != 0 or 0 in x.shape[1:]):
        # An empty batch is fine (eager returns an empty result); other empty dims are not.
        raise ValueError(f"input is empty (size {tuple(x.shape)})")
    if weight.numel() == 0:
        raise ValueError(f"weight is empty (size {tuple(weight.shape)})")
    if not isinstance(groups, int) or isinstance(groups, bool) or groups <= 0:
        raise ValueError(f"groups must be a positive int, got {groups!r}")
    n, ic = x.shape[0], x.shape[1]
    oc, icg = weight.shape[0], weight.shape[1]
    if ic % groups or oc % groups:
        raise ValueError(
            f"in_channels ({ic}) and out_channels ({oc}) must be divisible by groups ({groups})"
        )
    if icg * groups != ic:
        raise ValueError(
            f"input has {ic} channels but weight {tuple(weight.shape)} with groups={groups} "
            f"expects {icg * groups}"
        )
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != oc):
        raise ValueError(f"bias must have size ({oc},), got {tuple(bias.shape)}")

    stride = _tuple(stride, nsp, "stride")
    dilation = _tuple(dilation, nsp, "dilation")
    if any(s <= 0 for s in stride):
        raise ValueError(f"stride must be positive, got {stride}")
    if any(d <= 0 for d in dilation):
        raise ValueError(f"dilation must be positive, got {dilation}")
    in_sp = tuple(x.shape[2:])
    k_sp = tuple(weight.shape[2:])
    if isinstance(padding, str):
        if padding == "valid":
            pad_l = pad_r = (0,) * nsp
        elif padding == "same":
            if any(s != 1 for s in stride):
                raise ValueError("padding='same' is not supported for strided convolutions")
            total = [d * (k - 1) for d, k in zip(dilation, k_sp)]
            pad_l = tuple(t // 2 for t in total)
            pad_r = tuple(t - t // 2 for t in total)  # torch pads the odd one on the right
        else:
            raise ValueError(f"padding must be 'valid', 'same', an int or a tuple, got {padding!r}")
    else:
        pad_l = pad_r = _tuple(padding, nsp, "padding")
        if any(p < 0 for p in pad_l):
            raise ValueError(f"padding must be non-negative, got {padding!r}")
    for i in range(nsp):
        if in_sp[i] + pad_l[i] + pad_r[i] < dilation[i] * (k_sp[i] - 1) + 1:
            raise ValueError(
                f"kernel {k_sp} (dilation {dilation}) is larger than the padded input "
                f"{tuple(s + a + b for s, a, b in zip(in_sp, pad_l, pad_r))}"
            )
    out_sp = conv_out_spatial(in_sp, k_sp, stride, pad_l, pad_r, dilation)

    parsed = _parse_post_ops(post_ops)
    dst_cl = _layout_flag(out_layout, nsp)
    if dst_cl is None:
        dst_cl = torch_prefers_channels_last(x, weight)
    # Dense NCHW/NHWC input is used in place; anything else is copied into
    # the output's layout. When both fit (size-1 dims) the bytes are the same.
    src_cl = dst_cl if xfmt in (2, 3) else xfmt == 1
    w_cl = wfmt == 1
    if wfmt == TRANSPOSED_1X1 and (groups != 1 or not (isinstance(impl_rank, int) and 0 <= impl_rank <= 8)):
        wfmt = 3  # only oneDNN's own kernels read it: copied contiguous per call

    a = ffi.new("cl_conv_args *")
    a.nsp = nsp
    a.dtype = _DTYPES[x.dtype]
    a.has_bias = bias is not None
    a.bias_dtype = _DTYPES[bias.dtype] if bias is not None else 0
    a.src_cl = src_cl
    a.dst_cl = dst_cl
    a.w_cl = 2 if wfmt == TRANSPOSED_1X1 else int(w_cl)
    if not (isinstance(impl_rank, int) and (0 <= impl_rank <= 8 or impl_rank == WINOGRAD
                                            or merged_groups(impl_rank) in _MERGE_FACTORS)):
        raise ValueError("impl_rank must be an int in 0..8, ops.WINOGRAD or ops.MERGE_GROUPS + m "
                         f"(m in {_MERGE_FACTORS}), got {impl_rank!r}")
    if groups % merged_groups(impl_rank):
        raise ValueError(f"impl_rank ops.MERGE_GROUPS + {merged_groups(impl_rank)}: the factor must "
                         f"divide groups ({groups})")
    a.impl_rank = impl_rank
    a.n, a.ic, a.oc, a.groups = n, ic, oc, groups
    for i in range(nsp):
        a.in_sp[i], a.k_sp[i], a.out_sp[i] = in_sp[i], k_sp[i], out_sp[i]
        a.stride[i], a.dilation[i] = stride[i], dilation[i]
        a.pad_l[i], a.pad_r[i] = pad_l[i], pad_r[i]
    a.n_post_ops = len(parsed)
    for i, (kind, alpha, beta, _) in enumerate(parsed):
        a.post_ops[i].kind = kind
        a.post_ops[i].alpha = alpha
        a.post_ops[i].beta = beta
    return _Problem(a, (n, oc, *out_sp), dst_cl, src_cl, xfmt == 3, w_cl, wfmt == 3)


def _problem(nsp, x, weight, bias, stride, padding, dilation, groups, post_ops, out_layout, impl_rank=0):
    xfmt = _fmt_class(x)
    wfmt = 0 if weight.is_contiguous() else _weight_fmt_class(weight)
    po_key, residuals = _post_op_key(post_ops)
    key = (
        nsp, x.dtype, x.shape, xfmt, weight.dtype, weight.shape, wfmt,
        None if bias is None else (bias.dtype, bias.shape, bias.dim()),
        _hashable(stride), _hashable(padding), _hashable(dilation), groups, po_key,
        out_layout if isinstance(out_layout, (str, type(None))) else str(out_layout), impl_rank,
    )
    try:
        prob = _problems.get(key)
    except TypeError:  # unhashable option: validate and fail with the reason
        prob, key = None, None
    if prob is None:
        prob = _validate(nsp, x, weight, bias, stride, padding, dilation, groups, post_ops,
                         out_layout, xfmt, wfmt, impl_rank)
        if key is not None:
            with _problems_lock:
                if len(_problems) >= _PROBLEM_CACHE_MAX:
                    _problems.clear()
                _problems[key] = prob
    return prob, residuals


def _run(nsp, x, weight, bias, stride, padding, dilation, groups, post_ops, out_layout, impl_rank=0, out=None,
         weight_scale=None):
    """`weight_scale`: float32 [out channels], multiplied into the weight when it is
    packed (a folded batch-norm); the pair is cached by both tensors' serials. A
    float32 weight of a bfloat16 input is converted when packed."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError("input and weight must be tensors")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError("bias must be a tensor or None")
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        raise RuntimeError(
            "cpu_layout convolutions are inference-only: run under torch.no_grad() or "
            "torch.inference_mode()"
        )
    unbatched = x.dim() == nsp + 1
    if unbatched:
        x = x.unsqueeze(0)
    if x.dim() != nsp + 2:
        raise ValueError(
            f"conv{nsp}d expects a {nsp + 1}-d (unbatched) or {nsp + 2}-d input, got size {tuple(x.shape)}"
        )
    if weight.dim() != nsp + 2:
        raise ValueError(f"conv{nsp}d expects a {nsp + 2}-d weight, got size {tuple(weight.shape)}")
    prob, residuals = _problem(nsp, x, weight, bias, stride, padding, dilation, groups, post_ops, out_layout,
                               impl_rank)
    if prob.copy_src:
        x = to_dense(x, prob.dst_cl)
    if prob.copy_w:
        # Copied on every call: keep odd-strided weights contiguous yourself.
        weight = weight.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    if weight_scale is not None and (weight_scale.dtype != torch.float32 or not weight_scale.is_contiguous()
                                     or weight_scale.shape != (weight.shape[0],)):
        raise ValueError(f"weight_scale must be a contiguous float32 tensor of {weight.shape[0]} values, "
                         f"got {weight_scale.dtype} {tuple(weight_scale.shape)}")
    res_ptrs = ffi.NULL
    if residuals:
        kept = []
        for r in residuals:
            if tuple(r.shape) != prob.out_size:
                raise ValueError(
                    f"residual for 'add' must have the output's size {prob.out_size}, got {tuple(r.shape)}"
                )
            if r.dtype != x.dtype:
                raise TypeError(f"residual dtype {r.dtype} differs from the input's {x.dtype}")
            if r.device.type != "cpu":
                raise ValueError(f"residual is on {r.device}; cpu_layout runs on the CPU only")
            kept.append(to_dense(r, prob.dst_cl))
        residuals = kept  # keeps converted copies alive through the call
        res_ptrs = ffi.new("uintptr_t[]", [r.data_ptr() for r in kept])
    y = empty_dense(prob.out_size, x.dtype, prob.dst_cl) if out is None else _checked_out(out, prob, x.dtype)
    if y.numel() == 0:  # an empty batch: oneDNN takes no zero-sized problem
        return y.squeeze(0) if unbatched else y
    rc = lib.cl_conv_forward_packing(
        prob.args,
        x.data_ptr(),
        weight.data_ptr(),
        _DTYPES[weight.dtype],
        _weight_serial(weight),
        content_version(weight),
        weight_scale.data_ptr() if weight_scale is not None else 0,
        _weight_serial(weight_scale) if weight_scale is not None else 0,
        bias.data_ptr() if bias is not None else 0,
        y.data_ptr(),
        res_ptrs,
    )
    _native.check(rc)
    return y.squeeze(0) if unbatched else y


def _checked_out(out, prob, dtype) -> torch.Tensor:
    if not isinstance(out, torch.Tensor) or out.device.type != "cpu":
        raise TypeError("out must be a CPU tensor")
    size = prob.out_size
    want = channels_last_strides(size) if prob.dst_cl else contiguous_strides(size)  # as empty_dense makes
    if tuple(out.shape) != size or out.dtype != dtype or out.stride() != want:
        raise ValueError(f"out must be {size} {dtype} with strides {want}, got "
                         f"{tuple(out.shape)} {out.dtype} with strides {out.stride()}")
    return out


# ---- torch's bundled oneDNN: the other candidate for a channels-last conv -------------
#
# torch ships its own (newer) oneDNN behind torch.ops.mkldnn._convolution_pointwise.
# Per conv it is sometimes the faster one (depthwise convs with a fused swish on
# EPYC Zen 4: 0.33 vs 0.39 ms, its brgconv_dw handles the post-op better than our
# 3.2's brdgmm_dw), often not; plan/measure.py times both and the plan keeps the
# faster. It takes a plain weight (reordered per call: a few percent on the small
# depthwise/grouped weights where it can win; no packed copy to keep fresh), fuses
# at most one unary post-op, and returns a channels-last result for a channels-last
# input, so it is a candidate only for convs the plan runs in NHWC.

_ATEN_UNARY = {"relu": "relu", "silu": "swish", "hardswish": "hardswish", "sigmoid": "sigmoid",
               "tanh": "tanh", "gelu": "gelu", "gelu_erf": "gelu", "gelu_tanh": "gelu"}


def aten_conv_attr(post_ops) -> Optional[tuple]:
    """(attr, scalars, algorithm) of torch's convolution_pointwise for these
    post-ops, or None when it cannot fuse them (a residual add, more than one)."""
    ops_ = list(post_ops or ())
    if not ops_:
        return ("none", [], None)
    if len(ops_) > 1:
        return None
    po = ops_[0]
    name, params = (po, ()) if isinstance(po, str) else (po[0], tuple(po[1:]))
    if name in _ATEN_UNARY and not params:
        alg = "tanh" if name == "gelu_tanh" else "none" if _ATEN_UNARY[name] == "gelu" else None
        return (_ATEN_UNARY[name], [], alg)
    if name == "relu6" and not params:
        return ("hardtanh", [0.0, 6.0], None)
    if name == "clamp" and len(params) == 2 and all(isinstance(v, (int, float)) and math.isfinite(v)
                                                    for v in params):
        return ("hardtanh", [float(params[0]), float(params[1])], None)
    if name == "leaky_relu" and len(params) <= 1:
        return ("leaky_relu", [float(params[0]) if params else 0.01], None)
    return None


def aten_conv_candidate(dtype, in_size, out_size, post_ops) -> Optional[tuple]:
    """aten_conv_attr for a float32/bfloat16 2-D conv torch's oneDNN can run here,
    else None. Its result follows `suggest_memory_format`, which calls a tensor
    with a channel or spatial size of 1 contiguous (a linear run as a [1, K, 1, M]
    conv came back NCHW): those stay on ours, whose output layout is the plan's."""
    if dtype not in (torch.float32, torch.bfloat16) or len(in_size) != 4 or len(out_size) != 4:
        return None
    if not all(type(v) is int and v > 1 for v in (*in_size[1:], *out_size[1:])):
        return None
    return aten_conv_attr(post_ops)


def winograd_candidate(dtype, kernel, stride, padding, dilation, groups, post_ops) -> bool:
    """Whether cpu_layout's Winograd F(2x2, 3x3) can run a 2-D conv (in NHWC):
    float32, or bfloat16 on a CPU with native bf16, 3x3, stride 1, padding 1,
    no dilation or groups, and post-ops its output transform applies (ReLU and
    leaky ReLU, clamps, residual adds; csrc/winograd.cpp's `unsupported` is the
    rule in C++)."""
    kinds = {lib.CL_PO_RELU, lib.CL_PO_CLAMP, lib.CL_PO_ADD}
    names = [p if isinstance(p, str) else p[0] for p in post_ops]
    dtypes = (torch.float32, torch.bfloat16) if lib.cl_native_bf16() else (torch.float32,)
    return (dtype in dtypes and groups == 1 and tuple(kernel) == (3, 3) and tuple(stride) == (1, 1)
            and tuple(padding) == (1, 1) and tuple(dilation) == (1, 1)
            and all(n in POST_OPS and POST_OPS[n][0] in kinds for n in names))


def aten_conv2d(x, weight, bias, stride, padding, dilation, groups, attr: tuple) -> torch.Tensor:
    """A 2-D conv on torch's bundled oneDNN; `attr` from aten_conv_attr. The result is
    channels-last when `x` is."""
    unary, scalars, alg = attr
    return torch.ops.mkldnn._convolution_pointwise(x, weight, bias, list(padding), list(stride),
                                                   list(dilation), groups, unary, scalars, alg)


def conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, post_ops=(), out_layout=None,
           impl_rank=0, out=None):
    """2-d forward convolution with optional fused post-ops.

    post_ops: applied in order to conv(x) + bias. Names: relu, leaky_relu
    (slope), silu, gelu / gelu_erf, gelu_tanh, hardswish, sigmoid, tanh, relu6,
    ("clamp", low, high), ("add", residual). The residual must have the
    output's size and dtype.
    out_layout: None (the format eager torch would give), "contiguous"/"nchw"
    or "channels_last"/"nhwc" (torch memory formats work too).
    impl_rank: 0 runs oneDNN's first suitable implementation; k the k-th after
    it, when there is one (else the first); WINOGRAD cpu_layout's Winograd
    F(2x2, 3x3) (`winograd_candidate` says when); MERGE_GROUPS + m the groups
    merged m at a time (`merge_candidates`); `impl_name` tells which.
    out: a batched tensor to write the result into, of the output's size and dtype
    and dense in its layout (ValueError otherwise), as a graph's pooled buffers are:
    no allocation per call.
    """
    return _run(2, x, weight, bias, stride, padding, dilation, groups, post_ops, out_layout, impl_rank, out)


def conv1d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, post_ops=(), out_layout=None):
    """1-d forward convolution; same arguments as `conv2d` (channels-last means NWC)."""
    return _run(1, x, weight, bias, stride, padding, dilation, groups, post_ops, out_layout)


def conv3d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, post_ops=(), out_layout=None):
    """3-d forward convolution; same arguments as `conv2d` (channels-last means NDHWC)."""
    return _run(3, x, weight, bias, stride, padding, dilation, groups, post_ops, out_layout)


def impl_name(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, post_ops=(), out_layout=None,
              impl_rank=0):
    """The oneDNN implementation that runs this convolution (e.g. 'brgconv:avx2')."""
    nsp = x.dim() - 2
    if nsp not in (1, 2, 3) or weight.dim() != x.dim():
        raise ValueError("impl_name needs a batched 3/4/5-d input and a weight of the same rank")
    prob, _ = _problem(nsp, x, weight, bias, stride, padding, dilation, groups, post_ops, out_layout,
                       impl_rank)
    out = ffi.new("char[]", 256)
    _native.check(lib.cl_conv_impl_name(prob.args, out, 256))
    return ffi.string(out).decode()


def cache_stats() -> dict:
    """Counters of the extension's caches (monotonic except the *_size entries)."""
    s = ffi.new("cl_stats *")
    lib.cl_get_stats(s)
    return {
        name: getattr(s, name)
        for name in (
            "primitives_created",
            "primitive_cache_hits",
            "primitive_cache_size",
            "weight_reorders",
            "weight_cache_size",
            "converted_calls",
            "ref_primitives",
            "calls",
        )
    }


def clear_caches() -> None:
    """Drop all cached primitives and reordered weights."""
    with _problems_lock:
        _problems.clear()
    lib.cl_clear_caches()


def set_cache_capacity(n: int) -> None:
    """Maximum number of cached convolution primitives (least recently used go first)."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"cache capacity must be a positive int, got {n!r}")
    lib.cl_set_primitive_cache_capacity(n)


def cache_capacity() -> int:
    return lib.cl_primitive_cache_capacity()
