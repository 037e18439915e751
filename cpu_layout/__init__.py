"""cpu_layout: a torch.compile backend for x86 CPUs (see README.md).

Submodules load lazily so that `import cpu_layout` stays cheap and the
layout planner can be used without the native extension.
"""
import importlib

__version__ = "0.1.0"

_SUBMODULES = ("ops", "layout", "plan", "config")


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"cpu_layout.{name}")
    raise AttributeError(f"module 'cpu_layout' has no attribute {name!r}")


def compile_exported(ep, options=None):
    """Compile a torch.export.ExportedProgram; call the result like `ep.module()`,
    without Dynamo's per-call cost (see cpu_layout/exported.py, README)."""
    return importlib.import_module("cpu_layout.exported").compile_exported(ep, options)


def refresh() -> None:
    """Recompute every folded or reordered weight from the current parameters
    on the next call. Needed only after a change PyTorch cannot track: an
    in-place update of an inference tensor inside torch.inference_mode(), or
    a write through `tensor.data` (see README, "Module state")."""
    importlib.import_module("cpu_layout.ops").refresh()


def memory_stats(model=None) -> dict:
    """Bytes the compiled graphs of `model` hold between calls, by kind (packed and
    derived weights, arenas, pools, scratch, generated code) and in total; see
    cpu_layout/memory.py for what is and is not counted."""
    return importlib.import_module("cpu_layout.memory").memory_stats(model)


def release_memory(model=None) -> int:
    """Free the arenas, pools and scratch `model`'s compiled graphs keep between
    calls (weights stay packed); the next call lays them out again. Returns bytes freed."""
    return importlib.import_module("cpu_layout.memory").release_memory(model)
