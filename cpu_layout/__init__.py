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
