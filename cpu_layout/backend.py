"""`torch.compile(model, backend="cpu_layout")`.

Dynamo hands us an FX graph; aot_autograd turns it into an inference graph
of functional ATen ops whose inputs include the module's parameters and
buffers. That graph is lowered to cpu_layout IR, conv epilogues are fused,
layouts are planned, and a wrapper is generated. A graph the backend cannot
compile runs eagerly, with one warning (an error under CPU_LAYOUT_STRICT=1).
"""
from __future__ import annotations

import functools
import logging
import sys
import time
import warnings
from typing import List, Optional

import torch

from cpu_layout import config

log = logging.getLogger("cpu_layout")

KNOWN_OPTIONS = {"cpp_wrapper", "debug"}
# options={"cpp_wrapper": True} or CPU_LAYOUT_CPP_WRAPPER=1: the graph's work
# in C++ segments (codegen/cpp_wrapper.py); scripts read this flag.
CPP_WRAPPER_IMPLEMENTED = True


class CompileError(RuntimeError):
    """The backend could not compile a graph (raised under CPU_LAYOUT_STRICT=1)."""


def _static_input_indices(n_inputs: int) -> List[int]:
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
    idx = getattr(meta, "static_input_indices", None)
    return list(idx) if idx is not None else []


def _wants_cpp_wrapper(options: dict) -> bool:
    return bool(options.get("cpp_wrapper", config.cpp_wrapper_default()))


def compile_graph(gm: torch.fx.GraphModule, example_inputs, options: dict,
                  param_indices: Optional[List[int]] = None):
    """Lower, fuse, plan and generate the wrapper for one inference graph.
    `param_indices`: inputs that are module state (parameters, buffers, constants);
    by default aot_autograd's static inputs."""
    from cpu_layout import fuse, lower, memory, quant, schedule, threads
    from cpu_layout.codegen import wrapper

    threads.check_wait_policy()
    threads.pin_workers()
    t0 = time.perf_counter()
    if param_indices is None:
        param_indices = _static_input_indices(len(example_inputs))
    if quant.rewrite(gm, param_indices):  # PT2E's int8 patterns onto int8 kernels, before lowering
        gm.graph.lint()
    g = lower.lower(gm, param_indices)
    debug = bool(options.get("debug", config.debug()))
    cpp = _wants_cpp_wrapper(options)
    fuse.fuse_conv_epilogues(g, fuse.split_in_segments if cpp else None)
    if cpp:
        from cpu_layout.codegen import cpp_wrapper, program

        # Before the plan times convs: a compiler still running on another core would skew them.
        program.runtime()
        schedule.plan(g)
        runners = cpp_wrapper.build(g, schedule.bind, debug=debug)
    else:
        runners = schedule.plan_and_bind(g)
    source, env = wrapper.generate(g, runners, debug=debug)
    if config.log_enabled("wrapper"):
        print(source, file=sys.stderr)
    code = compile(source, "<cpu_layout wrapper>", "exec")
    exec(code, env)
    call = env["call"]
    call._boxed_call = True
    call.cpu_layout_source = source
    call.cpu_layout_graph = g
    call.cpu_layout_cpp_wrapper = cpp
    memory.register(call)
    memory.after_compile()
    if config.log_enabled("compile"):
        print(f"cpu_layout: compiled graph with {len(g.nodes)} nodes in "
              f"{(time.perf_counter() - t0) * 1e3:.1f} ms", file=sys.stderr)
    return call


def compile_or_eager(gm: torch.fx.GraphModule, example_inputs, options: dict,
                     param_indices: Optional[List[int]] = None):
    """compile_graph, or the graph run eagerly with one warning if it fails
    (CompileError under CPU_LAYOUT_STRICT=1). Both return a boxed call (one list)."""
    try:
        return compile_graph(gm, example_inputs, options, param_indices)
    except Exception as exc:  # noqa: BLE001 - any failure means: run this graph eagerly
        if config.strict():
            raise CompileError(f"cpu_layout could not compile a graph: {type(exc).__name__}: {exc}") from exc
        _fallback_warning(f"{type(exc).__name__}: {exc}")
        return _eager(gm)


def check_options(options) -> dict:
    options = dict(options or {})
    unknown = set(options) - KNOWN_OPTIONS
    if unknown:
        raise ValueError(f"cpu_layout: unknown options {sorted(unknown)}; known: {sorted(KNOWN_OPTIONS)}")
    return options


def _eager(gm):
    def run(args):
        return gm(*args)

    run._boxed_call = True
    return run


def cpu_layout_backend(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    """The Dynamo backend; registered as `cpu_layout` through an entry point."""
    from torch._dynamo.backends.common import aot_autograd

    options = check_options(kwargs.pop("options", None))
    kwargs.pop("mode", None)
    if torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs
    ):
        _fallback_warning("training graphs are not supported (compile under torch.no_grad() "
                          "or torch.inference_mode())")
        return gm.forward

    from cpu_layout import state_key

    state_key.prefetch()  # both build while aot_autograd traces, when not cached yet
    if _wants_cpp_wrapper(options):
        from cpu_layout.codegen import program

        program.prefetch_runtime()

    def fw_compiler(fx_gm, fx_inputs):
        return compile_or_eager(fx_gm, fx_inputs, options)

    # Dynamo's own aot_autograd wrapper, as its aot_eager backend uses: it keeps
    # Dynamo out of the compiled function (a graph split by a break of the DDP
    # optimizer's kind would otherwise hand the first caller a FakeTensor).
    # Input mutations stay in the graph (copy_/set_ into a parameter through
    # `.data`), where they run as ATen ops in order.
    return aot_autograd(fw_compiler=fw_compiler, keep_inference_input_mutations=True)(gm, example_inputs)


@functools.lru_cache(maxsize=None)
def _fallback_warning(reason: str) -> None:
    if config.strict():
        raise CompileError(f"cpu_layout: {reason}")
    warnings.warn(f"cpu_layout: running a graph eagerly: {reason}", RuntimeWarning, stacklevel=3)
