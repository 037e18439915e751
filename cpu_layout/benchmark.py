"""Benchmark harness: compile a model with one backend, time it, check it.

Library only (no argparse); used by scripts/bench_models.py and
scripts/single_run.py.

    from cpu_layout import benchmark as B
    c = B.compile_model(model, "inductor_freezing", dtype="amp", dynamic=True,
                        wrapper="cpp", channels_last=False)
    x = c.prepare_input(x)            # cast / channels_last / mark_dynamic(x, 0)
    first_s = c.first_call(x)         # triggers compilation
    med_s = B.median_latency(c, x, warmup=3, iters=20, min_time=0.2)
    c.check_own_code()                # the timed calls ran this backend's compiled code

Backends
  eager              the model itself (no Dynamo)
  cpu_layout         this project, looked up through Dynamo's registry (entry point)
  inductor           default Inductor (torch._inductor.compile_fx, what backend="inductor" runs)
  inductor_freezing  Inductor with torch._inductor.config.freezing = True, set while
                     compiling and during the first call (options={"freezing": True} on
                     torch.compile does not freeze); with wrapper="cpp" also
                     torch._inductor.config.cpp_wrapper = True (Inductor's best CPU config).
                     All Inductor settings go through config.patch, so nothing leaks.
  openvino           OpenVINO's CPU plugin, outside Dynamo (OpenVINOCompiled): the fp32
                     model through ov.convert_model + ov.compile_model, called on numpy.
  openvino_dynamo    the same OpenVINO model called from a Dynamo backend under torch.compile
                     (_openvino_graph_runner): OpenVINO's compute plus torch.compile's per-call
                     share, which every backend pays.

INT8 (PT2E graphs from cpu_layout.zoo.quantize_pt2e): compile the quantized graph module
with any backend above at dtype "float32" (it takes and returns fp32 tensors; eager is
then the quantized graph run as is). compile_openvino_int8(fp32 model, calibration
batches) is OpenVINO INT8 (NNCF's nncf.quantize on the same batches). int8_check holds an
int8 output to the eager quantized graph's (relative RMS error against the fp32 model,
top-1 agreement) instead of PyTorch's float tolerances; run_accuracy_int8 is
run_accuracy with that check (scripts/single_run.py DT=int8).

Every compiled backend is wrapped in a distinct counting callable: Dynamo cannot
share cache entries between two configurations (torch.compile(backend="inductor")
with equal options would), and `check_own_code` proves that timed calls ran the
code this backend compiled (`compiles` counts backend invocations, `runs` counts
calls into the compiled graph).

Memory: what a compiled model holds between calls (`Compiled.held_bytes`:
cpu_layout.memory_stats, packed and derived weights, arenas, pools, scratch,
generated code; 0 for eager, which holds nothing beyond the module) plus the
peak of one call. That peak is measured with the PyTorch profiler's memory
events (profile_memory=True). torch has no CPU allocator statistics
(torch.cpu has no memory_allocated / max_memory_allocated in 2.13), every CPU
tensor allocation and free goes through c10's CPU allocator which reports to
the profiler, and summing those events gives the peak of bytes live during one
call, relative to the start of the call (tensors allocated by the run, output
included). tracemalloc does not see tensor storage, and RSS (/proc/self/statm,
resource.ru_maxrss) is not usable for comparing two runs in one process: the
allocator keeps freed pages and ru_maxrss never goes down. Not counted:
memory that a library allocates behind the allocator's back (oneDNN
scratchpads, stack buffers inside generated kernels).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import statistics
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

# Keep the profiler (used by peak_memory) from printing start/stop lines, as
# benchmarks/dynamo/common.py does. Must be set before kineto initialises.
os.environ.setdefault("KINETO_LOG_LEVEL", "5")

import torch  # noqa: E402

BACKENDS = ("eager", "cpu_layout", "cpu_layout_export", "inductor", "inductor_freezing", "openvino",
            "openvino_dynamo")
DTYPES = ("float32", "bfloat16", "amp")
WRAPPERS = ("default", "cpp")
STATUSES = ("pass", "fail_accuracy", "fail_to_run", "eager_two_runs_differ")

# --------------------------------------------------------------------------
# Tolerances, as PyTorch's benchmark harness uses them for inference.
# Source: pytorch/pytorch benchmarks/dynamo/torchbench.py,
# TorchBenchmarkRunner.get_tolerance_and_cosine_flag:
#     tolerance = 1e-4                       (float32)
#     if args.float16 or args.amp: 1e-3      (1e-2 for models in torchbench.yaml "higher_fp16")
#     if args.bfloat16: 1e-4                 (1e-2 for models in "higher_bf16")
# and benchmarks/dynamo/common.py, BenchmarkRunner.check_accuracy, which calls
# torch._dynamo.utils.same(correct_result, new_result, fp64_outputs, tol=tolerance):
# allclose(atol=rtol=tol) first; if that fails, the compiled result passes when
# RMSE(fp64_ref, res) <= multiplier * RMSE(fp64_ref, ref) + tol / 10, with
# multiplier 3 for bf16/fp16 results, tensors under 1000 elements and 1x1-spatial
# 4-D outputs, else 2. The two eager runs are compared with tol=0.
# The built-in models are in none of the "higher_*" lists.
# --------------------------------------------------------------------------
TOLERANCE = {"float32": 1e-4, "amp": 1e-3, "bfloat16": 1e-4}


def tolerance(dtype: str) -> float:
    return TOLERANCE[dtype]


class NotSupportedYet(RuntimeError):
    """A configuration the backend does not implement yet (e.g. cpu_layout's cpp wrapper)."""


class WrongCodeRan(AssertionError):
    """A timed function did not run the code its backend compiled."""


def one_line(name: str, exc: BaseException, limit: int = 300) -> str:
    """`name, ExceptionType: first line of the message` (no traceback)."""
    msg = str(exc).strip().splitlines()
    first = msg[0] if msg else ""
    # Dynamo wraps backend errors: "backend='x' raised:\nRealError: real message".
    for line in msg[1:]:
        line = line.strip()
        if first.startswith("backend=") and line and not line.startswith(("Set TORCH", "While executing")):
            first = f"{first} {line}"
            break
    if len(first) > limit:
        first = first[: limit - 3] + "..."
    return f"{name}, {type(exc).__name__}: {first}"


# --------------------------------------------------------------------------
# cpp wrapper support of the cpu_layout backend
# --------------------------------------------------------------------------
def cpp_wrapper_supported() -> Tuple[bool, str]:
    """Whether cpu_layout implements options={"cpp_wrapper": True} (the backend declares it)."""
    from cpu_layout import backend as clb

    if clb.CPP_WRAPPER_IMPLEMENTED:
        return True, ""
    return False, "cpu_layout's C++ wrapper mode is not supported yet"


def cpp_not_supported_message(reason: str = "") -> str:
    msg = "cpp wrapper mode (WRAPPER=cpp) is not supported yet by the cpu_layout backend"
    return f"{msg} ({reason})" if reason else msg


# --------------------------------------------------------------------------
# Preparing models and inputs
# --------------------------------------------------------------------------
def _cast(t, dtype: str):
    if dtype == "bfloat16" and isinstance(t, torch.Tensor) and t.is_floating_point():
        return t.to(torch.bfloat16)
    return t


def prepare_model(model: torch.nn.Module, dtype: str, channels_last: bool) -> torch.nn.Module:
    """A deep copy in eval mode, cast to bf16 for dtype=bfloat16, channels_last if asked."""
    m = copy.deepcopy(model).eval()
    if dtype == "bfloat16":
        m = m.to(torch.bfloat16)
    if channels_last:
        m = m.to(memory_format=torch.channels_last)
    return m


def as_args(x) -> tuple:
    """A model's positional inputs: one tensor, or a tuple of them (token ids, a mask...)."""
    return x if isinstance(x, tuple) else (x,)


def call_with(fn: Callable, x):
    """fn on the inputs `x` (as_args)."""
    return fn(*as_args(x))


def prepare_input(x, dtype: str, channels_last: bool, dynamic: bool):
    """Cast / convert (always a new tensor), and mark the batch dimension dynamic if
    asked; a tuple of inputs each alike (integer tensors are only copied)."""
    if isinstance(x, tuple):
        return tuple(prepare_input(t, dtype, channels_last, dynamic) for t in x)
    y = _cast(x, dtype)
    if channels_last and y.dim() == 4:
        y = y.contiguous(memory_format=torch.channels_last)
    else:
        y = y.clone()
    if dynamic:
        # --dynamic-batch-only: only dim 0 symbolic, torch.compile(dynamic=False) elsewhere.
        # Dynamo specialises sizes 0 and 1, so a batch of 1 can only be a hint.
        if y.shape[0] >= 2:
            torch._dynamo.mark_dynamic(y, 0)
        else:
            torch._dynamo.maybe_mark_dynamic(y, 0)
    return y


def _autocast(dtype: str):
    if dtype == "amp":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


# --------------------------------------------------------------------------
# Compiling
# --------------------------------------------------------------------------
def _inductor_patches(backend: str, wrapper: str) -> dict:
    patches: Dict[str, Any] = {}
    if backend == "inductor_freezing":
        patches["freezing"] = True
    if wrapper == "cpp":
        patches["cpp_wrapper"] = True
    return patches


@dataclasses.dataclass
class Compiled:
    """A model compiled (lazily: on the first call) for one configuration. Call it with a
    prepared input; it runs under torch.no_grad() (and autocast for amp)."""

    backend: str
    dtype: str
    dynamic: bool
    wrapper: str
    channels_last: bool
    model: torch.nn.Module
    fn: Callable
    compiles: int = 0          # backend invocations (graphs compiled)
    runs: int = 0              # calls into compiled graphs
    frozen: Optional[bool] = None  # inductor_freezing: did Inductor's freeze() run
    fallback_warnings: List[str] = dataclasses.field(default_factory=list)
    first_call_s: Optional[float] = None
    first_output: Any = None
    _patches: dict = dataclasses.field(default_factory=dict)
    _runs_mark: int = 0

    @property
    def label(self) -> str:
        extra = "+cpp" if self.wrapper == "cpp" and self.backend != "eager" else ""
        return self.backend + ("_cl" if self.channels_last else "") + extra

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        return prepare_input(x, self.dtype, self.channels_last, self.dynamic)

    def __call__(self, x):
        with torch.no_grad(), _autocast(self.dtype):
            return call_with(self.fn, x)

    def first_call(self, x) -> float:
        """Run the first call (compiles) and return its wall time in seconds."""
        ctx = contextlib.nullcontext()
        if self.backend.startswith("inductor"):
            import torch._inductor.config as ic

            ctx = ic.patch(self._patches)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            with ctx:
                out = self(x)
            self.first_call_s = time.perf_counter() - t0
        for w in caught:
            text = str(w.message)
            if text.startswith("cpu_layout"):
                self.fallback_warnings.append(text.splitlines()[0])
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        self.first_output = out
        if self.backend != "eager" and self.compiles == 0:
            raise WrongCodeRan(f"{self.label}: the first call did not invoke the backend "
                               f"(Dynamo served another configuration's cache entry?)")
        return self.first_call_s

    def held_bytes(self) -> int:
        """Bytes the compiled model keeps between calls beside the module's own state
        (cpu_layout.memory_stats' total); 0 for eager. Inductor's frozen and packed
        constants are not visible from here: also 0 (say so where it is printed)."""
        if not self.backend.startswith("cpu_layout"):
            return 0
        import cpu_layout

        return cpu_layout.memory_stats(self._held_target())["total"]

    def _held_target(self):
        return self.fn

    def mark(self) -> None:
        """Remember the run counter; check_own_code() checks calls made after this."""
        self._runs_mark = self.runs

    def check_own_code(self, expected_calls: Optional[int] = None) -> None:
        """Raise WrongCodeRan unless calls since mark() went into this backend's compiled code."""
        if self.backend == "eager":
            return
        done = self.runs - self._runs_mark
        if self.compiles < 1 or done < 1 or (expected_calls is not None and done < expected_calls):
            raise WrongCodeRan(
                f"{self.label}: {done} calls into its compiled code since mark() "
                f"(expected {expected_calls if expected_calls is not None else '>= 1'}), "
                f"{self.compiles} compiles: the timed function did not run its own compiled code")
        if self.backend == "inductor_freezing" and self.frozen is False:
            raise WrongCodeRan(f"{self.label}: Inductor's freeze() never ran: not a freezing build")


@dataclasses.dataclass
class OpenVINOCompiled(Compiled):
    """OpenVINO's CPU plugin, for comparison: on the first call
    ov.convert_model(fp32 model, example_input=x), its input fixed to x's shape (batch dim
    left dynamic if `dynamic`; the converter leaves every dim dynamic), then
    ov.compile_model(..., "CPU", {INFERENCE_PRECISION_HINT: f32, or bf16 for dtype amp /
    bfloat16, INFERENCE_NUM_THREADS: torch.get_num_threads()}). Input and weights stay
    fp32 in every dtype: the hint is how OpenVINO is asked for bf16. A call returns output
    0 as a torch tensor (contiguous fp32: OpenVINO has no strides and picks its own
    precision, so compare values only, in eager's dtype).

    torch.compile(backend="openvino") is not used: on torch 2.13 it fails while Dynamo
    creates guards (AssertionError: sources must not be empty for symbol s...)."""

    _ov_model: Any = None

    def prepare_input(self, x):
        if isinstance(x, tuple):
            return tuple(self.prepare_input(t) for t in x)
        # x.numpy() needs fp32 (integer inputs, token ids, stay as they are)
        return x.detach().to(torch.float32 if x.is_floating_point() else x.dtype).contiguous().clone()

    def __call__(self, x):
        if self._ov_model is None:
            self._ov_model = self._compile(x)
            self.compiles += 1
        self.runs += 1
        return torch.from_numpy(self._ov_model([t.numpy() for t in as_args(x)])[0])  # a fresh array per call

    def _compile(self, x: torch.Tensor, **extra):
        import openvino as ov

        # OpenVINO converts the fp32 graph: no autocast, which a caller (openvino_dynamo's
        # first call runs inside the autocast region) may have on
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            m = ov.convert_model(self.model, example_input=x)
        shapes = [[-1 if self.dynamic else t.shape[0], *t.shape[1:]] for t in as_args(x)]
        m.reshape({port: shape for port, shape in zip(m.inputs, shapes)})
        cfg = {"INFERENCE_PRECISION_HINT": "f32" if self.dtype == "float32" else "bf16",
               "INFERENCE_NUM_THREADS": torch.get_num_threads(), **extra}
        return ov.compile_model(m, "CPU", cfg)

    def layer_profile(self, x: torch.Tensor, iters: int = 20) -> Dict[str, float]:
        """Milliseconds per forward by OpenVINO layer type and kernel ("Convolution
        brgconv_avx512_1x1_f32"), from its own counters (PERF_COUNT), on a model
        compiled for it: counting costs time, so the timed one never counts."""
        req = self._compile(x, PERF_COUNT=True).create_infer_request()
        xn = [t.numpy() for t in as_args(self.prepare_input(x))]
        for _ in range(3):
            req.infer(xn)
        per: Dict[str, float] = {}
        for _ in range(iters):
            req.infer(xn)
            for p in req.profiling_info:
                key = f"{p.node_type} {p.exec_type}"
                per[key] = per.get(key, 0.0) + p.real_time.total_seconds() * 1e3 / iters
        return {k: v for k, v in per.items() if v > 0}


def _require(module: str, what: str) -> None:
    """NotSupportedYet(what) when `module` does not import (missing, or its native
    libraries do not load)."""
    import importlib

    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001
        raise NotSupportedYet(f"{what} ({type(exc).__name__}: {exc})") from exc


def _openvino(model: torch.nn.Module, dtype: str, dynamic: bool) -> OpenVINOCompiled:
    _require("openvino", "openvino is not importable")
    m = prepare_model(model, "float32", False)
    return OpenVINOCompiled("openvino", dtype, dynamic, "default", False, m, fn=m)


@dataclasses.dataclass
class OpenVINOInt8Compiled(OpenVINOCompiled):
    """OpenVINO INT8 as its users make it, for comparison with PT2E int8 graphs: on the
    first call ov.convert_model(fp32 model, example_input=x), input fixed to x's shape,
    nncf.quantize(ov_model, nncf.Dataset(calibration batches as numpy arrays)) with
    NNCF's defaults (its CPU preset, fast bias correction), then ov.compile_model(...,
    "CPU", {INFERENCE_PRECISION_HINT: f32, INFERENCE_NUM_THREADS}): f32 for what stays
    unquantized, as in the PT2E graph. `int8_layers` counts the convolutions and
    fully-connected layers of the compiled model that run in u8/i8 (0: not quantized)."""

    calibration: List[torch.Tensor] = dataclasses.field(default_factory=list)
    int8_layers: int = 0

    def _compile(self, x: torch.Tensor, **extra):
        import sys

        import nncf
        import openvino as ov

        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            m = ov.convert_model(self.model, example_input=x)
        m.reshape(list(x.shape))
        data = nncf.Dataset([c.detach().to(torch.float32).contiguous().numpy()
                             for c in self.calibration])
        with contextlib.redirect_stdout(sys.stderr):  # NNCF's progress bars: keep stdout a table
            q = nncf.quantize(m, data, subset_size=len(self.calibration))
        cfg = {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": torch.get_num_threads(),
               **extra}
        compiled = ov.compile_model(q, "CPU", cfg)
        self.int8_layers = _openvino_int8_layers(compiled)
        return compiled


def _openvino_int8_layers(compiled) -> int:
    n = 0
    for op in compiled.get_runtime_model().get_ops():
        info = op.get_rt_info()
        if "layerType" not in info or "runtimePrecision" not in info:
            continue
        if (info["layerType"].astype(str) in ("Convolution", "FullyConnected", "MatMul")
                and info["runtimePrecision"].astype(str) in ("u8", "i8")):
            n += 1
    return n


def compile_openvino_int8(model: torch.nn.Module, calibration: Sequence[torch.Tensor]
                          ) -> OpenVINOInt8Compiled:
    """OpenVINO INT8 (NNCF post-training quantization of the fp32 `model` on the
    `calibration` batches, each shaped like the input it will run): see
    OpenVINOInt8Compiled. Static shapes. NotSupportedYet when openvino or nncf
    does not import."""
    _require("openvino", "openvino is not importable")
    _require("nncf", "OpenVINO INT8 needs nncf (pip install nncf)")
    if not calibration:
        raise ValueError("compile_openvino_int8 needs calibration batches")
    m = prepare_model(model, "float32", False)
    return OpenVINOInt8Compiled("openvino", "float32", False, "default", False, m, fn=m,
                                calibration=list(calibration))


def _openvino_graph_runner(model: torch.nn.Module, dtype: str):
    """The `openvino_dynamo` backend: ignores Dynamo's graph and runs OpenVINO's
    compiled model (openvino) on the graph's one user input. A call pays what
    torch.compile adds to any backend (guard evaluation over the module's state,
    gathering the parameters as graph inputs: about 1 ms of regnet_y_800mf's 13 ms
    at batch 1, 1 thread, Sapphire Rapids-class Xeon) around the same OpenVINO
    compute: the like-for-like peer of cpu_layout through torch.compile, as
    `openvino` is of compile_exported."""
    ov_c = _openvino(model, dtype, False)
    state = {id(t) for t in model.state_dict(keep_vars=True).values()}

    def inner(gm, example_inputs):
        user = [i for i, t in enumerate(example_inputs) if id(t) not in state]
        if len(user) != 1 or len(gm.graph.output_node().args[0]) != 1:
            raise NotSupportedYet(f"openvino_dynamo: a graph with {len(user)} user inputs "
                                  f"(one input, one output only)")
        pos = user[0]
        return lambda *flat: (ov_c(flat[pos]),)
    return inner


@dataclasses.dataclass
class ExportedCompiled(Compiled):
    """cpu_layout through `cpu_layout.compile_exported`: on the first call
    torch.export.export(model, (x,)) under no_grad and the dtype's autocast, then
    compile_exported; calls skip Dynamo. Static shapes only."""

    options: dict = dataclasses.field(default_factory=dict)
    _compiled: Any = None

    def __call__(self, x):
        with torch.no_grad(), _autocast(self.dtype):
            if self._compiled is None:
                self._compile(x)
            self.runs += 1
            return call_with(self._compiled, x)

    def _held_target(self):
        return self._compiled

    def _compile(self, x) -> None:
        from cpu_layout.exported import compile_exported

        ep = torch.export.export(self.model, as_args(x))
        self._compiled = compile_exported(ep, _cpu_layout_options(self.options, self.wrapper))
        self.compiles += 1


def _cpu_layout_options(options: Optional[dict], wrapper: str) -> dict:
    """The backend's options for a variant: the caller's, plus the C++ wrapper when asked."""
    return {**(options or {}), **({"cpp_wrapper": True} if wrapper == "cpp" else {})}


def _exported(model, dtype, dynamic, wrapper, channels_last, options) -> ExportedCompiled:
    if dynamic:
        raise NotSupportedYet("cpu_layout.compile_exported compiles static shapes")
    m = prepare_model(model, dtype, channels_last)
    return ExportedCompiled("cpu_layout_export", dtype, dynamic, wrapper, channels_last, m, fn=m,
                            options=dict(options or {}))


def _backend_callable(c: Compiled, backend: str, wrapper: str, options: Optional[dict]):
    """The compiler Dynamo calls: counts compiles, wraps the result to count runs."""
    if backend == "openvino_dynamo":
        inner = _openvino_graph_runner(c.model, c.dtype)
    elif backend == "cpu_layout":
        inner_backend = torch._dynamo.lookup_backend("cpu_layout")  # the entry point
        opts = _cpu_layout_options(options, wrapper)

        def inner(gm, example_inputs):
            if opts:
                return inner_backend(gm, example_inputs, options=opts)
            return inner_backend(gm, example_inputs)
    else:
        from torch._inductor.compile_fx import compile_fx
        import torch._inductor.config as ic
        patches = dict(c._patches)

        def inner(gm, example_inputs):
            with ic.patch(patches):
                if backend != "inductor_freezing":
                    return compile_fx(gm, example_inputs)
                try:
                    import torch._inductor.freezing as fz
                except ImportError:  # pragma: no cover
                    return compile_fx(gm, example_inputs)
                real = fz.freeze

                def spy(*a, **k):
                    c.frozen = True
                    return real(*a, **k)

                fz.freeze = spy
                if c.frozen is None:
                    c.frozen = False
                try:
                    return compile_fx(gm, example_inputs)
                finally:
                    fz.freeze = real

    def counted_backend(gm, example_inputs, **kwargs):
        c.compiles += 1
        compiled = inner(gm, example_inputs)

        # Dynamo calls what a backend returns with positional arguments.
        def run(*args):
            c.runs += 1
            return compiled(*args)
        return run

    counted_backend.__name__ = f"counted_{backend}"
    return counted_backend


def compile_model(model: torch.nn.Module, backend: str, dtype: str = "float32",
                  dynamic: bool = False, wrapper: str = "default", channels_last: bool = False,
                  *, options: Optional[dict] = None, reset: bool = True,
                  guard_filter_fn: Optional[Callable] = None) -> Compiled:
    """Prepare (copy, cast, channels_last) and torch.compile `model` for one configuration.

    Compilation is lazy: call `.first_call(x)` with `.prepare_input(x)`. With reset=True
    (default) Dynamo's caches are reset first, so a previous configuration cannot be
    served. Pass reset=False only to keep several backends of ONE configuration alive
    together (each has its own counting backend, so their cache entries stay apart).
    Raises ValueError for bad arguments, NotSupportedYet for cpu_layout + wrapper="cpp"
    while the backend does not implement it, and for openvino when it does not import.
    backend="openvino" ignores wrapper, channels_last and options (OpenVINOCompiled).
    guard_filter_fn: torch.compile's own option (which Dynamo guards to keep), for
    the torch.compile'd backends; the exported entry and OpenVINO have no guards.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    if wrapper not in WRAPPERS:
        raise ValueError(f"unknown wrapper {wrapper!r}; choose from {', '.join(WRAPPERS)}")
    if backend.startswith("cpu_layout") and wrapper == "cpp":
        ok, reason = cpp_wrapper_supported()
        if not ok:
            raise NotSupportedYet(cpp_not_supported_message(reason))
    if backend == "openvino":
        return _openvino(model, dtype, dynamic)
    if backend == "openvino_dynamo" and (dynamic or dtype == "bfloat16"):
        raise NotSupportedYet("openvino_dynamo: static shapes, float32 or amp input (OpenVINO "
                              "reads fp32 numpy arrays)")
    if backend == "cpu_layout_export":
        return _exported(model, dtype, dynamic, wrapper, channels_last, options)
    m = prepare_model(model, dtype, channels_last)
    c = Compiled(backend, dtype, dynamic, wrapper, channels_last, m, fn=m)
    if backend == "eager":
        return c
    if reset:
        torch._dynamo.reset()
    if backend.startswith("inductor"):
        c._patches = _inductor_patches(backend, wrapper)
    c.fn = torch.compile(m, backend=_backend_callable(c, backend, wrapper, options), dynamic=False,
                         options={"guard_filter_fn": guard_filter_fn} if guard_filter_fn else None)
    return c


# --------------------------------------------------------------------------
# Timing and memory
# --------------------------------------------------------------------------
def median_latency(fn: Callable, x, warmup: int = 3, iters: int = 20, min_time: float = 0.0) -> float:
    """Median seconds per call of fn(x): `warmup` untimed calls, then at least `iters`
    timed calls and at least `min_time` seconds of them."""
    for _ in range(warmup):
        fn(x)
    samples: List[float] = []
    start = time.perf_counter()
    while len(samples) < iters or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn(x)
        samples.append(time.perf_counter() - t0)
        if len(samples) > 100 * max(iters, 1):  # min_time on a very fast fn: enough
            break
    return statistics.median(samples)


def interleaved_medians(fns: Dict[str, Tuple[Callable, Any]], rounds: int = 5, iters: int = 10,
                        warmup: int = 2, before: Optional[Dict[str, Callable[[], Any]]] = None
                        ) -> Dict[str, float]:
    """Median seconds per call for several functions timed in alternating rounds
    (fn A x iters, fn B x iters, ..., repeated `rounds` times), so drift on a shared
    machine hits all of them alike. fns: label -> (fn, input); before: label -> a
    call made before each of that label's rounds (process state a variant needs)."""
    before = before or {}
    for k, (fn, x) in fns.items():
        if k in before:
            before[k]()
        for _ in range(warmup):
            fn(x)
    samples: Dict[str, List[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, (fn, x) in fns.items():
            if k in before:
                before[k]()
            for _ in range(iters):
                t0 = time.perf_counter()
                fn(x)
                samples[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


@contextlib.contextmanager
def _quiet_fd2():
    """Silence file descriptor 2 (kineto prints profiler_start/stop lines from C++ that
    KINETO_LOG_LEVEL does not cover). Only wraps a call that has already run fine."""
    import sys

    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def peak_memory(fn: Callable, x) -> int:
    """Peak bytes allocated (and not yet freed) through c10's CPU allocator during one
    call fn(x), measured from the profiler's memory events (see the module docstring)."""
    return allocations(fn, x)[0]


def allocations(fn: Callable, x):
    """(peak bytes, bytes still held after, number of allocations) through c10's CPU
    allocator during one call fn(x), its result dropped (profiler memory events)."""
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings(), _quiet_fd2():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = fn(x)
            del out
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    cur = peak = count = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
        count += e.nbytes() > 0
    return peak, cur, count


# --------------------------------------------------------------------------
# Accuracy
# --------------------------------------------------------------------------
def _flatten(out) -> List[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for k in sorted(out) for t in _flatten(out[k])]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _flatten(o)]
    return []


def _same(ref, res, fp64_ref, tol: float) -> bool:
    from torch._dynamo.utils import same

    return bool(same(ref, res, fp64_ref, tol=tol, equal_nan=True, log_error=lambda *a, **k: None))


def values_match(ref, res, fp64_ref, dtype: str) -> bool:
    """PyTorch's benchmark accuracy check (torch._dynamo.utils.same, TOLERANCE[dtype])."""
    try:
        return _same(ref, res, fp64_ref, tolerance(dtype))
    except Exception:  # noqa: BLE001 - allclose can raise on mismatched shapes/dtypes
        return False


def bitwise_equal(a, b) -> bool:
    try:
        return _same(a, b, None, 0.0)
    except Exception:  # noqa: BLE001
        return False


def _stride_key(t: torch.Tensor):
    # Strides of size-1 dimensions are meaningless; compare the others.
    return tuple((s, st) for s, st in zip(t.shape, t.stride()) if s != 1)


def strides_match(ref, res) -> bool:
    a, b = _flatten(ref), _flatten(res)
    return len(a) == len(b) and all(
        x.shape == y.shape and _stride_key(x) == _stride_key(y) for x, y in zip(a, b))


def stride_report(ref, res) -> str:
    a, b = _flatten(ref), _flatten(res)
    return "; ".join(f"output {i}: eager {tuple(x.stride())} vs compiled {tuple(y.stride())} "
                     f"(size {tuple(x.shape)})"
                     for i, (x, y) in enumerate(zip(a, b)) if _stride_key(x) != _stride_key(y))


def fp64_reference(model: torch.nn.Module, x):
    """Eager float64 outputs (the harness's golden reference for RMSE)."""
    m = copy.deepcopy(model).eval().to(torch.float64)
    with torch.no_grad():
        out = call_with(m, _to64(x.detach() if isinstance(x, torch.Tensor) else x))
    return _to64(out)


def _to64(out):
    if isinstance(out, torch.Tensor):
        return out.to(torch.float64) if out.is_floating_point() else out
    if isinstance(out, (list, tuple)):
        return type(out)(_to64(o) for o in out)
    if isinstance(out, dict):
        return {k: _to64(v) for k, v in out.items()}
    return out


def dynamo_stats() -> Dict[str, int]:
    """calls_captured, unique_graphs, graph_breaks as benchmarks/dynamo/common.py's
    get_dynamo_stats reads them from torch._dynamo.utils.counters."""
    from torch._dynamo.utils import counters

    return {
        "calls_captured": int(counters["stats"]["calls_captured"]),
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }


@dataclasses.dataclass
class AccuracyResult:
    status: str
    reason: str = ""
    calls_captured: int = 0
    unique_graphs: int = 0
    graph_breaks: int = 0
    strides_ok: Optional[bool] = None
    warnings: List[str] = dataclasses.field(default_factory=list)


def _eager_then_compiled(name, model, x, backend, dtype, dynamic, wrapper, channels_last):
    """Two eager runs in the configuration's dtype (bitwise equal, tol=0), then one compiled
    run checked to be the backend's own code: (eager output, compiled output, compiled
    model, Dynamo's counters), or the AccuracyResult of what failed. NotSupportedYet
    propagates."""
    eager = compile_model(model, "eager", dtype, False, "default", channels_last)
    xe = eager.prepare_input(x)
    try:
        ref1 = eager(xe)
        ref2 = eager(eager.prepare_input(x))
    except Exception as exc:  # noqa: BLE001
        return AccuracyResult("fail_to_run", one_line(name, exc))
    if not bitwise_equal(ref1, ref2):
        return AccuracyResult("eager_two_runs_differ", f"{name}, eager outputs of two runs differ")
    del ref2
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    try:
        c = compile_model(model, backend, dtype, dynamic, wrapper, channels_last)
        xc = c.prepare_input(x)
        c.first_call(xc)
        c.mark()
        res = c(xc)
        c.check_own_code(1)
    except NotSupportedYet:
        raise
    except Exception as exc:  # noqa: BLE001
        return AccuracyResult("fail_to_run", one_line(name, exc), **dynamo_stats())
    return ref1, res, c, dynamo_stats()


def run_accuracy(name: str, model: torch.nn.Module, x: torch.Tensor, backend: str,
                 dtype: str = "float32", dynamic: bool = False, wrapper: str = "default",
                 channels_last: bool = False) -> AccuracyResult:
    """benchmarks/dynamo/common.py check_accuracy, for inference: fp64 golden outputs,
    two eager runs (tol=0) in the configuration's dtype, then the compiled run compared
    with same(eager, compiled, fp64, tol). NotSupportedYet propagates."""
    try:
        fp64 = fp64_reference(model, x)
    except Exception:  # noqa: BLE001 - the harness falls back to cosine; we keep allclose
        fp64 = None
    got = _eager_then_compiled(name, model, x, backend, dtype, dynamic, wrapper, channels_last)
    if isinstance(got, AccuracyResult):
        return got
    ref1, res, c, stats = got
    ok = values_match(ref1, res, fp64, dtype)
    s_ok = strides_match(ref1, res)
    r = AccuracyResult("pass" if ok else "fail_accuracy", "", strides_ok=s_ok,
                       warnings=list(c.fallback_warnings), **stats)
    if not ok:
        r.reason = f"{name}, AccuracyError: {describe_error(ref1, res, fp64, dtype)}"
    return r


# --------------------------------------------------------------------------
# INT8 accuracy: against the quantized graph run eagerly, not against fp64
# (an int8 result may sit one quantization step from eager's where a value lands
# on a rounding boundary, so PyTorch's float tolerances do not apply)
# --------------------------------------------------------------------------
INT8_RMS_FACTOR = 1.1      # rel. RMS error against fp32: at most this times eager-quantized's
INT8_TOP1 = 0.99           # top-1 agreement with eager-quantized: at least this fraction of rows
INT8_RMS_FLOOR = 0.5       # ... and at least this times eager-quantized's (else: not int8)


def quantize_nodes(module: torch.nn.Module) -> int:
    """quantized_decomposed calls in a graph module (0: not a PT2E-quantized graph)."""
    graph = getattr(module, "graph", None)
    if graph is None:
        return 0
    return sum(1 for n in graph.nodes
               if n.op == "call_function" and "quantized_decomposed" in str(n.target))


def rel_rms(y, ref) -> float:
    """RMS(y - ref) / RMS(ref) over all outputs (flattened, in float64)."""
    a, b = _flatten(y), _flatten(ref)
    num = sum(float((p.double() - q.double()).pow(2).sum()) for p, q in zip(a, b))
    den = sum(float(q.double().pow(2).sum()) for q in b)
    return math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)


def top1_agreement(y, ref) -> Optional[float]:
    """Fraction of positions whose argmax over dim 1 (the classes of [N, C, ...] logits)
    is the same in `y` and `ref`; None when no output has two dims."""
    same = total = 0
    for p, q in zip(_flatten(y), _flatten(ref)):
        if p.dim() < 2 or p.shape != q.shape or p.numel() == 0:
            continue
        eq = p.float().argmax(1) == q.float().argmax(1)
        same += int(eq.sum())
        total += eq.numel()
    return same / total if total else None


def int8_check(out, eager_q, fp32, against: str = "eager_q") -> Tuple[bool, str, Dict[str, Any]]:
    """(ok, reason, numbers) for one int8 variant's output `out`, given the quantized
    graph's eager output `eager_q` and the fp32 model's output `fp32`.

    against="eager_q" (a backend running the same quantized graph): rel. RMS error
    against fp32 at most INT8_RMS_FACTOR times eager_q's, top-1 agreement with eager_q
    on at least INT8_TOP1 of the rows, and that error at least INT8_RMS_FLOOR times
    eager_q's (the same quantization cannot be much more accurate: an output near fp32
    means an fp32 model was measured in the quantized graph's place; deep models'
    compiled int8 outputs sit about half the quantization error from eager_q's, one
    rounding step flipping here and there, so nearness to eager_q cannot tell).
    against="fp32" (another quantizer, OpenVINO's NNCF): the same RMS bound, and top-1
    agreement with fp32 no lower than eager_q's own."""
    a, b, c = _flatten(out), _flatten(eager_q), _flatten(fp32)
    if [tuple(t.shape) for t in a] != [tuple(t.shape) for t in b] or len(b) != len(c):
        return False, (f"output sizes {[tuple(t.shape) for t in a]}, eager-quantized "
                       f"{[tuple(t.shape) for t in b]}"), {}
    a = [t.to(q.dtype) for t, q in zip(a, b)]
    nums: Dict[str, Any] = {"rms": rel_rms(a, c), "rms_eager_q": rel_rms(b, c),
                            "rms_vs_q": rel_rms(a, b), "fp32_vs_q": rel_rms(c, b),
                            "top1_fp32": top1_agreement(a, c)}
    bound = INT8_RMS_FACTOR * nums["rms_eager_q"] + 1e-6
    why = []
    if not nums["rms"] <= bound:
        why.append(f"rel. RMS error vs fp32 {nums['rms']:.4g} > {INT8_RMS_FACTOR} x "
                   f"eager-quantized's {nums['rms_eager_q']:.4g}")
    if against == "eager_q":
        nums["top1"] = top1_agreement(a, b)
        if nums["top1"] is not None and nums["top1"] < INT8_TOP1:
            why.append(f"top-1 agreement with eager-quantized {nums['top1']:.3f} < {INT8_TOP1}")
        if nums["rms"] < INT8_RMS_FLOOR * nums["rms_eager_q"]:
            why.append(f"rel. RMS error vs fp32 {nums['rms']:.4g} < {INT8_RMS_FLOOR} x eager-quantized's "
                       f"{nums['rms_eager_q']:.4g}: more accurate than its quantization allows, "
                       f"an fp32 model computed in its place?")
    else:
        nums["top1"] = top1_agreement(a, c)
        nums["top1_eager_q"] = top1_agreement(b, c)
        if nums["top1"] is not None and nums["top1"] < nums["top1_eager_q"]:
            why.append(f"top-1 agreement with fp32 {nums['top1']:.3f} < eager-quantized's "
                       f"{nums['top1_eager_q']:.3f}")
    return not why, "; ".join(why), nums


def run_accuracy_int8(name: str, fp32_model: torch.nn.Module, qmodel: torch.nn.Module,
                      x: torch.Tensor, backend: str, dynamic: bool = False,
                      wrapper: str = "default", channels_last: bool = False) -> AccuracyResult:
    """run_accuracy for `qmodel`, a PT2E-quantized graph of `fp32_model` (zoo.quantize_pt2e):
    two eager runs of the quantized graph (tol=0), then the compiled quantized graph
    checked with int8_check against the eager one (rel. RMS error against
    `fp32_model`'s output, top-1 agreement). NotSupportedYet propagates."""
    try:
        with torch.no_grad():
            fp32 = fp32_model(x)
    except Exception as exc:  # noqa: BLE001
        return AccuracyResult("fail_to_run", one_line(name, exc))
    got = _eager_then_compiled(name, qmodel, x, backend, "float32", dynamic, wrapper, channels_last)
    if isinstance(got, AccuracyResult):
        return got
    ref1, res, c, stats = got
    ok, why, _ = int8_check(res, ref1, fp32)
    r = AccuracyResult("pass" if ok else "fail_accuracy", "", strides_ok=strides_match(ref1, res),
                       warnings=list(c.fallback_warnings), **stats)
    if not ok:
        r.reason = f"{name}, AccuracyError (int8): {why}"
    return r


def describe_error(ref, res, fp64, dtype: str) -> str:
    a, b = _flatten(ref), _flatten(res)
    if len(a) != len(b):
        return f"{len(b)} outputs, eager has {len(a)}"
    parts = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape or x.dtype != y.dtype:
            parts.append(f"output {i}: {tuple(y.shape)} {y.dtype} vs eager {tuple(x.shape)} {x.dtype}")
            continue
        d = (x.double() - y.double()).abs().max().item() if x.numel() else 0.0
        parts.append(f"output {i}: max abs diff {d:.3g}")
    return "; ".join(parts) + f" (tol {tolerance(dtype)})"


# --------------------------------------------------------------------------
# Performance
# --------------------------------------------------------------------------
@dataclasses.dataclass
class PerfResult:
    status: str                 # "pass" or "fail_to_run"
    reason: str = ""
    speedup: float = 0.0        # median eager / median compiled
    abs_latency_ms: float = 0.0  # median compiled, ms
    eager_latency_ms: float = 0.0
    compile_s: float = 0.0      # first call - median call
    compression_ratio: float = 0.0  # eager peak / compiled peak (held between calls + one call's)
    eager_peak_bytes: int = 0
    compiled_peak_bytes: int = 0
    calls_captured: int = 0
    unique_graphs: int = 0
    graph_breaks: int = 0
    warnings: List[str] = dataclasses.field(default_factory=list)


def run_performance(name: str, model: torch.nn.Module, x: torch.Tensor, backend: str,
                    dtype: str = "float32", dynamic: bool = False, wrapper: str = "default",
                    channels_last: bool = False, warmup: int = 3, iters: int = 20,
                    rounds: int = 5) -> PerfResult:
    """Compile, then time eager and compiled in interleaved rounds; peak memory of one
    call each. NotSupportedYet propagates; other failures become fail_to_run."""
    from torch._dynamo.utils import counters

    eager = compile_model(model, "eager", dtype, False, "default", channels_last)
    xe = eager.prepare_input(x)
    try:
        eager(xe)
    except Exception as exc:  # noqa: BLE001
        return PerfResult("fail_to_run", one_line(name, exc))
    torch._dynamo.reset()
    counters.clear()
    try:
        c = compile_model(model, backend, dtype, dynamic, wrapper, channels_last)
        xc = c.prepare_input(x)
        first = c.first_call(xc)
        c.mark()
        per_round = max(1, iters // max(rounds, 1))
        med = interleaved_medians({"eager": (eager, xe), "compiled": (c, xc)},
                                  rounds=rounds, iters=per_round, warmup=warmup)
        c.check_own_code((warmup + rounds * per_round) if backend != "eager" else None)
        ep, cp = peak_memory(eager, xe), peak_memory(c, xc) + c.held_bytes()
    except NotSupportedYet:
        raise
    except Exception as exc:  # noqa: BLE001
        return PerfResult("fail_to_run", one_line(name, exc), **dynamo_stats())
    return PerfResult(
        "pass", "", speedup=med["eager"] / med["compiled"], abs_latency_ms=med["compiled"] * 1e3,
        eager_latency_ms=med["eager"] * 1e3, compile_s=max(first - med["compiled"], 0.0),
        compression_ratio=(ep / cp) if cp else 0.0, eager_peak_bytes=ep, compiled_peak_bytes=cp,
        warnings=list(c.fallback_warnings), **dynamo_stats())


def geomean(xs: Sequence[float]) -> float:
    import math

    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")
