"""Bad input raises a Python exception with the reason; nothing crashes."""
import pytest
import torch

from cpu_layout import ops
from cpu_layout._native import ffi, lib

pytestmark = pytest.mark.usefixtures("no_grad")

X = torch.randn(2, 8, 9, 9)
W = torch.randn(16, 8, 3, 3)
B = torch.randn(16)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: ops.conv2d(X.double(), W.double()), TypeError, "float32 or bfloat16"),
        (lambda: ops.conv2d(X, W.bfloat16()), TypeError, "same dtype"),
        (lambda: ops.conv2d(X, W, B.bfloat16()), TypeError, "same dtype"),
        (lambda: ops.conv2d(X, torch.randn(16, 3, 3, 3), groups=3), ValueError, "divisible by groups"),
        (lambda: ops.conv2d(X, torch.randn(15, 4, 3, 3), groups=2), ValueError, "divisible by groups"),
        (lambda: ops.conv2d(X, torch.randn(16, 5, 3, 3)), ValueError, "expects 5"),
        (lambda: ops.conv2d(X[0, 0], W), ValueError, "expects a 3-d"),
        (lambda: ops.conv2d(X.unsqueeze(0), W), ValueError, "expects a 3-d"),
        (lambda: ops.conv2d(X, W[0]), ValueError, "4-d weight"),
        (lambda: ops.conv2d(torch.randn(2, 8, 0, 9), W), ValueError, "empty"),
        (lambda: ops.conv2d(X, W, padding=-1), ValueError, "non-negative"),
        (lambda: ops.conv2d(X, W, padding=(1, -2)), ValueError, "non-negative"),
        (lambda: ops.conv2d(X, W, stride=0), ValueError, "stride must be positive"),
        (lambda: ops.conv2d(X, W, dilation=0), ValueError, "dilation must be positive"),
        (lambda: ops.conv2d(X, W, stride=(1, 2, 3)), ValueError, "2 values"),
        (lambda: ops.conv2d(X, W, padding="full"), ValueError, "padding must be"),
        (lambda: ops.conv2d(X, W, stride=2, padding="same"), ValueError, "strided"),
        (lambda: ops.conv2d(X, W, groups=0), ValueError, "groups must be"),
        (lambda: ops.conv2d(X, torch.randn(16, 8, 11, 11)), ValueError, "larger than the padded input"),
        (lambda: ops.conv2d(X, W, torch.randn(15)), ValueError, "bias must have size"),
        (lambda: ops.conv2d(X, W, post_ops=["swish2"]), ValueError, "unknown post-op"),
        (lambda: ops.conv2d(X, W, post_ops=[("add",)]), ValueError, "exactly one tensor"),
        (lambda: ops.conv2d(X, W, post_ops=[("add", torch.randn(2, 16, 9, 9))]), ValueError, "output's size"),
        (lambda: ops.conv2d(X, W, post_ops=[("add", torch.randn(2, 16, 7, 7).bfloat16())]), TypeError, "dtype"),
        (lambda: ops.conv2d(X, W, post_ops=[("clamp", 1.0, 0.0)]), ValueError, "low <= high"),
        (lambda: ops.conv2d(X, W, post_ops=["relu"] * 9), ValueError, "at most 8"),
        (lambda: ops.conv2d(X, W, post_ops=[42]), ValueError, "post-op must be"),
        (lambda: ops.conv2d(X, W, out_layout="nhcw"), ValueError, "out_layout"),
        (lambda: ops.conv2d(X.numpy(), W), TypeError, "must be tensors"),
        (lambda: ops.conv2d(X, W, bias=[1.0]), TypeError, "bias must be a tensor"),
        (lambda: ops.conv1d(torch.randn(2, 8, 1), torch.randn(4, 8, 3)), ValueError, "larger than"),
        (lambda: ops.set_cache_capacity(0), ValueError, "positive"),
    ],
)
def test_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_requires_grad_is_refused_outside_no_grad():
    w = W.clone().requires_grad_()
    with torch.enable_grad():
        with pytest.raises(RuntimeError, match="inference-only"):
            ops.conv2d(X, w)
    # Under no_grad the same parameter is fine.
    torch.testing.assert_close(ops.conv2d(X, w), torch.nn.functional.conv2d(X, w))


def _args(**over):
    a = ffi.new("cl_conv_args *")
    a.nsp, a.dtype, a.n, a.ic, a.oc, a.groups = 2, lib.CL_F32, 1, 4, 4, 1
    for i in range(2):
        a.in_sp[i], a.k_sp[i], a.out_sp[i], a.stride[i], a.dilation[i] = 5, 3, 3, 1, 1
    for k, v in over.items():
        setattr(a, k, v)
    return a


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(groups=0), "groups"),
        (dict(groups=3), "divisible"),
        (dict(dtype=7), "dtype"),
        (dict(nsp=4), "spatial rank"),
        (dict(n=-1), "positive"),
        (dict(n_post_ops=9), "too many"),
        (dict(out_sp=[4, 3, 0]), "does not follow"),  # inconsistent with the input size
    ],
)
def test_c_abi_rejects_bad_problems_without_crashing(over, match):
    x = torch.randn(1, 4, 5, 5)
    w = torch.randn(4, 4, 3, 3)
    y = torch.empty(1, 4, 4, 4)
    rc = lib.cl_conv_forward(_args(**over), x.data_ptr(), w.data_ptr(), 999999, 0, 0, y.data_ptr(), ffi.NULL)
    assert rc != 0
    assert match in ffi.string(lib.cl_last_error()).decode()


def test_c_abi_null_pointers_and_missing_residual():
    x = torch.randn(1, 4, 5, 5)
    w = torch.randn(4, 4, 3, 3)
    y = torch.empty(1, 4, 3, 3)
    assert lib.cl_conv_forward(ffi.NULL, 0, 0, 1, 0, 0, 0, ffi.NULL) != 0
    assert lib.cl_conv_forward(_args(), 0, w.data_ptr(), 1, 0, 0, y.data_ptr(), ffi.NULL) != 0
    assert "null" in ffi.string(lib.cl_last_error()).decode()
    a = _args(n_post_ops=1)
    a.post_ops[0].kind = lib.CL_PO_ADD
    assert lib.cl_conv_forward(a, x.data_ptr(), w.data_ptr(), 1, 0, 0, y.data_ptr(), ffi.NULL) != 0
    assert "residual" in ffi.string(lib.cl_last_error()).decode()
    a.post_ops[0].kind = 99
    assert lib.cl_conv_forward(a, x.data_ptr(), w.data_ptr(), 1, 0, 0, y.data_ptr(), ffi.NULL) != 0
    assert "unknown post-op" in ffi.string(lib.cl_last_error()).decode()


@pytest.mark.parametrize("out_layout", [None, "nchw", "nhwc"])
def test_empty_batch_is_not_an_error(out_layout):
    """Eager returns an empty result for a batch of 0 (only other empty dims are errors)."""
    x = torch.randn(0, 8, 9, 9)
    y = ops.conv2d(x, W, B, padding=1, out_layout=out_layout)
    ref = torch.nn.functional.conv2d(x, W, B, padding=1)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    if out_layout is None:
        assert y.stride() == ref.stride()


@pytest.mark.parametrize("layout, fmt", [("nhwc", torch.channels_last), ("nchw", torch.contiguous_format)])
def test_out_is_written_in_place_and_checked(layout, fmt):
    x, w, b = torch.randn(2, 8, 9, 9), torch.randn(16, 8, 3, 3), torch.randn(16)
    with torch.no_grad():
        ref = ops.conv2d(x, w, b, padding=1, out_layout=layout, post_ops=["relu"])
        out = torch.full((2, 16, 9, 9), float("nan")).contiguous(memory_format=fmt)
        got = ops.conv2d(x, w, b, padding=1, out_layout=layout, post_ops=["relu"], out=out)
        assert got is out and torch.equal(got, ref)
        other = torch.contiguous_format if fmt is torch.channels_last else torch.channels_last
        bad = [torch.empty(2, 16, 9, 9).contiguous(memory_format=other),  # the other layout
               torch.empty(2, 16, 9, 8).contiguous(memory_format=fmt),   # another size
               torch.empty(2, 16, 9, 9, dtype=torch.bfloat16).contiguous(memory_format=fmt),
               torch.empty(2, 16, 9, 18).contiguous(memory_format=fmt)[..., ::2]]  # not dense
        for o in bad:
            with pytest.raises(ValueError, match="out must be"):
                ops.conv2d(x, w, b, padding=1, out_layout=layout, out=o)
        with pytest.raises(TypeError, match="out must be a CPU tensor"):
            ops.conv2d(x, w, b, padding=1, out_layout=layout, out=[1.0])
