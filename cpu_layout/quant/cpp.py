"""The int8 ops inside C++ segments (the C++ wrapper): which run there, and their instructions.

An int8 conv on uint8 activations is the segment runtime's QCONV (csrc/segment_vm.cpp,
calling the extension's cl_qconv_forward): weight, scales and bias come from the
segment's constants (the weight's serial and version key its packed copy, as for
float convs), the result lands in the segment's pool, and a residual that dies at the
conv lends it its storage (oneDNN's sum adds in place); an int8 linear is QCONV over its
[M, K] input read as the channels-last [1, K, 1, M]. uint8 max pooling is QMAX_POOL
and an int8 cat the runtime's own CAT. int8 (signed) activations stay Python nodes: a
segment names a dtype by its element size, and uint8 is the one 1-byte dtype it holds
(X86InductorQuantizer quantizes activations to uint8).
"""
from __future__ import annotations

import torch

from cpu_layout import ir
from cpu_layout.ops import _parse_post_ops
from cpu_layout.quant.ops import QCat, QConv, QLinear, QMaxPool

_OUT_ES = {torch.uint8: 1, torch.float32: 4}


def _u8(b) -> bool:
    return isinstance(b, ir.Buffer) and b.is_tensor and b.dtype is torch.uint8


def _consts(*bs) -> bool:
    return all(b is None or (isinstance(b, ir.Buffer) and b.constant) for b in bs)


def conv_args(n: ir.Aten):
    """(x, weight, scales, bias, residual) of a QConv or QLinear node."""
    a = list(n.args) + [None] * (5 - len(n.args))
    return a[0], a[1], a[2], a[3], a[4]


def runs_in_cpp(n: ir.Node) -> bool:
    """Whether an int8 node runs inside a C++ segment (segments.runs_in_cpp asks)."""
    if not isinstance(n, ir.Aten) or n.kwargs:
        return False
    t = n.target
    if isinstance(t, QConv):
        x, w, scales, bias, res = conv_args(n)
        return (t.x_dtype is torch.uint8 and _u8(x) and t.out_dtype in _OUT_ES and _consts(w, scales, bias)
                and (res is None or (isinstance(res, ir.Buffer) and res.dtype is t.out_dtype))
                and all(type(v) is int for v in w.size))
    if isinstance(t, QLinear):
        x, w, scales, bias, _ = conv_args(n)
        return (t.conv.x_dtype is torch.uint8 and _u8(x) and x.rank == 2 and t.conv.out_dtype in _OUT_ES
                and _consts(w, scales, bias) and all(type(v) is int for v in w.size))
    if isinstance(t, QMaxPool):
        return _u8(n.args[0])
    if isinstance(t, QCat):
        return all(_u8(p) for p in n.args[0]) and n.out.rank >= 3
    return False


def is_weight(n: ir.Node, b: ir.Buffer) -> bool:
    """b is the int8 weight a QConv or QLinear node packs (its serial and version key the packed copy)."""
    return isinstance(n, ir.Aten) and isinstance(n.target, (QConv, QLinear)) and conv_args(n)[1] is b


def encode(em, n: ir.Aten) -> None:
    """The node's instruction (em: codegen.program.SegmentEncoder)."""
    t, p = n.target, em.p
    if isinstance(t, QMaxPool):
        x = em.read(n, n.args[0])
        out = em.out_reg(n)
        p.op("QMAX_POOL", out, x, len(t.k), t.k, t.s, t.p, t.d, int(t.ceil), em.fresh_flag(n.out),
             p.name(f"{n.name}: int8 max pool"))
        return
    if isinstance(t, QCat):
        parts = [em.read(n, b) for b in n.args[0]]
        out = em.out_reg(n)
        p.op("CAT", out, t.dim % n.out.rank, len(parts), parts, 1, 1, em.fresh_flag(n.out))
        return
    linear = isinstance(t, QLinear)
    if linear:
        t = t.conv
    x, w, scales, bias, res = conv_args(n)
    consts = em.consts
    xr = em.read(n, x)
    rr = em.read(n, res) if res is not None else -1
    inplace = em.reg[res] if res is not None and res is not x and em.may_take_over(n, res) else -1
    out = em.out_reg(n)
    post = []
    ops = [q for q in t.post_ops]
    for kind, alpha, beta, _ in _parse_post_ops([("add", torch.empty(0)) if q == "add" else q for q in ops]):
        post += [kind, p.real(alpha), p.real(beta)]
    k = [1, 1] if linear else [int(v) for v in w.size[2:]]
    p.op("QCONV", out, xr, consts.index(w), consts.index(scales), consts.index(bias) if bias is not None else -1,
         t.nsp, _OUT_ES[t.out_dtype], int(w.size[0]), t.groups, int(w.size[1]) * t.groups,
         k, t.stride, t.padding, t.dilation,
         p.real(t.x_scale), t.x_zp, p.real(t.out_scale), t.out_zp, len(ops), post,
         p.real(t.residual_scale), t.residual_zp, rr, inplace, em.fresh_flag(n.out), int(linear), p.name(n.name))
