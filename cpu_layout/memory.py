"""What compiled graphs hold between calls, by kind, and giving it back.

A compiled graph keeps, beside the module's own parameters (which it reads and
never copies):

  weights_packed   oneDNN's packed copies of conv weights (csrc/conv.cpp's
                   weight cache; a batch-norm is multiplied in while packing)
  weights_derived  tensors computed from module state and kept while it is
                   unchanged: transposed or cast weights, batch-norm scales and
                   shifts, folded weights of convs that run on ATen's oneDNN
  arenas           each C++ segment's arena, laid out from its first call
  pools            blocks a segment keeps for its next call (before an arena
                   exists, or while calls differ from the first)
  scratch          the extension's per-thread scratch buffers (shared by every
                   graph of the process: counted in each model's figure)
  code             the graph's generated kernel libraries (file size: what is
                   mapped, at most)

Not counted: the module's parameters and buffers; oneDNN's primitives and
their JIT code, torch's and Dynamo's own caches; what the allocator keeps of
memory freed (glibc returns it with `malloc_trim`, which compiles call).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading
import weakref
from typing import Dict, List

import torch

KINDS = ("weights_packed", "weights_derived", "arenas", "pools", "scratch", "code")

_graphs: "weakref.WeakSet" = weakref.WeakSet()  # every compiled graph's `call`
_lock = threading.Lock()


def register(call) -> None:
    """Called by the backend for each compiled graph (its generated `call`)."""
    with _lock:
        _graphs.add(call)


def _env_values(call) -> List[object]:
    env = getattr(call, "__globals__", None) or {}
    return [v for k, v in env.items() if k.startswith("_")]


def _parts(call):
    """(memoized values, their module-state sources, segments, kernel libraries) of one graph."""
    from cpu_layout import runtime

    values, sources, segments, libraries = [], [], [], []
    todo = list(_env_values(call))
    seen = set()
    while todo:
        r = todo.pop()
        if id(r) in seen:
            continue
        seen.add(id(r))
        if isinstance(r, runtime.Timed):
            todo.append(r.fn)
            continue
        if isinstance(r, runtime.Memoized):
            values.append(r.value)
            sources += r.key.tensors()
        elif isinstance(r, runtime.ConstantPrologue):
            values.append(r.value)
            sources += r.key.tensors()
            if r.fn is not None and hasattr(r.fn, "__globals__"):
                todo += _env_values(r.fn)
        elif isinstance(r, runtime.SegmentCall):
            segments.append(r)
            todo += list(r.kernels)
        elif isinstance(r, runtime.ConvCall) and r.fold is not None:
            todo.append(r.fold)
        lib = getattr(r, "library", None) or getattr(getattr(r, "compiled", None), "library", None)
        if lib is not None:
            libraries.append(lib)
    return values, sources, segments, libraries


def _tensors(v, out: list) -> list:
    if isinstance(v, torch.Tensor):
        out.append(v)
    elif isinstance(v, (list, tuple)):
        for x in v:
            _tensors(x, out)
    return out


def _storage(t: torch.Tensor):
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _model_parts(model) -> tuple:
    """(`_parts` of each of its graphs, module-state tensors) of what the user holds: a
    torch.compile'd module, a compile_exported result, a module, a compiled graph, or
    None (every graph)."""
    with _lock:
        graphs = list(_graphs)
    if model is None:
        return [_parts(g) for g in graphs], []
    if hasattr(model, "compiled_graphs"):  # what compile_exported returns
        return [_parts(g) for g in model.compiled_graphs() if g in graphs], model.state_tensors()
    if model in graphs:
        return [_parts(model)], []
    module = getattr(model, "_orig_mod", model)
    if not isinstance(module, torch.nn.Module):
        raise TypeError("cpu_layout.memory_stats: expected a torch.compile'd module, a module, what "
                        f"compile_exported returns, or None; got {type(model).__name__}")
    state = list(module.parameters()) + list(module.buffers())
    ptrs = {t.data_ptr() for t in state}
    # A graph reads the module's state when its memoized nodes or prologue remember it.
    parts = [_parts(g) for g in graphs]
    return [p for p in parts if any(t.data_ptr() in ptrs for t in p[1])], state


def memory_stats(model=None) -> Dict[str, int]:
    """Bytes held between calls by the compiled graphs of `model` (a torch.compile'd
    module or its module, what `compile_exported` returns; None: every compiled graph
    of the process), by kind (see KINDS and this module's docstring), and `total`.
    `largest_live` is the largest set of arena buffers live at once in the calls
    the arenas were laid out from (an arena of exactly that size wastes nothing)."""
    return _stats(*_model_parts(model))


def _stats(parts: list, state: list) -> Dict[str, int]:
    from cpu_layout import ops

    out = dict.fromkeys(KINDS, 0)
    out["largest_live"] = 0
    source_storages = {_storage(t)[0] for t in state}
    derived, serial_tensors, libraries = {}, list(state), {}
    for values, sources, segments, libs in parts:
        source_storages |= {_storage(t)[0] for t in sources}
        serial_tensors += sources
        for v in values:
            for t in _tensors(v, []):
                serial_tensors.append(t)
                ptr, nbytes = _storage(t)
                derived[ptr] = nbytes
        for s in segments:
            arena, blocks, live = s.held()
            out["arenas"] += arena
            out["pools"] += blocks
            out["largest_live"] += live
        for lib in libs:
            libraries[lib.path] = lib
    for ptr in source_storages:  # a view of module state is not a copy
        derived.pop(ptr, None)
    out["weights_derived"] = sum(derived.values())
    serials = sorted({s for s in (getattr(t, "_cpu_layout_serial", None) for t in serial_tensors) if s})
    out["weights_packed"] = int(ops.lib.cl_weight_bytes(ops.ffi.new("unsigned long long[]", serials or [0]),
                                                        len(serials)))
    out["scratch"] = int(ops.lib.cl_thread_buffer_bytes())
    out["code"] = sum(_file_size(p) for p in libraries)
    out["total"] = sum(out[k] for k in KINDS)
    return out


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def release_memory(model=None) -> int:
    """Give back what `model`'s compiled graphs (None: every graph) keep only to be
    fast: each segment's arena and pool, and this thread's scratch buffers. Weights
    stay packed. The next call allocates again and lays the arenas out anew (its
    first call after a release runs as a first call does). Returns the bytes freed
    (as memory_stats counted them); the allocator may keep some of it (see trim)."""
    from cpu_layout import ops

    parts, state = _model_parts(model)
    kinds = ("arenas", "pools", "scratch")
    before = _stats(parts, state)
    for _, _, segments, _ in parts:
        for s in segments:
            s.release()
    ops.lib.cl_release_thread_buffers()
    trim()
    after = _stats(parts, state)
    return sum(before[k] - after[k] for k in kinds)


def after_compile() -> None:
    """What compiling grew goes back: the scratch buffers timing the convs grew
    (densenet121 at batch 8: 35 MB, where its calls need 10 kB) and, through
    `trim`, what the allocator keeps of freed memory (traced graphs, plan tables)."""
    ops = sys.modules.get("cpu_layout.ops")  # loaded when the graph has convs
    if ops is not None:
        ops.lib.cl_release_thread_buffers()
    trim()


_libc = None


def trim() -> None:
    """Hand the allocator's free memory back to the system (glibc's malloc_trim;
    nothing elsewhere). A compile frees far more than it keeps: without this the
    process stays that much larger."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            lib = ctypes.CDLL(name) if name else None
            _libc = lib if lib is not None and hasattr(lib, "malloc_trim") else False
        except OSError:
            _libc = False
    if _libc:
        _libc.malloc_trim(0)

