"""A tiny immutable expression IR for the body of a fused elementwise kernel.

Nodes are frozen dataclasses, so they hash and compare structurally; the C++ emitter is a pure
function of the structure, so equal expressions give identical source (and build-cache hits).
Everything is computed in float32, following torch's semantics for each op.
"""
import math
import struct
from dataclasses import dataclass, field
from typing import Callable, Optional, Tuple, Union

import torch

@dataclass(frozen=True)
class ElementOp:
    """One element-wise op, defined once: its arity and parameters (Python
    scalars, strings or None), the ATen ops lowered to it directly, the C++
    of one element (a format of the argument expressions {0}, {1}, ..., or
    `fn(args, params) -> str`), whether that C++ calls libmvec's vector math
    (cl:: helpers), and the conv post-op that runs it after a convolution
    (`fn(params)` -> a cpu_layout.ops post-op), if any."""
    arity: int
    cpp: Union[str, Callable]
    params: Tuple[str, ...] = ()
    aten: tuple = ()
    vector_math: bool = False
    post_op: Optional[Callable] = None


def float_literal(v: float) -> str:
    """A C++ float literal for any Python float, infinities and NaN included."""
    v = float(v)
    if v != v:
        return '__builtin_nanf("")'
    if v in (float("inf"), float("-inf")):
        return "__builtin_inff()" if v > 0 else "(-__builtin_inff())"
    return f"({v.hex()}f)"


def _leaky_relu_cpp(a, p):
    return f"{a[0]} > 0.f ? {a[0]} : {a[0]} * {float_literal(p[0])}"


def _clamp_cpp(a, p):
    x = a[0]
    if p[0] is not None:
        x = f"cl::max_({x}, {float_literal(p[0])})"
    if p[1] is not None:
        x = f"cl::min_({x}, {float_literal(p[1])})"
    return x


def _pow_cpp(a, p):  # torch's special cases for scalar exponents
    x = a[0]
    special = {2.0: f"{x} * {x}", 3.0: f"{x} * {x} * {x}", 0.5: f"std::sqrt({x})",
               -0.5: f"1.f / std::sqrt({x})", -1.0: f"1.f / {x}",
               -2.0: f"1.f / ({x} * {x})", 1.0: x, 0.0: "1.f"}
    return special.get(p[0], f"std::pow({x}, {float_literal(p[0])})")


def _named(name):
    return lambda p: name


def _dequant_cpp(a, p):  # dequantize_per_tensor: ((float)q - zp) * scale, in float32
    return f"(({a[0]}) - {float_literal(p[1])}) * {float_literal(p[0])}"


def _quant_cpp(a, p):  # quantize_per_tensor: clamp(round(x * (float)(1 / scale)) + zp, lo, hi)
    return (f"cl::quant({a[0]}, {float_literal(1.0 / p[0])}, {float_literal(p[1])}, "
            f"{float_literal(p[2])}, {float_literal(p[3])})")


_aten = torch.ops.aten
OPS = {
    "add": ElementOp(2, "{0} + {1}", aten=(_aten.add.Tensor, _aten.add.Scalar)),
    "sub": ElementOp(2, "{0} - {1}", aten=(_aten.sub.Tensor, _aten.sub.Scalar)),
    "mul": ElementOp(2, "{0} * {1}", aten=(_aten.mul.Tensor, _aten.mul.Scalar)),
    "div": ElementOp(2, "{0} / {1}", aten=(_aten.div.Tensor, _aten.div.Scalar)),
    "maximum": ElementOp(2, "cl::max_({0}, {1})", aten=(_aten.maximum.default,)),
    "minimum": ElementOp(2, "cl::min_({0}, {1})", aten=(_aten.minimum.default,)),
    "gt": ElementOp(2, "({0} > {1}) ? 1.f : 0.f"),
    "lt": ElementOp(2, "({0} < {1}) ? 1.f : 0.f"),
    "ge": ElementOp(2, "({0} >= {1}) ? 1.f : 0.f"),
    "le": ElementOp(2, "({0} <= {1}) ? 1.f : 0.f"),
    "eq": ElementOp(2, "({0} == {1}) ? 1.f : 0.f"),
    "neg": ElementOp(1, "-{0}", aten=(_aten.neg.default,)),
    "abs": ElementOp(1, "std::fabs({0})", aten=(_aten.abs.default,)),
    "exp": ElementOp(1, "std::exp({0})", aten=(_aten.exp.default,), vector_math=True),
    "log": ElementOp(1, "std::log({0})", aten=(_aten.log.default,), vector_math=True),
    "sqrt": ElementOp(1, "std::sqrt({0})", aten=(_aten.sqrt.default,)),
    "rsqrt": ElementOp(1, "1.f / std::sqrt({0})", aten=(_aten.rsqrt.default,)),
    "reciprocal": ElementOp(1, "1.f / {0}", aten=(_aten.reciprocal.default,)),
    "relu": ElementOp(1, "cl::relu({0})", aten=(_aten.relu.default,), post_op=_named("relu")),
    "sigmoid": ElementOp(1, "cl::sigmoid({0})", aten=(_aten.sigmoid.default,), vector_math=True,
                         post_op=_named("sigmoid")),
    "tanh": ElementOp(1, "std::tanh({0})", aten=(_aten.tanh.default,), vector_math=True,
                      post_op=_named("tanh")),
    "silu": ElementOp(1, "cl::silu({0})", aten=(_aten.silu.default,), vector_math=True,
                      post_op=_named("silu")),
    "hardswish": ElementOp(1, "cl::hardswish({0})", aten=(_aten.hardswish.default,),
                           post_op=_named("hardswish")),
    "hardsigmoid": ElementOp(1, "cl::hardsigmoid({0})", aten=(_aten.hardsigmoid.default,)),
    "relu6": ElementOp(1, "cl::min_(cl::max_({0}, 0.f), 6.f)"),
    "pow": ElementOp(1, _pow_cpp, ("exponent",)),  # tensor ** python scalar
    "leaky_relu": ElementOp(1, _leaky_relu_cpp, ("slope",),
                            post_op=lambda p: ("leaky_relu", float(p[0]))),
    "gelu": ElementOp(1, lambda a, p: f"cl::gelu{'_tanh' if p[0] == 'tanh' else ''}({a[0]})",
                      ("approximate",), vector_math=True,  # 'none' (erf) or 'tanh'
                      post_op=lambda p: "gelu_tanh" if p and p[0] == "tanh" else "gelu"),
    "clamp": ElementOp(1, _clamp_cpp, ("lo", "hi"),  # either bound may be None
                       post_op=lambda p: ("clamp", None if p[0] is None else float(p[0]),
                                          None if p[1] is None else float(p[1]))),
    "where": ElementOp(3, "({0} != 0.f) ? {1} : {2}"),  # where(cond != 0, a, b)
    # (De)quantization of PT2E graphs (quant/ops.py: Dequantize, Quantize): the kernel loads
    # and stores uint8/int8 buffers as it does bf16 ones, so a dequantize -> float ops ->
    # quantize chain is one kernel.
    "dequant": ElementOp(1, _dequant_cpp, ("scale", "zp")),
    "quant": ElementOp(1, _quant_cpp, ("scale", "zp", "lo", "hi")),
    # addcmul(x, a, b, value): x + value * a * b, in ATen's order of operations.
    "addcmul": ElementOp(3, lambda a, p: f"{a[0]} + {float_literal(p[0])} * {a[1]} * {a[2]}", ("value",)),
}
_DEFAULTS = {"leaky_relu": (0.01,), "gelu": ("none",), "clamp": (None, None), "addcmul": (1.0,)}


def _f32(v: float) -> float:
    """Round to the nearest float32, as torch does to a Python scalar used with a float tensor."""
    return struct.unpack("f", struct.pack("f", v))[0] if math.isfinite(v) else v


@dataclass(frozen=True)
class Load:
    """The i-th kernel input at the current element (broadcast inputs read with stride 0)."""
    index: int

    def __post_init__(self):
        if not isinstance(self.index, int) or self.index < 0:
            raise ValueError(f"Load index must be a non-negative int, got {self.index!r}")

    def __str__(self):
        return f"in{self.index}"


@dataclass(frozen=True)
class Const:
    """A float32 constant. Compared by bit pattern, so 0.0 != -0.0 and nan == nan."""
    value: float = field(compare=False)
    _bits: str = field(init=False, repr=False)

    def __post_init__(self):
        v = _f32(float(self.value))
        object.__setattr__(self, "value", v)
        object.__setattr__(self, "_bits", "nan" if math.isnan(v) else v.hex())

    def __str__(self):
        return repr(self.value)


@dataclass(frozen=True)
class Op:
    name: str
    args: Tuple["Expr", ...]
    params: tuple = ()

    def __post_init__(self):
        if self.name not in OPS:
            raise ValueError(f"unsupported op {self.name!r}; known: {sorted(OPS)}")
        arity, pnames = OPS[self.name].arity, OPS[self.name].params
        args = tuple(self.args)
        if len(args) != arity:
            raise ValueError(f"{self.name} takes {arity} argument(s), got {len(args)}")
        for a in args:
            if not isinstance(a, (Load, Const, Op)):
                raise ValueError(f"{self.name}: argument {a!r} is not an expression")
        params = tuple(self.params) if self.params else _DEFAULTS.get(self.name, ())
        if len(params) != len(pnames):
            raise ValueError(f"{self.name} takes parameters {pnames}, got {params!r}")
        if self.name == "gelu" and params[0] not in ("none", "tanh"):
            raise ValueError(f"gelu approximate must be 'none' or 'tanh', got {params[0]!r}")
        if self.name in ("pow", "leaky_relu"):
            params = (_f32(float(params[0])),)
        if self.name == "clamp":
            params = tuple(None if p is None else _f32(float(p)) for p in params)
        object.__setattr__(self, "args", args)
        object.__setattr__(self, "params", params)

    def __str__(self):
        inner = [str(a) for a in self.args] + [repr(p) for p in self.params]
        return f"{self.name}({', '.join(inner)})"


Expr = Union[Load, Const, Op]


def loads(e: Expr) -> set:
    """Indices of the inputs an expression reads."""
    if isinstance(e, Load):
        return {e.index}
    if isinstance(e, Op):
        return set().union(*(loads(a) for a in e.args))
    return set()
