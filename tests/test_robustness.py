"""What real usage hits: torch.inference_mode(), inference-tensor parameters and
their staleness, empty batches, constants the graph module holds, views at a
storage offset, permuted outputs, one-element conv arguments, infinite clamp
bounds, and forwards that mutate a parameter through `.data`.

Every compile runs strict (a whole-graph fallback is an error) under both
wrappers. Tolerances: fp32 1e-4 of the output's largest magnitude (plus 1e-4
relative); AMP 3e-2 of it, as in test_backend.py.
"""
import pytest
import torch
import torch.nn as nn

import cpu_layout
from cpu_layout import models

pytestmark = pytest.mark.usefixtures("strict_compile", "wrapper")


def assert_matches(y, ref, amp=False):
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert y.stride() == ref.stride(), f"strides {y.stride()} vs eager's {ref.stride()}"
    scale = ref.float().abs().max().item() if ref.numel() else 1.0
    tol = 3e-2 if amp else 1e-4
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol * (scale or 1.0))


def conv_bn_net():
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.Hardswish(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )
    with torch.no_grad():
        for bn in (m[1], m[5]):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 1.5)
    return m.eval()


# ---- inference_mode ---------------------------------------------------------------

@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_inference_mode_with_batch_norm(amp, dynamic, compiled_graphs):
    model = conv_bn_net()
    fn = torch.compile(model, backend="cpu_layout", dynamic=dynamic, options={"debug": True})
    for bs in (2, 3):
        x = torch.randn(bs, 3, 16, 16)
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            assert_matches(fn(x), model(x), amp)
    assert len(compiled_graphs) == 1 + (not dynamic)


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_inference_mode_builtin_models(name):
    model, x = models.build(name)
    fn = torch.compile(model, backend="cpu_layout")
    with torch.inference_mode():
        assert_matches(fn(x), model(x))
    with torch.no_grad():  # the same compiled model, then under no_grad
        assert_matches(fn(x), model(x))


def test_normal_parameter_changed_inside_inference_mode_is_seen():
    model = conv_bn_net()
    fn = torch.compile(model, backend="cpu_layout")
    x = torch.randn(2, 3, 16, 16)
    with torch.inference_mode():
        fn(x)
        model[0].weight.mul_(-1.5)        # a normal tensor: its version counter moves
        model[1].running_var.add_(0.25)
        assert_matches(fn(x), model(x))


def test_inference_tensor_parameters_and_refresh():
    """Parameters that are inference tensors have no version counter: an in-place
    change made inside inference mode is invisible until cpu_layout.refresh()."""
    with torch.inference_mode():
        model = conv_bn_net().float()  # .float() inside inference mode: inference tensors
        assert model[0].weight.is_inference()
        fn = torch.compile(model, backend="cpu_layout")
        x = torch.randn(2, 3, 16, 16)
        assert_matches(fn(x), model(x))
        before = fn(x)
        model[0].weight.mul_(-1.5)
        model[5].running_mean.add_(1.0)
        expected = model(x)
        assert not torch.allclose(expected, before)
        cpu_layout.refresh()
        assert_matches(fn(x), expected)
        # New storage (load_state_dict of new tensors, or reassignment) needs no refresh.
        model[4].weight = nn.Parameter(torch.randn_like(model[4].weight), requires_grad=False)
        assert_matches(fn(x), model(x))


# ---- shapes and graphs real models produce ------------------------------------------

def test_empty_batch_returns_empty_like_eager():
    model = conv_bn_net()
    fn = torch.compile(model, backend="cpu_layout", dynamic=False)
    x = torch.randn(0, 3, 16, 16)
    with torch.no_grad():
        y, ref = fn(x), model(x)
    assert y.shape == ref.shape == (0, 10)


@pytest.mark.parametrize("stage", ["scale", "scores", "softmax", "attend"])
def test_attention_split_views_at_storage_offsets(stage):
    """q, k, v are selects of one buffer (k and v at a storage offset): views of
    them inside a C++ segment keep their offset, and permuted element-wise
    results come back with eager's strides."""

    class Attention(nn.Module):
        def forward(self, x):
            qkv = x.view(1, 49, 3, 4, 8).permute(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]
            q = q * 0.35
            if stage == "scale":
                return q
            a = q @ k.transpose(-2, -1)
            if stage == "scores":
                return a
            a = a.softmax(-1)
            return a if stage == "softmax" else a @ v

    x = torch.randn(1, 49, 96)
    with torch.no_grad():
        assert_matches(torch.compile(Attention(), backend="cpu_layout")(x), Attention()(x))


def test_graph_module_constants():
    """torchvision's shifted-window attention reads a relative position index the
    graph holds as a constant (FX get_attr)."""
    from cpu_layout import zoo

    if zoo.import_torchvision() is None:
        pytest.skip("torchvision is not installed")
    from torchvision.models.swin_transformer import ShiftedWindowAttention

    torch.manual_seed(0)
    m = ShiftedWindowAttention(32, [4, 4], [2, 2], 2).eval()
    x = torch.randn(1, 8, 8, 32)
    with torch.no_grad():
        assert_matches(torch.compile(m, backend="cpu_layout")(x), m(x))


def test_one_element_padding_and_infinite_clamp():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=(1,), stride=(2,)),
                      nn.Hardtanh(min_val=0.0, max_val=float("inf")),
                      nn.Conv2d(8, 8, 1), nn.Hardtanh(min_val=float("-inf"), max_val=0.5)).eval()
    x = torch.randn(2, 3, 15, 15)
    with torch.no_grad():
        assert_matches(torch.compile(m, backend="cpu_layout")(x), m(x))


def test_forward_that_masks_a_weight_through_data():
    """`weight.data *= mask` in forward: the mutation is applied on every call, as in eager."""

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.register_buffer("mask", (torch.rand(4, 3, 3, 3, generator=torch.Generator().manual_seed(0)) > 0.5).float())

        def forward(self, x):
            self.conv.weight.data *= self.mask
            return self.conv(x)

    torch.manual_seed(0)
    eager, compiled_model = Masked(), Masked()
    compiled_model.load_state_dict(eager.state_dict())
    fn = torch.compile(compiled_model, backend="cpu_layout")
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        for _ in range(2):
            assert_matches(fn(x), eager(x))
            torch.testing.assert_close(compiled_model.conv.weight, eager.conv.weight)
        compiled_model.conv.weight.add_(1.0)   # a later change is masked again on the next call
        eager.conv.weight.add_(1.0)
        assert_matches(fn(x), eager(x))
        torch.testing.assert_close(compiled_model.conv.weight, eager.conv.weight)


@pytest.mark.parametrize("case", ["permute_back", "transpose_back_contiguous", "view_3d", "permute_3d"])
def test_ops_reading_permuted_elementwise_results_see_eager_strides(case):
    """An element-wise result of a permuted view is, in eager, in that permutation:
    a layout-sensitive op after it (permute, view) must see it so, or its output
    strides differ from eager's (found by the property test)."""
    fn, x = {
        "permute_back": (lambda t: (t.permute(0, 2, 3, 1) * 2).permute(0, 3, 1, 2), torch.randn(2, 3, 6, 6)),
        "transpose_back_contiguous": (lambda t: torch.relu(t.transpose(1, 2)).transpose(1, 2).contiguous(),
                                      torch.randn(2, 3, 6, 6)),
        "view_3d": (lambda t: torch.relu(t).view(2, 7, 15), torch.randn(2, 15, 7).permute(0, 2, 1)),
        "permute_3d": (lambda t: torch.relu(t).permute(0, 2, 1), torch.randn(2, 2, 5).permute(0, 2, 1)[:, 2:4]),
    }[case]
    with torch.no_grad():
        assert_matches(torch.compile(fn, backend="cpu_layout", options={"debug": True})(x), fn(x))


def test_parameter_expanded_to_the_batch_under_mark_dynamic(compiled_graphs):
    """ViT's class token: a parameter expanded to the (dynamic) batch is not module
    state of a fixed size; treating it as one specialised the batch (Dynamo's
    ConstraintViolationError under mark_dynamic in the C++ wrapper)."""

    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 4, 4)
            self.cls = nn.Parameter(torch.randn(1, 1, 8))

        def forward(self, x):
            t = self.conv(x).flatten(2).transpose(1, 2)
            return torch.cat([self.cls.expand(t.shape[0], -1, -1), t], dim=1)

    m = Tokens().eval()
    fn = torch.compile(m, backend="cpu_layout")
    for bs in (2, 3):
        x = torch.randn(bs, 3, 16, 16)
        torch._dynamo.mark_dynamic(x, 0)
        with torch.no_grad():
            assert_matches(fn(x), m(x))
    assert len(compiled_graphs) == 1


@pytest.mark.parametrize("check", ["c++", "python"])
def test_state_key_sees_every_kind_of_change(check, monkeypatch):
    from cpu_layout import ops, state_key

    if check == "python":
        monkeypatch.setattr(state_key, "native", lambda: None)
    else:
        assert state_key.native() is not None, "the C++ state check did not build"
    w, b = torch.randn(4), torch.randn(4)
    key = state_key.StateKey()
    assert not key.same([w, 3, b])  # nothing remembered yet
    key.remember([w, 3, b])
    assert (key._state[-1] is not None) == (check == "c++")
    assert key.same([w, 5, b])  # arguments that are not tensors are graph constants
    b.add_(1)
    assert not key.same([w, 3, b]), "an in-place change bumps the version"
    key.remember([w, 3, b])
    assert key.same([w, 3, b])
    assert not key.same([w, 3, b.clone()]), "another tensor object"
    assert not key.same([w, 3, b.to(torch.float64)]), "another dtype is another tensor"
    assert not key.same([w, 3]), "fewer tensors"
    b.data = torch.randn(4)
    assert not key.same([w, 3, b]), "the same object on other storage"
    key.remember([w, 3, b])
    with torch.no_grad():
        b.set_(torch.randn(8)[2:6])
    assert not key.same([w, 3, b]), "set_: other storage"
    key.remember([w, 3, b])
    assert key.same([w, 3, b])
    with torch.inference_mode():
        wi, bi = torch.randn(4), torch.randn(4)
    key.remember([wi, bi])
    assert key.same([wi, bi]), "inference tensors have no version counter: taken as unchanged"
    ops.refresh()
    assert not key.same([wi, bi]), "until refresh()"
    key.remember([wi, bi])
    with torch.inference_mode():
        bi.data = torch.randn(4)
    assert not key.same([wi, bi]), "an inference tensor on other storage"


def test_without_guards_on_nn_modules_new_state_is_still_seen():
    """The README's serving option (guard_filter_fn=skip_guard_on_inbuilt_nn_modules_unsafe)
    drops Dynamo's guards on torch.nn modules: the backend's own module-state check
    must still see parameters changed in place, replaced, and batch-norm buffers."""
    m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()).eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        c = torch.compile(m, backend="cpu_layout", options={  # both wrappers: the `wrapper` fixture
            "guard_filter_fn": torch.compiler.skip_guard_on_inbuilt_nn_modules_unsafe})
        torch.testing.assert_close(c(x), m(x), rtol=1e-4, atol=1e-5)
        m[0].weight.mul_(2)
        torch.testing.assert_close(c(x), m(x), rtol=1e-4, atol=1e-5)
        m[0].weight = nn.Parameter(torch.randn(8, 3, 3, 3))
        torch.testing.assert_close(c(x), m(x), rtol=1e-4, atol=1e-5)
        m[1].running_var.fill_(4.0)
        torch.testing.assert_close(c(x), m(x), rtol=1e-4, atol=1e-5)
