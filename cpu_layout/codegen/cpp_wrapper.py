"""cpp_wrapper mode: the graph's work in C++ segments, each entered once per forward.

After planning and fusion the graph is rewritten into three parts:

* a **prologue** (Python, memoized as one unit): every node computed from
  module state alone (batch-norm folding, autocast copies of weights, weight
  transposes). It runs again only when a parameter's storage or version
  counter changed, and then also packs the constants each segment reads
  (address, weight serial, version) into one int64 array per segment.
* **segments**: maximal runs of nodes that can run in C++ (the rule is
  `runs_in_cpp`), each encoded as a program for the precompiled segment
  runtime (codegen/program.py, csrc/segment_vm.cpp); only the graph's fused
  kernels are compiled per graph. Tensors cross the boundary as ATen tensor
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
symbolic sizes (codegen.sizes: postfix tokens), so a new batch size runs without recompiling.
"""
from __future__ import annotations

import functools
import sys
from typing import Dict, List, Optional

import torch

from cpu_layout import config, ir
from cpu_layout import layout as L
from cpu_layout import op_table as T
from cpu_layout import ops, runtime
from cpu_layout.codegen import program as P
from cpu_layout.codegen import sizes as S

aten = torch.ops.aten


# ---- which nodes run in C++ ------------------------------------------------------

def weight_format(b: ir.Buffer) -> Optional[int]:
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
    - an ATen call whose entry in op_table.OPS has a C++ form and admits it
      (libtorch's C shim or csrc/cl_wrapper.h; float tensors, static
      arguments, sizes that print as C++).
    Everything else (other ATen ops, symbolic scalar arithmetic, ops on
    integer tensors) is a Python node between segments."""
    if isinstance(n, ir.Conv):
        w = n.weight
        return (n.bn is None and w.constant and weight_format(w) is not None
                and all(P.float_tensor(b) and b.dtype == n.x.dtype for b in n.tensor_inputs())
                and (n.bias is None or n.bias.constant))
    if isinstance(n, ir.Kernel):
        return all(P.float_tensor(b) for b in n.inputs) and n.out.rank <= 16
    if isinstance(n, ir.Reduction):
        return P.float_tensor(n.inputs[0])
    if isinstance(n, ir.LayerNorm):
        return all(P.float_tensor(b) for b in n.inputs)
    if isinstance(n, ir.Getitem):  # a piece of a split a segment runs
        src = n.inputs[0].producer
        return isinstance(src, ir.Aten) and src.target in T.SPLIT_OPS and runs_in_cpp(src)
    return isinstance(n, ir.Aten) and T.runs_in_cpp(n)


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


# ---- segment programs ------------------------------------------------------------------

def _encode_segment(seg: ir.Segment, kernels, outs: List[ir.Buffer], consts: List[ir.Buffer],
                    sym_src, last_use: Dict[ir.Buffer, ir.Node], debug: bool) -> P.Program:
    """The segment as a program for the segment runtime (codegen/program.py)."""
    prog = P.Program()
    em = P.SegmentEncoder(prog, kernels, consts, outs, last_use)
    acts = seg.inputs[:seg.n_activations]
    prog.n_in = len(acts)
    for b in acts:  # the caller's handles land in the first registers
        em.reg[b] = prog.reg()
    for b in acts:
        want = [int(x) if type(x) is int else -1 for x in b.size]
        prog.op("EXPECT", em.reg[b], P.HELD_ES[b.dtype], b.rank, want, prog.name(f"input {b.name}"))
    # Module constants that kernels or ATen ops read need a tensor view of their memory.
    needs_handle = {b for m in seg.members if not isinstance(m, ir.Conv) for b in m.inputs if b in consts}
    for m in seg.members:
        if isinstance(m, ir.Conv):
            needs_handle.update(p[1] for p in m.post_ops if isinstance(p, tuple) and p[1] in consts)
            if m.impl == "aten":  # torch's convolution takes tensors
                needs_handle.update(b for b in (m.weight, m.bias) if b is not None and b in consts)
    for i, b in enumerate(consts):
        if b in needs_handle:
            em.reg[b] = prog.reg()
            prog.op("BLOB", em.reg[b], i, P.HELD_ES[b.dtype], b.rank, b.size, P.static_strides(b))
    # Symbols the views' sizes use, read from the inputs that define them.
    syms = set()
    for m in seg.members:
        if isinstance(m, ir.Aten) and m.target in T.RESHAPE_OPS:
            for s in m.out.size:
                syms |= S.free_symbols(s)
    slots = {}
    for sym in sorted(syms, key=lambda s: s.name):
        slots[sym] = len(slots)
        src, dim = sym_src[sym]
        if dim is None:
            prog.op("SYM_SCALAR", slots[sym], seg.inputs.index(src) - seg.n_activations - 1)
        else:
            prog.op("SYM_DIM", slots[sym], em.reg[src], dim)
    prog.n_syms = len(slots)
    outset = set(outs)
    from cpu_layout.codegen.wrapper import conversions, read_conversion

    reads, last_conv = conversions(seg.members, read_conversion)
    for m in seg.members:
        keys = list(reads.get(m, {}).values())
        em.convert_reads(keys)
        _encode_node(em, m, slots)
        if debug and m.out.layout in L.LABELS:
            prog.op("CHECK", em.reg[m.out], int(m.out.layout == L.CHANNELS_LAST), prog.name(m.out.name))
        em.release_reads(keys, last_conv, m)
        for b in dict.fromkeys(m.inputs):
            if last_use.get(b) is m and b in em.reg and b not in outset and b not in consts:
                em.release(b)
    for j, b in enumerate(outs):
        prog.op("OUT", j, em.reg[b])
    return prog


def _encode_node(em: P.SegmentEncoder, m: ir.Node, slots) -> None:
    """One member of a segment, by kind (the kinds `runs_in_cpp` admits)."""
    if isinstance(m, ir.Conv):
        em.conv(m)
    elif isinstance(m, ir.Kernel):
        em.kernel(m)
    elif isinstance(m, ir.Reduction):
        em.reduction(m)
    elif isinstance(m, ir.LayerNorm):
        em.layer_norm(m)
    elif isinstance(m, ir.Getitem):
        em.split_piece(m, *T.split_piece(m.inputs[0].producer, m.index))
    else:
        T.encode(em, m, slots.__getitem__)

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
        if isinstance(n, ir.Aten) and n.rule == ir.VIEW and runs_in_cpp(n):
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
        if isinstance(m, ir.Aten) and m.target in T.RESHAPE_OPS:
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
    # Read outside the segments (a segment reads its constants through its pack).
    python_read = {b for grp in groups if not isinstance(grp, list) for b in grp.inputs}
    python_read.update(output.inputs)
    for spec in seg_specs:
        exports += [b for b in spec[3] if b not in exports]
    pro_graph = ir.Graph()
    pro_graph.nodes = [p.producer for p in params] + const_nodes
    pro_graph.output = ir.Output("output", list(exports), None, values=list(exports))
    pro_graph.nodes.append(pro_graph.output)

    # Each segment as a program for the segment runtime; the graph's kernels are compiled below.
    kernels = {}
    for _gi, grp, *_ in seg_specs:
        kernels.update(zip(*schedule.generated(grp)))
    segs = []
    for k, (gi, grp, acts, consts, outs, scalars) in enumerate(seg_specs):
        pack = g.new_buffer("pack")
        seg_out = g.new_buffer("seg")
        seg = ir.Segment(f"cl_segment_{k}", list(acts) + [pack] + list(scalars), seg_out,
                         members=grp, n_activations=len(acts))
        seg.consts = consts
        seg.outs = outs
        seg.pack = pack
        seg.program = _encode_segment(seg, kernels, outs, consts, sym_src, last_use, debug)
        if config.log_enabled("program"):
            print(f"{seg.name}: {len(seg.members)} nodes\n{seg.program.listing()}", file=sys.stderr)
        segs.append((gi, seg))

    # Rebuild the main graph: inputs, prologue, then segments and Python nodes in order.
    pro_node = None
    new_nodes: List[ir.Node] = list(inputs)
    pro_out = g.new_buffer("consts")
    packs = [seg.pack for _, seg in segs]
    if const_nodes or segs:
        pro_node = ir.Aten("prologue", list(params), pro_out, rule=ir.FREE, target=None,
                           args=tuple(params), multi=True, picks_args=True)
        new_nodes.append(pro_node)
        for i, b in enumerate(exports + packs):
            if b in python_read or b in packs:
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

    # One bind over both graphs: one compiler run for every kernel of the graph.
    both = ir.Graph()
    both.nodes = pro_graph.nodes[:-1] + g.nodes
    runners, compiled = schedule.bind(both, extra_kernels=list(kernels.values()))
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
            pack_entries.append([(exports.index(b), b in weights, tuple(b.size), P.static_strides(b))
                                 for b in seg.consts])
        runners[pro_node] = runtime.ConstantPrologue(fn, pack_entries, ops.ffi)
    for _, seg in segs:
        used = [compiled[spec] for spec in seg.program.kernels]
        call = runtime.SegmentCall(seg.name, len(seg.outs))
        call.bind(seg.program, used)
        runners[seg] = call
    return runners
