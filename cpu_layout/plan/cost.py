"""Cost model: estimated microseconds for a conv in each layout and for a layout copy.

Conv costs come from a measured table (cpu_layout/data/conv_cost_table.json,
built by scripts/build_cost_table.py): the nearest measured shape class of the
same dtype and group kind gives the NCHW and NHWC times, scaled by the FLOP
ratio.  When the table has no class close enough (or no table), heuristics
decide.  Copies cost bytes x measured µs/byte.  Everything is in µs so conv
and copy costs add up in one objective.

Sizes may be symbolic: costs use size hints (`layout.hint`), never guards.

One table per oneDNN ISA (`conv_cost_table_<isa>.json`): relative NCHW/NHWC
costs differ between AVX2 and AVX-512/AMX kernels, so the planner uses the
table measured on this CPU's ISA, else one of the same family (avx512*), else
heuristics alone.
"""
from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from cpu_layout.layout import CHANNELS_LAST, hint
from cpu_layout.plan.graph import Conv

__all__ = ["ConvCost", "CostModel", "TABLE_PATH"]

DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")


def cpu_isa() -> str:
    """The ISA oneDNN dispatches to on this CPU (avx2, avx512_core, ..., avx512_core_amx)."""
    try:
        from cpu_layout import _native

        return _native.cpu_isa()
    except ImportError:  # planning without the extension (its tests): read the CPU flags
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith("flags")), "").split()
        return "avx512_core" if "avx512f" in flags else "avx2" if "avx2" in flags else "other"


def _family(isa: str) -> str:
    return "avx512" if isa.startswith("avx512") else isa


def table_path_for(isa: str, directory: str = DATA_DIR) -> Optional[str]:
    """The shipped table measured on `isa`, else one of its family, else None."""
    found = {}
    for path in sorted(glob.glob(os.path.join(directory, "conv_cost_table_*.json"))):
        found[os.path.basename(path)[len("conv_cost_table_"):-len(".json")]] = path
    if isa in found:
        return found[isa]
    same = [k for k in found if _family(k) == _family(isa)]
    return found[max(same)] if same else None


TABLE_PATH = table_path_for(cpu_isa()) or table_path_for("avx2")

# A table class further than this (sum of |log2| feature differences) is not
# trusted: heuristics decide instead.
MAX_DISTANCE = 4.0
# Fallbacks when nothing is measured: single-core throughput and copy speed.
_GFLOPS = {torch.float32: 40.0, torch.bfloat16: 10.0}
_COPY_US_PER_BYTE = 0.0003  # ~3 GB/s for a transposing copy on one core


@dataclass(frozen=True)
class ConvCost:
    nchw_us: float
    nhwc_us: float
    source: str  # "table: <class>" or "heuristic: <rule>"
    # What runs the conv in NHWC at nhwc_us: "onednn" (ours) or "aten" (torch's bundled oneDNN),
    # and for ours which of oneDNN's implementations (ops.conv2d's impl_rank).
    nhwc_impl: str = "onednn"
    nhwc_rank: int = 0

    def of(self, label: str) -> float:
        return self.nhwc_us if label == CHANNELS_LAST else self.nchw_us


def _group_kind(groups: int, cin: int) -> str:
    if groups == 1:
        return "regular"
    return "depthwise" if groups == cin else "grouped"


def _flops(batch, cin, cout, groups, kernel: Tuple[int, ...], out_spatial: Tuple[int, ...]) -> float:
    f = 2.0 * batch * cout * (cin / groups)
    for k in kernel:
        f *= k
    for s in out_spatial:
        f *= s
    return max(f, 1.0)


# Modelled constants for the prediction (other_cost): a call's fixed cost, and a
# matmul's FLOP rate per thread (ATen's oneDNN/MKL sgemm, Sapphire Rapids fp32).
_CALL_US = 3.0
_MATMUL_GFLOPS = 60.0
# A kernel streams its operands in their own order; the copy rate is a layout
# conversion's (a transposition). densenet121's BN-ReLU kernels and concats ran at
# 0.4x of what the copy rate predicts (Sapphire Rapids, fp32, 1 thread).
_STREAM_VS_COPY = 0.4
# ns per element of an op that calls vector math, per thread: libmvec's expf over
# 144x56x56 floats took 146 us (0.32 ns/element, EPYC Zen 4, 1 thread), and
# efficientnet_b0's SiLU passes ran at 0.3 ns/element beyond their memory traffic
# (Sapphire Rapids, 1 thread).
_VECTOR_MATH_NS = 0.3

def _threads() -> int:
    """The threads a conv, kernel or copy runs on: every measured or modelled
    one-thread cost is spread over them."""
    return max(1, torch.get_num_threads())


# ns per (output element x window element) of pooling, (NCHW: ATen, NHWC: ours).
_POOL_NS = {"max": (3.2, 0.12), "avg": (1.0, 0.12)}


class CostModel:
    """Conv and copy costs in µs. `table` is the parsed JSON (or None: heuristics only)."""

    def __init__(self, table: Optional[dict] = None):
        self.table = table
        self.entries: List[dict] = list(table["entries"]) if table else []
        self._copy = dict(table.get("copy_us_per_byte", {})) if table else {}
        self._memo: Dict[tuple, ConvCost] = {}
        self._table_threads = int(table.get("threads", 1)) if table else 1
        for e in self.entries:
            k, s = e["kernel"], e["stride"]
            o = (e["spatial"] + 2 * (k // 2) - k) // s + 1
            e["_flops"] = _flops(e["batch"], e["cin"], e["cout"], e["groups"], (k, k), (o, o))
            e["_kind"] = _group_kind(e["groups"], e["cin"])

    @classmethod
    def load(cls, path: Optional[str] = None) -> "CostModel":
        """The table at `path`, by default the one for this CPU's ISA (heuristics if none)."""
        path = path or table_path_for(cpu_isa())
        if path is None:
            return cls(None)
        try:
            with open(path) as f:
                return cls(json.load(f))
        except (OSError, ValueError):
            return cls(None)

    # ---- a graph's planning (measuring models keep a budget and a disk cache) ----
    def begin_graph(self) -> None:
        """A new graph is about to be priced."""

    def save(self) -> None:
        """Keep what pricing the graph learned for the next compile."""

    # ---- pooling (ATen's kernels) ----------------------------------------------
    def pool_cost(self, node) -> Tuple[float, float]:
        """(NCHW µs, NHWC µs) of a max/avg pool: channels-last runs on the generated
        kernel (codegen/specs.py: pool_kernel), vectorised over channels; NCHW on ATen's, which
        walks each window scalar, 10-25x slower (measured per output element and
        window element, 1 thread, Xeon Sapphire Rapids; the ratio is what decides)."""
        per = _POOL_NS.get(node.op)
        if per is None or not node.kernel:
            return (0.0, 0.0)
        from cpu_layout.layout import numel_hint

        # Both kernels split the output over the threads; the rates are one thread's.
        work = numel_hint(node.size) * math.prod(node.kernel) / 1e3 / _threads()
        return (work * per[0], work * per[1])

    # ---- everything else: priced for the prediction, the same in every layout ----
    def other_cost(self, in_bytes: int, out_bytes: int, dtype: torch.dtype, flops: float = 0.0,
                   call: bool = True, math_elements: int = 0) -> float:
        """µs of a generated kernel, reduction, concat or ATen op, modelled: the bytes it
        reads and writes at a streaming rate derived from the copy rate, or for a
        matmul its FLOPs at _MATMUL_GFLOPS per thread, plus a fixed per-call cost
        (`call`: not for an op fused into the next one's kernel), and for an op
        that calls vector math (exp, tanh, erf) _VECTOR_MATH_NS per element.
        Layout-independent, so it never changes the plan's choice; it makes the plan's
        predicted forward time comparable with the measured one."""
        fixed = _CALL_US if call else 0.0
        if flops:
            return fixed + flops / (_MATMUL_GFLOPS * 1e3 * _threads())
        math = math_elements * _VECTOR_MATH_NS / (1e3 * _threads())
        return fixed + math + _STREAM_VS_COPY * self.copy_cost((in_bytes + out_bytes) // 2, dtype)

    # ---- copies ---------------------------------------------------------------
    def copy_cost(self, nbytes: int, dtype: torch.dtype = torch.float32) -> float:
        """The table's rate (one thread's; plan/measure.py measures it at the thread
        count in use) over every thread, as its convs."""
        per_byte = self._copy.get(str(dtype).replace("torch.", ""), _COPY_US_PER_BYTE)
        return nbytes * per_byte * self._table_threads / _threads()

    def gather_cost(self, nbytes: int, dtype: torch.dtype = torch.float32) -> float:
        """µs to copy a slice dense in its own order (rows copied as they are, no
        transposition): priced at a kernel's streaming rate. A channel half of
        120x28x28 fp32 channels-last took 12 us, a layout conversion of the whole
        118 us (EPYC Zen 4, 1 thread)."""
        return _STREAM_VS_COPY * self.copy_cost(nbytes, dtype)

    # ---- convolutions --------------------------------------------------------
    def conv_cost(self, conv: Conv) -> ConvCost:
        n, cin = hint(conv.in_size[0]), hint(conv.in_size[1])
        spatial_in = tuple(hint(s) for s in conv.in_size[2:])
        spatial_out = tuple(hint(s) for s in conv.size[2:])
        # A weight that is a graph input has symbolic sizes under dynamic=True.
        cout, kernel = hint(conv.out_channels), tuple(hint(k) for k in conv.kernel)
        key = (conv.dtype, n, cin, cout, conv.groups, kernel, conv.stride,
               conv.dilation, spatial_in, spatial_out, torch.get_num_threads())
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = self._conv_cost(conv.dtype, n, cin, cout, conv.groups,
                                                    kernel, conv.stride, spatial_in, spatial_out)
        return got

    def _conv_cost(self, dtype, n, cin, cout, groups, kernel, stride, spatial_in, spatial_out) -> ConvCost:
        flops = _flops(n, cin, cout, groups, kernel, spatial_out)
        kind = _group_kind(groups, cin)
        best, best_d = None, math.inf
        dname = str(dtype).replace("torch.", "")
        hw = math.prod(spatial_in) ** (1.0 / max(len(spatial_in), 1))
        k = math.prod(kernel) ** (1.0 / max(len(kernel), 1))
        s = max(stride)
        if len(spatial_in) == 2:  # the table measures 2-D convs; 1-D/3-D use heuristics
            for e in self.entries:
                if e["dtype"] != dname or e["_kind"] != kind:
                    continue
                d = (abs(math.log2(cin / e["cin"])) + abs(math.log2(cout / e["cout"]))
                     + abs(math.log2(hw / e["spatial"])) + abs(math.log2(k / e["kernel"]))
                     + (0.5 if s != e["stride"] else 0.0))
                if kind == "grouped":
                    d += abs(math.log2((cin / groups) / (e["cin"] / e["groups"])))
                if d < best_d:
                    best, best_d = e, d
        if best is not None and best_d <= MAX_DISTANCE:
            # The table's convs ran on its `threads` (one); a conv runs on all of ours.
            r = flops / best["_flops"] * self._table_threads / _threads()
            src = (f"table: {best['dtype']} {best['cin']}->{best['cout']} k{best['kernel']} s{best['stride']} "
                   f"g{best['groups']} {best['spatial']}px (d={best_d:.2f})")
            return ConvCost(best["nchw_us"] * r, best["nhwc_us"] * r, src)
        return self._heuristic(dtype, flops, cin, cout, groups, kind)

    def _heuristic(self, dtype, flops, cin, cout, groups, kind) -> ConvCost:
        """Rules read off the measured table (scripts/build_cost_table.py, cpu_layout.ops backend):
        NHWC wins clearly only for depthwise fp32 and modestly for regular convs."""
        base = flops / (_GFLOPS.get(dtype, 20.0) * 1e3)  # µs
        if cin == 1:
            # [N,1,H,W] is both NCHW and NHWC: no layout to prefer.
            return ConvCost(base, base, "heuristic: in_channels == 1")
        if cin < 8 or cout < 8:
            # Fewer channels than one AVX2 vector: neither layout vectorises C well; stay neutral
            # so conversions (which cost real bytes) decide.
            return ConvCost(base, base, "heuristic: tiny channel count")
        if kind == "depthwise":
            r = 0.5 if dtype == torch.float32 else 1.0
            return ConvCost(base, base * r, "heuristic: depthwise")
        if kind == "grouped":
            # Few channels per group: NHWC grouped kernels lose the channel vector.
            r = 1.2 if cin // groups < 8 else 0.9
            return ConvCost(base, base * r, "heuristic: grouped")
        return ConvCost(base, base * 0.9, "heuristic: regular conv")
