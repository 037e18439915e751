"""The layout model end to end: what the plan decides is what runs.

- The copies the wrappers make at run time are the plan's executed copies
  (one per buffer and order, shared by its readers), for every built-in model
  and for torchvision's layout-sensitive ones, in both wrappers (C++ segments
  count their conversions into runtime.COPIES).
- View ops alias whatever layout their input has (a ConvNeXt permute of a
  channels-last conv is free); layer_norm is a generated kernel and matmuls
  read their inputs as they are, so a ConvNeXt block plans and runs with no
  copy and is one C++ segment.
Values and strides against eager in fp32 and AMP, under no_grad and
inference_mode, both wrappers.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cpu_layout import ir, models, ops, runtime, zoo

pytestmark = pytest.mark.usefixtures("strict_compile")


def compile_run(model, x, amp, compiled_graphs, grad="no_grad", cpp=False, calls=2, dynamic=False):
    """Eager's result, ours, and the runtime copies of the last call."""
    mode = torch.inference_mode() if grad == "inference_mode" else torch.no_grad()
    with mode, torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        ref = model(x)
        fn = torch.compile(model, backend="cpu_layout", dynamic=dynamic,
                           options={"debug": True, "cpp_wrapper": cpp})
        for _ in range(calls):
            before = runtime.COPIES["count"]
            y = fn(x)
    return ref, y, runtime.COPIES["count"] - before


def assert_same(y, ref, amp):
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert y.stride() == ref.stride(), "output strides must be eager's"
    scale = ref.float().abs().max().item() or 1.0
    tol = 3e-2 if amp else 1e-4
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol * scale)


def planned_copies(compiled_graphs):
    return sum(len(c.cpu_layout_graph.plan.executed_copies) for c in compiled_graphs)


class Chains(nn.Module):
    """Element-wise chains after a conv: one fuses whole (mul -> add -> relu),
    one is cut where a value is also an output, one where a value has two readers."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        a = torch.relu(y * 0.5 + 1.0)
        b = y - 2.0
        c = torch.sigmoid(b) * 3.0
        d = y * y
        return a, b, c, d + d.exp()


@pytest.mark.parametrize("cpp", [False, True], ids=["py", "cpp"])
def test_the_plan_prices_the_kernels_fusion_makes(cpp, compiled_graphs, monkeypatch):
    from cpu_layout.plan import ir_plan

    built = []
    real = ir_plan.to_planner_graph

    def spy(g, *args, **kwargs):
        built.append(real(g, *args, **kwargs))
        return built[-1]

    monkeypatch.setattr(ir_plan, "to_planner_graph", spy)
    model = Chains().eval()
    x = torch.randn(1, 3, 10, 10)
    ref, y, _ = compile_run(model, x, False, compiled_graphs, cpp=cpp)
    for got, want in zip(y, ref):
        assert_same(got, want, False)
    (graph,) = [c.cpu_layout_graph for c in compiled_graphs]
    nodes = [m for n in graph.nodes for m in (n.members if isinstance(n, ir.Segment) else [n])]
    kernels = [n for n in nodes if isinstance(n, ir.Kernel)]
    priced = [n for n in built[-1] if n.kind == "pointwise" and not n.fused_into_user]
    assert len(kernels) == len(priced) and sum(k.members for k in kernels) == len(
        [n for n in built[-1] if n.kind == "pointwise"]), [n.name for n in priced]
    assert len(kernels) >= 4, "the output and the second reader cut chains"


@pytest.mark.parametrize("cpp", [False, True], ids=["py", "cpp"])
# Dynamic shapes in fp32 only: autocast's casts change no copy, and CI time is shared.
@pytest.mark.parametrize("amp,dynamic", [(False, False), (True, False), (False, True)],
                         ids=["fp32", "amp", "fp32-dynamic"])
@pytest.mark.parametrize("name", list(models.MODELS))
def test_builtin_models_make_exactly_the_plans_copies(name, amp, dynamic, cpp, compiled_graphs):
    model, x = models.build(name)
    ref, y, copies = compile_run(model, x, amp, compiled_graphs, cpp=cpp, dynamic=dynamic)
    assert_same(y, ref, amp)
    assert copies == planned_copies(compiled_graphs), compiled_graphs[0].cpu_layout_graph.plan.explain()


TORCHVISION = ["convnext_tiny", "shufflenet_v2_x1_0", "swin_t"]


@pytest.mark.parametrize("cpp", [False, True], ids=["py", "cpp"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
@pytest.mark.parametrize("name", TORCHVISION)
def test_torchvision_models_make_exactly_the_plans_copies(name, amp, cpp, compiled_graphs):
    if zoo.import_torchvision() is None:
        pytest.skip("torchvision is not installed")
    model = zoo.build("torchvision", name)
    x = zoo.example_input((1, 3, 64, 64))
    ref, y, copies = compile_run(model, x, amp, compiled_graphs, cpp=cpp)
    assert_same(y, ref, amp)
    assert copies == planned_copies(compiled_graphs), compiled_graphs[0].cpu_layout_graph.plan.explain()


class ConvNeXtBlock(nn.Module):
    """torchvision's CNBlock: depthwise conv, permute to NHWC, layer_norm, MLP
    of linears with GELU, permute back, layer scale, residual."""

    def __init__(self, dim=32):
        super().__init__()
        self.dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.scale = nn.Parameter(torch.rand(dim, 1, 1) + 0.5)

    def forward(self, x):
        y = self.dw(x).permute(0, 2, 3, 1)
        y = self.fc2(F.gelu(self.fc1(self.norm(y)))).permute(0, 3, 1, 2)
        return x + self.scale * y


class ConvNeXtStage(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 4, stride=4)
        self.blocks = nn.Sequential(ConvNeXtBlock(dim), ConvNeXtBlock(dim))

    def forward(self, x):
        return self.blocks(self.stem(x))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("cpp", [False, True], ids=["default", "cpp"])
@pytest.mark.parametrize("grad", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
def test_convnext_blocks_run_without_copies(amp, grad, cpp, dynamic, compiled_graphs):
    # Under dynamic shapes too: there a view's sizes are read from its input by
    # size queries, which must neither hide the layer norm's contiguous result
    # (its strides read Max(1, s)) nor keep the GELU out of its linear.
    model = ConvNeXtStage().eval()
    x = torch.randn(2, 3, 32, 32)
    ref, y, copies = compile_run(model, x, amp, compiled_graphs, grad=grad, cpp=cpp, dynamic=dynamic)
    assert_same(y, ref, amp)
    if dynamic:
        x2 = torch.randn(3, 3, 40, 40)  # square as the first: Dynamo gave H and W one symbol
        mode = torch.inference_mode() if grad == "inference_mode" else torch.no_grad()
        with mode, torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            assert_same(torch.compile(model, backend="cpu_layout", dynamic=True,
                                      options={"debug": True, "cpp_wrapper": cpp})(x2), model(x2), amp)
        assert len(compiled_graphs) == 1, "another size must not recompile"
    g = compiled_graphs[0].cpu_layout_graph
    plan = g.plan
    # Only the graph's edges convert (its input to the convs' channels-last, its
    # output to eager's contiguous); every permute inside is an alias, every
    # layer_norm and linear reads what it is given. Converting the stem's output
    # instead of its 3-channel input is a near-tie the measured costs may tip
    # either way (2.2 against 3 us), so the stem's output counts as an edge.
    edge = {n.out.name for n in g.walk() if isinstance(n, ir.Input) or (  # the input or its AMP cast
        isinstance(n, ir.Kernel) and all(isinstance(b.producer, ir.Input) for b in n.inputs))}
    edge |= {c.out.name for c in g.convs() if c.x.name in edge}
    inner = [c for c in plan.executed_copies
             if c.source not in edge and not all(u.startswith("output") for u in c.consumers)]
    assert not inner, plan.explain()
    assert len([n for n in g.walk() if isinstance(n, ir.LayerNorm)]) == 2
    # Each linear is a 1x1 conv on oneDNN, the first with its GELU fused.
    assert not [n for n in g.walk() if isinstance(n, ir.Aten) and n.rule == ir.DENSE], g.dump()
    assert sorted(len(c.post_ops) for c in g.convs()) == [0] * 5 + [1] * 2, g.dump()
    if cpp:  # everything runs in C++: one segment, one foreign call per forward
        assert [type(n) for n in g.nodes if not isinstance(n, (ir.Input, ir.Output, ir.Getitem))] == \
            [ir.Aten, ir.Segment], g.dump()
    assert copies == len(plan.executed_copies)


@pytest.mark.parametrize("cpp", [False, True], ids=["default", "cpp"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
def test_view_that_cannot_alias_copies_once_and_matches_eager(amp, cpp, compiled_graphs):
    """flatten of a channels-last conv result is no view: one planned copy,
    then a linear; and a transpose feeding a matmul is read in place."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 16, 3, padding=1)
            self.fc = nn.Linear(16 * 8 * 8, 10)

        def forward(self, x):
            y = torch.relu(self.conv(x))
            z = self.fc(y.flatten(1))
            return z, y.mean((2, 3)) @ self.fc.weight[:, :16].t()

    model = M().eval()
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    ref, y, copies = compile_run(model, x, amp, compiled_graphs, cpp=cpp)
    for a, b in zip(y, ref):
        assert_same(a, b, amp)
    assert copies == planned_copies(compiled_graphs)


@pytest.mark.parametrize("cpp", [False, True], ids=["default", "cpp"])
def test_a_conversion_read_by_two_ops_is_made_once(cpp, compiled_graphs):
    """Two layout-sensitive readers of one channels-last buffer that want it
    contiguous share one copy (the plan prices one)."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, x):
            y = self.conv(x)
            return torch.cumsum(y, 1), torch.cumsum(y, 2)  # EAGER reads, eager's order

    model = M().eval()
    x = torch.randn(2, 8, 16, 16).to(memory_format=torch.channels_last)
    ref, y, copies = compile_run(model, x, False, compiled_graphs, cpp=cpp)
    for a, b in zip(y, ref):
        assert_same(a, b, False)
    plan = compiled_graphs[0].cpu_layout_graph.plan
    src = compiled_graphs[0].cpu_layout_source
    assert copies == len(plan.executed_copies)
    if not cpp:
        assert src.count("to_order(") == len(plan.executed_copies), src


@pytest.mark.parametrize("cpp", [False, True], ids=["default", "cpp"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
def test_linear_layers_with_a_dynamic_batch(amp, cpp, compiled_graphs):
    """A symbolic row count runs on oneDNN as with static sizes (1x1 convs whose
    views say -1 for the rows), the GELU fused; values and strides eager's, three
    batch sizes, one compile, no matmul left on ATen."""
    model = nn.Sequential(nn.Linear(24, 48), nn.GELU(), nn.Linear(48, 8)).eval()
    for grad_mode in (torch.no_grad, torch.inference_mode):
        torch._dynamo.reset()
        compiled_graphs.clear()
        with grad_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            fn = torch.compile(model, backend="cpu_layout", options={"debug": True, "cpp_wrapper": cpp})
            for batch in (4, 7, 2):
                xb = torch.randn(batch, 6, 24)
                torch._dynamo.mark_dynamic(xb, 0)
                assert_same(fn(xb), model(xb), amp)
        assert len(compiled_graphs) == 1
        g = compiled_graphs[0].cpu_layout_graph
        convs = g.convs()
        assert [c.linear for c in convs] == [True, True], g.dump()
        assert convs[0].post_ops == ["gelu"] and not convs[1].post_ops, g.dump()
        assert not [n for n in g.walk() if isinstance(n, ir.Aten) and n.rule == ir.DENSE], g.dump()


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
def test_torchvision_convnext_is_one_cpp_segment(amp, dynamic, compiled_graphs):
    """The whole of torchvision's ConvNeXt (permutes, layer norms, linears, its
    head's as_strided, whose sizes and strides follow the batch under dynamic
    shapes) runs in one C++ call per forward."""
    if zoo.import_torchvision() is None:
        pytest.skip("torchvision is not installed")
    model = zoo.build("torchvision", "convnext_tiny")
    x = zoo.example_input((2 if dynamic else 1, 3, 32, 32))
    ref, y, _ = compile_run(model, x, amp, compiled_graphs, cpp=True, calls=1, dynamic=dynamic)
    assert_same(y, ref, amp)
    g = compiled_graphs[0].cpu_layout_graph
    assert [type(n) for n in g.nodes if not isinstance(n, (ir.Input, ir.Output, ir.Getitem))] == \
        [ir.Aten, ir.Segment], g.dump()
    if dynamic:
        x3 = zoo.example_input((3, 3, 32, 32))  # (its 32 px compile guards the spatial size)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            fn = torch.compile(model, backend="cpu_layout", dynamic=True,
                               options={"debug": True, "cpp_wrapper": True})  # compile_run's
            assert_same(fn(x3), model(x3), amp)
        assert len(compiled_graphs) == 1, "another size must not recompile"


class ShuffleBlock(nn.Module):
    """A ShuffleNet unit: chunk, a conv branch, cat, then the channel shuffle
    written as eager code does (view, transpose, contiguous, view)."""

    def __init__(self, c=16, groups=2, transpose=(1, 2)):
        super().__init__()
        self.groups, self.transpose = groups, transpose
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.branch = nn.Sequential(nn.Conv2d(c // 2, c // 2, 1), nn.ReLU(),
                                    nn.Conv2d(c // 2, c // 2, 3, padding=1, groups=c // 2))
        self.head = nn.Conv2d(c, c, 1)

    def forward(self, x):
        y = self.stem(x)
        a, b = y.chunk(2, dim=1)
        y = torch.cat((a, self.branch(b)), dim=1)
        n, c, h, w = y.shape
        y = y.view(n, self.groups, c // self.groups, h, w).transpose(*self.transpose).contiguous()
        return self.head(y.view(n, c, h, w))


def _nodes(compiled_graphs):
    """Every node run, segment members included."""
    return [m for c in compiled_graphs for n in c.cpu_layout_graph.nodes
            for m in (n.members if isinstance(n, ir.Segment) else [n])]


def _targets(compiled_graphs):
    return [getattr(n, "target", None) for n in _nodes(compiled_graphs)]


@pytest.mark.parametrize("cpp", [False, True], ids=["py", "cpp"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
@pytest.mark.parametrize("grad", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("groups", [2, 4])
@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
def test_channel_shuffle_is_one_layout_agnostic_op(fmt, groups, grad, amp, cpp, compiled_graphs, monkeypatch):
    """The view-transpose-contiguous-view pattern lowers to ops.channel_shuffle
    (no clone pins it to contiguous); in C++ it runs inside the one segment."""
    model = ShuffleBlock(groups=groups).eval()
    x = torch.randn(2, 3, 12, 10).to(memory_format=fmt)
    if cpp:
        calls = []
        real = runtime.SegmentCall.__call__
        monkeypatch.setattr(runtime.SegmentCall, "__call__", lambda s, *a: calls.append(s) or real(s, *a))
    ref, y, copies = compile_run(model, x, amp, compiled_graphs, grad=grad, cpp=cpp)
    assert_same(y, ref, amp)
    targets = _targets(compiled_graphs)
    assert ops.channel_shuffle in targets
    assert torch.ops.aten.clone.default not in targets
    if cpp:
        assert len(calls) == 2  # one foreign call per forward
    else:
        # Not asserted in C++: there the branch conv copies its strided chunk piece dense,
        # a copy the plan does not price (a channel slice of NHWC is in order, not dense).
        assert copies == planned_copies(compiled_graphs), compiled_graphs[0].cpu_layout_graph.plan.explain()


@pytest.mark.parametrize("cpp", [False, True], ids=["py", "cpp"])
def test_a_transpose_that_is_not_a_channel_shuffle_stays_as_written(cpp, compiled_graphs):
    model = ShuffleBlock(transpose=(3, 4)).eval()  # swaps height and width instead
    x = torch.randn(2, 3, 8, 8)
    ref, y, _ = compile_run(model, x, False, compiled_graphs, cpp=cpp)
    assert_same(y, ref, False)
    assert ops.channel_shuffle not in _targets(compiled_graphs)



class ShuffleThenChunk(nn.Module):
    """ShuffleNet's order: shuffle, then chunk the result; each piece feeds a conv
    (or, with `piece_out`, the first piece is also a result of the graph)."""

    def __init__(self, c=16, piece_out=False):
        super().__init__()
        self.piece_out = piece_out
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.a, self.b = nn.Conv2d(c // 2, c // 2, 1), nn.Conv2d(c // 2, c // 2, 3, padding=1, groups=c // 2)

    def forward(self, x):
        y = self.stem(x)
        n, c, h, w = y.shape
        y = y.view(n, 2, c // 2, h, w).transpose(1, 2).contiguous().view(n, c, h, w)
        p, q = y.chunk(2, dim=1)
        z = torch.cat((self.a(p), self.b(q)), dim=1)
        return (z, p) if self.piece_out else z


def _shuffles(compiled_graphs):
    return sorted(tuple(n.args[1:]) for n in _nodes(compiled_graphs) if getattr(n, "target", None) is ops.channel_shuffle)


@pytest.mark.parametrize("cpp", [False, True], ids=["py", "cpp"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
def test_a_chunk_of_a_shuffle_is_one_dense_shuffle_per_piece(fmt, amp, cpp, compiled_graphs):
    model = ShuffleThenChunk().eval()
    x = torch.randn(2, 3, 9, 7).to(memory_format=fmt)
    ref, y, copies = compile_run(model, x, amp, compiled_graphs, grad="inference_mode", cpp=cpp)
    assert_same(y, ref, amp)
    assert _shuffles(compiled_graphs) == [(2, 0, 8), (2, 8, 16)]  # no whole shuffle, no split
    assert copies == planned_copies(compiled_graphs), compiled_graphs[0].cpu_layout_graph.plan.explain()


@pytest.mark.parametrize("cpp", [False, True], ids=["py", "cpp"])
def test_a_shuffle_piece_that_is_a_result_keeps_eagers_strides(cpp, compiled_graphs):
    model = ShuffleThenChunk(piece_out=True).eval()
    x = torch.randn(2, 3, 9, 7)
    ref, y, _ = compile_run(model, x, False, compiled_graphs, cpp=cpp)
    for got, want in zip(y, ref):
        assert_same(got, want, False)
    assert _shuffles(compiled_graphs) == [(2, 0, 16)]  # the whole shuffle, then the split's views


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["nchw", "nhwc", "nhwc_sliced", "strided"])
def test_channel_shuffle_kernel_matches_atens(fmt, dtype):
    x = torch.randn(2, 12, 5, 3).to(dtype)
    if fmt == "nhwc":
        x = x.contiguous(memory_format=torch.channels_last)
    elif fmt == "nhwc_sliced":  # channels innermost, pixels not one run
        x = torch.randn(2, 12, 5, 6).to(dtype).contiguous(memory_format=torch.channels_last)[..., 1:4]
    elif fmt == "strided":
        x = torch.randn(2, 12, 5, 6).to(dtype)[..., ::2]
    for groups, start, end in ((3, 0, 12), (2, 0, 6), (2, 6, 12), (4, 5, 11)):
        want = torch.native_channel_shuffle(x.contiguous(), groups)[:, start:end]
        got = ops.channel_shuffle(x, groups, start, end)
        assert torch.equal(got, want)
        assert ops.is_channels_last_dense(got) if fmt == "nhwc" else got.is_contiguous()  # x's format, else NCHW
    with pytest.raises(ValueError):
        ops.channel_shuffle(x, 5)
    with pytest.raises(ValueError):
        ops.channel_shuffle(x, 2, 4, 13)


class MixedBlock(nn.Module):
    """MixNet's mixed depthwise convs (a split along channels, one kernel size
    per piece, cat, batch-norm) and mixed 1x1 convs (a chunk per conv), then
    ReXNet's partial residual (the first channels plus the input, cat with the
    rest). `piece_out`: a piece is also a result; `piece_view`: a view reads one."""

    def __init__(self, c=8, piece_out=False, piece_view=False):
        super().__init__()
        self.piece_out, self.piece_view = piece_out, piece_view
        self.expand = nn.Conv2d(c, 3 * c, 1)
        self.dw = nn.ModuleList(nn.Conv2d(c, c, k, padding=k // 2, groups=c) for k in (3, 5, 7))
        self.bn = nn.BatchNorm2d(3 * c)
        self.bn.running_mean.uniform_(-1, 1)
        self.bn.running_var.uniform_(0.5, 2)
        self.pw = nn.ModuleList(nn.Conv2d(3 * c // 2, c, 1) for _ in range(2))
        self.bn2 = nn.BatchNorm2d(2 * c)
        self.bn2.running_var.uniform_(0.5, 2)

    def forward(self, x):
        pieces = torch.split(self.expand(x), x.shape[1], dim=1)
        y = F.relu(self.bn(torch.cat([conv(p) for conv, p in zip(self.dw, pieces)], 1)))
        y = self.bn2(torch.cat([conv(p) for conv, p in zip(self.pw, y.chunk(2, 1))], 1))
        c = x.shape[1]
        out = torch.cat([y[:, :c] + x, y[:, c:]], 1)
        if self.piece_out:
            return out, pieces[1]
        if self.piece_view:
            return out, pieces[1].flatten(2).sum(-1)
        return out


def _slice_nodes(compiled_graphs):
    return [n for n in _nodes(compiled_graphs) if isinstance(n, ir.Aten)
            and n.target in (torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default,
                             torch.ops.aten.slice.Tensor)]


def in_every_mode(test):
    """Parametrized over both wrappers, fp32 and AMP, no_grad and inference_mode,
    and an NCHW or NHWC input (`fmt`)."""
    for mark in (pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"]),
                 pytest.mark.parametrize("grad", ["no_grad", "inference_mode"]),
                 pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"]),
                 pytest.mark.parametrize("cpp", [False, True], ids=["py", "cpp"])):
        test = mark(test)
    return test


@in_every_mode
@pytest.mark.parametrize("batch", [1, 2])
def test_split_pieces_and_slices_are_views_in_the_planned_layout(fmt, batch, grad, amp, cpp, compiled_graphs):
    model = MixedBlock().eval()
    x = torch.randn(batch, 8, 11, 9).to(memory_format=fmt)
    ref, y, copies = compile_run(model, x, amp, compiled_graphs, grad=grad, cpp=cpp)
    assert_same(y, ref, amp)
    nodes = _slice_nodes(compiled_graphs)
    assert len(nodes) == 3 and all(n.rule == ir.SLICE for n in nodes), [(n.name, n.rule) for n in nodes]
    # The 1x1 convs over the chunks are one grouped conv over their input, the
    # batch-norm after their cat folded into it.
    convs = [n for n in _nodes(compiled_graphs) if isinstance(n, ir.Conv)]
    assert sorted(c.groups for c in convs) == [1, 2, 8, 8, 8]
    assert [(c.bn or c.prefolded) is not None for c in convs if c.groups == 2] == [True]
    plan = compiled_graphs[0].cpu_layout_graph.plan
    # What the convs copy dense is a copy of the plan (in both wrappers, counted).
    assert copies == planned_copies(compiled_graphs), plan.explain()
    # A slice is never copied for a kernel (read in place, in any order) or the
    # concatenation: only convs copy pieces.
    pieces = {n.out.name for n in _nodes(compiled_graphs) if ir.slice_source(n) is not None}
    made_by = {n.out.name: n for n in _nodes(compiled_graphs) if n.out is not None}
    readers = {u for c in plan.executed_copies if c.source in pieces for u in c.consumers}
    assert all(isinstance(made_by[u], ir.Conv) for u in readers), plan.explain()


class CatOfTwoOrders(nn.Module):
    """A cat of a channels-last and a contiguous tensor, then a conv: whichever
    order the plan gives the cat, one part is in the other."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(10, 6, 3, padding=1)

    def forward(self, x, y):
        return self.conv(torch.cat([x, y], 1))


@pytest.mark.parametrize("cpp", [False, True], ids=["py", "cpp"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
@pytest.mark.parametrize("grad", ["no_grad", "inference_mode"])
def test_a_cat_reads_a_part_in_the_other_order_in_place(grad, amp, cpp, compiled_graphs):
    """The cat copies every part into its slice anyway, so a part in the other
    order is read where it is (the plan prices that read, no copy is made)."""
    model = CatOfTwoOrders().eval()
    x = torch.randn(2, 4, 9, 7).to(memory_format=torch.channels_last)
    y = torch.randn(2, 6, 9, 7)
    mode = torch.inference_mode() if grad == "inference_mode" else torch.no_grad()
    with mode, torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        ref = model(x, y)
        fn = torch.compile(model, backend="cpu_layout", options={"debug": True, "cpp_wrapper": cpp})
        fn(x, y)
        before = runtime.COPIES["count"]
        out = fn(x, y)
        copies = runtime.COPIES["count"] - before
    assert_same(out, ref, amp)
    plan = compiled_graphs[0].cpu_layout_graph.plan
    cat = next(n for n in _nodes(compiled_graphs) if getattr(n, "target", None) is torch.ops.aten.cat.default)
    assert [c for c in plan.copies if cat.out.name in c.consumers and c.strided], plan.explain()
    assert not [c for c in plan.executed_copies if cat.out.name in c.consumers], plan.explain()
    assert copies == planned_copies(compiled_graphs), plan.explain()


@pytest.mark.parametrize("cpp", [False, True], ids=["py", "cpp"])
@pytest.mark.parametrize("how", ["piece_out", "piece_view"])
def test_a_piece_returned_or_viewed_keeps_eagers_strides(how, cpp, compiled_graphs):
    model = MixedBlock(**{how: True}).eval()
    x = torch.randn(2, 8, 11, 9).to(memory_format=torch.channels_last)
    ref, y, copies = compile_run(model, x, False, compiled_graphs, grad="inference_mode", cpp=cpp)
    for got, want in zip(y, ref):
        assert_same(got, want, False)
    split = [n for n in _slice_nodes(compiled_graphs) if n.multi and n.args[1] in (8, [8, 8, 8])]
    assert len(split) == 1 and split[0].rule == ir.EAGER
    assert copies == planned_copies(compiled_graphs)


class TwoHalves(nn.Module):
    """1x1 convs over the halves of a split, concatenated: one grouped conv,
    unless the convs differ, a piece is read again, or the pieces do not
    cover the input."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.a = nn.Conv2d(8, 6, 1)
        self.b = nn.Conv2d(8, 6, 3 if how == "unlike" else 1, padding=1 if how == "unlike" else 0,
                           bias=how != "one_bias")

    def forward(self, x):
        if self.how == "two_splits":  # one split per piece, as torch.export keeps MixNet's
            p, q = torch.split(x, 8, 1)[0], torch.split(x, 8, 1)[1]
        elif self.how == "slices":
            p, q = x[:, :8], x[:, 8:]
        elif self.how == "swapped":  # the pieces concatenated in the other order: no grouped conv
            q, p = x[:, :8], x[:, 8:]
        else:
            p, q = torch.split(x, 8, 1)[:2]
        y = torch.cat([self.a(p), self.b(q)], 1)
        return y + q.mean() if self.how == "reread" else y


@pytest.mark.parametrize("cpp", [False, True], ids=["py", "cpp"])
@pytest.mark.parametrize("how", ["alike", "two_splits", "slices", "swapped", "unlike", "one_bias", "reread",
                                 "partial"])
def test_convs_over_a_splits_pieces_are_one_grouped_conv_when_alike(how, cpp, compiled_graphs):
    model = TwoHalves(how).eval()
    x = torch.randn(2, 24 if how == "partial" else 16, 7, 5)
    ref, y, copies = compile_run(model, x, False, compiled_graphs, grad="inference_mode", cpp=cpp)
    assert_same(y, ref, False)
    groups = sorted(n.groups for n in _nodes(compiled_graphs) if isinstance(n, ir.Conv))
    assert groups == ([2] if how in ("alike", "two_splits", "slices") else [1, 1])
    assert copies == planned_copies(compiled_graphs)


class SplitAttention(nn.Module):
    """ResNeSt's split attention (radix r): the conv's channels viewed as
    [B, r, C, H, W], summed over r; a softmax over r weights each split; the
    weighted splits summed."""

    def __init__(self, c=8, radix=2):
        super().__init__()
        self.radix = radix
        self.conv = nn.Conv2d(c, c * radix, 3, padding=1)
        self.fc1, self.fc2 = nn.Conv2d(c, 4, 1), nn.Conv2d(4, c * radix, 1)
        self.out = nn.Conv2d(c, c, 1)

    def forward(self, x):
        y = F.relu(self.conv(x))
        b, rc, h, w = y.shape
        y = y.reshape(b, self.radix, rc // self.radix, h, w)
        gap = self.fc2(F.relu(self.fc1(y.sum(dim=1).mean((2, 3), keepdim=True))))
        attn = F.softmax(gap.view(b, 1, self.radix, -1).transpose(1, 2), dim=1).reshape(b, -1)
        out = (y * attn.view(b, -1, 1, 1).reshape(b, self.radix, rc // self.radix, 1, 1)).sum(dim=1)
        return self.out(out.contiguous())


@in_every_mode
@pytest.mark.parametrize("radix", [2, 4])
def test_a_sum_over_split_channels_is_a_sum_of_slices(fmt, radix, grad, amp, cpp, compiled_graphs):
    model = SplitAttention(radix=radix).eval()
    x = torch.randn(2, 8, 9, 7).to(memory_format=fmt)
    ref, y, copies = compile_run(model, x, amp, compiled_graphs, grad=grad, cpp=cpp)
    assert_same(y, ref, amp)
    nodes = _nodes(compiled_graphs)
    # No 5-D tensor is computed or copied: the radix sums add channel slices of the conv.
    assert not [n for n in nodes if isinstance(n, (ir.Reduction, ir.Kernel)) and n.out.rank == 5]
    plan = compiled_graphs[0].cpu_layout_graph.plan
    assert not [c for c in plan.executed_copies if len(c.layout.size) == 5], plan.explain()
    assert len([n for n in nodes if ir.slice_source(n) is not None]) == 3 * radix  # y twice, the weights
    assert copies == planned_copies(compiled_graphs)


@pytest.mark.parametrize("cpp", [False, True], ids=["py", "cpp"])
def test_a_grouped_conv_follows_its_convs_weights_when_they_change(cpp, compiled_graphs):
    """The merged weight is computed from the convs' weights: changed in place, it is recomputed."""
    model = TwoHalves("alike").eval()
    x = torch.randn(2, 16, 7, 5)
    with torch.no_grad():
        fn = torch.compile(model, backend="cpu_layout", options={"cpp_wrapper": cpp})
        fn(x)
        model.b.weight.mul_(-2.0)
        model.a.bias.add_(1.0)
        assert_same(fn(x), model(x), False)
    assert sorted(n.groups for n in _nodes(compiled_graphs) if isinstance(n, ir.Conv)) == [2]
