"""Lowering: an inference ATen FX graph (from aot_autograd) to cpu_layout IR.

Convolutions become `ir.Conv` (with inference batch-norm folded in when its
parameters are module state), element-wise ops become `ir.Pointwise`, and
other ATen calls an `ir.Aten` with the rule their op_table entry gives
(layout-agnostic ones such as pooling, upsampling and cat FOLLOW); an op
without an entry gets rule EAGER: it runs the ATen op on inputs laid out as
eager had them, so its result is eager's. Groups of nodes recognised together
(batch-norm folding, linear as conv, channel shuffles, grouped convs, ...) are
`patterns.py`.
"""
from __future__ import annotations

import operator
from typing import Dict, Iterable, Optional

import torch
from torch.fx import Node as FxNode

from cpu_layout import attention, ir, runtime
from cpu_layout import op_table as T
from cpu_layout import layout as L
from cpu_layout.codegen import expr as E
from cpu_layout.patterns import FLOAT, Patterns, Picked, drop_copies_of_whole, share_constant_calls

aten = torch.ops.aten

# aten overload -> the element-wise op (codegen.expr.OPS) it lowers to as it is.
_ELEMENTWISE = {t: name for name, op in E.OPS.items() for t in op.aten}


# Deterministic tensor factories: with static arguments their result is a
# constant of the graph (e.g. the index ramps of a decomposed upsample).
CONSTANT_FACTORIES = {aten.arange.default, aten.arange.start, aten.arange.start_step,
                      aten.zeros.default, aten.ones.default, aten.full.default,
                      aten.scalar_tensor.default}

# Factories that read only another tensor's metadata (new_zeros, zeros_like, ...):
# with a static, contiguous result they are `full`, a constant of the graph
# (Swin's shifted-window mask, built from x.new_zeros every forward in eager).
# aten overload -> the value it fills with
METADATA_FACTORIES = {aten.new_zeros.default: 0, aten.new_ones.default: 1,
                      aten.zeros_like.default: 0, aten.ones_like.default: 1}
# aten overload -> the position of its fill_value argument
METADATA_FULL = {aten.new_full.default: 2, aten.full_like.default: 1}

# aten overload -> reduction kind of ir.Reduction (float32 accumulation).
REDUCTIONS = {
    aten.mean.dim: "mean",
    aten.sum.dim_IntList: "sum",
    aten.amax.default: "amax",
    aten.amin.default: "amin",
}


class Lowering(Patterns):
    """One FX node at a time; the multi-node patterns are `patterns.Patterns`'."""

    def __init__(self, gm: torch.fx.GraphModule, param_indices: Iterable[int]):
        self.gm = gm
        self.params = set(param_indices)
        self.g = ir.Graph()
        self.env: Dict[FxNode, object] = {}
        self._values: Dict[FxNode, object] = {}  # _concrete's memo
        self._shuffles: Dict[FxNode, tuple] = {}  # channel shuffles: (x, groups)

    # ---- helpers -------------------------------------------------------------

    def _val(self, n: FxNode):
        return n.meta.get("val", n.meta.get("example_value"))

    def _buffer_for(self, n: FxNode, prefix="buf") -> ir.Buffer:
        v = self._val(n)
        if isinstance(v, torch.Tensor):
            return self.g.new_buffer(prefix, size=tuple(v.shape), dtype=v.dtype, eager_stride=tuple(v.stride()))
        return self.g.new_buffer(prefix)

    def _arg(self, a):
        """FX argument -> the same structure with Buffers for nodes."""
        if isinstance(a, FxNode):
            return self.env[a]
        if isinstance(a, (list, tuple)):
            return type(a)(self._arg(x) for x in a)
        if isinstance(a, dict):
            return {k: self._arg(v) for k, v in a.items()}
        return a

    def _is_param(self, b) -> bool:
        return isinstance(b, ir.Buffer) and b.constant

    def _aten(self, n: FxNode, rule: str, target=None, args=None, kwargs=None) -> ir.Buffer:
        args = self._arg(n.args) if args is None else args
        kwargs = self._arg(n.kwargs) if kwargs is None else kwargs
        multi = isinstance(self._val(n), (tuple, list))
        out = self._buffer_for(n)
        target = target or n.target
        effects = isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable
        node = ir.Aten(n.name, ir.values_of((args, kwargs)), out, rule=rule, target=target,
                       args=args, kwargs=kwargs, multi=multi, effects=effects)
        self.g.add(node)
        return out

    # ---- per-op lowering -------------------------------------------------------

    def _conv(self, n: FxNode):
        x, w, b, stride, padding, dilation, transposed, output_padding, groups = n.args
        xv = self._val(x)
        if transposed or xv.dtype not in FLOAT or xv.dim() not in (3, 4, 5):
            return self._aten(n, ir.EAGER)
        if any(isinstance(p, torch.SymInt) for p in (*stride, *padding, *dilation)):
            return self._aten(n, ir.EAGER)
        xb, wb = self.env[x], self.env[w]
        bb = self.env[b] if b is not None else None
        out = self._buffer_for(n)
        inputs = [xb, wb] + ([bb] if bb is not None else [])
        nsp = xv.dim() - 2

        def per_dim(v):  # ATen repeats a one-element stride/padding/dilation for every dim
            v = tuple(int(i) for i in v)
            return v * nsp if len(v) == 1 else v

        node = ir.Conv(n.name, inputs, out, x=xb, weight=wb, bias=bb, stride=per_dim(stride),
                       padding=per_dim(padding), dilation=per_dim(dilation), groups=int(groups))
        self.g.add(node)
        return out

    def _batch_norm_pointwise(self, n: FxNode):
        """Inference batch-norm not after a conv: x * scale + shift, with the
        per-channel coefficients computed from module state (once, while it
        is unchanged) and the affine part fused with its neighbours."""
        x, w, b, mean, var, _momentum, eps = n.args
        xv = self._val(x)
        out_v = self._val(n)[0]
        if xv.dtype not in FLOAT or xv.dim() < 2:
            return self._aten(n, ir.FOLLOW)
        xb = self.env[x]
        rank = xv.dim()
        state = [self._arg(a) for a in (w, b, mean, var)]
        c = xv.shape[1]
        coeff = []
        for fn in (runtime.bn_scale, runtime.bn_shift):
            buf = self.g.new_buffer(size=(c,) + (1,) * (rank - 2), dtype=torch.float32,
                                    eager_stride=(1,) * (rank - 1))
            args = (*state, float(eps), rank)
            node = ir.Aten(f"{n.name}_{fn.__name__}", ir.values_of(args), buf, rule=ir.EAGER,
                           target=fn, args=args)
            self.g.add(node)
            buf.constant = all(isinstance(t, ir.Buffer) and t.constant for t in ir.values_of(args))
            coeff.append(buf)
        scaled = self._elementwise(f"{n.name}_mul", "mul", aten.mul.Tensor, [xb, coeff[0]], out_v)
        return Picked({0: self._elementwise(f"{n.name}_add", "add", aten.add.Tensor, [scaled, coeff[1]], out_v)})

    def _elementwise(self, name, op, target, args: list, like: torch.Tensor, params=()) -> ir.Buffer:
        """A pointwise node made by the lowering itself (`args`: buffers and scalars in the
        op's order), shaped like eager's `like`."""
        out = self.g.new_buffer(size=tuple(like.shape), dtype=like.dtype, eager_stride=tuple(like.stride()))
        self.g.add(ir.Pointwise(name, [a for a in args if isinstance(a, ir.Buffer)], out, op=op,
                                args=list(args), params=tuple(params), aten=(target, tuple(args), {})))
        return out

    def _pointwise(self, n: FxNode, op: str, args: list, params=()):
        v = self._val(n)
        tensors = [a for a in args if isinstance(a, ir.Buffer) and a.is_tensor]
        if v.dtype not in FLOAT or any(t.dtype not in FLOAT for t in tensors):
            return self._aten(n, ir.EAGER)
        if any(isinstance(a, (torch.SymInt, torch.SymFloat)) for a in args):
            return self._aten(n, ir.EAGER)
        out = self._buffer_for(n)
        node = ir.Pointwise(n.name, [a for a in args if isinstance(a, ir.Buffer)], out, op=op,
                            args=list(args), params=tuple(params),
                            aten=(n.target, self._arg(n.args), self._arg(n.kwargs)))
        self.g.add(node)
        return out

    def _layer_norm(self, n: FxNode):
        """native_layer_norm whose mean/rstd nothing reads: a LayerNorm node."""
        x, shape, w, b, eps = n.args
        xv = self._val(x)
        used = {u.args[1] for u in n.users if u.target is operator.getitem}
        params = {self._val(a).dtype for a in (w, b) if a is not None}  # x's, or fp32 under autocast
        if (xv.dtype not in FLOAT or used - {0} or len(used) != len(n.users)
                or not all(type(s) is int for s in shape) or not shape
                or len(params) > 1 or params - {xv.dtype, torch.float32}):
            return self._aten(n, ir.EAGER)
        out_v = self._val(n)[0]
        if out_v.dtype != xv.dtype or not L.made_contiguous(out_v):
            return self._aten(n, ir.EAGER)
        out = self.g.new_buffer(size=tuple(out_v.shape), dtype=out_v.dtype, eager_stride=tuple(out_v.stride()))
        wb = self.env[w] if w is not None else None
        bb = self.env[b] if b is not None else None
        xb = self.env[x]
        self.g.add(ir.LayerNorm(n.name, [xb] + [t for t in (wb, bb) if t is not None], out, x=xb,
                                weight=wb, bias=bb, n_norm=len(shape), eps=float(eps),
                                aten=(n.target, self._arg(n.args), self._arg(n.kwargs))))
        return Picked({0: out})

    def _group_norm(self, n: FxNode):
        """native_group_norm whose mean/rstd nothing reads: a GroupNorm node,
        when eager's result is in its input's order (contiguous, or channels-last
        for 4-D/5-D: what the kernel writes)."""
        x, w, b, _n, c, _hxw, groups, eps = n.args
        xv, out_v = self._val(x), self._val(n)[0]
        used = {u.args[1] for u in n.users if u.target is operator.getitem}
        params = {self._val(a).dtype for a in (w, b) if a is not None}
        order = self.env[x].eager_order()
        if (xv.dtype not in FLOAT or used - {0} or len(used) != len(n.users) or xv.dim() < 2
                or type(groups) is not int or type(c) is not int or groups <= 0 or c % groups
                or len(params) > 1 or params - {xv.dtype, torch.float32} or out_v.dtype != xv.dtype
                or order not in (L.CONTIGUOUS, L.CHANNELS_LAST)
                or (order == L.CHANNELS_LAST and xv.dim() not in (4, 5))
                or not L.is_in_order(tuple(out_v.shape), tuple(out_v.stride()), order)):
            return self._aten(n, ir.EAGER)
        out = self.g.new_buffer(size=tuple(out_v.shape), dtype=out_v.dtype, eager_stride=tuple(out_v.stride()))
        xb = self.env[x]
        wb = self.env[w] if w is not None else None
        bb = self.env[b] if b is not None else None
        self.g.add(ir.GroupNorm(n.name, [xb] + [t for t in (wb, bb) if t is not None], out, x=xb,
                                weight=wb, bias=bb, groups=groups, eps=float(eps)))
        return Picked({0: out})

    def _softmax(self, n: FxNode):
        """_softmax / _log_softmax in the input's dtype with a static dim: a Softmax
        node, when eager's result is contiguous (ATen's kernel makes it so)."""
        x, dim, half_to_float = n.args
        xv, v = self._val(x), self._val(n)
        if (xv.dtype not in FLOAT or half_to_float or v.dtype != xv.dtype or type(dim) is not int
                or not L.made_contiguous(v)):
            return self._aten(n, ir.EAGER)
        out = self._buffer_for(n)
        xb = self.env[x]
        self.g.add(ir.Softmax(n.name, [xb], out, x=xb, dim=dim % max(xv.dim(), 1),
                              log=n.target is aten._log_softmax.default))
        return out

    def _dense(self, n: FxNode):
        if n.target in (aten.addmm.default, aten.mm.default):
            r = self._linear_as_conv(n)
            if r is not None:
                return r
        v = self._val(n)
        if not L.made_contiguous(v):
            return self._aten(n, ir.EAGER)
        return self._aten(n, ir.DENSE)

    def _reduction(self, n: FxNode):
        if n.target is aten.sum.dim_IntList:
            r = self._sum_of_channel_slices(n)
            if r is not None:
                return r
        x = n.args[0]
        xv, v = self._val(x), self._val(n)
        dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        keepdim = bool(n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False))
        if (not isinstance(xv, torch.Tensor) or xv.dtype not in FLOAT or v.dtype != xv.dtype
                or n.kwargs.get("dtype") is not None or not dims or xv.dim() == 0
                or not all(type(d) is int for d in dims)):
            return self._aten(n, ir.EAGER)  # dtype changes, full reductions, symbolic dims
        rank = xv.dim()
        dims = tuple(sorted({d % rank for d in dims}))
        out = self._buffer_for(n)
        self.g.add(ir.Reduction(n.name, [self.env[x]], out, kind=REDUCTIONS[n.target], dims=dims,
                                keepdim=keepdim, aten=(n.target, self._arg(n.args), self._arg(n.kwargs))))
        return out

    def _vector_norm(self, n: FxNode):
        """linalg_vector_norm of order 2 over static dims, in the input's dtype: a
        sum reduction of x * x with a sqrt on the result (ATen's float sum of
        squares, no scaling). Other orders and full reductions stay on ATen."""
        x = n.args[0]
        a = list(n.args) + [None] * (4 - len(n.args))
        ord_, dims = n.kwargs.get("ord", a[1] if len(n.args) > 1 else 2), n.kwargs.get("dim", a[2])
        keepdim = bool(n.kwargs.get("keepdim", a[3] or False))
        xv, v = self._val(x), self._val(n)
        if (not isinstance(xv, torch.Tensor) or xv.dtype not in FLOAT or v.dtype != xv.dtype
                or n.kwargs.get("dtype") is not None or ord_ not in (2, 2.0) or not dims or xv.dim() == 0
                or not all(type(d) is int for d in dims)):
            return self._aten(n, ir.EAGER)
        rank = xv.dim()
        out = self._buffer_for(n)
        sq = E.Op("mul", (E.Load(0), E.Load(0)))
        self.g.add(ir.Reduction(n.name, [self.env[x]], out, kind="sum",
                                dims=tuple(sorted({d % rank for d in dims})), keepdim=keepdim,
                                aten=(n.target, self._arg(n.args), self._arg(n.kwargs)),
                                prologue=sq, epilogue=E.Op("sqrt", (E.Load(0),))))
        return out

    def _slice(self, n: FxNode):
        """A split or step-1 slice with static bounds: a view of its input in
        whatever layout the plan gives that (rule SLICE; a channel slice of a
        channels-last conv output is read in place by kernels and cat, copied
        dense by a conv), else EAGER. Not when a piece is returned (eager gives
        it the slice's strides) or read by a view op (views follow dense
        layouts)."""
        out = self._aten(n, ir.EAGER)
        node = self.g.nodes[-1]
        pieces = list(n.users) if node.multi else [n]
        if node.multi and not all(p.target is operator.getitem for p in pieces):
            return out
        bounds = T.split_piece(node, 0) if node.multi else T.slice_range(node)
        readers = [r for p in pieces for r in p.users]
        if (bounds is None or not node.inputs[0].is_tensor
                or any(r.op == "output" or T.rule_of(r.target) == ir.VIEW for r in readers)):
            return out
        node.rule = ir.SLICE
        return out

    def _metadata_factory(self, n: FxNode) -> Optional[ir.Buffer]:
        """`new_zeros(x, size)`, `zeros_like(x)`, ...: `full(size, value)` with x's
        dtype, when the result's size is static and its strides contiguous."""
        v = self._val(n)
        if (not isinstance(v, torch.Tensor) or not all(type(s) is int for s in v.shape)
                or tuple(v.stride()) != L.contiguous_strides(tuple(v.shape))):
            return None
        pos = METADATA_FULL.get(n.target)
        if pos is None:
            fill = METADATA_FACTORIES[n.target]
        else:
            fill = n.args[pos] if len(n.args) > pos else n.kwargs.get("fill_value")
            if type(fill) not in (int, float, bool):
                return None
        return self._aten(n, ir.EAGER, target=aten.full.default, args=(list(v.shape), fill),
                          kwargs={"dtype": v.dtype, "layout": torch.strided, "device": v.device,
                                  "pin_memory": False})

    def _call(self, n: FxNode):
        t = n.target
        if t is attention.FLASH:
            return attention.lower(self, n)
        if t in METADATA_FACTORIES or t in METADATA_FULL:
            r = self._metadata_factory(n)
            if r is not None:
                return r
        own = getattr(type(t), "lower_into", None)  # a call that lowers itself (quant/ops.py)
        if own is not None:
            return own(t, self, n)
        if t in (aten.view.default, aten._unsafe_view.default):
            r = self._channel_shuffle(n)
            if r is not None:
                return r
        if t in (aten.split.Tensor, aten.split_with_sizes.default) and n.args[0] in self._shuffles:
            r = self._shuffle_pieces(n)
            if r is not None:
                return r
        if t in T.SPLIT_OPS or t is aten.slice.Tensor:
            return self._slice(n)
        if t is aten.cat.default:
            r = self._grouped_conv(n)
            if r is not None:
                return r
        if t in REDUCTIONS:
            return self._reduction(n)
        if t is aten.linalg_vector_norm.default:
            return self._vector_norm(n)
        if t is aten.addcmul.default and set(n.kwargs) <= {"value"} and len(n.args) in (3, 4):
            value = n.kwargs.get("value", n.args[3] if len(n.args) > 3 else 1)
            if type(value) not in (int, float):
                return self._aten(n, ir.EAGER)
            return self._pointwise(n, "addcmul", [self._arg(a) for a in n.args[:3]], params=(float(value),))
        if t is aten._unsafe_index.Tensor:
            r = self._nearest_upsample(n)
            if r is not None:
                return r
        if t is aten.convolution.default:
            return self._conv(n)
        if t is aten._native_batch_norm_legit_no_training.default:
            return self._batch_norm(n)
        if t is aten.native_layer_norm.default:
            return self._layer_norm(n)
        if t is aten.native_group_norm.default:
            return self._group_norm(n)
        if t in (aten._softmax.default, aten._log_softmax.default):
            return self._softmax(n)
        rule = T.rule_of(t)
        if rule == ir.VIEW:
            return self._aten(n, ir.VIEW)
        if rule == ir.DENSE:
            return self._dense(n)
        if t is operator.getitem:
            src = self.env[n.args[0]]
            if isinstance(src, Picked):
                return src.items[n.args[1]]
            out = self._buffer_for(n)
            self.g.add(ir.Getitem(n.name, [src], out, index=n.args[1]))
            return out
        if t in _ELEMENTWISE:
            name = _ELEMENTWISE[t]
            if n.kwargs.get("alpha", 1) != 1:
                return self._aten(n, ir.EAGER)
            return self._pointwise(n, name, [self._arg(a) for a in n.args[:E.OPS[name].arity]])
        if t is aten.gelu.default:
            approx = n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none")
            return self._pointwise(n, "gelu", [self._arg(n.args[0])], params=(approx,))
        if t in (aten.hardtanh.default, aten.clamp.default):
            lo = n.args[1] if len(n.args) > 1 else n.kwargs.get("min")
            hi = n.args[2] if len(n.args) > 2 else n.kwargs.get("max")
            if t is aten.hardtanh.default:
                lo = -1.0 if lo is None else lo
                hi = 1.0 if hi is None else hi
            return self._pointwise(n, "clamp", [self._arg(n.args[0])], params=(lo, hi))
        if t is aten.pow.Tensor_Scalar and not n.kwargs and type(n.args[1]) in (int, float):
            return self._pointwise(n, "pow", [self._arg(n.args[0])], params=(n.args[1],))
        if t is aten.leaky_relu.default:
            slope = n.args[1] if len(n.args) > 1 else 0.01
            return self._pointwise(n, "leaky_relu", [self._arg(n.args[0])], params=(slope,))
        if t is aten._to_copy.default and set(n.kwargs) <= {"dtype"} and len(n.args) == 1:
            return self._pointwise(n, "to", [self._arg(n.args[0])], params=(n.kwargs.get("dtype"),))
        if t is aten.max_pool2d_with_indices.default:
            idx_used = any(u.target is operator.getitem and u.args[1] != 0 for u in n.users)
            if not idx_used:
                out = self._aten(n, ir.FOLLOW, target=aten.max_pool2d.default)
                self.g.nodes[-1].multi = False
                v = self._val(n)[0]
                out.size, out.dtype, out.eager_stride = tuple(v.shape), v.dtype, tuple(v.stride())
                return Picked({0: out})
            return self._aten(n, ir.EAGER)
        if rule == ir.FOLLOW:
            fmt = n.kwargs.get("memory_format")
            if fmt is not None and fmt is not torch.preserve_format:
                return self._aten(n, ir.EAGER)  # an explicit format is eager's choice, not ours
            return self._aten(n, ir.FOLLOW)
        return self._aten(n, ir.EAGER)

    def _graph_constant(self, n: FxNode):
        """A tensor the graph module holds (a lifted constant, e.g. a relative
        position index): module state, produced by a node with no inputs."""
        value = operator.attrgetter(n.target)(self.gm)
        if not isinstance(value, torch.Tensor):
            raise NotImplementedError(f"get_attr {n.target} of type {type(value).__name__}")
        out = self.g.new_buffer("const", size=tuple(value.shape), dtype=value.dtype,
                                eager_stride=tuple(value.stride()))
        self.g.add(ir.Aten(n.name, [], out, rule=ir.EAGER, target=runtime.GraphConstant(value),
                           args=(), kwargs={}))
        out.constant = True
        return out

    def run(self) -> ir.Graph:
        index = 0
        for n in self.gm.graph.nodes:
            if n.op == "placeholder":
                out = self._buffer_for(n, prefix="arg")
                v = self._val(n)
                if isinstance(v, torch.SymInt):
                    out.sym = v.node.expr
                node = ir.Input(n.name, [], out, index=index, is_param=index in self.params)
                out.constant = node.is_param and out.is_tensor
                self.g.add(node)
                self.env[n] = out
                index += 1
            elif n.op == "call_function":
                self.env[n] = r = self._call(n)
                node = self.g.nodes[-1] if self.g.nodes else None
                if isinstance(r, ir.Buffer) and node is not None and node.out is r:
                    # A cast or view of module state is module state too, unless
                    # its size follows the input's (ViT's class token expanded to
                    # the batch): a constant's size is fixed at compile time.
                    # (An element of a tuple of module state, such as the var_mean of
                    # nfnet's weight standardisation, is module state as well.)
                    # Every input counts, scalars too: a ramp scaled by a number
                    # computed from a symbolic size (a decomposed upsample to a fixed
                    # size from a dynamic one) changes with the input.
                    tensors = [b for b in node.inputs if b.is_tensor or isinstance(node, ir.Getitem)]
                    r.constant = (bool(tensors) and all(b.constant for b in node.inputs)
                                  and not isinstance(node, ir.Conv) and not node.effects
                                  and (not r.is_tensor or all(type(s) is int for s in r.size)))
                    if isinstance(node, ir.Aten) and node.target in CONSTANT_FACTORIES and not node.inputs:
                        r.constant = r.is_tensor
            elif n.op == "get_attr":
                self.env[n] = self._graph_constant(n)
            elif n.op == "output":
                vals = [self._arg(v) for v in n.args[0]]
                self.g.add(ir.Output("output", ir.values_of(vals), None, values=vals))
            else:
                raise NotImplementedError(f"FX node kind {n.op}")
        share_constant_calls(self.g)
        drop_copies_of_whole(self.g)
        self.g.remove_dead()  # e.g. index ramps a recognised upsample no longer reads
        return self.g


def lower(gm: torch.fx.GraphModule, param_indices: Iterable[int]) -> ir.Graph:
    """`param_indices`: positions of graph inputs that are module parameters/buffers."""
    return Lowering(gm, param_indices).run()
