"""Segment programs: what a cpp_wrapper segment does, as instructions for the segment runtime.

The runtime (csrc/segment_vm.cpp, after cl_api.h and cl_wrapper.h) is
compiled once per machine and torch into the build cache; a segment is an
array of int64 instructions it interprets, so compiling a graph compiles
only its fused kernels. Each instruction is `opcode, operand count,
operands...`; registers hold tensor handles, one per buffer and one per
layout conversion. The encoder (`SegmentEncoder`) decides at compile time
everything that does not depend on sizes (release points, pooling, in-place
residuals, conversions); the runtime computes sizes and calls oneDNN, the
kernels and ATen's C shim.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from cpu_layout import build, config, ir, ops
from cpu_layout import layout as L
from cpu_layout.codegen import sizes as S
from cpu_layout.op_table import RESHAPE_OPS, permutation_of, pool_args, shape_exprs
from cpu_layout.reads import read_conversion

aten = torch.ops.aten

# Opcodes: csrc/segment_vm.cpp's enum Op, in the same order.
OPS = ("EXPECT BLOB SYM_DIM SYM_SCALAR ORDERED ORDERED_PERM GIVE RESET CONV KERNEL REDUCTION LAYER_NORM "
       "RESHAPE PERMUTE UNSQUEEZE REORDER REORDER_PERM POOL_KERNEL MAX_POOL AVG_POOL CAT CAT_SHIM "
       "AS_STRIDED UPSAMPLE INDEX MM ADDMM ALIAS SLICE CLONE SHUFFLE CHECK OUT ATEN_CONV GROUP_NORM "
       "SOFTMAX OUT_EAGER QCONV QMAX_POOL BMM SELECT ROLL SDPA EXPAND").split()
OP = {name: i + 1 for i, name in enumerate(OPS)}

ES = {torch.float32: 4, torch.bfloat16: 2}
# Element sizes of what a segment may hold: float data, uint8 quantized activations (the int8
# ops', quant/cpp.py), and integer index tensors (read by ATen only).
HELD_ES = {**ES, torch.uint8: 1, torch.int64: 8}
# What a segment's pool serves: float data and uint8 activations.
POOLED = (torch.float32, torch.bfloat16, torch.uint8)
INT64_MAX = (1 << 63) - 1


_RUNTIME_CDEF = """
void* cl_program_new(const int64_t* code, int64_t ncode, const double* reals, int64_t nreals, const char* names,
                     int64_t names_len, const uintptr_t* kernels, int64_t nkernels, int64_t n_regs,
                     int64_t n_syms, int64_t n_in, int arena_layout, char* err, int errlen);
int cl_program_run(void* prog, const uintptr_t* in, const int64_t* consts, const int64_t* scalars,
                   uintptr_t* out, char* err, int errlen);
void cl_program_free(void* prog);
void cl_program_take_profile(void* prog, int64_t* ns, int64_t n);
void cl_program_held(void* prog, int64_t* out);
void cl_program_release(void* prog);
long long cl_layout_copies(void);
void cl_profile(int on);
long long cl_arena_takes(void);
void cl_arena_enable(int on);
int64_t cl_profile_take(int64_t* ns, int64_t* count, int64_t n);
void cl_segment_init(uintptr_t conv, uintptr_t error, uintptr_t copy, uintptr_t shuffle, uintptr_t qconv,
                     uintptr_t qmax_pool);
"""
# The runtime is optimised like a library, not like kernels: it is shape
# arithmetic and calls, the same on every x86-64 (no -march=native).
_RUNTIME_FLAGS = ("-O2", "-fopenmp", "-fPIC", "-shared", "-std=c++17", "-fno-math-errno")


def _build_runtime() -> build.Library:
    source = "#include <cstdint>\n" + build.csrc("cl_api.h") + build.csrc("cl_wrapper.h") + build.csrc("segment_vm.cpp")
    lib = build.load_library(source, _RUNTIME_CDEF, name_hint="segment runtime",
                             flags=_RUNTIME_FLAGS + build.torch_link_flags())
    ext, effi = ops.lib, ops.ffi

    def addr(name):
        return int(effi.cast("uintptr_t", effi.addressof(ext, name)))

    lib.lib.cl_segment_init(addr("cl_conv_forward_packing"), addr("cl_last_error"),
                            addr("cl_copy_strided"), addr("cl_channel_shuffle"),
                            addr("cl_qconv_forward"), addr("cl_qmax_pool"))
    lib.lib.cl_arena_enable(1 if config.arenas() else 0)
    return lib


_RUNTIME = build.Once(_build_runtime, "segment runtime")


def runtime() -> build.Library:
    """The segment runtime, built on first use on this machine (content-hashed
    cache: later processes load it) and wired to the extension's oneDNN entry points."""
    return _RUNTIME.get()


def set_profiling(on: bool) -> None:
    """Time every instruction the segment runtime runs, in every program of the process."""
    runtime().lib.cl_profile(1 if on else 0)


def arena_takes() -> int:
    """Buffers segments have taken from their arenas so far (csrc/cl_wrapper.h, Pool)."""
    return int(runtime().lib.cl_arena_takes())


def set_arenas(on: bool) -> None:
    """Whether segments serve their buffers from arenas laid out from a first
    call (the default) or from size-classed blocks only; a segment switches at
    the end of its next call. For measurements."""
    runtime().lib.cl_arena_enable(1 if on else 0)


def take_profile() -> dict:
    """Seconds and counts per opcode name since the last take ("run": whole
    program runs, registers' release included), and zero the counters."""
    rt = runtime()
    n = len(OPS) + 1
    ns, count = rt.ffi.new("int64_t[]", n), rt.ffi.new("int64_t[]", n)
    rt.lib.cl_profile_take(ns, count, n)
    names = ["run", *OPS]
    return {names[i]: (ns[i] * 1e-9, count[i]) for i in range(n) if count[i]}


def prefetch_runtime() -> None:
    """Start building the runtime in the background when no process built it
    yet: the compiler then runs while torch traces the graph, and `runtime()`
    waits for it (or builds it itself, reporting the error, if this failed)."""
    _RUNTIME.prefetch()


class Program:
    """One segment's instructions and the tables they index."""

    def __init__(self):
        self.code: List[int] = []
        self.reals: List[float] = []
        self.names: List[str] = []
        self.kernels: List[object] = []  # compiled kernel specs, in the order instructions name them
        self.notes: List[tuple] = []  # (first word, what the instructions from there on do)
        self.n_regs = 0
        self.n_syms = 0
        self.n_in = 0

    def op(self, name: str, *operands):
        flat = []
        for x in operands:
            if isinstance(x, (list, tuple)):
                flat.extend(int(v) for v in x)
            else:
                flat.append(int(x))
        self.code += [OP[name], len(flat), *flat]

    def note(self, what: str) -> None:
        """Names the instructions that follow (per-node profiles)."""
        self.notes.append((len(self.code), what))

    def node_profile(self, ns: List[int]) -> List[tuple]:
        """(note, seconds) per note, from time per instruction word (`ns`, as
        cl_program_take_profile gives it); words before the first note are "setup"."""
        starts = [(0, "setup")] + self.notes if not self.notes or self.notes[0][0] else self.notes
        bounds = [s for s, _ in starts[1:]] + [len(self.code)]
        return [(what, sum(ns[s:e]) * 1e-9) for (s, what), e in zip(starts, bounds)]

    def real(self, v: float) -> int:
        self.reals.append(float(v))
        return len(self.reals) - 1

    def name(self, s: str) -> int:
        self.names.append(s)
        return len(self.names) - 1

    def kernel(self, spec) -> int:
        if spec not in self.kernels:
            self.kernels.append(spec)
        return self.kernels.index(spec)

    def reg(self) -> int:
        self.n_regs += 1
        return self.n_regs - 1

    def instructions(self) -> List[tuple]:
        """(opcode name, operands) per instruction, in order (logs and tests)."""
        out, pc = [], 0
        while pc < len(self.code):
            op, n = self.code[pc], self.code[pc + 1]
            out.append((OPS[op - 1], self.code[pc + 2:pc + 2 + n]))
            pc += 2 + n
        return out

    def listing(self) -> str:
        return "\n".join(f"{name} {' '.join(map(str, ops))}".rstrip() for name, ops in self.instructions())

    def load(self, kernel_addresses: List[int]):
        """Hand the program to the runtime; returns (runtime library, handle)."""
        rt = runtime()
        ffi = rt.ffi
        names = "".join(s.replace("\0", " ") + "\0" for s in self.names).encode("utf-8", "replace")
        err = ffi.new("char[]", 1024)
        prog = rt.lib.cl_program_new(
            ffi.new("int64_t[]", self.code or [0]), len(self.code), ffi.new("double[]", self.reals or [0.0]),
            len(self.reals), ffi.new("char[]", names or b"\0"), len(names),
            ffi.new("uintptr_t[]", kernel_addresses or [0]), len(kernel_addresses),
            self.n_regs, self.n_syms, self.n_in, config.arena_layout(), err, 1024)
        if prog == ffi.NULL:
            raise RuntimeError(f"cpu_layout: {ffi.string(err).decode('utf-8', 'replace')}")
        return rt, prog


def pooled(b: ir.Buffer) -> bool:
    """A buffer whose storage the segment's pool takes back."""
    return isinstance(b, ir.Buffer) and b.is_tensor and b.dtype in POOLED


def _cl(order) -> int:
    return int(order == L.CHANNELS_LAST)


def _size_exprs(sizes, slot_of) -> list:
    """Size expressions as a program writes them: each its token count, then its tokens."""
    out = []
    for s in sizes:
        tok = S.rpn(s, slot_of)
        out += [len(tok), *tok]
    return out


class SegmentEncoder:
    """The instructions of one segment; `reg` names each buffer's register.

    Release rules: a buffer goes back to the segment's pool (`GIVE`) after its
    last consumer when the segment allocated it and nothing else refers to it
    (not an output, not viewed); a view's storage is its root's, freed when
    the root and every view of it died, unless some view escapes the segment."""

    def __init__(self, prog: Program, kernels: Dict[ir.Node, object], consts: List[ir.Buffer],
                 outs: List[ir.Buffer], last_use: Dict[ir.Buffer, ir.Node]):
        self.p = prog
        self.kernels = kernels
        self.consts = consts
        self.last_use = last_use
        self.outs = set(outs)  # handed to the caller: fresh storage, never the pool's
        self.reg: Dict[ir.Buffer, int] = {}
        self.fresh = set()   # buffers this segment allocated (may go back to its pool)
        self.aliased = set()  # buffers some view aliases
        self.aliased_reads = set()  # conversions some view aliases
        # A view that reads a conversion aliases the copy (or the buffer itself, when it
        # already was in order): such copies wait in `view_copies` for the root's views.
        self.root: Dict[ir.Buffer, ir.Buffer] = {}
        self.live_views: Dict[ir.Buffer, set] = {}
        self.view_copies: Dict[ir.Buffer, List[int]] = {}
        self.unpoolable = set()
        self.converted: Dict[tuple, int] = {}  # (buffer, order) -> register in that order

    def out_reg(self, n: ir.Node) -> int:
        r = self.p.reg()
        self.reg[n.out] = r
        return r

    def fresh_flag(self, out: ir.Buffer) -> int:
        """1: the result leaves the segment (its own storage); 0: pooled storage."""
        self.fresh.add(out)
        return int(out in self.outs)

    def convert_reads(self, keys):
        """Before a node: the inputs it reads in another order (`keys`: (buffer, order)
        pairs from `wrapper.conversions`), each converted once and shared with later
        readers; `release_reads` frees it after the last."""
        for key in keys:
            if key in self.converted:
                continue
            b, order = key
            r = self.p.reg()
            self.converted[key] = r
            if isinstance(order, tuple):  # eager's own permutation of the dims
                self.p.op("ORDERED_PERM", r, self.reg[b], len(order), order, 1)
            else:
                self.p.op("ORDERED", r, self.reg[b], _cl(order), 1)

    def release_reads(self, keys, last_conv: Dict[tuple, ir.Node], n: ir.Node):
        for key in dict.fromkeys(keys):
            if last_conv[key] is n:
                copy = self.converted[key]
                root = self.root.get(key[0], key[0])
                if key in self.aliased_reads and self.live_views.get(root):
                    self.view_copies.setdefault(root, []).append(copy)  # views of it still live
                elif key in self.aliased_reads and root in self.unpoolable:
                    self.p.op("RESET", copy)
                else:
                    self.p.op("GIVE", copy)

    def read(self, n: ir.Node, b: ir.Buffer) -> int:
        """The register of `b` in the order node `n` reads it in (converted by `convert_reads`)."""
        order = read_conversion(n, b)
        return self.reg[b] if order is None else self.converted[(b, order)]

    def read_aliased(self, n: ir.Node, b: ir.Buffer) -> int:
        """`read` for a node whose output aliases the handle read: neither storage is pooled."""
        self.aliased.add(b)
        order = read_conversion(n, b)
        if order is not None:
            self.aliased_reads.add((b, order))
        # The view aliases the conversion, or `b` itself when it already was in that order:
        # either way the root is free once the view died too.
        self.view_of(n.out, b)
        return self.read(n, b)

    def view_of(self, view: ir.Buffer, b: ir.Buffer):
        root = self.root.get(b, b)
        self.root[view] = root
        members = self.live_views.setdefault(root, {root})
        if view in self.outs or self.last_use.get(view) is None:
            self.unpoolable.add(root)  # escapes, or no reader to mark its death
        members.add(view)

    def release(self, b: ir.Buffer):
        """`b` died: to the pool when this segment allocated it and nothing else refers to it
        (a root once its views died too), else its handle is dropped."""
        root = self.root.get(b, b)
        members = self.live_views.get(root)
        if members is None:  # never viewed
            self.p.op("GIVE" if b in self.fresh and pooled(b) else "RESET", self.reg[b])
            return
        members.discard(b)
        if b is not root:
            self.p.op("RESET", self.reg[b])
        if members:
            return  # the root's handle stays until its last view died
        poolable = root not in self.unpoolable
        self.p.op("GIVE" if root in self.fresh and poolable and pooled(root) else "RESET",
                  self.reg[root])
        for copy in self.view_copies.pop(root, []):
            self.p.op("GIVE" if poolable else "RESET", copy)

    # ---- one method per node kind ------------------------------------------------------

    def conv(self, n: ir.Conv):
        if n.impl == "aten":
            return self.aten_conv(n)
        nsp = n.x.rank - 2
        dst_cl = int(n.out.layout == L.CHANNELS_LAST)
        wi = self.consts.index(n.weight)
        si = self.consts.index(n.weight_scale) if n.weight_scale is not None else -1
        bi = self.consts.index(n.bias) if n.bias is not None else -1
        parsed = ops._parse_post_ops(n.post_op_template(("add", torch.empty(0))))
        residuals = n.residuals()
        x = self.read(n, n.x)
        res = [self.read(n, r) for r in residuals]
        inplace = self.inplace_residual(n, residuals)
        out = self.out_reg(n)
        k = [int(v) for v in n.weight.size[2:]]
        post_ops = []
        for kind, alpha, beta, _ in parsed:
            post_ops += [kind, self.p.real(alpha), self.p.real(beta)]
        self.p.op("CONV", out, x, wi, ES[n.weight.dtype], si, bi, nsp, ES[n.x.dtype], dst_cl, _weight_flag(weight_format(n.weight)),
                  n.impl_rank, int(n.weight.size[0]), n.groups, int(n.weight.size[1]) * n.groups,
                  k, n.stride, n.padding, n.dilation, len(parsed), post_ops, len(res), res,
                  self.reg[inplace] if inplace is not None else -1, self.fresh_flag(n.out),
                  self.p.name(n.name))

    def aten_conv(self, n: ir.Conv):
        """A conv on torch's bundled oneDNN (ops.aten_conv2d): NHWC, no residuals."""
        unary, scalars, alg = ops.aten_conv_attr(n.post_ops)
        x = self.read(n, n.x)
        b = self.reg[n.bias] if n.bias is not None else -1
        out = self.out_reg(n)
        self.fresh_flag(n.out)  # its own storage: to the pool when it dies
        self.p.op("ATEN_CONV", out, x, self.reg[n.weight], b, n.padding, n.stride, n.dilation, n.groups,
                  self.p.name(unary), len(scalars), [self.p.real(v) for v in scalars],
                  self.p.name(alg) if alg is not None else -1, self.p.name(n.name))

    def may_take_over(self, n: ir.Node, r: ir.Buffer) -> bool:
        """Whether n's output may take over the storage of its input r: the segment
        allocated r, nothing else refers to it (no view, not a result), it dies at
        n, it has the output's dtype, and the output stays in the segment (a
        result gets storage of its own)."""
        return (r in self.fresh and r not in self.aliased and r not in self.outs and n.out not in self.outs
                and self.last_use.get(r) is n and r.dtype == n.out.dtype)

    def inplace_residual(self, n: ir.Conv, residuals: List[ir.Buffer]) -> Optional[ir.Buffer]:
        """The first residual when the conv's output may take over its storage
        (read as it is, no copy planned, and not the conv's input too)."""
        if not residuals:
            return None
        r = residuals[0]
        ok = (self.may_take_over(n, r) and r is not n.x and residuals.count(r) == 1
              and read_conversion(n, r) in (None, r.layout))  # no copy planned
        return r if ok else None

    def kernel(self, n: ir.Kernel):
        ins = [self.reg[b] for b in n.inputs]
        inplace = self.inplace_input(n)
        out = self.out_reg(n)
        self.p.op("KERNEL", out, self.p.kernel(self.kernels[n]), n.out.rank, len(ins), ins,
                  _cl(n.out.layout), HELD_ES[n.out.dtype], self.fresh_flag(n.out),
                  self.reg[inplace] if inplace is not None else -1)

    def inplace_input(self, n: ir.Kernel) -> Optional[ir.Buffer]:
        """An input whose storage the kernel's output may take over (may_take_over)
        with the output's size and layout (the runtime also checks it is dense in
        that order). Half the memory a pass touches: efficientnet_b0 at batch 8,
        2 threads 56.9 -> 52.1 ms fp32, densenet121 251 -> 242 ms (EPYC Zen 4,
        scripts/bench_ab.py); at batch 1, where it fits in cache, about 1%."""
        for r in n.inputs:
            if self.may_take_over(n, r) and r.layout == n.out.layout and L.same_sizes(r.size, n.out.size):
                return r
        return None

    def reduction(self, n: ir.Reduction):
        x = self.reg[n.inputs[0]]
        out = self.out_reg(n)
        msg = (self.p.name(f"{n.name}: {n.kind} over an empty dimension has no identity")
               if n.kind in ("amax", "amin") else -1)
        self.p.op("REDUCTION", out, self.p.kernel(self.kernels[n]), x, n.inputs[0].rank, int(bool(n.keepdim)),
                  msg, len(n.dims), sorted(n.dims), _cl(n.out.layout), ES[n.out.dtype], self.fresh_flag(n.out))

    def affine_params(self, n: ir.Norm, shape: str) -> list:
        """A norm's weight and bias operands: (register, message if not dense of `shape`) or -1, -1."""
        params = []
        for b in (n.weight, n.bias):
            params += [-1, -1] if b is None else [
                self.reg[b], self.p.name(f"{n.name}: {type(n).__name__} {b.name} is not dense with {shape}")]
        return params

    def layer_norm(self, n: ir.LayerNorm):
        x = self.read(n, n.x)
        params = self.affine_params(n, "the normalised size")
        out = self.out_reg(n)
        self.p.op("LAYER_NORM", out, self.p.kernel(self.kernels[n]), x, n.x.rank, n.n_norm, params,
                  ES[n.out.dtype], self.fresh_flag(n.out))

    def group_norm(self, n: ir.GroupNorm):
        x = self.read(n, n.x)
        params = self.affine_params(n, "one value per channel")
        out = self.out_reg(n)
        spec = self.kernels[n]
        self.p.op("GROUP_NORM", out, self.p.kernel(spec), x, _cl(n.out.layout), n.groups, params,
                  spec.CHUNK, ES[n.out.dtype], self.fresh_flag(n.out))

    def softmax(self, n: ir.Softmax):
        x = self.read(n, n.x)
        out = self.out_reg(n)
        self.p.op("SOFTMAX", out, self.p.kernel(self.kernels[n]), x, n.dim, ES[n.out.dtype],
                  self.fresh_flag(n.out))

    def view(self, n: ir.Aten, slot_of):
        t, a = n.target, n.args
        x = self.read_aliased(n, a[0])
        out = self.out_reg(n)
        perm = permutation_of(t, a, a[0].rank)
        if t in RESHAPE_OPS or t is aten.squeeze.dim:
            self.p.op("RESHAPE", out, x, n.out.rank, _size_exprs(shape_exprs(n), slot_of))
        elif perm is not None:
            self.p.op("PERMUTE", out, x, a[0].rank, perm)
        else:  # unsqueeze
            self.p.op("UNSQUEEZE", out, x, a[1] % (a[0].rank + 1))
        lay = n.out.layout
        if isinstance(lay, tuple):  # the plan's order: a no-op when the alias already is
            self.p.op("REORDER_PERM", out, len(lay), lay)
        elif lay in L.LABELS:
            self.p.op("REORDER", out, _cl(lay))

    def pool_kernel(self, n: ir.Aten):
        """A pool on the generated channels-last kernel."""
        spec = self.kernels[n]
        x = self.read(n, n.args[0])
        out = self.out_reg(n)
        window = []
        for k, st, p, dl in zip(spec.kernel, spec.stride, spec.padding, spec.dilation):
            window += [k, st, p, dl]
        self.p.op("POOL_KERNEL", out, self.p.kernel(spec), x, int(bool(spec.ceil_mode)), window,
                  ES[n.out.dtype], self.fresh_flag(n.out))

    def max_pool(self, n: ir.Aten):
        x = self.read(n, n.args[0])
        out = self.out_reg(n)
        p = pool_args(n.target, n.args)
        self.fresh.add(n.out)
        self.p.op("MAX_POOL", out, x, p.kernel, p.stride, p.padding, p.dilation, int(p.ceil_mode),
                  self.p.name(f"{n.name}: max_pool2d"))

    def avg_pool(self, n: ir.Aten):
        x = self.read(n, n.args[0])
        out = self.out_reg(n)
        p = pool_args(n.target, n.args)
        self.fresh.add(n.out)
        self.p.op("AVG_POOL", out, x, p.kernel, p.stride, p.padding, int(p.ceil_mode), int(p.count_include_pad),
                  int(p.divisor is not None), int(p.divisor) if p.divisor is not None else 0,
                  self.p.name(f"{n.name}: avg_pool2d"))

    def cat(self, n: ir.Aten, own: bool):
        a = n.args
        parts = [self.read(n, b) for b in a[0]]
        out = self.out_reg(n)
        if own:
            dim = (a[1] if len(a) > 1 else 0) % n.out.rank
            self.p.op("CAT", out, dim, len(parts), parts, _cl(n.out.layout), ES[n.out.dtype],
                      self.fresh_flag(n.out))
        else:
            self.fresh.add(n.out)
            self.p.op("CAT_SHIM", out, a[1] if len(a) > 1 else 0, len(parts), parts, self.p.name(f"{n.name}: cat"))

    def as_strided(self, n: ir.Aten, slot_of):
        """Over eager's layout of its input (its read rule). Its sizes and strides
        are its result's (as_strided's arguments exactly), as size expressions:
        under dynamic shapes they follow the batch."""
        a = n.args
        x = self.read_aliased(n, a[0])
        out = self.out_reg(n)
        off = -1 if len(a) < 4 or a[3] is None else int(a[3])
        self.p.op("AS_STRIDED", out, x, n.out.rank, _size_exprs(shape_exprs(n), slot_of), off)

    def upsample(self, n: ir.Aten):
        a = n.args
        x = self.read(n, a[0])
        out = self.out_reg(n)
        self.fresh.add(n.out)
        lay = n.out.layout if n.out.layout in L.LABELS else L.CONTIGUOUS
        self.p.op("UPSAMPLE", out, x, int(a[1][0]), int(a[1][1]), _cl(lay))

    def index(self, n: ir.Aten, indices=None):
        """x[indices] (`indices`: n's own second argument unless given; None: a whole dim)."""
        x = self.read(n, n.args[0])
        idx = [-1 if i is None else self.reg[i] for i in (n.args[1] if indices is None else indices)]
        out = self.out_reg(n)
        self.fresh.add(n.out)
        self.p.op("INDEX", out, x, len(idx), idx, self.p.name(f"{n.name}: index"))

    def matmul(self, n: ir.Aten):
        a = n.args
        plain = {aten.mm.default: "MM", aten.bmm.default: "BMM"}.get(n.target)
        regs = [self.read(n, b) for b in (a[:2] if plain else a[:3])]
        out = self.out_reg(n)
        fresh = self.fresh_flag(n.out)
        if plain:
            self.p.op(plain, out, regs[0], regs[1], ES[n.out.dtype], fresh,
                      self.p.name(f"{n.name}: {plain.lower()}"))
        else:
            beta = float(a[3]) if len(a) > 3 else 1.0
            alpha = float(a[4]) if len(a) > 4 else 1.0
            self.p.op("ADDMM", out, regs[0], regs[1], regs[2], self.p.real(beta), self.p.real(alpha),
                      ES[n.out.dtype], fresh, self.p.name(f"{n.name}: addmm"))

    def split(self, n: ir.Aten):
        """A handle of the input that the pieces view (the tuple itself is never materialised)."""
        x = self.read_aliased(n, n.args[0])
        self.p.op("ALIAS", self.out_reg(n), x)

    def split_piece(self, n: ir.Getitem, dim: int, start: int, end: int):
        self.view_of(n.out, n.inputs[0])
        x = self.reg[n.inputs[0]]
        self.p.op("SLICE", self.out_reg(n), x, dim, start, end, 1)

    def slice(self, n: ir.Aten, dim: int, start: int, end, step: int = 1):
        x = self.read_aliased(n, n.args[0])
        self.p.op("SLICE", self.out_reg(n), x, dim, start, INT64_MAX if end is None else int(end), step)

    def select(self, n: ir.Aten):
        x = self.read_aliased(n, n.args[0])
        self.p.op("SELECT", self.out_reg(n), x, n.args[1] % n.args[0].rank, n.args[2])

    def expand(self, n: ir.Aten):
        x = self.read_aliased(n, n.args[0])
        self.p.op("EXPAND", self.out_reg(n), x, len(n.args[1]), n.args[1])

    def roll(self, n: ir.Aten, dims, shifts):
        """Into a contiguous result (`op_table._roll_in_cpp` admits no other)."""
        x = self.read(n, n.args[0])
        out = self.out_reg(n)
        self.p.op("ROLL", out, x, n.out.rank, _cl(L.CONTIGUOUS), ES[n.out.dtype], self.fresh_flag(n.out),
                  len(dims), dims, shifts)

    def clone(self, n: ir.Aten, order):
        x = self.read(n, n.args[0])
        out = self.out_reg(n)
        self.p.op("CLONE", out, x, n.out.rank, _cl(order), ES[n.out.dtype], self.fresh_flag(n.out))

    def channel_shuffle(self, n: ir.Aten):
        groups, start, end = (int(a) for a in n.args[1:])
        x = self.read(n, n.args[0])
        out = self.out_reg(n)
        lay = n.out.layout if n.out.layout in L.LABELS else L.CONTIGUOUS
        self.p.op("SHUFFLE", out, x, n.out.rank, groups, start, end, _cl(lay), ES[n.out.dtype],
                  self.fresh_flag(n.out))


def weight_format(b: ir.Buffer) -> Optional[int]:
    """oneDNN's w_cl flag for a constant weight in its eager strides (ops.weight_format)."""
    return ops.weight_format(b.size, b.eager_stride)


def _weight_flag(fmt: Optional[int]) -> int:
    if fmt is None:
        raise ValueError("a conv weight in neither dense form reached a segment")
    return fmt
