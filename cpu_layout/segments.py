"""cpp_wrapper mode's graph rewrites: a pass after planning and fusion, before code generation.

The graph becomes three parts (codegen/cpp_wrapper.py then encodes and binds them):

* a **prologue**: every node computed from module state alone (batch-norm
  folding, hoisted out of the convs here; autocast copies of weights; weight
  transposes), run as one memoized Python call;
* **segments** (`ir.Segment`): maximal runs of nodes that can run in C++ (the
  rule is `runs_in_cpp`), each with the activations, constants and size
  symbols it reads and the buffers it returns;
* **Python nodes** between segments: what no segment instruction runs.

`partition` makes the prologue graph and the segments, with each member
still linked in the graph (encoding reads its users); `assemble` then makes
the graph the sequence of inputs, prologue, segments and Python nodes.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from cpu_layout import ir
from cpu_layout import layout as L
from cpu_layout import op_table as T
from cpu_layout import runtime
from cpu_layout.codegen import program as P
from cpu_layout.codegen import sizes as S
from cpu_layout.quant import cpp as quant_cpp

# Its sizes and strides come from the symbolic shape (op_table.shape_exprs).
AS_STRIDED = torch.ops.aten.as_strided.default


# ---- which nodes run in C++ ------------------------------------------------------

def runs_in_cpp(n: ir.Node) -> bool:
    """THE rule: a node runs inside a C++ segment when it is
    - a convolution on constant float weights (the extension's oneDNN path),
    - a fused element-wise kernel (float or uint8 data), a reduction or a normalisation
      (generated code),
    - an int8 op on uint8 activations (quant/cpp.py),
    - an ATen call whose entry in op_table.OPS has a C++ form and admits it
      (libtorch's C shim or csrc/cl_wrapper.h; float tensors, static
      arguments, sizes that print as C++).
    Everything else (other ATen ops, symbolic scalar arithmetic, ops on
    integer tensors) is a Python node between segments."""
    if isinstance(n, ir.Conv):
        w = n.weight
        return (n.bn is None and w.constant and P.weight_format(w) is not None
                and all(T.float_tensor(b) and b.dtype == n.x.dtype for b in n.tensor_inputs()
                        if b is not n.weight_scale and b is not w)  # those two may be float32
                and T.float_tensor(w)
                and (n.bias is None or n.bias.constant))
    if isinstance(n, ir.Kernel):  # float data, and the uint8 a (de)quantizing kernel loads or stores
        return all(T.float_tensor(b) or b.dtype is torch.uint8 for b in n.inputs + [n.out]) and n.out.rank <= 16
    if isinstance(n, ir.Reduction):
        return T.float_tensor(n.inputs[0])
    if isinstance(n, ir.Norm):
        return all(T.float_tensor(b) for b in n.inputs)
    if quant_cpp.runs_in_cpp(n):  # int8 convs, pools and cats on uint8 activations
        return True
    if isinstance(n, ir.Getitem):  # a piece of a split a segment runs
        src = n.inputs[0].producer
        return isinstance(src, ir.Aten) and src.target in T.SPLIT_OPS and runs_in_cpp(src)
    return isinstance(n, ir.Aten) and T.runs_in_cpp(n)


# ---- rewrites ----------------------------------------------------------------------

def _hoist_batch_norm(g: ir.Graph) -> None:
    """Folded batch-norm as explicit constant nodes, so convs read plain weights.

    A conv whose weight the extension packs itself (`runtime.packs_own_weight`)
    reads that weight and a per-channel scale multiplied in while packing
    (`runtime.bn_scale_shift`); any other reads a folded copy
    (`runtime.fold_batch_norm`)."""
    for conv in [n for n in g.nodes if isinstance(n, ir.Conv) and n.bn is not None]:
        bn, w, b = conv.bn, conv.weight, conv.bias
        src = (w, b, bn.weight, bn.bias, bn.mean, bn.var)
        if not all(s is None or s.constant for s in src):
            continue
        scaled = runtime.packs_own_weight(conv)
        oc = w.size[0]
        pair = g.new_buffer("fold")
        pair.constant = True
        if scaled:
            src = src[1:]
            dtype = conv.x.dtype  # a float32 weight of a bf16 conv: the bias is bf16
            fn = functools.partial(runtime.bn_scale_shift, eps=bn.eps, dtype=dtype)
            outs = (g.new_buffer("scale", size=(oc,), dtype=torch.float32, eager_stride=(1,)),
                    g.new_buffer("b", size=(oc,), dtype=dtype, eager_stride=(1,)))
        else:
            fn = functools.partial(runtime.fold_batch_norm, eps=bn.eps)
            outs = (g.new_buffer("w", size=w.size, dtype=w.dtype, eager_stride=L.contiguous_strides(w.size)),
                    g.new_buffer("b", size=(oc,), dtype=w.dtype, eager_stride=(1,)))
        fold = ir.Aten(f"{conv.name}_fold", [s for s in src if s is not None], pair, rule=ir.EAGER,
                       target=runtime.Memoized(fn), args=src, multi=True)
        pos = g.nodes.index(conv)
        g.nodes.insert(pos, fold)
        for s in fold.inputs:
            s.users.append(fold)
        pair.producer = fold
        for i, nb in enumerate(outs):
            nb.constant = True
            nb.layout = ir.EAGER
            gi = ir.Getitem(f"{conv.name}_fold{i}", [pair], nb, index=i)
            g.nodes.insert(pos + 1 + i, gi)
            pair.users.append(gi)
            nb.producer = gi
            nb.users.append(conv)
        for s in {x for x in (w, b, bn.weight, bn.bias, bn.mean, bn.var) if x is not None}:
            while conv in s.users:
                s.users.remove(conv)
        if scaled:
            new_w, (scale, new_b) = w, outs
            w.users.append(conv)
        else:
            (new_w, new_b), scale = outs, None
        conv.inputs = [conv.x, new_w, new_b] + conv.residuals() + ([scale] if scale is not None else [])
        conv.weight, conv.bias, conv.bn, conv.prefolded, conv.weight_scale = new_w, new_b, None, bn, scale


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
    for n in [n for n in g.nodes if isinstance(n, ir.Aten) and n.target in T.SPLIT_OPS and runs_in_cpp(n)]:
        items = [u for u in g.nodes if u in n.out.users]
        rest = [m for m in g.nodes if m not in items]
        pos = rest.index(n) + 1
        g.nodes = rest[:pos] + items + rest[pos:]
    for n in g.nodes:
        if isinstance(n, ir.Aten) and (n.rule == ir.VIEW or n.target is AS_STRIDED) and runs_in_cpp(n):
            # Its sizes come from the symbolic shape, so the scalar arithmetic
            # that fed it in Python is no longer needed (and would split segments).
            for b in [b for b in n.inputs if not b.is_tensor]:
                while n in b.users:
                    b.users.remove(n)
            n.inputs = [b for b in n.inputs if b.is_tensor]
    g.remove_dead()


def _python_first(nodes: List[ir.Node]) -> List[ir.Node]:
    """`nodes` with the Python nodes that read nothing a segment computes moved
    ahead, in order: an attention mask built from the input ids (bool tensors,
    Python) between layers would otherwise end one segment and start the next.
    Nodes with effects, and everything after one, keep their places."""
    from_cpp = set()  # buffers a segment computes, or computed from one
    early, late = [], []
    for i, n in enumerate(nodes):
        if n.effects:
            return early + late + nodes[i:]
        if runs_in_cpp(n) or any(b in from_cpp for b in n.inputs):
            late.append(n)
            if n.out is not None:
                from_cpp.add(n.out)
        else:
            early.append(n)
    return early + late


def _groups(g: ir.Graph):
    """Constant nodes (the prologue), and the rest in order as groups: a list
    of nodes for each run that goes into one segment, a node for Python."""
    body = [n for n in g.nodes if not isinstance(n, (ir.Input, ir.Output))]
    const_nodes = [n for n in body if n.out is not None and n.out.constant]
    rest = _python_first([n for n in body if not (n.out is not None and n.out.constant)])
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
    """What a segment reads (activations, constants, size-defining ints) and returns,
    and the size symbols its views use with where each is read: [(symbol, buffer,
    dim or None)], in name order (the order of the program's symbol slots)."""
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
    syms = set()
    for m in grp:
        for sym in set().union(*(S.free_symbols(s) for s in T.shape_exprs(m))):
            if sym not in sym_src:
                raise NotImplementedError(f"no input defines size symbol {sym}")
            syms.add(sym)
            b, dim = sym_src[sym]
            target = scalars if dim is None else acts
            if b not in target:
                target.append(b)
    sym_reads = [(sym, *sym_src[sym]) for sym in sorted(syms, key=lambda s: s.name)]
    return acts, consts, outs, scalars, sym_reads


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


@dataclass
class Partition:
    """What `partition` decided, for the encoder and for `assemble`."""
    inputs: List[ir.Input]
    output: ir.Output
    params: List[ir.Buffer]            # module-state inputs (the prologue's arguments)
    const_nodes: List[ir.Node]         # the prologue's nodes
    groups: List[object]               # in order: a Segment, or a node run in Python
    exports: List[ir.Buffer]           # the prologue's results, in its output order
    python_read: set                   # exports read outside the segments
    prologue: ir.Graph
    last_use: Dict[ir.Buffer, ir.Node]  # each buffer's last reader in the graph as partitioned

    @property
    def segments(self) -> List[ir.Segment]:
        return [s for s in self.groups if isinstance(s, ir.Segment)]


def partition(g: ir.Graph) -> Partition:
    """The prologue and the segments of a planned, fused graph (rewritten for them first)."""
    _prepare(g)
    sym_src = _symbol_sources(g)
    const_nodes, rest, groups = _groups(g)
    inputs = [n for n in g.nodes if isinstance(n, ir.Input)]
    output = g.output
    last_use: Dict[ir.Buffer, ir.Node] = {}
    for n in g.nodes:
        for b in n.inputs:
            last_use[b] = n
    params = [n.out for n in inputs if n.out.constant]
    const_set = set(const_nodes)
    exports: List[ir.Buffer] = []
    for n in rest + [output]:
        for b in n.inputs:
            if b.is_tensor and b.constant and b.producer in const_set and b not in exports:
                exports.append(b)
    # Read outside the segments (a segment reads its constants through its pack).
    python_read = {b for grp in groups if not isinstance(grp, list) for b in grp.inputs}
    python_read.update(output.inputs)
    k = 0
    for i, grp in enumerate(groups):
        if not isinstance(grp, list):
            continue
        acts, consts, outs, scalars, sym_reads = _segment_io(grp, output, sym_src)
        exports += [b for b in consts if b not in exports]
        pack = g.new_buffer("pack")
        seg = ir.Segment(f"cl_segment_{k}", list(acts) + [pack] + list(scalars), g.new_buffer("seg"),
                         members=grp, n_activations=len(acts))
        seg.consts, seg.outs, seg.pack, seg.sym_reads = consts, outs, pack, sym_reads
        groups[i] = seg
        k += 1
    prologue = ir.Graph()
    prologue.nodes = [p.producer for p in params] + const_nodes
    prologue.output = ir.Output("output", list(exports), None, values=list(exports))
    prologue.nodes.append(prologue.output)
    return Partition(inputs, output, params, const_nodes, groups, exports, python_read, prologue,
                     last_use)


def assemble(g: ir.Graph, part: Partition) -> Optional[ir.Aten]:
    """Make `g` its inputs, the prologue's call (returned, None without one), then
    the segments (each followed by the picks of its results) and Python nodes in order."""
    pro_node = None
    new_nodes: List[ir.Node] = list(part.inputs)
    pro_out = g.new_buffer("consts")
    segs = part.segments
    packs = [seg.pack for seg in segs]
    if part.const_nodes or segs:
        pro_node = ir.Aten("prologue", list(part.params), pro_out, rule=ir.FREE, target=None,
                           args=tuple(part.params), multi=True, picks_args=True)
        new_nodes.append(pro_node)
        for i, b in enumerate(part.exports + packs):
            if b in part.python_read or b in packs:
                new_nodes.append(ir.Getitem(f"const{i}", [pro_out], b, index=i))
    for grp in part.groups:
        new_nodes.append(grp)
        if isinstance(grp, ir.Segment):
            for j, b in enumerate(grp.outs):
                new_nodes.append(ir.Getitem(f"{grp.name}_{j}", [grp.out], b, index=j))
    new_nodes.append(part.output)
    _relink(g, new_nodes)
    return pro_node
