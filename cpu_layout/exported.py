"""`cpu_layout.compile_exported(ep)`: an ExportedProgram compiled once and called
without Dynamo.

Under torch.compile every call first runs Dynamo's guards over the module's
state and gathers its parameters as graph inputs: about 1 ms of efficientnet_b0's
13.6 ms batch-1 forward (EPYC Zen 4, 1 thread), the same for every backend. An
ExportedProgram has its state lifted and its shapes fixed, so its graph is
compiled by the same pipeline (`backend.compile_graph`) and called directly with
the program's state tensors and the caller's inputs: the deployment path, as
AOTInductor is Inductor's. What Dynamo's guards would have caught is checked
here instead, in Python, for a few microseconds: input sizes, strides, dtypes
and devices, and the autocast state.
"""
from __future__ import annotations

import warnings
from typing import Any, List, Optional, Tuple

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from cpu_layout import backend, config

_STATE_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


def inference_decompositions():
    """Export's decomposition table cut to the CompositeImplicitAutograd ops
    (conv2d, linear, ...): that gives the graph aot_autograd gives the Dynamo
    path, functional ATen, which lower.py reads. Export's full default also
    decomposes batch-norm, silu, ... to core ATen ops, which would lower into
    many kernels instead of one fused conv post-op each."""
    table = torch.export.default_decompositions()
    for op in list(table.keys()):
        if not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
            del table[op]
    return table


def _autocast_state() -> Tuple[bool, Optional[torch.dtype]]:
    """(enabled, dtype) of CPU autocast; the dtype only matters when it is enabled."""
    if not torch._C._is_any_autocast_enabled():  # one cheap call on the common path
        return False, None
    enabled = torch.is_autocast_enabled("cpu")
    return enabled, torch.get_autocast_dtype("cpu") if enabled else None


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return repr(t)
    return f"size {tuple(t.shape)}, stride {t.stride()}, {t.dtype}, {t.device}"


def _unsupported(ep: ExportedProgram) -> Optional[str]:
    """Why `ep` cannot be compiled here, or None."""
    sig = ep.graph_signature
    for spec in sig.input_specs:
        if spec.kind not in _STATE_KINDS + (InputKind.USER_INPUT,):
            return f"an input of kind {spec.kind.name}"
    for spec in sig.output_specs:
        if spec.kind != OutputKind.USER_OUTPUT:
            return (f"an output of kind {spec.kind.name} (the program mutates its state or inputs; "
                    f"export the model in eval mode)")
    for node in ep.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt) or (
                isinstance(val, torch.Tensor) and not all(isinstance(d, int) for d in val.shape)):
            return "symbolic sizes (export with static shapes, or use torch.compile(dynamic=True))"
    return None


class CompiledExport:
    """Call it like `ep.module()`. Runs the program's graph on the backend's
    compiled code (or, after a fallback, as `ep.module()` does) with the state
    tensors the program holds: in-place changes to them are seen, as under
    torch.compile (see README, "Module state"); tensors swapped into the
    original module after export are not, as with `ep.module()`."""

    def __init__(self, ep: ExportedProgram, options: Optional[dict] = None):
        options = backend.check_options(options)
        self.exported = ep.run_decompositions(inference_decompositions())
        self._in_spec = self.exported.call_spec.in_spec
        self._out_spec = self.exported.call_spec.out_spec
        self._autocast = _autocast_state()
        sig = self.exported.graph_signature
        placeholders = [n for n in self.exported.graph.nodes if n.op == "placeholder"]
        # flat graph inputs: a state tensor, or None where the caller's next input goes
        self._flat: List[Optional[torch.Tensor]] = []
        self._expected: List[Any] = []  # per user input: its example (fake tensor or value)
        for spec, node in zip(sig.input_specs, placeholders):
            if spec.kind in _STATE_KINDS:
                self._flat.append(self._state_tensor(spec))
            else:
                self._flat.append(None)
                self._expected.append(node.meta.get("val"))
        self._user_pos = [i for i, t in enumerate(self._flat) if t is None]
        # What each tensor input must be, read once: `t.device` builds a device object
        # per call (16 us of a 4 ms forward once the forward has evicted its code).
        self._tensor_expect = [(tuple(v.shape), v.dtype, v.device.type == "cpu", tuple(v.stride()))
                               if isinstance(v, torch.Tensor) else None for v in self._expected]
        # One output, or a tuple of them: returned without tree_unflatten.
        spec = self._out_spec
        self._out_kind = ("leaf" if spec.is_leaf() else
                          "tuple" if spec.type is tuple and all(c.is_leaf() for c in spec.children()) else None)
        # Exported with positional tensors only (the usual `export(model, (x,))`): a
        # call with as many tensors needs no tree_flatten, whose recursive closure
        # leaves cyclic garbage on every call (and so wakes the collector over
        # everything export keeps alive: 0.2 s a full collection).
        self._positional = (all(isinstance(v, torch.Tensor) for v in self._expected)
                            and self._in_spec == pytree.tree_flatten((tuple(self._expected), {}))[1])
        # Set when the program runs as ep.module() (a warning said why).
        self._module: Optional[torch.nn.Module] = None
        reason = _unsupported(self.exported)
        if reason is None:
            example = list(self._flat)
            for i, val in zip(self._user_pos, self._expected):
                example[i] = (torch.empty_strided(tuple(val.shape), val.stride(), dtype=val.dtype).zero_()
                              if isinstance(val, torch.Tensor) else val)
            state = [i for i, t in enumerate(self._flat) if t is not None]
            with torch.no_grad():
                self._call = backend.compile_or_eager(
                    self.exported.graph_module, example, options, param_indices=state)
            # False: the graph runs eagerly (compile_or_eager warned why).
            self.compiled = hasattr(self._call, "cpu_layout_graph")
            if self.compiled:
                # Its traced graph (and every node's fake-tensor metadata) is not needed
                # by the compiled code: kept, it was most of what a compile leaves behind.
                self.exported = None
        else:
            if config.strict():
                raise backend.CompileError(f"cpu_layout: cannot compile this ExportedProgram: {reason}")
            warnings.warn(f"cpu_layout: running the ExportedProgram as ep.module(): it has {reason}",
                          RuntimeWarning, stacklevel=3)
            self.compiled = False
            self._module = self.exported.module()

    def compiled_graphs(self) -> list:
        """The backend's compiled graph (none after a fallback): what memory_stats reads."""
        return [self._call] if self.compiled else []

    def state_tensors(self) -> List[torch.Tensor]:
        """The program's parameters, buffers and constants, as its calls pass them."""
        return [t for t in self._flat if t is not None]

    def _state_tensor(self, spec) -> torch.Tensor:
        """Parameters and persistent buffers are in the state dict; constants and
        non-persistent buffers (never in a state dict) in `constants`."""
        ep = self.exported
        return ep.state_dict[spec.target] if spec.target in ep.state_dict else ep.constants[spec.target]

    def _check(self, flat_args) -> None:
        for i, (got, want, expect) in enumerate(zip(flat_args, self._expected, self._tensor_expect)):
            if expect is not None:
                shape, dtype, is_cpu, stride = expect
                if not (isinstance(got, torch.Tensor) and got.shape == shape and got.dtype == dtype
                        and got.is_cpu == is_cpu and got.stride() == stride):
                    raise ValueError(
                        f"cpu_layout: input {i} has {_describe(got)}; the program was compiled for "
                        f"{_describe(want)} (compile_exported compiles the exported shapes and "
                        f"strides: export again, or use torch.compile for other ones)")
                if got.requires_grad and torch.is_grad_enabled():
                    raise RuntimeError(f"cpu_layout: input {i} requires grad; a compiled "
                                       f"ExportedProgram is for inference (no autograd graph)")
            elif got != want:
                raise ValueError(f"cpu_layout: input {i} is {got!r}; the program was exported "
                                 f"with {want!r}")

    def __call__(self, *args, **kwargs):
        if self._module is not None:
            return self._module(*args, **kwargs)
        if _autocast_state() != self._autocast:
            raise RuntimeError(
                f"cpu_layout: compiled with CPU autocast (enabled, dtype) = {self._autocast}, called "
                f"with {_autocast_state()}: the exported graph has its casts built in; export and "
                f"compile under the autocast state you call it with")
        if (self._positional and not kwargs and len(args) == len(self._expected)
                and all(isinstance(a, torch.Tensor) for a in args)):
            flat_args = args  # the spec tree_flatten would give is the exported one
        else:
            if kwargs:
                from torch.export._tree_utils import reorder_kwargs

                kwargs = reorder_kwargs(kwargs, self._in_spec)
            flat_args, spec = pytree.tree_flatten((args, kwargs))
            if spec != self._in_spec:
                raise TypeError(f"cpu_layout: the program was exported with inputs {self._in_spec}, "
                                f"called with {spec}")
        self._check(flat_args)
        flat = list(self._flat)
        for pos, a in zip(self._user_pos, flat_args):
            flat[pos] = a
        if torch.is_grad_enabled():  # ATen ops in the graph would record autograd history
            with torch.no_grad():
                out = self._call(flat)
        else:
            out = self._call(flat)
        if self._out_kind == "leaf":
            return out[0]
        if self._out_kind == "tuple":
            return tuple(out)
        return pytree.tree_unflatten(list(out), self._out_spec)


def compile_exported(ep: ExportedProgram, options: Optional[dict] = None) -> CompiledExport:
    """Compile `ep` (from `torch.export.export(model.eval(), args)`) with the
    backend's pipeline; `options` as for torch.compile (`{"cpp_wrapper": True}`)."""
    if not isinstance(ep, ExportedProgram):
        raise TypeError(f"cpu_layout.compile_exported takes a torch.export.ExportedProgram, "
                        f"not {type(ep).__name__}")
    return CompiledExport(ep, options)
