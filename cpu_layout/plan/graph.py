"""Graph-of-ops data model the planner works on (independent of FX and codegen).

Every node produces one buffer, named like the node.  Nodes are kept in
insertion order, which must be topological (a node's inputs exist before it).
Sizes may be ints, torch.SymInt or sympy expressions; node constructors only do
arithmetic on them (no comparisons that could add a guard).

Build a graph with the `Graph` methods, e.g.::

    g = Graph()
    x = g.input("x", (n, 3, 224, 224), dtype=torch.float32)   # stride defaults to contiguous
    y = g.conv(x, 64, kernel=7, stride=2, padding=3)
    y = g.pointwise(g.batchnorm(y))                             # relu etc. are pointwise
    y = g.flatten(g.adaptive_pool(y, (1, 1)), 1)
    g.output(g.linear(y, 1000), stride=eager_stride)

The lowering should pass graph-input strides from the FakeTensor and output
strides from the eager FakeTensor (`node.meta["val"].stride()`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from cpu_layout.layout import contiguous_strides, is_size_one
from cpu_layout.ops import conv_out_spatial

__all__ = [
    "Node", "Input", "Output", "Conv", "Pointwise", "Reduction", "Pool", "BatchNorm",
    "View", "Slice", "Permute", "Concat", "Linear", "Fallback", "Graph",
]


def _tuple(v, n):
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


@dataclass(eq=False)
class Node:
    name: str
    inputs: Tuple[str, ...]
    size: Tuple
    dtype: torch.dtype

    kind = "node"
    # Computed from module state alone: run once and memoized, so a copy only
    # constant nodes read is made once, not per call.
    constant = False
    # Reads its inputs dense in the order it wants, not just in it (a slice of
    # a dense buffer is in order but is copied first): convs, and the kernels
    # that walk dense memory (plan/ir_plan.py sets it on those).
    dense_reads = False

    @property
    def rank(self) -> int:
        return len(self.size)


@dataclass(eq=False)
class Input(Node):
    """Graph input: strides are fixed by the caller."""
    stride: Tuple = ()
    kind = "input"


@dataclass(eq=False)
class Output(Node):
    """Graph output: must have the strides eager PyTorch gives (`stride`)."""
    stride: Tuple = ()
    kind = "output"


@dataclass(eq=False)
class Conv(Node):
    """Convolution (1-D/2-D/3-D by rank). `in_size` is the input's size."""
    in_size: Tuple = ()
    out_channels: int = 0
    kernel: Tuple = ()
    stride: Tuple = ()
    padding: Tuple = ()
    dilation: Tuple = ()
    groups: int = 1
    bias: bool = True
    # Fused post-ops as cpu_layout.ops takes them, a residual as "add": they are
    # timed with the conv (a GEMM kernel's separate post-op pass can flip the choice).
    post_ops: Tuple = ()
    kind = "conv"
    dense_reads = True

    @property
    def in_channels(self):
        return self.in_size[1]

    @property
    def depthwise(self) -> bool:
        from cpu_layout.layout import hint  # channel counts are concrete in practice; hints never guard
        return self.groups > 1 and self.groups == hint(self.in_size[1])


@dataclass(eq=False)
class Pointwise(Node):
    """n-ary elementwise op with broadcasting (relu, add, mul, dtype casts, ...).
    `strided_reads`: it runs in a generated kernel, which reads an input in
    another order in place (priced like the copy it replaces, never made).
    `fused_into_user`: it is computed inside its user's kernel (fuse.py's
    chains), so its result never goes through memory."""
    op: str = "pointwise"
    strided_reads: bool = False
    fused_into_user: bool = False
    kind = "pointwise"


@dataclass(eq=False)
class Reduction(Node):
    dims: Tuple[int, ...] = ()
    keepdim: bool = False
    op: str = "sum"
    strided_reads: bool = False
    kind = "reduction"


@dataclass(eq=False)
class Pool(Node):
    op: str = "max"  # max | avg | adaptive_avg | adaptive_max
    kernel: Tuple = ()
    stride: Tuple = ()
    padding: Tuple = ()
    kind = "pool"


@dataclass(eq=False)
class BatchNorm(Node):
    """Inference batch-norm (per-channel affine): layout-agnostic."""
    kind = "batchnorm"


@dataclass(eq=False)
class View(Node):
    """view / reshape / flatten / squeeze / unsqueeze to `size` (layout-sensitive)."""
    op: str = "view"
    kind = "view"


@dataclass(eq=False)
class Slice(Node):
    """A step-1 slice of its input (a split's piece): a view with its input's
    strides whatever its layout, never a copy and never a label of its own."""
    kind = "slice"


@dataclass(eq=False)
class Permute(Node):
    dims: Tuple[int, ...] = ()
    kind = "permute"


@dataclass(eq=False)
class Concat(Node):
    """`strided_reads`: it reads a part in another order in place (priced like
    the copy it replaces, never made; op_table.cat_reads_in_place)."""
    dim: int = 1
    strided_reads: bool = False
    kind = "concat"


@dataclass(eq=False)
class Linear(Node):
    """x @ W.T (+ b) over the last dim; wants its input dense with the last dim innermost."""
    out_features: int = 0
    kind = "linear"


@dataclass(eq=False)
class Fallback(Node):
    """An op that reads its inputs in fixed orders and writes a fixed layout.
    `wants`, one per input, is the order each is read in (None: as it is);
    without it, `needs_contiguous` says whether every input must be contiguous
    (else any strides do). `stride` is its output's (default contiguous)."""
    op: str = "fallback"
    needs_contiguous: bool = True
    wants: Optional[Tuple] = None
    stride: Optional[Tuple] = None
    flops: float = 0.0  # a matmul's multiply-adds x 2 (priced by FLOPs, not bytes)
    kind = "fallback"


class Graph:
    def __init__(self):
        self.nodes: Dict[str, Node] = {}
        self._consumers: Dict[str, List[str]] = {}
        self._counter = 0

    # ---- access ---------------------------------------------------------------
    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes.values())

    def __len__(self):
        return len(self.nodes)

    def __getitem__(self, name: str) -> Node:
        return self.nodes[name]

    def consumers(self, name: str) -> List[str]:
        return self._consumers[name]

    def of_kind(self, *kinds: str) -> List[Node]:
        return [n for n in self.nodes.values() if n.kind in kinds]

    # ---- building -------------------------------------------------------------
    def add(self, node: Node) -> str:
        if node.name in self.nodes:
            raise ValueError(f"duplicate node name {node.name!r}")
        for i in node.inputs:
            if i not in self.nodes:
                raise ValueError(f"{node.name}: unknown input {i!r} (nodes must be added in topological order)")
            if self.nodes[i].kind == "output":
                raise ValueError(f"{node.name}: cannot consume graph output {i!r}")
        self.nodes[node.name] = node
        self._consumers[node.name] = []
        for i in node.inputs:
            self._consumers[i].append(node.name)
        return node.name

    def _name(self, name, kind):
        if name is not None:
            return name
        self._counter += 1
        return f"{kind}{self._counter}"

    def input(self, name: str, size: Sequence, stride: Optional[Sequence] = None,
              dtype: torch.dtype = torch.float32) -> str:
        size = tuple(size)
        stride = contiguous_strides(size) if stride is None else tuple(stride)
        return self.add(Input(name, (), size, dtype, stride=stride))

    def output(self, x: str, stride: Optional[Sequence] = None, name: Optional[str] = None) -> str:
        """`stride`: what eager gives for this output (default: contiguous)."""
        src = self.nodes[x]
        stride = contiguous_strides(src.size) if stride is None else tuple(stride)
        return self.add(Output(self._name(name, "output"), (x,), src.size, src.dtype, stride=stride))

    def conv(self, x: str, out_channels: int, kernel=3, stride=1, padding=0, dilation=1,
             groups: int = 1, bias: bool = True, dtype: Optional[torch.dtype] = None,
             name: Optional[str] = None) -> str:
        src = self.nodes[x]
        nsp = src.rank - 2
        if nsp not in (1, 2, 3):
            raise ValueError(f"conv needs a rank-3..5 input, got {src.size}")
        k, s, p, d = (_tuple(v, nsp) for v in (kernel, stride, padding, dilation))
        spatial = conv_out_spatial(src.size[2:], k, s, p, p, d)
        size = (src.size[0], out_channels) + spatial
        return self.add(Conv(self._name(name, "conv"), (x,), size, dtype or src.dtype, in_size=src.size,
                             out_channels=out_channels, kernel=k, stride=s, padding=p, dilation=d,
                             groups=groups, bias=bias))

    def pointwise(self, *xs: str, dtype: Optional[torch.dtype] = None, op: str = "pointwise",
                  name: Optional[str] = None) -> str:
        srcs = [self.nodes[x] for x in xs]
        rank = max(n.rank for n in srcs)
        size = []
        for i in range(rank):
            cand = [n.size[i - rank + n.rank] for n in srcs if i - rank + n.rank >= 0]
            # Broadcasting: the size that is not 1 wins; symbolic sizes are assumed to agree.
            size.append(next((c for c in cand if not is_size_one(c)), cand[0]))
        return self.add(Pointwise(self._name(name, op), tuple(xs), tuple(size), dtype or srcs[0].dtype, op=op))

    def cast(self, x: str, dtype: torch.dtype, name: Optional[str] = None) -> str:
        return self.pointwise(x, dtype=dtype, op="cast", name=name)

    def batchnorm(self, x: str, name: Optional[str] = None) -> str:
        src = self.nodes[x]
        return self.add(BatchNorm(self._name(name, "bn"), (x,), src.size, src.dtype))

    def pool(self, x: str, kernel, stride=None, padding=0, op: str = "max", name: Optional[str] = None) -> str:
        src = self.nodes[x]
        nsp = src.rank - 2
        k = _tuple(kernel, nsp)
        s = k if stride is None else _tuple(stride, nsp)
        p = _tuple(padding, nsp)
        spatial = tuple((src.size[2 + i] + 2 * p[i] - k[i]) // s[i] + 1 for i in range(nsp))
        return self.add(Pool(self._name(name, op + "pool"), (x,), src.size[:2] + spatial, src.dtype,
                             op=op, kernel=k, stride=s, padding=p))

    def adaptive_pool(self, x: str, output_size, op: str = "adaptive_avg", name: Optional[str] = None) -> str:
        src = self.nodes[x]
        out = _tuple(output_size, src.rank - 2)
        return self.add(Pool(self._name(name, "adaptivepool"), (x,), src.size[:2] + out, src.dtype, op=op))

    def reduction(self, x: str, dims: Sequence[int], keepdim: bool = False, op: str = "sum",
                  name: Optional[str] = None) -> str:
        src = self.nodes[x]
        dims = tuple(d % src.rank for d in dims)
        if keepdim:
            size = tuple(1 if i in dims else s for i, s in enumerate(src.size))
        else:
            size = tuple(s for i, s in enumerate(src.size) if i not in dims)
        return self.add(Reduction(self._name(name, op), (x,), size, src.dtype, dims=dims, keepdim=keepdim, op=op))

    def view(self, x: str, size: Sequence, op: str = "view", name: Optional[str] = None) -> str:
        src = self.nodes[x]
        size = list(size)
        if -1 in [s for s in size if isinstance(s, int)]:
            i = next(j for j, s in enumerate(size) if isinstance(s, int) and s == -1)
            total = 1
            for s in src.size:
                total = total * s
            known = 1
            for j, s in enumerate(size):
                if j != i:
                    known = known * s
            size[i] = total // known
        return self.add(View(self._name(name, op), (x,), tuple(size), src.dtype, op=op))

    def flatten(self, x: str, start_dim: int = 1, end_dim: int = -1, name: Optional[str] = None) -> str:
        src = self.nodes[x]
        a, b = start_dim % src.rank, end_dim % src.rank
        merged = 1
        for s in src.size[a:b + 1]:
            merged = merged * s
        return self.view(x, src.size[:a] + (merged,) + src.size[b + 1:], op="flatten", name=name)

    def permute(self, x: str, dims: Sequence[int], name: Optional[str] = None) -> str:
        src = self.nodes[x]
        dims = tuple(d % src.rank for d in dims)
        return self.add(Permute(self._name(name, "permute"), (x,), tuple(src.size[d] for d in dims),
                                src.dtype, dims=dims))

    def slice(self, x: str, dim: int, start: int, end: int, name: Optional[str] = None) -> str:
        """x[..., start:end, ...] along `dim` (a split's piece)."""
        src = self.nodes[x]
        size = src.size[:dim] + (end - start,) + src.size[dim + 1:]
        return self.add(Slice(self._name(name, "slice"), (x,), size, src.dtype))

    def cat(self, xs: Sequence[str], dim: int = 1, name: Optional[str] = None) -> str:
        srcs = [self.nodes[x] for x in xs]
        dim = dim % srcs[0].rank
        total = srcs[0].size[dim]
        for n in srcs[1:]:
            total = total + n.size[dim]
        size = srcs[0].size[:dim] + (total,) + srcs[0].size[dim + 1:]
        return self.add(Concat(self._name(name, "cat"), tuple(xs), size, srcs[0].dtype, dim=dim))

    def linear(self, x: str, out_features: int, name: Optional[str] = None) -> str:
        src = self.nodes[x]
        return self.add(Linear(self._name(name, "linear"), (x,), src.size[:-1] + (out_features,), src.dtype,
                               out_features=out_features))

    def fallback(self, xs: Sequence[str], size: Sequence, needs_contiguous: bool = True,
                 dtype: Optional[torch.dtype] = None, op: str = "fallback", name: Optional[str] = None) -> str:
        dtype = dtype or self.nodes[xs[0]].dtype
        return self.add(Fallback(self._name(name, op), tuple(xs), tuple(size), dtype, op=op,
                                 needs_contiguous=needs_contiguous))
