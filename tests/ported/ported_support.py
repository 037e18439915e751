"""Helpers the ported PyTorch tests share: compile with this backend, and compare
with eager (values, sizes, dtypes and strides; fp32 to 1e-4 and bf16/AMP to 3e-2
of the largest magnitude)."""
import contextlib

import torch


def compile_(fn, **kwargs):
    return torch.compile(fn, backend="cpu_layout", options={"debug": True}, **kwargs)


def autocast(amp):
    return torch.autocast("cpu", dtype=torch.bfloat16) if amp else contextlib.nullcontext()


def clone(args):
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def assert_same(y, ref, amp=False):
    """Values, sizes, dtype and strides of `y` are eager's (`ref`), recursively."""
    if isinstance(ref, (tuple, list)):
        assert isinstance(y, (tuple, list)) and len(y) == len(ref), (type(y), type(ref))
        for a, b in zip(y, ref):
            assert_same(a, b, amp)
        return
    if not isinstance(ref, torch.Tensor):
        assert y == ref
        return
    assert type(y) is type(ref), f"{type(y)} is not eager's {type(ref)}"
    assert y.shape == ref.shape
    assert y.dtype == ref.dtype
    assert y.stride() == ref.stride(), f"strides {y.stride()} != eager's {ref.stride()}"
    if not ref.dtype.is_floating_point:
        assert torch.equal(y, ref)
        return
    scale = ref.float().abs().max().item() if ref.numel() else 1.0
    scale = scale or 1.0
    if amp or ref.dtype in (torch.bfloat16, torch.float16):
        torch.testing.assert_close(y.float(), ref.float(), rtol=3e-2, atol=3e-2 * scale)
    else:
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * scale)
