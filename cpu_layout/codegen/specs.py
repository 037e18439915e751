"""Which generated kernel runs an IR node: one answer for the scheduler, which
binds it, and both wrappers, which call it."""
from __future__ import annotations

import torch

from cpu_layout import ir
from cpu_layout import layout as L
from cpu_layout import runtime
from cpu_layout.codegen import expr as E
from cpu_layout.codegen.cpp_kernels import (_CTYPE, GroupNormKernel, LayerNormKernel, PointwiseKernel,
                                            PoolKernel, ReductionKernel, SoftmaxKernel)
from cpu_layout.op_table import pool_args


def pool_kernel(n: ir.Node):
    """The generated kernel that runs a max/avg pool planned channels-last
    (ATen's NCHW and NHWC kernels are 10x apart, ours vectorises over
    channels like the NHWC one but faster), or None: ATen runs it."""
    aten = torch.ops.aten
    if not (isinstance(n, ir.Aten) and n.target in (aten.max_pool2d.default, aten.avg_pool2d.default)
            and not n.kwargs and n.out.layout == L.CHANNELS_LAST and n.out.rank == 4
            and n.out.dtype in _CTYPE and n.inputs[0].dtype == n.out.dtype):
        return None
    a = n.args
    if not all(type(v) in (int, bool) or v is None for v in runtime.leaves(a[1:])):
        return None
    p = pool_args(n.target, a)
    if len(p.kernel) != 2 or len(p.stride) != 2 or len(p.padding) != 2:
        return None
    if n.target is aten.max_pool2d.default:
        return PoolKernel(n.out.dtype, "max", p.kernel, p.stride, p.padding, p.dilation, p.ceil_mode)
    return PoolKernel(n.out.dtype, "avg", p.kernel, p.stride, p.padding, p.dilation, p.ceil_mode,
                      p.count_include_pad, p.divisor)


def kernel_spec(n: ir.Node):
    """The generated kernel that runs a Kernel, Reduction or Norm node,
    or a pool (None for an ATen op without one)."""
    if isinstance(n, ir.Aten):
        return pool_kernel(n)
    if isinstance(n, ir.Softmax):
        return SoftmaxKernel(n.x.dtype, n.log)
    if isinstance(n, ir.Norm):
        params = [b.dtype for b in (n.weight, n.bias) if b is not None]
        affine = (n.weight is not None, n.bias is not None, n.eps, params[0] if params else None)
        if isinstance(n, ir.GroupNorm):
            return GroupNormKernel(n.x.dtype, *affine)
        return LayerNormKernel(n.x.dtype, n.n_norm, *affine)
    if isinstance(n, ir.Kernel):
        return PointwiseKernel([b.dtype for b in n.inputs], [(n.expr, n.out.dtype)], n.out.rank)
    return ReductionKernel(n.inputs[0].dtype, n.prologue or E.Load(0), n.kind, n.inputs[0].rank, n.dims,
                           keepdim=n.keepdim, out_dtype=n.out.dtype, epilogue=n.epilogue)


def generated(nodes):
    """The nodes that run as generated kernels, and their kernels."""
    pairs = [(n, kernel_spec(n)) for n in nodes
             if isinstance(n, (ir.Kernel, ir.Reduction, ir.Norm, ir.Aten))]
    pairs = [(n, k) for n, k in pairs if k is not None]
    return [n for n, _ in pairs], [k for _, k in pairs]
