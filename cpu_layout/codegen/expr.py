"""A tiny immutable expression IR for the body of a fused elementwise kernel.

Nodes are frozen dataclasses, so they hash and compare structurally; the C++ emitter is a pure
function of the structure, so equal expressions give identical source (and build-cache hits).
Everything is computed in float32, following torch's semantics for each op.
"""
import math
import struct
from dataclasses import dataclass, field
from typing import Tuple, Union

# name -> (arity, parameter names). Parameters are Python scalars/strings/None.
OPS = {
    "add": (2, ()), "sub": (2, ()), "mul": (2, ()), "div": (2, ()),
    "maximum": (2, ()), "minimum": (2, ()),
    "gt": (2, ()), "lt": (2, ()), "ge": (2, ()), "le": (2, ()), "eq": (2, ()),
    "neg": (1, ()), "abs": (1, ()), "exp": (1, ()), "log": (1, ()), "sqrt": (1, ()),
    "rsqrt": (1, ()), "reciprocal": (1, ()), "relu": (1, ()), "sigmoid": (1, ()),
    "tanh": (1, ()), "silu": (1, ()), "hardswish": (1, ()), "hardsigmoid": (1, ()),
    "relu6": (1, ()),
    "pow": (1, ("exponent",)),          # tensor ** python scalar
    "leaky_relu": (1, ("slope",)),
    "gelu": (1, ("approximate",)),      # 'none' (erf) or 'tanh'
    "clamp": (1, ("lo", "hi")),         # either bound may be None
    "where": (3, ()),                   # where(cond != 0, a, b)
}
_DEFAULTS = {"leaky_relu": (0.01,), "gelu": ("none",), "clamp": (None, None)}


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
        arity, pnames = OPS[self.name]
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
