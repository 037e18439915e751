"""The global layout planner: one min cut chooses NCHW or NHWC for every buffer.

Model (all costs in estimated µs, see cost.py):

* Decision nodes get a label CONTIGUOUS / CHANNELS_LAST: every conv (the
  layout it computes in), and every pointwise, batch-norm, pooling, reduction,
  concat, view and permute whose output has rank 3..5 and a size for which the
  two orders really differ (not e.g. [N,C,1,1]).  Graph inputs are fixed;
  linear, fallback and output nodes have requirements instead of labels.
* A conv costs its cost-model time in its label's layout.
* A consumer reads each same-rank input in its own label (conv, pointwise,
  pooling, batch-norm, concat, reduction), in CONTIGUOUS (linear, a fallback
  that needs it) or in the eager stride order (graph outputs).  If the
  producer's layout is not in that order (`layout.is_in_order`), a copy is
  inserted; one copy per (buffer, order) is shared by all consumers that want
  it, and that sharing is modelled exactly with auxiliary variables.
* A view/flatten/permute aliases its input when eager `view` could
  (`layout.view_strides`) and the result is in the view's label; otherwise it
  costs a copy of its bytes.

`materialize` turns an assignment into layouts and copies and is the single
source of truth for costs: `plan` minimises the same costs with a min cut,
`evaluate` prices any assignment (tests compare against simple policies).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union

from cpu_layout import config
from cpu_layout.layout import (
    CHANNELS_LAST, CONTIGUOUS, LABELS, FixedLayout, FlexibleLayout, contiguous_strides,
    is_dense_in_order, is_in_order, matching_labels, nbytes_hint, numel_hint, orders_agree, require_order,
    same_sizes, eager_memory_format, stride_order, strides_for_order, view_strides,
)
from cpu_layout.plan.cost import ConvCost, CostModel
from cpu_layout.plan.measure import default_cost_model
from cpu_layout.plan.graph import Graph, Node
from cpu_layout.plan.mincut import INF, BinaryEnergy

__all__ = ["Copy", "ConvDecision", "Plan", "plan", "evaluate", "materialize", "uniform_assignment",
           "decision_nodes"]

Want = Union[str, Tuple[int, ...]]  # a label, or an explicit order no label matches

_AGNOSTIC = ("pointwise", "batchnorm", "pool", "reduction", "concat")  # read inputs in their own label
_VIEWS = ("view", "permute")


@dataclass
class Copy:
    """A copy the plan inserts. `name` is the new buffer; consumers read it instead of `source`."""
    name: str
    source: str
    layout: FixedLayout          # layout of the copy
    source_layout: FixedLayout
    nbytes: int
    cost_us: float
    reason: str                  # "layout" (consumer wants another order), "dense" (a slice a conv
                                 # reads, made dense in its order) or "view" (view not expressible)
    consumers: List[str] = field(default_factory=list)
    # Every consumer is a generated kernel that reads the source in place in
    # the other order: priced as a copy, never made at run time.
    strided: bool = False
    # Every consumer is computed from module state: made once, not per call
    # (still priced per call: the min cut does not know, a known overestimate).
    once: bool = False


@dataclass
class ConvDecision:
    name: str
    label: str
    cost: ConvCost


@dataclass
class Plan:
    layout_of: Dict[str, FixedLayout]     # every buffer (node name) -> planned layout
    label_of: Dict[str, str]              # decision nodes -> CONTIGUOUS / CHANNELS_LAST
    reads: Dict[Tuple[str, int], str]     # (consumer, input index) -> buffer read (source or a Copy.name)
    copies: List[Copy]
    convs: Dict[str, ConvDecision]
    conv_cost: float
    copy_cost: float
    exact: bool = True                    # the min cut found the optimum of the model
    op_cost: float = 0.0                  # other priced ops (ATen pooling)
    other_cost: float = 0.0               # kernels, reductions, concats, ATen ops: the same in any layout
    policies: Dict[str, float] = field(default_factory=dict)  # name -> total cost, for explain()

    @property
    def executed_copies(self) -> List[Copy]:
        """The copies the wrappers make (one per buffer and order)."""
        return [c for c in self.copies if not c.strided and not c.once]

    @property
    def total_cost(self) -> float:
        return self.conv_cost + self.copy_cost + self.op_cost + self.other_cost

    def copy_named(self, name: str) -> Copy:
        return next(c for c in self.copies if c.name == name)

    def explain(self) -> str:
        lines = [f"cpu_layout plan: {len(self.convs)} convs, {len(self.copies)} copies, "
                 f"total {self.total_cost:.1f} us (convs {self.conv_cost:.1f}, copies {self.copy_cost:.1f}, "
                 f"pooling {self.op_cost:.1f}, other ops {self.other_cost:.1f})"
                 + ("" if self.exact else "  [approximate: conflicting permutes or a shared copy of a slice]")]
        for name, pol in self.policies.items():
            lines.append(f"  policy {name}: {pol:.1f} us")
        for d in self.convs.values():
            lay = self.layout_of[d.name]
            lines.append(f"  conv {d.name} {list(lay.size)}: {d.label}  "
                         f"nchw {d.cost.nchw_us:.1f} us  nhwc {d.cost.nhwc_us:.1f} us  ({d.cost.source})")
        lines.append("copies kept:" if self.copies else "copies kept: none")
        for c in self.copies:
            how = "read in place by kernels" if c.strided else f"{c.reason}, once" if c.once else c.reason
            lines.append(f"  {c.source} -> {c.name} for {', '.join(c.consumers)}: {how}, "
                         f"stride {list(c.source_layout.stride)} -> {list(c.layout.stride)}, "
                         f"{c.nbytes} B, {c.cost_us:.1f} us")
        return "\n".join(lines)


# ---- which nodes choose a layout ------------------------------------------------

def _label_matters(size) -> bool:
    return len(size) in (3, 4, 5) and not orders_agree(size, CONTIGUOUS, CHANNELS_LAST)


def decision_nodes(graph: Graph) -> List[str]:
    """Convs, layout-agnostic ops, and views of a buffer whose layout the plan
    chooses. A view of a fixed layout (an input, a fallback's result) is not
    one: it keeps its alias in whatever order that gives (e.g. attention's
    head permutes of a matmul result), or copies to contiguous."""
    out = []
    cand: Dict[str, List[Optional[tuple]]] = {}  # varying buffer -> its strides per label of its source
    for n in graph:
        if n.kind == "conv" or (n.kind in _AGNOSTIC and _label_matters(n.size)):
            out.append(n.name)
            cand[n.name] = [strides_for_order(n.size, l) for l in LABELS]
        elif n.kind == "slice" and n.inputs[0] in cand:
            cand[n.name] = cand[n.inputs[0]]  # its source's strides, never a label of its own
        elif n.kind in _VIEWS and n.inputs[0] in cand:
            src = graph[n.inputs[0]]
            aliases = [None if st is None else _alias(n, FixedLayout(src.size, st, src.dtype))
                       for st in cand[n.inputs[0]]]
            # A view of a chosen layout chooses too when some choice makes it a label (a
            # ConvNeXt permute of a channels-last conv is contiguous); when none does (a
            # channel shuffle's transpose), it keeps its alias in whatever order that is.
            if _label_matters(n.size) and any(a is not None and matching_labels(n.size, a) for a in aliases):
                out.append(n.name)
                cand[n.name] = [strides_for_order(n.size, l) for l in LABELS]
            else:
                cand[n.name] = aliases
    return out


def uniform_assignment(graph: Graph, label: str) -> Dict[str, str]:
    """The simple policy "every conv in `label`"; other ops follow their inputs (like Inductor)."""
    return {n.name: label for n in graph.of_kind("conv")}


def _canon(size, want: Want) -> Want:
    """An order equivalent to a label (for this size) is that label: copies are shared per key."""
    if isinstance(want, str):
        return want
    for l in LABELS:
        if orders_agree(size, want, l):
            return l
    return tuple(want)


def _alias(node: Node, lay: FixedLayout) -> Optional[tuple]:
    if node.kind == "permute":
        return tuple(lay.stride[d] for d in node.dims)
    return view_strides(lay.size, lay.stride, node.size)


def _sliced(node: Node, source: FixedLayout) -> FixedLayout:
    """A slice's layout: its source's strides at its own size."""
    return FixedLayout(node.size, source.stride, node.dtype)


def _is_dense(lay: FixedLayout, want: Want) -> bool:
    return is_dense_in_order(lay.size, lay.stride, want)


def _slice_like(lay: FixedLayout) -> bool:
    """In some label's order without being dense in it (a slice of a dense
    buffer): a dense reader copies it even when it reads it in that order."""
    return any(lay.is_in_order(l) and not _is_dense(lay, l) for l in LABELS)


def _produced(node: Node, label: str, memo: Optional[dict] = None) -> FixedLayout:
    """Layout a decision node writes in `label` (views: the dense layout; aliasing may differ
    only in strides `is_in_order` ignores)."""
    if memo is not None:
        got = memo.get((node.name, label))
        if got is None:
            # Also keyed by size where sizes are concrete: equal layouts are one object, so
            # their is_in_order answers are computed once per plan, not once per node.
            key = (node.size, node.dtype, node.kind == "conv", label)
            try:
                got = memo.get(key)
            except TypeError:  # SymInt sizes are unhashable: per-node entry only
                key = got = None
            if got is None:
                got = _produced(node, label)
                if key:
                    memo[key] = got
            memo[(node.name, label)] = got
        return got
    if node.kind == "conv":
        # oneDNN (ours or eager's) writes exactly torch's contiguous / channels_last strides.
        return FixedLayout(node.size, strides_for_order(node.size, label), node.dtype)
    return require_order(FlexibleLayout(node.size, node.dtype), label)[0]


def _reads(node: Node, graph: Graph, label: Optional[str]) -> List[Tuple[int, Optional[Want]]]:
    """(input index, wanted order or None for 'as is') for each input of `node`."""
    k = node.kind
    out = []
    for i, src in enumerate(node.inputs):
        srank = graph[src].rank
        if k == "conv" or (k in _AGNOSTIC and label is not None and srank == node.rank):
            out.append((i, label))
        elif k == "fallback" and node.wants is not None:
            out.append((i, node.wants[i]))
        elif k == "linear" or (k == "fallback" and node.needs_contiguous):
            out.append((i, CONTIGUOUS))
        elif k == "output":
            out.append((i, stride_order(node.size, node.stride)))
        else:
            out.append((i, None))
    return out


def _fixed_stride(node: Node) -> tuple:
    """Strides of a node without a label: an output's are eager's, a fallback's its own
    (eager's for an op run as eager ran it), everything else contiguous."""
    if node.kind in ("output", "fallback") and node.stride:
        return tuple(node.stride)
    return contiguous_strides(node.size)


# ---- materialisation: the cost of an assignment -------------------------------------

def _follow(node: Node, graph: Graph, layout_of: Dict[str, FixedLayout]) -> str:
    """Label of an unassigned decision node: what eager would do."""
    if node.kind == "conv":
        src = layout_of[node.inputs[0]]
        return eager_memory_format(src.size, src.stride)
    if node.kind in _VIEWS:
        alias = _alias(node, layout_of[node.inputs[0]])
        if alias is not None:
            m = matching_labels(node.size, alias)
            if m:
                return m[0]
        return CONTIGUOUS
    for src in node.inputs:
        lay = layout_of[src]
        if lay.size and len(lay.size) == node.rank:
            m = matching_labels(lay.size, lay.stride)
            if len(m) == 1:
                return m[0]
    return CONTIGUOUS


def materialize(graph: Graph, assignment: Dict[str, str], cost_model: Optional[CostModel] = None,
                _memo: Optional[dict] = None) -> Plan:
    """Layouts, copies and costs for `assignment` (decision node -> label; missing ones follow
    their inputs as eager would)."""
    cm = cost_model or default_cost_model()
    memo = {} if _memo is None else _memo
    if "decide" not in memo:
        memo["decide"] = set(decision_nodes(graph))
    decide = memo["decide"]
    layout_of: Dict[str, FixedLayout] = {}
    label_of: Dict[str, str] = {}
    reads: Dict[Tuple[str, int], str] = {}
    copies: Dict[tuple, Copy] = {}
    convs: Dict[str, ConvDecision] = {}
    conv_total = op_total = 0.0

    def new_copy(key, src, lay, reason, consumer):
        c = copies.get(key)
        if c is None:
            sl = layout_of[src]
            nb = nbytes_hint(sl.size, sl.dtype)
            tag = key[1] if isinstance(key[1], str) else "order" + "".join(map(str, key[1]))
            name = f"{src}@{tag}" if reason in ("layout", "dense") else f"{consumer}@copy"
            cost = (cm.gather_cost if reason == "dense" else cm.copy_cost)(nb, sl.dtype)
            c = copies[key] = Copy(name, src, lay, sl, nb, cost, reason)
        c.consumers.append(consumer)
        return c

    for node in graph:
        k, name = node.kind, node.name
        label = None
        if name in decide:
            label = assignment.get(name) or _follow(node, graph, layout_of)
            label_of[name] = label
        if k == "input":
            layout_of[name] = FixedLayout(node.size, node.stride, node.dtype)
            continue
        for i, want in _reads(node, graph, label):
            src = node.inputs[i]
            sl = layout_of[src]
            if want is None or (_is_dense(sl, want) if node.dense_reads else sl.is_in_order(want)):
                reads[(name, i)] = src
            else:
                want = _canon(sl.size, want)
                lay = FixedLayout(sl.size, strides_for_order(sl.size, want), sl.dtype)
                reason = "dense" if sl.is_in_order(want) else "layout"  # a slice made dense, or converted
                reads[(name, i)] = new_copy((src, want), src, lay, reason, name).name
        if k == "conv":
            cost = cm.conv_cost(node)
            convs[name] = ConvDecision(name, label, cost)
            conv_total += cost.of(label)
            layout_of[name] = _produced(node, label, memo)
        elif k == "pool" and label is not None:
            op_total += cm.pool_cost(node)[LABELS.index(label)]
            layout_of[name] = _produced(node, label, memo)
        elif k == "slice":
            layout_of[name] = _sliced(node, layout_of[node.inputs[0]])
        elif k in _VIEWS:
            src = node.inputs[0]
            alias = _alias(node, layout_of[src])
            if alias is not None and (label is None or is_in_order(node.size, alias, label)):
                layout_of[name] = FixedLayout(node.size, alias, node.dtype)
            else:
                lay = _produced(node, label, memo) if label else FixedLayout(node.size, contiguous_strides(node.size),
                                                                      node.dtype)
                new_copy(("view", name), src, lay, "view", name)
                layout_of[name] = lay
        elif k == "output":
            # Eager's strides; a read without copy differs at most in size-1 strides (free restride).
            layout_of[name] = FixedLayout(node.size, node.stride, node.dtype)
        elif label is not None:
            layout_of[name] = _produced(node, label, memo)
        else:  # fixed: linear, fallback, and ops whose size makes the orders coincide
            layout_of[name] = FixedLayout(node.size, _fixed_stride(node), node.dtype)

    cl = list(copies.values())
    for c in cl:
        c.strided = c.reason == "layout" and all(getattr(graph[u], "strided_reads", False) for u in c.consumers)
        c.once = all(graph[u].constant for u in c.consumers)
    if "other" not in memo:
        memo["other"] = _other_cost(graph, cm)
    return Plan(layout_of, label_of, reads, cl, convs, conv_total, sum(c.cost_us for c in cl), op_cost=op_total,
                other_cost=memo["other"])


# Node kinds priced by other_cost: their time does not depend on the plan's layouts.
_OTHER_KINDS = ("pointwise", "reduction", "concat", "batchnorm", "fallback", "linear")


def _other_cost(graph: Graph, cm: CostModel) -> float:
    """Modelled µs of every non-constant node the plan does not otherwise price;
    an element-wise chain as the one kernel it becomes (densenet121's BN-ReLU,
    three nodes, is one pass), vector math by its elements (efficientnet_b0's
    SiLU passes wait on the exp, not on memory)."""
    total = 0.0
    fused_away = {node.name for node in graph if getattr(node, "fused_into_user", False)}
    for node in graph:
        if node.kind not in _OTHER_KINDS or node.constant:
            continue
        fused = node.name in fused_away
        ins = sum(nbytes_hint(graph[i].size, graph[i].dtype) for i in node.inputs if i not in fused_away)
        total += cm.other_cost(ins, 0 if fused else nbytes_hint(node.size, node.dtype), node.dtype,
                               getattr(node, "flops", 0.0), call=not fused,
                               math_elements=numel_hint(node.size) if _calls_vector_math(node) else 0)
    return total


def _calls_vector_math(node: Node) -> bool:
    """An element-wise op whose kernel calls vector math (exp, tanh, erf: SiLU, GELU,
    sigmoid), which bounds its time by arithmetic rather than memory."""
    from cpu_layout.codegen.expr import OPS

    spec = OPS.get(getattr(node, "op", None)) if node.kind == "pointwise" else None
    return bool(spec is not None and spec.vector_math)


def evaluate(graph: Graph, assignment: Dict[str, str], cost_model: Optional[CostModel] = None) -> float:
    """Total estimated cost (µs) of an assignment, e.g. `uniform_assignment(g, CHANNELS_LAST)`."""
    return materialize(graph, assignment, cost_model).total_cost


# ---- the energy ------------------------------------------------------------------------

class _Builder:
    """Encodes `materialize`'s costs as a binary energy over the decision labels.

    Each buffer's layout is a function of at most one variable (`dep`): its own
    label, or its input's for views that have no label of their own.
    """

    def __init__(self, graph: Graph, cm: CostModel):
        self.g, self.cm = graph, cm
        self.e = BinaryEnergy()
        self.var: Dict[str, int] = {}
        self.dep: Dict[str, Optional[int]] = {}
        self.lay: Dict[str, Dict[int, FixedLayout]] = {}  # buffer -> {value of dep (or 0): layout}
        self.pol: List[int] = []
        self.exact = True
        self.memo: dict = {}  # produced layouts and the decision set, shared with materialize

    def _chain_source(self, node: Node) -> Optional[str]:
        """The producer whose label `node` can share without losing optimality, if any.

        A single-input, size- and dtype-preserving op (relu, batch-norm) whose input has
        no other consumer: giving it its producer's label saves the copy between them (w)
        and changes its own consumers' copies by at most one copy of the same w, so some
        optimum always has them equal.  Views and non-label orders downstream break that
        bound (each could add a copy), so they disable it.  Fewer variables, same optimum.
        """
        g = self.g
        if node.kind not in ("pointwise", "batchnorm") or len(node.inputs) != 1:
            return None
        src = g[node.inputs[0]]
        if (src.name not in self.var or g.consumers(src.name) != [node.name] or src.dtype != node.dtype
                or not same_sizes(src.size, node.size)):
            return None
        for c in g.consumers(node.name):
            cn = g[c]
            if cn.kind in _VIEWS:
                return None
            if cn.kind == "output" and not isinstance(_canon(node.size, stride_order(cn.size, cn.stride)), str):
                return None
        return src.name

    def _cost_on(self, dep: Optional[int], per_value: Dict[int, float]) -> None:
        if dep is None:
            self.e.const += per_value[0]
        else:
            self.e.add_unary(dep, per_value[0], per_value[1])

    def build(self) -> BinaryEnergy:
        g, e = self.g, self.e
        decide = decision_nodes(g)
        self.memo["decide"] = set(decide)
        for name in decide:
            src = self._chain_source(g[name])
            self.var[name] = self.var[src] if src is not None else e.var()
        wants: Dict[str, List[Tuple[str, Want]]] = {n.name: [] for n in g}  # buffer -> (consumer, want)
        dense_reads: List[Tuple[str, str, Want]] = []  # (slice-like buffer, dense reader, want)
        for node in g:
            name, k = node.name, node.kind
            x = self.var.get(name)
            if k == "input":
                self.dep[name] = None
                self.lay[name] = {0: FixedLayout(node.size, node.stride, node.dtype)}
                continue
            # requirements on inputs (label-dependent wants are recorded as the consumer's label)
            for i, want in _reads(node, g, LABELS[0] if x is not None else None):
                if want is None:
                    continue
                src = node.inputs[i]
                if node.dense_reads and any(_slice_like(l) for l in self.lay[src].values()):
                    dense_reads.append((src, name, "LABEL" if x is not None and k in ("conv",) + _AGNOSTIC
                                        else _canon(g[src].size, want)))
                elif x is not None and k in ("conv",) + _AGNOSTIC:
                    wants[src].append((name, "LABEL"))
                else:
                    wants[src].append((name, _canon(g[src].size, want)))
            if k == "conv":
                c = self.cm.conv_cost(node)
                e.add_unary(x, c.nchw_us, c.nhwc_us)
            elif k == "pool" and x is not None:
                e.add_unary(x, *self.cm.pool_cost(node))
            if k == "slice":
                src = node.inputs[0]
                self.dep[name] = self.dep[src]
                self.lay[name] = {v: _sliced(node, l) for v, l in self.lay[src].items()}
            elif k in _VIEWS:
                self._view(node, x)
            elif x is not None:
                self.dep[name] = x
                self.lay[name] = {v: _produced(node, LABELS[v], self.memo) for v in (0, 1)}
            else:
                self.dep[name] = None
                self.lay[name] = {0: FixedLayout(node.size, _fixed_stride(node), node.dtype)}
        # Shared copies need the consumers and the producer in one polarity class
        # (see mincut.py): colour with those relations included, then build them.
        same = []
        for b, ws in wants.items():
            group = sorted({self.var[c] for c, w in ws if w == "LABEL"})
            if group:
                root = self.dep[b] if self.dep[b] is not None else group[0]
                same += [(root, c, 1) for c in group if c != root]
        same += [(self.dep[b], self.var[c], 1) for b, c, w in dense_reads
                 if w == "LABEL" and self.dep[b] is not None]
        readers = [b for b, _, _ in dense_reads]
        # Dense reads are priced per reader: exact unless a copy could be shared.
        self.exact &= all(readers.count(b) == 1 and not wants[b] for b in readers)
        self.pol = e.polarities(same)
        e.fixed_pol = dict(enumerate(self.pol))  # aux terms below are built consistent with these
        for b, ws in wants.items():
            if ws:
                self._copies(b, ws)
        for b, c, w in dense_reads:
            self._dense_copy(b, c, w)
        return e

    def _dense_copy(self, b: str, c: str, w: Want) -> None:
        """A dense reader of a slice-like buffer: a copy unless the buffer is dense
        in the order it reads (priced per reader: a copy two readers would share
        is counted twice, an overestimate; `materialize` counts it once)."""
        d, lay = self.dep[b], self.lay[b]
        node = self.g[b]
        nb = nbytes_hint(node.size, node.dtype)
        convert, gather = self.cm.copy_cost(nb, node.dtype), self.cm.gather_cost(nb, node.dtype)

        def copy_for(v, want):
            return 0.0 if _is_dense(lay[v], want) else gather if lay[v].is_in_order(want) else convert
        vals = sorted(lay)
        if w != "LABEL":
            self._cost_on(d, {v: copy_for(v, w) for v in vals})
            return
        self._read_in_label(d, self.var[c], [[copy_for(v, LABELS[l]) for v in vals] for l in (0, 1)])

    def _read_in_label(self, d: Optional[int], c: int, miss) -> None:
        """A consumer (variable c) reading a buffer in its own label: miss[label][value of the
        buffer's variable d (0 without one)] is what that read costs."""
        if d is None:
            self.e.add_unary(c, miss[0][0], miss[1][0])
        else:
            self.e.add_pairwise(d, c, miss[0][0], miss[1][0], miss[0][1], miss[1][1])

    def _view(self, node: Node, y: Optional[int]) -> None:
        src = node.inputs[0]
        d = self.dep[src]
        sl = self.lay[src]
        nb = nbytes_hint(node.size, node.dtype)
        cost = self.cm.copy_cost(nb, node.dtype)
        alias = {v: _alias(node, l) for v, l in sl.items()}
        if y is None:
            self._cost_on(d, {v: (cost if a is None else 0.0) for v, a in alias.items()})
            self.dep[node.name] = d
            self.lay[node.name] = {
                v: FixedLayout(node.size, alias[v] if alias[v] is not None else contiguous_strides(node.size),
                               node.dtype) for v in alias}
            return
        self.dep[node.name] = y
        self.lay[node.name] = {v: _produced(node, LABELS[v], self.memo) for v in (0, 1)}

        def miss(v, w):
            return 0.0 if alias[v] is not None and is_in_order(node.size, alias[v], LABELS[w]) else cost
        if d is None:
            self.e.add_unary(y, miss(0, 0), miss(0, 1))
        else:
            self.e.add_pairwise(d, y, miss(0, 0), miss(0, 1), miss(1, 0), miss(1, 1))

    def _copies(self, b: str, ws: List[Tuple[str, Want]]) -> None:
        """Copy costs for buffer b given its consumers' wants, one copy per distinct order."""
        e = self.e
        d = self.dep[b]
        consts, var_consumers = set(), set()
        for c, w in ws:
            if w == "LABEL":
                var_consumers.add(self.var[c])
            else:
                consts.add(w)
        if not consts and var_consumers == {d}:
            return  # read by ops sharing its label (merged chains): never copied
        lay = self.lay[b]
        vals = sorted(lay)
        # ok[label][dep value]: the buffer is already in that label's order
        ok = [[lay[v].is_in_order(LABELS[l]) for v in vals] for l in (0, 1)]
        if all(ok[0]) and all(ok[1]) and not (consts - set(LABELS)):
            return  # e.g. [N,C,1,1]: every consumer can read it as is
        node = self.g[b]
        cost = self.cm.copy_cost(nbytes_hint(node.size, node.dtype), node.dtype)
        for w in consts:  # needed regardless of labels
            av = ok[LABELS.index(w)] if isinstance(w, str) else [lay[v].is_in_order(w) for v in vals]
            self._cost_on(d, {v: 0.0 if a else cost for v, a in zip(vals, av)})
        if not var_consumers:
            return
        # miss[want label][dep value]; a label some constant want already copies to is free
        miss = [[0.0 if (LABELS[l] in consts or a) else cost for a in ok[l]] for l in (0, 1)]
        var_consumers = sorted(var_consumers)
        pols = {self.pol[c] for c in var_consumers} | ({self.pol[d]} if d is not None else set())
        if len(var_consumers) == 1 or len(pols) > 1:
            # One consumer: a plain pairwise term is exact.  Mixed polarities (only after
            # label-swapping permutes): price each consumer on its own, which may count a
            # shared copy twice, so the optimum is no longer guaranteed.
            self.exact &= len(var_consumers) == 1
            for c in var_consumers:
                self._read_in_label(d, c, miss)
            return
        for l in (0, 1):
            if not any(miss[l]):
                continue
            z = e.var()  # 1 = "a copy of b in label l is needed"
            hard = (INF, 0.0, 0.0, 0.0) if l == 0 else (0.0, 0.0, INF, 0.0)
            # Seed z's polarity from its hard terms: left to the colouring, the soft
            # term to d could reach z first and put a hard term on the diagonal.
            e.fixed_pol[z] = 1 - self.pol[var_consumers[0]] if l == 0 else self.pol[var_consumers[0]]
            for c in var_consumers:  # consumer in label l forces z = 1
                e.add_pairwise(c, z, *hard)
            if d is None:
                e.add_unary(z, 0.0, miss[l][0])
            else:
                e.add_pairwise(d, z, 0.0, miss[l][0], 0.0, miss[l][1])


def plan(graph: Graph, cost_model: Optional[CostModel] = None, compare_policies: bool = False) -> Plan:
    """Choose layouts for `graph` by an exact min cut; see the module docstring.

    With CPU_LAYOUT_LOG=plan the plan's explanation is printed to stderr
    (including the costs of the all-contiguous / all-channels-last policies).
    """
    cm = cost_model or default_cost_model()
    cm.begin_graph()
    b = _Builder(graph, cm)
    energy = b.build()
    labels, value, exact = energy.minimize()
    assignment = {name: LABELS[labels[i]] for name, i in b.var.items()}
    p = materialize(graph, assignment, cm, b.memo)
    p.exact = exact and b.exact
    if not p.exact:
        # Approximate energy (conflicting permutes): never return worse than a simple policy.
        for alt in (uniform_assignment(graph, CONTIGUOUS), uniform_assignment(graph, CHANNELS_LAST), {}):
            q = materialize(graph, alt, cm, b.memo)
            if q.total_cost < p.total_cost:
                q.exact = False
                p = q
    cm.save()  # measured conv costs, for the next compile
    log = config.log_enabled("plan")
    if compare_policies or log:
        for lab in LABELS:
            p.policies["all " + lab] = evaluate(graph, uniform_assignment(graph, lab), cm)
    if log:
        print(p.explain(), file=sys.stderr)
    return p
