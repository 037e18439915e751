"""Primitive and weight caches: reuse, invalidation, bounds, threads."""
import ctypes
import gc
import os
import threading

import pytest
import torch
import torch.nn.functional as F

from cpu_layout import _native, ops

pytestmark = pytest.mark.usefixtures("no_grad")


def delta(before):
    after = ops.cache_stats()
    return {k: after[k] - before[k] for k in after}


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * (b.abs().max().item() or 1))


def test_same_problem_reuses_primitive_and_weights():
    x = torch.randn(2, 8, 10, 10)
    w = torch.randn(16, 8, 3, 3)
    s0 = ops.cache_stats()
    ops.conv2d(x, w, padding=1)
    d = delta(s0)
    assert d["primitives_created"] == 1 and d["weight_reorders"] == 1
    s1 = ops.cache_stats()
    for _ in range(3):
        ops.conv2d(x, w, padding=1)
    d = delta(s1)
    assert d["primitives_created"] == 0 and d["weight_reorders"] == 0
    assert d["primitive_cache_hits"] == 3


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
def test_new_batch_size_builds_a_primitive_not_a_weight_copy(fmt):
    w = torch.randn(32, 16, 3, 3)
    ops.conv2d(torch.randn(1, 16, 14, 14).contiguous(memory_format=fmt), w, padding=1)
    s0 = ops.cache_stats()
    for n in (2, 3, 7):
        x = torch.randn(n, 16, 14, 14).contiguous(memory_format=fmt)
        close(ops.conv2d(x, w, padding=1), F.conv2d(x, w, padding=1))
    d = delta(s0)
    assert d["primitives_created"] == 3
    assert d["weight_reorders"] == 0


def test_in_place_weight_change_is_noticed():
    x = torch.randn(2, 8, 10, 10)
    w = torch.randn(16, 8, 3, 3)
    close(ops.conv2d(x, w), F.conv2d(x, w))
    w.mul_(-2.0)  # bumps the version counter
    s0 = ops.cache_stats()
    close(ops.conv2d(x, w), F.conv2d(x, w))
    assert delta(s0)["weight_reorders"] == 1


def test_load_state_dict_and_replaced_data_are_noticed():
    conv = torch.nn.Conv2d(8, 16, 3, padding=1).eval()
    x = torch.randn(2, 8, 10, 10)
    close(ops.conv2d(x, conv.weight, conv.bias, padding=1), conv(x))
    other = torch.nn.Conv2d(8, 16, 3, padding=1)
    conv.load_state_dict(other.state_dict())
    close(ops.conv2d(x, conv.weight, conv.bias, padding=1), other(x))
    conv.weight.data = torch.randn(16, 8, 3, 3)  # new storage, same Parameter object
    close(ops.conv2d(x, conv.weight, conv.bias, padding=1), conv(x))


def test_dead_weight_is_released():
    gc.collect()  # drop weights of earlier tests that only cycles kept alive
    x = torch.randn(1, 8, 6, 6)
    w = torch.randn(8, 8, 3, 3)
    ops.conv2d(x, w)
    size = ops.cache_stats()["weight_cache_size"]
    del w
    gc.collect()
    assert ops.cache_stats()["weight_cache_size"] == size - 1


def test_new_tensor_at_a_dead_tensors_address_is_not_served_its_copy():
    # Two tensor objects over the same memory, each at version 0: what the
    # allocator produces when a freed weight's address is reused.
    x = torch.randn(1, 4, 6, 6)
    raw = bytearray(4 * 4 * 3 * 3 * 4)
    w1 = torch.frombuffer(raw, dtype=torch.float32).view(4, 4, 3, 3)
    w1.fill_(1.0)
    close(ops.conv2d(x, w1), F.conv2d(x, w1))
    ptr = w1.data_ptr()
    del w1
    gc.collect()
    w2 = torch.frombuffer(raw, dtype=torch.float32).view(4, 4, 3, 3)
    w2.mul_(3.0)
    # Same address, same version count as the dead tensor had: only the
    # tensor's identity tells them apart.
    assert w2.data_ptr() == ptr and w2._version == 1
    close(ops.conv2d(x, w2), F.conv2d(x, w2))


def test_primitive_cache_is_lru_bounded():
    old = ops.cache_capacity()
    try:
        ops.clear_caches()
        ops.set_cache_capacity(2)
        w = torch.randn(4, 4, 3, 3)
        for hw in (6, 7, 8, 9):
            ops.conv2d(torch.randn(1, 4, hw, hw), w)
        assert ops.cache_stats()["primitive_cache_size"] == 2
        s0 = ops.cache_stats()
        ops.conv2d(torch.randn(1, 4, 9, 9), w)  # most recent: still cached
        assert delta(s0)["primitives_created"] == 0
        ops.conv2d(torch.randn(1, 4, 6, 6), w)  # evicted: rebuilt
        assert delta(s0)["primitives_created"] == 1
    finally:
        ops.set_cache_capacity(old)


def test_concurrent_calls_from_four_threads():
    torch.manual_seed(0)
    problems = []
    for t in range(4):
        c = 8 * (t + 1)
        x = torch.randn(2, c, 12, 12)
        if t % 2:
            x = x.contiguous(memory_format=torch.channels_last)
        w = torch.randn(16, c, 3, 3) / c**0.5
        b = torch.randn(16)
        problems.append((x, w, b, F.relu(F.conv2d(x, w, b, padding=1))))
    shared_w = problems[0][1]
    errors = []
    barrier = threading.Barrier(4)

    def work(t):
        try:
            with torch.no_grad():
                barrier.wait()
                x, w, b, ref = problems[t]
                for i in range(25):
                    y = ops.conv2d(x, w, b, padding=1, post_ops=["relu"])
                    close(y, ref)
                    # Everyone also hits one shared weight.
                    x0 = problems[0][0][: 1 + (i + t) % 2]
                    close(ops.conv2d(x0, shared_w, padding=1), F.conv2d(x0, shared_w, padding=1))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors


def test_linked_onednn_is_ours_and_torch_exports_none():
    assert _native.DNNL_VERSION[:2] == (3, 2)
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    handle = ctypes.CDLL(torch_lib)
    for sym in ("dnnl_version", "dnnl_primitive_execute", "dnnl_memory_create"):
        with pytest.raises(AttributeError):
            getattr(handle, sym)  # torch hides its oneDNN; if this changes, two copies may clash
