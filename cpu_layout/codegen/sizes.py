"""Sizes as C++: sympy expressions of symbolic shapes printed as int64 arithmetic.

Fake tensors carry sizes such as `s0`, `FloorDiv(s1 - 1, 2) + 1`; a
cpp_wrapper segment computes them from the symbols' run-time values (read
from its inputs' sizes). Only what shape arithmetic produces is supported;
anything else raises NotImplementedError and the node stays in Python.
"""
from __future__ import annotations

from typing import Set

import sympy
import torch

try:  # torch's own sympy functions for integer shape arithmetic
    from torch.utils._sympy.functions import CeilDiv, FloorDiv, Max, Min, Mod, PythonMod
except ImportError:  # pragma: no cover - older torch
    from torch.utils._sympy.functions import FloorDiv, Mod  # type: ignore

    CeilDiv = Max = Min = PythonMod = ()


def to_sympy(v):
    """An int, SymInt or sympy expression as a sympy expression."""
    if isinstance(v, torch.SymInt):
        return v.node.expr
    if isinstance(v, int):
        return sympy.Integer(v)
    if isinstance(v, sympy.Expr):
        return v
    raise NotImplementedError(f"size {v!r} is not an integer expression")


def free_symbols(v) -> Set[sympy.Symbol]:
    return set(to_sympy(v).free_symbols)


def cexpr(v) -> str:
    """C++ for one size expression (symbols print as their names)."""
    return _print(to_sympy(v))


def _print(e) -> str:
    if isinstance(e, sympy.Integer):
        return f"INT64_C({int(e)})"
    if isinstance(e, sympy.Symbol):
        return e.name
    if isinstance(e, sympy.Add):
        return "(" + " + ".join(_print(a) for a in e.args) + ")"
    if isinstance(e, sympy.Mul):
        return "(" + " * ".join(_print(a) for a in e.args) + ")"
    if isinstance(e, sympy.Pow) and isinstance(e.exp, sympy.Integer) and int(e.exp) > 0:
        return "(" + " * ".join([_print(e.base)] * int(e.exp)) + ")"
    if isinstance(e, FloorDiv):
        return f"clw::floordiv({_print(e.args[0])}, {_print(e.args[1])})"
    if CeilDiv and isinstance(e, CeilDiv):
        a, b = (_print(x) for x in e.args)
        return f"(-clw::floordiv(-({a}), {b}))"
    if isinstance(e, Mod) or (PythonMod and isinstance(e, PythonMod)):
        return f"clw::pymod({_print(e.args[0])}, {_print(e.args[1])})"
    if (Max and isinstance(e, Max)) or isinstance(e, sympy.Max):
        return _fold("std::max", e.args)
    if (Min and isinstance(e, Min)) or isinstance(e, sympy.Min):
        return _fold("std::min", e.args)
    raise NotImplementedError(f"size expression {e} ({type(e).__name__}) has no C++ form here")


def _fold(fn, args) -> str:
    out = _print(args[0])
    for a in args[1:]:
        out = f"{fn}<int64_t>({out}, {_print(a)})"
    return out
