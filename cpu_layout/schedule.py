"""Give every IR buffer its layout and every node the callable that runs it.

Layouts: FREE nodes (convs, pointwise) take the planner's choice; FOLLOW
nodes inherit their first tensor input's layout (ATen keeps the memory
format of what it is given); SLICE results are slices of their source in
its layout; EAGER nodes and graph inputs keep eager's strides. `runtime` holds what the callables do.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from cpu_layout import config, ir, ops
from cpu_layout import layout as L
from cpu_layout import runtime


def _propagate(g: ir.Graph, choose: Callable[[ir.Node], str]) -> None:
    for n in g.nodes:
        if n.out is None:
            continue
        b = n.out
        if not b.is_tensor:
            b.layout = None
            continue
        src = ir.slice_source(n)
        if src is not None:
            # A view of its source's memory whatever that is: in its layout, with its strides.
            b.layout = src.layout if src.layout is not None else ir.EAGER
            b.slice_of = src if b.layout != ir.EAGER else None
            continue
        if isinstance(n, ir.Input) or n.rule == ir.EAGER:
            b.layout = ir.EAGER
            continue
        if n.rule == ir.DENSE:
            b.layout = L.CONTIGUOUS
            continue
        if n.rule == ir.VIEW:
            b.layout = view_layout(n, choose(n) if b.rank in (3, 4, 5) else None)
            continue
        chosen = choose(n) if b.rank in (4, 5) else None
        if n.rule == ir.FREE:
            b.layout = chosen or L.CONTIGUOUS
        elif chosen is not None:
            b.layout = chosen  # FOLLOW op the planner gave a layout; inputs are converted to it
        else:  # FOLLOW
            first = next((i for i in n.inputs if i.is_tensor), None)
            src = first.layout if first is not None else ir.EAGER
            if src == ir.EAGER and first is not None:
                src = first.eager_order()
            b.layout = src if b.rank in (4, 5) else (ir.EAGER if src == ir.EAGER else L.CONTIGUOUS)


def view_layout(n: ir.Node, chosen=None):
    """The layout a VIEW node's result has: the plan's label when it gave one
    (a copy converts when the alias is not in it), else the alias of its
    input's layout (a label when one matches, else the explicit order), or
    contiguous when memory order allows no alias (reshape copies). A view of
    a buffer with eager's strides has eager's strides."""
    from cpu_layout.op_table import permutation_of

    if chosen is not None:
        return chosen
    src = n.inputs[0]
    if src.layout in (ir.EAGER, None):
        return ir.EAGER
    st = L.strides_for_order(src.size, src.layout)
    perm = permutation_of(n.target, n.args, src.rank)
    alias = tuple(st[d] for d in perm) if perm is not None else L.view_strides(src.size, st, n.out.size)
    if alias is None:
        return L.CONTIGUOUS
    labels = L.matching_labels(n.out.size, alias) if n.out.rank in (3, 4, 5) else (
        (L.CONTIGUOUS,) if L.is_in_order(n.out.size, alias, L.CONTIGUOUS) else ())
    return labels[0] if labels else L.stride_order(n.out.size, alias)


def _pair(v):
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return v * (2 // len(v)) if len(v) in (1, 2) else v


def pool_window(a):
    """kernel, stride (empty: the kernel) and padding of a 2-D pool's ATen arguments."""
    k = _pair(a[1])
    st = _pair(a[2]) if len(a) > 2 and a[2] else k
    return k, st, _pair(a[3] if len(a) > 3 else 0)


def pool_kernel(n: ir.Node):
    """The generated kernel that runs a max/avg pool planned channels-last
    (ATen's NCHW and NHWC kernels are 10x apart, ours vectorises over
    channels like the NHWC one but faster), or None: ATen runs it."""
    from cpu_layout.codegen.cpp_kernels import PoolKernel, _CTYPE

    aten = torch.ops.aten
    if not (isinstance(n, ir.Aten) and n.target in (aten.max_pool2d.default, aten.avg_pool2d.default)
            and not n.kwargs and n.out.layout == L.CHANNELS_LAST and n.out.rank == 4
            and n.out.dtype in _CTYPE and n.inputs[0].dtype == n.out.dtype):
        return None
    a = n.args
    if not all(type(v) in (int, bool) or v is None for v in runtime.leaves(a[1:])):
        return None
    k, st, pad = pool_window(a)
    if len(k) != 2 or len(st) != 2 or len(pad) != 2:
        return None
    if n.target is aten.max_pool2d.default:
        dil = _pair(a[4] if len(a) > 4 else 1)
        return PoolKernel(n.out.dtype, "max", k, st, pad, dil, bool(a[5]) if len(a) > 5 else False)
    return PoolKernel(n.out.dtype, "avg", k, st, pad, (1, 1), bool(a[4]) if len(a) > 4 else False,
                      bool(a[5]) if len(a) > 5 else True, a[6] if len(a) > 6 else None)


def generated(nodes):
    """The nodes that run as generated kernels, and their kernels."""
    pairs = [(n, kernel_spec(n)) for n in nodes
             if isinstance(n, (ir.Kernel, ir.Reduction, ir.Norm, ir.Aten))]
    pairs = [(n, k) for n, k in pairs if k is not None]
    return [n for n, _ in pairs], [k for _, k in pairs]


def kernel_spec(n: ir.Node):
    """The generated kernel that runs a Kernel, Reduction or Norm node,
    or a pool (None for an ATen op without one)."""
    from cpu_layout.codegen import expr as E
    from cpu_layout.codegen.cpp_kernels import (GroupNormKernel, LayerNormKernel, PointwiseKernel,
                                                ReductionKernel, SoftmaxKernel)

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


def plan(g: ir.Graph, choose: Optional[Callable[[ir.Node], str]] = None,
         kernels: bool = True) -> None:
    """Plan layouts and fuse element-wise chains into kernels.
    `kernels=False` keeps element-wise ops on ATen."""
    from cpu_layout import fuse

    if choose is None:
        from cpu_layout.plan import ir_plan

        choose = ir_plan.planner_choice(g, kernels)
    _propagate(g, choose)
    choose_conv_impls(g)
    if kernels:
        fuse.fuse_pointwise(g)


def choose_conv_impls(g: ir.Graph) -> None:
    """Each conv the plan runs in NHWC runs on what was measured fastest there
    (its ConvCost): torch's bundled oneDNN where it can run it
    (ops.aten_conv_candidate), else ours on oneDNN's first or next
    implementation or on our Winograd kernel. CPU_LAYOUT_CONV_IMPL overrides
    the measurement."""
    force = config.conv_impl()
    decided = getattr(getattr(g, "plan", None), "convs", {})
    for n in g.nodes:
        if not isinstance(n, ir.Conv):
            continue
        n.impl, n.impl_rank = "onednn", 0
        if force == "onednn" or n.out.layout != L.CHANNELS_LAST:
            continue
        if force == "onednn_next":
            n.impl_rank = 1 if n.groups > 1 else 0
            continue
        if force == "winograd":
            if n.x.rank == 4 and ops.winograd_candidate(n.x.dtype, n.weight.size[2:], n.stride, n.padding,
                                                        n.dilation, n.groups, n.post_ops):
                n.impl_rank = ops.WINOGRAD
            continue
        d = decided.get(n.out.name)
        if (ops.aten_conv_candidate(n.x.dtype, n.x.size, n.out.size, n.post_ops) is not None
                and (force == "aten" or (d is not None and d.cost.nhwc_impl == "aten"))):
            n.impl = "aten"
        elif force == "auto" and d is not None:
            n.impl_rank = d.cost.nhwc_rank


def bind(g: ir.Graph, extra_kernels=()):
    """Compile the graph's kernels and `extra_kernels` together (one compiler
    run per core: cpp_kernels.compile_library) and bind every node to what runs
    it. Returns (runners, {kernel spec: its compiled runner})."""
    from cpu_layout.codegen.cpp_kernels import compile_library

    knodes, specs = generated(g.nodes)
    everything = specs + list(extra_kernels)
    compiled = compile_library(everything, name_hint=f"graph_{len(g.nodes)}")
    by_spec = dict(zip(everything, compiled))
    runners: Dict[ir.Node, object] = {}
    for n, spec, c in zip(knodes, specs, compiled):
        if isinstance(n, ir.Kernel):
            runners[n] = runtime.KernelCall(c, n.out.dtype, n.out.layout, n.out.rank)
        elif isinstance(n, ir.LayerNorm):
            runners[n] = runtime.LayerNormCall(spec, c, n.aten)
        elif isinstance(n, ir.GroupNorm):
            runners[n] = runtime.GroupNormCall(spec, c, n.groups, n.out.layout)
        elif isinstance(n, ir.Softmax):
            runners[n] = runtime.SoftmaxCall(spec, c, n.dim)
        elif isinstance(n, ir.Aten):
            runners[n] = runtime.PoolCall(spec, c)
        else:
            runners[n] = runtime.ReductionCall(spec, c, n.out.dtype, n.out.layout, n.aten)
    for n in g.nodes:
        if n in runners:
            pass
        elif isinstance(n, ir.Conv):
            runners[n] = runtime.ConvCall(n, n.out.layout)
        elif isinstance(n, ir.Pointwise):
            runners[n] = runtime.AtenPointwise(n.aten[0], n.out.layout, n.out.dtype)
        elif isinstance(n, ir.Aten) and n.rule == ir.VIEW:
            runners[n] = runtime.ViewCall(n.target, n.out.layout)
        elif isinstance(n, ir.Aten):
            runners[n] = n.target
        if n in runners and n.out is not None and n.out.constant:
            runners[n] = runtime.Memoized(runners[n])
    return runners, by_spec


def plan_and_bind(g: ir.Graph, choose: Optional[Callable[[ir.Node], str]] = None,
                  kernels: bool = True) -> Dict[ir.Node, object]:
    """Plan, fuse and bind (the default wrapper's whole schedule)."""
    plan(g, choose, kernels)
    return bind(g)[0]
