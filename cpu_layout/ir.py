"""cpu_layout's graph IR: buffers and the nodes that produce them.

The lowering (lower.py) builds it from an ATen FX graph, the planner decides
each buffer's layout, fusion rewrites groups of nodes, and the wrapper
codegen emits one statement per node. Sizes and eager strides come from the
FX node's fake tensor, so they may be symbolic; nothing here guards on them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

import torch

from cpu_layout import layout as L

# How a node's output layout relates to its inputs'.
FREE = "free"  # we produce it (conv, fused kernel): any layout, planner's choice
FOLLOW = "follow"  # layout-agnostic ATen op: output takes its tensor inputs' layout
EAGER = "eager"  # layout-sensitive or unknown: inputs as eager had them, output as eager's
# A view op (permute, view, transpose, unsqueeze, ...): reads its input in
# whatever layout it has and aliases it when memory order allows, else makes
# one copy into the planned layout. Its output layout is the plan's (a label,
# or an explicit permutation of the dims).
VIEW = "view"
# Reads its inputs as they are (or, for `Node.dense_inputs`, contiguous) and
# writes a contiguous output whatever their strides: matmuls, layer_norm.
DENSE = "dense"
# A step-1 slice with static bounds (split pieces, slice): reads its input as
# it is and is a view of it, in its layout (the planned strides of a slice are
# its source's, not dense: `Buffer.planned_strides`).
SLICE = "slice"


def is_residual(post_op) -> bool:
    """A conv post-op that adds a tensor: ("add", buffer, or a call's tensor, or a placeholder)."""
    return isinstance(post_op, tuple) and len(post_op) == 2 and post_op[0] == "add"


def with_residuals(post_ops, residuals) -> list:
    """`post_ops` with each residual's operand replaced, in order, by the next of `residuals`."""
    it = iter(residuals)
    return [("add", next(it)) if is_residual(p) else p for p in post_ops]


@dataclass(eq=False)
class Buffer:
    """One value of the graph: a tensor (size/dtype/eager_stride set) or a Python scalar."""

    name: str
    size: Optional[tuple] = None
    dtype: Optional[torch.dtype] = None
    eager_stride: Optional[tuple] = None
    producer: Optional["Node"] = None
    users: List["Node"] = field(default_factory=list)
    # Set by planning: L.CONTIGUOUS, L.CHANNELS_LAST, EAGER (exactly eager's
    # strides), or for a VIEW result an explicit stride order (a permutation
    # of the dims, outermost first) when no label matches.
    layout: Any = None
    # Module state (parameter/buffer) or computed only from module state (e.g. an
    # autocast copy of a weight): computed once, recomputed only when a source changes.
    constant: bool = False
    # A symbolic-int graph input: the sympy symbol it carries (its value sizes other buffers).
    sym: Any = None
    # Set by planning for a SLICE result of a buffer in a label or an explicit
    # order: the buffer it is a slice of (its strides are that buffer's).
    slice_of: Optional["Buffer"] = None

    @property
    def is_tensor(self) -> bool:
        return self.size is not None

    @property
    def rank(self) -> int:
        return len(self.size)

    def planned_strides(self) -> tuple:
        """The strides the plan gives this buffer at run time: a slice's are its
        source's, a layout's are dense in it, eager's otherwise."""
        if self.slice_of is not None:
            return self.slice_of.planned_strides()
        if self.layout in L.LABELS or isinstance(self.layout, tuple):
            return L.strides_for_order(self.size, self.layout)
        return self.eager_stride

    def eager_order(self) -> str:
        """The named order eager's strides are in (ambiguous size-1 cases read as contiguous)."""
        labels = L.matching_labels(self.size, self.eager_stride)
        if L.CONTIGUOUS in labels:
            return L.CONTIGUOUS
        return labels[0] if labels else EAGER

    def eager_want(self):
        """The order eager has this tensor in: a named order, else eager's own
        permutation of the dims (an element-wise result of a permuted view),
        or None when eager's strides are dense in no order (expanded)."""
        order = self.eager_order()
        if order != EAGER:
            return order
        perm = L.stride_order(self.size, self.eager_stride)
        return perm if L.is_in_order(self.size, self.eager_stride, perm) else None

    def __repr__(self):
        return f"Buffer({self.name})"


@dataclass(eq=False)
class Node:
    name: str
    inputs: List[Buffer]
    out: Optional[Buffer]
    rule: str = EAGER
    # Writes into an input (copy_/set_ of a graph input the forward mutated):
    # runs every call, in graph order, even though nothing reads its result.
    effects: bool = False

    def tensor_inputs(self) -> List[Buffer]:
        return [b for b in self.inputs if b.is_tensor]

    def dense_inputs(self) -> List[Buffer]:
        """DENSE nodes: the inputs they read contiguous (the others as they are)."""
        return []


@dataclass(eq=False)
class Input(Node):
    index: int = 0
    is_param: bool = False  # a parameter or buffer of the module (constant while unchanged)


@dataclass(eq=False)
class BatchNormFold:
    """Inference batch-norm to fold into the conv before it (computed when parameters change)."""

    weight: Optional[Buffer]
    bias: Optional[Buffer]
    mean: Buffer
    var: Buffer
    eps: float


@dataclass(eq=False)
class Conv(Node):
    """Forward convolution on cpu_layout's oneDNN primitives.

    inputs: [x, weight, bias?] then any residual buffers and folding parameters;
    post_ops: names/tuples as cpu_layout.ops takes them, with ("add", Buffer)."""

    x: Buffer = None
    weight: Buffer = None
    bias: Optional[Buffer] = None
    stride: tuple = ()
    padding: tuple = ()
    dilation: tuple = ()
    groups: int = 1
    bn: Optional[BatchNormFold] = None
    # cpp_wrapper mode: the batch-norm, hoisted into a constant node ahead of the
    # conv (segments._hoist_batch_norm; bn is then None), and the per-output-channel
    # scale it makes, multiplied into the weight when it is packed (the conv's last
    # input; bias is then the shift). Convs on ATen's oneDNN read a folded copy instead.
    prefolded: Optional[BatchNormFold] = None
    weight_scale: Optional[Buffer] = None
    post_ops: list = field(default_factory=list)
    # A linear layer run as this 1x1 conv over [1, K, 1, M] (patterns._linear_as_conv).
    linear: bool = False
    # What runs it: "onednn" (cpu_layout's own) or "aten" (torch's bundled oneDNN,
    # when measured faster in NHWC; schedule.choose_conv_impls).
    impl: str = "onednn"
    # onednn: which of oneDNN's suitable implementations (0: its first; see ops.conv2d).
    impl_rank: int = 0
    rule: str = FREE

    def residuals(self) -> List[Buffer]:
        """The buffers its ("add", buffer) post-ops add, in order."""
        return [p[1] for p in self.post_ops if is_residual(p)]

    def post_op_template(self, residual) -> list:
        """Its post-ops with each residual post-op replaced by `residual`: what a call
        lowering keeps, its residual tensors coming per call (`with_residuals`)."""
        return [residual if is_residual(p) else p for p in self.post_ops]

    def activations(self) -> List[Buffer]:
        """What it reads as tensors in its layout: its input and its residuals
        (weight and bias are the primitive's business)."""
        return [self.x] + self.residuals()


@dataclass(eq=False)
class Pointwise(Node):
    """Element-wise op with broadcasting: `op` names a codegen.expr op; `args`
    mixes Buffers and Python scalars in the op's argument order."""

    op: str = ""
    args: list = field(default_factory=list)
    params: tuple = ()
    # (target, args, kwargs) of the ATen call that computes it, for when it
    # is not fused into a kernel.
    aten: Optional[tuple] = None
    rule: str = FREE


@dataclass(eq=False)
class Kernel(Node):
    """A fused group of element-wise nodes: one generated OpenMP C++ loop.
    `expr` (a codegen.expr tree) reads `inputs[i]` as Load(i)."""

    expr: Any = None
    members: int = 1  # how many IR nodes it replaced
    rule: str = FREE


@dataclass(eq=False)
class Reduction(Node):
    """sum/mean/amax/amin over `dims` (non-negative, sorted) of one float
    tensor, accumulated in float32: one generated OpenMP C++ kernel that reads
    any strides, so its input's layout is whatever the planner chose."""

    kind: str = "sum"
    dims: tuple = ()
    keepdim: bool = False
    aten: Optional[tuple] = None  # (target, args, kwargs) of the ATen call it replaces
    # codegen.expr trees: what is reduced, of the input Load(0) (None: the input
    # itself), and what is stored, of the reduced value Load(0) (None: the value).
    # A 2-norm is the sum of Load(0) * Load(0), then its sqrt.
    prologue: Any = None
    epilogue: Any = None
    rule: str = FREE


@dataclass(eq=False)
class Norm(Node):
    """A normalisation on a generated kernel with float32 statistics (a softmax
    normalises exponentials): inputs [x, weight?, bias?]; weight and bias of x's
    dtype or float32."""

    x: Buffer = None
    weight: Optional[Buffer] = None
    bias: Optional[Buffer] = None
    eps: float = 1e-5


@dataclass(eq=False)
class LayerNorm(Norm):
    """layer_norm over the last `n_norm` dims: reads x contiguous, writes
    contiguous as ATen does."""

    n_norm: int = 1
    aten: Optional[tuple] = None  # (target, args, kwargs) of native_layer_norm, for empty inputs
    rule: str = DENSE

    def dense_inputs(self) -> List[Buffer]:
        return [self.x]


@dataclass(eq=False)
class GroupNorm(Norm):
    """group_norm of [N, C, *] in `groups` groups: reads x contiguous or dense
    with channels innermost and writes the same order (FOLLOW: x is converted
    to the plan's layout of the result, as ATen keeps a channels-last input's)."""

    groups: int = 1
    rule: str = FOLLOW


@dataclass(eq=False)
class Softmax(Norm):
    """softmax (log: log_softmax) along `dim`: reads x contiguous, writes
    contiguous as ATen does. No weight or bias."""

    dim: int = -1
    log: bool = False
    rule: str = DENSE

    def dense_inputs(self) -> List[Buffer]:
        return [self.x]


@dataclass(eq=False)
class Aten(Node):
    """An ATen call: `args`/`kwargs` hold Buffers where the FX graph had nodes."""

    target: Any = None
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    multi: bool = False  # returns a tuple; Getitem nodes pick from it
    # Takes its inputs (graph inputs all) as one tuple picked from the wrapper's
    # boxed argument list: the cpp_wrapper prologue, which reads every parameter.
    picks_args: bool = False


@dataclass(eq=False)
class Segment(Node):
    """cpp_wrapper mode: a run of nodes compiled into one C++ function.
    inputs: the tensors it reads (activations, then module constants), then
    Python ints it reads sizes from; its outputs are picked by Getitem nodes."""

    members: list = field(default_factory=list)
    n_activations: int = 0
    n_constants: int = 0
    rule: str = FREE


@dataclass(eq=False)
class Getitem(Node):
    index: int = 0
    rule: str = FOLLOW


@dataclass(eq=False)
class Output(Node):
    values: list = field(default_factory=list)  # Buffers or constants, in eager's order


class Graph:
    def __init__(self):
        self.nodes: List[Node] = []
        self.buffers: dict = {}
        self.output: Optional[Output] = None
        self._n = 0

    def new_buffer(self, prefix="buf", **kw) -> Buffer:
        name = f"{prefix}{self._n}"
        self._n += 1
        b = Buffer(name, **kw)
        self.buffers[name] = b
        return b

    def add(self, node: Node) -> Node:
        for b in node.inputs:
            b.users.append(node)
        if node.out is not None:
            node.out.producer = node
        self.nodes.append(node)
        if isinstance(node, Output):
            self.output = node
        return node

    def remove(self, node: Node) -> None:
        self.nodes.remove(node)
        for b in node.inputs:
            while node in b.users:
                b.users.remove(node)

    def remove_dead(self) -> None:
        """Drop nodes whose result nothing reads (every node but input mutations is functional)."""
        live = set(values_of(self.output.values)) if self.output is not None else set()
        for n in reversed(list(self.nodes)):
            if isinstance(n, (Input, Output)):
                continue
            if not n.effects and (n.out is None or (n.out not in live and not n.out.users)):
                self.remove(n)
                continue
            live.update(n.inputs)

    def replace_input(self, node: Node, old: Buffer, new: Buffer) -> None:
        node.inputs = [new if b is old else b for b in node.inputs]
        while node in old.users:
            old.users.remove(node)
        new.users.append(node)

    def replace_all_uses(self, old: Buffer, new: Buffer) -> None:
        """Every reader of `old` reads `new` instead, in its inputs and in every
        field that names buffers (ATen args, post-op residuals, output values)."""
        import dataclasses

        def sub(v):
            if v is old:
                return new
            if isinstance(v, list):
                return [sub(x) for x in v]
            if isinstance(v, tuple):
                return tuple(sub(x) for x in v)
            if isinstance(v, dict):
                return {k: sub(x) for k, x in v.items()}
            return v

        for user in list(old.users):
            for f in dataclasses.fields(user):
                if f.name not in ("inputs", "out"):
                    setattr(user, f.name, sub(getattr(user, f.name)))
            self.replace_input(user, old, new)

    def walk(self):
        """Every node, including those inside cpp_wrapper segments."""
        for n in self.nodes:
            if isinstance(n, Segment):
                yield from n.members
            yield n

    def convs(self) -> List[Conv]:
        return [n for n in self.walk() if isinstance(n, Conv)]

    def dump(self) -> str:
        lines = []
        for n in self.nodes:
            ins = ", ".join(b.name for b in n.inputs)
            out = n.out.name if n.out is not None else "-"
            extra = getattr(n, "op", "") or getattr(n, "target", "") or ""
            lay = f" [{n.out.layout}]" if n.out is not None and n.out.layout else ""
            lines.append(f"{out}{lay} = {type(n).__name__}({extra}; {ins})")
        return "\n".join(lines)


def values_of(x) -> Sequence:
    """Every Buffer inside a nested args structure."""
    if isinstance(x, Buffer):
        return [x]
    if isinstance(x, (list, tuple)):
        return [b for v in x for b in values_of(v)]
    if isinstance(x, dict):
        return [b for v in x.values() for b in values_of(v)]
    return []


def slice_source(n: Node) -> Optional[Buffer]:
    """The buffer a SLICE result views: a slice's input, or the input of the
    split a piece is picked from; None for any other node."""
    if isinstance(n, Aten) and n.rule == SLICE and not n.multi:
        return n.args[0]
    if isinstance(n, Getitem):
        p = n.inputs[0].producer
        if isinstance(p, Aten) and p.rule == SLICE:
            return p.args[0]
    return None
