"""cpu_layout.compile_exported: an ExportedProgram compiled by the backend's
pipeline and called without Dynamo. Values, sizes and strides against eager;
what Dynamo's guards would catch is an error here; fallbacks are warned."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cpu_layout
from cpu_layout import backend, ir, models, runtime

pytestmark = pytest.mark.usefixtures("strict_compile")

MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


def assert_matches(y, ref, amp=False):
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert y.stride() == ref.stride(), f"strides {y.stride()} vs eager's {ref.stride()}"
    scale = ref.float().abs().max().item() or 1.0
    tol = 3e-2 if amp else 1e-4
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol * scale)


def export(model, *args, amp=False, **kwargs):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        return torch.export.export(model, args, kwargs or None)


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = F.relu(self.bn(self.conv(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1))


def conv_bn():
    torch.manual_seed(0)
    m = ConvBN()
    with torch.no_grad():
        m.bn.running_mean.uniform_(-0.5, 0.5)
        m.bn.running_var.uniform_(0.5, 2.0)
    return m.eval()


@pytest.mark.parametrize("cpp", [False, True], ids=["default", "cpp"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3", "densenet", "maml_omniglot"])
def test_builtin_models_match_eager(name, amp, cpp):
    model, x = models.build(name)
    ep = export(model, x, amp=amp)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        f = cpu_layout.compile_exported(ep, {"cpp_wrapper": cpp})
        assert f.compiled
        g = f._call.cpu_layout_graph
        assert g.convs(), "convolutions ran on cpu_layout's oneDNN path"
        if cpp:  # the whole graph in one C++ segment, as through torch.compile
            assert [type(n) for n in g.nodes if not isinstance(n, (ir.Input, ir.Output, ir.Getitem))] \
                == [ir.Aten, ir.Segment], g.dump()
        for mode in MODES.values():
            with mode():
                ref = model(x)
                calls = runtime.SegmentCall.calls
                y = f(x)
                assert_matches(y, ref, amp)
                if cpp:
                    assert runtime.SegmentCall.calls == calls + 1, "one foreign call per forward"


@pytest.mark.parametrize("mode", list(MODES))
def test_in_place_changes_to_the_weights_are_seen(mode):
    model = conv_bn()
    x = torch.randn(2, 3, 16, 16)
    f = cpu_layout.compile_exported(export(model, x), {"cpp_wrapper": True})
    with MODES[mode]():
        assert_matches(f(x), model(x))
    with torch.no_grad():  # the program holds the module's own tensors
        model.conv.weight.mul_(-2)
        model.bn.running_var.add_(1.0)
    with MODES[mode]():
        assert_matches(f(x), model(x))


def test_inputs_its_guards_would_reject_are_errors():
    model = conv_bn()
    x = torch.randn(2, 3, 16, 16)
    f = cpu_layout.compile_exported(export(model, x))
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"input 0 has size \(3, 3, 16, 16\)"):
            f(torch.randn(3, 3, 16, 16))
        with pytest.raises(ValueError, match="stride"):
            f(x.to(memory_format=torch.channels_last))
        with pytest.raises(ValueError, match="torch.float64"):
            f(x.double())
        with pytest.raises(TypeError, match="exported with inputs"):
            f(x, x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with pytest.raises(RuntimeError, match="autocast"):
                f(x)
    with pytest.raises(RuntimeError, match="requires grad"):
        f(x.clone().requires_grad_())
    with pytest.raises(TypeError, match="ExportedProgram"):
        cpu_layout.compile_exported(model)
    with pytest.raises(ValueError, match="unknown options"):
        cpu_layout.compile_exported(export(model, x), {"cpp": True})


def test_a_call_leaves_no_cyclic_garbage():
    """Positional tensors skip tree_flatten, whose closure is a reference cycle
    per call: garbage that wakes the collector over everything export keeps."""
    import gc

    model = conv_bn()
    x = torch.randn(2, 3, 16, 16)
    f = cpu_layout.compile_exported(export(model, x), {"cpp_wrapper": True})
    with torch.no_grad():
        f(x)
        gc.collect()
        enabled = gc.isenabled()
        gc.disable()
        try:
            for _ in range(10):
                y = f(x)
            assert gc.collect() == 0
        finally:
            if enabled:
                gc.enable()
        assert_matches(y, model(x))
        with pytest.raises(TypeError, match="exported with inputs"):
            f([x])  # a list is a pytree node, not a tensor: the general path checks it


@pytest.mark.parametrize("amp", [False, True])
def test_segments_hand_outputs_over_with_eager_strides(amp):
    """A classifier at batch 1 ends in a linear run as a 1x1 conv: its [1, 10]
    result is a view whose size-1 dim has another stride than eager's. The
    segment hands it over with eager's (OUT_EAGER), so the wrapper's restride
    finds them equal instead of making an alias per call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 10)).eval()
    x = torch.randn(1, 3, 16, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        f = cpu_layout.compile_exported(export(model, x, amp=amp), {"cpp_wrapper": True})
    env = f._call.__globals__
    handed = []
    real = env["restride"]

    def spy(t, order, want=None):
        handed.append((t.stride(), want))
        return real(t, order, want)

    env["restride"] = spy
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        for _ in range(2):
            y = f(x)
            assert_matches(y, model(x), amp=amp)
    assert handed == [((10, 1), (10, 1))] * 2


def test_with_grad_enabled_it_runs_without_an_autograd_graph():
    model = conv_bn()
    x = torch.randn(2, 3, 16, 16)
    f = cpu_layout.compile_exported(export(model, x))
    y = f(x)  # grad mode on; parameters require grad
    assert not y.requires_grad
    with torch.no_grad():
        assert_matches(y, model(x))


class TwoInOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(3, 8, 1)

    def forward(self, x, *, skip):
        y = F.relu(self.a(x))
        return {"sum": y + self.b(skip), "y": y}


def test_keyword_inputs_and_nested_outputs():
    model = TwoInOut().eval()
    x, s = torch.randn(1, 3, 12, 12), torch.randn(1, 3, 12, 12)
    f = cpu_layout.compile_exported(export(model, x, skip=s), {"cpp_wrapper": True})
    with torch.no_grad():
        out, ref = f(x, skip=s), model(x, skip=s)
    assert set(out) == {"sum", "y"}
    for k in ref:
        assert_matches(out[k], ref[k])


class Outputs(nn.Module):
    """Returns its result as `kind`: one tensor, a tuple, a list or a one-tuple."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return {"one": y, "tuple": (y, y.relu()), "list": [y, y.sum(1)], "single": (y,)}[self.kind]


@pytest.mark.parametrize("kind", ["one", "tuple", "list", "single"])
@pytest.mark.parametrize("cpp", [False, True])
def test_outputs_come_back_in_the_structure_the_model_returns(kind, cpp):
    model = Outputs(kind).eval()
    x = torch.randn(1, 3, 10, 10)
    f = cpu_layout.compile_exported(export(model, x), {"cpp_wrapper": cpp})
    with torch.no_grad():
        out, ref = f(x), model(x)
    assert type(out) is type(ref)
    for o, r in (zip(out, ref) if isinstance(ref, (tuple, list)) else [(out, ref)]):
        assert_matches(o, r)


def test_the_autocast_dtype_matters_only_where_autocast_is_on():
    model = conv_bn()
    x = torch.randn(2, 3, 16, 16)
    plain = cpu_layout.compile_exported(export(model, x))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # compiled under the state it is called with
        amp = cpu_layout.compile_exported(export(model, x, amp=True))
    before = torch.get_autocast_dtype("cpu")
    try:
        with torch.no_grad():
            torch.set_autocast_dtype("cpu", torch.float16)  # autocast itself stays off
            assert_matches(plain(x), model(x))
            with pytest.raises(RuntimeError, match="autocast"):
                amp(x)
            with torch.autocast("cpu"):  # on, but float16: not what it was compiled for
                with pytest.raises(RuntimeError, match="autocast"):
                    amp(x)
            torch.set_autocast_dtype("cpu", torch.bfloat16)
            with torch.autocast("cpu"):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    ref = model(x)
                assert_matches(amp(x), ref, amp=True)
                with pytest.raises(RuntimeError, match="autocast"):
                    plain(x)
    finally:
        torch.set_autocast_dtype("cpu", before)


def test_what_it_cannot_compile_runs_as_the_exported_module_with_a_warning(monkeypatch):
    monkeypatch.delenv("CPU_LAYOUT_STRICT")
    model = conv_bn().train()  # batch-norm updates its running stats: buffer mutations
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        ep = torch.export.export(model, (x,))
    with pytest.warns(RuntimeWarning, match="BUFFER_MUTATION"):
        f = cpu_layout.compile_exported(ep)
    assert not f.compiled
    ref_model = conv_bn().train()
    with torch.no_grad():
        torch.testing.assert_close(f(x), ref_model(x), rtol=1e-4, atol=1e-4)

    model = conv_bn()
    dyn = torch.export.Dim("batch", min=2, max=8)
    with torch.no_grad():
        ep = torch.export.export(model, (x,), dynamic_shapes=({0: dyn},))
    with pytest.warns(RuntimeWarning, match="symbolic sizes"):
        f = cpu_layout.compile_exported(ep)
    with torch.no_grad():
        for bs in (2, 5):
            xb = torch.randn(bs, 3, 16, 16)
            torch.testing.assert_close(f(xb), model(xb), rtol=1e-4, atol=1e-4)


def test_strict_mode_makes_the_fallbacks_errors(monkeypatch):
    model = conv_bn().train()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        ep = torch.export.export(model, (x,))
    with pytest.raises(backend.CompileError, match="BUFFER_MUTATION"):
        cpu_layout.compile_exported(ep)

    def broken(*a, **k):
        raise NotImplementedError("lowering exploded")

    monkeypatch.setattr(backend, "compile_graph", broken)
    with pytest.raises(backend.CompileError, match="lowering exploded"):
        cpu_layout.compile_exported(export(conv_bn(), x))


def test_a_graph_that_fails_to_compile_runs_eagerly_with_a_warning(monkeypatch):
    monkeypatch.delenv("CPU_LAYOUT_STRICT")

    def broken(*a, **k):
        raise NotImplementedError("lowering exploded (exported)")

    monkeypatch.setattr(backend, "compile_graph", broken)
    model = conv_bn()
    x = torch.randn(2, 3, 16, 16)
    backend._fallback_warning.cache_clear()
    with pytest.warns(RuntimeWarning, match="lowering exploded"):
        f = cpu_layout.compile_exported(export(model, x))
    assert not f.compiled
    with torch.no_grad():
        assert_matches(f(x), model(x))
