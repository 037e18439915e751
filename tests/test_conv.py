"""cpu_layout.ops convolutions against torch.nn.functional, values and strides.

Tolerances: fp32 results must match eager to 1e-4 relative (plus 1e-4 of the
output's largest magnitude, for sums that cancel). bf16 results are checked
two ways: against an fp32 convolution of the same bf16 inputs, to within one
bf16 rounding (2**-8 relative) plus accumulation-order slack of 1e-3 of the
largest magnitude; and against eager bf16 to 2e-2 relative, since eager also
rounds once but may round intermediate post-op results.
"""
import pytest
import torch
import torch.nn.functional as F

from cpu_layout import ops

pytestmark = pytest.mark.usefixtures("no_grad")

# (N, C, H, W, OC, kernel, stride, padding, dilation, groups)
CASES = {
    "3x3": (2, 8, 9, 9, 16, 3, 1, 1, 1, 1),
    "1x1": (2, 16, 7, 7, 32, 1, 1, 0, 1, 1),
    "7x7s2": (1, 3, 23, 23, 8, 7, 2, 3, 1, 1),
    "dilated": (2, 8, 11, 11, 8, 3, 1, 2, 2, 1),
    "groups2": (2, 8, 9, 9, 12, 3, 1, 1, 1, 2),
    "depthwise_s2": (2, 16, 10, 10, 16, 3, 2, 1, 1, 16),
    "depthwise_x2": (1, 8, 9, 9, 16, 3, 1, 1, 1, 8),
    "in_ch1": (5, 1, 28, 28, 64, 3, 1, 0, 1, 1),
    "odd_b5": (5, 6, 13, 11, 10, 3, 2, 1, 1, 1),
    "rect": (2, 4, 12, 9, 8, (3, 2), (2, 1), (1, 0), 1, 1),
    "batch1_big_c": (1, 64, 6, 6, 128, 3, 1, 1, 1, 1),
}

FORMATS = {"cf": torch.contiguous_format, "cl": torch.channels_last}


def make(case, dtype, in_fmt="cf", bias=True, seed=0):
    n, c, h, w, oc, k, s, p, d, g = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    kk = k if isinstance(k, tuple) else (k, k)
    x = torch.randn(n, c, h, w, generator=gen).contiguous(memory_format=FORMATS[in_fmt])
    wt = torch.randn(oc, c // g, *kk, generator=gen) / (c // g * kk[0] * kk[1]) ** 0.5
    b = torch.randn(oc, generator=gen) if bias else None
    x, wt = x.to(dtype), wt.to(dtype)
    b = b.to(dtype) if b is not None else None
    return x, wt, b, dict(stride=s, padding=p, dilation=d, groups=g)


def expected_strides(size, fmt):
    return torch.empty(size, memory_format=fmt).stride()


def assert_fp32_close(y, ref):
    scale = ref.abs().max().item() or 1.0
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * scale)


def assert_bf16_close(y, x, wt, b, kw, post=lambda t: t):
    ref32 = post(F.conv2d(x.float(), wt.float(), None if b is None else b.float(), **kw))
    scale = ref32.abs().max().item() or 1.0
    torch.testing.assert_close(y.float(), ref32, rtol=2**-8, atol=1e-3 * scale)
    ref16 = post(F.conv2d(x, wt, b, **kw))
    torch.testing.assert_close(y.float(), ref16.float(), rtol=2e-2, atol=1e-2 * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("out_layout", [None, "nchw", "nhwc"])
@pytest.mark.parametrize("in_fmt", ["cf", "cl"])
@pytest.mark.parametrize("case", list(CASES))
def test_conv2d_matches_eager(case, in_fmt, out_layout, dtype):
    x, wt, b, kw = make(case, dtype, in_fmt)
    y = ops.conv2d(x, wt, b, out_layout=out_layout, **kw)
    ref = F.conv2d(x, wt, b, **kw)
    assert y.shape == ref.shape
    if out_layout is None:
        assert y.stride() == ref.stride(), "default output layout must be eager's"
    else:
        fmt = torch.channels_last if out_layout == "nhwc" else torch.contiguous_format
        assert y.stride() == expected_strides(ref.shape, fmt)
    if dtype == torch.float32:
        assert_fp32_close(y, ref)
    else:
        assert_bf16_close(y, x, wt, b, kw)


def test_no_reference_kernels_on_grid():
    for case in CASES:
        for in_fmt in FORMATS:
            for out in ("nchw", "nhwc"):
                for dtype in (torch.float32, torch.bfloat16):
                    x, wt, b, kw = make(case, dtype, in_fmt)
                    name = ops.impl_name(x, wt, b, out_layout=out, **kw)
                    assert "ref" not in name, f"{case} {in_fmt}->{out} {dtype}: {name}"


def test_no_reference_kernels_with_residual_add():
    for case in ("1x1", "3x3", "depthwise_s2", "in_ch1"):
        for in_fmt in FORMATS:
            for out in ("nchw", "nhwc"):
                for dtype in (torch.float32, torch.bfloat16):
                    x, wt, b, kw = make(case, dtype, in_fmt)
                    res = torch.empty(F.conv2d(x, wt, b, **kw).shape, dtype=dtype)
                    name = ops.impl_name(x, wt, b, post_ops=[("add", res), "relu"], out_layout=out, **kw)
                    assert "ref" not in name, f"{case} {in_fmt}->{out} {dtype} +add: {name}"


POST_OPS = {
    "relu": (["relu"], F.relu),
    "leaky_relu": ([("leaky_relu", 0.2)], lambda t: F.leaky_relu(t, 0.2)),
    "silu": (["silu"], F.silu),
    "gelu_erf": (["gelu"], F.gelu),
    "gelu_tanh": (["gelu_tanh"], lambda t: F.gelu(t, approximate="tanh")),
    "hardswish": (["hardswish"], F.hardswish),
    "sigmoid": (["sigmoid"], torch.sigmoid),
    "tanh": (["tanh"], torch.tanh),
    "clamp": ([("clamp", -0.5, 0.7)], lambda t: t.clamp(-0.5, 0.7)),
    "relu6": (["relu6"], F.relu6),
    "chain": (["silu", ("clamp", -0.2, 0.4)], lambda t: F.silu(t).clamp(-0.2, 0.4)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("out_layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("case", ["3x3", "depthwise_s2", "in_ch1"])
@pytest.mark.parametrize("name", list(POST_OPS))
def test_eltwise_post_ops(name, case, out_layout, dtype):
    spec, fn = POST_OPS[name]
    x, wt, b, kw = make(case, dtype, "cl" if out_layout == "nhwc" else "cf")
    y = ops.conv2d(x, wt, b, post_ops=spec, out_layout=out_layout, **kw)
    if dtype == torch.float32:
        assert_fp32_close(y, fn(F.conv2d(x, wt, b, **kw)))
    else:
        ref32 = fn(F.conv2d(x.float(), wt.float(), b.float(), **kw))
        scale = ref32.abs().max().item()
        torch.testing.assert_close(y.float(), ref32, rtol=2**-7, atol=2e-3 * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("res_fmt", ["cf", "cl"])
@pytest.mark.parametrize("out_layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("case", ["3x3", "1x1", "depthwise_s2"])
def test_residual_add_then_relu(case, out_layout, res_fmt, dtype):
    x, wt, b, kw = make(case, dtype, "cf")
    shape = F.conv2d(x, wt, b, **kw).shape
    res = torch.randn(shape).to(dtype).contiguous(memory_format=FORMATS[res_fmt])
    res_before = res.clone()
    y = ops.conv2d(x, wt, b, post_ops=[("add", res), "relu"], out_layout=out_layout, **kw)
    assert torch.equal(res, res_before), "the residual must not be modified"
    fmt = torch.channels_last if out_layout == "nhwc" else torch.contiguous_format
    assert y.stride() == expected_strides(shape, fmt)
    if dtype == torch.float32:
        assert_fp32_close(y, F.relu(F.conv2d(x, wt, b, **kw) + res))
    else:
        ref32 = F.relu(F.conv2d(x.float(), wt.float(), b.float(), **kw) + res.float())
        scale = ref32.abs().max().item()
        torch.testing.assert_close(y.float(), ref32, rtol=2**-7, atol=2e-3 * scale)


def test_add_before_and_after_activation():
    x, wt, b, kw = make("3x3", torch.float32)
    r1 = torch.randn(F.conv2d(x, wt, b, **kw).shape)
    r2 = torch.randn_like(r1)
    before = (r1.clone(), r2.clone())
    # The first add runs as oneDNN's sum post-op (r1 copied into the output), the second as a binary one.
    y = ops.conv2d(x, wt, b, post_ops=["silu", ("add", r1), ("add", r2)], **kw)
    assert_fp32_close(y, F.silu(F.conv2d(x, wt, b, **kw)) + r1 + r2)
    assert torch.equal(r1, before[0]) and torch.equal(r2, before[1])


def test_non_dense_input_and_weight():
    x, wt, b, kw = make("3x3", torch.float32)
    big = torch.randn(2, 16, 20, 20)
    xs = big[:, ::2, 1:10, ::2]  # strided view: neither NCHW- nor NHWC-dense
    wt_t = wt.transpose(2, 3).contiguous().transpose(2, 3)  # odd weight strides
    for out in (None, "nchw", "nhwc"):
        y = ops.conv2d(xs, wt_t, b, out_layout=out, **kw)
        assert_fp32_close(y, F.conv2d(xs, wt, b, **kw))


def test_channels_last_weight_and_unbatched():
    x, wt, b, kw = make("3x3", torch.float32)
    wcl = wt.contiguous(memory_format=torch.channels_last)
    ref = F.conv2d(x, wcl, b, **kw)
    y = ops.conv2d(x, wcl, b, **kw)
    assert y.stride() == ref.stride()
    assert_fp32_close(y, ref)
    y1 = ops.conv2d(x[0], wt, b, **kw)
    assert y1.shape == ref.shape[1:]
    assert_fp32_close(y1, F.conv2d(x[0], wt, b, **kw))


def test_maml_size1_channel_input_keeps_eager_strides():
    # [N,1,28,28] is both NCHW- and NHWC-dense; eager calls it contiguous.
    x = torch.randn(5, 1, 28, 28)
    wt = torch.randn(64, 1, 3, 3)
    b = torch.randn(64)
    for xin in (x, x.contiguous(memory_format=torch.channels_last), x.bfloat16()):
        w_ = wt.to(xin.dtype)
        b_ = b.to(xin.dtype)
        ref = F.conv2d(xin, w_, b_)
        y = ops.conv2d(xin, w_, b_)
        assert y.stride() == ref.stride() == (43264, 676, 26, 1)


def test_padding_strings():
    x, wt, b, _ = make("3x3", torch.float32)
    for pad in ("same", "valid"):
        assert_fp32_close(ops.conv2d(x, wt, b, padding=pad), F.conv2d(x, wt, b, padding=pad))
    wt4 = torch.randn(8, 8, 4, 4)  # even kernel: 'same' pads one more on the right
    assert_fp32_close(ops.conv2d(x, wt4, padding="same"), F.conv2d(x, wt4, padding="same"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cl", [False, True])
def test_conv1d(dtype, cl):
    x = torch.randn(3, 8, 50).to(dtype)
    if cl:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    wt = (torch.randn(12, 4, 5) * 0.3).to(dtype)
    b = torch.randn(12).to(dtype)
    y = ops.conv1d(x, wt, b, stride=2, padding=2, groups=2, post_ops=["relu"],
                   out_layout="nwc" if cl else None)
    ref = F.relu(F.conv1d(x.float(), wt.float(), b.float(), stride=2, padding=2, groups=2))
    if not cl:
        assert y.stride() == ref.stride()
    else:
        assert y.stride() == (y.shape[1] * y.shape[2], 1, y.shape[1])
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(y.float(), ref, **tol)


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last_3d])
def test_conv3d(fmt):
    x = torch.randn(2, 4, 6, 7, 8).contiguous(memory_format=fmt)
    wt = torch.randn(8, 4, 3, 3, 3) * 0.2
    ref = F.conv3d(x, wt, None, stride=(1, 2, 1), padding=1)
    y = ops.conv3d(x, wt, None, stride=(1, 2, 1), padding=1)
    assert y.stride() == ref.stride()
    assert_fp32_close(y, ref)


@pytest.mark.parametrize("cin", [16, 24, 48, 80, 112])
@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("out_layout", ["nchw", "nhwc"])
def test_bf16_non_overlapping_kernels(cin, k, out_layout):
    """stride == kernel (ConvNeXt's downsampling and stems): oneDNN 3.2's AMX bf16
    kernel for these shapes is wrong; the extension must pick another."""
    g = torch.Generator().manual_seed(cin * k)
    x = torch.randn(2, cin, 16, 16, generator=g).bfloat16()
    w = (torch.randn(64, cin, k, k, generator=g) * 0.05).bfloat16()
    b = torch.randn(64, generator=g).bfloat16()
    y = ops.conv2d(x, w, b, stride=k, out_layout=out_layout)
    ref = F.conv2d(x.float(), w.float(), b.float(), stride=k)
    scale = ref.abs().max().item()
    torch.testing.assert_close(y.float(), ref, rtol=2 ** -8, atol=1e-3 * scale + 2 ** -8 * scale)


def test_conv_out_spatial_is_torchs_formula():
    # One formula for the conv calls and the planner's graphs: torch's own, asymmetric padding too.
    from cpu_layout.ops import conv_out_spatial

    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        h, w, k, s, d = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in
                         ((1, 20), (1, 20), (1, 6), (1, 4), (1, 3)))
        pl, pr = (int(torch.randint(0, 4, (1,), generator=g)) for _ in range(2))
        if h + pl + pr < d * (k - 1) + 1 or w + pl + pr < d * (k - 1) + 1:
            continue
        x = F.pad(torch.zeros(1, 1, h, w), (pl, pr, pl, pr))
        want = F.conv2d(x, torch.zeros(1, 1, k, k), stride=s, dilation=d).shape[2:]
        assert conv_out_spatial((h, w), (k, k), (s, s), (pl, pl), (pr, pr), (d, d)) == tuple(want)
