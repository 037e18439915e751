"""What generated wrappers call at run time: convolutions with folded
batch-norm, kernels, layout conversions, per-buffer layout checks (debug
mode), and in cpp_wrapper mode the constant prologue and the calls into C++
segments.

Parameters arrive as graph inputs on every call, so a folded weight is
recomputed exactly when one of its sources changed (state_key.StateKey):
module state is constant only while it is unchanged.
"""
from __future__ import annotations

import ctypes
import functools
import threading
import time
import weakref
from typing import List, Optional

import torch

from cpu_layout import ir
from cpu_layout import layout as L
from cpu_layout import ops
from cpu_layout.op_table import RESHAPE_OPS
from cpu_layout.state_key import StateKey


def _planned_cl(order: str, rank: int) -> bool:
    # The plan uses channels-last for 4-D and 5-D buffers only.
    return order == L.CHANNELS_LAST and rank in (4, 5)


# Layout copies the runtime made (to_order conversions, views that had to
# copy; C++ segments add their conversions to the count, not to the bytes),
# for tests that check them against the plan and for profiling.
COPIES = {"count": 0, "bytes": 0}


def _counted(x: torch.Tensor) -> torch.Tensor:
    COPIES["count"] += 1
    COPIES["bytes"] += x.numel() * x.element_size()
    return x


# CPU_LAYOUT_PROFILE=1: seconds and calls per kind of work, summed over calls
# of every graph compiled while it was set (default wrapper; see `profile_kind`).
PROFILE: dict = {}


class Timed:
    """A runner that adds its wall time to PROFILE[kind]."""

    def __init__(self, kind: str, fn):
        self.kind, self.fn = kind, fn

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.fn(*args, **kwargs)
        entry = PROFILE.setdefault(self.kind, [0.0, 0])
        entry[0] += time.perf_counter() - t0
        entry[1] += 1
        return out


def to_order(x: torch.Tensor, order) -> torch.Tensor:
    """`x` dense in `order`, a named order or a permutation of the dims (a
    no-op when it already is: size-1 dims are ignored)."""
    if isinstance(order, tuple):
        if L.is_in_order(tuple(x.shape), tuple(x.stride()), order):
            return x
        inverse = sorted(range(len(order)), key=order.__getitem__)
        out = torch.empty([x.shape[d] for d in order], dtype=x.dtype).permute(inverse)
        return _counted(out.copy_(x))
    if order not in L.LABELS:
        return x
    if order == L.CHANNELS_LAST and x.dim() not in (4, 5):
        return to_order(x, L.order_of(order, x.dim()))  # e.g. NWC: the label's own permutation
    y = ops.to_dense(x, _planned_cl(order, x.dim()))
    return y if y is x else _counted(y)


def restride(x, order: str, want: Optional[tuple] = None):
    """Give a graph output exactly the strides eager would, including those of
    size-1 dims (which `is_in_order` rightly ignores but users can see):
    eager's output is dense in `order`, so torch's own formula gives them.
    `want`: those strides, when the wrapper knew the size when it was generated."""
    if not isinstance(x, torch.Tensor):
        return x
    if want is None:
        want = L.strides_for_order(tuple(x.shape), order)
    if x.stride() == want:
        return x
    if not L.is_in_order(tuple(x.shape), tuple(x.stride()), order):
        x = to_order(x, order)
        if tuple(x.stride()) == tuple(want):
            return x
    return x.as_strided(x.shape, want)


def check_layout(x, order: str, name: str) -> None:
    """CPU_LAYOUT_DEBUG: the runtime produced the layout the plan promised."""
    if not isinstance(x, torch.Tensor) or order not in L.LABELS:
        return
    if not L.is_in_order(tuple(x.shape), tuple(x.stride()), order):
        raise AssertionError(
            f"cpu_layout: buffer {name} was planned {order} but has size {tuple(x.shape)} "
            f"stride {x.stride()}"
        )


def _bn_affine(w, b, mean, var, eps: float, conv_bias=None):
    """Inference batch-norm as y = x * scale + shift, in float64: scale and shift are
    each the exact value rounded once (in float32 the shift `bias - mean * scale`
    cancels; resnet50's RMS error against float64 went from 1.43x to 1.33x eager's).
    A folded weight is `w * scale` in float32 from that scale: a float64 product
    changed no error measurably and took 46 instead of 8 ms for resnet50's weights."""
    d = torch.float64
    scale = torch.rsqrt(var.to(d) + eps)
    if w is not None:
        scale = scale * w.to(d)
    shift = -mean.to(d) * scale
    if b is not None:
        shift = shift + b.to(d)
    if conv_bias is not None:
        shift = shift + conv_bias.to(d) * scale
    return scale, shift


def bn_scale(w, b, mean, var, eps: float, rank: int) -> torch.Tensor:
    """Per-channel multiplier of inference batch-norm, shaped to broadcast over [N, C, ...]."""
    scale, _ = _bn_affine(w, b, mean, var, eps)
    return scale.float().reshape((-1,) + (1,) * (rank - 2)).contiguous()


def bn_shift(w, b, mean, var, eps: float, rank: int) -> torch.Tensor:
    """Per-channel offset of inference batch-norm: bias - mean * scale."""
    _, shift = _bn_affine(w, b, mean, var, eps)
    return shift.float().reshape((-1,) + (1,) * (rank - 2)).contiguous()


def fold_batch_norm(w, b, bn_w, bn_b, mean, var, eps: float):
    """Conv weight and bias with an inference batch-norm folded in."""
    with torch.no_grad():
        scale, shift = _bn_affine(bn_w, bn_b, mean, var, eps, conv_bias=b)
        shape = (-1,) + (1,) * (w.dim() - 1)
        wf = (w.float() * scale.float().reshape(shape)).to(w.dtype).contiguous()
        return wf, shift.to(w.dtype).contiguous()


def packs_own_weight(conv: ir.Conv) -> bool:
    """Whether the extension packs this conv's weight from the weight as it is (its
    own oneDNN conv, a weight in a form it reads): then a batch-norm's scale is
    multiplied in and a float32 weight converted while packing, and no folded or
    cast copy is kept. Convs on ATen's oneDNN, or on a weight in no such form, read
    a folded copy."""
    return conv.impl != "aten" and ops.weight_format(conv.weight.size, conv.weight.eager_stride) is not None


def bn_scale_shift(b, bn_w, bn_b, mean, var, eps: float, dtype: torch.dtype):
    """An inference batch-norm after a conv as the per-output-channel scale its
    weight is multiplied by when packed (float32; the extension rounds the product
    as `fold_batch_norm` does) and the conv's new bias (in `dtype`)."""
    with torch.no_grad():
        scale, shift = _bn_affine(bn_w, bn_b, mean, var, eps, conv_bias=b)
        return scale.float().contiguous(), shift.to(dtype).contiguous()


class GraphConstant:
    """A tensor attribute of the graph module (FX get_attr), returned as it is."""

    def __init__(self, value: torch.Tensor):
        self.value = value
        self.__name__ = "graph_constant"

    def __call__(self) -> torch.Tensor:
        return self.value


def leaves(v, out: Optional[list] = None) -> list:
    """The non-container values in nested lists, tuples and dicts, in order. (Not
    pytree's tree_leaves: Memoized calls this every forward, and pytree's recursive
    closures leave cyclic garbage behind; see exported.py.)"""
    out = [] if out is None else out
    if isinstance(v, (list, tuple)):
        for x in v:
            leaves(x, out)
    elif isinstance(v, dict):
        for x in v.values():
            leaves(x, out)
    else:
        out.append(v)
    return out


class Memoized:
    """Runs `fn` again only when one of its tensor arguments changed (storage
    or version counter): for nodes computed from module state alone. Tensors
    inside list arguments count too (a `cat` of weights)."""

    def __init__(self, fn):
        self.fn = fn
        self.key = StateKey()
        self.value = None
        self.nested = None  # whether an argument is a container (fixed per node)

    def __call__(self, *args, **kwargs):
        state = args + tuple(kwargs.values()) if kwargs else args
        if self.nested is None:
            self.nested = any(isinstance(v, (list, tuple, dict)) for v in state)
        if self.nested:
            state = tuple(leaves(state))
        if self.value is None or not self.key.same(state):
            self.value = self.fn(*args, **kwargs)
            self.key.remember(state)
        return self.value


class ConvCall:
    """One `ir.Conv` node: a callable for the generated wrapper."""

    def __init__(self, node, out_layout: str):
        self.nsp = node.x.rank - 2
        self.stride, self.padding, self.dilation, self.groups = (
            node.stride, node.padding, node.dilation, node.groups)
        self.out_layout = "nhwc" if out_layout == L.CHANNELS_LAST else "nchw"
        # Post-ops as cpu_layout.ops takes them; residuals are passed per call.
        self.post_template = node.post_op_template(("add", None))
        self.n_residuals = len(node.residuals())
        self.has_bias = node.bias is not None
        # Memoized: the same tensors come back while the sources are unchanged,
        # so the extension's packed-weight cache keeps hitting.
        self.scaled = packs_own_weight(node)
        fold = bn_scale_shift if self.scaled else fold_batch_norm
        self.fold = (Memoized(functools.partial(fold, eps=node.bn.eps))
                     if node.bn is not None else None)
        self.bn_has = (node.bn.weight is not None, node.bn.bias is not None) if node.bn else None
        # torch's bundled oneDNN instead (schedule.choose_conv_impls): NHWC, no residuals.
        self.aten_attr = ops.aten_conv_attr(node.post_ops) if node.impl == "aten" else None
        self.impl_rank = node.impl_rank

    def __call__(self, x, w, *rest):
        rest = list(rest)
        b = rest.pop(0) if self.has_bias else None
        scale = None
        if self.fold is not None:
            bn_w = rest.pop(0) if self.bn_has[0] else None
            bn_b = rest.pop(0) if self.bn_has[1] else None
            mean, var = rest.pop(0), rest.pop(0)
            if self.scaled:
                scale, b = self.fold(b, bn_w, bn_b, mean, var, dtype=x.dtype)
            else:
                w, b = self.fold(w, b, bn_w, bn_b, mean, var)
        if self.aten_attr is not None:
            return ops.aten_conv2d(ops.to_dense(x, True), w, b, self.stride, self.padding, self.dilation,
                                   self.groups, self.aten_attr)
        post = self.post_template
        if self.n_residuals:
            post = ir.with_residuals(post, rest)
        return ops._run(self.nsp, x, w, b, self.stride, self.padding, self.dilation, self.groups,
                        post, self.out_layout, self.impl_rank, weight_scale=scale)


def empty_in_order(size, dtype, order: str) -> torch.Tensor:
    return ops.empty_dense(size, dtype, _planned_cl(order, len(size)))


class CatCall:
    """A cat that reads its parts where they are (op_table.cat_reads_in_place),
    into a result in the planned order, as a segment's cat: ATen's cat.out keeps
    the strides of a result of the right size, and copies each part into its slice."""

    def __init__(self, order: str):
        self.order = order

    def __call__(self, parts, dim=0):
        size = list(parts[0].shape)
        d = dim % len(size)
        size[d] = sum(p.shape[d] for p in parts)
        return torch.ops.aten.cat.out(parts, dim, out=empty_in_order(size, parts[0].dtype, self.order))


class KernelCall:
    """A fused element-wise kernel: output allocated in the planned layout,
    sizes taken from the inputs at run time (one kernel serves every shape)."""

    def __init__(self, compiled, out_dtype, order: str, ndim: int):

        self.compiled = compiled
        self.out_dtype = out_dtype
        self.order = order
        self.ndim = ndim
        self._bstrides = L.broadcast_strides

    def __call__(self, *inputs):
        sizes = tuple(torch.broadcast_shapes(*[t.shape for t in inputs]))
        if len(sizes) < self.ndim:
            sizes = (1,) * (self.ndim - len(sizes)) + sizes
        out = empty_in_order(sizes, self.out_dtype, self.order)
        strides = []
        for t in inputs:
            strides += self._bstrides(t, sizes, "input")
        strides += list(out.stride())
        # The output is fresh (no aliasing) and dtypes were fixed at compile
        # time, so the checked entry point's validation is not needed.
        self.compiled.call_unchecked(sizes, [*inputs, out], strides)
        return out


class ReductionCall:
    """A generated reduction kernel: output allocated in the planned layout,
    sizes taken from the input at run time."""

    def __init__(self, kernel, compiled, out_dtype, order: str, aten):
        self.kernel = kernel
        self.compiled = compiled
        self.out_dtype = out_dtype
        self.order = order
        self.aten = aten

    def __call__(self, x):
        k = self.kernel
        sizes = tuple(x.shape)
        if k.kind in ("amax", "amin") and any(sizes[d] == 0 for d in k.reduce_dims):
            target, args, kwargs = self.aten
            return target(x, *args[1:], **kwargs)  # ATen's own error for an empty max/min
        out = empty_in_order(k.output_shape(sizes), self.out_dtype, self.order)
        strides = list(x.stride()) + k.output_strides_over_input(sizes, out.stride())
        self.compiled.call_unchecked(sizes, [x, out], strides)
        return out


class ViewCall:
    """A VIEW node: the alias when memory order allows, else the contiguous
    copy `reshape` makes; then in the planned order (a no-op when the alias
    already is, as the plan counts it)."""

    def __init__(self, target, order):
        self.reshape = target in RESHAPE_OPS  # the only view op that may copy
        self.target = torch.ops.aten.reshape.default if self.reshape else target
        self.order = order if order in L.LABELS or isinstance(order, tuple) else None

    def __call__(self, x, *args):
        y = self.target(x, *args)
        if self.reshape and y.numel() and y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
            _counted(y)  # memory order allowed no view
        return y if self.order is None else to_order(y, self.order)


class LayerNormCall:
    """layer_norm on the generated kernel; input contiguous (the plan's read),
    output contiguous like ATen's."""

    def __init__(self, kernel, compiled, aten):
        self.kernel = kernel
        self.compiled = compiled
        self.aten = aten

    def __call__(self, x, *params):
        k = self.kernel
        it = iter(params)
        w = next(it) if k.has_weight else None
        b = next(it) if k.has_bias else None
        if x.numel() == 0:
            target, args, kwargs = self.aten
            return target(x, args[1], w, b, *args[4:], **kwargs)[0]
        out = torch.empty(x.shape, dtype=x.dtype)
        # x was planned contiguous, but a slice of a contiguous buffer is read as it is:
        # made dense here (counted as the segment runtime counts it); weights are dense.
        dense = [to_order(x, L.CONTIGUOUS)] + [t.contiguous() for t in (w, b) if t is not None]
        self.compiled.call_unchecked(k.sizes_of(tuple(x.shape)), dense + [out], [])
        return out


class GroupNormCall:
    """group_norm on the generated kernel: x in the plan's layout (contiguous or
    channels-last), the result in the same order."""

    def __init__(self, kernel, compiled, groups: int, order):
        self.kernel = kernel
        self.compiled = compiled
        self.groups = groups
        self.order = order if order in L.LABELS else L.CONTIGUOUS

    def __call__(self, x, *params):

        k = self.kernel
        cl = L.channels_innermost(x)
        if cl is None:  # a slice, or eager's strides of another order: made dense, counted
            x = to_order(x, self.order)
            cl = L.channels_innermost(x)
        out = torch.empty_like(x)  # dense x: the same strides
        self.compiled.call_unchecked(k.sizes_of(tuple(x.shape), self.groups, cl),
                                     [x, *[t.contiguous() for t in params], out,
                                      k.workspace(tuple(x.shape))], [])
        return out


class SoftmaxCall:
    """softmax / log_softmax on the generated kernel: input contiguous (the plan's
    read; a slice is made dense here, counted), output contiguous like ATen's."""

    def __init__(self, kernel, compiled, dim: int):
        self.kernel = kernel
        self.compiled = compiled
        self.dim = dim

    def __call__(self, x):
        x = to_order(x, L.CONTIGUOUS)
        out = torch.empty(x.shape, dtype=x.dtype)
        self.compiled.call_unchecked(self.kernel.sizes_of(tuple(x.shape), self.dim), [x, out], [])
        return out


class PoolCall:
    """A max/avg pool on the generated channels-last kernel (input channels-last:
    the plan's read)."""

    def __init__(self, kernel, compiled):
        self.kernel = kernel
        self.compiled = compiled

    def __call__(self, x, *args):
        size = self.kernel.output_shape(tuple(x.shape))
        out = ops.empty_dense(size, x.dtype, True)
        self.compiled.call_unchecked(tuple(x.shape) + size[2:], [ops.to_dense(x, True), out], [])
        return out


class AtenPointwise:
    """A pointwise node run by ATen (not yet fused into a kernel): the result
    is brought to the planned layout (ATen's own choice follows its inputs)."""

    def __init__(self, target, order: str, dtype=None):
        self.target = target
        self.order = order
        self.dtype = dtype

    def __call__(self, *args, **kwargs):
        out = self.target(*args, **kwargs)
        if self.dtype is not None and out.dtype != self.dtype:
            out = out.to(self.dtype)  # e.g. bf16 batch-norm input times fp32 coefficients
        return to_order(out, self.order)


def _same_strides(size, got, want) -> bool:
    """Equal strides wherever they address memory (size-1 dims ignored)."""
    return all(n == 1 or g == w for n, g, w in zip(size, got, want))


class ConstantPrologue:
    """cpp_wrapper mode: the module-state nodes as one memoized Python function,
    plus each C++ segment's constant pack (address, weight serial, version per constant)."""

    def __init__(self, fn, packs, ffi):
        self.fn = fn
        self.packs = packs              # per segment: [(export index, is conv weight, size, strides)]
        self.ffi = ffi
        self.key = StateKey()
        self.value = None

    def __call__(self, params: tuple):
        if self.value is not None and self.key.same(params):
            return self.value
        vals = tuple(self.fn(list(params)))
        packs = []
        for entries in self.packs:
            flat = []
            for idx, is_weight, size, want in entries:
                t = vals[idx]
                if tuple(t.shape) != size or not _same_strides(size, tuple(t.stride()), want):
                    raise RuntimeError(
                        f"cpu_layout: a module constant has size {tuple(t.shape)} and stride "
                        f"{t.stride()}; the graph was compiled for {size} and {want}")
                flat += [t.data_ptr(), ops._weight_serial(t) if is_weight else 0, ops.content_version(t)]
            packs.append(self.ffi.new("int64_t[]", flat or [0]))
        self.value = (*vals, *packs)
        self.key.remember(params)
        return self.value


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = (ctypes.py_object, ctypes.c_char_p)
_to_handles = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors
_from_handles = torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs


class SegmentCall:
    """Python's side of one segment: tensors in as owned handles, the segment
    runtime runs its program, results come back as tensors."""

    calls = 0  # foreign calls made by all segments (tests count them)
    live = weakref.WeakSet()  # every bound segment (per-node profiles)

    def __init__(self, name: str, n_outputs: int):
        self.name = name
        self.n_outputs = n_outputs
        self.fn = None
        self.ffi = None

    def bind(self, program, kernels):
        """`program`: codegen.program.Program; `kernels`: the compiled runners of
        its kernels, in its order (their libraries stay loaded while this lives)."""
        self.program = program
        self.kernels = kernels
        addresses = [int(k.library.ffi.cast("uintptr_t", k.library.ffi.addressof(k.library.lib, k.kernel.name)))
                     for k in kernels]
        rt, handle = program.load(addresses)
        self._handle = handle
        SegmentCall.live.add(self)
        self.fn = functools.partial(rt.lib.cl_program_run, handle)
        self.ffi = rt.ffi
        self._rt_lib = rt.lib
        self.copies = rt.lib.cl_layout_copies  # the runtime's layout-copy counter
        self._lock = threading.Lock()
        self._held = self._buffers()
        # The program keeps its buffers between calls (clw::Pool); they go when this call does.
        weakref.finalize(self, rt.lib.cl_program_free, handle)

    def held(self) -> tuple:
        """(arena bytes, pooled block bytes, largest live set of arena buffers) the
        program keeps between calls (csrc/cl_wrapper.h, Pool)."""
        out = self.ffi.new("int64_t[3]")
        self._rt_lib.cl_program_held(self._handle, out)
        return int(out[0]), int(out[1]), int(out[2])

    def release(self) -> None:
        """Free the program's arena and pooled blocks; the next call lays them out again."""
        self._rt_lib.cl_program_release(self._handle)

    def take_node_profile(self) -> List[tuple]:
        """(node, seconds) for each node of the segment since the last take, with
        profiling on (codegen.program.set_profiling); zeroes the counters."""
        n = len(self.program.code)
        ns = self.ffi.new("int64_t[]", max(n, 1))
        self._rt_lib.cl_program_take_profile(self._handle, ns, n)
        return self.program.node_profile(list(ns)[:n])

    def _buffers(self):
        """The output and error arrays of one call: allocated once and reused by
        the calls that find them free (fewer objects made per forward)."""
        ffi = self.ffi
        return ffi.new("uintptr_t[]", max(self.n_outputs, 1)), ffi.new("char[]", 1024)

    def __call__(self, acts: list, pack, *scalars):
        ffi = self.ffi
        # The segment owns these references; clearing the list lets it free
        # an activation at its last use when the wrapper holds no other name for it.
        caps = _to_handles(acts) if acts else []
        acts.clear()
        handles = ffi.new("uintptr_t[]", [_capsule_pointer(c, None) for c in caps] or [0])
        del caps
        sc = ffi.new("int64_t[]", [int(s) for s in scalars] or [0])
        # Segments may run in several threads at once: a call that finds the
        # buffers taken allocates its own.
        mine = self._lock.acquire(blocking=False)
        try:
            outs, err = self._held if mine else self._buffers()
            SegmentCall.calls += 1
            before = self.copies()
            rc = self.fn(handles, pack, sc, outs, err, 1024)
            COPIES["count"] += self.copies() - before
            if rc != 0:
                raise RuntimeError(f"cpu_layout: {ffi.string(err).decode('utf-8', 'replace')}")
            return _from_handles([_capsule_new(outs[i], None, None) for i in range(self.n_outputs)])
        finally:
            if mine:
                self._lock.release()
