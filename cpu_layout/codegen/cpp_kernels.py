"""OpenMP C++ for fused pointwise and reduction kernels.

Every generated kernel has the same C signature

    void <name>(const int64_t* sizes, void* const* data, const int64_t* strides);

  sizes    the iteration shape, ``ndim`` values (pointwise: the output shape; reduction: the
           input shape, before reducing)
  data     one pointer per tensor: inputs in order, then outputs
  strides  ``ndim`` strides per tensor (in elements), tensor-major: strides[t*ndim + d]. A
           broadcast dimension has stride 0. A reduction's output is described over the input's
           ``ndim`` dims with stride 0 on the reduced ones.

Shapes and strides are run-time values, so one compiled kernel serves every shape and layout.
The Python ``run`` wrappers validate tensors and build these arrays; a C++ wrapper can call the
function directly. All the loop machinery lives in a fixed preamble, csrc/cl_kernels.h (templates
parameterised by the generated per-element lambdas), so the per-kernel code is only the expression.

Aliasing: an output may be the same memory as an input only with identical strides (in place:
each element is read before it is written, and no other element touches it). That is also what
makes ``#pragma omp simd`` legal without ``__restrict__``, which is therefore never emitted.
"""
import hashlib
import math
import operator
import os

import torch

from cpu_layout import build
from cpu_layout import layout as L
from cpu_layout.layout import channels_innermost
from cpu_layout.codegen.expr import OPS, Const, Load, Op, float_literal, loads

_MAX_NDIM = 16
_CTYPE = {torch.float32: "float", torch.bfloat16: "cl::bf16", torch.uint8: "uint8_t", torch.int8: "int8_t"}
_SHORT = {torch.float32: "f32", torch.bfloat16: "bf16", torch.uint8: "u8", torch.int8: "s8"}
_INT8 = (torch.uint8, torch.int8)
# Data a pointwise kernel widens to float blocks before its math and narrows after
# (_staged_loop): bf16, and the uint8/int8 of (de)quantizing kernels, whose loops mixing
# 1- and 4-byte elements GCC left scalar (dequantize -> BN -> ReLU -> quantize over
# 256x56x56 uint8: 0.70 ns an element in one loop, EPYC Zen 5).
_NARROW = (torch.bfloat16,) + _INT8
_REDUCTIONS = ("sum", "mean", "amax", "amin")



# Vector forms of the math functions kernels call: glibc's libmvec has them
# (x86-64 ABI names _ZGV<isa>N<lanes>v_<name>), and a declaration with GCC's
# simd attribute lets the loops that call them vectorise. Without it every
# exp/erf/tanh/log is a scalar call: a silu kernel ran 7x slower than ATen's
# (1.39 vs 0.19 ms for 144x56x56 on an EPYC Zen 4). The variants of each ISA
# GCC may call must all be present, or the library would not load: functions
# this glibc lacks (erff and tanhf came in 2.35) stay scalar.
_SIMD_VARIANTS = ("bN4v", "cN8v", "dN8v", "eN16v")
_SIMD_FUNCS = ("expf", "logf", "erff", "tanhf")
_simd = None


def _simd_math():
    """(declarations, link flags) for the vector math this machine's libmvec has."""
    global _simd
    if _simd is None:
        import ctypes

        try:
            mvec = ctypes.CDLL("libmvec.so.1")
            have = [f for f in _SIMD_FUNCS
                    if all(hasattr(mvec, f"_ZGV{v}_{f}") for v in _SIMD_VARIANTS)]
        except OSError:
            have = []
        decls = "".join(f'extern "C" float {f}(float) throw() __attribute__((__simd__("notinbranch")));\n'
                        for f in have)
        _simd = (decls, ("-l:libmvec.so.1",) if have else ())
    return _simd


_preamble = None


def preamble() -> str:
    """csrc/cl_kernels.h with this machine's vector math declared at its marker."""
    global _preamble
    if _preamble is None:
        marker = "// @SIMD_MATH@ (cpp_kernels.preamble puts the vector math declarations here)\n"
        text = build.csrc("cl_kernels.h")
        if marker not in text:
            raise RuntimeError("cpu_layout: csrc/cl_kernels.h lacks its @SIMD_MATH@ marker")
        _preamble = text.replace(marker, _simd_math()[0])
    return _preamble


def kernel_flags() -> tuple:
    """Compiler flags of kernel libraries: the build's, 512-bit vectors where the
    machine has them, and libmvec when kernels use it. GCC's -march=native
    vectorises with 256-bit vectors on Intel's AVX-512 parts (its tuning's
    preference), half the width of every generated loop and of libmvec's calls:
    a bf16 BN-ReLU over 256x56x56 channels-last took 174 us, 132 us with 512-bit
    vectors; efficientnet_b0 AMP 8.89 -> 7.45 ms, fp32 12.06 -> 11.17 ms,
    densenet121 AMP 12.5 -> 11.7 ms (Sapphire Rapids, batch 1, 1 thread,
    interleaved). The flag changes which libmvec variant computes exp: last-ulp
    differences in fp32, none seen in bf16."""
    wide = ("-mprefer-vector-width=512",) if build.native_isa("avx512f") else ()
    return build.CXXFLAGS + wide + _simd_math()[1]


class _Emitter:
    """Emits an expression as straight-line C++ with common subexpressions shared."""

    def __init__(self, loads_as):
        self.loads_as = loads_as  # Load index -> C++ expression
        self.lines = []
        self.memo = {}

    def __call__(self, e) -> str:
        if isinstance(e, Const):
            return float_literal(e.value)
        if e in self.memo:
            return self.memo[e]
        if isinstance(e, Load):
            code = self.loads_as(e.index)
        else:
            code = self._op(e, [self(a) for a in e.args])
        name = f"t{len(self.memo)}"
        self.lines.append(f"const float {name} = {code};")
        self.memo[e] = name
        return name

    @staticmethod
    def _op(e: Op, a):
        cpp = OPS[e.name].cpp  # expr.Op validated the name
        return cpp.format(*a) if isinstance(cpp, str) else cpp(a, e.params)


def _calls_vector_math(e) -> bool:
    if isinstance(e, Op):
        return OPS[e.name].vector_math or any(_calls_vector_math(a) for a in e.args)
    return False


def _check_expr(e, what):
    if not isinstance(e, (Load, Const, Op)):
        raise ValueError(f"{what} is not an expression (Load, Const or Op): {e!r}")


def _check_dtype(dt, what, quantized: bool = False):
    """float32/bfloat16; pointwise kernels also load and store uint8/int8 (quantize ops)."""
    ok = (torch.float32, torch.bfloat16) + ((torch.uint8, torch.int8) if quantized else ())
    if dt not in ok:
        raise ValueError(f"{what}: dtype must be one of {', '.join(map(str, ok))}, got {dt}")
    return dt


def _span(t, sizes, strides):
    """Byte range [lo, hi) a tensor touches when viewed with these sizes and strides."""
    lo = t.data_ptr()
    n = 1
    for size, st in zip(sizes, strides):
        if size == 0:
            return lo, lo
        n += (size - 1) * st
    return lo, lo + n * t.element_size()


def _check_tensors(ts, dtypes, kind):
    for i, (t, dt) in enumerate(zip(ts, dtypes)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{kind} {i} is not a tensor: {type(t).__name__}")
        if t.dtype != dt:
            raise ValueError(f"{kind} {i} has dtype {t.dtype}, the kernel expects {dt}")
        if not t.is_cpu or t.layout != torch.strided:
            raise ValueError(f"{kind} {i} must be a strided CPU tensor")


def _check_sizes(sizes, ndim):
    sizes = tuple(sizes)
    if len(sizes) != ndim:
        raise ValueError(f"sizes must have {ndim} entries, got {sizes}")
    for s in sizes:
        if type(s) is not int or s < 0:
            try:
                return _check_sizes([operator.index(x) for x in sizes], ndim) \
                    if any(type(x) is not int for x in sizes) else _bad_sizes(sizes, ndim)
            except TypeError:
                _bad_sizes(sizes, ndim)
    return sizes


def _bad_sizes(sizes, ndim):
    raise ValueError(f"sizes must be {ndim} non-negative ints, got {sizes!r}")


def _check_aliasing(ins, in_st, outs, out_st, out_sizes):
    """Outputs must not overlap each other, nor an input unless it is the same elements."""
    if not outs:
        return
    stor = [t.untyped_storage().data_ptr() for t in outs]
    in_stor = [t.untyped_storage().data_ptr() for t in ins]
    for i, o in enumerate(outs):  # only tensors on one storage can overlap: cheap common case
        shared_out = [j for j in range(i + 1, len(outs)) if stor[j] == stor[i]]
        shared_in = [j for j, sp in enumerate(in_stor) if sp == stor[i]]
        if not shared_out and not shared_in:
            continue
        lo, hi = _span(o, out_sizes[i], out_st[i])
        for j in shared_out:
            lo2, hi2 = _span(outs[j], out_sizes[j], out_st[j])
            if lo < hi2 and lo2 < hi:
                raise ValueError(f"outputs {i} and {j} overlap")
        for j in shared_in:
            b = ins[j]
            lo2, hi2 = _span(b, out_sizes[i], in_st[j])
            # A size-1 dim's stride is 0 in the input's broadcast strides, the
            # tensor's own in the output's: it addresses one element either way.
            same = all(a == c or n == 1 for a, c, n in zip(in_st[j], out_st[i], out_sizes[i]))
            if lo < hi2 and lo2 < hi and not (
                    o.data_ptr() == b.data_ptr() and same and o.element_size() == b.element_size()):
                raise ValueError(f"output {i} overlaps input {j} without being the same "
                                 "elements (in place needs identical strides)")


class _Compiled:
    """Validating Python entry point around a compiled kernel: ``run(sizes, ins, outs)``."""

    def __init__(self, kernel, library):
        self.kernel = kernel
        self.library = library
        self.fn = getattr(library.lib, kernel.name)
        self._ffi = library.ffi

    def call_unchecked(self, sizes, tensors, strides):
        """Call the kernel without validation: ``tensors`` are inputs then outputs, ``strides``
        the flat per-tensor list of the C signature (broadcast dims 0). For wrappers that have
        already proved the layouts; anything wrong here is memory corruption, not an error."""
        # One buffer holds sizes | data pointers | strides (pointers are 64-bit on x86-64).
        ffi, nd, nt = self._ffi, len(sizes), len(tensors)
        buf = ffi.new("int64_t[]", [*sizes, *[t.data_ptr() for t in tensors], *strides])
        self.fn(buf, ffi.cast("void* const*", buf + nd), buf + nd + nt)

    def _check_counts(self, ins, outs, n_in, n_out):
        if len(ins) != n_in or len(outs) != n_out:
            raise ValueError(f"{self.kernel.name}: expected {n_in} input and {n_out} output "
                             f"tensors, got {len(ins)} and {len(outs)}")


class CompiledPointwise(_Compiled):
    def __call__(self, sizes, in_tensors, out_tensors):
        k = self.kernel
        sizes = _check_sizes(sizes, k.ndim)
        self._check_counts(in_tensors, out_tensors, len(k.inputs), len(k.outputs))
        _check_tensors(in_tensors, k.inputs, "input")
        _check_tensors(out_tensors, k.out_dtypes, "output")
        in_st = [L.broadcast_strides(t, sizes, f"input {i}") for i, t in enumerate(in_tensors)]
        out_st = []
        for i, t in enumerate(out_tensors):
            if t.shape != sizes:
                raise ValueError(f"output {i} has shape {tuple(t.shape)}, expected {sizes}")
            st = t.stride()
            if 0 in st and any(s == 0 and n > 1 for s, n in zip(st, sizes)):
                raise ValueError(f"output {i} is broadcast (stride 0); outputs must not overlap")
            out_st.append(list(st))
        _check_aliasing(in_tensors, in_st, out_tensors, out_st, [sizes] * len(out_st))
        self.call_unchecked(sizes, [*in_tensors, *out_tensors], [s for st in in_st + out_st for s in st])


class CompiledReduction(_Compiled):
    def __call__(self, sizes, in_tensors, out_tensors):
        k = self.kernel
        sizes = _check_sizes(sizes, k.ndim)
        self._check_counts(in_tensors, out_tensors, len(k.input_dtypes), 1)
        _check_tensors(in_tensors, k.input_dtypes, "input")
        _check_tensors(out_tensors, (k.out_dtype,), "output")
        in_st = [L.broadcast_strides(t, sizes, f"input {i}") for i, t in enumerate(in_tensors)]
        out = out_tensors[0]
        want = k.output_shape(sizes)
        if out.shape != want:
            raise ValueError(f"output has shape {tuple(out.shape)}, expected {want}")
        if k.kind in ("amax", "amin") and any(sizes[d] == 0 for d in k.reduce_dims) \
                and all(want):
            raise ValueError(f"{k.kind} over an empty dimension has no identity")
        if any(s == 0 and n > 1 for s, n in zip(out.stride(), out.shape)):
            raise ValueError("output is broadcast (stride 0); outputs must not overlap")
        ost = k.output_strides_over_input(sizes, out.stride())
        so = out.untyped_storage().data_ptr()
        for i, t in enumerate(in_tensors):
            if t.untyped_storage().data_ptr() == so:
                lo, hi = _span(out, out.shape, out.stride())
                lo2, hi2 = _span(t, sizes, in_st[i])
                if lo < hi2 and lo2 < hi:
                    raise ValueError(f"reduction output overlaps input {i}")
        self.call_unchecked(sizes, [*in_tensors, out], [s for st in in_st for s in st] + ost)


class _Kernel:
    _prefix = "k"

    @property
    def name(self) -> str:
        """C symbol, derived from the generated body so equal kernels share it."""
        if self._name is None:
            digest = hashlib.sha256(self._body("NAME").encode()).hexdigest()[:16]
            self._name = f"cl_{self._prefix}_{digest}"
        return self._name

    def source(self) -> str:
        """A self-contained translation unit (the preamble is include-guarded, so several
        kernels' sources can be concatenated into one file)."""
        return preamble() + self._body(self.name)

    def cdef(self) -> str:
        return f"void {self.name}(const int64_t* sizes, void* const* data, const int64_t* strides);"

    def compile(self):
        if self._compiled is None:
            compile_library([self], name_hint=self.describe())
        return self._compiled

    def __eq__(self, other):
        return type(self) is type(other) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())


def _es_array(dtypes):
    return ", ".join(str(d.itemsize) for d in dtypes)


class PointwiseKernel(_Kernel):
    """Computes each output expression at every element of an ``ndim``-dim output shape.

    ``inputs``: dtypes of the inputs (float32/bfloat16), read by ``Load(i)``; ``outputs``:
    ``(expr, dtype)`` pairs. ``compile()`` returns ``run(sizes, in_tensors, out_tensors)``:
    outputs must have shape ``sizes``; inputs broadcast to it (right-aligned, size-1 dims).
    """
    _prefix = "pw"
    _runner = CompiledPointwise

    def __init__(self, inputs, outputs, ndim: int):
        self.inputs = tuple(_check_dtype(d, f"input {i}", True) for i, d in enumerate(inputs))
        self.outputs = tuple((e, _check_dtype(d, f"output {i}", True)) for i, (e, d) in enumerate(outputs))
        self.out_dtypes = tuple(d for _, d in self.outputs)
        if not self.outputs:
            raise ValueError("a pointwise kernel needs at least one output")
        if not isinstance(ndim, int) or not 0 <= ndim <= _MAX_NDIM:
            raise ValueError(f"ndim must be an int in [0, {_MAX_NDIM}], got {ndim!r}")
        self.ndim = ndim
        for i, (e, _) in enumerate(self.outputs):
            _check_expr(e, f"output {i}")
            bad = [j for j in loads(e) if j >= len(self.inputs)]
            if bad:
                raise ValueError(f"output {i} reads input {bad[0]} of {len(self.inputs)}")
        self._compiled = None
        self._name = None

    def _key(self):
        return ("pw", self.inputs, self.outputs, self.ndim)

    def _body(self, name):
        ni = len(self.inputs)
        lines = [f"const {_CTYPE[d]}* i{i} = (const {_CTYPE[d]}*)q[{i}];"
                 for i, d in enumerate(self.inputs)]
        lines += [f"{_CTYPE[d]}* o{i} = ({_CTYPE[d]}*)q[{ni + i}];"
                  for i, (_, d) in enumerate(self.outputs)]
        bf_in = [i for i, d in enumerate(self.inputs) if d in _NARROW]
        bf_out = [k for k, (_, d) in enumerate(self.outputs) if d in _NARROW]
        q_io = any(d in _INT8 for d in self.inputs + self.out_dtypes)
        if (bf_in or bf_out) and (q_io or any(_calls_vector_math(e) for e, _ in self.outputs)):
            loop = self._staged_loop(bf_in, bf_out)
        elif bf_out and build.native_isa("avx512bf16"):
            loop = self._staged_loop([], bf_out)  # for cl::narrow's one-instruction rounding
        else:
            em = _Emitter(lambda i: f"cl::ld(i{i}[j])")
            results = [em(e) for e, _ in self.outputs]
            # All loads and math before any store: an in-place output may be one of the inputs.
            inner = em.lines + [f"o{i}[j] = cl::cvt<{_CTYPE[d]}>({r});"
                                for i, (r, (_, d)) in enumerate(zip(results, self.outputs))]
            loop = ("#pragma omp simd\n    for (int64_t j = 0; j < n; ++j) {\n"
                    + "".join(f"      {ln}\n" for ln in inner) + "    }\n")
        return (
            f"\n// {self.describe()}\n"
            f'extern "C" void {name}(const int64_t* sizes, void* const* data, const int64_t* strides) {{\n'
            f"  static const int es[] = {{{_es_array(self.inputs + tuple(d for _, d in self.outputs))}}};\n"
            f"  cl::pointwise<{self.ndim}, {ni}, {len(self.outputs)}>(sizes, data, strides, es,\n"
            f"      [](int64_t n, char* const* q) {{\n"
            + "".join(f"    {ln}\n" for ln in lines)
            + loop
            + "  });\n}\n"
        )

    def _staged_loop(self, bf_in, bf_out):
        """The element loop through float buffers, a block at a time: the inputs in
        `bf_in` (bf16, uint8, int8) widened first, the math on floats, such outputs narrowed last
        (`cl::narrow`). Over bf16 data GCC vectorises 32 lanes at a time and the
        vector-math calls' register spills cost more than the conversions; staged,
        the math runs 16-wide as in fp32 (silu over 144x56x56 bf16: 239 -> 210 us,
        fp32 177 us; EPYC Zen 4). Without vector math a kernel is staged only for
        its bf16 stores, where AVX512-BF16 rounds 16 in one instruction: a bf16 add
        over 128x56x56 80 -> 55 us; efficientnet_b0 AMP 2.9% and densenet121 AMP
        1.4% faster at batch 1 (EPYC Zen 4, interleaved A/B). The same float
        operations; only the loops' scalar remainders (libm's exp, not libmvec's)
        fall on other elements, a last-ulp difference there. A block's inputs are
        all read before any of its outputs is written, so an output may still be
        one of the inputs."""
        em = _Emitter(lambda i: f"s{i}[j]" if i in bf_in else f"cl::ld(i{i}[b + j])")
        results = [em(e) for e, _ in self.outputs]
        math = em.lines + [f"r{k}[j] = {r};" if k in bf_out else f"o{k}[b + j] = {r};"
                           for k, r in enumerate(results)]
        out = [f"alignas(64) float s{i}[cl::BLOCK];" for i in bf_in]
        out += [f"alignas(64) float r{k}[cl::BLOCK];" for k in bf_out]
        out += ["for (int64_t b = 0; b < n; b += cl::BLOCK) {",
                "  const int64_t m = n - b < cl::BLOCK ? n - b : cl::BLOCK;"]
        for i in bf_in:
            out += ["#pragma omp simd", f"  for (int64_t j = 0; j < m; ++j) s{i}[j] = cl::ld(i{i}[b + j]);"]
        out += ["#pragma omp simd", "  for (int64_t j = 0; j < m; ++j) {"]
        out += [f"    {ln}" for ln in math] + ["  }"]
        out += [f"  cl::narrow(o{k} + b, r{k}, m);" for k in bf_out]
        out += ["}"]
        return "".join(("" if ln.startswith("#") else "    ") + ln + "\n" for ln in out)

    def describe(self) -> str:
        ins = ",".join(_SHORT[d] for d in self.inputs)
        outs = "; ".join(f"{_SHORT[d]} {e}" for e, d in self.outputs)
        return f"pointwise ndim={self.ndim} in=({ins}) -> {outs}"


class ReductionKernel(_Kernel):
    """``epilogue(reduce(prologue(inputs), reduce_dims))`` with float32 accumulation.

    ``input_dtype``: one dtype for every input, or a list (one per input); the number of inputs is
    1 + the largest ``Load`` index in ``prologue``. ``kind``: 'sum', 'mean', 'amax' or 'amin'.
    ``epilogue`` reads the reduced value as ``Load(0)``. ``run(sizes, in_tensors, [out])`` takes
    the *input* shape as ``sizes``; ``out`` has the reduced shape (size-1 dims kept if
    ``keepdim``). Input 0 (or the first unbroadcast input) sets the loop order.
    """
    _prefix = "red"
    _runner = CompiledReduction

    def __init__(self, input_dtype, prologue, kind, ndim, reduce_dims, keepdim=False,
                 out_dtype=torch.float32, epilogue=None):
        if kind not in _REDUCTIONS:
            raise ValueError(f"kind must be one of {_REDUCTIONS}, got {kind!r}")
        if not isinstance(ndim, int) or not 0 <= ndim <= _MAX_NDIM:
            raise ValueError(f"ndim must be an int in [0, {_MAX_NDIM}], got {ndim!r}")
        _check_expr(prologue, "prologue")
        if epilogue is not None:
            _check_expr(epilogue, "epilogue")
        n_in = max(loads(prologue), default=-1) + 1
        if isinstance(input_dtype, torch.dtype):
            dts = (input_dtype,) * max(n_in, 1)
        else:
            dts = tuple(input_dtype)
            if len(dts) < n_in or not dts:
                raise ValueError(f"prologue reads {n_in} inputs, {len(dts)} dtypes given")
        self.input_dtypes = tuple(_check_dtype(d, f"input {i}") for i, d in enumerate(dts))
        dims = sorted({d % ndim if ndim and -ndim <= d < ndim else _bad_dim(d, ndim)
                       for d in reduce_dims})
        self.reduce_dims = tuple(dims)
        self.prologue, self.kind, self.ndim, self.keepdim = prologue, kind, ndim, bool(keepdim)
        self.out_dtype = _check_dtype(out_dtype, "output")
        if epilogue is not None and loads(epilogue) - {0}:
            raise ValueError("the epilogue may only read Load(0), the reduced value")
        self.epilogue = epilogue
        self._compiled = None
        self._name = None

    def output_shape(self, sizes):
        return tuple(1 if d in self.reduce_dims else s for d, s in enumerate(sizes)
                     if self.keepdim or d not in self.reduce_dims)

    def output_strides_over_input(self, sizes, out_stride):
        """The output's strides described over the input's dims (0 along reduced ones), as the
        kernel's signature takes them."""
        ost, j = [0] * self.ndim, 0
        for d in range(self.ndim):
            if d not in self.reduce_dims:
                ost[d] = out_stride[j] if sizes[d] != 1 else 0
            if self.keepdim or d not in self.reduce_dims:
                j += 1
        return ost

    def _key(self):
        return ("red", self.input_dtypes, self.prologue, self.kind, self.ndim, self.reduce_dims,
                self.keepdim, self.out_dtype, self.epilogue)

    def _body(self, name):
        ni = len(self.input_dtypes)
        kd = [d for d in range(self.ndim) if d not in self.reduce_dims]
        em = _Emitter(lambda i: f"cl::ld(i{i}[j])")
        r = em(self.prologue)
        pro = [f"const {_CTYPE[d]}* i{i} = (const {_CTYPE[d]}*)q[{i}];"
               for i, d in enumerate(self.input_dtypes)]
        ep = _Emitter(lambda i: "acc")
        res = ep(self.epilogue) if self.epilogue is not None else "acc"
        ct = _CTYPE[self.out_dtype]
        arr = lambda xs: "{" + ", ".join(map(str, xs or [0])) + "}"
        return (
            f"\n// {self.describe()}\n"
            f'extern "C" void {name}(const int64_t* sizes, void* const* data, const int64_t* strides) {{\n'
            f"  static const int es[] = {{{_es_array(self.input_dtypes + (self.out_dtype,))}}};\n"
            f"  static const int kd[] = {arr(kd)}, rd[] = {arr(self.reduce_dims)};\n"
            f"  cl::reduction<{self.ndim}, {ni}, {_REDUCTIONS.index(self.kind)}>(sizes, data, strides,"
            f" es, kd, {len(kd)}, rd, {len(self.reduce_dims)},\n"
            f"      [](int64_t n, char* const* q, float* v) {{\n"
            + "".join(f"    {ln}\n" for ln in pro)
            + "#pragma omp simd\n    for (int64_t j = 0; j < n; ++j) {\n"
            + "".join(f"      {ln}\n" for ln in em.lines)
            + f"      v[j] = {r};\n    }}\n  }},\n"
            f"      [](float acc, char* out) {{\n"
            + "".join(f"    {ln}\n" for ln in ep.lines)
            + f"    *({ct}*)out = cl::cvt<{ct}>({res});\n  }});\n}}\n"
        )

    def describe(self) -> str:
        ins = ",".join(_SHORT[d] for d in self.input_dtypes)
        epi = f" then {self.epilogue}" if self.epilogue is not None else ""
        return (f"reduction {self.kind}{list(self.reduce_dims)} keepdim={self.keepdim} "
                f"ndim={self.ndim} in=({ins}) of {self.prologue}{epi} -> {_SHORT[self.out_dtype]}")


class _AffineNorm(_Kernel):
    """A normalisation kernel with optional weight and bias of the input's dtype or float32
    (ATen's mixed form under autocast); its C entry takes data (x, weight?, bias?, out, ...)."""

    def __init__(self, dtype, has_weight: bool, has_bias: bool, eps: float, param_dtype=None):
        self.dtype = _check_dtype(dtype, "input")
        self.param_dtype = _check_dtype(param_dtype or dtype, "weight")
        self.has_weight, self.has_bias = bool(has_weight), bool(has_bias)
        self.eps = float(eps)
        self._compiled = None
        self._name = None

    def checked_params(self, weight, bias, numel: int, op: str) -> list:
        """The weight and bias the kernel takes, each checked contiguous, of the parameter
        dtype, with `numel` elements."""
        params = []
        for t, has, what in ((weight, self.has_weight, "weight"), (bias, self.has_bias, "bias")):
            if has:
                if t is None or t.dtype != self.param_dtype or not t.is_contiguous() or t.numel() != numel:
                    raise ValueError(f"{op}: {what} must be contiguous {self.param_dtype} of {numel} elements")
                params.append(t)
        return params

    def _entry(self, name, fn: str, sizes: str, scratch: str) -> str:
        """The C entry calling cl::`fn`<T, P, weight?, bias?>(`sizes`, x, w, b, out, `scratch`eps)."""
        ct, pt = _CTYPE[self.dtype], _CTYPE[self.param_dtype]
        i = iter(range(1, 3))
        w = f"(const {pt}*)data[{next(i)}]" if self.has_weight else "nullptr"
        b = f"(const {pt}*)data[{next(i)}]" if self.has_bias else "nullptr"
        o = 1 + self.has_weight + self.has_bias
        return (
            f"\n// {self.describe()}\n"
            f'extern "C" void {name}(const int64_t* sizes, void* const* data, const int64_t* strides) {{\n'
            f"  (void)strides;\n"
            f"  cl::{fn}<{ct}, {pt}, {str(self.has_weight).lower()}, {str(self.has_bias).lower()}>("
            f"{sizes}, (const {ct}*)data[0], {w}, {b}, ({ct}*)data[{o}], {scratch}{float_literal(self.eps)});\n}}\n")


class CompiledLayerNorm(_Compiled):
    def __call__(self, x, weight, bias, out):
        """Validating entry point: x and out dense row-major with the same shape; weight/bias
        (when the kernel has them) dense with the normalised shape."""
        k = self.kernel
        _check_tensors([x], (k.dtype,), "input")
        _check_tensors([out], (k.dtype,), "output")
        if tuple(out.shape) != tuple(x.shape) or not x.is_contiguous() or not out.is_contiguous():
            raise ValueError("layer_norm: input and output must be contiguous and of one shape")
        cols = math.prod(x.shape[x.dim() - k.n_norm:]) if x.dim() >= k.n_norm else -1
        params = k.checked_params(weight, bias, cols, "layer_norm")
        if cols < 0:
            raise ValueError(f"layer_norm: input of rank {x.dim()} for {k.n_norm} normalised dims")
        self.call_unchecked(k.sizes_of(tuple(x.shape)), [x, *params, out], [])


class LayerNormKernel(_AffineNorm):
    """layer_norm over the last ``n_norm`` dims of a contiguous tensor, with optional weight
    and bias of the input's dtype; float32 statistics. The C entry takes sizes (rows, cols)
    and data (x, weight?, bias?, out)."""
    _prefix = "ln"
    _runner = CompiledLayerNorm

    def __init__(self, dtype, n_norm: int, has_weight: bool, has_bias: bool, eps: float,
                 param_dtype=None):
        super().__init__(dtype, has_weight, has_bias, eps, param_dtype)
        self.n_norm = int(n_norm)

    def sizes_of(self, shape):
        """(rows, cols) of an input of `shape`."""
        cols = math.prod(shape[len(shape) - self.n_norm:])
        return (math.prod(shape) // cols if cols else math.prod(shape[:len(shape) - self.n_norm]), cols)

    def _key(self):
        return ("ln", self.dtype, self.n_norm, self.has_weight, self.has_bias, self.eps, self.param_dtype)

    def _body(self, name):
        return self._entry(name, "layer_norm", "sizes[0], sizes[1]", "")

    def describe(self) -> str:
        return (f"layer_norm over {self.n_norm} dims {_SHORT[self.dtype]} params {_SHORT[self.param_dtype]} "
                f"weight={self.has_weight} "
                f"bias={self.has_bias} eps={self.eps!r}")


class CompiledGroupNorm(_Compiled):
    def __call__(self, x, weight, bias, out, groups: int):
        """Validating entry point: x and out of one shape [N, C, *], both contiguous or both
        dense with channels innermost; weight/bias (when the kernel has them) dense of C
        elements; C divisible by `groups`."""
        k = self.kernel
        _check_tensors([x], (k.dtype,), "input")
        _check_tensors([out], (k.dtype,), "output")
        if x.dim() < 2 or tuple(out.shape) != tuple(x.shape):
            raise ValueError("group_norm: input and output must be of one shape [N, C, *]")
        cl = channels_innermost(x)
        if cl is None or (cl and not out.permute(0, *range(2, out.dim()), 1).is_contiguous()) or (
                not cl and not out.is_contiguous()):
            raise ValueError("group_norm: input and output must both be contiguous or both be "
                             "dense with channels innermost")
        c = x.shape[1]
        if type(groups) is not int or groups <= 0 or c % groups:
            raise ValueError(f"group_norm: {c} channels do not split into {groups!r} groups")
        params = k.checked_params(weight, bias, c, "group_norm")
        self.call_unchecked(k.sizes_of(tuple(x.shape), groups, cl),
                            [x, *params, out, k.workspace(tuple(x.shape))], [])


class GroupNormKernel(_AffineNorm):
    """group_norm of [N, C, *] dense contiguous or with channels innermost (the output in the
    same order), with optional weight and bias; float32 statistics. The C entry takes sizes
    (N, C, positions, groups, channels innermost, CHUNK) and data (x, weight?, bias?, out,
    workspace of `workspace(shape)` float32 elements)."""
    _prefix = "gn"
    _runner = CompiledGroupNorm
    CHUNK = 256  # positions a channel sums before they join its total

    def sizes_of(self, shape, groups: int, channels_last: bool):
        return (shape[0], shape[1], math.prod(shape[2:]), groups, int(channels_last), self.CHUNK)

    def workspace(self, shape) -> torch.Tensor:
        """The kernel's scratch: per image and channel, a sum per chunk, then mean, scale, bias."""
        n, c, s = shape[0], shape[1], math.prod(shape[2:])
        return torch.empty(n * c * (-(-s // self.CHUNK) + 3), dtype=torch.float32)

    def _key(self):
        return ("gn", self.dtype, self.has_weight, self.has_bias, self.eps, self.param_dtype)

    def _body(self, name):
        o = 1 + self.has_weight + self.has_bias
        return self._entry(name, "group_norm", "sizes[0], sizes[1], sizes[2], sizes[3], sizes[4] != 0, sizes[5]",
                           f"(float*)data[{o + 1}], ")

    def describe(self) -> str:
        return (f"group_norm {_SHORT[self.dtype]} params {_SHORT[self.param_dtype]} "
                f"weight={self.has_weight} bias={self.has_bias} eps={self.eps!r}")


class CompiledSoftmax(_Compiled):
    def __call__(self, x, out, dim: int):
        """Validating entry point: x and out contiguous of one shape."""
        k = self.kernel
        _check_tensors([x], (k.dtype,), "input")
        _check_tensors([out], (k.dtype,), "output")
        if tuple(out.shape) != tuple(x.shape) or not x.is_contiguous() or not out.is_contiguous():
            raise ValueError("softmax: input and output must be contiguous and of one shape")
        if type(dim) is not int or not -max(x.dim(), 1) <= dim < max(x.dim(), 1):
            raise ValueError(f"softmax: dim {dim!r} out of range for rank {x.dim()}")
        self.call_unchecked(k.sizes_of(tuple(x.shape), dim), [x, out], [])


class SoftmaxKernel(_Kernel):
    """softmax or log_softmax along one dim of a contiguous tensor, float32 inside. The C
    entry takes sizes (outer, size of the dim, inner) and data (x, out)."""
    _prefix = "sm"
    _runner = CompiledSoftmax

    def __init__(self, dtype, log: bool):
        self.dtype = _check_dtype(dtype, "input")
        self.log = bool(log)
        self._compiled = None
        self._name = None

    @staticmethod
    def sizes_of(shape, dim: int):
        """(outer, D, inner) of a contiguous tensor of `shape` along `dim` (a 0-d tensor: one)."""
        if not shape:
            return (1, 1, 1)
        dim %= len(shape)
        return (math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1:]))

    def _key(self):
        return ("sm", self.dtype, self.log)

    def _body(self, name):
        ct = _CTYPE[self.dtype]
        return (
            f"\n// {self.describe()}\n"
            f'extern "C" void {name}(const int64_t* sizes, void* const* data, const int64_t* strides) {{\n'
            f"  (void)strides;\n"
            f"  cl::softmax<{ct}, {str(self.log).lower()}>(sizes[0], sizes[1], sizes[2], "
            f"(const {ct}*)data[0], ({ct}*)data[1]);\n}}\n")

    def describe(self) -> str:
        return f"{'log_' if self.log else ''}softmax {_SHORT[self.dtype]}"


def pool_output_size(size: int, k: int, s: int, p: int, d: int, ceil: bool) -> int:
    """ATen's pooling_output_shape."""
    out = (size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil else 0)) // s + 1
    if ceil and (out - 1) * s >= size + p:
        out -= 1
    return out


class CompiledPool(_Compiled):
    def __call__(self, x, out):
        """Validating entry point: x and out channels-last dense [N, C, H, W], out of the
        pooled size."""
        k = self.kernel
        _check_tensors([x], (k.dtype,), "input")
        _check_tensors([out], (k.dtype,), "output")
        want = k.output_shape(tuple(x.shape))
        cl = torch.channels_last
        if (x.dim() != 4 or tuple(out.shape) != want or not x.is_contiguous(memory_format=cl)
                or not out.is_contiguous(memory_format=cl)):
            raise ValueError(f"pool: input and output must be channels-last 4-D, output {want}")
        self.call_unchecked(tuple(x.shape) + want[2:], [x, out], [])


class PoolKernel(_Kernel):
    """2-D max or avg pooling (ATen's semantics) of a channels-last tensor, parameters
    fixed at compile time. The C entry takes sizes (N, C, H, W, OH, OW), data (x, out)."""
    _prefix = "pool"
    _runner = CompiledPool

    def __init__(self, dtype, kind, kernel, stride, padding, dilation=(1, 1), ceil_mode=False,
                 count_include_pad=True, divisor=None):
        if kind not in ("max", "avg"):
            raise ValueError(f"pool kind must be max or avg, got {kind!r}")
        self.dtype = _check_dtype(dtype, "input")
        self.kind = kind
        self.kernel, self.stride, self.padding, self.dilation = (
            tuple(int(v) for v in t) for t in (kernel, stride, padding, dilation))
        self.ceil_mode, self.count_include_pad = bool(ceil_mode), bool(count_include_pad)
        self.divisor = int(divisor) if divisor else 0
        self._compiled = None
        self._name = None

    def output_shape(self, shape):
        n, c, h, w = shape
        return (n, c) + tuple(pool_output_size(v, *a, self.ceil_mode) for v, a in zip(
            (h, w), zip(self.kernel, self.stride, self.padding, self.dilation)))

    def _key(self):
        return ("pool", self.dtype, self.kind, self.kernel, self.stride, self.padding, self.dilation,
                self.ceil_mode, self.count_include_pad, self.divisor)

    def _body(self, name):
        ct = _CTYPE[self.dtype]
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = self.kernel, self.stride, self.padding, self.dilation
        return (
            f"\n// {self.describe()}\n"
            f'extern "C" void {name}(const int64_t* sizes, void* const* data, const int64_t* strides) {{\n'
            f"  (void)strides;\n"
            f"  cl::pool2d_nhwc<{ct}, {int(self.kind == 'avg')}>(sizes, (const {ct}*)data[0], ({ct}*)data[1], "
            f"{kh}, {kw}, {sh}, {sw}, {ph}, {pw}, {dh}, {dw}, {str(self.count_include_pad).lower()}, "
            f"{self.divisor});\n}}\n")

    def describe(self) -> str:
        return (f"{self.kind}_pool2d nhwc {_SHORT[self.dtype]} k{self.kernel} s{self.stride} "
                f"p{self.padding} d{self.dilation} ceil={self.ceil_mode} "
                f"incl={self.count_include_pad} div={self.divisor}")


def _bad_dim(d, ndim):
    raise ValueError(f"reduce dim {d} out of range for ndim {ndim}")


# A translation unit per this many kernels at least. A unit's fixed cost (the
# preamble) is ~0.15 s of g++; one kernel takes 0.05-0.5 s (densenet121's 4
# kernels: 1.27 s in one unit, 0.77 s in two on two cores, EPYC Zen 4).
KERNELS_PER_UNIT = 2


def _units(n_kernels: int) -> int:
    """Translation units to compile `n_kernels` in, one per core this process may use."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, n_kernels // KERNELS_PER_UNIT))


def compile_library(kernels, name_hint: str = "graph"):
    """Compile several kernels into shared libraries: one compiler run per core
    (not one per kernel, most of a graph's compile time otherwise), in parallel.
    Returns the runners in order; equal kernels share one symbol."""
    unique = list(dict.fromkeys(kernels))
    todo = [k for k in unique if k._compiled is None]
    n = _units(len(todo))
    chunks = [todo[i::n] for i in range(n)] if todo else []

    def build_unit(i, chunk):
        source = "".join(k.source() for k in chunk)
        cdef = "\n".join(k.cdef() for k in chunk)
        hint = name_hint if n == 1 else f"{name_hint} ({i + 1}/{n})"
        return build.load_library(source, cdef, name_hint=hint, flags=kernel_flags())

    if len(chunks) > 1:  # g++ runs in subprocesses: threads are enough to overlap them
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(chunks)) as pool:
            libraries = list(pool.map(build_unit, range(len(chunks)), chunks))
    else:
        libraries = [build_unit(0, c) for c in chunks]
    for chunk, library in zip(chunks, libraries):
        for k in chunk:
            k._compiled = k._runner(k, library)
    by_key = {k: k._compiled for k in unique}
    return [by_key[k] for k in kernels]
