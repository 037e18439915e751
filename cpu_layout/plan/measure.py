"""Conv costs measured on the machine at hand (autotuning the layout choice).

The shipped tables were measured on other CPUs; on this one the two layouts
can rank the other way round (resnext50's 1x1 and grouped convs: the table
said NCHW, this Xeon runs them faster in NHWC). So at compile time each conv
shape the plan prices is run a few times in each layout on cpu_layout's oneDNN
path, with its fused post-ops (a residual in the output's layout), in
interleaved rounds, each timing a candidate's second call in a row (as in the
graph its memory is warm: the first call after another candidate ran 1.3-2x
slow on mobilenet_v3's convs, and its plan predicted 1.49x the measured
forward, 0.93x timed this way; Sapphire Rapids, 1 thread), and the fastest
round of each is its cost: on a shared machine contention only ever adds
time, and medians of five rounds taken while another process held the second
core came out 4-10x high (resnet50's stem at
batch 8, 2 threads: ours NHWC 42.7 ms "measured", 10 ms in fact), a choice the
cache then kept. Post-ops are part of the problem: a GEMM kernel applies them in
a separate pass, and measured without them efficientnet_b0's convs ran 1.37x
slower in the graph than the plan predicted. A grouped or depthwise conv
torch's bundled oneDNN can also run (`ops.aten_conv_candidate`: at most one
unary post-op, no size-1 dims) is timed on it too, in NHWC, and runs there
when it is at least ATEN_MARGIN faster (`ConvCost.nhwc_impl`); and on ours
with oneDNN's next implementation (`ops.conv2d(impl_rank=1)`), which runs it
when at least NEXT_MARGIN faster (`ConvCost.nhwc_rank`): oneDNN 3.2 ranks
brdgmm_dw first for every NHWC depthwise conv, and jit_dw is the faster one
for some shapes (EPYC Zen 4, batch 8, 2 threads: C16 112x112 0.46 vs 0.74 ms,
C120 28x28 5x5 0.29 vs 0.37 ms; the other way round 0.76 vs 1.16 ms at C72
56x56). A 3x3 stride-1 conv, float32 or (with native bf16) bfloat16, is also
timed on cpu_layout's Winograd kernel (`ops.winograd_candidate`), which runs
it when at least WINOGRAD_MARGIN faster (`ConvCost.nhwc_rank` = ops.WINOGRAD):
1.3-1.9x on resnet50's 3x3 convs at 56 to 14 px, slower at 7 px. A grouped
conv with groups of fewer than 16 channels is also timed with its groups
merged into groups of 16 and of 32 channels on a block-diagonal weight
(`ops.merge_candidates`), which runs it when at least MERGE_MARGIN faster
(`ConvCost.nhwc_rank` = ops.MERGE_GROUPS + m): oneDNN 3.2's AMX kernels start at
16 channels per group (ResNeXt's bf16 3x3 convs, 4 and 8 per group: 5-6x). Dense convs
are not timed on torch's oneDNN: of 706 dense shapes timed on both (torchvision's models, batch 1
and 8, fp32 and bf16, EPYC Zen 4) torch's won one, by 6%, against 19 of 192
depthwise ones, and timing it was about a third of the measuring a cold
compile of resnet50 or densenet121 spent. Results are cached on disk per
oneDNN ISA and thread count (`<CPU_LAYOUT_CACHE_DIR>/autotune/conv10-<isa>-<threads>t.json`,
atomic writes, shared by processes), so a second compile measures nothing.
Measuring is bounded per graph (CPU_LAYOUT_AUTOTUNE_BUDGET seconds, default
2); past the budget, and for shapes it cannot run (1-D/3-D convs, sizes with
no hint), the table and heuristics of `cost.CostModel` price the conv. A
symbolic size (dynamic shapes) is measured at its hint, the size Dynamo
compiled for, as the table prices it: fcn_resnet50 under dynamic=True then
runs its 3x3 convs on Winograd as the static plan does (batch 2, 1 thread,
EPYC Zen 4: the head's 2048->512 conv 136 instead of 317 ms).
CPU_LAYOUT_AUTOTUNE=0 switches measuring off.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import threading
import time
from typing import Dict, Optional

import torch

from cpu_layout import config
from cpu_layout.plan.cost import ConvCost, CostModel, cpu_isa

_LOCK = threading.Lock()
# torch's oneDNN must beat ours by this much to be chosen. In the graph ours
# writes into the segment's pooled buffers while torch's allocates its output
# every call, which the isolated timing (both allocate) does not see: with a 5%
# margin, graphs ran 0-5% slower than with ours alone (mobilenet_v3 batch 8,
# 2 threads 27.7 vs 26.2 ms; efficientnet_b0 batch 1, 1 thread 14.8 vs 14.1 ms;
# EPYC Zen 4, interleaved A/B).
ATEN_MARGIN = 0.15
# Ours on oneDNN's next implementation: the same buffers either way, so only
# the timing's noise to stay clear of.
NEXT_MARGIN = 0.05
# Ours on the Winograd kernel: the same buffers as well (its transforms' scratch is
# per thread and reused), and values as close to exact as the direct conv's (fp32:
# closer; bf16: 1.2x eager's own bf16 error): taken when clearly faster.
WINOGRAD_MARGIN = 0.10
# Ours with the groups merged (ops.merge_candidates): the same buffers, values as the
# grouped conv's (the added products are exact zeros), so noise is the only margin.
MERGE_MARGIN = 0.05


class MeasuredCostModel(CostModel):
    """`CostModel` whose conv costs are measured (see the module docstring)."""

    def __init__(self, table: Optional[dict] = None):
        super().__init__(table)
        # Per cache file (one per thread count): a process may change its thread count.
        self._disk: Dict[str, Dict[str, list]] = {}
        self._new: Dict[str, Dict[str, list]] = {}
        self._rates: Dict[tuple, float] = {}
        self._spent = 0.0

    def begin_graph(self) -> None:
        """A new graph gets a fresh measuring budget."""
        self._spent = 0.0

    def _path(self) -> str:
        return os.path.join(config.cache_dir(), "autotune",
                            f"conv10-{cpu_isa()}-{torch.get_num_threads()}t.json")

    def _load(self) -> Dict[str, list]:
        path = self._path()
        if path not in self._disk:
            try:
                with open(path) as f:
                    self._disk[path] = dict(json.load(f))
            except (OSError, ValueError):
                self._disk[path] = {}
        return self._disk[path]

    def _known(self, key: str) -> Optional[list]:
        return self._new.get(self._path(), {}).get(key) or self._load().get(key)

    def _learn(self, key: str, got: list) -> None:
        self._new.setdefault(self._path(), {})[key] = got

    def _key(self, conv) -> Optional[str]:
        sizes = (*conv.in_size, *conv.size, *conv.kernel)
        if len(conv.in_size) != 4 or not all(type(s) is int for s in sizes):
            return None
        if conv.dtype not in (torch.float32, torch.bfloat16) or conv.in_size[0] == 0:
            return None
        post = conv.post_ops
        return (f"{str(conv.dtype)[6:]} n{conv.in_size[0]} {conv.in_size[1]}->{conv.size[1]} "
                f"in{list(conv.in_size[2:])} k{list(conv.kernel)} s{list(conv.stride)} "
                f"p{list(conv.padding)} d{list(conv.dilation)} g{conv.groups}"
                + (f" po{list(post)}" if post else ""))

    def conv_cost(self, conv) -> ConvCost:
        concrete = _at_hints(conv) if config.autotune() else None
        key = self._key(concrete) if concrete is not None else None
        if key is None:
            return super().conv_cost(conv)
        conv = concrete
        got = self._known(key)
        if got is None and self._spent < config.autotune_budget():
            t0 = time.perf_counter()
            try:
                got = _measure(conv)
            except Exception:  # noqa: BLE001 - a shape oneDNN refuses: the table prices it
                got = None
            self._spent += time.perf_counter() - t0
            if got is not None:
                self._learn(key, got)
        if got is None:
            return super().conv_cost(conv)
        return measured_cost(got)

    def copy_cost(self, nbytes: int, dtype: torch.dtype = torch.float32) -> float:
        rate = self._copy_rate(dtype) if config.autotune() else None
        return nbytes * rate if rate is not None else super().copy_cost(nbytes, dtype)

    def _copy_rate(self, dtype: torch.dtype) -> Optional[float]:
        """µs per byte of a layout conversion at this thread count: the shipped
        table's rate is one thread's, and kernels and copies run on all of them
        (at 2 threads it priced efficientnet_b0's batch-8 kernels at 2.6x what they took)."""
        if dtype not in (torch.float32, torch.bfloat16):
            return None
        memo = (dtype, torch.get_num_threads())  # the planner asks for every edge
        if memo in self._rates:
            return self._rates[memo]
        key = f"copy {str(dtype)[6:]}"
        got = self._known(key)
        if got is None:
            t0 = time.perf_counter()
            try:
                got = [_on_real_tensors(copy_us_per_byte, dtype)]
            except Exception:  # noqa: BLE001 - the table's rate then
                return None
            self._spent += time.perf_counter() - t0
            self._learn(key, got)
        self._rates[memo] = got[0]
        return got[0]

    def save(self) -> None:
        """Merge what this process measured into the on-disk caches (atomic replace)."""
        with _LOCK:
            for path, new in list(self._new.items()):
                if not new:
                    continue
                try:
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    try:
                        with open(path) as f:
                            merged = dict(json.load(f))
                    except (OSError, ValueError):
                        merged = {}
                    merged.update(new)
                    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".conv-", suffix=".json")
                    with os.fdopen(fd, "w") as f:
                        json.dump(merged, f, indent=0, sort_keys=True)
                    os.replace(tmp, path)
                    self._disk[path] = merged
                    del self._new[path]
                except OSError:
                    pass  # a read-only cache: measure again next time


def _at_hints(conv):
    """The conv with every symbolic size at its hint (the size Dynamo compiled it
    for), as the table prices it; None when a size has no hint (unbacked)."""
    def concrete(x):
        if type(x) is int:
            return x
        if isinstance(x, torch.SymInt) and x.node.has_hint():
            return int(x.node.hint)
        return None

    in_size, size = tuple(map(concrete, conv.in_size)), tuple(map(concrete, conv.size))
    if None in in_size or None in size:
        return None
    if all(type(x) is int for x in (*conv.in_size, *conv.size)):
        return conv  # (comparing a SymInt with its hint would add a guard)
    return dataclasses.replace(conv, in_size=in_size, size=size)


def measured_cost(got) -> ConvCost:
    """The cost of a conv from its timings [NCHW, NHWC, torch's oneDNN NHWC or None,
    ours NHWC on oneDNN's next implementation or None, ours NHWC on the Winograd
    kernel or None, ours NHWC with the groups merged or None, its factor m] (µs)."""
    from cpu_layout.ops import MERGE_GROUPS, WINOGRAD

    nchw, nhwc = got[0], got[1]
    aten = got[2] if len(got) > 2 else None
    nxt = got[3] if len(got) > 3 else None
    wino = got[4] if len(got) > 4 else None
    merge, factor = (got[5], got[6]) if len(got) > 6 and got[5] is not None else (None, 1)
    text = f"measured: ours NCHW {nchw:.0f} us, NHWC {nhwc:.0f} us"
    rank = 0
    if nxt is not None:
        text += f", NHWC on oneDNN's next implementation {nxt:.0f} us"
        if nxt < (1.0 - NEXT_MARGIN) * nhwc:
            nhwc, rank = nxt, 1
            text += " (NHWC runs on it)"
    if wino is not None:
        text += f", NHWC on Winograd {wino:.0f} us"
        if wino < (1.0 - WINOGRAD_MARGIN) * nhwc:
            nhwc, rank = wino, WINOGRAD
            text += " (NHWC runs on it)"
    if merge is not None:
        text += f", NHWC with groups merged {factor} at a time {merge:.0f} us"
        if merge < (1.0 - MERGE_MARGIN) * nhwc:
            nhwc, rank = merge, MERGE_GROUPS + factor
            text += " (NHWC runs on it)"
    if aten is not None:
        text += f", torch's oneDNN NHWC {aten:.0f} us"
        if aten < (1.0 - ATEN_MARGIN) * nhwc:
            return ConvCost(nchw, aten, text + " (NHWC runs on torch's)", nhwc_impl="aten")
    return ConvCost(nchw, nhwc, text, nhwc_rank=rank)


def _measure(conv, rounds: int = 5):
    """Fastest µs of the conv in NCHW and in NHWC on cpu_layout's oneDNN path
    (input, output and residual in that layout, bias, its post-ops), in NHWC
    on torch's bundled oneDNN when it can run the conv, and for a grouped conv
    in NHWC on oneDNN's next implementation when there is another (else None),
    interleaved."""
    return _on_real_tensors(_measure_real, conv, rounds)


def _on_real_tensors(fn, *args):
    """fn(*args) outside Dynamo's fake tensor mode: compiles run under it, and a
    measurement times real tensors."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return fn(*args)


def _measure_real(conv, rounds):
    from cpu_layout import ops

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(conv.in_size, generator=gen).to(conv.dtype)
    cin_g = conv.in_size[1] // conv.groups
    w = torch.randn((conv.size[1], cin_g, *conv.kernel), generator=gen).to(conv.dtype) * 0.1
    b = torch.zeros(conv.size[1], dtype=conv.dtype)
    args = dict(stride=conv.stride, padding=conv.padding, dilation=conv.dilation, groups=conv.groups)
    xs = {"nchw": x.contiguous(), "nhwc": x.contiguous(memory_format=torch.channels_last)}
    res = torch.randn(tuple(conv.size), generator=gen).to(conv.dtype)
    post = {}  # per layout: the conv's post-ops, a residual already in the output's layout
    for lay in xs:
        r = res.contiguous(memory_format=torch.channels_last if lay == "nhwc" else torch.contiguous_format)
        post[lay] = [("add", r) if p == "add" else p for p in conv.post_ops]
    # Ours writes into buffers allocated once, as the graph's pooled ones: an output allocated
    # per call is a fresh mapping past malloc's threshold, whose page faults made a 1x1 conv to
    # 8x96x112x112 "cost" 13 ms that runs in 3.8 ms in the graph (2 threads, Sapphire Rapids).
    outs = {lay: ops.empty_dense(tuple(conv.size), conv.dtype, lay == "nhwc") for lay in xs}
    runs = {lay: (lambda xi=xi, lay=lay: ops.conv2d(xi, w, b, out_layout=lay, post_ops=post[lay],
                                                   out=outs[lay], **args))
            for lay, xi in xs.items()}
    attr = (ops.aten_conv_candidate(conv.dtype, conv.in_size, conv.size, conv.post_ops)
            if conv.groups > 1 else None)
    if attr is not None:
        runs["aten"] = lambda: ops.aten_conv2d(xs["nhwc"], w, b, conv.stride, conv.padding, conv.dilation,
                                               conv.groups, attr)
    if conv.groups > 1:
        names = [ops.impl_name(xs["nhwc"], w, b, out_layout="nhwc", post_ops=post["nhwc"], impl_rank=r,
                               **args) for r in (0, 1)]
        if names[1] != names[0]:
            runs["next"] = lambda: ops.conv2d(xs["nhwc"], w, b, out_layout="nhwc", post_ops=post["nhwc"],
                                              impl_rank=1, out=outs["nhwc"], **args)
    if ops.winograd_candidate(conv.dtype, conv.kernel, conv.stride, conv.padding, conv.dilation, conv.groups,
                              conv.post_ops):
        runs["wino"] = lambda: ops.conv2d(xs["nhwc"], w, b, out_layout="nhwc", post_ops=post["nhwc"],
                                          impl_rank=ops.WINOGRAD, out=outs["nhwc"], **args)
    for m in ops.merge_candidates(conv.dtype, conv.in_size[1], conv.size[1], conv.groups):
        runs[f"merge{m}"] = (lambda m=m: ops.conv2d(xs["nhwc"], w, b, out_layout="nhwc", post_ops=post["nhwc"],
                                                    impl_rank=ops.MERGE_GROUPS + m, out=outs["nhwc"], **args))
    times = {k: [] for k in runs}
    with torch.no_grad():
        for run in runs.values():
            run()  # primitive creation, weight reorder
        for _ in range(rounds):
            for k, run in runs.items():
                run()  # as in the graph: its memory warm from the call before
                t0 = time.perf_counter()
                run()
                times[k].append((time.perf_counter() - t0) * 1e6)
    merged = min(((min(t), int(k[5:])) for k, t in times.items() if k.startswith("merge")), default=(None, None))
    return [min(times["nchw"]), min(times["nhwc"])] + [min(times[k]) if k in times else None
                                                       for k in ("aten", "next", "wino")] + list(merged)


def copy_us_per_byte(dtype: torch.dtype, rounds: int = 5) -> float:
    """µs per byte (of one tensor) of a layout conversion, NCHW <-> NHWC both ways,
    over four activation sizes of batch 1: the median of their fastest rounds."""
    per_byte = []
    with torch.no_grad():
        for shape in ((1, 64, 56, 56), (1, 256, 14, 14), (1, 32, 112, 112), (1, 512, 7, 7)):
            a = torch.randn(shape).to(dtype)
            b = a.contiguous(memory_format=torch.channels_last)
            nbytes = a.numel() * a.element_size()
            for run in (lambda: a.contiguous(memory_format=torch.channels_last), lambda: b.contiguous()):
                run()
                best = float("inf")
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    run()
                    best = min(best, time.perf_counter() - t0)
                per_byte.append(best * 1e6 / nbytes)
    return statistics.median(per_byte)


_DEFAULT: Optional[CostModel] = None


def default_cost_model() -> CostModel:
    """Conv costs measured on this machine where allowed (plan/measure.py), else the
    shipped table for its ISA (loaded once per process)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = MeasuredCostModel.load()
    return _DEFAULT
