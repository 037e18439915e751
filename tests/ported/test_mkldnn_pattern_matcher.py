"""Convolution + post-op (unary and binary) tests ported from PyTorch.

Upstream: pytorch/pytorch, test/inductor/test_mkldnn_pattern_matcher.py at
commit 0021157d7d139d0631da94069527577a6242d8f5 (the non-quantized conv tests
of `TestPatternMatcher` and `TestDynamicPatternMatcher`).

Adaptation: backend="cpu_layout" instead of Inductor with freezing, CPU only,
small shapes. Upstream checks pattern-matcher counters and generated-kernel
counts; these tests check values only (plus eager's output sizes and strides),
which is what the backend promises whether or not it fuses a post-op into the
oneDNN call. Dtypes: fp32 and bf16 autocast (AMP), as upstream's
check_autocast; fp16 autocast is not ported (the backend's convolutions are
fp32 and bf16). To keep the file fast, upstream's product
(op x memory format x dtype) is thinned: every post-op runs after conv2d and
conv3d in fp32 and after conv2d under AMP; the memory formats, ReLU or not,
and the conv3d / broadcast / dynamic-shape groups are sampled, as each test
says. Transposed convolutions run as ATen ops inside the graph
(allowed), with their post-ops after them. Not ported: linear, quantization
(qconv/qlinear/woq/int_mm) and XPU tests.

Every test runs under both wrappers (CPU_LAYOUT_CPP_WRAPPER=0/1) with
CPU_LAYOUT_STRICT=1 (a whole-graph fallback to eager is an error), under
torch.no_grad() (and torch.inference_mode() in the few tests that say so).
Tolerances: fp32 to rtol 1e-4 and atol 1e-4 * max|ref|; bf16 / AMP outputs to
3e-2 relative and 3e-2 * max|ref| absolute (both round to bf16, at different
points).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ported_support import compile_, autocast, clone, assert_same  # noqa: E402

pytestmark = pytest.mark.usefixtures("strict_compile", "wrapper")


def check(mod, inputs, amp=False, dynamic=False, fullgraph=False, calls=1,
          inference_mode=False, more_inputs=()):
    """Upstream's _test_common / _test_code_common, values only: a fresh compile,
    compared with eager (under no_grad, then optionally afresh under inference_mode)."""
    modes = [torch.no_grad] + ([torch.inference_mode] if inference_mode else [])
    for mode in modes:
        torch._dynamo.reset()
        with mode(), autocast(amp):
            fn = compile_(mod, dynamic=dynamic, fullgraph=fullgraph)
            for _ in range(calls):
                assert_same(fn(*clone(inputs)), mod(*clone(inputs)), amp)
            for other in more_inputs:
                assert_same(fn(*clone(other)), mod(*clone(other)), amp)


CL = {2: torch.channels_last, 3: torch.channels_last_3d}


def conv(dim, *args, **kwargs):
    return (nn.Conv2d if dim == 2 else nn.Conv3d)(*args, **kwargs)


def x_shape(dim, batch=1):
    return (batch, 3, 16, 16) if dim == 2 else (batch, 3, 6, 10, 10)


# The unary post-ops of upstream's unary_list (its values are matcher counts).
UNARY = {
    "relu": lambda: nn.ReLU(),
    "sigmoid": lambda: nn.Sigmoid(),
    "tanh": lambda: nn.Tanh(),
    "hardswish": lambda: nn.Hardswish(),
    "leaky_relu": lambda: nn.LeakyReLU(0.1, inplace=False),
    "hardtanh": lambda: nn.Hardtanh(min_val=-0.5, max_val=4.0, inplace=False),
    "hardtanh_inf": lambda: nn.Hardtanh(min_val=-0.5, max_val=float("inf"), inplace=False),
    "gelu": lambda: nn.GELU(approximate="none"),
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "relu6": lambda: nn.ReLU6(),
    "silu": lambda: nn.SiLU(),
    "hardsigmoid": lambda: nn.Hardsigmoid(),
}

# Upstream's binary_list: call_function / call_method, out of place and in place.
BINARY = {
    "torch.add": lambda x, y: torch.add(x, y),
    "torch.add_swapped": lambda x, y: torch.add(y, x),
    "x.add": lambda x, y: x.add(y),
    "x.add_": lambda x, y: x.add_(y),
    "torch.sub": lambda x, y: torch.sub(x, y),
    "x.sub": lambda x, y: x.sub(y),
    "x.sub_": lambda x, y: x.sub_(y),
}


class ConvUnary(nn.Module):
    def __init__(self, dim, unary_fn):
        super().__init__()
        self.conv = conv(dim, 3, 16, kernel_size=3, stride=1)
        self.unary_fn = unary_fn

    def forward(self, x):
        return self.unary_fn(self.conv(x))


def run_conv_unary(dim, unary, memory_format, amp, dynamic=False):
    mod = ConvUnary(dim, UNARY[unary]()).to(memory_format=memory_format).eval()
    v = torch.randn(x_shape(dim)).add(1).to(memory_format=memory_format)
    more = [(torch.randn(x_shape(dim, 3)).add(1).to(memory_format=memory_format),)] \
        if dynamic else ()
    check(mod, (v,), amp=amp, dynamic=dynamic, more_inputs=more)


@pytest.mark.parametrize("variant", ["fp32-contiguous", "fp32-channels_last",
                                     "amp-channels_last"])
@pytest.mark.parametrize("unary", list(UNARY))
def test_conv2d_unary_cpu(unary, variant):
    # Upstream: fp32 and AMP, each in both memory formats; AMP in NCHW is left out.
    dtype, memory_format = variant.split("-")
    fmt = CL[2] if memory_format == "channels_last" else torch.contiguous_format
    run_conv_unary(2, unary, fmt, dtype == "amp")


@pytest.mark.parametrize("unary", list(UNARY))
def test_conv3d_unary_cpu(unary):
    run_conv_unary(3, unary, CL[3], amp=False)


@pytest.mark.parametrize("unary", ["relu", "sigmoid", "hardswish", "gelu"])
def test_conv3d_unary_cpu_amp(unary):
    # test_conv3d_unary_cpu's AMP half for a subset of the post-ops, in NCDHW.
    run_conv_unary(3, unary, torch.contiguous_format, amp=True)


@pytest.mark.parametrize("dim", [2, 3], ids=["conv2d", "conv3d"])
@pytest.mark.parametrize("unary", ["relu", "hardswish"])
def test_conv_unary_dynamic_shapes(dim, unary):
    # TestDynamicPatternMatcher.test_conv{2,3}d_unary_dynamic_shapes (a subset of
    # the post-ops), plus a second batch size through the same compiled graph.
    run_conv_unary(dim, unary, CL[dim], amp=False, dynamic=True)


class ConvBinary(nn.Module):
    def __init__(self, dim, binary_fn, has_relu):
        super().__init__()
        self.conv1 = conv(dim, 3, 16, kernel_size=3, stride=1)
        self.conv2 = conv(dim, 3, 16, kernel_size=3, stride=1)
        self.binary_fn = binary_fn
        self.has_relu = has_relu

    def forward(self, x):
        x1 = self.conv1(x)
        x2 = self.conv2(x)
        if self.has_relu:
            return self.binary_fn(x1, x2).relu()
        return self.binary_fn(x1, x2)


def run_conv_binary(dim, binary, has_relu, memory_format, amp, dynamic=False):
    mod = ConvBinary(dim, BINARY[binary], has_relu).eval()
    v = torch.randn(x_shape(dim)).add(1).to(memory_format=memory_format)
    more = [(torch.randn(x_shape(dim, 2)).add(1).to(memory_format=memory_format),)] \
        if dynamic else ()
    check(mod, (v,), amp=amp, dynamic=dynamic, more_inputs=more)


@pytest.mark.parametrize("variant", ["relu-channels_last", "no_relu-contiguous"])
@pytest.mark.parametrize("binary", list(BINARY))
def test_conv2d_binary(binary, variant):
    # fp32; upstream also crosses ReLU / no ReLU with both memory formats.
    relu, memory_format = variant.split("-")
    fmt = CL[2] if memory_format == "channels_last" else torch.contiguous_format
    run_conv_binary(2, binary, relu == "relu", fmt, amp=False)


@pytest.mark.parametrize("binary", list(BINARY))
def test_conv2d_binary_amp(binary):
    # test_conv2d_binary's bf16 autocast half: channels-last, with the ReLU.
    run_conv_binary(2, binary, True, CL[2], amp=True)


@pytest.mark.parametrize("binary", list(BINARY))
def test_conv3d_binary(binary):
    # fp32; channels_last_3d with the ReLU for the out-of-place ops, NCDHW
    # without it for the others.
    has_relu = not binary.endswith("_")
    run_conv_binary(3, binary, has_relu, CL[3] if has_relu else torch.contiguous_format,
                    amp=False)


@pytest.mark.parametrize("dim", [2, 3], ids=["conv2d", "conv3d"])
def test_conv_binary_dynamic_shapes(dim):
    # TestDynamicPatternMatcher.test_conv{2,3}d_binary_dynamic_shapes (a subset).
    run_conv_binary(dim, "x.add_", True, CL[dim], amp=False, dynamic=True)


class ConvBinaryBroadcast(nn.Module):
    def __init__(self, dim, binary_fn, has_relu):
        super().__init__()
        self.conv = conv(dim, 3, 16, kernel_size=3, stride=1)
        self.binary_fn = binary_fn
        self.has_relu = has_relu

    def forward(self, x, x2):
        x1 = self.conv(x)
        if self.has_relu:
            return self.binary_fn(x1, x2).relu()
        return self.binary_fn(x1, x2)


BROADCAST_OTHERS = {2: [[2, 16, 1, 1], [1, 16, 1, 1], [1, 1, 1, 1]],
                    3: [[2, 16, 1, 1, 1], [1, 16, 1, 1, 1], [1, 1, 1, 1, 1]]}


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
@pytest.mark.parametrize("other_shape", [0, 1, 2], ids=["N_C_1_1", "1_C_1_1", "1_1_1_1"])
def test_conv2d_binary_broadcast_shapes_cpu(other_shape, amp):
    # Upstream: every binary op x relu x format x dtype; here add, the ReLU and
    # channels-last with fp32, sub in NCHW without the ReLU with AMP.
    binary = "x.sub" if amp else "torch.add"
    has_relu = not amp
    fmt = CL[2] if not amp else torch.contiguous_format
    mod = ConvBinaryBroadcast(2, BINARY[binary], has_relu).eval()
    x = torch.randn(x_shape(2, 2)).add(1).to(memory_format=fmt)
    other = torch.randn(BROADCAST_OTHERS[2][other_shape]).add(1).to(memory_format=fmt)
    if amp:
        other = other.to(torch.bfloat16)
    check(mod, (x, other), amp=amp)


@pytest.mark.parametrize("other_shape", [0, 1, 2], ids=["N_C_1_1_1", "1_C_1_1_1", "1_1_1_1_1"])
def test_conv3d_binary_broadcast_shapes_cpu(other_shape):
    mod = ConvBinaryBroadcast(3, BINARY["torch.add"], True).eval()
    x = torch.randn(x_shape(3, 2)).add(1).to(memory_format=CL[3])
    other = torch.randn(BROADCAST_OTHERS[3][other_shape]).add(1).to(memory_format=CL[3])
    check(mod, (x, other))


def test_conv2d_linear_add_broadcast_shapes_cpu():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 16, kernel_size=3, stride=1)
            self.linear = nn.Linear(3, 16)

        def forward(self, x1, x2):
            return self.conv(x1) + self.linear(x2)[:, :, None, None]

    check(M().eval(), (torch.randn(2, 3, 16, 16), torch.randn(2, 3)))


@pytest.mark.parametrize("unary", ["relu", "hardswish"])
def test_conv_transpose2d_unary_cpu(unary):
    # A subset of the post-ops; the transposed conv may run as an ATen op.
    class M(nn.Module):
        def __init__(self, unary_fn):
            super().__init__()
            self.conv_transpose = nn.ConvTranspose2d(3, 16, 3, stride=2, padding=1)
            self.unary_fn = unary_fn

        def forward(self, x):
            return self.unary_fn(self.conv_transpose(x))

    for fmt in (torch.contiguous_format, torch.channels_last):
        check(M(UNARY[unary]()).eval(), (torch.randn(1, 3, 12, 12).to(memory_format=fmt),))


# --- fallbacks and fusion corner cases ------------------------------------------------------


@pytest.mark.parametrize("bounds", ["scalar_min_gt_max", "tensor"])
def test_hardtanh_pattern_fallback(bounds):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv_transpose = nn.ConvTranspose2d(in_channels=3, out_channels=32,
                                                     kernel_size=3, stride=1, padding=1)

        def forward(self, x, min_value, max_value):
            out = self.conv_transpose(x)
            return torch.clamp_max(torch.clamp_min(out, min_value), max_value)

    v = torch.randn(1, 3, 12, 12)
    if bounds == "tensor":
        min_value, max_value = torch.randn(1, 32, 12, 12), torch.randn(1, 32, 12, 12)
    else:  # min_value > max_value
        min_value, max_value = 3, 0
    check(Model().eval(), (v, min_value, max_value))


class ConvHardtanhLike(nn.Module):
    """A conv followed by clamp_min/clamp_max (the hardtanh pattern) on a forward conv."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 32, kernel_size=3, stride=1, padding=1)

    def forward(self, x, min_value, max_value):
        return torch.clamp_max(torch.clamp_min(self.conv(x), min_value), max_value)


@pytest.mark.parametrize("bounds", ["scalar_min_gt_max", "tensor"])
def test_hardtanh_pattern_fallback_conv2d(bounds):
    # The same check with a forward conv, where the clamp could become a post-op.
    v = torch.randn(1, 3, 12, 12)
    if bounds == "tensor":
        min_value, max_value = torch.randn(1, 32, 12, 12), torch.randn(1, 32, 12, 12)
    else:
        min_value, max_value = 3.0, 0.0
    check(ConvHardtanhLike().eval(), (v, min_value, max_value))


@pytest.mark.parametrize("slope", ["scalar", "tensor"])
def test_leaky_relu_pattern_fallback(slope):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(in_channels=3, out_channels=32, kernel_size=3, stride=1,
                                  padding=1)

        def forward(self, x, negative_slope):
            conv_out = self.conv(x)
            return torch.where(conv_out > 0, conv_out, conv_out * negative_slope)

    negative_slope = 0.1 if slope == "scalar" else torch.randn(1, 32, 12, 12)
    check(Model().eval(), (torch.randn(1, 3, 12, 12), negative_slope))


def test_conv2d_add_scalar():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(in_channels=3, out_channels=32, kernel_size=3, stride=1,
                                  padding=1)

        def forward(self, x):
            return torch.add(self.conv(x), 1.0)

    check(Model().eval(), (torch.randn(1, 3, 12, 12),), inference_mode=True)


class InplaceV1(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 32, kernel_size=3, stride=1, padding=1)

    def forward(self, x, other):
        return torch.add(self.conv(x), other.relu())


class InplaceV2(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 32, kernel_size=3, stride=1, padding=1)
        self.conv2 = nn.Conv2d(32, 32, kernel_size=3, stride=1, padding=1)
        self.conv3 = nn.Conv2d(32, 32, kernel_size=3, stride=1, padding=1)

    def forward(self, x, _):
        pow_out = torch.pow(self.conv(x), 2)
        conv_out3 = self.conv3(self.conv2(pow_out))
        return torch.add(conv_out3, pow_out)


@pytest.mark.parametrize("model", [InplaceV1, InplaceV2], ids=["v1", "v2"])
def test_conv2d_binary_inplace_fusion_pass_cpu(model):
    inp = torch.randn(1, 3, 12, 12).to(memory_format=torch.channels_last)
    other = torch.randn(1, 32, 12, 12).to(memory_format=torch.channels_last)
    mod = model().to(memory_format=torch.channels_last).eval()
    check(mod, (inp, other), fullgraph=True)


class FailedV1(nn.Module):  # the written buffer is a graph input
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 32, kernel_size=3, stride=1, padding=1)

    def forward(self, x, other):
        return torch.add(self.conv(x), other)


class FailedV2(nn.Module):  # the written buffer is an alias
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 32, kernel_size=3, stride=1, padding=1)

    def forward(self, x, other):
        return torch.add(self.conv(x), other[1:2, :, :, :]), other


class FailedV3(nn.Module):  # the other operand has another user
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 32, kernel_size=3, stride=1, padding=1)
        self.conv2 = nn.Conv2d(32, 32, kernel_size=3, stride=1, padding=1)

    def forward(self, x, _):
        pow_out = torch.pow(self.conv(x), 2)
        other2 = F.relu(pow_out)
        res = torch.add(self.conv2(pow_out), pow_out)
        return res + other2


class FailedV4(nn.Module):  # the other operand is a reinterpreted view
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 32, 3, padding=1, bias=True)
        self.linear = nn.Linear(32 * 12, 32 * 12)
        self.relu = nn.ReLU()

    def forward(self, x, y):
        x = self.conv(self.relu(x))
        y = self.linear(y)
        y = torch.cat((y, y + 1), 1)
        y = torch.ops.aten.permute.default(y, [0, 2, 1]).reshape(1, 32, 12, 12)
        return x + y


class FailedV5(nn.Module):  # the other operand is the conv's own input
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(32, 32, 3, padding=1, bias=True)
        self.relu = nn.ReLU()

    def forward(self, _, x):
        x1 = self.relu(x)
        return self.conv(x1) + x1


@pytest.mark.parametrize("case", ["v1", "v2", "v3", "v4", "v5"])
def test_conv2d_binary_inplace_fusion_failed_cpu(case):
    cl = torch.channels_last
    inp = torch.randn(1, 3, 12, 12).to(memory_format=cl)
    model, other = {
        "v1": (FailedV1, torch.randn(1, 32, 12, 12).to(memory_format=cl)),
        "v2": (FailedV2, torch.randn(2, 32, 12, 12).to(memory_format=cl)),
        "v3": (FailedV3, torch.randn(1, 32, 12, 12).to(memory_format=cl)),
        "v4": (FailedV4, torch.randn(1, 6, 32 * 12)),
        "v5": (FailedV5, torch.randn(1, 32, 12, 12).to(memory_format=cl)),
    }[case]
    mod = model().to(memory_format=cl).eval()
    check(mod, (inp, other), fullgraph=True)


class AddAlpha(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(in_channels=3, out_channels=32, kernel_size=3, stride=1,
                              padding=1)

    def forward(self, x, other, alpha):
        return torch.add(self.conv(x), other, alpha=alpha)


class AddSelf(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(in_channels=3, out_channels=16, kernel_size=3, stride=1,
                              padding=1)

    def forward(self, x):
        out = self.conv(x)
        return torch.add(out, out)


class AddDouble(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(in_channels=3, out_channels=16, kernel_size=3, stride=1,
                              padding=1)

    def forward(self, x):
        temp = self.conv(x)
        other = torch.ones(temp.shape, dtype=torch.double)
        return torch.add(temp, other)


@pytest.mark.parametrize("case", ["alpha", "broadcast_other", "add_self", "mixed_dtype"])
def test_conv2d_binary_fusion_failed(case):
    inp = torch.randn(1, 3, 12, 12).to(memory_format=torch.channels_last)
    if case == "alpha":  # alpha != 1
        mod = AddAlpha().to(memory_format=torch.channels_last).eval()
        args = (inp, torch.randn(1, 32, 12, 12).to(memory_format=torch.channels_last), 0.1)
    elif case == "broadcast_other":  # other has another size than the conv's output
        mod = AddAlpha().to(memory_format=torch.channels_last).eval()
        args = (inp, torch.randn(32, 12, 12), 1.0)
    elif case == "add_self":  # both operands are the conv's output
        mod, args = AddSelf().to(memory_format=torch.channels_last).eval(), (inp,)
    else:  # mixed dtype: the sum is float64
        mod, args = AddDouble().to(memory_format=torch.channels_last).eval(), (inp,)
    check(mod, args, fullgraph=True)


def test_reproduce_99842_issue():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1)

        def forward(self, input_tensor):
            x = self.conv(input_tensor)
            return F.relu(x + torch.ones(x.size()))

    check(Model().eval(), (torch.randn(1, 3, 14, 14),), fullgraph=True, inference_mode=True)


class Issue113440(nn.Module):
    def __init__(self, add_fn, tail):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, kernel_size=3, stride=1)
        self.conv2 = nn.Conv2d(3, 6, kernel_size=3, stride=1)
        self.add_fn = add_fn
        self.relu = nn.ReLU(inplace=True)
        self.conv3 = nn.Conv2d(6, 6, kernel_size=3, stride=1)
        self.conv4 = nn.Conv2d(6, 6, kernel_size=3, stride=1)
        self.add_fn2 = add_fn
        self.relu2 = nn.ReLU(inplace=True)
        self.tail = tail

    def forward(self, x):
        tmp = self.relu(self.add_fn(self.conv1(x), self.conv2(x)))
        tmp1 = self.conv3(tmp)
        if self.tail == "add":  # test_reproduce_113440_issue_1
            return self.relu2(self.add_fn2(tmp1, self.conv4(tmp)))
        return self.relu2(tmp1)  # test_reproduce_113440_issue_2


@pytest.mark.parametrize("tail", ["add", "relu"], ids=["issue_1", "issue_2"])
def test_reproduce_113440_issue(tail):
    mod = Issue113440(lambda x, y: x.add_(y), tail).eval()
    check(mod, (torch.randn(1, 3, 8, 8).add(1),), calls=2)
