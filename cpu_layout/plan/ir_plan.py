"""Plan an IR graph: translate it into the planner's graph model and back.

Convs, pointwise ops and layout-agnostic ATen ops become decision nodes;
layout-sensitive or unknown ATen ops are fallbacks that read their inputs in
eager's order; graph outputs must come out with eager's strides.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch

from cpu_layout import fuse, ir
from cpu_layout import layout as L
from cpu_layout import op_table as T
from cpu_layout.op_table import permutation_of
from cpu_layout.plan import graph as pg
from cpu_layout.reads import reads_dense
from cpu_layout.plan.planner import Plan, plan

aten = torch.ops.aten


def _matmul_flops(n: ir.Node) -> float:
    """2 x M x N x K (x batch) of addmm/mm/bmm, from size hints; 0 for anything else."""
    if not isinstance(n, ir.Aten) or n.target not in (aten.addmm.default, aten.mm.default, aten.bmm.default):
        return 0.0
    a = n.args[1] if n.target is aten.addmm.default else n.args[0]
    if not isinstance(a, ir.Buffer) or not n.out.is_tensor:
        return 0.0
    k = L.numel_hint(a.size[-1:])
    return 2.0 * L.numel_hint(n.out.size) * k


def to_planner_graph(g: ir.Graph, kernels: bool = True) -> pg.Graph:
    """`kernels`: element-wise nodes will run in generated kernels (else on ATen)."""
    pgraph = pg.Graph()
    known = set()
    chains = fuse.pointwise_groups(g) if kernels else {}

    def tensors(bs):
        return tuple(b.name for b in dict.fromkeys(bs) if b.is_tensor and b.name in known)

    def add(node):
        buf = g.buffers.get(node.name)
        node.constant = bool(buf is not None and buf.constant)
        made_by = buf.producer if buf is not None else None
        if made_by is not None and any(reads_dense(made_by, t) for t in made_by.inputs):
            node.dense_reads = True  # the wrappers' rule, priced
        pgraph.add(node)
        known.add(node.name)

    for n in g.nodes:
        b = n.out
        if isinstance(n, ir.Aten) and n.rule == ir.SLICE and n.multi:
            continue  # a split: its pieces are slices of its input
        src = ir.slice_source(n)
        if src is not None and src.name in known:
            add(pg.Slice(b.name, (src.name,), b.size, b.dtype))
            continue
        if isinstance(n, ir.Output):
            for i, v in enumerate(n.values):
                if isinstance(v, ir.Buffer) and v.is_tensor and v.name in known:
                    pgraph.add(pg.Output(f"output{i}", (v.name,), v.size, v.dtype, stride=v.eager_stride))
            continue
        if b is None or (not b.is_tensor and not (isinstance(n, ir.Aten) and n.multi)):
            continue  # Python scalars
        if isinstance(n, ir.Input) or isinstance(n, ir.Getitem):
            add(pg.Input(b.name, (), b.size, b.dtype, stride=b.eager_stride))
        elif isinstance(n, ir.Conv):
            residuals = n.residuals()
            k = n.weight.size[2:]
            add(pg.Conv(b.name, tensors([n.x] + residuals), b.size, b.dtype, in_size=n.x.size,
                        out_channels=b.size[1], kernel=tuple(k), stride=n.stride, padding=n.padding,
                        dilation=n.dilation, groups=n.groups, bias=n.bias is not None,
                        post_ops=tuple(n.post_op_template("add"))))
        elif isinstance(n, ir.Pointwise):
            add(pg.Pointwise(b.name, tensors(n.inputs), b.size, b.dtype, op=n.op, strided_reads=kernels,
                             fused_into_user=chains.get(n, n) is not n))
        elif isinstance(n, ir.GroupNorm):  # its result in the order it reads x in
            add(pg.Pointwise(b.name, tensors([n.x]), b.size, b.dtype, op="group_norm"))
        elif isinstance(n, ir.Reduction):
            add(pg.Reduction(b.name, tensors(n.inputs), b.size, b.dtype, dims=n.dims,
                             keepdim=n.keepdim, op=n.kind, strided_reads=True))
        elif isinstance(n, ir.Aten) and n.rule == ir.FOLLOW:
            ins = tensors(n.inputs)
            priced = T.OPS[n.target].priced if n.target in T.OPS else None
            if priced == "concat":
                add(pg.Concat(b.name, ins, b.size, b.dtype, dim=n.args[1] if len(n.args) > 1 else 0,
                              strided_reads=T.cat_reads_in_place(n)))
            elif priced is not None:
                pool = n.target in (aten.max_pool2d.default, aten.avg_pool2d.default)
                kernel = tuple(T.pool_args(n.target, n.args).kernel) if pool and len(n.args) > 1 else ()
                add(pg.Pool(b.name, ins[:1], b.size, b.dtype, op=priced,
                            kernel=kernel if all(type(k) is int for k in kernel) else ()))
            else:
                add(pg.Pointwise(b.name, ins, b.size, b.dtype, op=str(n.target)))
        elif n.rule == ir.VIEW and n.inputs[0].name in known:
            src = n.inputs[0]
            perm = permutation_of(n.target, n.args, src.rank)
            if perm is not None:
                add(pg.Permute(b.name, (src.name,), b.size, b.dtype, dims=perm))
            else:
                add(pg.View(b.name, (src.name,), b.size, b.dtype))
        else:
            ins = tensors(n.inputs)
            if not ins:
                add(pg.Input(b.name, (), b.size, b.dtype, stride=b.eager_stride))
                continue
            if not b.is_tensor:  # a tuple: its reads are priced, its Getitems enter as inputs
                b = ir.Buffer(b.name, size=(), dtype=torch.float32, eager_stride=())
            # The wrappers' read rule, priced: EAGER reads eager's orders and writes
            # eager's strides; DENSE reads its dense inputs contiguous, writes contiguous.
            by_name = {t.name: t for t in n.inputs if t.is_tensor}
            if n.rule == ir.DENSE:
                dense = {t.name for t in n.dense_inputs()}
                wants = tuple(L.CONTIGUOUS if i in dense else None for i in ins)
                stride = L.contiguous_strides(b.size)
            else:
                wants = tuple(by_name[i].eager_want() for i in ins)
                stride = b.eager_stride
            add(pg.Fallback(b.name, ins, b.size, b.dtype, wants=wants, stride=stride, flops=_matmul_flops(n)))
    return pgraph


def planner_choice(g: ir.Graph, kernels: bool = True) -> Callable[[ir.Node], str]:
    """Run the planner on `g`; return the layout chooser `schedule` applies."""
    p: Plan = plan(to_planner_graph(g, kernels))
    labels: Dict[str, str] = dict(p.label_of)
    g.plan = p

    def choose(node: ir.Node) -> str:
        return labels.get(node.out.name)

    return choose
