"""cpp_wrapper mode: the graph's work as C++ functions, entered once each per forward.

After planning and fusion the graph is rewritten into three parts:

* a **prologue** (Python, memoized as one unit): every node computed from
  module state alone (batch-norm folding, autocast copies of weights, weight
  transposes). It runs again only when a parameter's storage or version
  counter changed, and then also packs the constants each segment reads
  (address, weight serial, version) into one int64 array per segment.
* **segments**: maximal runs of nodes that can run in C++ (the rule is
  `runs_in_cpp`), each emitted as one `extern "C"` function in one library
  with the graph's kernels. Tensors cross the boundary as ATen tensor
  handles: activations handed over (the segment owns and frees them),
  results handed back without a copy.
* **Python nodes** between segments: ATen ops the C shim has no entry for.
  A graph whose ops are all supported is one segment: one foreign call per
  forward, plus the prologue's key check.

Inside a segment every buffer is released after its last consumer ran.
Buffers the segment allocated and nothing else refers to (not an output,
not viewed) go back to the segment's pool (`clw::Pool`), and later
allocations that fit take them, in this call and the next: no page faults
for fresh memory on each forward, peak memory the schedule's. Sizes are computed at run
time: convs, kernels and reductions from their inputs' sizes, views from the
symbolic sizes (codegen.sizes), so a new batch size runs without recompiling.
"""
from __future__ import annotations

import functools
import os
from typing import Dict, List, Optional, Tuple

import torch

from cpu_layout import ir
from cpu_layout.lower import permutation_of
from cpu_layout.schedule import _pair, pool_window
from cpu_layout import layout as L
from cpu_layout import ops, runtime
from cpu_layout.codegen import sizes as S
from cpu_layout.codegen.cpp_kernels import float_literal

aten = torch.ops.aten

_ES = {torch.float32: 4, torch.bfloat16: 2}
_CL_DTYPE = {torch.float32: "CL_F32", torch.bfloat16: "CL_BF16"}
VIEW_OPS = (aten.view.default, aten._unsafe_view.default, aten.t.default, aten.permute.default,
            aten.transpose.int, aten.unsqueeze.default)
# ATen ops a segment runs through libtorch's C shim (aoti_torch_cpu_*).
SHIM_OPS = (aten.max_pool2d.default, aten.avg_pool2d.default, aten.cat.default, aten.addmm.default,
            aten.mm.default, aten._unsafe_index.Tensor, aten.index.Tensor)
_INDEX_OPS = (aten._unsafe_index.Tensor, aten.index.Tensor)
# ATen ops the shim lacks that csrc/cl_wrapper.h implements itself.
OWN_OPS = (aten.upsample_nearest2d.default, aten.as_strided.default, ops.channel_shuffle)
# Splits run as views (clw::narrow), one per Getitem of the result.
SPLIT_OPS = (aten.split.Tensor, aten.split_with_sizes.default)
# Element sizes of what a segment may hold: float data, and integer index tensors (read by ATen only).
_HELD_ES = {**_ES, torch.int64: 8}


def _csrc(name: str) -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    for d in (os.path.join(here, "..", "..", "csrc"), os.path.join(here, "..", "csrc")):
        path = os.path.join(d, name)
        if os.path.exists(path):
            with open(path) as f:
                return f.read()
    raise FileNotFoundError(f"cpp_wrapper needs csrc/{name} (install cpu_layout from its source tree)")


# ---- which nodes run in C++ ------------------------------------------------------

def _float_tensor(b) -> bool:
    return isinstance(b, ir.Buffer) and b.is_tensor and b.dtype in _ES


def _static(v) -> bool:
    if isinstance(v, (list, tuple)):
        return all(_static(x) for x in v)
    return v is None or type(v) in (int, float, bool)


def _weight_format(b: ir.Buffer) -> Optional[int]:
    """oneDNN's w_cl flag for a constant weight in its eager strides, None if neither dense form."""
    if L.same_sizes(b.eager_stride, L.contiguous_strides(b.size)):
        return 0
    if b.rank in (4, 5) and L.is_in_order(b.size, b.eager_stride, L.CHANNELS_LAST):
        return 1
    return None


def runs_in_cpp(n: ir.Node) -> bool:
    """THE rule: a node runs inside a C++ segment when it is
    - a convolution on constant float weights (the extension's oneDNN path),
    - a fused element-wise kernel or a reduction (generated code),
    - an ATen op libtorch's C shim exports (SHIM_OPS) or csrc/cl_wrapper.h
      implements (OWN_OPS) with float tensors and static arguments, or a view
      whose sizes print as C++ (VIEW_OPS).
    Everything else (other ATen ops, symbolic scalar arithmetic, ops on
    integer tensors) is a Python node between segments."""
    if isinstance(n, ir.Conv):
        w = n.weight
        return (n.bn is None and w.constant and _weight_format(w) is not None
                and all(_float_tensor(b) and b.dtype == n.x.dtype for b in n.tensor_inputs())
                and (n.bias is None or n.bias.constant))
    if isinstance(n, ir.Kernel):
        return all(_float_tensor(b) for b in n.inputs) and n.out.rank <= 16
    if isinstance(n, ir.Reduction):
        return _float_tensor(n.inputs[0])
    if isinstance(n, ir.LayerNorm):
        return all(_float_tensor(b) for b in n.inputs)
    if isinstance(n, ir.Getitem):
        src = n.inputs[0].producer
        return isinstance(src, ir.Aten) and src.target in SPLIT_OPS and runs_in_cpp(src)
    if isinstance(n, ir.Aten) and n.target in SPLIT_OPS:
        return (_float_tensor(n.inputs[0]) and split_piece(n, 0) is not None
                and all(isinstance(u, ir.Getitem) for u in n.out.users))
    if isinstance(n, ir.Aten) and n.target is aten.slice.Tensor:
        return _float_tensor(n.inputs[0]) and _float_tensor(n.out) and slice_range(n) is not None
    if isinstance(n, ir.Aten) and n.target is aten.clone.default:
        return (set(n.kwargs) <= {"memory_format"} and len(n.args) == 1 and _float_tensor(n.inputs[0])
                and _float_tensor(n.out) and clone_order(n) is not None)
    if not isinstance(n, ir.Aten) or n.multi or not _float_tensor(n.out):
        return False
    if n.target in _INDEX_OPS:  # x[..., idx, idx]: float data, integer index tensors
        idx = n.args[1] if len(n.args) > 1 else None
        return (not n.kwargs and _float_tensor(n.args[0]) and isinstance(idx, (list, tuple))
                and all(i is None or (isinstance(i, ir.Buffer) and i.dtype == torch.int64) for i in idx))
    if not all(_float_tensor(b) for b in n.inputs if b.is_tensor):
        return False
    if n.target is aten.as_strided.default:  # static sizes, strides and offset
        return not n.kwargs and 3 <= len(n.args) <= 4 and _static(n.args[1:])
    if n.target is ops.channel_shuffle:  # csrc/shuffle.cpp, through the extension
        return not n.kwargs and len(n.args) == 4 and _static(n.args[1:]) and 3 <= n.out.rank <= 5
    if n.target is aten.upsample_nearest2d.default:  # output size given, no scales
        return (not n.kwargs and len(n.args) == 2 and n.inputs[0].rank == 4 and _static(n.args[1])
                and len(n.args[1]) == 2)
    if n.target in VIEW_OPS:
        try:
            [S.cexpr(s) for s in n.out.size]
        except NotImplementedError:
            return False
        return n.target in (aten.view.default, aten._unsafe_view.default) or _static(n.args[1:])
    if n.target in SHIM_OPS:
        if n.kwargs:
            return False
        if n.target is aten.cat.default:
            return _static(n.args[1:]) and all(isinstance(t, ir.Buffer) for t in n.args[0])
        if n.target is aten.addmm.default:
            return _static(n.args[3:]) and n.inputs[0].rank in (1, 2)
        return _static(n.args[1:])
    return False


def split_piece(n: ir.Aten, i: int):
    """(dim, start, end) of piece `i` of a split with static sizes along a
    static dim, else None: a step-1 slice (the last piece of an uneven
    split.Tensor is clamped to the size, as ATen's is)."""
    x = n.args[0]
    dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)
    if set(n.kwargs) - {"dim"} or type(dim) is not int or not x.rank:
        return None
    how = n.args[1]
    if n.target is aten.split.Tensor:
        if type(how) is not int or how <= 0:
            return None
        return dim % x.rank, i * how, (i + 1) * how
    if not _static(how) or not how or (type(x.size[dim]) is int and sum(how) != x.size[dim]):
        return None
    return dim % x.rank, sum(how[:i]), sum(how[:i + 1])


def slice_range(n: ir.Aten):
    """(dim, start, end) of a step-1 slice with static bounds (end None: to the end), else None."""
    x = n.args[0]
    dim, start, end, step = (list(n.args[1:]) + [0, None, None, 1][len(n.args) - 1:])[:4]
    if n.kwargs or step != 1 or not _static([dim, start, end]) or not x.rank:
        return None
    return dim % x.rank, start or 0, end


def own_cat(n: ir.Aten) -> bool:
    """Whether csrc's cat_into runs this cat: parts of the result's rank and
    dtype (no promotion, no skipped empty 1-D parts), result in a named order."""
    return (n.out.layout in L.LABELS and n.out.rank > 0
            and all(b.rank == n.out.rank and b.dtype == n.out.dtype for b in n.args[0]))


def clone_order(n: ir.Aten) -> Optional[str]:
    """The named order a clone's result is dense in: the one an explicit memory
    format names (ATen's strides for it), else its planned layout, else None."""
    fmt = n.kwargs.get("memory_format", torch.preserve_format)
    if fmt is torch.contiguous_format:
        return L.CONTIGUOUS
    if (fmt is torch.channels_last and n.out.rank == 4) or (fmt is torch.channels_last_3d and n.out.rank == 5):
        return L.CHANNELS_LAST
    if fmt is torch.preserve_format and n.out.layout in L.LABELS:
        return n.out.layout
    return None


# ---- IR rewriting ------------------------------------------------------------------

def _hoist_batch_norm(g: ir.Graph) -> None:
    """Folded batch-norm as explicit constant nodes, so convs read plain weights."""
    for conv in [n for n in g.nodes if isinstance(n, ir.Conv) and n.bn is not None]:
        bn, w, b = conv.bn, conv.weight, conv.bias
        src = (w, b, bn.weight, bn.bias, bn.mean, bn.var)
        if not all(s is None or s.constant for s in src):
            continue
        pair = g.new_buffer("fold")
        pair.constant = True
        fold = ir.Aten(f"{conv.name}_fold", [s for s in src if s is not None], pair, rule=ir.EAGER,
                       target=runtime.Memoized(functools.partial(runtime.fold_batch_norm, eps=bn.eps)),
                       args=src, multi=True)
        oc = w.size[0]
        new_w = g.new_buffer("w", size=w.size, dtype=w.dtype, eager_stride=L.contiguous_strides(w.size))
        new_b = g.new_buffer("b", size=(oc,), dtype=w.dtype, eager_stride=(1,))
        pos = g.nodes.index(conv)
        g.nodes.insert(pos, fold)
        for s in fold.inputs:
            s.users.append(fold)
        pair.producer = fold
        for i, nb in enumerate((new_w, new_b)):
            nb.constant = True
            nb.layout = ir.EAGER
            gi = ir.Getitem(f"{conv.name}_fold{i}", [pair], nb, index=i)
            g.nodes.insert(pos + 1 + i, gi)
            pair.users.append(gi)
            nb.producer = gi
        for s in {x for x in (b, bn.weight, bn.bias, bn.mean, bn.var) if x is not None}:
            while conv in s.users:
                s.users.remove(conv)
        residuals = [p[1] for p in conv.post_ops if isinstance(p, tuple) and p[0] == "add"]
        conv.inputs = [conv.x, new_w, new_b] + residuals
        while conv in w.users:
            w.users.remove(conv)
        new_w.users.append(conv)
        new_b.users.append(conv)
        conv.weight, conv.bias, conv.bn, conv.prefolded = new_w, new_b, None, bn


# ---- C++ emission --------------------------------------------------------------------

def _cl(order) -> str:
    return "true" if order == L.CHANNELS_LAST else "false"


def _static_strides(b: ir.Buffer) -> tuple:
    if b.layout in L.LABELS:
        return L.strides_for_order(b.size, b.layout)
    return b.eager_stride


def _arr(xs) -> str:
    xs = list(xs)
    return "{" + ", ".join(str(int(x)) for x in xs) + "}" if xs else "{0}"


class _SegmentEmitter:
    """C++ statements of one segment; `var` names each buffer's handle."""

    def __init__(self, kernels: Dict[ir.Node, object], consts: List[ir.Buffer], outs: List[ir.Buffer],
                 last_use: Dict[ir.Buffer, ir.Node]):
        self.kernels = kernels
        self.consts = consts
        self.last_use = last_use
        self.outs = set(outs)  # handed to the caller: fresh storage, never the pool's
        self.lines: List[str] = []
        self.var: Dict[ir.Buffer, str] = {}
        self.fresh = set()   # buffers this segment allocated (may go back to its pool)
        self.aliased = set()  # buffers some view aliases
        self.aliased_reads = set()  # conversions some view aliases
        # A view's storage is its root's: the root goes back to the pool when it and every
        # view of it died (`live_views`), unless some view escapes the segment.
        # A view that reads a conversion aliases the copy (or the buffer itself, when it
        # already was in order): such copies wait in `view_copies` for the root's views.
        self.root: Dict[ir.Buffer, ir.Buffer] = {}
        self.live_views: Dict[ir.Buffer, set] = {}
        self.view_copies: Dict[ir.Buffer, List[str]] = {}
        self.unpoolable = set()
        self.converted: Dict[tuple, str] = {}  # (buffer, order) -> handle in that order

    def emit(self, s: str):
        self.lines.append("    " + s)

    def v(self, b: ir.Buffer) -> str:
        return self.var[b]

    def begin(self, n: ir.Node):
        """Declare the node's output handle and open its block."""
        self.emit(f"// {n.name}: {type(n).__name__}")
        self.emit(f"clw::H t_{n.out.name};")
        self.emit("{")

    def end(self, n: ir.Node):
        self.var[n.out] = f"t_{n.out.name}"
        self.emit("}")

    def alloc(self, out: ir.Buffer, nd: int, sz: str, var: str = "clw::H tmp_out", cl=None):
        """`var` = the output, dense in its planned layout (or `cl`), on pooled storage when some fits."""
        self.fresh.add(out)
        cl = _cl(out.layout) if cl is None else cl
        if out in self.outs:
            self.emit(f"  {var} = clw::empty_dense({nd}, {sz}, {cl}, {_ES[out.dtype]});")
        else:
            self.emit(f"  {var} = clw_pool->take({nd}, {sz}, {cl}, {_ES[out.dtype]});")

    def convert_reads(self, keys):
        """Before a node, at segment scope: the inputs it reads in another order
        (`keys`: (buffer, order) pairs from `wrapper.conversions`), each converted
        once and shared with later readers; `release_reads` frees it after the last."""
        for key in keys:
            if key in self.converted:
                continue
            b, order = key
            tmp = f"r{len(self.converted)}_{b.name}"
            self.converted[key] = tmp
            if isinstance(order, tuple):  # eager's own permutation of the dims
                self.emit(f"const int {tmp}_p[] = {{{', '.join(map(str, order))}}};")
                self.emit(f"clw::H {tmp}_c; const clw::H& {tmp} = clw::ordered_perm({self.v(b)}, {tmp}_p, {tmp}_c, clw_pool.get());")
            else:
                self.emit(f"clw::H {tmp}_c; const clw::H& {tmp} = clw::ordered({self.v(b)}, {_cl(order)}, {tmp}_c, clw_pool.get());")

    def release_reads(self, keys, last_conv: Dict[tuple, ir.Node], n: ir.Node):
        for key in dict.fromkeys(keys):
            if last_conv[key] is n:
                copy = f"{self.converted[key]}_c"
                root = self.root.get(key[0], key[0])
                if key in self.aliased_reads and self.live_views.get(root):
                    self.view_copies.setdefault(root, []).append(copy)  # views of it still live
                elif key in self.aliased_reads and root in self.unpoolable:
                    self.emit(f"{copy}.reset();")
                else:
                    self.emit(f"clw_pool->give(std::move({copy}));")

    def read(self, n: ir.Node, b: ir.Buffer) -> str:
        """A handle of `b` in the order node `n` reads it in (converted by `convert_reads`)."""
        from cpu_layout.codegen.wrapper import _required

        order = _required(n, b)
        return self.v(b) if order is None else self.converted[(b, order)]

    def read_aliased(self, n: ir.Node, b: ir.Buffer) -> str:
        """`read` for a node whose output aliases the handle read: neither storage is pooled."""
        from cpu_layout.codegen.wrapper import _required

        self.aliased.add(b)
        order = _required(n, b)
        if order is not None:
            self.aliased_reads.add((b, order))
        # The view aliases the conversion, or `b` itself when it already was in that order:
        # either way the root is free once the view died too.
        self.view_of(n.out, b)
        return self.read(n, b)

    def view_of(self, view: ir.Buffer, b: ir.Buffer):
        root = self.root.get(b, b)
        self.root[view] = root
        members = self.live_views.setdefault(root, {root})
        if view in self.outs or self.last_use.get(view) is None:
            self.unpoolable.add(root)  # escapes, or no reader to mark its death
        members.add(view)

    def release(self, b: ir.Buffer):
        """`b` died: to the pool when this segment allocated it and nothing else refers to it
        (a root once its views died too), else its handle is dropped."""
        root = self.root.get(b, b)
        members = self.live_views.get(root)
        if members is None:  # never viewed
            if b in self.fresh and _float_tensor(b):
                self.emit(f"clw_pool->give(std::move({self.v(b)}));")
            else:
                self.emit(f"{self.v(b)}.reset();")
            return
        members.discard(b)
        if b is not root:
            self.emit(f"{self.v(b)}.reset();")
        if members:
            return  # the root's handle stays until its last view died
        poolable = root not in self.unpoolable
        if root in self.fresh and poolable and _float_tensor(root):
            self.emit(f"clw_pool->give(std::move({self.v(root)}));")
        else:
            self.emit(f"{self.v(root)}.reset();")
        for copy in self.view_copies.pop(root, []):
            self.emit(f"clw_pool->give(std::move({copy}));" if poolable else f"{copy}.reset();")

    # each returns the C++ statements (inside braces) for one node
    def conv(self, n: ir.Conv):
        nsp = n.x.rank - 2
        dst_cl = n.out.layout == L.CHANNELS_LAST
        wi = self.const_index(n.weight)
        bi = self.const_index(n.bias) if n.bias is not None else None
        post = [("add", torch.empty(0)) if isinstance(p, tuple) and p[0] == "add" else p for p in n.post_ops]
        parsed = ops._parse_post_ops(post)
        residuals = [p[1] for p in n.post_ops if isinstance(p, tuple) and p[0] == "add"]
        k = n.weight.size[2:]
        e = self.emit
        self.begin(n)
        x = self.read(n, n.x)
        e(f"  const clw::H* xs = &{x}; clw::H xc; bool scl = {str(dst_cl).lower()};")
        e(f"  if (!clw::dense_in({x}, scl)) {{ if (clw::dense_in({x}, !scl)) scl = !scl; "
          f"else {{ xc = clw::copy_in_order({x}, scl); xs = &xc; }} }}")
        e("  const int64_t* xsz = clw::sizes(*xs);")
        e("  cl_conv_args a; std::memset(&a, 0, sizeof a);")
        e(f"  a.nsp = {nsp}; a.dtype = {_CL_DTYPE[n.x.dtype]}; a.bias_dtype = {_CL_DTYPE[n.x.dtype]};")
        e(f"  a.has_bias = {int(n.bias is not None)}; a.src_cl = scl; a.dst_cl = {int(dst_cl)}; "
          f"a.w_cl = {_weight_format(n.weight)};")
        e(f"  a.n = xsz[0]; a.ic = xsz[1]; a.oc = {int(n.weight.size[0])}; a.groups = {n.groups};")
        ic = int(n.weight.size[1]) * n.groups
        e(f"  if (a.ic != {ic}) clw::fail(\"{n.name}: input has \" + std::to_string(a.ic) + "
          f"\" channels, the weight expects {ic}\");")
        for i in range(nsp):
            kk, s, p, d = int(k[i]), n.stride[i], n.padding[i], n.dilation[i]
            e(f"  a.in_sp[{i}] = xsz[{2 + i}]; a.k_sp[{i}] = {kk}; a.stride[{i}] = {s}; "
              f"a.pad_l[{i}] = a.pad_r[{i}] = {p}; a.dilation[{i}] = {d};")
            e(f"  a.out_sp[{i}] = (xsz[{2 + i}] + {2 * p} - {d * (kk - 1) + 1}) / {s} + 1;")
            e(f"  if (xsz[{2 + i}] + {2 * p} < {d * (kk - 1) + 1}) clw::fail(\"{n.name}: kernel larger "
              f"than the padded input\");")
        e(f"  a.n_post_ops = {len(parsed)};")
        for i, (kind, alpha, beta, _) in enumerate(parsed):
            e(f"  a.post_ops[{i}].kind = {kind}; a.post_ops[{i}].alpha = {float_literal(alpha)}; "
              f"a.post_ops[{i}].beta = {float_literal(beta)};")
        dims = ", ".join(["a.n", "a.oc"] + [f"a.out_sp[{i}]" for i in range(nsp)])
        e(f"  const int64_t osz[] = {{{dims}}};")
        inplace = self.inplace_residual(n, residuals)
        if inplace is not None:
            # The output takes over the dying residual's storage: oneDNN's sum post-op adds in place.
            e(f"  clw::H tmp_out = clw::take_over({self.v(inplace)}, {nsp + 2}, osz, {str(dst_cl).lower()});")
            e("  const bool inplace = static_cast<bool>(tmp_out);")
            self.alloc(n.out, nsp + 2, "osz", "if (!inplace) tmp_out")
        else:
            self.alloc(n.out, nsp + 2, "osz")
        res_names = []
        for j, r in enumerate(residuals):
            rv = self.read(n, r)
            conv_r = f"clw::ordered({rv}, {str(dst_cl).lower()}, res{j}_c)"
            if j == 0 and inplace is not None:
                conv_r = f"(inplace ? tmp_out : {conv_r})"
            e(f"  clw::H res{j}_c; const clw::H& res{j} = {conv_r};")
            e(f"  if (clw::dim(res{j}) != {nsp + 2} || !std::equal(osz, osz + {nsp + 2}, clw::sizes(res{j})))")
            e(f"    clw::fail(\"{n.name}: the residual does not have the output's size\");")
            res_names.append(f"clw::addr(res{j})")
        e(f"  const uintptr_t res[] = {{{', '.join(res_names) or '0'}}};")
        bias = f"(uintptr_t)consts[{3 * bi}]" if bi is not None else "0"
        # An empty batch has an empty result, as in eager (oneDNN takes no zero-sized problem).
        e(f"  if (a.n > 0 && clw::conv_forward(&a, clw::addr(*xs), (uintptr_t)consts[{3 * wi}], "
          f"(unsigned long long)consts[{3 * wi + 1}], consts[{3 * wi + 2}], {bias}, clw::addr(tmp_out), "
          f"{'res' if residuals else 'nullptr'}))")
        e(f"    clw::fail(std::string(\"{n.name}: \") + clw::conv_error());")
        e(f"  t_{n.out.name} = std::move(tmp_out);")
        self.end(n)

    def inplace_residual(self, n: ir.Conv, residuals: List[ir.Buffer]) -> Optional[ir.Buffer]:
        """The first residual when the conv's output may take over its storage: the
        segment allocated it, nothing else refers to it, and it dies at this conv."""
        from cpu_layout.codegen.wrapper import _required

        if not residuals:
            return None
        r = residuals[0]
        ok = (r in self.fresh and r not in self.aliased and r not in self.outs and n.out not in self.outs
              and self.last_use.get(r) is n and r is not n.x and residuals.count(r) == 1
              and r.dtype == n.out.dtype and _required(n, r) in (None, r.layout))  # no copy planned
        return r if ok else None

    def kernel(self, n: ir.Kernel):
        spec = self.kernels[n]
        nd, ni = n.out.rank, len(n.inputs)
        e = self.emit
        self.begin(n)
        ins = [self.v(b) for b in n.inputs]
        e(f"  const clw::H* ins[] = {{{', '.join('&' + i for i in ins)}}};")
        e(f"  int64_t sz[{max(nd, 1)}]; clw::broadcast_sizes(ins, {ni}, {nd}, sz);")
        self.alloc(n.out, nd, "sz")
        e(f"  int64_t st[{max((ni + 1) * nd, 1)}];")
        for i, name in enumerate(ins):
            e(f"  clw::broadcast_strides({name}, {nd}, sz, st + {i * nd});")
        e(f"  {{ const int64_t* os = clw::strides(tmp_out); for (int d = 0; d < {nd}; ++d) "
          f"st[{ni * nd} + d] = os[d]; }}")
        e(f"  void* const d[] = {{{', '.join(f'clw::data({i})' for i in ins)}, clw::data(tmp_out)}};")
        e(f"  {spec.name}(sz, d, st);")
        e(f"  t_{n.out.name} = std::move(tmp_out);")
        self.end(n)

    def reduction(self, n: ir.Reduction):
        spec = self.kernels[n]
        x = n.inputs[0]
        nd, ond = x.rank, n.out.rank
        e = self.emit
        self.begin(n)
        xv = self.v(x)
        e(f"  const int64_t* xs = clw::sizes({xv});")
        if n.kind in ("amax", "amin"):
            cond = " || ".join(f"xs[{d}] == 0" for d in n.dims)
            e(f"  if ({cond}) clw::fail(\"{n.name}: {n.kind} over an empty dimension has no identity\");")
        osz = [("1" if d in n.dims else f"xs[{d}]") for d in range(nd) if n.keepdim or d not in n.dims]
        e(f"  const int64_t osz[] = {{{', '.join(osz) or '1'}}};")
        self.alloc(n.out, ond, "osz")
        e(f"  int64_t st[{2 * nd}]; const int64_t* xst = clw::strides({xv});")
        e(f"  const int64_t* os = clw::strides(tmp_out);")
        e(f"  for (int d = 0; d < {nd}; ++d) {{ st[d] = xst[d]; st[{nd} + d] = 0; }}")
        j = 0
        for d in range(nd):
            if d not in n.dims:
                e(f"  st[{nd + d}] = xs[{d}] != 1 ? os[{j}] : 0;")
            if n.keepdim or d not in n.dims:
                j += 1
        e(f"  void* const d[] = {{clw::data({xv}), clw::data(tmp_out)}};")
        e(f"  {spec.name}(xs, d, st);")
        e(f"  t_{n.out.name} = std::move(tmp_out);")
        self.end(n)

    def layer_norm(self, n: ir.LayerNorm):
        spec = self.kernels[n]
        e = self.emit
        self.begin(n)
        x = self.read(n, n.x)
        nd = n.x.rank
        e(f"  const int64_t* xs = clw::sizes({x});")
        e(f"  int64_t rc[2] = {{1, 1}}; for (int d = 0; d < {nd}; ++d) rc[d < {nd - n.n_norm} ? 0 : 1] *= xs[d];")
        e("  {")
        self.alloc(n.out, nd, "xs", cl="false")
        params = [self.v(b) for b in (n.weight, n.bias) if b is not None]
        for b, p in zip([b for b in (n.weight, n.bias) if b is not None], params):
            e(f"  if (clw::numel({p}) != rc[1] || !clw::dense_in({p}, false)) "
              f"clw::fail(\"{n.name}: layer_norm {b.name} is not dense with the normalised size\");")
        data = [f"clw::data({x})"] + [f"clw::data({p})" for p in params] + ["clw::data(tmp_out)"]
        e(f"  void* const d[] = {{{', '.join(data)}}};")
        e(f"  if (rc[0] * rc[1] > 0) {spec.name}(rc, d, nullptr);")
        e(f"  t_{n.out.name} = std::move(tmp_out); }}")
        self.end(n)

    def aten_op(self, n: ir.Aten):
        t, a = n.target, n.args
        out = f"t_{n.out.name}"
        e = self.emit
        self.begin(n)
        if t in VIEW_OPS:
            x = self.read_aliased(n, a[0])
            perm = permutation_of(t, a, a[0].rank)
            if t in (aten.view.default, aten._unsafe_view.default):
                dims = ", ".join(S.cexpr(s) for s in n.out.size)
                e(f"  const int64_t nsz[] = {{{dims or '1'}}};")
                e(f"  {out} = clw::reshape({x}, {n.out.rank}, nsz);")
            elif perm is not None:
                e(f"  const int perm[] = {{{', '.join(map(str, perm))}}};")
                e(f"  {out} = clw::permute({x}, {a[0].rank}, perm);")
            else:  # unsqueeze
                d = a[1] % (a[0].rank + 1)
                e(f"  {out} = clw::unsqueeze({x}, {d});")
            lay = n.out.layout
            if isinstance(lay, tuple):  # the plan's order: a no-op when the alias already is
                e(f"  {{ const int p[] = {{{', '.join(map(str, lay))}}}; clw::H c; "
                  f"const clw::H& r = clw::ordered_perm({out}, p, c); if (&r == &c) {out} = std::move(c); }}")
            elif lay in L.LABELS:
                e(f"  {{ clw::H c; const clw::H& r = clw::ordered({out}, {_cl(lay)}, c); "
                  f"if (&r == &c) {out} = std::move(c); }}")
        elif n in self.kernels:  # a pool on the generated channels-last kernel
            spec = self.kernels[n]
            x = self.read(n, a[0])
            e(f"  const int64_t* xs = clw::sizes({x});")
            dims = [f"xs[{i}]" for i in range(4)]
            for d, (k, st, p, dl) in enumerate(zip(spec.kernel, spec.stride, spec.padding, spec.dilation)):
                o = f"(xs[{2 + d}] + {2 * p - dl * (k - 1) - 1 + (st - 1 if spec.ceil_mode else 0)}) / {st} + 1"
                e(f"  int64_t o{d} = {o};")
                if spec.ceil_mode:
                    e(f"  if ((o{d} - 1) * {st} >= xs[{2 + d}] + {p}) o{d} -= 1;")
                dims.append(f"o{d}")
            e(f"  const int64_t sz[] = {{{', '.join(dims)}}};")
            e(f"  const int64_t osz[] = {{xs[0], xs[1], o0, o1}};")
            self.alloc(n.out, 4, "osz", out, cl="true")
            e(f"  void* const d[] = {{clw::data({x}), clw::data({out})}};")
            e(f"  {spec.name}(sz, d, nullptr);")
        elif t is aten.max_pool2d.default:
            x = self.read(n, a[0])
            k, st, pad = pool_window(a)
            dil = _pair(a[4] if len(a) > 4 else 1)
            ceil = int(bool(a[5])) if len(a) > 5 else 0
            e(f"  const int64_t k[] = {_arr(k)}, s[] = {_arr(st)}, p[] = {_arr(pad)}, dl[] = {_arr(dil)};")
            e("  AtenTensorHandle o, idx;")
            e(f"  clw::shim(aoti_torch_cpu_max_pool2d_with_indices({x}.get(), k, 2, s, 2, p, 2, dl, 2, "
              f"{ceil}, &o, &idx), \"{n.name}: max_pool2d\");")
            e(f"  clw::H drop(idx); {out} = clw::H(o);")
        elif t is aten.avg_pool2d.default:
            x = self.read(n, a[0])
            k, st, pad = pool_window(a)
            ceil = int(bool(a[4])) if len(a) > 4 else 0
            incl = int(bool(a[5])) if len(a) > 5 else 1
            div = a[6] if len(a) > 6 else None
            e(f"  const int64_t k[] = {_arr(k)}, s[] = {_arr(st)}, p[] = {_arr(pad)};")
            if div is not None:
                e(f"  int64_t div = {int(div)};")
            e("  AtenTensorHandle o;")
            e(f"  clw::shim(aoti_torch_cpu_avg_pool2d({x}.get(), k, 2, s, 2, p, 2, {ceil}, {incl}, "
              f"{'&div' if div is not None else 'nullptr'}, &o), \"{n.name}: avg_pool2d\");")
            e(f"  {out} = clw::H(o);")
        elif t is aten.cat.default and own_cat(n):
            parts = [self.read(n, b) for b in a[0]]
            dim = (a[1] if len(a) > 1 else 0) % n.out.rank
            e(f"  const clw::H* parts[] = {{{', '.join('&' + p for p in parts)}}};")
            e(f"  int64_t osz[{n.out.rank}]; clw::cat_sizes(parts, {len(parts)}, {dim}, osz);")
            self.alloc(n.out, n.out.rank, "osz", out)
            e(f"  clw::cat_into({out}, parts, {len(parts)}, {dim}, {_cl(n.out.layout)});")
        elif t is aten.cat.default:
            parts = [self.read(n, b) for b in a[0]]
            dim = a[1] if len(a) > 1 else 0
            e(f"  const AtenTensorHandle parts[] = {{{', '.join(p + '.get()' for p in parts)}}};")
            e("  AtenTensorHandle o;")
            e(f"  clw::shim(aoti_torch_cpu_cat(parts, {len(parts)}, {dim}, &o), \"{n.name}: cat\");")
            e(f"  {out} = clw::H(o);")
        elif t is aten.as_strided.default:  # over eager's layout of its input (its read rule)
            x = self.read_aliased(n, a[0])
            off = -1 if len(a) < 4 or a[3] is None else int(a[3])
            e(f"  const int64_t sz[] = {_arr(a[1])}, st[] = {_arr(a[2])};")
            e(f"  {out} = clw::as_strided({x}, {len(a[1])}, sz, st, {off});")
        elif t is aten.upsample_nearest2d.default:
            cl = _cl(n.out.layout if n.out.layout in L.LABELS else L.CONTIGUOUS)
            x = self.read(n, a[0])
            e(f"  {out} = clw::upsample_nearest2d({x}, {int(a[1][0])}, {int(a[1][1])}, {cl});")
            self.fresh.add(n.out)
        elif t in _INDEX_OPS:
            x = self.read(n, a[0])
            ptrs = []
            for j, i in enumerate(a[1]):
                if i is None:
                    ptrs.append("nullptr")
                else:
                    e(f"  AtenTensorHandle i{j} = {self.v(i)}.get();")
                    ptrs.append(f"&i{j}")
            e(f"  const AtenTensorHandle* idx[] = {{{', '.join(ptrs)}}};")
            e("  AtenTensorHandle o;")
            e(f"  clw::shim(aoti_torch_cpu_index_Tensor({x}.get(), idx, {len(ptrs)}, &o), \"{n.name}: index\");")
            e(f"  {out} = clw::H(o);")
        else:  # addmm / mm
            mm = t is aten.mm.default
            names = [self.read(n, b) for b in (a[:2] if mm else a[:3])]
            m1, m2 = (names[0], names[1]) if mm else (names[1], names[2])
            e(f"  const int64_t osz[] = {{clw::sizes({m1})[0], clw::sizes({m2})[1]}};")
            self.alloc(n.out, 2, "osz", out, cl="false")
            if mm:
                e(f"  clw::shim(aoti_torch_cpu_mm_out({out}.get(), {m1}.get(), {m2}.get()), \"{n.name}: mm\");")
            else:
                beta = float(a[3]) if len(a) > 3 else 1.0
                alpha = float(a[4]) if len(a) > 4 else 1.0
                e(f"  clw::shim(aoti_torch_cpu_addmm_out({out}.get(), {names[0]}.get(), {m1}.get(), "
                  f"{m2}.get(), {beta!r}, {alpha!r}), \"{n.name}: addmm\");")
        if t in (aten.max_pool2d.default, aten.avg_pool2d.default, aten.cat.default) + _INDEX_OPS:
            self.fresh.add(n.out)
        self.end(n)

    def split(self, n: ir.Aten):
        """A handle of the input that the pieces view (the tuple itself is never materialised)."""
        x = self.read_aliased(n, n.args[0])
        self.emit(f"// {n.name}: split")
        self.emit(f"clw::H t_{n.out.name} = clw::alias({x}, (int)clw::dim({x}), clw::sizes({x}), clw::strides({x}));")
        self.var[n.out] = f"t_{n.out.name}"

    def split_piece(self, n: ir.Getitem):
        dim, start, end = split_piece(n.inputs[0].producer, n.index)
        self.begin(n)
        self.view_of(n.out, n.inputs[0])
        self.emit(f"  t_{n.out.name} = clw::slice({self.v(n.inputs[0])}, {dim}, {start}, {end});")
        self.end(n)

    def slice(self, n: ir.Aten):
        dim, start, end = slice_range(n)
        self.begin(n)
        x = self.read_aliased(n, n.args[0])
        end = "INT64_MAX" if end is None else int(end)
        self.emit(f"  t_{n.out.name} = clw::slice({x}, {dim}, {int(start)}, {end});")
        self.end(n)

    def clone(self, n: ir.Aten):
        out = f"t_{n.out.name}"
        self.begin(n)
        x = self.read(n, n.args[0])
        self.alloc(n.out, n.out.rank, f"clw::sizes({x})", out, cl=_cl(clone_order(n)))
        self.emit(f"  clw::copy_into({out}, {x});")
        self.end(n)

    def channel_shuffle(self, n: ir.Aten):
        out = f"t_{n.out.name}"
        groups, start, end = (int(a) for a in n.args[1:])
        self.begin(n)
        x = self.read(n, n.args[0])
        lay = n.out.layout if n.out.layout in L.LABELS else L.CONTIGUOUS
        self.emit(f"  int64_t osz[{n.out.rank}]; std::copy_n(clw::sizes({x}), {n.out.rank}, osz); osz[1] = {end - start};")
        self.alloc(n.out, n.out.rank, "osz", out, cl=_cl(lay))
        self.emit(f"  clw::channel_shuffle_into({out}, {x}, {groups}, {start});")
        self.end(n)

    def const_index(self, b: ir.Buffer) -> int:
        return self.consts.index(b)




_SIGNATURE = ("const uintptr_t* in, const int64_t* consts, const int64_t* scalars, uintptr_t* out, "
              "char* err, int errlen")


def _emit_segment(seg: ir.Segment, kernels, outs: List[ir.Buffer], consts: List[ir.Buffer],
                  sym_src, last_use: Dict[ir.Buffer, ir.Node], debug: bool) -> str:
    em = _SegmentEmitter(kernels, consts, outs, last_use)
    acts = seg.inputs[:seg.n_activations]
    em.emit(f"clw::H t_in[{max(len(acts), 1)}];")
    em.emit(f"for (int i = 0; i < {len(acts)}; ++i) t_in[i] = clw::H((AtenTensorHandle)in[i]);")
    for i, b in enumerate(acts):
        em.var[b] = f"t_in[{i}]"
        want = [int(x) if type(x) is int else -1 for x in b.size]
        em.emit(f"{{ const int64_t want[] = {_arr(want)}; "
                f"clw::expect(t_in[{i}], {_HELD_ES[b.dtype]}, {b.rank}, want, \"input {b.name}\"); }}")
    # Module constants that kernels or ATen ops read need a tensor view of their memory.
    needs_handle = {b for m in seg.members if not isinstance(m, ir.Conv) for b in m.inputs if b in consts}
    for m in seg.members:
        if isinstance(m, ir.Conv):
            needs_handle.update(p[1] for p in m.post_ops if isinstance(p, tuple) and p[1] in consts)
    for i, b in enumerate(consts):
        if b in needs_handle:
            em.emit(f"const int64_t c{i}_sz[] = {_arr(b.size)}, c{i}_st[] = {_arr(_static_strides(b))};")
            em.emit(f"clw::H c{i} = clw::blob((uintptr_t)consts[{3 * i}], {b.rank}, c{i}_sz, c{i}_st, "
                    f"{_HELD_ES[b.dtype]});")
            em.var[b] = f"c{i}"
    # Symbols the views' sizes use, read from the inputs that define them.
    syms = set()
    for m in seg.members:
        if isinstance(m, ir.Aten) and m.target in (aten.view.default, aten._unsafe_view.default):
            for s in m.out.size:
                syms |= S.free_symbols(s)
    for sym in sorted(syms, key=lambda s: s.name):
        src, dim = sym_src[sym]
        if dim is None:
            em.emit(f"const int64_t {sym.name} = scalars[{seg.inputs.index(src) - seg.n_activations - 1}];")
        else:
            em.emit(f"const int64_t {sym.name} = clw::sizes({em.v(src)})[{dim}];")
    members = seg.members
    outset = set(outs)
    from cpu_layout.codegen.wrapper import _required, conversions

    reads, last_conv = conversions(members, _required)
    for m in members:
        keys = list(reads.get(m, {}).values())
        em.convert_reads(keys)
        if isinstance(m, ir.Conv):
            em.conv(m)
        elif isinstance(m, ir.Kernel):
            em.kernel(m)
        elif isinstance(m, ir.Reduction):
            em.reduction(m)
        elif isinstance(m, ir.LayerNorm):
            em.layer_norm(m)
        elif isinstance(m, ir.Getitem):
            em.split_piece(m)
        elif m.target in SPLIT_OPS:
            em.split(m)
        elif m.target is aten.clone.default:
            em.clone(m)
        elif m.target is ops.channel_shuffle:
            em.channel_shuffle(m)
        elif m.target is aten.slice.Tensor:
            em.slice(m)
        else:
            em.aten_op(m)
        if debug and m.out.layout in L.LABELS:
            em.emit(f"clw::check_order(t_{m.out.name}, {_cl(m.out.layout)}, \"{m.out.name}\");")
        em.release_reads(keys, last_conv, m)
        for b in dict.fromkeys(m.inputs):
            if last_use.get(b) is m and b in em.var and b not in outset and b not in consts:
                em.release(b)
    for j, b in enumerate(outs):
        em.emit(f"out[{j}] = (uintptr_t){em.v(b)}.release();")
    return (
        f"static clw::PoolSlot {seg.name}_pool;\n"
        f'extern "C" void {seg.name}_release(void) {{ delete {seg.name}_pool.p.exchange(nullptr); }}\n'
        f'extern "C" int {seg.name}({_SIGNATURE}) {{\n'
        f"  try {{\n    clw::PoolLease clw_pool({seg.name}_pool);\n" + "\n".join(em.lines) + "\n"
        f"  }} catch (const std::exception& e) {{\n    return clw::report(e, err, errlen);\n  }}\n"
        f"  (void)consts; (void)scalars;\n  return 0;\n}}\n"
    )


def _symbol_sources(g: ir.Graph) -> Dict:
    """symbol -> (graph Input tensor, dim) or (symbolic-int Input, None): where its value is read."""
    import sympy

    src = {}
    for n in g.nodes:
        if not isinstance(n, ir.Input):
            continue
        b = n.out
        if b.is_tensor:
            for d, s in enumerate(b.size):
                if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol):
                    src.setdefault(s.node.expr, (b, d))
        elif isinstance(b.sym, sympy.Symbol):
            src.setdefault(b.sym, (b, None))
    return src


def _prepare(g: ir.Graph) -> None:
    _hoist_batch_norm(g)
    # A split's pieces right after it, so they share its segment (the tuple is never a handle).
    for n in [n for n in g.nodes if isinstance(n, ir.Aten) and n.target in SPLIT_OPS and runs_in_cpp(n)]:
        items = [u for u in g.nodes if u in n.out.users]
        rest = [m for m in g.nodes if m not in items]
        pos = rest.index(n) + 1
        g.nodes = rest[:pos] + items + rest[pos:]
    for n in g.nodes:
        if isinstance(n, ir.Aten) and n.target in VIEW_OPS and runs_in_cpp(n):
            # Its sizes come from the symbolic shape, so the scalar arithmetic
            # that fed it in Python is no longer needed (and would split segments).
            for b in [b for b in n.inputs if not b.is_tensor]:
                while n in b.users:
                    b.users.remove(n)
            n.inputs = [b for b in n.inputs if b.is_tensor]
    g.remove_dead()


def _partition(g: ir.Graph):
    """Constant nodes (the prologue), and the rest in order as groups: a list
    of nodes for each run that goes into one segment, a node for Python."""
    body = [n for n in g.nodes if not isinstance(n, (ir.Input, ir.Output))]
    const_nodes = [n for n in body if n.out is not None and n.out.constant]
    rest = [n for n in body if not (n.out is not None and n.out.constant)]
    groups: List[object] = []
    for n in rest:
        if not runs_in_cpp(n):
            groups.append(n)
        elif groups and isinstance(groups[-1], list):
            groups[-1].append(n)
        else:
            groups.append([n])
    return const_nodes, rest, groups


def _segment_io(grp: List[ir.Node], output: ir.Output, sym_src: Dict):
    """What a segment reads (activations, constants, size-defining ints) and returns."""
    inside = {m.out for m in grp}
    members = set(grp)
    graph_outs = set(ir.values_of(output.values))
    acts, consts, scalars = [], [], []
    for m in grp:
        for b in m.inputs:
            if not b.is_tensor or b in inside:
                continue
            target = consts if b.constant else acts
            if b not in target:
                target.append(b)
    outs = [b for b in inside if b in graph_outs or any(u not in members for u in b.users)]
    outs.sort(key=lambda b: grp.index(b.producer))
    for m in grp:
        if isinstance(m, ir.Aten) and m.target in (aten.view.default, aten._unsafe_view.default):
            for sym in set().union(*(S.free_symbols(s) for s in m.out.size)):
                if sym not in sym_src:
                    raise NotImplementedError(f"no input defines size symbol {sym}")
                b, dim = sym_src[sym]
                target = scalars if dim is None else acts
                if b not in target:
                    target.append(b)
    return acts, consts, outs, scalars


def _relink(g: ir.Graph, nodes: List[ir.Node]) -> None:
    """Make `nodes` the graph, users and producers rebuilt from scratch."""
    for b in g.buffers.values():
        b.users = []
    for n in nodes:
        for b in n.inputs:
            b.users.append(n)
        if n.out is not None:
            n.out.producer = n
    g.nodes = nodes


def build(g: ir.Graph, debug: bool = False):
    """Rewrite a planned, fused graph for cpp_wrapper mode and compile it.
    Returns the runners the Python wrapper (codegen.wrapper) needs."""
    from cpu_layout import schedule
    from cpu_layout.codegen import wrapper

    _prepare(g)
    sym_src = _symbol_sources(g)
    const_nodes, rest, groups = _partition(g)
    inputs = [n for n in g.nodes if isinstance(n, ir.Input)]
    output = g.output
    last_use: Dict[ir.Buffer, ir.Node] = {}
    for n in g.nodes:
        for b in n.inputs:
            last_use[b] = n
    seg_specs = [(gi, grp, *_segment_io(grp, output, sym_src))
                 for gi, grp in enumerate(groups) if isinstance(grp, list)]

    # The prologue: constant nodes plus the param inputs segments read, as one memoized call.
    params = [n.out for n in inputs if n.out.constant]
    const_set = set(const_nodes)
    exports: List[ir.Buffer] = []
    for n in rest + [output]:
        for b in n.inputs:
            if b.is_tensor and b.constant and b.producer in const_set and b not in exports:
                exports.append(b)
    for spec in seg_specs:
        exports += [b for b in spec[3] if b not in exports]
    pro_graph = ir.Graph()
    pro_graph.nodes = [p.producer for p in params] + const_nodes
    pro_graph.output = ir.Output("output", list(exports), None, values=list(exports))
    pro_graph.nodes.append(pro_graph.output)

    # Emit segment C++ and compile it with every kernel of the graph.
    kernels = {}
    for _gi, grp, *_ in seg_specs:
        kernels.update(zip(*schedule.generated(grp)))
    sources, cdefs, segs = [], [], []
    for k, (gi, grp, acts, consts, outs, scalars) in enumerate(seg_specs):
        pack = g.new_buffer("pack")
        seg_out = g.new_buffer("seg")
        seg = ir.Segment(f"cl_segment_{k}", list(acts) + [pack] + list(scalars), seg_out,
                         members=grp, n_activations=len(acts))
        seg.consts = consts
        seg.outs = outs
        seg.pack = pack
        segs.append((gi, seg))
        sources.append(_emit_segment(seg, kernels, outs, consts, sym_src, last_use, debug))
        cdefs.append(f"int {seg.name}({_SIGNATURE});\nvoid {seg.name}_release(void);")
    # The kernels come first in the file and keep -O3; what follows is glue
    # (shape arithmetic, handle bookkeeping) in one long function per segment,
    # which g++ optimises in superlinear time: densenet121's took 11.5 s at -O1,
    # 3.6 s at -Og, 1.6 s at -O0. -Og ran forwards as fast as -O1 (mobilenet_v3,
    # densenet121, within noise); -O0 cost 2-5%.
    header = '#pragma GCC optimize ("Og")\n' + _csrc("cl_api.h") + _csrc("cl_wrapper.h")
    extra = header + "".join(sources) if sources else ""
    cdef = "\n".join(cdefs + (["void cl_segment_init(uintptr_t conv, uintptr_t error, uintptr_t copy, uintptr_t shuffle);",
                                   "long long cl_layout_copies(void);"] if sources else []))

    # Rebuild the main graph: inputs, prologue, then segments and Python nodes in order.
    pro_node = None
    new_nodes: List[ir.Node] = list(inputs)
    pro_out = g.new_buffer("consts")
    packs = [seg.pack for _, seg in segs]
    if const_nodes or segs:
        pro_node = ir.Aten("prologue", list(params), pro_out, rule=ir.FREE, target=None,
                           args=tuple(params), multi=True)
        new_nodes.append(pro_node)
        for i, b in enumerate(exports + packs):
            new_nodes.append(ir.Getitem(f"const{i}", [pro_out], b, index=i))
    seg_of = dict(segs)
    for gi, grp in enumerate(groups):
        if gi in seg_of:
            seg = seg_of[gi]
            new_nodes.append(seg)
            for j, b in enumerate(seg.outs):
                new_nodes.append(ir.Getitem(f"{seg.name}_{j}", [seg.out], b, index=j))
        else:
            new_nodes.append(grp)
    new_nodes.append(output)
    _relink(g, new_nodes)

    # One bind over both graphs: one compiler run for every kernel and segment.
    both = ir.Graph()
    both.nodes = pro_graph.nodes[:-1] + g.nodes
    runners, library = schedule.bind(both, extra_kernels=list(kernels.values()), extra_source=extra,
                                     extra_cdef=cdef)
    for n in const_nodes:
        if isinstance(n, ir.Aten) and isinstance(n.target, runtime.Memoized):
            runners[n] = n.target  # the hoisted batch-norm folds are memoized already
    if pro_node is not None:
        fn = None
        if const_nodes:
            src, env = wrapper.generate(pro_graph, runners, raw_outputs=True)
            exec(compile(src, "<cpu_layout prologue>", "exec"), env)
            fn = env["call"]
        else:  # only parameters: the prologue passes them through
            fn = (lambda ps, idx=[params.index(b) for b in exports]: tuple(ps[i] for i in idx))
        pack_entries = []
        for _, seg in segs:
            weights = {m.weight for m in seg.members if isinstance(m, ir.Conv)}
            pack_entries.append([(exports.index(b), b in weights, tuple(b.size), _static_strides(b))
                                 for b in seg.consts])
        runners[pro_node] = runtime.ConstantPrologue(fn, pack_entries,
                                                     library.ffi if library else ops.ffi)
    for _, seg in segs:
        call = runtime.SegmentCall(seg.name, len(seg.outs))
        call.bind(library)
        runners[seg] = call
    if segs:
        lib = ops.lib
        library.lib.cl_segment_init(
            int(ops.ffi.cast("uintptr_t", ops.ffi.addressof(lib, "cl_conv_forward"))),
            int(ops.ffi.cast("uintptr_t", ops.ffi.addressof(lib, "cl_last_error"))),
            int(ops.ffi.cast("uintptr_t", ops.ffi.addressof(lib, "cl_copy_strided"))),
            int(ops.ffi.cast("uintptr_t", ops.ffi.addressof(lib, "cl_channel_shuffle"))))
    return runners
