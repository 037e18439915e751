"""cpp_wrapper mode: the graph's work in C++ segments, each entered once per forward.

segments.py rewrites the planned, fused graph into a prologue, segments and
Python nodes; here

* the **prologue** (Python, memoized as one unit: every node computed from
  module state alone) runs again only when a parameter's storage or version
  counter changed, and then also packs the constants each segment reads
  (address, weight serial, version) into one int64 array per segment;
* each **segment** is encoded as a program for the precompiled segment
  runtime (codegen/program.py, csrc/segment_vm.cpp), node by node from its
  kind or its op_table entry; only the graph's fused kernels are compiled per
  graph. Tensors cross the boundary as ATen tensor handles: activations
  handed over (the segment owns and frees them), results handed back without
  a copy;
* **Python nodes** between segments run on the Python wrapper's runners.
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

import sys
from typing import Dict

import torch

from cpu_layout import config, ir
from cpu_layout import layout as L
from cpu_layout import op_table as T
from cpu_layout import ops, runtime, segments
from cpu_layout.codegen import program as P
from cpu_layout.codegen import specs, wrapper
from cpu_layout.quant import cpp as quant_cpp
from cpu_layout.reads import conversions, dense_as_planned, read_conversion

aten = torch.ops.aten


# ---- segment programs ------------------------------------------------------------------

def _encode_segment(seg: ir.Segment, kernels, last_use: Dict[ir.Buffer, ir.Node],
                    debug: bool, eager_orders: Dict[ir.Buffer, object]) -> P.Program:
    """The segment as a program for the segment runtime (codegen/program.py).
    `eager_orders`: graph outputs and the order eager's strides are dense in."""
    outs, consts = seg.outs, seg.consts
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
    needs_handle = {b for m in seg.members if not isinstance(m, ir.Conv) and not quant_cpp.runs_in_cpp(m)
                    for b in m.inputs if b in consts}
    for m in seg.members:
        if quant_cpp.runs_in_cpp(m):  # int8 ops read constants (weight, scales, bias) from the pack
            x, _w, _s, _b, res = quant_cpp.conv_args(m)
            needs_handle.update(b for b in (x, res) if isinstance(b, ir.Buffer) and b in consts)
        if isinstance(m, ir.Conv):
            # Its activation and residuals are tensors; only its weight and bias are
            # read from the pack (a conv over module state: a buffer it filters).
            needs_handle.update(b for b in m.activations() if b in consts)
            if m.impl == "aten":  # torch's convolution takes tensors
                needs_handle.update(b for b in (m.weight, m.bias) if b is not None and b in consts)
    for i, b in enumerate(consts):
        if b in needs_handle:
            em.reg[b] = prog.reg()
            prog.op("BLOB", em.reg[b], i, P.HELD_ES[b.dtype], b.rank, b.size, b.planned_strides())
    # Symbols the views' sizes use, read from the inputs that define them (segments.py).
    slots = {}
    for sym, src, dim in seg.sym_reads:
        slots[sym] = len(slots)
        if dim is None:
            prog.op("SYM_SCALAR", slots[sym], seg.inputs.index(src) - seg.n_activations - 1)
        else:
            prog.op("SYM_DIM", slots[sym], em.reg[src], dim)
    prog.n_syms = len(slots)
    outset = set(outs)

    reads, last_conv = conversions(seg.members, read_conversion)
    for m in seg.members:
        prog.note(_describe(m))
        keys = list(reads.get(m, {}).values())
        em.convert_reads(keys)
        _encode_node(em, m, slots)
        if debug and dense_as_planned(m.out):
            prog.op("CHECK", em.reg[m.out], int(m.out.layout == L.CHANNELS_LAST), prog.name(m.out.name))
        em.release_reads(keys, last_conv, m)
        for b in dict.fromkeys(m.inputs):
            if last_use.get(b) is m and b in em.reg and b not in outset and b not in consts:
                em.release(b)
    for j, b in enumerate(outs):
        order = eager_orders.get(b)
        if order is None:
            prog.op("OUT", j, em.reg[b])
        else:
            prog.op("OUT_EAGER", j, em.reg[b], b.rank, L.order_of(order, b.rank))
    return prog


def _describe(m: ir.Node) -> str:
    """A member as profiles name it: kind, name, output, and what it computes."""
    out = m.out
    what = f"{type(m).__name__} {m.name}"
    if out is not None and out.size is not None:  # (a split's pieces are the getitems' outputs)
        what += f" {list(out.size)} {out.layout} {str(out.dtype)[6:]}"
    if isinstance(m, ir.Conv):
        k = "x".join(str(v) for v in m.weight.size[2:])
        posts = [p if isinstance(p, str) else p[0] for p in m.post_ops]
        what += f" {k} groups={m.groups} stride={list(m.stride)} post_ops={posts}"
    elif isinstance(m, ir.Kernel):
        what += f" {m.expr}"
    elif isinstance(m, ir.Reduction):
        what += f" {m.kind}{list(m.dims)}"
    return what


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
    elif isinstance(m, ir.GroupNorm):
        em.group_norm(m)
    elif isinstance(m, ir.Softmax):
        em.softmax(m)
    elif isinstance(m, ir.Getitem):
        em.split_piece(m, *T.split_piece(m.inputs[0].producer, m.index))
    elif quant_cpp.runs_in_cpp(m):
        quant_cpp.encode(em, m)
    else:
        T.encode(em, m, slots.__getitem__)

def build(g: ir.Graph, bind, debug: bool = False):
    """Rewrite a planned, fused graph for cpp_wrapper mode (segments.py) and compile it;
    `bind` (schedule.bind) makes the runners of what stays in Python. Returns the
    runners the Python wrapper (codegen.wrapper) needs."""

    part = segments.partition(g)
    eager_orders = wrapper.output_orders(g)
    # Each segment as a program for the segment runtime; the graph's kernels are compiled below.
    kernels = {}
    for seg in part.segments:
        kernels.update(zip(*specs.generated(seg.members)))
    for seg in part.segments:
        seg.program = _encode_segment(seg, kernels, part.last_use, debug, eager_orders)
        if config.log_enabled("program"):
            print(f"{seg.name}: {len(seg.members)} nodes\n{seg.program.listing()}", file=sys.stderr)
    pro_node = segments.assemble(g, part)

    # One bind over both graphs: one compiler run for every kernel of the graph.
    both = ir.Graph()
    both.nodes = part.prologue.nodes[:-1] + g.nodes
    runners, compiled = bind(both, extra_kernels=list(kernels.values()))
    for n in part.const_nodes:
        if isinstance(n, ir.Aten) and isinstance(n.target, runtime.Memoized):
            runners[n] = n.target  # the hoisted batch-norm folds are memoized already
    if pro_node is not None:
        fn = None
        if part.const_nodes:
            src, env = wrapper.generate(part.prologue, runners, raw_outputs=True)
            exec(compile(src, "<cpu_layout prologue>", "exec"), env)
            fn = env["call"]
        else:  # only parameters: the prologue passes them through
            fn = (lambda ps, idx=[part.params.index(b) for b in part.exports]: tuple(ps[i] for i in idx))
        pack_entries = []
        for seg in part.segments:
            # Named by serial: what the extension's packed-weight cache keys on.
            weights = {b for m in seg.members if isinstance(m, ir.Conv) for b in (m.weight, m.weight_scale)
                       if b is not None}
            weights |= {b for m in seg.members for b in m.inputs if quant_cpp.is_weight(m, b)}
            pack_entries.append([(part.exports.index(b), b in weights, tuple(b.size), b.planned_strides())
                                 for b in seg.consts])
        runners[pro_node] = runtime.ConstantPrologue(fn, pack_entries, ops.ffi)
    for seg in part.segments:
        used = [compiled[spec] for spec in seg.program.kernels]
        call = runtime.SegmentCall(seg.name, len(seg.outs))
        call.bind(seg.program, used)
        runners[seg] = call
    return runners
