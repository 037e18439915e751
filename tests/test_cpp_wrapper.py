"""cpp_wrapper mode specifics: one foreign call per forward, segments around
Python-only ops, buffer reuse and peak memory, errors from inside C++.

(Values, sizes and strides against eager for every model are in
test_backend.py, which runs each test under both wrappers.)
"""
import contextlib
import os
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cpu_layout import benchmark, build, ir, models, op_table, ops, runtime, segments
from cpu_layout.codegen import Const, Load, Op, cpp_kernels

pytestmark = pytest.mark.usefixtures("no_grad", "strict_compile")


def compile_cpp(model, dynamic=False, **opts):
    return torch.compile(model, backend="cpu_layout", dynamic=dynamic,
                         options={"cpp_wrapper": True, **opts})


class SENet(nn.Module):
    """conv+BN+ReLU, max-pool, SE block (mean, 1x1 convs, sigmoid), residual, head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.fc1 = nn.Conv2d(16, 4, 1)
        self.fc2 = nn.Conv2d(4, 16, 1)
        self.conv = nn.Conv2d(16, 16, 3, padding=1)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        y = F.max_pool2d(self.stem(x), 2)
        w = torch.sigmoid(self.fc2(F.relu(self.fc1(y.mean((2, 3), keepdim=True)))))
        y = F.relu(self.conv(y * w) + y)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1))


def _init(model):
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    return model.eval()


def _no_python_runners(monkeypatch):
    """Make every per-op Python runner fail: only C++ segments may run the graph."""
    def refuse(*a, **k):
        raise AssertionError("a node ran from Python")

    monkeypatch.setattr(ops, "_run", refuse)
    monkeypatch.setattr(runtime.KernelCall, "__call__", refuse)
    monkeypatch.setattr(runtime.ReductionCall, "__call__", refuse)
    monkeypatch.setattr(runtime.AtenPointwise, "__call__", refuse)


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_supported_graph_is_one_foreign_call_per_forward(amp, dynamic, monkeypatch):
    model = _init(SENet())
    fn = compile_cpp(model, dynamic=dynamic)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        x = torch.randn(2, 3, 16, 14)
        fn(x)  # compile (and fill the prologue's constants)
        _no_python_runners(monkeypatch)
        for n in (2, 3, 5) if dynamic else (2, 2):
            x = torch.randn(n, 3, 16, 14)
            before = runtime.SegmentCall.calls
            y = fn(x)
            assert runtime.SegmentCall.calls - before == 1
            ref = model(x)
            assert y.shape == ref.shape and y.stride() == ref.stride()
            tol = 3e-2 if amp else 1e-4
            torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol)


def test_option_and_environment_variable_both_select_it(monkeypatch, compiled_graphs):
    model, x = models.build("maml_omniglot")
    graphs = compiled_graphs
    compile_cpp(model)(x)
    torch._dynamo.reset()
    monkeypatch.setenv("CPU_LAYOUT_CPP_WRAPPER", "1")
    torch.compile(model, backend="cpu_layout")(x)
    assert [c.cpu_layout_cpp_wrapper for c in graphs] == [True, True]
    for c in graphs:
        segments = [n for n in c.cpu_layout_graph.nodes if isinstance(n, ir.Segment)]
        assert len(segments) == 1 and "_segment" in c.cpu_layout_source


class CumsumInTheMiddle(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        y = F.relu(self.a(x))
        y = torch.cumsum(y, dim=3)  # no C shim entry: a Python node
        return self.b(y) * 0.5


def test_unsupported_op_splits_the_graph_into_segments():
    model = CumsumInTheMiddle().eval()
    x = torch.randn(2, 3, 10, 10)
    fn = compile_cpp(model)
    before = runtime.SegmentCall.calls
    y = fn(x)
    ref = model(x)
    assert runtime.SegmentCall.calls - before == 2
    assert y.stride() == ref.stride()
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)


class ShuffleBlock(nn.Module):
    """ShuffleNet's unit: chunk, a branch, cat, channel shuffle (view, transpose,
    contiguous, view), plus splits of other kinds and a channels-last clone."""

    def __init__(self, c=8):
        super().__init__()
        self.branch = nn.Sequential(nn.Conv2d(c // 2, c // 2, 1), nn.BatchNorm2d(c // 2), nn.ReLU(),
                                    nn.Conv2d(c // 2, c // 2, 3, padding=1, groups=c // 2))
        self.stem = nn.Conv2d(3, c, 3, padding=1)

    def forward(self, x):
        y = self.stem(x)
        a, b = y.chunk(2, dim=1)
        y = torch.cat((a, self.branch(b)), dim=1)
        n, c, h, w = y.shape
        y = y.view(n, 2, c // 2, h, w).transpose(1, 2).contiguous().view(n, c, h, w)
        p, q, r = torch.split(y, [3, 4, 1], dim=1)      # uneven pieces
        s = torch.split(y, 5, dim=3)                      # along width, last piece short
        z = (p.sum(1, keepdim=True) * q[:, :1] + r).clone(memory_format=torch.channels_last)
        return z, s[-1], s[0] * 2


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_splits_and_clones_run_inside_the_segment(mode, dynamic, monkeypatch):
    model = _init(ShuffleBlock())
    fn = compile_cpp(model, dynamic=dynamic)
    grad = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
    with grad:
        fn(torch.randn(2, 3, 6, 7))
        _no_python_runners(monkeypatch)
        for n in (2, 3) if dynamic else (2, 2):
            x = torch.randn(n, 3, 6, 7)
            before = runtime.SegmentCall.calls
            got = fn(x)
            assert runtime.SegmentCall.calls - before == 1, "split and clone split the segment"
            for y, ref in zip(got, model(x)):
                assert y.shape == ref.shape and y.stride() == ref.stride()
                torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    assert got[0].is_contiguous(memory_format=torch.channels_last)


class ShuffleUnits(nn.Module):
    """Two ShuffleNet units back to back: every view (chunk pieces, the shuffle's
    5-D view and transpose) dies inside the segment."""

    def __init__(self, c=8):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.branches = nn.ModuleList(
            nn.Sequential(nn.Conv2d(c // 2, c // 2, 1), nn.ReLU(),
                          nn.Conv2d(c // 2, c // 2, 3, padding=1, groups=c // 2)) for _ in range(2))

    def forward(self, x):
        y = self.stem(x)
        for branch in self.branches:
            a, b = y.chunk(2, dim=1)
            y = torch.cat((a, branch(b)), dim=1)
            n, c, h, w = y.shape
            y = y.view(n, 2, c // 2, h, w).transpose(1, 2).contiguous().view(n, c, h, w)
        return F.relu(y).mean((2, 3))  # a result in no particular layout: nothing to convert


def test_viewed_buffers_go_back_to_the_pool_when_their_views_died():
    model = _init(ShuffleUnits())
    x = torch.randn(1, 3, 16, 16)
    fn = compile_cpp(model)
    with torch.no_grad():
        for _ in range(3):
            fn(x)
        peak, held, allocs = benchmark.allocations(fn, x)
        assert (allocs, held) == (1, 0), (peak, held, allocs)  # the result only
        y, ref = fn(x), model(x)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    assert y.stride() == ref.stride()


def test_a_returned_view_keeps_its_storage_out_of_the_pool():
    model = _init(ShuffleBlock())  # returns views of the shuffled buffer
    fn = compile_cpp(model)
    x1, x2 = torch.randn(2, 3, 6, 7), torch.randn(2, 3, 6, 7)
    with torch.no_grad():
        fn(x1)
        first = fn(x1)
        kept = [t.clone() for t in first]
        for _ in range(2):
            fn(x2)  # later calls must not write into what the first one returned
    for t, k in zip(first, kept):
        assert torch.equal(t, k)


class Cats(nn.Module):
    """Cats along channels of conv outputs (the plan's order), with a part read
    through a transpose (not dense in any named order), along width, and of
    an empty part."""

    def __init__(self, ca=5, cb=4):
        super().__init__()
        self.a = nn.Conv2d(3, ca, 3, padding=1)
        self.b = nn.Conv2d(3, cb, 1)

    def forward(self, x):
        a, b = F.relu(self.a(x)), self.b(x)
        y = torch.cat((a, b, a[:, :0]), dim=1)
        z = torch.cat((a, b.transpose(2, 3).transpose(2, 3) * 2, a), dim=1)
        w = torch.cat((y, y * 0.5), dim=-1)
        t = torch.cat((a[:, :, :, :4].transpose(2, 3), a[:, :, :4]), dim=2)  # a strided part
        return y, z, w, t


# (channels of a, of b, size, amp): parts shorter than 64 bytes a row, and
# parts of whole 64-byte blocks and a tail (fp32: 24 and 32 channels are 96 and
# 128 bytes; bf16 48 and 64) over enough rows to share among threads.
CAT_CASES = {"narrow": (5, 4, 6, False), "wide": (24, 32, 40, False), "wide_amp": (24, 32, 40, True)}


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw_input", "nhwc_input"])
@pytest.mark.parametrize("case", list(CAT_CASES))
def test_own_cat_matches_atens(case, mode, channels_last, monkeypatch):
    ca, cb, size, amp = CAT_CASES[case]
    torch.manual_seed(0)
    model = Cats(ca, cb).eval()
    fn = compile_cpp(model)
    grad = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    with grad, torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        x = torch.randn(2, 3, size, size).contiguous(memory_format=fmt)
        fn(x)
        _no_python_runners(monkeypatch)
        before = runtime.SegmentCall.calls
        got = fn(x)
        assert runtime.SegmentCall.calls - before == 1
        for y, ref in zip(got, model(x)):
            assert y.shape == ref.shape and y.stride() == ref.stride() and y.dtype == ref.dtype
            tol = 2e-2 if amp else 1e-5
            torch.testing.assert_close(y, ref, rtol=tol, atol=tol)


def test_split_piece_and_clone_order():
    aten = torch.ops.aten
    g = ir.Graph()
    x = g.new_buffer(size=(2, 10, 3), dtype=torch.float32, eager_stride=(30, 3, 1))
    tup = g.new_buffer()

    def split(target, how, **kw):
        return ir.Aten("split", [x], tup, target=target, args=(x, how, *kw.values()), multi=True)

    assert [op_table.split_piece(split(aten.split.Tensor, 4, dim=1), i) for i in range(3)] == [
        (1, 0, 4), (1, 4, 8), (1, 8, 12)]  # the last piece is clamped at run time
    assert [op_table.split_piece(split(aten.split_with_sizes.default, [7, 3], dim=-2), i)
            for i in range(2)] == [(1, 0, 7), (1, 7, 10)]
    assert op_table.split_piece(split(aten.split_with_sizes.default, [7, 2], dim=1), 0) is None
    y = g.new_buffer(size=(2, 10, 3), dtype=torch.float32, eager_stride=(30, 1, 10))

    def clone(fmt, layout):
        y.layout = layout
        return ir.Aten("clone", [x], y, target=aten.clone.default, args=(x,), kwargs={"memory_format": fmt})

    assert op_table.clone_order(clone(torch.preserve_format, ir.EAGER)) is None  # eager's own strides
    assert not segments.runs_in_cpp(clone(torch.preserve_format, ir.EAGER))
    assert op_table.clone_order(clone(torch.preserve_format, "channels_last")) == "channels_last"
    assert op_table.clone_order(clone(torch.contiguous_format, ir.EAGER)) == "contiguous"
    assert op_table.clone_order(clone(torch.channels_last, ir.EAGER)) is None  # not 4-D


def test_rule_keeps_python_only_ops_out_of_segments():
    g = ir.Graph()
    x = g.new_buffer(size=(2, 3), dtype=torch.float32, eager_stride=(3, 1))
    out = g.new_buffer(size=(2, 3), dtype=torch.float32, eager_stride=(3, 1))
    cumsum = ir.Aten("cumsum", [x], out, target=torch.ops.aten.cumsum.default, args=(x, 1))
    assert not segments.runs_in_cpp(cumsum)
    ints = g.new_buffer(size=(2, 3), dtype=torch.int64, eager_stride=(3, 1))
    cat = ir.Aten("cat", [ints], g.new_buffer(size=(4, 3), dtype=torch.int64, eager_stride=(3, 1)),
                  target=torch.ops.aten.cat.default, args=([ints, ints], 0))
    assert not segments.runs_in_cpp(cat), "integer tensors stay in Python"
    fcat = ir.Aten("cat", [x], g.new_buffer(size=(4, 3), dtype=torch.float32, eager_stride=(3, 1)),
                   target=torch.ops.aten.cat.default, args=([x, x], 0))
    assert segments.runs_in_cpp(fcat)


class Plain(nn.Module):
    """5 convs of 16 channels: the overhead benchmark's model."""

    def __init__(self, layers=5, ch=16):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(ch, ch, 3, padding=1) for _ in range(layers))

    def forward(self, x):
        for c in self.convs:
            x = F.relu(c(x)) * 1.5
        return x


def test_buffers_are_reused_and_peak_memory_is_not_above_the_default_wrappers(compiled_graphs):
    model = Plain().eval()
    x = torch.randn(2, 16, 32, 32)
    peaks = {}
    for cpp in (False, True):
        torch._dynamo.reset()
        fn = torch.compile(model, backend="cpu_layout", options={"cpp_wrapper": cpp})
        torch.testing.assert_close(fn(x), model(x), rtol=1e-4, atol=1e-4)
        peaks[cpp] = benchmark.peak_memory(fn, x)
    one = 2 * 16 * 32 * 32 * 4
    assert peaks[True] <= peaks[False], peaks
    assert peaks[True] <= 3 * one, peaks  # live: the input, one conv output, one kernel output


def test_a_segment_keeps_its_buffers_between_calls_and_never_hands_them_out(compiled_graphs):
    model = Plain().eval()
    fn = compile_cpp(model)
    # Channels-last in and out (the plan's layout): the segment's result needs no restride in Python.
    x = torch.randn(2, 16, 32, 32).contiguous(memory_format=torch.channels_last)
    fn(x)
    # Later calls take the kept buffers: the result is the one allocation, and nothing
    # more stays allocated when it is dropped.
    peak, held, allocs = benchmark.allocations(fn, x)
    one = 2 * 16 * 32 * 32 * 4
    assert (allocs, held) == (1, 0) and peak == one, (peak, held, allocs)
    # A result handed out is the caller's: the next calls do not write into it.
    y1 = fn(x)
    keep = y1.clone()
    y2 = fn(torch.randn_like(x))
    assert y1.data_ptr() != y2.data_ptr()
    assert torch.equal(y1, keep)
    ref = model(x)
    y = fn(x)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    assert y.stride() == ref.stride()
    seg = next(n for n in compiled_graphs[0].cpu_layout_graph.nodes if isinstance(n, ir.Segment))
    code = seg.program.instructions()
    conversions = {ops[0] for name, ops in code if name in ("ORDERED", "ORDERED_PERM")}
    gives = [ops for name, ops in code if name == "GIVE" and ops[0] not in conversions]
    assert len(gives) == len(seg.members) - 1, ("every buffer but the result", seg.program.listing())


def _conv_relu(i, o, k=1, s=1, g=1):
    return [nn.Conv2d(i, o, k, s, k // 2, groups=g), nn.ReLU()]


def test_pool_serves_every_buffer_from_the_second_call_on():
    # mnasnet's stem: buffers of several sizes, where a request that took a larger block
    # than it needed left a later, larger request to allocate fresh memory every call.
    model = nn.Sequential(*_conv_relu(3, 32, 3, 2), *_conv_relu(32, 32, 3, 1, 32), nn.Conv2d(32, 16, 1),
                          *_conv_relu(16, 48), *_conv_relu(48, 48, 3, 2, 48), nn.Conv2d(48, 24, 1),
                          *_conv_relu(24, 72), *_conv_relu(72, 72, 3, 1, 72), nn.Conv2d(72, 24, 1),
                          nn.AdaptiveAvgPool2d(1)).eval()
    x = torch.randn(1, 3, 64, 64)
    fn = compile_cpp(model)
    with torch.no_grad():
        for _ in range(3):
            fn(x)
        for _ in range(3):
            peak, held, allocs = benchmark.allocations(fn, x)
            assert (allocs, held) == (1, 0), (peak, held, allocs)  # the result only
            assert peak == 24 * 4
        y, ref = fn(x), model(x)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    assert y.stride() == ref.stride()


class Residuals(nn.Module):
    """Two bottleneck-style blocks; the second block's input is also read after its last conv."""

    def __init__(self, ch=16):
        super().__init__()
        self.a1, self.a2 = nn.Conv2d(ch, ch, 1), nn.Conv2d(ch, ch, 3, padding=1)
        self.b1, self.b2 = nn.Conv2d(ch, ch, 1), nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x):
        x = F.relu(x * 1.5)
        y = F.relu(self.a2(F.relu(self.a1(x))) + x)  # x dies here: the output takes its storage
        z = F.relu(self.b2(F.relu(self.b1(y))) + y)
        return z * y.sigmoid()  # y is read after the conv that adds it: not in place


def _run_on_pooled_storage(model, dtype, compiled_graphs):
    """Three calls (the later ones on the pool's storage) against eager, the
    caller's input never written; returns the graph's one segment."""
    model = model.eval().to(dtype)
    x = torch.randn(2, 16, 10, 10).to(dtype).contiguous(memory_format=torch.channels_last)
    fn = compile_cpp(model)
    ref = model(x)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    for _ in range(3):
        x_before = x.clone()
        y = fn(x)
        assert torch.equal(x, x_before), "the caller's input is never written"
        torch.testing.assert_close(y, ref, **tol)
        assert y.stride() == ref.stride()
    segs = [v for v in compiled_graphs[0].__globals__.values() if isinstance(v, runtime.SegmentCall)]
    assert len(segs) == 1
    return segs[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_conv_adds_a_dying_residual_in_place(dtype, compiled_graphs):
    seg = _run_on_pooled_storage(Residuals(), dtype, compiled_graphs)
    in_place = [_conv_in_place(ops) for name, ops in seg.program.instructions() if name == "CONV"]
    assert sum(r >= 0 for r in in_place) == 1, ("only the residual that dies at its conv", in_place)


def _conv_in_place(ops):
    """The residual register a CONV instruction takes over, -1 for none (operands as
    csrc/segment_vm.cpp's Run::conv reads them)."""
    nsp = ops[6]
    i = 14 + 4 * nsp  # out x w w_es scale b nsp es dst_cl w_cl impl_rank oc groups ic, then k s p d
    i += 1 + 3 * ops[i]  # post-ops
    i += 1 + ops[i]  # residuals
    return ops[i]


class KernelsInPlace(nn.Module):
    """Element-wise kernels whose input dies there (in place) and one whose input
    is read again later (not in place)."""

    def __init__(self, ch=16):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Conv2d(ch, ch, 1) for _ in range(4))
        self.dw = nn.Conv2d(ch, ch, 3, padding=1, groups=ch)

    def forward(self, x):
        u = self.a(x)
        v = F.silu(self.dw(u))  # the depthwise output dies at its silu: in place
        w = F.silu(self.b(v))  # likewise
        # u is read after its silu: not in place; nor the last kernel, whose output
        # leaves the segment with storage of its own
        return self.d(w) * self.c(F.silu(u)) + u


def _kernel_in_place(ops):
    """The input register a KERNEL instruction's output takes over, -1 for none
    (operands as csrc/segment_vm.cpp's Run::kernel reads them)."""
    return ops[4 + ops[3] + 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_kernel_writes_over_a_dying_input(dtype, compiled_graphs, monkeypatch):
    # Which kernels exist depends on the plan (a mul and an add in two layouts are
    # two kernels); convs priced from the table, not timed, give the same plan on
    # every run, where a noisy timing kept in the cache split the last kernel.
    monkeypatch.setenv("CPU_LAYOUT_AUTOTUNE", "0")
    seg = _run_on_pooled_storage(KernelsInPlace(), dtype, compiled_graphs)
    in_place = [_kernel_in_place(ops) for name, ops in seg.program.instructions() if name == "KERNEL"]
    assert sum(r >= 0 for r in in_place) == 2, ("the two silus after convs", seg.program.listing())
    assert sum(r < 0 for r in in_place) == 2, ("silu(u) and the output's kernel", seg.program.listing())


class Pooled(nn.Module):
    """Intermediates that die inside the segment (pooled storage): convs,
    a gate, a residual; the input read channels-last through a conversion."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.c3 = nn.Conv2d(16, 32, 1)
        self.c4 = nn.Conv2d(32, 8, 1)

    def forward(self, x):
        a = F.relu(self.c1(x))
        b = torch.sigmoid(self.c2(a)) * a
        c = F.relu(self.c3(b))
        return self.c4(c) + b[:, :8]


def _same_as_eager(y, ref, amp):
    assert y.shape == ref.shape and y.stride() == ref.stride() and y.dtype == ref.dtype
    tol = 3e-2 if amp else 1e-4
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
def test_pooled_buffers_come_from_an_arena_after_the_first_call(amp, mode):
    from cpu_layout.codegen import program

    torch.manual_seed(0)
    model = Pooled().eval()
    fn = compile_cpp(model)
    grad = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
    xs = [torch.randn(2, 3, 24, 24) for _ in range(3)]
    with grad, torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        first = fn(xs[0])  # laid out from this call
        kept = first.clone()
        before = program.arena_takes()
        for x in xs * 2:
            _same_as_eager(fn(x), model(x), amp)
        assert program.arena_takes() - before >= 6, "every later call takes arena buffers"
        assert torch.equal(first, kept), "a result is never arena storage"
        program.set_arenas(False)
        try:
            fn(xs[1])  # switches at the end of this call
            before = program.arena_takes()
            for x in xs:
                _same_as_eager(fn(x), model(x), amp)
            assert program.arena_takes() == before
        finally:
            program.set_arenas(True)
        fn(xs[2])  # switches at its end
        fn(xs[1])  # laid out from this call
        before = program.arena_takes()
        _same_as_eager(fn(xs[0]), model(xs[0]), amp)
        assert program.arena_takes() > before, "laid out again once switched back on"


def test_calls_that_differ_from_the_arenas_first_call_take_blocks():
    """Other sizes (a dynamic batch) and other input strides (no conversion
    copy) allocate differently from the call the arena was laid out from:
    such a call takes blocks from its first difference on, and two of them in
    a row lay the arena out again."""
    from cpu_layout.codegen import program

    torch.manual_seed(0)
    model = Pooled().eval()
    fn = compile_cpp(model, dynamic=True)
    nchw = [torch.randn(n, 3, 20, 20) for n in (2, 3, 2, 2, 3, 3, 3)]
    with torch.no_grad():
        for x in nchw + [x.contiguous(memory_format=torch.channels_last) for x in nchw]:
            _same_as_eager(fn(x), model(x), False)
        x = torch.randn(5, 3, 20, 20)
        for _ in range(3):  # two that differ, then one laid out from
            _same_as_eager(fn(x), model(x), False)
        before = program.arena_takes()
        _same_as_eager(fn(x), model(x), False)
        assert program.arena_takes() > before


def test_arenas_can_be_switched_off_from_the_environment(tmp_path):
    """CPU_LAYOUT_ARENAS=0 (read when the runtime loads, so in a process of its
    own): every call takes blocks, and the values are eager's."""
    import subprocess
    import sys

    script = tmp_path / "no_arenas.py"
    script.write_text(
        "import torch\n"
        "from tests.test_cpp_wrapper import Pooled, compile_cpp\n"
        "from cpu_layout.codegen import program\n"
        "torch.manual_seed(0)\n"
        "model = Pooled().eval()\n"
        "fn = compile_cpp(model)\n"
        "with torch.no_grad():\n"
        "    for _ in range(4):\n"
        "        x = torch.randn(2, 3, 24, 24)\n"
        "        torch.testing.assert_close(fn(x), model(x), rtol=1e-4, atol=1e-4)\n"
        "print('arena takes', program.arena_takes())\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "CPU_LAYOUT_ARENAS": "0", "PYTHONPATH": root}
    got = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                         cwd=root, timeout=600)
    assert got.returncode == 0, got.stderr[-2000:]
    assert "arena takes 0" in got.stdout, got.stdout


def test_segments_run_concurrently_from_several_threads(compiled_graphs):
    from concurrent.futures import ThreadPoolExecutor

    model = Plain(layers=3).eval()
    fn = compile_cpp(model)
    xs = [torch.randn(1 + i % 3, 16, 12, 12) for i in range(24)]
    refs = [model(x) for x in xs]
    fn(xs[0])
    def run(x):
        with torch.no_grad():  # grad mode is per thread
            return fn(x)

    with ThreadPoolExecutor(max_workers=4) as ex:
        outs = list(ex.map(run, xs))
    for y, ref in zip(outs, refs):
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)


def test_an_error_inside_a_segment_is_a_python_exception(compiled_graphs):
    model = Plain(layers=2).eval()
    compile_cpp(model)(torch.randn(1, 16, 8, 8))
    env = compiled_graphs[0].__globals__
    seg = next(v for v in env.values() if isinstance(v, runtime.SegmentCall))
    pack = next(v for v in env.values() if isinstance(v, runtime.ConstantPrologue)).value[-1]
    # Tensors that do not match what the segment was compiled for are refused on entry.
    with pytest.raises(RuntimeError, match="cpu_layout: input .*size 5 at dim 1, compiled for 16"):
        seg([torch.randn(1, 5, 8, 8)], pack)
    with pytest.raises(RuntimeError, match="cpu_layout: input .*dtype"):
        seg([torch.randn(1, 16, 8, 8, dtype=torch.bfloat16)], pack)
    with pytest.raises(RuntimeError, match="cpu_layout: input .*expected 4 dims"):
        seg([torch.randn(16, 8, 8)], pack)
    y = seg([torch.randn(1, 16, 8, 8)], pack)  # and the segment still works afterwards
    assert y[0].shape == (1, 16, 8, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_format", ["contiguous", "channels_last"])
@pytest.mark.parametrize("size", [(5, 6), (10, 12), (13, 7)], ids=["same", "x2", "odd"])
def test_own_nearest_upsample_is_bit_identical_to_atens(size, in_format, dtype, compiled_graphs):
    fmt = torch.channels_last if in_format == "channels_last" else torch.contiguous_format
    x = torch.randn(2, 4, 5, 6, dtype=dtype).contiguous(memory_format=fmt)
    fn = compile_cpp(lambda t: F.interpolate(t, size=size, mode="nearest"))
    y, ref = fn(x), F.interpolate(x, size=size, mode="nearest")
    assert torch.equal(y, ref) and y.stride() == ref.stride()
    seg = next(n for n in compiled_graphs[0].cpu_layout_graph.nodes if isinstance(n, ir.Segment))
    targets = [getattr(m, "target", None) for m in seg.members]
    assert torch.ops.aten.upsample_nearest2d.default in targets, targets


def _eval_rpn(tokens, values):
    """The segment runtime's stack machine (csrc/segment_vm.cpp: Run::expr), in Python."""
    from cpu_layout.codegen import sizes as S

    st, i = [], 0
    while i < len(tokens):
        t = tokens[i]
        if t in (S.T_CONST, S.T_SYM):
            st.append(tokens[i + 1] if t == S.T_CONST else values[tokens[i + 1]])
            i += 2
            continue
        b, a = st.pop(), st.pop()
        st.append({S.T_ADD: lambda: a + b, S.T_MUL: lambda: a * b, S.T_FLOORDIV: lambda: a // b,
                   S.T_MOD: lambda: a % b, S.T_MAX: lambda: max(a, b), S.T_MIN: lambda: min(a, b),
                   S.T_CEILDIV: lambda: -(-a // b)}[t]())
        i += 1
    assert len(st) == 1
    return st[0]


def test_size_expressions_become_runtime_tokens():
    import sympy
    from torch.utils._sympy.functions import CeilDiv, FloorDiv, Mod

    from cpu_layout.codegen import sizes

    s0, s1 = sympy.symbols("s0 s1", integer=True, positive=True)
    slot = {s0: 0, s1: 1}.__getitem__
    for e in (FloorDiv(s0 - 1, 2) + 1, s0 * s1, 3 * s0 ** 2 - s1, CeilDiv(s0, 3) + Mod(s1, 4),
              sympy.Max(s0, s1 + 2) - sympy.Min(s0, 5), FloorDiv(-s0 - 3, 4)):
        toks = sizes.rpn(e, slot)
        for v in ((1, 1), (7, 3), (12, 30)):
            assert _eval_rpn(toks, v) == int(e.subs({s0: v[0], s1: v[1]})), (e, v)
    with pytest.raises(NotImplementedError):
        sizes.rpn(sympy.sin(s0), slot)


def test_kernels_compile_in_one_unit_per_core(monkeypatch):
    units = []
    real = cpp_kernels.build.load_library
    monkeypatch.setattr(cpp_kernels.build, "load_library", lambda src, cdef, **kw: units.append(src) or real(src, cdef, **kw))
    monkeypatch.setattr(cpp_kernels, "_units", lambda n: max(1, min(2, n // cpp_kernels.KERNELS_PER_UNIT)))
    specs = [cpp_kernels.PointwiseKernel([torch.float32], [(Op("add", (Load(0), Const(float(i)))), torch.float32)], 1)
             for i in range(20)]
    runners = cpp_kernels.compile_library(specs + specs[:3])
    assert len(units) == 2, "20 kernels in two units"
    x = torch.randn(37)
    for i, r in enumerate(runners):
        out = torch.empty_like(x)
        r([37], [x], [out])
        torch.testing.assert_close(out, x + float(i % 20), rtol=0, atol=0)


def test_a_graph_compiles_only_its_kernels(monkeypatch):
    from cpu_layout.codegen import program

    program.runtime()  # built once per machine, not per graph
    calls = []
    real = cpp_kernels.build.load_library

    def spy(source, cdef, **kw):
        calls.append(source)
        return real(source, cdef, **kw)

    monkeypatch.setattr(cpp_kernels.build, "load_library", spy)
    model, x = models.build("mobilenet_v3")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(x)
        y = compile_cpp(model)(x)
    torch.testing.assert_close(y, ref, rtol=2e-2, atol=5e-2)
    assert 1 <= len(calls) <= cpp_kernels._units(10**6), "one compiler run per core at most"
    assert all("CL_KERNEL_PREAMBLE" in c and "clw::" not in c for c in calls), "kernels, no segment glue"


def test_the_segment_runtime_refuses_a_malformed_program():
    from cpu_layout.codegen import program

    bad = program.Program()
    bad.code = [999, 0]  # no such opcode
    with pytest.raises(RuntimeError, match="malformed at word 0"):
        bad.load([])
    short = program.Program()
    short.code = [program.OP["RESET"], 3, 0, 0, 0]  # operands outside the program
    short.code = short.code[:-1]
    with pytest.raises(RuntimeError, match="malformed"):
        short.load([])


def test_an_instruction_with_the_wrong_operand_count_is_an_error_not_a_crash():
    from cpu_layout import runtime as R
    from cpu_layout.codegen import program

    p = program.Program()
    p.n_in = 1
    p.reg()
    p.op("RESET", 0, 0)  # RESET reads one operand
    call = R.SegmentCall("bad", 0)
    call.bind(p, [])
    with pytest.raises(RuntimeError, match="RESET|wrong operand count"):
        call([torch.randn(2)], program.runtime().ffi.new("int64_t[]", [0]))
    p2 = program.Program()
    p2.n_in = 1
    p2.reg()
    p2.op("OUT", 0, 0)
    ok = R.SegmentCall("good", 1)
    ok.bind(p2, [])
    x = torch.randn(3)
    (y,) = ok([x], program.runtime().ffi.new("int64_t[]", [0]))
    assert y.data_ptr() == x.data_ptr(), "OUT hands the input's handle back"


def test_log_program_prints_each_segments_instructions(monkeypatch, capfd):
    monkeypatch.setenv("CPU_LAYOUT_LOG", "program")
    model = Plain(layers=2).eval()
    x = torch.randn(1, 16, 8, 8)
    torch.testing.assert_close(compile_cpp(model)(x), model(x), rtol=1e-4, atol=1e-4)
    err = capfd.readouterr().err
    assert "cl_segment_0:" in err and "\nCONV " in err, err[-2000:]
    assert "\nOUT 0 " in err or "\nOUT_EAGER 0 " in err, err[-2000:]


def test_the_encoders_opcodes_are_the_runtimes():
    import re

    from cpu_layout.codegen import program

    src = build.csrc("segment_vm.cpp")
    body = re.search(r"enum Op : int64_t \{(.*?)\};", src, re.S).group(1)
    names = [n.split("=")[0].strip() for n in body.replace("\n", " ").split(",") if n.strip()]
    assert names[-1] == "N_OPS" and "EXPECT = 1" in body
    assert names[:-1] == list(program.OPS), "program.OPS must list csrc/segment_vm.cpp's enum Op in order"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("what", ["segment runtime", "state check"])
def test_a_child_forked_during_a_background_build_can_build_it(what):
    from cpu_layout import state_key
    from cpu_layout.codegen import program

    once = program._RUNTIME if what == "segment runtime" else state_key._CHECK
    with once._lock:  # as if the background build were running at fork time
        pid = os.fork()
        if pid == 0:  # the child: the lock must be usable, the library loadable
            code = 1
            try:
                got = once._lock.acquire(timeout=5)
                once._lock.release()
                code = 0 if got and once.get() else 2
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0, "the child inherited a held lock"


def test_the_runtime_times_each_instruction_it_runs_only_while_asked():
    from cpu_layout.codegen import program

    model = Plain(layers=3).eval()
    x = torch.randn(1, 16, 8, 8)
    fn = compile_cpp(model)
    fn(x)
    program.take_profile()
    fn(x)
    segs = list(runtime.SegmentCall.live)
    for seg in segs:
        seg.take_node_profile()
    assert program.take_profile() == {}, "profiling is off by default"
    assert not any(t for seg in segs for _, t in seg.take_node_profile())
    program.set_profiling(True)
    try:
        for _ in range(3):
            fn(x)
    finally:
        program.set_profiling(False)
    prof = program.take_profile()
    assert prof["run"][1] == 3 and prof["CONV"][1] == 3 * 3, prof
    assert all(t >= 0 for t, _ in prof.values())
    assert prof["run"][0] >= sum(t for op, (t, _) in prof.items() if op != "run")
    assert program.take_profile() == {}, "taking the counters zeroes them"
    # Per node: each of the segment's three convs named, with its instructions' time.
    ran = [p for p in (seg.take_node_profile() for seg in segs) if any(t for _, t in p)]
    assert len(ran) == 1, "one segment ran"
    nodes = ran[0]
    convs = [(what, t) for what, t in nodes if what.startswith("Conv ")]
    assert len(convs) == 3 and all(t > 0 for _, t in convs), nodes
    assert all("[1, 16, 8, 8]" in what and "3x3" in what for what, _ in convs), convs
    assert sum(t for _, t in nodes) <= prof["run"][0]
    assert sum(t for _, t in convs) >= prof["CONV"][0]
    assert not any(t for seg in segs for _, t in seg.take_node_profile()), "taking zeroes them"


def test_op_table_entries_are_whole():
    """Every ATen op a segment admits has instructions, every rule is a rule
    the planner and wrappers know, and every element-wise op's post-op is one
    the conv path has."""
    from cpu_layout.codegen import expr

    for target, spec in op_table.OPS.items():
        assert spec.rule in (ir.FOLLOW, ir.VIEW, ir.DENSE, ir.EAGER), target
        assert (spec.in_cpp is None) == (spec.encode is None), target
        assert spec.priced in (None, "max", "avg", "concat"), target
    seen = set()
    for name, op in expr.OPS.items():
        assert not seen & set(op.aten), f"{name}: an ATen op lowered to two element-wise ops"
        seen |= set(op.aten)
        args = [f"in{i}" for i in range(op.arity)]
        # pow has no default exponent, (de)quantization no default scale
        params = {"pow": (2.5,), "dequant": (0.1, 3), "quant": (0.1, 3, 0, 255)}.get(name, ())
        defaults = expr.Op(name, tuple(expr.Load(i) for i in range(op.arity)), params).params
        code = op.cpp.format(*args) if isinstance(op.cpp, str) else op.cpp(args, defaults)
        assert all(a in code for a in args), (name, code)
        if op.post_op is not None:
            po = op.post_op(defaults)
            assert (po if isinstance(po, str) else po[0]) in ops.POST_OPS, name


def test_squeeze_is_a_view_in_the_segment(compiled_graphs):
    """squeeze.dim is a view in the plan and the segment's reshape to its result's
    sizes: the whole graph is one segment, values and strides eager's."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 8, 3, padding=1)

        def forward(self, x):
            y = self.conv(x).mean(dim=(2, 3), keepdim=True)  # [N, 8, 1, 1]
            return torch.relu(y.squeeze(3))

    m = M().eval()
    x = torch.randn(2, 4, 9, 9)
    with torch.no_grad():
        ref = m(x)
        out = compile_cpp(m)(x)
    torch.testing.assert_close(out, ref)
    assert out.shape == ref.shape and out.stride() == ref.stride()
    nodes = compiled_graphs[0].cpu_layout_graph.nodes
    segments = [n for n in nodes if isinstance(n, ir.Segment)]
    assert len(segments) == 1
    squeeze = [n for n in segments[0].members if isinstance(n, ir.Aten) and n.target is torch.ops.aten.squeeze.dim]
    assert len(squeeze) == 1 and squeeze[0].rule == ir.VIEW


@contextlib.contextmanager
def _compiled_region(grad_mode):
    """The grad mode a test runs its model under, with an eager fallback an error."""
    mode = torch.inference_mode() if grad_mode == "inference_mode" else torch.no_grad()
    with mode, warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*eagerly.*")
        yield


class OverModuleState(nn.Module):
    """A conv filtering a buffer, and swin_v2's position-bias MLP: linears over a
    coordinate table. Both read module state as their activation."""

    def __init__(self):
        super().__init__()
        self.register_buffer("grid", torch.randn(1, 8, 6, 6))
        self.register_buffer("coords", torch.randn(36, 2))
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.mlp = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 8))
        self.head = nn.Conv2d(8, 8, 1)

    def forward(self, x):
        bias = self.mlp(self.coords).t().reshape(1, 8, 6, 6)
        return self.head(x) + self.conv(self.grid) + bias


@pytest.mark.parametrize("cpp", [False, True])
@pytest.mark.parametrize("grad_mode", ["inference_mode", "no_grad"])
def test_module_state_as_an_activation(cpp, grad_mode, compiled_graphs):
    """They compile (no eager fallback) and match eager; in C++ the conv reads
    the buffer through a handle of the segment's constants."""
    model = OverModuleState().eval()
    x = torch.randn(2, 8, 6, 6)
    with _compiled_region(grad_mode):
        ref = model(x)
        fn = torch.compile(model, backend="cpu_layout", options={"cpp_wrapper": cpp})
        y = fn(x)
        y = fn(x)  # the second call, on the memoized constants
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    assert y.shape == ref.shape and y.stride() == ref.stride()
    g = compiled_graphs[0].cpu_layout_graph
    assert not any(isinstance(n, ir.Conv) and n.linear for n in g.nodes), "the MLP is a constant node"
    if cpp:
        convs = [m for n in g.nodes if isinstance(n, ir.Segment) for m in n.members if isinstance(m, ir.Conv)]
        assert any(c.x.constant for c in convs), "the conv over the buffer runs in a segment"


class StandardizedConv(nn.Module):
    """nfnet's weight standardisation: var_mean of the weight (a tuple of module
    state) in the forward."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 4, 3, 3))
        self.gain = nn.Parameter(torch.rand(8, 1, 1, 1) + 0.5)

    def forward(self, x):
        var, mean = torch.var_mean(self.weight, dim=(1, 2, 3), keepdim=True, unbiased=False)
        w = (self.weight - mean) * torch.rsqrt(var + 1e-5) * self.gain
        return F.relu(F.conv2d(x, w, padding=1))


@pytest.mark.parametrize("grad_mode", ["inference_mode", "no_grad"])
def test_an_element_of_a_tuple_of_module_state_is_module_state(grad_mode):
    model = StandardizedConv().eval()
    x = torch.randn(2, 4, 10, 10)
    with _compiled_region(grad_mode):
        fn = compile_cpp(model)
        y = fn(x)
        ref = model(x)
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
        assert y.stride() == ref.stride()
        model.weight.mul_(2.0)  # the standardised weight is recomputed, once
        y2, ref2 = fn(x), model(x)
    torch.testing.assert_close(y2, ref2, rtol=1e-4, atol=1e-4)


class NormOfASlice(nn.Module):
    """layer_norm of a chunk along the normalised dim: a slice of a contiguous
    buffer, which the plan reads as it is (no copy planned)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        a, b = x.relu().chunk(2, dim=-1)
        return self.norm(a) + b


@pytest.mark.parametrize("cpp", [False, True])
@pytest.mark.parametrize("grad_mode", ["inference_mode", "no_grad"])
def test_layer_norm_of_a_slice_reads_the_slice(cpp, grad_mode):
    """The segment's layer_norm walked dense rows of the slice's storage (every
    other half-row of its parent) until it made the slice dense first."""
    model = NormOfASlice().eval()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 2.0)
        model.norm.bias.uniform_(-1.0, 1.0)
    x = torch.randn(4, 6, 16)
    with _compiled_region(grad_mode):
        ref = model(x)
        y = torch.compile(model, backend="cpu_layout", options={"cpp_wrapper": cpp})(x)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert y.shape == ref.shape and y.stride() == ref.stride()


class PoolOfAPiece(nn.Module):
    """Max and average pooling of the two channel halves of a conv's output."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 32, 3, padding=1)

    def forward(self, x):
        a, b = self.conv(x).chunk(2, dim=1)
        return F.max_pool2d(a, 3, 2, 1) + F.avg_pool2d(b, 3, 2, 1)


@pytest.mark.parametrize("grad_mode", ["inference_mode", "no_grad"])
def test_pooling_a_channel_slice_of_a_channels_last_input(grad_mode):
    """With a channels-last input each half is a slice in channels-last order (no
    copy planned); the generated pool walked it as if dense until the segment
    made it dense first."""
    model = PoolOfAPiece().eval()
    x = torch.randn(2, 8, 12, 12).to(memory_format=torch.channels_last)
    with _compiled_region(grad_mode):
        ref = model(x)
        y = compile_cpp(model)(x)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert y.shape == ref.shape and y.stride() == ref.stride()


class WindowAttention(nn.Module):
    """Swin's shifted-window block at a multiple of its window, cut down: a pad by
    nothing, a roll, the window partition (views and permutes), qkv as one linear
    and `select` of q, k, v, q @ k^T and p @ v (bmm on head-split views, matmul's
    expand to the same size), a mask built from `new_zeros` every forward, the
    reverse roll, and the patch merge's step-2 slices."""

    def __init__(self, c=8, heads=2, win=2, shift=1):
        super().__init__()
        self.heads, self.win, self.shift = heads, win, shift
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c)
        self.merge = nn.Linear(4 * c, 2 * c)

    def forward(self, x):  # x: [B, H, W, C]
        b, h, w, c = x.shape
        win, s, nh = self.win, self.shift, self.heads
        x = F.pad(x, (0, 0, 0, (win - w % win) % win, 0, (win - h % win) % win))
        y = torch.roll(x, shifts=(-s, -s), dims=(1, 2))
        y = y.view(b, h // win, win, w // win, win, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, win * win, c)
        qkv = self.qkv(y).reshape(y.size(0), win * win, 3, nh, c // nh).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = q.matmul(k.transpose(-2, -1)) * (c // nh) ** -0.5
        mask = x.new_zeros((h, w))
        for i, hs in enumerate(((0, -win), (-win, -s), (-s, None))):
            mask[hs[0]:hs[1], :] = i
        mask = mask.view(h // win, win, w // win, win).permute(0, 2, 1, 3).reshape(-1, win * win)
        mask = (mask.unsqueeze(1) - mask.unsqueeze(2)).masked_fill(
            mask.unsqueeze(1) != mask.unsqueeze(2), -100.0)
        attn = (attn.view(b, -1, nh, win * win, win * win) + mask.unsqueeze(1).unsqueeze(0)).softmax(-1)
        y = attn.view(-1, nh, win * win, win * win).matmul(v).transpose(1, 2).reshape(-1, win * win, c)
        y = self.proj(y).view(b, h // win, w // win, win, win, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)
        x = x + torch.roll(y, shifts=(s, s), dims=(1, 2))
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1)
        return self.merge(x)


def _in_one_segment_call(fn, shape, monkeypatch, what):
    """fn's result on a new input of `shape` after a first call laid it out, checked to
    be one segment call with no node run from Python: (input, result)."""
    fn(torch.randn(shape))
    _no_python_runners(monkeypatch)
    x = torch.randn(shape)
    before = runtime.SegmentCall.calls
    got = fn(x)
    assert runtime.SegmentCall.calls - before == 1, f"{what} split the segment"
    return x, got


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_window_attention_runs_in_one_segment(mode, monkeypatch):
    """Each op of the block has a segment instruction (or is a constant, or
    nothing): one foreign call per forward, values and strides as eager's."""
    torch.manual_seed(0)
    model = WindowAttention().eval()
    fn = compile_cpp(model)
    grad = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
    with grad:
        x, got = _in_one_segment_call(fn, (2, 4, 6, 8), monkeypatch, "an op of the block")
        ref = model(x)
    assert got.shape == ref.shape and got.stride() == ref.stride()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shifts,dims", [((1, -2), (1, 2)), (3, 0), ((0, 7), (2, 3)), ((-1,), (-1,)),
                                         ((9, -11, 2, 1), (0, 1, 2, 3))])
def test_roll_and_strided_slices_match_atens(shifts, dims, monkeypatch):
    """The segment's roll (2^k block copies; shifts beyond the size, zero and
    negative) and step-k slices: bit-identical to ATen's, same strides, no
    Python node."""
    def f(x):
        y = torch.roll(x * 2, shifts, dims)
        return y[:, :, 1::2, ::3] + 1, y[1:, 2::2]
    x, got = _in_one_segment_call(compile_cpp(f), (2, 3, 5, 7), monkeypatch, "the roll or a slice")
    for g, r in zip(got, f(x)):
        assert g.stride() == r.stride()
        assert torch.equal(g, r)


def test_packed_projection_split_by_squeeze_runs_in_the_segment(monkeypatch):
    """torch's MHA splits its packed q/k/v projection with unflatten, unsqueeze,
    transpose and squeeze(-2) (vit_b_16 ran 13 segments a forward, one per
    layer's squeeze): the squeeze is a view in the segment, values and strides
    as eager's."""
    def f(x):
        proj = (x * 2).unflatten(-1, (3, 4)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
        q, k, v = proj[0], proj[1], proj[2]
        return q * 2 + k - v, proj.squeeze(-2)
    x, got = _in_one_segment_call(compile_cpp(f), (2, 5, 12), monkeypatch, "the squeeze")
    for g, r in zip(got, f(x)):
        assert g.shape == r.shape and g.stride() == r.stride()
        assert torch.equal(g, r)
