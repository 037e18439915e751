"""torch.compile(backend="cpu_layout") end to end, against eager PyTorch.

Every compile runs with CPU_LAYOUT_STRICT=1 (a fallback to eager is an error)
and the debug option (each planned layout is asserted at run time).
Tolerances: fp32 outputs to 1e-4 of the output's largest magnitude (plus
1e-4 relative); AMP outputs against eager AMP to 3e-2 of the largest
magnitude: both round to bf16, but at different points (folded batch-norm,
fused epilogues), and deep nets accumulate those differences.
"""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cpu_layout.backend as backend
from cpu_layout import ir, models

pytestmark = pytest.mark.usefixtures("no_grad", "strict_compile", "wrapper")


def run_both(model, x, amp=False, dynamic=False, **opts):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        ref = model(x)
        fn = torch.compile(model, backend="cpu_layout", dynamic=dynamic,
                           options={"debug": True, **opts})
        y = fn(x)
    return fn, y, ref


def assert_matches(y, ref, amp=False):
    assert y.shape == ref.shape
    assert y.dtype == ref.dtype
    assert y.stride() == ref.stride(), "output strides must be eager's"
    scale = ref.float().abs().max().item() or 1.0
    if amp:
        torch.testing.assert_close(y.float(), ref.float(), rtol=3e-2, atol=3e-2 * scale)
    else:
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * scale)


def graphs_under_both_grad_modes(model, x, compiled_graphs, amp=False, dynamic=False):
    """Compiles and runs `model` under inference_mode, then no_grad, checks every
    output against eager (values, sizes, strides) and yields each compiled IR graph."""
    for grad_mode in (torch.inference_mode, torch.no_grad):
        torch._dynamo.reset()
        compiled_graphs.clear()
        with grad_mode():
            _, ys, refs = run_both(model, x, amp=amp, dynamic=dynamic)
        for y, ref in zip(ys, refs):
            assert_matches(y, ref, amp)
        yield compiled_graphs[0].cpu_layout_graph


def test_registered_by_name():
    assert "cpu_layout" in torch._dynamo.list_backends()


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
@pytest.mark.parametrize("name", list(models.MODELS))
def test_builtin_models_static(name, amp, compiled_graphs, wrapper):
    model, x = models.build(name)
    _, y, ref = run_both(model, x, amp=amp)
    assert_matches(y, ref, amp)
    assert len(compiled_graphs) == 1, "one graph, no breaks"
    g = compiled_graphs[0].cpu_layout_graph
    if wrapper == "cpp":  # every op of the suite runs in C++: one segment, one foreign call
        assert [type(n) for n in g.nodes if not isinstance(n, (ir.Input, ir.Output, ir.Getitem))] == \
            [ir.Aten, ir.Segment], g.dump()
    assert g.convs(), "convolutions ran on cpu_layout's oneDNN path"
    assert not [n for n in g.walk() if isinstance(n, ir.Aten) and
                n.target is torch.ops.aten.convolution.default], "no conv fell back to ATen"


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
@pytest.mark.parametrize("in_format", ["contiguous", "channels_last"])
def test_maml_dynamic_two_batch_sizes_without_recompiling(amp, in_format, compiled_graphs):
    # The configuration that crashed Inductor: [s0,1,28,28] with stride
    # [784,784,28,1], AMP, dynamic shapes.
    model, x = models.build("maml_omniglot")
    fmt = torch.channels_last if in_format == "channels_last" else torch.contiguous_format
    x = x.contiguous(memory_format=fmt)
    fn, y, ref = run_both(model, x, amp=amp, dynamic=True)
    assert_matches(y, ref, amp)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        for n in (3, 8):
            x2 = torch.randn(n, 1, 28, 28).contiguous(memory_format=fmt)
            assert_matches(fn(x2), model(x2), amp)
    assert len(compiled_graphs) == 1, "a new batch size must not recompile"


def test_resnet_dynamic_batch(compiled_graphs):
    model, x = models.build("resnet18", batch_size=2)
    fn, y, ref = run_both(model, x, dynamic=True)
    assert_matches(y, ref)
    x2 = torch.randn(3, 3, 64, 64)
    assert_matches(fn(x2), model(x2))
    assert len(compiled_graphs) == 1


class UpsampledHead(nn.Module):
    """A segmentation head's bilinear upsample to the input's size: under dynamic
    shapes its decomposition multiplies index ramps by a scale computed from the
    sizes at run time (a Python number, not a tensor)."""

    def __init__(self, size=None):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.size = size

    def forward(self, x):
        y = torch.relu(self.conv(x))
        size = self.size or x.shape[-2:]
        return F.interpolate(y, size=size, mode="bilinear", align_corners=False)


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
@pytest.mark.parametrize("size", [None, (24, 30)], ids=["input_size", "fixed_size"])
def test_an_operand_computed_from_symbolic_sizes_stays_on_aten(amp, size, compiled_graphs):
    # To a fixed size, the index ramps are constant but the scale that multiplies
    # them is computed from the input's size: the product is not a constant.
    model = UpsampledHead(size).eval()
    fn, y, ref = run_both(model, torch.randn(2, 3, 12, 16), amp=amp, dynamic=True)
    assert_matches(y, ref, amp)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        x2 = torch.randn(3, 3, 9, 20)
        assert_matches(fn(x2), model(x2), amp)
    assert len(compiled_graphs) == 1, "other sizes must not recompile"


def test_residual_epilogue_and_batchnorm_are_fused(compiled_graphs):
    model, x = models.build("resnet18")
    run_both(model, x)
    g = compiled_graphs[0].cpu_layout_graph
    convs = [c for c in g.convs() if not c.linear]
    assert [c.linear for c in g.convs()].count(True) == 1, "the classifier is a 1x1 conv"
    assert all(c.bn is not None or c.prefolded is not None for c in convs), "every conv+BN pair is folded"
    adds = [c for c in convs if any(isinstance(p, tuple) and p[0] == "add" for p in c.post_ops)]
    assert len(adds) == 8, "each basic block's residual add (and its ReLU) is a post-op"
    assert all(c.post_ops[-1] == "relu" for c in adds)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("conv_bias,affine", [(False, True), (True, True), (True, False)])
def test_batch_norm_folds_rounded_once_from_float64(dtype, conv_bias, affine):
    # mean * scale close to the BN bias: in float32 the shift cancels to a few ulp of noise.
    # Scale and shift are float64 values rounded once; the weight is w * that scale in float32.
    from cpu_layout import runtime
    g = torch.Generator().manual_seed(0)
    c = 64
    w = torch.randn(c, 8, 3, 3, generator=g).to(dtype)
    b = torch.randn(c, generator=g).to(dtype) if conv_bias else None
    var = torch.rand(c, generator=g) * 3 + 0.1
    mean = torch.randn(c, generator=g) * 50
    bn_w = torch.randn(c, generator=g) if affine else None
    bn_b = (mean * torch.rsqrt(var + 1e-5) * (bn_w if affine else 1) + 1e-3) if affine else None
    wf, shift = runtime.fold_batch_norm(w, b, bn_w, bn_b, mean, var, 1e-5)
    d = torch.float64
    scale = torch.rsqrt(var.to(d) + 1e-5) * (bn_w.to(d) if affine else 1)
    exact_shift = -mean.to(d) * scale + (bn_b.to(d) if affine else 0) + (b.to(d) * scale if conv_bias else 0)
    assert wf.dtype == dtype and shift.dtype == dtype
    assert torch.equal(wf, (w.float() * scale.float().reshape(-1, 1, 1, 1)).to(dtype))
    assert torch.equal(shift, exact_shift.to(dtype))
    assert torch.equal(runtime.bn_scale(bn_w, bn_b, mean, var, 1e-5, 4), scale.float().reshape(-1, 1, 1))
    assert torch.equal(runtime.bn_shift(bn_w, bn_b, mean, var, 1e-5, 4),
                       (exact_shift - (b.to(d) * scale if conv_bias else 0)).float().reshape(-1, 1, 1))


class ConvSiluRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 16, 3, 1, 1)
        self.dw = nn.Conv2d(16, 16, 3, 1, 1, groups=16)
        self.b = nn.Conv2d(16, 8, 1)

    def forward(self, x):
        return F.relu(self.b(F.silu(self.dw(F.silu(self.a(x))))))


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
@pytest.mark.parametrize("l2", ["machine", "tiny"])
def test_silu_runs_in_a_kernel_in_segments_and_as_a_post_op_in_python(compiled_graphs, amp, wrapper, l2,
                                                                       monkeypatch):
    """In C++ segments oneDNN's swish post-op costs more than the generated
    kernel's pass while the conv's output is in cache (fuse.split_in_segments):
    with an L2 cache that the fp32 outputs outgrow, they keep it fused; bf16
    outputs never do. The Python wrapper, which allocates every kernel output,
    keeps it fused. relu fuses in both."""
    from cpu_layout import fuse

    if l2 == "tiny":  # 2x16x20x20 fp32 outputs, 25.6 kB: over 2 L2s of 256 B per thread below 50 threads
        monkeypatch.setattr(fuse, "_l2_bytes", lambda: 256)
    model = ConvSiluRelu().eval()
    x = torch.randn(2, 3, 20, 20)
    _, y, ref = run_both(model, x, amp=amp)
    assert_matches(y, ref, amp)
    g = compiled_graphs[0].cpu_layout_graph
    silu = [n for n in g.walk() if isinstance(n, ir.Kernel) and "silu" in repr(n.expr)]
    if wrapper == "cpp" and l2 == "tiny" and not amp:
        assert [list(c.post_ops) for c in g.convs()] == [["silu"], ["silu"], ["relu"]], g.dump()
        assert not silu, g.dump()
    elif wrapper == "cpp":
        assert [list(c.post_ops) for c in g.convs()] == [[], [], ["relu"]], g.dump()
        assert len(silu) == 2, g.dump()
    else:
        assert [list(c.post_ops) for c in g.convs()] == [["silu"], ["silu"], ["relu"]], g.dump()
        assert not silu, g.dump()


class ConvFlattenLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, 2, 1)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(torch.flatten(F.relu(self.conv(x)), 1))


@pytest.mark.parametrize("in_format", ["contiguous", "channels_last"])
def test_conv_flatten_linear(in_format):
    model = ConvFlattenLinear().eval()
    fmt = torch.channels_last if in_format == "channels_last" else torch.contiguous_format
    x = torch.randn(2, 3, 16, 16).contiguous(memory_format=fmt)
    _, y, ref = run_both(model, x)
    assert_matches(y, ref)


class UnsupportedInTheMiddle(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        y = F.relu(self.a(x))
        y = torch.cumsum(y, dim=3)  # no native lowering: runs as the ATen op
        return self.b(y)


def test_unsupported_op_falls_back_to_aten_inside_the_graph(compiled_graphs):
    model = UnsupportedInTheMiddle().eval()
    x = torch.randn(2, 3, 12, 12)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no whole-graph fallback
        _, y, ref = run_both(model, x)
    assert_matches(y, ref)
    g = compiled_graphs[0].cpu_layout_graph
    assert [n for n in g.walk() if isinstance(n, ir.Aten) and n.target is torch.ops.aten.cumsum.default]
    assert len(g.convs()) == 2


def test_graph_that_cannot_compile_runs_eagerly_with_one_warning(monkeypatch):
    monkeypatch.delenv("CPU_LAYOUT_STRICT")

    def broken(*a, **k):
        raise NotImplementedError("lowering exploded")

    monkeypatch.setattr(backend, "compile_graph", broken)
    backend._fallback_warning.cache_clear()
    model = ConvFlattenLinear().eval()
    x = torch.randn(2, 3, 16, 16)
    with pytest.warns(RuntimeWarning, match="lowering exploded") as rec:
        fn = torch.compile(model, backend="cpu_layout")
        y = fn(x)
        fn(x)
    assert len([w for w in rec if "cpu_layout" in str(w.message)]) == 1
    assert_matches(y, model(x))


def test_strict_mode_turns_the_fallback_into_an_error(monkeypatch):
    def broken(*a, **k):
        raise NotImplementedError("lowering exploded")

    monkeypatch.setattr(backend, "compile_graph", broken)
    fn = torch.compile(ConvFlattenLinear().eval(), backend="cpu_layout")
    with pytest.raises(Exception, match="lowering exploded"):
        fn(torch.randn(2, 3, 16, 16))


def test_unknown_option_is_refused():
    fn = torch.compile(ConvFlattenLinear().eval(), backend="cpu_layout", options={"freezing": True})
    with pytest.raises(Exception, match="unknown options"):
        fn(torch.randn(2, 3, 16, 16))


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
def test_load_state_dict_and_in_place_updates_after_compile(amp):
    model, x = models.build("resnet18", batch_size=2)
    fn, y, ref = run_both(model, x, amp=amp)
    assert_matches(y, ref, amp)
    other, _ = models.build("resnet18", seed=7)
    model.load_state_dict(other.state_dict())
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        assert_matches(fn(x), other(x), amp)
        bn = model.stem[0][1]
        bn.running_var.mul_(4.0)  # folded into the stem conv: must be refolded
        model.layers[0].a[0].weight.mul_(-1.0)
        assert_matches(fn(x), model(x), amp)


class ConcatenatedScale(nn.Module):
    """A per-channel scale concatenated from two parameters in forward: a node
    computed from module state alone, whose tensors arrive in a list."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.lo, self.hi = nn.Parameter(torch.rand(4) + 0.5), nn.Parameter(torch.rand(4) + 0.5)

    def forward(self, x):
        return self.conv(x) * torch.cat([self.lo, self.hi]).view(1, 8, 1, 1)


@pytest.mark.parametrize("cpp", [False, True], ids=["default", "cpp"])
@pytest.mark.parametrize("grad", ["no_grad", "inference_mode"])
def test_module_state_concatenated_in_forward_follows_in_place_changes(grad, cpp):
    model = ConcatenatedScale().eval()
    x = torch.randn(2, 3, 9, 9)
    fn = torch.compile(model, backend="cpu_layout", options={"cpp_wrapper": cpp})
    mode = torch.inference_mode if grad == "inference_mode" else torch.no_grad
    with torch.no_grad():
        assert_matches(fn(x), model(x))
        model.hi.mul_(-3.0)
    with mode():
        assert_matches(fn(x), model(x))


def test_training_graph_is_not_compiled():
    model = ConvFlattenLinear()  # parameters require grad
    x = torch.randn(2, 3, 16, 16)
    with torch.enable_grad():
        backend._fallback_warning.cache_clear()
        with pytest.raises(Exception, match="training graphs are not supported"):
            torch.compile(model, backend="cpu_layout")(x)


class Conv1dNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1d(4, 16, 5, padding=2)
        self.bn = nn.BatchNorm1d(16)
        self.c2 = nn.Conv1d(16, 8, 3, stride=2)

    def forward(self, x):
        return self.c2(F.gelu(self.bn(self.c1(x))))


def test_conv1d_net():
    model = Conv1dNet().eval()
    x = torch.randn(3, 4, 40)
    _, y, ref = run_both(model, x)
    assert_matches(y, ref)


class PointwiseChain(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.scale = nn.Parameter(torch.randn(8, 1, 1))

    def forward(self, x):
        y = self.conv(x)
        z = torch.sigmoid(y * 0.5 + 1.0) * self.scale  # feeds from y, which is also used below
        return torch.clamp(z - y, min=-0.3)


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
@pytest.mark.parametrize("in_format", ["contiguous", "channels_last"])
def test_elementwise_chain_becomes_one_generated_kernel(amp, in_format, compiled_graphs):
    model = PointwiseChain().eval()
    fmt = torch.channels_last if in_format == "channels_last" else torch.contiguous_format
    x = torch.randn(2, 3, 10, 10).contiguous(memory_format=fmt)
    _, y, ref = run_both(model, x, amp=amp)
    assert_matches(y, ref, amp)
    g = compiled_graphs[0].cpu_layout_graph
    kernels = [n for n in g.walk() if isinstance(n, ir.Kernel)]
    # mul, add, sigmoid, mul, sub, clamp: one loop (AMP adds cast kernels beside it).
    assert max(k.members for k in kernels) == 6, g.dump()
    assert not [n for n in g.walk() if isinstance(n, ir.Pointwise)], "nothing left on ATen"


class SqueezeExcite(nn.Module):
    """SE block and pooled heads: mean/sum/amax over kept and reduced dims."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.fc1 = nn.Conv2d(16, 4, 1)
        self.fc2 = nn.Conv2d(4, 16, 1)

    def forward(self, x):
        y = F.relu(self.conv(x))
        w = torch.sigmoid(self.fc2(F.relu(self.fc1(y.mean((2, 3), keepdim=True)))))
        z = y * w
        return z, z.mean([2, 3]), z.sum(1), z.amax(-1, keepdim=True)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
@pytest.mark.parametrize("in_format", ["contiguous", "channels_last"])
def test_reductions_run_as_generated_kernels(amp, in_format, dynamic, compiled_graphs):
    model = SqueezeExcite().eval()
    fmt = torch.channels_last if in_format == "channels_last" else torch.contiguous_format
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        fn = torch.compile(model, backend="cpu_layout", dynamic=dynamic, options={"debug": True})
        for shape in ((2, 8, 12, 10), (3, 8, 7, 9)):  # distinct sizes: no duck-sized symbols
            x = torch.randn(shape).contiguous(memory_format=fmt)
            for y, ref in zip(fn(x), model(x)):
                assert_matches(y, ref, amp)
    g = compiled_graphs[0].cpu_layout_graph
    kinds = sorted(n.kind for n in g.walk() if isinstance(n, ir.Reduction))
    assert kinds == ["amax", "mean", "mean", "sum"], g.dump()
    assert not [n for n in g.walk() if isinstance(n, ir.Aten) and "mean" in str(n.target)]
    if dynamic:
        assert len(compiled_graphs) == 1, "a new size ran without recompiling"


class Upsampling(nn.Module):
    def __init__(self, size=None):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.size = size

    def forward(self, x):
        y = F.relu(self.conv(x))
        if self.size is None:
            return F.interpolate(y, scale_factor=2, mode="nearest") * 2.0
        return F.interpolate(y, size=self.size, mode="nearest") * 2.0


@pytest.mark.parametrize("size", [None, (7, 13)], ids=["x2", "7x13"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
@pytest.mark.parametrize("in_format", ["contiguous", "channels_last"])
def test_nearest_upsample_is_recognised_and_exact(size, amp, in_format, compiled_graphs):
    model = Upsampling(size).eval()
    fmt = torch.channels_last if in_format == "channels_last" else torch.contiguous_format
    x = torch.randn(2, 3, 5, 6).contiguous(memory_format=fmt)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        y = torch.compile(model, backend="cpu_layout", options={"debug": True})(x)
        ref = model(x)
    assert y.shape == ref.shape and y.stride() == ref.stride()
    torch.testing.assert_close(y.float(), ref.float(), rtol=3e-2 if amp else 1e-4, atol=3e-2 if amp else 1e-4)
    g = compiled_graphs[0].cpu_layout_graph
    targets = {getattr(n, "target", None) for n in g.walk()}
    assert torch.ops.aten.upsample_nearest2d.default in targets, g.dump()
    assert torch.ops.aten._unsafe_index.Tensor not in targets


class PooledOutputs(nn.Module):
    """Outputs whose eager strides differ from another layout's only at size-1 dims."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        y = F.relu(self.conv(x))
        pooled = y.mean((2, 3), keepdim=True)
        return pooled, self.head(pooled), F.adaptive_avg_pool2d(y, 1)


@pytest.mark.parametrize("in_format", ["contiguous", "channels_last"])
def test_size1_output_strides_are_eagers(in_format):
    model = PooledOutputs().eval()
    fmt = torch.channels_last if in_format == "channels_last" else torch.contiguous_format
    x = torch.randn(2, 3, 9, 9).contiguous(memory_format=fmt)
    with torch.no_grad():
        refs = model(x)
        outs = torch.compile(model, backend="cpu_layout", options={"debug": True})(x)
    for y, ref in zip(outs, refs):
        assert_matches(y, ref)


def test_restride_gives_torchs_strides_for_size1_dims():
    from cpu_layout import runtime

    x = torch.randn(2, 4, 1, 1)  # contiguous strides (4, 1, 1, 1)
    y = runtime.restride(x, "channels_last")
    assert y.stride() == torch.empty(2, 4, 1, 1, memory_format=torch.channels_last).stride()
    assert y.data_ptr() == x.data_ptr() and torch.equal(y, x)
    z = torch.randn(2, 4, 3, 3)  # a real mismatch is copied, not re-strided
    w = runtime.restride(z, "channels_last")
    assert w.is_contiguous(memory_format=torch.channels_last) and torch.equal(w, z)


class Clones(nn.Module):
    """A clone between two convs (eval-mode Dropout as torch.export writes it), a
    clone of the input, and a clone that is an output."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(4, 8, 1)
        self.b = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        y = self.a(x.clone()).relu().clone()
        z = self.b(y)
        return z * 2, z.clone()


@pytest.mark.parametrize("in_format", ["contiguous", "channels_last"])
def test_a_clone_inside_the_graph_is_its_input(in_format, compiled_graphs):
    """The inner clone is dropped (no copy of the activation); the clone of the
    input and the returned clone stay, so the output is no alias of another."""
    x = torch.randn(2, 4, 9, 9)
    if in_format == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    model = Clones().eval()
    for grad_mode in (torch.inference_mode, torch.no_grad):
        torch._dynamo.reset()
        compiled_graphs.clear()
        with grad_mode():
            fn, (y, c), (ry, rc) = run_both(model, x)
            y, c = fn(x)
        assert_matches(y, ry)
        assert_matches(c, rc)
        assert c.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()
        clones = [n for n in compiled_graphs[0].cpu_layout_graph.walk()
                  if isinstance(n, ir.Aten) and n.target is torch.ops.aten.clone.default]
        assert len(clones) == 2, [n.args[0].producer for n in clones]
        assert {type(n.args[0].producer).__name__ for n in clones} == {"Input", "Conv"}


class PoolFormerish(nn.Module):
    """Group norm as CNNs use it: after a conv (32 groups of 2 channels, then one
    group), around a pooling token mixer, with a residual; and over a 3-D tensor."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 64, 3, padding=1)
        self.norm1 = nn.GroupNorm(32, 64)
        self.norm2 = nn.GroupNorm(1, 64)
        self.norm3 = nn.GroupNorm(4, 64, affine=False)
        self.mlp = nn.Conv2d(64, 64, 1)

    def forward(self, x):
        y = F.relu(self.norm1(self.stem(x)))
        z = self.norm2(y)
        y = y + self.mlp(F.avg_pool2d(z, 3, 1, 1) - z)
        n, c = y.shape[:2]
        return y, self.norm3(y.flatten(2)).view(n, c, *y.shape[2:]).mean((2, 3))


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
@pytest.mark.parametrize("in_format", ["contiguous", "channels_last"])
def test_group_norm_runs_on_the_generated_kernel(in_format, amp, compiled_graphs, wrapper):
    """Every group norm is a GroupNorm node (no ATen call); in C++ the graph is one
    segment; values, sizes and strides are eager's under both grad modes."""
    model = PoolFormerish().eval()
    with torch.no_grad():
        for m in (model.norm1, model.norm2):
            m.weight.uniform_(0.5, 2.0)
            m.bias.uniform_(-1.0, 1.0)
    x = torch.randn(2, 3, 12, 12) * 2 + 1
    if in_format == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    for g in graphs_under_both_grad_modes(model, x, compiled_graphs, amp):
        assert len([n for n in g.walk() if isinstance(n, ir.GroupNorm)]) == 3, g.dump()
        assert not [n for n in g.walk() if isinstance(n, ir.Aten) and "group_norm" in str(n.target)]
        if wrapper == "cpp":
            assert sum(isinstance(n, ir.Segment) for n in g.nodes) == 1, g.dump()


class Attentive(nn.Module):
    """ResNeSt's radix softmax (over a middle dim) and attention's softmax over
    the last dim of a matmul result, then a log_softmax."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 64, 3, padding=1)
        self.fc = nn.Conv2d(64, 128, 1)

    def forward(self, x):
        y = self.conv(x)
        n = x.shape[0]
        a = self.fc(y.mean((2, 3), keepdim=True)).view(n, 2, 1, 64).softmax(1)
        y = y * a.reshape(n, 128, 1, 1)[:, :64]
        t = y.flatten(2).transpose(1, 2)
        att = (t @ t.transpose(1, 2) / 8).softmax(-1)
        return (att @ t).log_softmax(-1), y


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
@pytest.mark.parametrize("in_format", ["contiguous", "channels_last"])
def test_softmax_runs_on_the_generated_kernel(in_format, amp, compiled_graphs, wrapper):
    """Every softmax and log_softmax is a Softmax node; values, sizes and strides
    are eager's under both grad modes; in C++ the radix softmax is inside the
    segment of the convs around it."""
    model = Attentive().eval()
    x = torch.randn(2, 3, 6, 6)
    if in_format == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    for g in graphs_under_both_grad_modes(model, x, compiled_graphs, amp):
        assert sorted(n.log for n in g.walk() if isinstance(n, ir.Softmax)) == [False, False, True], g.dump()
        assert not [n for n in g.walk() if isinstance(n, ir.Aten) and "softmax" in str(n.target)]
        if wrapper == "cpp":
            radix = next(s for s in g.nodes if isinstance(s, ir.Segment)
                         and any(isinstance(m, ir.Softmax) and m.dim == 1 for m in s.members))
            assert sum(isinstance(m, ir.Conv) for m in radix.members) == 2, g.dump()


class Ghost(nn.Module):
    """GhostNet's module: a 1x1 conv, a cheap depthwise conv of its result, the two
    concatenated and sliced to `oup` channels: all of them here (the slice is whole)
    then a part (a real slice)."""

    def __init__(self):
        super().__init__()
        self.primary = nn.Conv2d(8, 8, 1)
        self.cheap = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.next = nn.Conv2d(16, 16, 1)

    def forward(self, x):
        x1 = F.relu(self.primary(x))
        y = torch.cat([x1, F.relu(self.cheap(x1))], dim=1)[:, :16]
        z = self.next(y)
        return z, z[:, :12] * 2


@pytest.mark.parametrize("entry", ["compile", "export"])
def test_a_whole_slice_or_alias_is_its_input(entry, compiled_graphs):
    """The whole-channel slice (an alias in Dynamo's graph) is dropped, so nothing
    reads in eager's order and the convs may compute channels-last; the partial
    slice stays. Values and strides eager's under both grad modes."""
    from cpu_layout.exported import compile_exported

    model = Ghost().eval()
    x = torch.randn(2, 8, 10, 10)
    for grad_mode in (torch.inference_mode, torch.no_grad):
        torch._dynamo.reset()
        compiled_graphs.clear()
        with grad_mode():
            refs = model(x)
            if entry == "compile":
                fn = torch.compile(model, backend="cpu_layout", options={"debug": True})
            else:
                fn = compile_exported(torch.export.export(model, (x,)), {"debug": True})
            ys = fn(x)
        for y, ref in zip(ys, refs):
            assert_matches(y, ref)
        g = (compiled_graphs[0] if compiled_graphs else fn.compiled).cpu_layout_graph
        aliases = [n for n in g.walk() if isinstance(n, ir.Aten)
                   and n.target in (torch.ops.aten.alias.default, torch.ops.aten.slice.Tensor)]
        assert [n.args[0].size[1] for n in aliases] == [16], g.dump()  # only the real slice


class ResponseNorm(nn.Module):
    """ConvNeXt-V2's global response norm on channels-last activations: a 2-norm
    over H and W, its mean over channels, then addcmul; and a 1-norm, which stays
    on ATen."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.weight = nn.Parameter(torch.rand(16) + 0.5)
        self.bias = nn.Parameter(torch.randn(16))

    def forward(self, x):
        y = self.conv(x).permute(0, 2, 3, 1)
        g = y.norm(p=2, dim=(1, 2), keepdim=True)
        n = g / (g.mean(dim=-1, keepdim=True) + 1e-6)
        out = y + torch.addcmul(self.bias.view(1, 1, 1, -1), self.weight.view(1, 1, 1, -1), y * n, value=0.5)
        return out, torch.linalg.vector_norm(y, 1, dim=3)


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_vector_norm_and_addcmul_run_in_generated_kernels(dynamic, amp, compiled_graphs, wrapper):
    """The 2-norm is a sum reduction of x * x with a sqrt on the result, addcmul an
    element-wise op; in C++ the only ATen call left is the 1-norm's. Values, sizes
    and strides eager's under both grad modes."""
    model = ResponseNorm().eval()
    x = torch.randn(2, 3, 9, 9)
    for g in graphs_under_both_grad_modes(model, x, compiled_graphs, amp, dynamic):
        norms = [n for n in g.walk() if isinstance(n, ir.Reduction) and n.epilogue is not None]
        assert len(norms) == 1 and norms[0].dims == (1, 2), g.dump()
        aten = [str(n.target) for n in g.walk() if isinstance(n, ir.Aten) and "norm" in str(n.target)]
        assert aten == ["aten.linalg_vector_norm.default"], g.dump()  # the 1-norm
        assert "addcmul" in repr([n.expr for n in g.walk() if isinstance(n, ir.Kernel)]), g.dump()
