"""Layouts of buffers: the one definition of "is this tensor in stride order P?".

A stride *order* is a permutation of the dimensions from outermost to
innermost: for 4-D tensors NCHW is (0, 1, 2, 3) and NHWC is (0, 2, 3, 1).
The planner only ever chooses between the two named orders `CONTIGUOUS` and
`CHANNELS_LAST`; every function that takes an `order` accepts either one of
those names (resolved for the tensor's rank by `order_of`) or an explicit
permutation.

Rules, each defined once, here:

* `is_in_order(size, stride, order)` ignores dimensions of size 1 (and
  tensors with a size-0 dimension): their stride never addresses memory.
  Every other stage asks this function; nothing else compares strides.
* `require_order(layout, order)` leaves a matching fixed layout alone, freezes
  a matching flexible layout to its *current* strides, and only on a real
  mismatch re-strides (flexible) or asks for a copy (fixed).  This is what keeps
  a `[N, 1, 28, 28]` tensor at stride `[784, 784, 28, 1]` in FP32 and AMP alike
  instead of turning it into `[784, 1, 28, 1]` (the maml_omniglot crash).

Symbolic sizes (torch.SymInt from a ShapeEnv, or sympy expressions) are
supported without adding guards: a size counts as 1 only if that is statically
known, and stride comparisons are decided statically when possible and by
size hints otherwise (`torch.fx.experimental.symbolic_shapes.optimization_hint`,
which never guards).  A decision made from hints is a planning choice, not a
correctness assumption: the lowering materialises exactly the strides planned
here, whatever the sizes turn out to be.
"""
from __future__ import annotations

import functools
from typing import Iterable, Optional, Sequence, Tuple, Union

import torch
from torch.fx.experimental.symbolic_shapes import optimization_hint, statically_known_true

CONTIGUOUS = "contiguous"
CHANNELS_LAST = "channels_last"
LABELS = (CONTIGUOUS, CHANNELS_LAST)

Order = Union[str, Tuple[int, ...]]

# Used for cost estimates only, when an expression has no hint (unbacked or a
# free sympy symbol). Same spirit as Inductor's unbacked_symint_fallback.
DEFAULT_HINT = 64

__all__ = [
    "CONTIGUOUS", "CHANNELS_LAST", "LABELS", "DEFAULT_HINT",
    "Layout", "FixedLayout", "FlexibleLayout",
    "order_of", "contiguous_strides", "channels_last_strides", "strides_for_order",
    "is_size_one", "is_in_order", "stride_order", "orders_agree", "matching_labels",
    "require_order", "same_sizes", "eager_memory_format", "view_strides", "hint", "numel_hint", "nbytes_hint",
]


# ---- symbolic helpers (no guards) --------------------------------------------

def _is_sympy(x) -> bool:
    try:
        import sympy
    except ImportError:  # pragma: no cover - sympy ships with torch
        return False
    return isinstance(x, sympy.Basic)


def _static(cond) -> Optional[bool]:
    """True/False if `cond` (bool, SymBool or sympy relational) is statically decided, else None."""
    if isinstance(cond, bool):
        return cond
    if _is_sympy(cond):
        import sympy
        if cond in (sympy.true, sympy.false):
            return bool(cond)
        return None
    if statically_known_true(cond):
        return True
    return None


def hint(x, fallback: int = DEFAULT_HINT) -> int:
    """A concrete value for a size, for cost estimates and tie-breaking; never adds a guard."""
    if isinstance(x, int):
        return x
    if isinstance(x, torch.SymInt):
        return optimization_hint(x, fallback=fallback)
    if _is_sympy(x):
        return int(x) if x.is_number else fallback
    return int(x)


def _ge(a, b) -> bool:
    """a >= b: statically if possible, else by hints (planning choice, no guard)."""
    if isinstance(a, int) and isinstance(b, int):
        return a >= b
    if _is_sympy(a) or _is_sympy(b):
        import sympy
        d = sympy.simplify(sympy.sympify(a) - sympy.sympify(b))
        if d.is_nonnegative:
            return True
        if d.is_negative:
            return False
        return hint(a) >= hint(b)
    if _static(a >= b):
        return True
    if _static(a < b):
        return False
    return hint(a) >= hint(b)


def is_size_one(s) -> bool:
    """Only a size statically known to be 1 counts (backed dynamic sizes are >= 2 by 0/1 specialisation)."""
    if isinstance(s, int):
        return s == 1
    if _is_sympy(s):
        return s == 1
    return _static(s == 1) is True


def _is_size_zero(s) -> bool:
    if isinstance(s, int):
        return s == 0
    if _is_sympy(s):
        return s == 0
    return _static(s == 0) is True


# ---- orders and canonical strides ----------------------------------------------

def order_of(order: Order, rank: int) -> Tuple[int, ...]:
    """Resolve CONTIGUOUS / CHANNELS_LAST (or an explicit permutation) for a rank."""
    if isinstance(order, str):
        if order == CONTIGUOUS:
            return tuple(range(rank))
        if order == CHANNELS_LAST:
            if rank < 3:
                # No channels-last form below rank 3: it is plain contiguous.
                return tuple(range(rank))
            return (0,) + tuple(range(2, rank)) + (1,)
        raise ValueError(f"unknown order name {order!r}")
    order = tuple(order)
    if sorted(order) != list(range(rank)):
        raise ValueError(f"{order} is not a permutation of {rank} dims")
    return order


def strides_for_order(size: Sequence, order: Order) -> Tuple:
    """Dense strides for `size` laid out in `order` (size-1 dims get the product of inner sizes,
    which is exactly what torch computes for contiguous / channels_last tensors)."""
    perm = order_of(order, len(size))
    stride = [0] * len(size)
    acc = 1
    for d in reversed(perm):
        stride[d] = acc
        acc = acc * size[d]
    return tuple(stride)


def contiguous_strides(size: Sequence) -> Tuple:
    return strides_for_order(size, CONTIGUOUS)


def channels_last_strides(size: Sequence) -> Tuple:
    """NWC / NHWC / NDHWC strides for rank 3 / 4 / 5 (torch.channels_last[_3d] for 4 / 5)."""
    if len(size) not in (3, 4, 5):
        raise ValueError(f"channels-last needs rank 3..5, got {len(size)}")
    return strides_for_order(size, CHANNELS_LAST)


# ---- THE order check ---------------------------------------------------------------

def is_in_order(size: Sequence, stride: Sequence, order: Order) -> bool:
    """Does memory walk the dims in `order` (outermost first) without overlap?

    Dimensions of size 1 are ignored; a tensor with a size-0 dim is in every
    order.  For consecutive remaining dims a (outer) and b (inner) we need
    stride[a] >= stride[b] * size[b]: dense tensors and slices of them pass.
    """
    size, stride = tuple(size), tuple(stride)
    if all(type(v) is int for v in size + stride):  # the common case: cached, no symbolic work
        return _is_in_order_int(size, stride, order if isinstance(order, str) else tuple(order))
    return _is_in_order(size, stride, order_of(order, len(size)))


def _is_in_order(size, stride, perm) -> bool:
    if any(_is_size_zero(s) for s in size):
        return True
    dims = [d for d in perm if not is_size_one(size[d])]
    for a, b in zip(dims, dims[1:]):
        if not _ge(stride[a], stride[b] * size[b]):
            return False
    return True


@functools.lru_cache(maxsize=65536)
def _is_in_order_int(size, stride, order) -> bool:
    return _is_in_order(size, stride, order_of(order, len(size)))


def is_dense_in_order(size: Sequence, stride: Sequence, order: Order) -> bool:
    """Dense in `order`: in it without gaps (a slice of a dense buffer is in
    order but not dense). Size-1 dims are ignored; a size-0 dim is dense."""
    size, stride = tuple(size), tuple(stride)
    if any(_is_size_zero(s) for s in size):
        return True
    acc = 1
    for d in reversed(order_of(order, len(size))):
        if is_size_one(size[d]):
            continue
        if not _eq(stride[d], acc):
            return False
        acc = acc * size[d]
    return True


def stride_order(size: Sequence, stride: Sequence) -> Tuple[int, ...]:
    """A canonical order the layout is in (see `is_in_order`), closest to identity.

    Non-size-1 dims are sorted by decreasing stride (ties keep dim order), and
    size-1 dims keep their own position: among all equivalent orders this one
    prefers CONTIGUOUS, like torch's ambiguity rule.
    """
    n = len(size)
    free = [d for d in range(n) if not is_size_one(size[d])]
    ranked = []
    for d in free:  # insertion sort: n <= 5, and comparisons may be symbolic
        i = len(ranked)
        while i > 0 and not _ge(stride[ranked[i - 1]], stride[d]):
            i -= 1
        ranked.insert(i, d)
    out = list(range(n))
    for slot, d in zip(free, ranked):
        out[slot] = d
    return tuple(out)


def orders_agree(size: Sequence, a: Order, b: Order) -> bool:
    """Is every dense layout of `size` in order a also in order b (and vice versa)?

    True when the orders differ only in where size-1 dims go, e.g. CONTIGUOUS
    and CHANNELS_LAST for [N, 1, H, W] or [N, C, 1, 1].  Decided by the order
    check itself so there is no second notion of "same layout".
    """
    size = tuple(size)
    if all(type(s) is int for s in size):
        return _orders_agree_int(size, a if isinstance(a, str) else tuple(a), b if isinstance(b, str) else tuple(b))
    return _orders_agree(size, a, b)


def _orders_agree(size, a, b) -> bool:
    return (is_in_order(size, strides_for_order(size, a), b)
            and is_in_order(size, strides_for_order(size, b), a))


_orders_agree_int = functools.lru_cache(maxsize=16384)(_orders_agree)


def matching_labels(size: Sequence, stride: Sequence) -> Tuple[str, ...]:
    """Which of CONTIGUOUS / CHANNELS_LAST the strides satisfy (0, 1 or both)."""
    return tuple(l for l in LABELS if is_in_order(size, stride, l))


# ---- layout objects -----------------------------------------------------------

class Layout:
    __slots__ = ("size", "dtype", "_orders")

    def __init__(self, size: Iterable, dtype: torch.dtype = torch.float32):
        self.size = tuple(size)
        self.dtype = dtype
        self._orders = {}  # order -> is_in_order answer (layouts are immutable)

    def is_in_order(self, order: Order) -> bool:
        key = order if isinstance(order, str) else tuple(order)
        got = self._orders.get(key)
        if got is None:
            got = self._orders[key] = is_in_order(self.size, self.stride, key)
        return got

    @property
    def stride(self) -> Tuple:  # pragma: no cover - abstract
        raise NotImplementedError


class FixedLayout(Layout):
    """Size and strides are decided (graph inputs, outputs, frozen buffers)."""
    __slots__ = ("_stride",)

    def __init__(self, size: Iterable, stride: Iterable, dtype: torch.dtype = torch.float32):
        super().__init__(size, dtype)
        self._stride = tuple(stride)
        if len(self._stride) != len(self.size):
            raise ValueError(f"size {self.size} and stride {self._stride} differ in rank")

    @property
    def stride(self) -> Tuple:
        return self._stride

    def __eq__(self, other):
        # Structural equality (identical expressions), used by tests and caches; no guards.
        return (isinstance(other, FixedLayout) and self.dtype == other.dtype
                and _same(self.size, other.size) and _same(self.stride, other.stride))

    def __hash__(self):
        return hash((len(self.size), self.dtype))

    def __repr__(self):
        return f"FixedLayout(size={list(self.size)}, stride={list(self.stride)}, dtype={self.dtype})"


class FlexibleLayout(Layout):
    """Only the size is decided: we produce the buffer, so its strides are still free.

    Its *current* strides are contiguous; `require_order` freezes them.
    """
    __slots__ = ()

    @property
    def stride(self) -> Tuple:
        return contiguous_strides(self.size)

    def __repr__(self):
        return f"FlexibleLayout(size={list(self.size)}, dtype={self.dtype})"


def _same(xs, ys) -> bool:
    if len(xs) != len(ys):
        return False
    for x, y in zip(xs, ys):
        if isinstance(x, int) and isinstance(y, int):
            if x != y:
                return False
        elif isinstance(x, torch.SymInt) or isinstance(y, torch.SymInt):
            ex = x.node.expr if isinstance(x, torch.SymInt) else x
            ey = y.node.expr if isinstance(y, torch.SymInt) else y
            if not (ex == ey):  # sympy structural equality, no guard
                return False
        elif not (x == y):
            return False
    return True


def same_sizes(a: Sequence, b: Sequence) -> bool:
    """Structurally identical sizes/strides (same ints, same symbolic expressions); never guards."""
    return _same(tuple(a), tuple(b))


def made_contiguous(t: torch.Tensor) -> bool:
    """Is (fake) tensor `t` laid out as torch lays out a new contiguous tensor of its
    size? Never guards. Compared with torch's own strides for the size: under
    dynamic shapes those read `Max(1, s)` for a size `s`, which no static
    comparison with `contiguous_strides` (products of the sizes) decides."""
    from torch._prims_common import make_contiguous_strides_for

    stride, size = tuple(t.stride()), tuple(t.shape)
    return same_sizes(stride, make_contiguous_strides_for(size)) or same_sizes(stride, contiguous_strides(size))


def require_order(layout: Layout, order: Order) -> Tuple[FixedLayout, bool]:
    """Make `layout` satisfy `order`; returns (new fixed layout, needs_copy).

    fixed & matching    -> unchanged, no copy
    flexible & matching -> frozen to its current strides (never re-strided), no copy
    flexible & mismatch -> frozen to dense strides in `order`, no copy
    fixed & mismatch    -> dense strides in `order`, copy needed
    """
    if layout.is_in_order(order):
        if isinstance(layout, FixedLayout):
            return layout, False
        return FixedLayout(layout.size, layout.stride, layout.dtype), False
    new = FixedLayout(layout.size, strides_for_order(layout.size, order), layout.dtype)
    return new, isinstance(layout, FixedLayout)


# ---- eager PyTorch's rule (prediction only) -------------------------------------

def eager_memory_format(size: Sequence, stride: Sequence) -> str:
    """The memory format eager torch *infers* from strides (`suggest_memory_format`).

    This is not a layout rule of ours: torch resolves the size-1 ambiguity with
    its own tie-breaks (e.g. [N,1,H,W] at contiguous strides is NCHW, at
    [HW,1,W,1] it is NHWC).  It is used only to predict what eager ops (a conv
    taking its output format from its input) will produce.  Port of
    c10::is_channels_last_strides_2d/3d; symbolic values use `_ge`, no guards.
    """
    rank = len(size)
    if rank not in (4, 5):
        return CONTIGUOUS
    if _is_size_zero(stride[1]):
        return CONTIGUOUS
    loop = (1, 3, 2, 0) if rank == 4 else (1, 4, 3, 2, 0)
    lo = 0
    for d in loop:
        if _is_size_zero(size[d]):
            return CONTIGUOUS
        if not _ge(stride[d], lo):
            return CONTIGUOUS
        # torch: N111 tensors with identical strides are ambiguous -> contiguous.
        if d == 0 and _same((lo,), (stride[1],)):
            return CONTIGUOUS
        lo = stride[d] if is_size_one(size[d]) else stride[d] * size[d]
    return CHANNELS_LAST


# ---- sizes for costs --------------------------------------------------------------

def numel_hint(size: Sequence) -> int:
    n = 1
    for s in size:
        n *= hint(s)
    return n


def nbytes_hint(size: Sequence, dtype: torch.dtype) -> int:
    return numel_hint(size) * dtype.itemsize


# ---- views ------------------------------------------------------------------------

def _eq(a, b) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if _same((a,), (b,)):
        return True
    r = _static(a == b) if not (_is_sympy(a) or _is_sympy(b)) else None
    return r if r is not None else hint(a) == hint(b)


def view_strides(size: Sequence, stride: Sequence, new_size: Sequence) -> Optional[Tuple]:
    """Strides of `.view(new_size)` on this layout, or None if it needs a copy.

    Port of at::detail::computeStride (what eager `view` accepts). Size-1 dims
    never break a chunk, so the answer depends only on the stride *order* for
    dense tensors.  Symbolic sizes are matched structurally, then by hints.
    """
    size, stride, new_size = tuple(size), tuple(stride), tuple(new_size)
    if not size:
        return tuple(1 for _ in new_size)
    if any(_is_size_zero(s) for s in size):
        return contiguous_strides(new_size)
    new_stride = [0] * len(new_size)
    view_d = len(new_size) - 1
    chunk_base = stride[-1]
    tensor_numel, view_numel = 1, 1
    for d in range(len(size) - 1, -1, -1):
        tensor_numel = tensor_numel * size[d]
        if d == 0 or (not is_size_one(size[d - 1]) and not _eq(stride[d - 1], tensor_numel * chunk_base)):
            while view_d >= 0 and (is_size_one(new_size[view_d]) or
                                   (not _eq(view_numel, tensor_numel) and not _ge(view_numel, tensor_numel))):
                new_stride[view_d] = view_numel * chunk_base
                view_numel = view_numel * new_size[view_d]
                view_d -= 1
            if not _eq(view_numel, tensor_numel):
                return None
            if d > 0:
                chunk_base = stride[d - 1]
                tensor_numel, view_numel = 1, 1
    if view_d != -1:
        return None
    return tuple(new_stride)


def broadcast_strides(t, sizes, what):
    """Strides of tensor t viewed at `sizes` (right-aligned, broadcast dims get stride 0)."""
    shape = t.shape
    if shape == sizes and 1 not in sizes:  # the common case, kept cheap
        return list(t.stride())
    nd, k = len(sizes), len(sizes) - len(shape)
    if k < 0:
        raise ValueError(f"{what} has {len(shape)} dims, more than the kernel's {nd}")
    st = t.stride()
    out = [0] * nd
    for d in range(k, nd):
        s = shape[d - k]
        if s == sizes[d]:
            if s != 1:
                out[d] = st[d - k]
        elif s != 1:
            raise ValueError(f"{what} of shape {tuple(shape)} does not broadcast to {sizes}")
    return out


def channels_innermost(t: torch.Tensor):
    """How a group norm reads `t`: False when contiguous, True when dense with channels
    innermost (NWC, NHWC, NDHWC; either when both hold), None when neither."""
    if t.is_contiguous():
        return False
    if t.dim() >= 3 and t.permute(0, *range(2, t.dim()), 1).is_contiguous():
        return True
    return None
