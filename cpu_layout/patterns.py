"""Lowering patterns: several ATen nodes recognised together and lowered as
one IR node (or a few), where op-by-op lowering (lower.py) would pin a layout,
copy, or run a pass of its own.

- batch-norm after a conv folds into the conv;
- `addmm`/`mm` with a module weight is a 1x1 conv (linear as conv);
- a sum over split channels is a sum of channel slices (ResNeSt);
- the index ramps of a nearest upsample are `upsample_nearest2d`;
- view/transpose/clone/view is one channel shuffle, and a split after it one
  shuffle per piece (ShuffleNet);
- alike convs over all channel pieces of a tensor, concatenated, are one grouped
  conv (MixNet);
- a copy of a whole tensor (clone, alias, full slice) is its input (a pass over
  the lowered graph).

`Patterns` is a base of `lower.Lowering`: its methods read the FX graph and
build IR through Lowering's helpers (`env`, `g`, `_val`, `_arg`, `_buffer_for`,
`_aten`, `_elementwise`, `_batch_norm_pointwise`). A matcher returns None when
its pattern does not match, and the op lowers on its own (a batch-norm that
cannot fold lowers as a pointwise one from `_batch_norm` itself).
"""
from __future__ import annotations

import operator

import torch
from torch.fx import Node as FxNode

from cpu_layout import ir, ops
from cpu_layout import layout as L
from cpu_layout import op_table as T
from cpu_layout.codegen import expr as E
from cpu_layout.op_table import permutation_of

aten = torch.ops.aten

FLOAT = (torch.float32, torch.bfloat16)  # the dtypes generated code and oneDNN convs compute in

_UNKNOWN = object()  # _concrete: not computable from constants


class Picked:
    """A tuple-returning FX node whose used elements map straight to buffers
    (batch-norm folded into its conv, max-pool without indices)."""

    def __init__(self, items: dict):
        self.items = items


def _channel_piece(b: ir.Buffer):
    """(source, start, end) when `b` is channels [start, end) of `source` (a piece of
    a split with static sizes, or a step-1 slice, along dim 1), else None."""
    p = b.producer
    if isinstance(p, ir.Getitem):
        split = p.inputs[0].producer
        if not (isinstance(split, ir.Aten) and split.target in T.SPLIT_OPS):
            return None
        src, bounds = split.args[0], T.split_piece(split, p.index)
    elif isinstance(p, ir.Aten) and p.target is aten.slice.Tensor:
        src, bounds = p.args[0], T.slice_range(p)
    else:
        return None
    if bounds is None or bounds[0] != 1 or not src.is_tensor or type(src.size[1]) is not int:
        return None
    _, start, end = bounds
    end = src.size[1] if end is None else min(end, src.size[1])  # as ATen clamps it
    return (src, start, end) if type(start) is int and 0 <= start < end else None


class Patterns:
    def _batch_norm(self, n: FxNode):
        x, w, b, mean, var, _momentum, eps = n.args
        xb = self.env[x]
        conv = xb.producer
        state = [self.env[a] for a in (w, b, mean, var) if a is not None]
        foldable = (
            isinstance(conv, ir.Conv)
            and conv.bn is None
            and not conv.post_ops
            and len(x.users) == 1  # the FX conv feeds only this batch-norm
            and all(self._is_param(s) for s in state)
            and len([u for u in n.users if u.target is operator.getitem and u.args[1] != 0]) == 0
        )
        if not foldable:
            return self._batch_norm_pointwise(n)
        fold = ir.BatchNormFold(
            weight=self.env[w] if w is not None else None,
            bias=self.env[b] if b is not None else None,
            mean=self.env[mean], var=self.env[var], eps=float(eps),
        )
        conv.bn = fold
        for s in state:
            conv.inputs.append(s)
            s.users.append(conv)
        return Picked({0: xb})

    def _transposed_weight(self, name: str, w: ir.Buffer) -> ir.Buffer:
        """W^T, a view: a [K, N] weight read as [N, K] by the 1x1 conv, which oneDNN
        packs from W as it is (weight format 2, `ops.is_transposed_1x1`). ATen's
        addmm on the [K, N] weight ran GPT-2's MLP products at 0.35x the conv's
        speed (7.8 vs 2.8 ms for 128x768 by 768x3072, EPYC Zen 5, 1 thread)."""
        k, nout = w.size
        wt = self.g.new_buffer(size=(nout, k), dtype=w.dtype, eager_stride=(1, nout))
        self.g.add(ir.Aten(f"{name}_wt", [w], wt, rule=ir.VIEW, target=aten.permute.default, args=(w, [1, 0])))
        wt.constant = True
        return wt

    def _linear_as_conv(self, n: FxNode):
        """`addmm(b, x, t(W))` / `mm(x, t(W))` with module weights (or a module
        weight W as it is: `_transposed_weight`): a 1x1 conv on
        oneDNN (a GEMM over channels with fused bias and post-ops). [M, K]
        row-major is [1, K, 1, M] channels-last, so the views in and out are
        free when the conv computes channels-last. K and the output features
        are static; the row count M may be symbolic (a dynamic batch): the views
        say -1 for it, and Dynamo's sizes of 2 or more keep it from being 0."""
        addmm = n.target is aten.addmm.default
        if n.kwargs or len(n.args) != (3 if addmm else 2):
            return None
        bias, x, wt = (n.args if addmm else (None, *n.args))
        xb, wtb = self.env[x], self.env[wt]
        bb = self.env[bias] if bias is not None else None
        tnode = wtb.producer
        if (isinstance(tnode, ir.Aten) and tnode.target in (aten.t.default, aten.permute.default)
                and permutation_of(tnode.target, tnode.args, 2) == (1, 0)):
            w = tnode.inputs[0]
        elif wtb.constant and wtb.rank == 2 and not xb.constant and all(type(s) is int for s in wtb.size):
            w = self._transposed_weight(n.name, wtb)  # GPT-2's Conv1D: addmm(b, x, W), W [in, out]
        else:
            return None
        v = self._val(n)
        # A linear on module state alone (swin_v2's position-bias MLP over a
        # coordinate table) stays an ATen matmul: a constant node, computed once.
        if (xb.rank != 2 or w.rank != 2 or not w.constant or xb.constant or xb.dtype not in FLOAT
                or not (L.same_sizes(w.eager_stride, L.contiguous_strides(w.size))  # a weight, not a slice
                        or w.eager_stride == (1, w.size[0]))  # or one stored [in, out]
                or any(t.dtype != xb.dtype for t in (w, v))
                or not all(type(s) is int for s in (xb.size[1], *w.size, v.shape[1]))
                or (bb is not None and (not bb.constant or bb.rank != 1 or bb.dtype != xb.dtype))
                or not L.made_contiguous(v)):
            return None
        (m, k), (nout, _) = xb.size, w.size
        if type(m) is int and m == 0:
            return None
        rows = m if type(m) is int else -1  # a view argument: -1 is M whatever it is at run time

        def view(name, src, target, args, size):
            st = L.strides_for_order(size, L.CHANNELS_LAST if len(size) == 4 else L.CONTIGUOUS)
            out = self.g.new_buffer(size=tuple(size), dtype=src.dtype, eager_stride=st)
            self.g.add(ir.Aten(name, [src], out, rule=ir.VIEW, target=target, args=(src, *args)))
            out.constant = src.constant
            return out

        x4 = view(f"{n.name}_in", view(f"{n.name}_xt", xb, aten.permute.default, ([1, 0],), (k, m)),
                  aten.view.default, ([1, k, 1, rows],), (1, k, 1, m))
        w4 = view(f"{n.name}_w", w, aten.view.default, ([nout, k, 1, 1],), (nout, k, 1, 1))
        w4.eager_stride = (L.contiguous_strides(w4.size) if w.eager_stride != (1, nout) or nout == 1
                           else (1, nout, 1, 1))
        y4 = self.g.new_buffer(size=(1, nout, 1, m), dtype=xb.dtype,
                               eager_stride=L.strides_for_order((1, nout, 1, m), L.CHANNELS_LAST))
        self.g.add(ir.Conv(f"{n.name}_conv", [x4, w4] + ([bb] if bb is not None else []), y4, x=x4,
                           weight=w4, bias=bb, stride=(1, 1), padding=(0, 0), dilation=(1, 1),
                           linear=True))
        yt = view(f"{n.name}_yt", y4, aten.view.default, ([nout, rows],), (nout, m))
        out = view(n.name, yt, aten.permute.default, ([1, 0],), (m, nout))
        out.eager_stride = tuple(v.stride())
        return out

    def _split_channel_view(self, b: ir.Buffer):
        """(s, r) when `b` is a view of s = [B, r*C, ...] as [B, r, C, ...] (the
        channel dim split in two), else None."""
        p = b.producer
        if not (isinstance(p, ir.Aten) and p.rule == ir.VIEW and p.target in T.RESHAPE_OPS):
            return None
        s = p.inputs[0]
        if not (b.is_tensor and s.is_tensor and b.rank == s.rank + 1 >= 4):
            return None
        r, c = b.size[1], b.size[2]
        if (not all(type(v) is int for v in (r, c, s.size[1])) or s.size[1] != r * c
                or not L.same_sizes(s.size[:1], b.size[:1]) or not L.same_sizes(s.size[2:], b.size[3:])):
            return None
        return s, r

    def _sum_of_channel_slices(self, n: FxNode):
        """sum(t, [1]) where t is a [B, r, C, ...] view of a [B, r*C, ...] tensor, or
        an element-wise op of such views (ResNeSt's split attention: the radix
        sum, and the attention-weighted sum): the sum of the r channel slices,
        the element-wise op applied slice by slice. Every tensor stays of the
        source's rank, so a channels-last plan reads the slices in place, where
        the 5-D view is in neither label and was copied (resnest14d: 4 copies,
        1.6 MB each at 56x56)."""
        x = n.args[0]
        dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        keepdim = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
        v = self._val(n)
        if (set(n.kwargs) - {"dim", "keepdim"} or keepdim or not isinstance(dims, (list, tuple))
                or len(dims) != 1 or type(dims[0]) is not int or not isinstance(v, torch.Tensor)):
            return None
        t = self.env[x]
        if not isinstance(t, ir.Buffer) or not t.is_tensor or dims[0] % t.rank != 1 or t.dtype not in FLOAT:
            return None
        r = None
        views = {}

        def split_of(b):
            nonlocal r
            got = self._split_channel_view(b)
            if got is None or (r is not None and got[1] != r):
                return False
            r = got[1]
            views[b] = got[0]
            return True

        p = t.producer
        if split_of(t):
            per_slice = None
        elif (isinstance(p, ir.Pointwise) and E.OPS[p.op].arity == 2 and len(p.inputs) == len(set(p.inputs))
              and all(split_of(b) for b in p.inputs)):
            per_slice = p
        else:
            return None
        if r < 2 or v.dtype != t.dtype:
            return None

        def piece(src, i):
            c = src.size[1] // r
            out = self.g.new_buffer(size=(src.size[0], c) + tuple(src.size[2:]), dtype=src.dtype,
                                    eager_stride=src.eager_stride)
            self.g.add(ir.Aten(f"{n.name}_{src.name}_{i}", [src], out, rule=ir.SLICE, target=aten.slice.Tensor,
                               args=(src, 1, i * c, (i + 1) * c)))
            return out

        # Every term and partial sum is shaped like the result (v; its dtype is t's, checked above).
        terms = []
        for i in range(r):
            if per_slice is None:
                terms.append(piece(views[t], i))
            else:
                args = [piece(views[a], i) if isinstance(a, ir.Buffer) else a for a in per_slice.args]
                terms.append(self._elementwise(f"{n.name}_{per_slice.op}{i}", per_slice.op, per_slice.aten[0],
                                               args, v, per_slice.params))
        acc = terms[0]
        for i, term in enumerate(terms[1:], start=1):
            acc = self._elementwise(f"{n.name}_add{i}", "add", aten.add.Tensor, [acc, term], v)
        return acc

    def _concrete(self, n):
        """The value of an FX argument computed from constants alone (no graph
        input, nothing random), or None. Used to recognise index patterns."""
        if not isinstance(n, FxNode):
            if isinstance(n, (list, tuple)):
                vals = [self._concrete(a) for a in n]
                return _UNKNOWN if any(v is _UNKNOWN for v in vals) else type(n)(vals)
            return n
        if n in self._values:
            return self._values[n]
        v = _UNKNOWN
        if n.op == "call_function" and not (
                isinstance(n.target, torch._ops.OpOverload)
                and torch.Tag.nondeterministic_seeded in n.target.tags):
            args = self._concrete(list(n.args))
            kwargs = {k: self._concrete(a) for k, a in n.kwargs.items()}
            if args is not _UNKNOWN and not any(a is _UNKNOWN for a in kwargs.values()):
                try:
                    v = n.target(*args, **kwargs)
                except Exception:  # noqa: BLE001 - not evaluable here: not a pattern we know
                    v = _UNKNOWN
        self._values[n] = v
        return v

    def _nearest_upsample(self, n: FxNode):
        """`_unsafe_index(x, [None, None, ih, iw])` with the index ramps of a
        nearest upsample (what F.interpolate(mode="nearest") decomposes to) as
        `upsample_nearest2d`: it keeps channels-last and is many times faster
        than a gather. The ramps are computed and compared with ATen's own."""
        x, idx = n.args[0], n.args[1]
        xv, v = self._val(x), self._val(n)
        if (not isinstance(xv, torch.Tensor) or xv.dim() != 4 or xv.dtype not in FLOAT
                or len(idx) != 4 or idx[0] is not None or idx[1] is not None
                or not all(type(s) is int for s in (*xv.shape[2:], *v.shape[2:]))):
            return None
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        (h, w), (oh, ow) = xv.shape[2:], v.shape[2:]
        with unset_fake_temporarily():  # real values: the compile runs under fake tensors
            ih, iw = self._concrete(idx[2]), self._concrete(idx[3])
            if not (isinstance(ih, torch.Tensor) and isinstance(iw, torch.Tensor)
                    and tuple(ih.shape) == (oh, 1) and tuple(iw.shape) == (ow,)):
                return None

            def ramp(size, out):  # ATen's own source index for each output row/column
                src = torch.arange(size, dtype=torch.float32).view(1, 1, size, 1)
                return aten.upsample_nearest2d.default(src, [out, 1])[0, 0, :, 0].long()

            if not (torch.equal(ih.view(-1), ramp(h, oh)) and torch.equal(iw, ramp(w, ow))):
                return None
        return self._aten(n, ir.FOLLOW, target=aten.upsample_nearest2d.default,
                          args=(self.env[x], [oh, ow]), kwargs={})

    def _channel_shuffle(self, n: FxNode):
        """`view(clone(transpose(view(x, [b, g, c/g, *sp]), 1, 2)), [b, c, *sp])`
        (ShuffleNet's channel shuffle) as one `ops.channel_shuffle(x, g)`:
        layout-agnostic, so a channels-last x stays channels-last, where the
        five-dimensional clone would pin it to contiguous (a conversion on each
        side of every shuffle). Values do not depend on any of the strides."""
        c = n.args[0]
        if not (isinstance(c, FxNode) and c.target is aten.clone.default and len(c.args) == 1):
            return None
        t = c.args[0]
        if not (isinstance(t, FxNode) and t.target in (aten.transpose.int, aten.permute.default)):
            return None
        v = t.args[0]
        if not (isinstance(v, FxNode) and v.target in (aten.view.default, aten._unsafe_view.default)):
            return None
        x = v.args[0]
        xv, vv, nv = self._val(x), self._val(v), self._val(n)
        if not all(isinstance(a, torch.Tensor) for a in (xv, vv, nv)) or not 3 <= xv.dim() <= 5:
            return None
        r = vv.dim()
        g, k, c_in = vv.shape[1], vv.shape[2], xv.shape[1]
        if (r != xv.dim() + 1 or permutation_of(t.target, t.args, r) != (0, 2, 1) + tuple(range(3, r))
                or not all(type(d) is int for d in (g, k, c_in)) or c_in != g * k
                or not L.same_sizes(vv.shape[3:], xv.shape[2:]) or not L.same_sizes(vv.shape[:1], xv.shape[:1])
                or not L.same_sizes(nv.shape, xv.shape)):
            return None
        self._shuffles[n] = (self.env[x], g)
        return self._aten(n, ir.FOLLOW, target=ops.channel_shuffle, args=(self.env[x], g, 0, c_in), kwargs={})

    def _shuffle_pieces(self, n: FxNode):
        """`split(shuffle(x), ..., dim=1)` (ShuffleNet's chunk after its shuffle)
        as one `ops.channel_shuffle` per piece, each writing its channel range
        densely: a piece of a channels-last shuffle is otherwise a strided slice
        that a conv must copy before reading. Not when a piece is a graph output
        (eager gives it the slice's strides)."""
        src = n.args[0]
        x, g = self._shuffles[src]
        dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)
        vals = self._val(n)
        if (type(dim) is not int or dim % x.rank != 1 or not isinstance(vals, (list, tuple))
                or not all(u.target is operator.getitem for u in n.users)
                or any(uu.op == "output" for u in n.users for uu in u.users)
                or not all(isinstance(v, torch.Tensor) and type(v.shape[1]) is int for v in vals)
                or sum(v.shape[1] for v in vals) != x.size[1]):
            return None
        items, start = {}, 0
        for i, v in enumerate(vals):
            out = self.g.new_buffer("buf", size=tuple(v.shape), dtype=v.dtype, eager_stride=tuple(v.stride()))
            end = start + v.shape[1]
            self.g.add(ir.Aten(f"{n.name}_{i}", [x], out, rule=ir.FOLLOW, target=ops.channel_shuffle,
                               args=(x, g, start, end), kwargs={}))
            items[i], start = out, end
        return Picked(items)

    def _grouped_conv(self, n: FxNode):
        """`cat([conv_i(piece_i) for each channel piece of x], dim=1)` with alike convs
        (MixNet's mixed 1x1 convs): one grouped conv over x, its weight and bias the
        convs' concatenated (computed once per module state). The pieces may come
        from one split, from several alike splits of x (torch.export keeps one per
        use), or from slices. The pieces are not copied dense, nothing is
        concatenated, and a batch-norm after the cat folds into the one conv. The
        values are the convs' (a grouped conv computes each group from its own
        channels), up to summation order."""
        parts, dim = n.args[0], n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
        if not isinstance(parts, (list, tuple)) or len(parts) < 2 or not all(isinstance(p, FxNode) for p in parts):
            return None
        convs = [self.env[p].producer if isinstance(self.env[p], ir.Buffer) else None for p in parts]
        if not all(isinstance(c, ir.Conv) for c in convs) or any(len(p.users) != 1 for p in parts):
            return None
        first = convs[0]
        pieces = [_channel_piece(c.x) for c in convs]
        if type(dim) is not int or dim % first.out.rank != 1 or None in pieces:
            return None
        x = pieces[0][0]
        width = first.x.size[1]
        if (type(width) is not int or type(x.size[1]) is not int or x.size[1] != len(convs) * width
                or [p[1:] for p in pieces] != [(i * width, (i + 1) * width) for i in range(len(convs))]
                or any(p[0] is not x for p in pieces)
                # Nothing else reads a piece, before or after the cat (the FX graph's
                # users: later readers are not lowered yet): its conv, and so the piece, go.
                or any(len(p.args[0].users) != 1 for p in parts)):
            return None
        alike = all(
            c.bn is None and not c.post_ops and not c.linear and c.weight.constant
            and (c.bias is None) == (first.bias is None) and (c.bias is None or c.bias.constant)
            and (c.stride, c.padding, c.dilation, c.groups) == (first.stride, first.padding, first.dilation, first.groups)
            and L.same_sizes(c.weight.size, first.weight.size) and c.weight.dtype == first.weight.dtype
            and all(type(s) is int for s in c.weight.size) for c in convs)
        if not alike:
            return None

        def concatenated(name, bufs):
            size = (sum(b.size[0] for b in bufs),) + tuple(bufs[0].size[1:])
            out = self.g.new_buffer(name, size=size, dtype=bufs[0].dtype, eager_stride=L.contiguous_strides(size))
            self.g.add(ir.Aten(f"{n.name}_{name}", list(bufs), out, rule=ir.EAGER, target=aten.cat.default,
                               args=(list(bufs), 0)))
            out.constant = True
            return out

        w = concatenated("w", [c.weight for c in convs])
        b = concatenated("b", [c.bias for c in convs]) if first.bias is not None else None
        out = self._buffer_for(n)
        self.g.add(ir.Conv(n.name, [x, w] + ([b] if b is not None else []), out, x=x, weight=w, bias=b,
                           stride=first.stride, padding=first.padding, dilation=first.dilation,
                           groups=first.groups * len(convs)))
        return out


def _whole(n: ir.Node) -> bool:
    """A clone that keeps its input's memory format, an alias, an expand to the
    input's own size, a pad by nothing, or a step-1 slice over all of a static dim
    (GhostNet's `cat(...)[:, :oup]` where oup is every channel: torch.export keeps
    the slice, Dynamo's graph has an alias)."""
    if (not isinstance(n, ir.Aten) or not n.args or not isinstance(n.args[0], ir.Buffer)
            or not n.args[0].is_tensor):
        return False
    if n.target is aten.alias.default:
        return len(n.args) == 1 and not n.kwargs
    if n.target is aten.clone.default:
        return (len(n.args) == 1 and set(n.kwargs) <= {"memory_format"}
                and n.kwargs.get("memory_format", torch.preserve_format) is torch.preserve_format)
    if n.target is aten.expand.default:  # to its own size (matmul's decomposition)
        return len(n.args) == 2 and not n.kwargs and list(n.args[1]) == list(n.args[0].size)
    if n.target is aten.constant_pad_nd.default:  # no padding (Swin at a multiple of its window)
        return len(n.args) >= 2 and not n.kwargs and all(type(p) is int and p == 0 for p in n.args[1])
    if n.target is aten.slice.Tensor:
        r = T.slice_range(n)
        if r is None:
            return False
        dim, start, end = r
        size = n.args[0].size[dim]
        return start == 0 and type(size) is int and (end is None or (type(end) is int and end >= size))
    return False


def share_constant_calls(g: ir.Graph) -> None:
    """One node for each distinct ATen call on module state: a layer module called
    several times (ALBERT's one layer, 12 times) makes the same `t(W)` and views
    each time, and each result was a weight of its own: packed once per call site
    by oneDNN (ALBERT-xxlarge held 11 GB for 0.9 GB of parameters)."""
    seen = {}
    outputs = set(ir.values_of(g.output.values))

    def key(v):
        if isinstance(v, ir.Buffer):
            return ("buf", id(v))
        if isinstance(v, (list, tuple)):
            return (type(v).__name__,) + tuple(key(x) for x in v)
        if isinstance(v, dict):
            return ("dict",) + tuple(sorted((k, key(x)) for k, x in v.items()))
        return (type(v).__name__, repr(v))

    for n in list(g.nodes):
        if not (isinstance(n, ir.Aten) and n.out is not None and n.out.constant and not n.multi
                and not n.effects):
            continue
        k = (n.target, n.rule, key(n.args), key(n.kwargs))
        first = seen.setdefault(k, n)
        if first is not n and n.out not in outputs:
            g.replace_all_uses(n.out, first.out)
            g.remove(n)


def drop_copies_of_whole(g: ir.Graph) -> None:
    """A clone that keeps its input's memory format, an alias, or a slice of a whole
    dim, that is no graph output is its input: the graph is functional, so nothing
    can tell the two apart. timm's eval-mode Dropout(0) exports as a clone after
    each MLP conv (a copy of the activation); GhostNet's whole-channel slice after
    its cat (an alias in Dynamo's graph) read the cat in eager's order (both are
    EAGER), which pinned all its 96 convs to NCHW (NHWC is up to 4x faster there).
    Kept: one of a graph input (an input mutation later in the graph would show
    through)."""
    outputs = set(ir.values_of(g.output.values)) if g.output is not None else set()
    for n in list(g.nodes):
        if not _whole(n):
            continue
        src = n.args[0]
        if n.out in outputs or src.producer is None or isinstance(src.producer, ir.Input):
            continue
        g.replace_all_uses(n.out, src)
        g.remove(n)
