"""How each IR node reads its inputs: THE read rule, one definition for the
planner, which prices the copies it implies (plan/ir_plan.py), and both
wrappers, which make them (codegen/wrapper.py, codegen/cpp_wrapper.py and the
segment programs of codegen/program.py)."""
from __future__ import annotations

from typing import Dict

import torch

from cpu_layout import ir
from cpu_layout import layout as L
from cpu_layout import op_table as T


# ATen calls whose first input is walked densely when planned channels-last
# (the generated pool kernel); ATen's own NCHW pool is handed it dense too.
_DENSE_READING_ATEN = (torch.ops.aten.max_pool2d.default, torch.ops.aten.avg_pool2d.default)


def required(node: ir.Node, b: ir.Buffer):
    """THE read rule: the order `node` reads input `b` in, or None for as it
    is. The planner prices the same reads (plan/ir_plan.py)."""
    if isinstance(node, ir.Conv):
        # Its activation and residuals in the layout it computes in (the cost
        # model's conv); weights are the primitive's business.
        acts = node.activations()
        lay = node.out.layout
        return lay if lay in L.LABELS and b.rank == node.out.rank and any(a is b for a in acts) else None
    if not b.is_tensor or isinstance(node, (ir.Getitem, ir.Kernel, ir.Reduction, ir.Segment)):
        return None  # kernels read any strides (segments convert inside); getitem only picks
    if isinstance(node, ir.Aten) and node.target in T.SIZE_QUERIES:
        return None  # sizes: the same in any layout (the planner prices no read either)
    if isinstance(node, ir.Output) or node.rule == ir.EAGER:
        return b.eager_want()
    if node.rule in (ir.VIEW, ir.SLICE):
        return None  # a view reads what it is given; its own layout follows (schedule)
    if T.cat_reads_in_place(node):
        return None  # its parts in any order (the planner prices the read: plan/ir_plan.py)
    if node.rule == ir.DENSE:
        return L.CONTIGUOUS if any(d is b for d in node.dense_inputs()) else None
    out = node.out
    if out is None or out.layout not in L.LABELS:
        return None
    if isinstance(node, ir.Pointwise):
        # ATen's output follows full-size inputs; broadcast operands don't matter.
        return out.layout if L.same_sizes(b.size, out.size) else None
    return out.layout if b.rank == out.rank else None  # FOLLOW: same-rank inputs in our layout


def reads_dense(node: ir.Node, b: ir.Buffer) -> bool:
    """Whether `node` needs `b` dense in the order it reads it in, not just in
    that order: oneDNN convs (activation, residuals) and the kernels that walk
    dense memory (layer/group norm, softmax, 2-D pooling). The planner prices
    the same copies (plan/ir_plan.py: `dense_reads`)."""
    if isinstance(node, ir.Conv):
        return any(a is b for a in node.activations())
    if isinstance(node, ir.Norm):
        return b is node.x
    return isinstance(node, ir.Aten) and node.target in _DENSE_READING_ATEN and b is node.inputs[0]


def dense_as_planned(b: ir.Buffer) -> bool:
    """Whether the plan has `b` dense in a label (what the debug checks assert;
    a slice is only in its source's order)."""
    return b.is_tensor and b.layout in L.LABELS and b.slice_of is None


def read_conversion(node: ir.Node, b: ir.Buffer):
    """The conversion both wrappers make before `node` reads `b`: the read rule's
    order, unless the plan's strides for `b` already satisfy it (then the plan
    counts no copy, and a slice of a dense buffer is read as it is by all but
    the readers that need it dense)."""
    order = required(node, b)
    if order is None:
        return None
    strides = b.planned_strides()
    ok = (L.is_dense_in_order if reads_dense(node, b) else L.is_in_order)(b.size, strides, order)
    return None if ok else order


def conversions(nodes, wanted):
    """The conversions both wrappers make: one per (buffer, order), shared by
    every node that reads it so (as the plan counts them) and dropped after
    the last of them. `wanted(node, buffer)`: the order to convert to, or None.
    Returns ({node: {buffer: (buffer, order)}}, {(buffer, order): last reader})."""
    reads: Dict[ir.Node, Dict[ir.Buffer, tuple]] = {}
    last: Dict[tuple, ir.Node] = {}
    for n in nodes:
        if isinstance(n, ir.Input):
            continue
        for b in n.inputs:
            order = wanted(n, b)
            if order is not None:
                reads.setdefault(n, {})[b] = (b, order)
                last[(b, order)] = n
    return reads, last
