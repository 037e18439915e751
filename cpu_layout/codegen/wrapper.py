"""Default wrapper: one generated Python function per graph.

Each IR node becomes one statement calling a runtime object (a conv, a
fused kernel, an ATen op); layout conversions the plan asks for are emitted
inline, and every intermediate is released (`del`) after its last use, so
peak memory follows the schedule rather than the graph.
"""
from __future__ import annotations

import operator

import itertools
import math
from typing import Dict, List

import torch

from cpu_layout import config, ir
from cpu_layout import layout as L
from cpu_layout import runtime
from cpu_layout.codegen.specs import pool_kernel
from cpu_layout.reads import conversions, dense_as_planned, read_conversion


class _Emitter:
    def __init__(self):
        self.lines: List[str] = []
        self.globals: Dict[str, object] = {
            "to_order": runtime.to_order,
            "check_layout": runtime.check_layout,
            "restride": runtime.restride,
        }
        self._k = 0

    def constant(self, value, prefix="_k") -> str:
        name = f"{prefix}{self._k}"
        self._k += 1
        self.globals[name] = value
        return name

    def render(self, a, names: Dict[ir.Buffer, str]) -> str:
        if isinstance(a, ir.Buffer):
            return names.get(a, a.name)
        if isinstance(a, list):
            return "[" + ", ".join(self.render(x, names) for x in a) + "]"
        if isinstance(a, tuple):
            inner = ", ".join(self.render(x, names) for x in a)
            return "(" + inner + ("," if len(a) == 1 else "") + ")"
        if isinstance(a, bool) or a is None or isinstance(a, (int, str)):
            return repr(a)
        if isinstance(a, float) and math.isfinite(a):
            return repr(a)
        return self.constant(a)

    def render_call(self, fn: str, args, kwargs, names: Dict[ir.Buffer, str]) -> str:
        parts = [self.render(a, names) for a in args]
        parts += [f"{k}={self.render(v, names)}" for k, v in kwargs.items()]
        return f"{fn}(" + ", ".join(parts) + ")"

    def emit(self, line: str):
        self.lines.append("    " + line)


def _canonical_eager_order(b: ir.Buffer):
    """The order whose dense stride formula gives exactly eager's strides for
    this output (a named order, else eager's own permutation of the dims, as
    ATen gives element-wise results of permuted inputs), or None when eager's
    strides are not dense in any order."""
    if not b.is_tensor or b.layout == ir.EAGER:
        return None
    for order in (L.CONTIGUOUS, L.CHANNELS_LAST) if b.rank in (4, 5) else (L.CONTIGUOUS,):
        if L.same_sizes(L.strides_for_order(b.size, order), b.eager_stride):
            return order
    # Size-1 dims make several permutations equivalent in memory but not in
    # strides: any whose formula gives eager's exactly.
    perms = (itertools.permutations(range(b.rank)) if b.rank <= 5
             else [L.stride_order(b.size, b.eager_stride)])
    return next((tuple(p) for p in perms
                 if L.same_sizes(L.strides_for_order(b.size, p), b.eager_stride)), None)


def output_orders(g: ir.Graph) -> Dict[ir.Buffer, object]:
    """Each graph output dense in some order in eager: that order, whose dense
    strides are eager's (`restride` gives them; segments hand such outputs over
    with them already, OUT_EAGER)."""
    out = {}
    for v in g.output.values if g.output is not None else ():
        order = _canonical_eager_order(v) if isinstance(v, ir.Buffer) else None
        if order:
            out[v] = order
    return out


def profile_kind(n: ir.Node) -> str:
    """What a node's time counts as in a profile (CPU_LAYOUT_PROFILE)."""
    if isinstance(n, ir.Conv):
        return "conv (oneDNN)"
    if isinstance(n, (ir.Kernel, ir.Reduction, ir.Norm)) or pool_kernel(n) is not None:
        return "generated kernels"
    if isinstance(n, ir.Segment):
        return "C++ segments"
    if isinstance(n, ir.Aten) and n.rule == ir.DENSE:
        return "matmul (ATen)"
    if isinstance(n, ir.Aten) and n.rule == ir.VIEW:
        return "views"
    if isinstance(n, ir.Aten) and isinstance(n.target, torch._ops.OpOverload):
        return f"ATen {n.target.__name__}"
    return "other ATen / Python"


def generate(g: ir.Graph, runners: Dict[ir.Node, object], debug: bool = False,
             raw_outputs: bool = False):
    """Python source of `call(args)` and its globals. `runners` maps nodes to
    the callables that execute them (convs, kernels, ATen wrappers, C++
    segments). `raw_outputs`: return buffers as computed (planned strides),
    for callers that are not graph outputs (the cpp_wrapper prologue)."""
    em = _Emitter()
    if config.profile():
        em.globals["to_order"] = runtime.Timed("layout copies", runtime.to_order)
        runners = {n: runtime.Timed(profile_kind(n), r) for n, r in runners.items()}
    inputs = [n for n in g.nodes if isinstance(n, ir.Input)]
    last_use: Dict[ir.Buffer, ir.Node] = {}
    for n in g.nodes:
        for b in n.inputs:
            last_use[b] = n
    em.lines.append("def call(args):")
    # A node that picks its inputs from `args` by position (the cpp_wrapper
    # prologue, hundreds of parameters) runs first, before the inputs are named:
    # one C call instead of a local, an argument and a `del` per parameter.
    picked = [n for n in g.nodes if getattr(n, "picks_args", False)]
    position = {n.out: i for i, n in enumerate(inputs)}
    for n in picked:
        idx = [position[b] for b in n.inputs]
        fn = em.constant(runners[n], prefix=f"_{type(n).__name__.lower()}")
        if len(idx) > 1:
            pick = em.constant(operator.itemgetter(*idx), prefix="_pick")
            em.emit(f"{n.out.name} = {fn}({pick}(args))")
        else:  # itemgetter of one index returns the item, not a tuple
            em.emit(f"{n.out.name} = {fn}((" + "".join(f"args[{i}], " for i in idx) + "))")
    read_by_others = {b for m in g.nodes if m not in picked for b in m.inputs}
    named = [n for n in inputs if n.out in read_by_others]
    if inputs:
        if named:
            em.emit(", ".join(n.out.name for n in named) + ", = ("
                    + ", ".join(f"args[{position[n.out]}]" for n in named) + ",)")
        em.emit("args.clear()")  # the boxed convention: we own the inputs now
    def wanted(n, b):
        return None if raw_outputs and isinstance(n, ir.Output) else read_conversion(n, b)

    reads, last_conv = conversions(g.nodes, wanted)
    converted: Dict[tuple, str] = {}
    for n in g.nodes:
        if isinstance(n, ir.Input) or n in picked:
            continue
        names: Dict[ir.Buffer, str] = {}
        for b, key in reads.get(n, {}).items():
            if key not in converted:
                order = key[1]
                tag = ("p" + "".join(map(str, order)) if isinstance(order, tuple)
                       else "cl" if order == L.CHANNELS_LAST else "cf")
                converted[key] = f"{b.name}_{tag}"
                em.emit(f"{converted[key]} = to_order({b.name}, {order!r})")
            names[b] = converted[key]
        if isinstance(n, ir.Output):
            vals = []
            orders = {} if raw_outputs else output_orders(g)
            for v in n.values:
                text = em.render(v, names)
                order = orders.get(v) if isinstance(v, ir.Buffer) else None
                if order and all(type(d) is int for d in v.size):
                    # The strides computed now: per call only one comparison (output sizes are
                    # static here; the formula is 13 us of Python once a forward evicted it).
                    vals.append(f"restride({text}, {order!r}, {tuple(L.strides_for_order(v.size, order))!r})")
                else:
                    vals.append(f"restride({text}, {order!r})" if order else text)
            em.emit("return (" + "".join(f"{v}, " for v in vals) + ")")
            break
        fn = None if isinstance(n, ir.Getitem) else em.constant(runners[n], prefix=f"_{type(n).__name__.lower()}")
        handed = []
        if isinstance(n, ir.Segment):
            # Activations go in a list the segment empties: with no other name
            # left for them here, it can free each at its last use inside.
            acts = n.inputs[:n.n_activations]
            em.emit("_in = [" + ", ".join(names.get(b, b.name) for b in acts) + "]")
            handed = [b.name for b in dict.fromkeys(acts) if last_use.get(b) is n and b not in names]
            if handed:
                em.emit("del " + ", ".join(handed))
            rest = [names.get(b, b.name) for b in n.inputs[n.n_activations:]]
            call = f"{fn}(_in, " + ", ".join(rest) + ")"
        elif isinstance(n, (ir.Conv, ir.Kernel, ir.Reduction, ir.Norm)):
            call = f"{fn}(" + ", ".join(names.get(b, b.name) for b in n.inputs) + ")"
        elif isinstance(n, ir.Getitem):
            call = f"{names.get(n.inputs[0], n.inputs[0].name)}[{n.index}]"
        elif isinstance(n, ir.Pointwise):
            _target, args, kwargs = n.aten
            call = em.render_call(fn, args, kwargs, names)
        else:
            call = em.render_call(fn, n.args, n.kwargs, names)
        em.emit(f"{n.out.name} = {call}")
        if debug and dense_as_planned(n.out):
            em.emit(f"check_layout({n.out.name}, {n.out.layout!r}, {n.out.name!r})")
        dead = [b.name for b in dict.fromkeys(n.inputs) if last_use.get(b) is n and b.name not in handed]
        dead += [converted[k] for k in dict.fromkeys(reads.get(n, {}).values()) if last_conv[k] is n]
        if dead:
            em.emit("del " + ", ".join(dead))
    source = "\n".join(em.lines) + "\n"
    return source, em.globals
