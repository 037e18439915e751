"""PT2E's quantized patterns in an ATen graph, rewritten to int8 kernels.

A graph from `convert_pt2e` (torchao's `X86InductorQuantizer`, static) is
float ATen ops between `quantized_decomposed` quantize/dequantize nodes. This
pass runs before lowering and replaces

    dequantize(x) -> convolution(., dequantize_per_channel(w)) [-> add(., dequantize(r))]
        [-> activation] [-> quantize]                                        QConv
    addmm(bias, [view](dequantize(x)), t(dequantize_per_channel(w))) [-> view]
        [-> activation] [-> quantize]                                        QLinear
    dequantize(q) -> max_pool2d -> quantize (one scale and zero point)       QMaxPool
    cat(dequantize(q_i), ...) -> quantize (one scale and zero point)         QCat

with calls on the uint8/int8 tensors (quant/ops.py), and every other quantize or
dequantize with Quantize/Dequantize, which lower to element-wise ops that fuse
with their float neighbours. The calls' outputs are channels-last, which their
fake values say (refreshed downstream), so the planner sees int8 tensors flow
between them without copies. What does not match (a narrowed quantization range,
a weight that is not module state, autocast around the graph, per-channel
activation scales) stays as it is and runs as ATen ops, correct and slower;
CPU_LAYOUT_LOG=plan counts what was rewritten and what was left.
"""
from __future__ import annotations

import operator
import sys
from typing import Optional

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node

from cpu_layout import config
from cpu_layout.runtime import leaves
from cpu_layout.quant.ops import (Dequantize, QCat, QConv, QLinear, QMaxPool, Quantize, SymmetricWeight,
                                   full_range)

aten = torch.ops.aten


def _qd(name: str):
    """A quantized_decomposed overload, or None when torch has not registered the namespace."""
    ns = getattr(torch.ops, "quantized_decomposed", None)
    try:
        return getattr(getattr(ns, name), "default")
    except AttributeError:
        return None


def _targets():
    return {k: _qd(k) for k in ("quantize_per_tensor", "dequantize_per_tensor", "dequantize_per_channel")}


def _static(v) -> bool:
    return type(v) in (int, float)


class _DQ:
    """A dequantize_per_tensor node's source and static quantization."""

    def __init__(self, node: Node, src: Node, scale: float, zp: int, dtype):
        self.node, self.src, self.scale, self.zp, self.dtype = node, src, scale, zp, dtype


def _log(msg: str) -> None:
    if config.log_enabled("plan"):
        print(f"cpu_layout: int8: {msg}", file=sys.stderr)


def _val(n):
    return n.meta.get("val") if isinstance(n, Node) else None


class _Rewriter:
    def __init__(self, gm: GraphModule, param_nodes):
        self.gm, self.g = gm, gm.graph
        self.t = _targets()
        self.params = set(param_nodes)
        self.reasons = []

    # ---- matching --------------------------------------------------------------

    def dq_tensor(self, n) -> Optional[_DQ]:
        if not isinstance(n, Node) or n.target is not self.t["dequantize_per_tensor"] or n.kwargs.get("out_dtype"):
            return None
        src, scale, zp, qmin, qmax, dtype = n.args[:6]
        if not (_static(scale) and _static(zp) and full_range(dtype, qmin, qmax)):
            return None
        return _DQ(n, src, float(scale), int(zp), dtype)

    def q_tensor(self, n: Node):
        """(scale, zp, dtype) of a quantize_per_tensor node onto the full int8 range."""
        if n.target is not self.t["quantize_per_tensor"]:
            return None
        _x, scale, zp, qmin, qmax, dtype = n.args[:6]
        if not (_static(scale) and _static(zp) and full_range(dtype, qmin, qmax)):
            return None
        return float(scale), int(zp), dtype

    def weight(self, n):
        """(wq, scales, zero points) of a per-channel int8 weight held as module state."""
        if not isinstance(n, Node) or n.target is not self.t["dequantize_per_channel"]:
            return None
        wq, scales, zps, axis, qmin, qmax, dtype = n.args[:7]
        if axis != 0 or dtype is not torch.int8 or (qmin, qmax) != (-128, 127) or n.kwargs.get("out_dtype"):
            self.reasons.append(f"{n.name}: weight quantization (axis {axis}, {dtype}, [{qmin}, {qmax}]) "
                                "is not symmetric per output channel int8")
            return None
        if not all(isinstance(a, Node) and a in self.params for a in (wq, scales, zps)):
            self.reasons.append(f"{n.name}: the int8 weight is not module state")
            return None
        return wq, scales, zps

    @staticmethod
    def only_user(n: Node) -> Optional[Node]:
        users = list(n.users)
        return users[0] if len(users) == 1 else None

    @staticmethod
    def activation(n: Node):
        """The post-op of an activation node, or None."""
        t, a = n.target, n.args
        if t in (aten.relu.default, aten.relu_.default):
            return "relu"
        if t in (aten.hardtanh.default, aten.clamp.default) and len(a) == 3 and _static(a[1]) and _static(a[2]):
            return "relu6" if (a[1], a[2]) == (0, 6) else ("clamp", float(a[1]), float(a[2]))
        if t is aten.hardswish.default:
            return "hardswish"
        if t is aten.silu.default:
            return "silu"
        if t is aten.sigmoid.default:
            return "sigmoid"
        if t is aten.gelu.default:
            approx = n.kwargs.get("approximate", a[1] if len(a) > 1 else "none")
            return "gelu_tanh" if approx == "tanh" else "gelu"
        return None

    # ---- rewrites --------------------------------------------------------------

    def call(self, target, args, fallback=None) -> Node:
        """A call of `target` at the insertion point, with its fake value."""
        n = self.g.call_function(target, args)
        n.meta["val"] = _fake_value(target, args, {}, fallback)
        return n

    def symmetric_weight(self, name: str, wq: Node, zps: Node) -> Node:
        return self.call(SymmetricWeight(name), (wq, zps), _val(wq))

    def conv(self, c: Node) -> bool:
        x, w, b, stride, padding, dilation, transposed, _opad, groups = c.args
        dq = self.dq_tensor(x)
        if dq is None:
            return False
        weight = self.weight(w)
        cv = _val(c)
        if weight is None:
            return False
        if transposed or cv is None or cv.dtype is not torch.float32 or cv.dim() not in (3, 4, 5):
            self.reasons.append(f"{c.name}: transposed, or not a float32 conv (autocast)")
            return False
        if b is not None and not (b in self.params and _val(b).dtype is torch.float32):
            self.reasons.append(f"{c.name}: the bias is not float32 module state")
            return False
        if not all(type(v) is int for v in (*stride, *padding, *dilation, groups)):
            return False
        nsp = cv.dim() - 2

        def per_dim(v):
            v = tuple(int(i) for i in v)
            return v * nsp if len(v) == 1 else v

        # Follow the conv's single-user chain: [add(dequantized residual)] [activation] [quantize].
        # The add is fused (oneDNN's sum into the output) only when a quantize of the residual's
        # dtype ends the chain.
        start, residual, post_ops = c, None, []
        add = self.only_user(c)
        if add is not None and add.target is aten.add.Tensor and add.kwargs.get("alpha", 1) == 1:
            other = add.args[1] if add.args[0] is c else add.args[0]
            r = self.dq_tensor(other) if other is not c else None
            q_after = self.tail(add)[1] if r is not None else None
            if q_after is not None and q_after[2] == r.dtype:
                start, residual, post_ops = add, r, ["add"]
        more, q, last = self.tail(start)
        post_ops += more
        out_scale, out_zp, out_dtype = q if q is not None else (1.0, 0, torch.float32)
        call = QConv(per_dim(stride), per_dim(padding), per_dim(dilation), groups, dq.scale, dq.zp, dq.dtype,
                     out_dtype, out_scale, out_zp, post_ops,
                     residual.scale if residual else 1.0, residual.zp if residual else 0)
        wq, scales, zps = weight
        with self.g.inserting_before(last):
            w_sym = self.symmetric_weight(c.name, wq, zps)
            new = self.call(call, (dq.src, w_sym, scales, b) + ((residual.src,) if residual else ()), _val(last))
        last.replace_all_uses_with(new)
        return True

    def tail(self, start: Node):
        """After a conv or linear: [activation] [quantize]. Returns (post_ops, quantization
        (scale, zp, dtype) or None, the last node replaced)."""
        post_ops, cur, nxt = [], start, self.only_user(start)
        act = self.activation(nxt) if nxt is not None else None
        if act is not None:
            post_ops.append(act)
            cur, nxt = nxt, self.only_user(nxt)
        q = self.q_tensor(nxt) if nxt is not None else None
        return post_ops, q, (nxt if q is not None else cur)

    def linear(self, mm: Node) -> bool:
        """addmm(bias, [view](dequantize(x)), t(dequantize_per_channel(w))) [-> view] [-> activation]
        [-> quantize] (mm without the bias): an int8 linear on the quantized x."""
        if mm.kwargs.get("beta", 1) != 1 or mm.kwargs.get("alpha", 1) != 1:
            return False
        b, x, wt = (mm.args if mm.target is aten.addmm.default else (None, *mm.args))[:3]
        if not (isinstance(wt, Node) and wt.target is aten.t.default and len(wt.users) == 1):
            return False
        shape = None
        if isinstance(x, Node) and x.target in (aten.view.default, aten.reshape.default) and len(x.users) == 1:
            shape, x = x.args[1], x.args[0]
        dq = self.dq_tensor(x)
        if dq is None:
            return False
        weight = self.weight(wt.args[0])
        mv = _val(mm)
        if weight is None or mv is None or mv.dtype is not torch.float32:
            return False
        if b is not None and not (b in self.params and _val(b).dtype is torch.float32 and _val(b).dim() == 1):
            return False
        # An optional view back to the caller's shape (a linear over [..., K]): element-wise
        # post-ops commute with it.
        out_view, start = None, mm
        nxt = self.only_user(mm)
        if nxt is not None and nxt.target in (aten.view.default, aten.reshape.default):
            out_view, start = nxt.args[1], nxt
        post_ops, q, last = self.tail(start)
        out_scale, out_zp, out_dtype = q if q is not None else (1.0, 0, torch.float32)
        call = QLinear(dq.scale, dq.zp, dq.dtype, out_dtype, out_scale, out_zp, post_ops)
        wq, scales, zps = weight
        if getattr(_val(dq.src), "fake_mode", None) is None:
            return False
        with self.g.inserting_before(last):
            # The input view on the int8 tensor: a view the plan lays out.
            src = dq.src if shape is None else self.call(aten.view.default, (dq.src, shape))
            new = self.call(call, (src, self.symmetric_weight(mm.name, wq, zps), scales, b))
            if out_view is not None:
                new = self.call(aten.view.default, (new, out_view))
        last.replace_all_uses_with(new)
        return True

    def max_pool(self, p: Node) -> bool:
        """dequantize -> max_pool2d -> quantize with one scale and zero point: the pool on q."""
        dq = self.dq_tensor(p.args[0])
        if dq is None:
            return False
        getter = self.only_user(p)
        if getter is None or getter.target is not operator.getitem or getter.args[1] != 0:
            return False
        q_node = self.only_user(getter)
        q = self.q_tensor(q_node) if q_node is not None else None
        if q != (dq.scale, dq.zp, dq.dtype):
            return False
        with self.g.inserting_before(q_node):
            new = self.call(QMaxPool(*p.args[1:], **p.kwargs), (dq.src,), _val(q_node))
        q_node.replace_all_uses_with(new)
        return True

    def cat(self, c: Node) -> bool:
        """cat of dequantized tensors sharing one scale and zero point, quantized with them
        again (X86InductorQuantizer shares a cat's quantization with its inputs): the cat of
        the int8 tensors, a copy of bytes."""
        parts = c.args[0]
        dqs = [self.dq_tensor(p) for p in parts]
        if not dqs or any(d is None for d in dqs):
            return False
        qparams = {(d.scale, d.zp, d.dtype) for d in dqs}
        q_node = self.only_user(c)
        if len(qparams) != 1 or q_node is None or self.q_tensor(q_node) not in qparams:
            return False
        dim = c.args[1] if len(c.args) > 1 else c.kwargs.get("dim", 0)
        srcs = [d.src for d in dqs]
        if getattr(_val(srcs[0]), "fake_mode", None) is None:
            return False
        with self.g.inserting_before(q_node):
            new = self.call(QCat(dim), (srcs,))
        q_node.replace_all_uses_with(new)
        return True

    def casts(self) -> int:
        """The quantize/dequantize nodes no pattern took: `Quantize`/`Dequantize` calls, which
        lower to element-wise ops that fuse with the float ops around them into one
        generated kernel (quantized_decomposed's own run 4-5 ATen passes each)."""
        n_casts = 0
        for n in list(self.g.nodes):
            if n.op != "call_function" or len(n.args) < 6 or n.kwargs:
                continue
            if n.target is self.t["dequantize_per_tensor"]:
                d = self.dq_tensor(n)
                call = Dequantize(d.scale, d.zp, d.dtype) if d is not None else None
            elif n.target is self.t["quantize_per_tensor"] and _val(n.args[0]) is not None \
                    and _val(n.args[0]).dtype is torch.float32:
                q = self.q_tensor(n)
                call = Quantize(*q) if q is not None else None
            else:
                continue
            if call is None:
                continue
            with self.g.inserting_before(n):
                new = self.g.call_function(call, (n.args[0],))
            new.meta["val"] = _val(n)
            n.replace_all_uses_with(new)
            self.g.erase_node(n)
            n_casts += 1
        return n_casts

    def run(self) -> int:
        changed = 0
        for n in list(self.g.nodes):
            if n.op != "call_function":
                continue
            if n.target is aten.convolution.default:
                changed += self.conv(n)
            elif n.target is aten.max_pool2d_with_indices.default:
                changed += self.max_pool(n)
            elif n.target is aten.cat.default:
                changed += self.cat(n)
            elif n.target in (aten.addmm.default, aten.mm.default):
                changed += self.linear(n)
        casts = 0
        if changed:
            self.g.eliminate_dead_code()
            casts = self.casts()
            _refresh_fake_values(self.g)
            self.gm.recompile()
        for r in dict.fromkeys(self.reasons):
            _log(f"left as ATen ops: {r}")
        left = [n.name for n in self.g.nodes if n.op == "call_function" and n.target in self.t.values()]
        _log(f"{changed} patterns rewritten, {casts} quantize/dequantize nodes as element-wise ops, "
             f"{len(left)} left as ATen ops" + (f" (first: {', '.join(left[:4])})" if left else ""))
        return changed + casts


def _fake_value(target, args, kwargs, fallback=None):
    """What a call of `target` returns, on its arguments' fake values (the call's own `fake`
    where it has one: quant/ops.py's calls run C code); `fallback` outside a fake mode."""
    args, kwargs = torch.fx.node.map_arg((args, kwargs), _val)
    mode = detect_fake_mode([t for t in leaves((args, kwargs)) if isinstance(t, torch.Tensor)])
    if mode is None:
        return fallback
    with mode:
        return getattr(target, "fake", target)(*args, **kwargs)


def _refresh_fake_values(g) -> None:
    """Fake values again downstream of the rewritten nodes, whose outputs are channels-last
    where the float graph's were contiguous: eager strides are what the planner lays out
    and what EAGER-rule ops are handed, and stale contiguous ones made it convert every int8
    tensor to NCHW and back. Graph outputs keep the fake values they had (the user's eager
    model gives them their strides); a node whose value cannot be recomputed keeps its own."""
    out = next(n for n in reversed(g.nodes) if n.op == "output")
    keep = set()
    torch.fx.node.map_arg(out.args, keep.add)
    started = False
    for n in g.nodes:
        if n.op != "call_function":
            continue
        started = started or hasattr(n.target, "fake")
        if not started or n in keep:
            continue
        try:
            n.meta["val"] = _fake_value(n.target, n.args, n.kwargs, n.meta.get("val"))
        except Exception:  # noqa: BLE001 - keep the old value: stale strides cost copies, never values
            pass


def has_quantized_ops(gm: GraphModule) -> bool:
    targets = {t for t in _targets().values() if t is not None}
    return bool(targets) and any(n.op == "call_function" and n.target in targets for n in gm.graph.nodes)


def rewrite(gm: GraphModule, param_indices) -> int:
    """Rewrite gm's quantized patterns in place; returns how many were rewritten.
    `param_indices`: positions of the placeholders that are module state."""
    if not has_quantized_ops(gm):
        return 0
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    params = [placeholders[i] for i in param_indices if i < len(placeholders)]
    params += [n for n in gm.graph.nodes if n.op == "get_attr"]
    return _Rewriter(gm, params).run()
