"""Sizes for the segment runtime: sympy expressions of symbolic shapes as postfix int64 tokens.

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


# Tokens of a size expression for the segment runtime (csrc/segment_vm.cpp, enum Tok).
T_CONST, T_SYM, T_ADD, T_MUL, T_FLOORDIV, T_MOD, T_MAX, T_MIN, T_CEILDIV = range(9)


def rpn(v, slot_of) -> list:
    """One size expression as the segment runtime's postfix tokens; `slot_of`
    maps a symbol to the slot its run-time value is read into."""
    out: list = []
    _rpn(to_sympy(v), slot_of, out)
    return out


def _rpn(e, slot_of, out) -> None:
    def fold(tok, args):
        _rpn(args[0], slot_of, out)
        for a in args[1:]:
            _rpn(a, slot_of, out)
            out.append(tok)

    if isinstance(e, sympy.Integer):
        out += [T_CONST, int(e)]
    elif isinstance(e, sympy.Symbol):
        out += [T_SYM, slot_of(e)]
    elif isinstance(e, sympy.Add):
        fold(T_ADD, e.args)
    elif isinstance(e, sympy.Mul):
        fold(T_MUL, e.args)
    elif isinstance(e, sympy.Pow) and isinstance(e.exp, sympy.Integer) and int(e.exp) > 0:
        fold(T_MUL, [e.base] * int(e.exp))
    elif isinstance(e, FloorDiv):
        fold(T_FLOORDIV, e.args)
    elif CeilDiv and isinstance(e, CeilDiv):
        fold(T_CEILDIV, e.args)
    elif isinstance(e, Mod) or (PythonMod and isinstance(e, PythonMod)):
        fold(T_MOD, e.args)
    elif (Max and isinstance(e, Max)) or isinstance(e, sympy.Max):
        fold(T_MAX, e.args)
    elif (Min and isinstance(e, Min)) or isinstance(e, sympy.Min):
        fold(T_MIN, e.args)
    else:
        raise NotImplementedError(f"size expression {e} ({type(e).__name__}) has no runtime form here")
