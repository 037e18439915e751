"""Has module state changed since a compiled graph last folded or packed it?

Parameters arrive as graph inputs on every call, and a folded weight or a
segment's constant pack is rebuilt exactly when one of its source tensors
changed: another tensor object, other storage, an in-place change (version
counter), or ops.refresh(). This is checked on every forward against hundreds
of tensors, so the per-tensor part runs in C++ (csrc/state_check.cpp) on the
TensorImpl addresses of the tensors this key holds; it falls back to the
Python loop when that library cannot be built.
"""
from __future__ import annotations

import operator
import sys

import torch

from cpu_layout import build, ops

_VERSION = operator.attrgetter("_version")
_DATA_PTR = torch.Tensor.data_ptr
_CDATA = operator.attrgetter("_cdata")  # the TensorImpl's address
_IS = operator.is_


def native():
    """The state-check library (built on first use, content-hashed cache), or None."""
    return _CHECK.get()


def prefetch() -> None:
    """Build the library in the background (a first compile traces meanwhile);
    `native()` waits for it."""
    _CHECK.prefetch()


def _build():
    import os


    inc = os.path.join(os.path.dirname(torch.__file__), "include")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    source = f"// torch {torch.__version__}\n" + build.csrc("state_check.cpp")
    flags = tuple(f for f in build.CXXFLAGS if f != "-std=c++17") + (
        "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{inc}") + build.torch_link_flags()
    try:
        return build.load_library(
            source, "int64_t cl_state_changed(const uintptr_t*, const int64_t*, const uintptr_t*, "
                    "int64_t, int64_t);", name_hint="state check", flags=flags)
    except Exception as exc:  # noqa: BLE001 - the Python loop does the same, slower
        from cpu_layout import config

        if config.log_enabled("build"):
            print(f"[cpu_layout.state_key] C++ check unavailable, checking in Python: {exc}",
                  file=sys.stderr)
        return None


_CHECK = build.Once(_build, "state check")  # None, remembered, when it cannot be built


class StateKey:
    """Whether the module-state tensors of a call are what they were when last
    remembered: the same tensor objects (held here, so their ids cannot be
    reused), each with the same storage address and content version, and the
    same epoch (ops.refresh). Dtypes are not compared: Dynamo guards every
    tensor input's dtype, so a compiled graph only ever sees the dtypes it was
    compiled for. Arguments that are not tensors are not compared (they are
    constants of the graph). What is remembered is replaced as one tuple, so a
    thread checking while another remembers sees the old state or the new."""

    __slots__ = ("_state",)

    def __init__(self):
        self._state = None  # (epoch, mask, tensors, ptrs, versions, C call or None)

    @staticmethod
    def _tensors(values, mask):
        return values if mask is None else [v for v, m in zip(values, mask) if m]

    def same(self, values) -> bool:
        st = self._state
        if st is None or st[0] != ops.state_epoch():
            return False
        _, mask, held, ptrs, versions, c = st
        ts = self._tensors(values, mask)
        # Identity reads no tensor memory; the C++ check then reads only the held tensors.
        if len(ts) != len(held) or not all(map(_IS, ts, held)):
            return False
        if c is not None:
            lib, args = c
            changed = lib.lib.cl_state_changed(*args)
            if changed != -2:
                return changed == -1
        try:
            now = list(map(_VERSION, ts))
        except RuntimeError:  # an inference tensor: no version counter
            now = [ops.content_version(t) for t in ts]
        return now == versions and list(map(_DATA_PTR, ts)) == ptrs

    def tensors(self) -> list:
        """The tensors last remembered (memory.py reads what a graph's state is)."""
        st = self._state
        return list(st[2]) if st is not None else []

    def remember(self, values) -> None:
        mask = [isinstance(v, torch.Tensor) for v in values]
        mask = None if all(mask) else mask
        ts = list(self._tensors(values, mask))
        ptrs = list(map(_DATA_PTR, ts))
        versions = [ops.content_version(t) for t in ts]
        c = None
        lib = native() if ts else None
        if lib is not None:
            ffi = lib.ffi
            c = (lib, (ffi.new("uintptr_t[]", list(map(_CDATA, ts))), ffi.new("int64_t[]", versions),
                       ffi.new("uintptr_t[]", ptrs), len(ts), ops.INFERENCE_VERSION))
        self._state = (ops.state_epoch(), mask, ts, ptrs, versions, c)
