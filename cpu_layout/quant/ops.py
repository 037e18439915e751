"""INT8 convolution on cpu_layout's oneDNN (csrc/qconv.cpp), as a graph calls it.

`QConv` is one quantized conv of a graph, its static arguments fixed when the
graph is compiled: called with the quantized input, the int8 weight, its
per-channel scales and zero points, the bias and (for a fused residual add)
the quantized residual, it returns the conv's output channels-last, quantized
(uint8/int8) or dequantized (float32), as

    quantize(post_ops(conv(dequantize(x), dequantize(w)) + bias [+ dequantize(r)]))

computes it in eager PyTorch, up to one quantization step where a value lands
on a rounding boundary (oneDNN sums in int32 and rescales once; eager sums the
dequantized floats).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from cpu_layout._native import ffi, lib
from cpu_layout.op_table import pool_args
from cpu_layout.ops import (POST_OPS, _weight_serial, content_version, conv_out_spatial, empty_dense,
                            is_channels_last_dense, to_dense)

_DT = {torch.uint8: lib.CL_U8, torch.int8: lib.CL_S8, torch.float32: lib.CL_F32, torch.bfloat16: lib.CL_BF16}
_RANGE = {torch.uint8: (0, 255), torch.int8: (-128, 127)}


def full_range(dtype, qmin, qmax) -> bool:
    """oneDNN saturates to the whole uint8/int8 range: only such quantizations fuse."""
    return dtype in _RANGE and (qmin, qmax) == _RANGE[dtype]


def dequantize(q: torch.Tensor, scale: float, zp: int) -> torch.Tensor:
    """quantized_decomposed.dequantize_per_tensor's formula."""
    return (q.to(torch.float32) - zp) * scale


def quantize(y: torch.Tensor, scale: float, zp: int, dtype) -> torch.Tensor:
    """quantized_decomposed.quantize_per_tensor's formula (round half to even)."""
    lo, hi = _RANGE[dtype]
    return torch.clamp(torch.round(y * (1.0 / scale)) + zp, lo, hi).to(dtype)


# Layout copies the int8 ops made of their inputs (tests: an int8 graph makes only
# the copies its plan predicts).
COPIES = {"count": 0}


def channels_last(t: torch.Tensor) -> torch.Tensor:
    """t dense with channels innermost (a copy, counted, only when it is not)."""
    if is_channels_last_dense(t):
        return t
    COPIES["count"] += 1
    return to_dense(t, True)


class QConv:
    """One int8 convolution with its static arguments (see the module docstring).

    x_scale/x_zp: the input's quantization; out_dtype uint8/int8 with out_scale/out_zp,
    or float32 (dequantized output); post_ops: ops.POST_OPS names (the activations
    quant.rewrite fuses), ("clamp", lo, hi),
    and at most one "add" (then residual_scale/residual_zp describe the residual, which
    has the output's dtype)."""

    __name__ = "cpu_layout_qconv"

    def __init__(self, stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], groups: int,
                 x_scale: float, x_zp: int, x_dtype, out_dtype, out_scale: float = 1.0, out_zp: int = 0,
                 post_ops: Sequence = (), residual_scale: float = 1.0, residual_zp: int = 0):
        if x_dtype not in _RANGE:
            raise ValueError(f"int8 conv: input dtype must be uint8 or int8, got {x_dtype}")
        if out_dtype not in _DT:
            raise ValueError(f"int8 conv: output dtype must be uint8, int8, float32 or bfloat16, got {out_dtype}")
        self.nsp = len(stride)
        self.stride, self.padding, self.dilation = tuple(stride), tuple(padding), tuple(dilation)
        self.groups = int(groups)
        self.x_scale, self.x_zp, self.x_dtype = float(x_scale), int(x_zp), x_dtype
        self.out_dtype = out_dtype
        quantized = out_dtype in _RANGE
        self.out_scale = float(out_scale) if quantized else 1.0
        self.out_zp = int(out_zp) if quantized else 0
        self.post_ops = tuple(post_ops)
        self.has_residual = any(p == "add" for p in self.post_ops)
        self.residual_scale, self.residual_zp = float(residual_scale), int(residual_zp)
        self._args = {}  # input size -> the filled cl_qconv_args

    def __repr__(self):
        return (f"QConv(stride={self.stride}, padding={self.padding}, groups={self.groups}, "
                f"{self.x_dtype}->{self.out_dtype}, post_ops={self.post_ops})")

    def _make_args(self, x: torch.Tensor, w: torch.Tensor, has_bias: bool):
        a = ffi.new("cl_qconv_args *")
        a.nsp = self.nsp
        a.src_dt, a.dst_dt = _DT[self.x_dtype], _DT[self.out_dtype]
        a.has_bias = int(has_bias)
        a.src_cl = a.dst_cl = 1
        a.src_zp, a.dst_zp = self.x_zp, self.out_zp
        a.n, a.ic, a.oc, a.groups = x.shape[0], x.shape[1], w.shape[0], self.groups
        out = self.out_size(x.shape, w.shape)
        if min(out[2:]) <= 0:
            raise ValueError(f"int8 conv: kernel larger than the padded input {tuple(x.shape)}")
        for i in range(self.nsp):
            a.in_sp[i], a.k_sp[i], a.out_sp[i] = x.shape[2 + i], w.shape[2 + i], out[2 + i]
            a.stride[i], a.pad_l[i], a.pad_r[i], a.dilation[i] = (self.stride[i], self.padding[i], self.padding[i],
                                                                  self.dilation[i])
        n_post = 0
        for p in self.post_ops:
            name, params = (p, ()) if isinstance(p, str) else (p[0], p[1:])
            kind, alpha, beta, _ = POST_OPS[name]
            if params:
                alpha, beta = params
            a.post_ops[n_post].kind, a.post_ops[n_post].alpha, a.post_ops[n_post].beta = kind, alpha, beta
            n_post += 1
        a.n_post_ops = n_post
        a.sum_scale, a.sum_zp = self.residual_scale, self.residual_zp
        return a, out

    def out_size(self, x_size, w_size) -> tuple:
        """The output's size (torch's formula: ops.conv_out_spatial), symbolic sizes too."""
        sp = conv_out_spatial(x_size[2:], w_size[2:], self.stride, self.padding, self.padding, self.dilation)
        return (x_size[0], w_size[0], *sp)

    def reference(self, x, w, w_scales, w_zps, bias, residual=None):
        """The eager computation: dequantize, conv, post-ops, quantize (the fallback)."""
        xf = dequantize(x, self.x_scale, self.x_zp)
        shape = (-1,) + (1,) * (w.dim() - 1)
        wf = (w.float() - w_zps.reshape(shape).float()) * w_scales.reshape(shape).float()
        conv = {1: torch.nn.functional.conv1d, 2: torch.nn.functional.conv2d, 3: torch.nn.functional.conv3d}[self.nsp]
        y = conv(xf, wf, bias, self.stride, self.padding, self.dilation, self.groups)
        for p in self.post_ops:
            name, params = (p, ()) if isinstance(p, str) else (p[0], p[1:])
            if name == "add":
                y = y + dequantize(residual, self.residual_scale, self.residual_zp)
            elif name == "relu":
                y = torch.relu(y)
            elif name in ("relu6", "clamp"):
                lo, hi = params if params else (0.0, 6.0)
                y = torch.clamp(y, lo, hi)
            elif name == "gelu_tanh":
                y = torch.nn.functional.gelu(y, approximate="tanh")
            else:
                y = getattr(torch.nn.functional, name)(y)
        if self.out_dtype in _RANGE:
            return channels_last(quantize(y, self.out_scale, self.out_zp, self.out_dtype))
        return channels_last(y.to(self.out_dtype))

    def __call__(self, x: torch.Tensor, w: torch.Tensor, w_scales: torch.Tensor,
                 bias: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """w: symmetric int8 weights (`SymmetricWeight` checks a graph's once per change)."""
        if x.dtype != self.x_dtype or w.dtype != torch.int8 or x.dim() != self.nsp + 2:
            raise TypeError(f"int8 conv: expected a {self.nsp + 2}-d {self.x_dtype} input and an int8 weight, "
                            f"got {x.dtype} {tuple(x.shape)} and {w.dtype}")
        if residual is not None and not self.has_residual:
            raise TypeError("int8 conv: a residual was given to a conv without a residual add")
        return self.run(x, w, _weight_serial(w), content_version(w), w_scales, bias, residual)

    def run(self, x, w, serial: int, version: int, w_scales, bias=None, residual=None) -> torch.Tensor:
        """__call__ with the weight's identity given (a view of a weight keeps its source's)."""
        if x.numel() == 0:  # oneDNN takes no empty problem; eager gives an empty result
            return self.reference(x, w, w_scales, torch.zeros_like(w_scales), bias, residual)
        x = channels_last(x)
        scales = w_scales if w_scales.dtype == torch.float32 and w_scales.is_contiguous() else \
            w_scales.float().contiguous()
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            bias = bias.float().contiguous()
        key = (tuple(x.shape), tuple(w.shape), bias is not None)
        entry = self._args.get(key)
        if entry is None:
            if x.shape[1] != w.shape[1] * self.groups:
                raise ValueError(f"int8 conv: input has {x.shape[1]} channels, the weight expects "
                                 f"{w.shape[1] * self.groups}")
            entry = self._args[key] = self._make_args(x, w, bias is not None)
        args, out_size = entry
        out = empty_dense(out_size, self.out_dtype, True)
        res_addr = 0
        if self.has_residual:
            if residual is None or residual.dtype != self.out_dtype or tuple(residual.shape) != out_size:
                raise ValueError("int8 conv: the residual must have the output's size and dtype")
            residual = channels_last(residual)  # copied into the output, which the sum adds to
            res_addr = residual.data_ptr()
        rc = lib.cl_qconv_forward(args, x.data_ptr(), self.x_scale, w.data_ptr(), serial, version,
                                  scales.data_ptr(), bias.data_ptr() if bias is not None else 0, out.data_ptr(),
                                  self.out_scale, res_addr)
        if rc:
            raise RuntimeError(f"cpu_layout int8 conv failed: {ffi.string(lib.cl_last_error()).decode()}")
        return out

    def fake(self, x, w, *_rest):
        """The result's metadata for fake (meta) inputs: what the graph's fake values say."""
        return empty_dense(self.out_size(x.shape, w.shape), self.out_dtype, True)

    def impl_name(self, x: torch.Tensor, w: torch.Tensor, has_bias: bool = True) -> str:
        """oneDNN's implementation for this conv at x's size ("ref" would be a bug)."""
        args, _ = self._make_args(channels_last(x), w, has_bias)
        buf = ffi.new("char[]", 256)
        if lib.cl_qconv_impl_name(args, buf, 256):
            raise RuntimeError(ffi.string(lib.cl_last_error()).decode())
        return ffi.string(buf).decode()


class SymmetricWeight:
    """An int8 conv's weight as oneDNN takes it: per-output-channel symmetric int8 (zero
    points all 0, as X86InductorQuantizer makes them). Module state, so a graph computes it
    once per change of the weight or its zero points (memoized; the C++ wrapper's prologue);
    a weight with non-zero zero points is refused with the reason, never run wrong."""

    __name__ = "cpu_layout_symmetric_weight"

    def __init__(self, name: str):
        self.name = name

    def __call__(self, w: torch.Tensor, zero_points: torch.Tensor) -> torch.Tensor:
        if w.dtype != torch.int8:
            raise TypeError(f"int8 conv {self.name}: the weight is {w.dtype}, not int8")
        if bool(zero_points.any()):
            raise ValueError(f"int8 conv {self.name}: the weight's zero points are not all 0; cpu_layout's "
                             "int8 convs take symmetric per-channel weights (X86InductorQuantizer's)")
        return w.contiguous()

    def fake(self, w, _zero_points):
        return torch.empty(w.shape, dtype=w.dtype)


class QMaxPool:
    """max_pool2d of a uint8/int8 tensor on oneDNN (csrc/qpool.cpp): the max of quantized
    values is the quantized max, so it needs no scale. Keeps its input's layout when that
    is dense channels-last or contiguous (else channels-last). Arguments as ATen's
    max_pool2d takes them (op_table.pool_args reads them)."""

    __name__ = "cpu_layout_qmax_pool"

    def __init__(self, kernel, stride=(), padding=0, dilation=1, ceil_mode=False):
        a = pool_args(torch.ops.aten.max_pool2d.default, (None, kernel, stride, padding, dilation, ceil_mode))
        self.k, self.s, self.p, self.d = (tuple(int(v) for v in t) for t in (a.kernel, a.stride, a.padding,
                                                                              a.dilation))
        self.ceil = a.ceil_mode

    def out_size(self, size):
        out = list(size[:2])
        for i, x in enumerate(size[2:]):
            k, s, p, d = self.k[i], self.s[i], self.p[i], self.d[i]
            span = x + 2 * p - d * (k - 1) - 1
            o = (span + (s - 1 if self.ceil else 0)) // s + 1
            if self.ceil and (o - 1) * s >= x + p:  # torch: the last window starts inside the input
                o -= 1
            out.append(o)
        return tuple(out)

    @staticmethod
    def _layout_cl(x) -> bool:
        return not x.is_contiguous()

    def fake(self, x):
        """The result's metadata for a fake input (ATen's float pool gives the sizes)."""
        y = torch.ops.aten.max_pool2d.default(torch.empty(x.shape), self.k, self.s, self.p, self.d, self.ceil)
        return empty_dense(tuple(y.shape), x.dtype, self._layout_cl(x))

    def __call__(self, x: torch.Tensor, *_args) -> torch.Tensor:
        if x.dtype not in _RANGE:
            raise TypeError(f"int8 max pool: expected uint8 or int8, got {x.dtype}")
        nsp = x.dim() - 2
        if nsp != 2:
            raise ValueError(f"int8 max pool: a 2-d pool got a {x.dim()}-d input")
        cl = self._layout_cl(x)
        x = channels_last(x) if cl else x
        size = self.out_size(tuple(x.shape))
        out = empty_dense(size, x.dtype, cl)
        if out.numel() == 0:
            return out
        pad_r = [(size[2 + i] - 1) * self.s[i] + self.d[i] * (self.k[i] - 1) + 1 - x.shape[2 + i] - self.p[i]
                 for i in range(nsp)]
        pad_r = [max(v, 0) for v in pad_r]
        arr = lambda v: ffi.new("long long[]", list(v))  # noqa: E731
        rc = lib.cl_qmax_pool(nsp, _DT[x.dtype], int(cl), arr(x.shape), arr(size), arr(self.k), arr(self.s),
                              arr(self.p), arr(pad_r), arr(self.d), x.data_ptr(), out.data_ptr())
        if rc:
            raise RuntimeError(f"cpu_layout int8 max pool failed: {ffi.string(lib.cl_last_error()).decode()}")
        return out


class QCat:
    """cat of uint8/int8 tensors sharing one quantization, channels-last like the int8
    convs that read it (the planner does not lay out int8 tensors: a cat it planned
    contiguous made every reading conv copy its input back)."""

    __name__ = "cpu_layout_qcat"

    def __init__(self, dim: int):
        self.dim = dim

    def __call__(self, parts) -> torch.Tensor:
        if not parts or any(p.dtype not in _RANGE or p.dtype != parts[0].dtype for p in parts):
            raise TypeError("int8 cat: expected uint8 or int8 tensors of one dtype")
        if parts[0].dim() < 3:
            return torch.cat(parts, self.dim)
        return torch.cat([channels_last(p) for p in parts], self.dim)

    fake = __call__  # torch.cat and the layout change work on fake tensors as they are


class QLinear:
    """An int8 linear, x [M, K] (uint8/int8) times a symmetric int8 weight [N, K]: a 1x1
    `QConv` over [1, K, 1, M], which is x's own memory read channels-last (the float path's
    linear-as-conv, patterns._linear_as_conv). Result [M, N], row-major."""

    __name__ = "cpu_layout_qlinear"

    def __init__(self, x_scale: float, x_zp: int, x_dtype, out_dtype, out_scale: float = 1.0, out_zp: int = 0,
                 post_ops: Sequence = ()):
        self.conv = QConv((1, 1), (0, 0), (1, 1), 1, x_scale, x_zp, x_dtype, out_dtype, out_scale, out_zp,
                          post_ops)

    def __repr__(self):
        return f"QLinear({self.conv!r})"

    def __call__(self, x: torch.Tensor, w: torch.Tensor, w_scales: torch.Tensor,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
            raise ValueError(f"int8 linear: expected x [M, K] and weight [N, K], got {tuple(x.shape)} and "
                             f"{tuple(w.shape)}")
        m, n = x.shape[0], w.shape[0]
        x4 = x.t()[None, :, None, :]
        w4 = w.contiguous().view(n, w.shape[1], 1, 1)
        y = self.conv.run(x4, w4, _weight_serial(w), content_version(w), w_scales, bias)
        return y.view(n, m).t() if m else torch.empty((0, n), dtype=y.dtype)

    def fake(self, x, w, *_rest):
        return torch.empty((x.shape[0], w.shape[0]), dtype=self.conv.out_dtype)


def _lower_cast(lowering, n, op: str, params: tuple):
    """A quantize/dequantize call as the element-wise op `op` (codegen/expr.py): the float ops
    around it fuse with it into one generated kernel that loads and stores the int8 tensor
    (lower.py asks a call with a `lower_into` to lower itself)."""
    from cpu_layout import ir

    x = lowering.env[n.args[0]]
    out = lowering._buffer_for(n)
    lowering.g.add(ir.Pointwise(n.name, [x], out, op=op, args=[x], params=params, aten=(n.target, [x], {})))
    return out


class _Cast:
    """A quantize or dequantize node's call: static scale, zero point and int8 dtype."""

    def __init__(self, scale: float, zp: int, dtype):
        if dtype not in _RANGE:
            raise ValueError(f"{type(self).__name__}: dtype must be uint8 or int8, got {dtype}")
        self.scale, self.zp, self.dtype = float(scale), int(zp), dtype

    def __repr__(self):
        return f"{type(self).__name__}({self.scale}, {self.zp}, {self.dtype})"


class Quantize(_Cast):
    """quantize_per_tensor (float32 -> uint8/int8, the full range): the element-wise op "quant",
    fused with the float ops before it. Called as it is (a graph that kept it on ATen), torch's
    formula; the result in the input's memory order either way."""

    __name__ = "cpu_layout_quantize"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return quantize(x if x.dtype == torch.float32 else x.float(), self.scale, self.zp, self.dtype)

    def fake(self, x):
        return torch.empty_like(x, dtype=self.dtype)

    def lower_into(self, lowering, n):
        return _lower_cast(lowering, n, "quant", (self.scale, self.zp, *_RANGE[self.dtype]))


class Dequantize(_Cast):
    """dequantize_per_tensor (uint8/int8 -> float32): the element-wise op "dequant", fused
    with the float ops after it (see Quantize)."""

    __name__ = "cpu_layout_dequantize"

    def __call__(self, q: torch.Tensor) -> torch.Tensor:
        if q.dtype != self.dtype:
            raise TypeError(f"dequantize: expected {self.dtype}, got {q.dtype}")
        return dequantize(q, self.scale, self.zp)

    def fake(self, q):
        return torch.empty_like(q, dtype=torch.float32)

    def lower_into(self, lowering, n):
        return _lower_cast(lowering, n, "dequant", (self.scale, self.zp))
