"""The ATen ops the backend handles as more than an opaque call: one entry per op.

An ATen call in the IR (`ir.Aten`) takes from its entry
- `rule`: how it reads and writes layouts (ir.FOLLOW, VIEW or DENSE; the
  docs' "Node rules" table). lower.py gives the node this rule; the planner
  and both wrappers follow it (reads.py: `required`).
- `priced`: how the planner models it (plan/ir_plan.py): "max" or "avg" a
  pool of its window, "concat" a concatenation; None: by its rule (FOLLOW an
  element-wise pass, VIEW a view or permute, DENSE a fallback reading dense).
- `in_cpp` and `encode`: whether a C++ segment runs the call
  (segments.py: `runs_in_cpp`) and the segment instructions it
  becomes (`encode(SegmentEncoder, node, slot_of_symbol)`, codegen/program.py).
  Without them the call is a Python node between segments.

An op that is not listed lowers to rule EAGER, is priced as a fallback
reading eager's layouts, and runs in Python. The IR's own node kinds (Conv,
Kernel, Reduction, LayerNorm, the pieces of a split) have their C++ rules
next to `runs_in_cpp`; lowering patterns that span several FX nodes (a conv
with its batch-norm, a channel shuffle, a linear as a 1x1 conv, alike convs
over a split's pieces) are patterns.py's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, NamedTuple, Optional

import torch

from cpu_layout import ir, ops
from cpu_layout import layout as L
from cpu_layout.codegen import sizes as S

aten = torch.ops.aten

# The view ops that may copy (a reshape when memory order does not allow an alias).
RESHAPE_OPS = (aten.view.default, aten._unsafe_view.default)
# Size queries: they read a tensor's sizes, which no layout changes, so they read
# it as it is (reads.required) and do not count as readers of its values (fuse).
# Under dynamic shapes a view's sizes come from them. (Not sym_stride: strides
# are the layout.)
SIZE_QUERIES = (aten.sym_size.int, aten.sym_numel.default)
# Splits run as views (clw::narrow), one per Getitem of the result.
SPLIT_OPS = (aten.split.Tensor, aten.split_with_sizes.default)


def float_tensor(b) -> bool:
    """A tensor buffer of what segments compute in (float32, bfloat16)."""
    return isinstance(b, ir.Buffer) and b.is_tensor and b.dtype in (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class AtenOp:
    rule: str
    priced: Optional[str] = None
    in_cpp: Optional[Callable[[ir.Aten], bool]] = None
    encode: Optional[Callable] = None


# ---- what the entries read off a call -----------------------------------------------

def static(v) -> bool:
    """Whether an argument is known at compile time (no symbolic sizes)."""
    if isinstance(v, (list, tuple)):
        return all(static(x) for x in v)
    return v is None or type(v) in (int, float, bool)


def permutation_of(target, args, rank: int):
    """The dims a permute-like view op reads its input in (None for a reshape)."""
    if target is aten.permute.default:
        return tuple(d % rank for d in args[1])
    if target is aten.t.default:
        return (1, 0) if rank == 2 else tuple(range(rank))
    if target is aten.transpose.int:
        dims = list(range(rank))
        a, b = args[1] % rank, args[2] % rank
        dims[a], dims[b] = dims[b], dims[a]
        return tuple(dims)
    return None


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
    if not static(how) or not how or (type(x.size[dim]) is int and sum(how) != x.size[dim]):
        return None
    return dim % x.rank, sum(how[:i]), sum(how[:i + 1])


def strided_slice(n: ir.Aten):
    """(dim, start, end, step) of a slice with static bounds and step (end None: to
    the end), else None."""
    x = n.args[0]
    dim, start, end, step = (list(n.args[1:]) + [0, None, None, 1][len(n.args) - 1:])[:4]
    if n.kwargs or not static([dim, start, end, step]) or not x.rank or (step or 1) < 1:
        return None
    return dim % x.rank, start or 0, end, step or 1


def slice_range(n: ir.Aten):
    """(dim, start, end) of a step-1 slice with static bounds (end None: to the end), else None."""
    r = strided_slice(n)
    return r[:3] if r is not None and r[3] == 1 else None


def cat_reads_in_place(n: ir.Node) -> bool:
    """Whether `n` is a cat that reads its parts where they are, in any order: a
    segment's cat (parts of the result's rank and dtype: no promotion, no skipped
    empty 1-D parts) copies a part dense in the result's order by rows and any other part
    through ATen's copy_ into its slice, one pass either way, so converting the
    part first would copy it twice. The planner prices the read as that copy."""
    return (isinstance(n, ir.Aten) and n.target is aten.cat.default and _cat_in_cpp(n) and n.out.rank > 0
            and all(b.rank == n.out.rank and b.dtype == n.out.dtype for b in n.args[0]))


def own_cat(n: ir.Node) -> bool:
    """Whether csrc's cat_into runs this cat: one that reads its parts in place,
    its result in a named order (otherwise libtorch's cat through the C shim)."""
    return cat_reads_in_place(n) and n.out.layout in L.LABELS


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


# ---- when a segment runs a call ----------------------------------------------------------

def _float_call(n: ir.Aten) -> bool:
    """A single float result from float tensor inputs: what most segment instructions take."""
    return not n.multi and float_tensor(n.out) and all(float_tensor(b) for b in n.inputs if b.is_tensor)


def _static_call(n: ir.Aten) -> bool:
    return _float_call(n) and not n.kwargs and static(n.args[1:])


def shape_exprs(n: ir.Node) -> tuple:
    """The sizes a node's segment instruction computes at run time from the size
    symbols: a reshape's result sizes, an as_strided's result sizes and strides
    (its arguments); () for any other node."""
    if not isinstance(n, ir.Aten):
        return ()
    if n.target in RESHAPE_OPS or n.target is aten.squeeze.dim:
        return tuple(n.out.size)
    if n.target is aten.as_strided.default:
        return (*n.out.size, *n.out.eager_stride)
    return ()


def _print(sizes) -> bool:
    """Whether `sizes` print as the runtime's size expressions."""
    try:
        [S.rpn(s, lambda sym: 0) for s in sizes]
    except NotImplementedError:
        return False
    return True


def _sizes_print(n: ir.Aten) -> bool:
    return _print(n.out.size)


def _held_call(n: ir.Aten) -> bool:
    """A single result of a dtype segments hold (float, or uint8 quantized activations) from
    such tensors: what views, which only alias, take."""
    held = (torch.float32, torch.bfloat16, torch.uint8)
    return (not n.multi and n.out.is_tensor and n.out.dtype in held
            and all(b.dtype in held for b in n.inputs if b.is_tensor))


def _reshape_in_cpp(n):
    return _held_call(n) and _sizes_print(n)


def _permute_in_cpp(n):
    return _reshape_in_cpp(n) and static(n.args[1:])


def _split_in_cpp(n):
    return (float_tensor(n.inputs[0]) and split_piece(n, 0) is not None
            and all(isinstance(u, ir.Getitem) for u in n.out.users))


def _slice_in_cpp(n):
    return float_tensor(n.inputs[0]) and float_tensor(n.out) and strided_slice(n) is not None


def _clone_in_cpp(n):
    return (set(n.kwargs) <= {"memory_format"} and len(n.args) == 1 and float_tensor(n.inputs[0])
            and float_tensor(n.out) and clone_order(n) is not None)


def _index_in_cpp(n):  # x[..., idx, idx]: float data, integer index tensors
    idx = n.args[1] if len(n.args) > 1 else None
    return (not n.multi and float_tensor(n.out) and not n.kwargs and float_tensor(n.args[0])
            and isinstance(idx, (list, tuple))
            and all(i is None or (isinstance(i, ir.Buffer) and i.dtype == torch.int64) for i in idx))


def _embedding_in_cpp(n):  # weight[ids]: the forward of an embedding (padding_idx only affects grads)
    w, ids = n.args[:2]
    return (not n.multi and float_tensor(n.out) and float_tensor(w) and w.rank == 2
            and isinstance(ids, ir.Buffer) and ids.dtype == torch.int64)


def _cat_in_cpp(n):
    return (_float_call(n) and not n.kwargs and static(n.args[1:])
            and all(isinstance(t, ir.Buffer) for t in n.args[0]))


def _addmm_in_cpp(n):
    return _float_call(n) and not n.kwargs and static(n.args[3:]) and n.inputs[0].rank in (1, 2)


def roll_args(n: ir.Aten):
    """(dims, shifts) of a roll over given dims with static shifts, else None (a
    roll of the flattened tensor, no dims, stays on ATen)."""
    a = list(n.args) + [None] * (3 - len(n.args))
    shifts, dims = n.kwargs.get("shifts", a[1]), n.kwargs.get("dims", a[2])
    shifts = [shifts] if type(shifts) is int else shifts
    dims = [dims] if type(dims) is int else dims
    if not dims or not static(shifts) or not static(dims) or len(shifts) != len(dims):
        return None
    return [d % n.args[0].rank for d in dims], list(shifts)


def _eager_contiguous(b: ir.Buffer) -> bool:
    return b.eager_stride is not None and L.same_sizes(b.eager_stride, L.contiguous_strides(b.size))


def _roll_in_cpp(n):
    # Contiguous in and out only: on a channels-last input ATen's CPU roll keeps the
    # format while its meta function (the fake strides planned with) says contiguous.
    x = n.args[0]
    return (not n.multi and float_tensor(n.out) and float_tensor(x) and roll_args(n) is not None
            and n.out.layout in (ir.EAGER, L.CONTIGUOUS) and _eager_contiguous(x) and _eager_contiguous(n.out))


def _expand_in_cpp(n):  # static sizes: a view with stride-0 dims
    return (_float_call(n) and set(n.kwargs) <= {"implicit"} and len(n.args) == 2
            and isinstance(n.args[0], ir.Buffer) and static(n.args[1]) and len(n.args[1]) <= 16)


def _select_in_cpp(n):
    return (_float_call(n) and not n.kwargs and len(n.args) == 3 and isinstance(n.args[0], ir.Buffer)
            and static(n.args[1:]))


def _matmul_in_cpp(n):  # mm / bmm: two float tensors of the op's rank
    rank = 3 if n.target is aten.bmm.default else 2
    return (_float_call(n) and not n.kwargs and len(n.args) == 2
            and all(isinstance(a, ir.Buffer) and a.rank == rank for a in n.args))


def _as_strided_in_cpp(n):  # sizes and strides as the runtime's size expressions, a static offset
    return (_float_call(n) and not n.kwargs and 3 <= len(n.args) <= 4
            and (len(n.args) == 3 or static(n.args[3])) and _print(shape_exprs(n)))


def _shuffle_in_cpp(n):  # csrc/shuffle.cpp, through the extension
    return _static_call(n) and len(n.args) == 4 and 3 <= n.out.rank <= 5


def _upsample_in_cpp(n):  # output size given, no scales
    return (_float_call(n) and not n.kwargs and len(n.args) == 2 and n.inputs[0].rank == 4
            and static(n.args[1]) and len(n.args[1]) == 2)


def _pool(method: str):
    """A pool planned channels-last runs on the generated kernel, else on ATen's (the C shim)."""
    def encode(em, n, slot_of):
        (em.pool_kernel if n in em.kernels else getattr(em, method))(n)
    return encode


def _view(em, n, slot_of):
    em.view(n, slot_of)


def _matmul(em, n, slot_of):
    em.matmul(n)


# ---- the table ---------------------------------------------------------------------------
# C++ forms: libtorch's C shim (aoti_torch_cpu_*: pooling, cat, addmm, mm, bmm,
# index) or csrc/cl_wrapper.h's own (upsample, as_strided, channel shuffle,
# slices, selects, expands, rolls, clones, views).

OPS: Dict[object, AtenOp] = {
    # VIEW: an alias in whatever layout the plan gave the input, when memory order allows.
    aten.view.default: AtenOp(ir.VIEW, in_cpp=_reshape_in_cpp, encode=_view),
    aten._unsafe_view.default: AtenOp(ir.VIEW, in_cpp=_reshape_in_cpp, encode=_view),
    aten.permute.default: AtenOp(ir.VIEW, in_cpp=_permute_in_cpp, encode=_view),
    aten.t.default: AtenOp(ir.VIEW, in_cpp=_permute_in_cpp, encode=_view),
    aten.transpose.int: AtenOp(ir.VIEW, in_cpp=_permute_in_cpp, encode=_view),
    aten.unsqueeze.default: AtenOp(ir.VIEW, in_cpp=_permute_in_cpp, encode=_view),
    # A squeeze is the reshape to its result's sizes (dropping a size-1 dim always views).
    aten.squeeze.dim: AtenOp(ir.VIEW, in_cpp=_reshape_in_cpp, encode=_view),
    # DENSE: a contiguous result whatever the inputs' strides (ATen's kernels
    # allocate it so), values independent of them.
    aten.addmm.default: AtenOp(ir.DENSE, in_cpp=_addmm_in_cpp, encode=_matmul),
    aten.mm.default: AtenOp(ir.DENSE, in_cpp=_matmul_in_cpp, encode=_matmul),
    aten.bmm.default: AtenOp(ir.DENSE, in_cpp=_matmul_in_cpp, encode=_matmul),
    # FOLLOW: the result takes its (first) tensor input's memory format, and
    # either format is accepted: safe on channels-last data.
    aten.max_pool2d.default: AtenOp(ir.FOLLOW, "max", _static_call, _pool("max_pool")),
    aten.avg_pool2d.default: AtenOp(ir.FOLLOW, "avg", _static_call, _pool("avg_pool")),
    aten.upsample_nearest2d.default: AtenOp(ir.FOLLOW, "avg", _upsample_in_cpp, lambda em, n, s: em.upsample(n)),
    aten.upsample_nearest2d.vec: AtenOp(ir.FOLLOW, "avg"),
    aten.upsample_bilinear2d.default: AtenOp(ir.FOLLOW, "avg"),
    aten.upsample_bilinear2d.vec: AtenOp(ir.FOLLOW, "avg"),
    aten.constant_pad_nd.default: AtenOp(ir.FOLLOW, "avg"),
    aten._native_batch_norm_legit_no_training.default: AtenOp(ir.FOLLOW),
    aten.cat.default: AtenOp(ir.FOLLOW, "concat", _cat_in_cpp, lambda em, n, s: em.cat(n, own_cat(n))),
    aten.clone.default: AtenOp(ir.FOLLOW, None, _clone_in_cpp, lambda em, n, s: em.clone(n, clone_order(n))),
    ops.channel_shuffle: AtenOp(ir.FOLLOW, None, _shuffle_in_cpp, lambda em, n, s: em.channel_shuffle(n)),
    # EAGER, with a C++ form. A split or slice with static bounds is a view of its
    # input in its planned layout instead (rule SLICE, given by lower.py: _slice).
    aten.split.Tensor: AtenOp(ir.EAGER, in_cpp=_split_in_cpp, encode=lambda em, n, s: em.split(n)),
    aten.split_with_sizes.default: AtenOp(ir.EAGER, in_cpp=_split_in_cpp, encode=lambda em, n, s: em.split(n)),
    aten.slice.Tensor: AtenOp(ir.EAGER, in_cpp=_slice_in_cpp,
                              encode=lambda em, n, s: em.slice(n, *strided_slice(n))),
    aten.expand.default: AtenOp(ir.EAGER, in_cpp=_expand_in_cpp, encode=lambda em, n, s: em.expand(n)),
    aten.select.int: AtenOp(ir.EAGER, in_cpp=_select_in_cpp, encode=lambda em, n, s: em.select(n)),
    aten.roll.default: AtenOp(ir.EAGER, in_cpp=_roll_in_cpp, encode=lambda em, n, s: em.roll(n, *roll_args(n))),
    aten.as_strided.default: AtenOp(ir.EAGER, in_cpp=_as_strided_in_cpp, encode=lambda em, n, s: em.as_strided(n, s)),
    aten._unsafe_index.Tensor: AtenOp(ir.EAGER, in_cpp=_index_in_cpp, encode=lambda em, n, s: em.index(n)),
    aten.index.Tensor: AtenOp(ir.EAGER, in_cpp=_index_in_cpp, encode=lambda em, n, s: em.index(n)),
    aten.embedding.default: AtenOp(ir.EAGER, in_cpp=_embedding_in_cpp,
                                   encode=lambda em, n, s: em.index(n, [n.args[1]])),
}


def rule_of(target) -> str:
    """The layout rule of an ATen call lowered as it is."""
    spec = OPS.get(target)
    return spec.rule if spec is not None else ir.EAGER


def runs_in_cpp(n: ir.Aten) -> bool:
    """Whether a C++ segment runs this ATen call (its entry's test)."""
    spec = OPS.get(n.target)
    return spec is not None and spec.in_cpp is not None and bool(spec.in_cpp(n))


def encode(em, n: ir.Aten, slot_of) -> None:
    """The segment instructions of an ATen call `runs_in_cpp` admitted."""
    spec = OPS.get(n.target)
    if spec is None or spec.encode is None:  # runs_in_cpp admitted it: a bug here
        raise NotImplementedError(f"{n.name}: no segment instruction for {n.target}")
    spec.encode(em, n, slot_of)


def _pair(v):
    """An ATen 2-d pooling size: an int or a list of one or two, as a list of two."""
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return v * (2 // len(v)) if len(v) in (1, 2) else v


class PoolArgs(NamedTuple):
    kernel: list
    stride: list
    padding: list
    dilation: list
    ceil_mode: bool
    count_include_pad: bool  # avg only
    divisor: Optional[int]  # avg only: divisor_override


def pool_args(target, a) -> PoolArgs:
    """The arguments of max_pool2d(x, kernel, stride=[] (the kernel), padding=0,
    dilation=1, ceil_mode=False) or avg_pool2d(x, kernel, stride=[], padding=0,
    ceil_mode=False, count_include_pad=True, divisor_override=None), defaults filled in:
    one reading for the generated pool kernel and the segment runtime's ATen pools."""
    k = _pair(a[1])
    st = _pair(a[2]) if len(a) > 2 and a[2] else k
    pad = _pair(a[3] if len(a) > 3 else 0)
    if target is aten.max_pool2d.default:
        return PoolArgs(k, st, pad, _pair(a[4] if len(a) > 4 else 1), bool(a[5]) if len(a) > 5 else False,
                        True, None)
    return PoolArgs(k, st, pad, [1, 1], bool(a[4]) if len(a) > 4 else False,
                    bool(a[5]) if len(a) > 5 else True, a[6] if len(a) > 6 else None)
