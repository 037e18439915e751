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
from cpu_layout import op_table as T
from cpu_layout import runtime
from cpu_layout.codegen.specs import generated


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
    pack_from_float32_weights(g)
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
        if force == "merge_groups":
            factors = ops.merge_candidates(n.x.dtype, L.hint(n.x.size[1]), L.hint(n.out.size[1]), n.groups)
            if factors:
                n.impl_rank = ops.MERGE_GROUPS + max(factors)
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


def pack_from_float32_weights(g: ir.Graph) -> None:
    """A bf16 conv whose weight is a cast of a constant float32 weight (autocast's
    `_to_copy`) and which the extension packs itself (`runtime.packs_own_weight`)
    reads the float32 weight: it is converted while packing, so the packed copy is
    the only one kept (resnet50 under autocast kept a 51 MB bf16 copy beside it)."""
    for n in list(g.nodes):
        if not (isinstance(n, ir.Pointwise) and n.op == "to" and n.out.constant):
            continue
        src, cast = n.inputs[0], n.out
        if not (src.constant and src.dtype is torch.float32 and cast.dtype is torch.bfloat16
                and L.same_sizes(src.eager_stride, cast.eager_stride)):
            continue
        convs = cast.users
        if not convs or g.output is not None and cast in ir.values_of(g.output.values):
            continue
        if not all(isinstance(c, ir.Conv) and c.weight is cast and runtime.packs_own_weight(c)
                   and c.x.dtype is torch.bfloat16 and c.inputs.count(cast) == 1 for c in convs):
            continue
        for c in list(convs):
            g.replace_input(c, cast, src)
            c.weight = src
        g.remove(n)


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
        elif T.own_cat(n):
            runners[n] = runtime.CatCall(n.out.layout)
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
