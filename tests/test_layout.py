"""Layout rules (cpu_layout.layout) against eager torch's own behaviour."""
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from cpu_layout.layout import (
    CHANNELS_LAST, CONTIGUOUS, FixedLayout, FlexibleLayout, channels_last_strides, contiguous_strides,
    eager_memory_format, is_dense_in_order, is_in_order, matching_labels, order_of, orders_agree, require_order,
    stride_order, strides_for_order, view_strides,
)

SIZES_4D = [s for s in itertools.product((1, 2, 5), (1, 3, 8), (1, 4), (1, 6))]
CL = {4: torch.channels_last, 5: torch.channels_last_3d}


def fake_input(real, dynamic):
    """A FakeTensor with symbolic sizes for the dims flagged in `dynamic`."""
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC if d else DimDynamic.STATIC for d in dynamic])
    return env, mode.from_tensor(real, symbolic_context=ctx)


def test_order_names():
    assert order_of(CONTIGUOUS, 4) == (0, 1, 2, 3)
    assert order_of(CHANNELS_LAST, 4) == (0, 2, 3, 1)
    assert order_of(CHANNELS_LAST, 3) == (0, 2, 1)
    assert order_of(CHANNELS_LAST, 5) == (0, 2, 3, 4, 1)
    with pytest.raises(ValueError):
        order_of((0, 0, 1, 2), 4)


@pytest.mark.parametrize("size", SIZES_4D + [(2, 3, 1, 4, 5), (1, 1, 2, 1, 3), (2, 8, 4, 4, 4)])
def test_canonical_strides_match_torch(size):
    t = torch.empty(size)
    assert contiguous_strides(size) == t.stride()
    assert channels_last_strides(size) == torch.empty(size, memory_format=CL[len(size)]).stride()


def test_channels_last_3d_rank_is_nwc():
    t = torch.empty(2, 7, 5).transpose(1, 2)  # [N=2, C=5, W=7] stored as NWC
    assert t.shape == (2, 5, 7) and channels_last_strides(t.shape) == t.stride()


@pytest.mark.parametrize("size", SIZES_4D)
def test_is_in_order_matches_torch_on_dense_tensors(size):
    # every dense permutation of the tensor, checked against torch's is_contiguous
    # (which, like is_in_order, ignores size-1 dims)
    for perm in itertools.permutations(range(4)):
        base = torch.empty([size[p] for p in perm])
        inv = [perm.index(d) for d in range(4)]
        t = base.permute(inv)
        assert t.shape == size
        assert is_in_order(size, t.stride(), CONTIGUOUS) == t.is_contiguous(), (size, t.stride())
        assert is_in_order(size, t.stride(), CHANNELS_LAST) == t.is_contiguous(memory_format=torch.channels_last)
        assert is_in_order(size, t.stride(), perm)
        assert is_in_order(size, t.stride(), stride_order(size, t.stride()))


def test_slices_keep_their_order():
    t = torch.empty(2, 8, 10, 10)[:, :, ::2, 1:]
    assert is_in_order(t.shape, t.stride(), CONTIGUOUS)
    assert not is_in_order(t.shape, t.stride(), CHANNELS_LAST)


@pytest.mark.parametrize("size", SIZES_4D)
def test_is_dense_in_order_matches_torch(size):
    """Dense tensors in their order (size-1 dims ignored) are dense; slices that are
    in order are not, unless the slice is whole or every other dim has size 1."""
    for fmt, label in ((torch.contiguous_format, CONTIGUOUS), (torch.channels_last, CHANNELS_LAST)):
        t = torch.empty(size).contiguous(memory_format=fmt)
        assert is_dense_in_order(size, t.stride(), label)
        wide = torch.empty(size[0], size[1] + 3, *size[2:]).contiguous(memory_format=fmt)[:, 1:size[1] + 1]
        assert is_in_order(wide.shape, wide.stride(), label)
        dense = wide.is_contiguous(memory_format=fmt)  # torch's own answer (it ignores size-1 dims too)
        assert is_dense_in_order(wide.shape, wide.stride(), label) == dense


def test_is_dense_in_order_symbolic_batch_no_guards():
    env, x = fake_input(torch.randn(5, 8, 6, 6), [True, False, False, False])
    n = len(env.guards)
    size, stride = tuple(x.shape), tuple(x.stride())
    assert is_dense_in_order(size, stride, CONTIGUOUS)
    piece = x[:, :4]
    assert not is_dense_in_order(tuple(piece.shape), tuple(piece.stride()), CONTIGUOUS)
    assert is_in_order(tuple(piece.shape), tuple(piece.stride()), CONTIGUOUS)
    assert len(env.guards) == n


def test_seed_bug_layout_is_both_and_never_restrided():
    size, stride = (5, 1, 28, 28), (784, 784, 28, 1)
    assert matching_labels(size, stride) == (CONTIGUOUS, CHANNELS_LAST)
    fixed = FixedLayout(size, stride)
    new, copy = require_order(fixed, CHANNELS_LAST)
    assert new is fixed and not copy
    # flexible (a bf16 cast we produce): frozen to its current strides, not [784, 1, 28, 1]
    new, copy = require_order(FlexibleLayout(size, torch.bfloat16), CHANNELS_LAST)
    assert new.stride == (784, 784, 28, 1) and not copy and new.dtype == torch.bfloat16
    assert orders_agree(size, CONTIGUOUS, CHANNELS_LAST)


def test_require_order_real_mismatch():
    size = (2, 64, 28, 28)
    fixed = FixedLayout(size, contiguous_strides(size))
    new, copy = require_order(fixed, CHANNELS_LAST)
    assert copy and new.stride == channels_last_strides(size)
    new, copy = require_order(FlexibleLayout(size), CHANNELS_LAST)
    assert not copy and new.stride == channels_last_strides(size)
    new, copy = require_order(FlexibleLayout(size), CONTIGUOUS)
    assert not copy and new.stride == contiguous_strides(size)
    assert not orders_agree(size, CONTIGUOUS, CHANNELS_LAST)


@pytest.mark.parametrize("size", [(1, 64, 28, 28), (4, 1, 28, 28), (4, 64, 1, 1), (4, 64, 1, 28),
                                  (4, 64, 28, 1), (1, 1, 1, 1)])
def test_size_one_in_every_position(size):
    for fmt in (torch.contiguous_format, torch.channels_last):
        t = torch.empty(size).contiguous(memory_format=fmt)
        both = orders_agree(size, CONTIGUOUS, CHANNELS_LAST)
        assert is_in_order(size, t.stride(), CONTIGUOUS) == (fmt == torch.contiguous_format or both)
        assert is_in_order(size, t.stride(), CHANNELS_LAST) == (fmt == torch.channels_last or both)
    # orders coincide exactly when C == 1 or H == W == 1
    assert orders_agree(size, CONTIGUOUS, CHANNELS_LAST) == (size[1] == 1 or size[2:] == (1, 1))


@pytest.mark.parametrize("size", SIZES_4D + [(3, 8, 1, 1), (1, 8, 1, 1)])
@pytest.mark.parametrize("fmt", ["contiguous", "channels_last", "permuted"])
def test_eager_memory_format_predicts_conv_output(size, fmt):
    x = torch.randn(size)
    if fmt == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif fmt == "permuted":
        x = x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        x = torch.as_strided(x, size, [s if size[i] != 1 else 1 for i, s in enumerate(x.stride())])
    w = torch.randn(4, size[1], 1, 1)
    y = F.conv2d(x, w)
    predicted = eager_memory_format(x.shape, x.stride())
    want = channels_last_strides(y.shape) if predicted == CHANNELS_LAST else contiguous_strides(y.shape)
    assert y.stride() == want, (x.stride(), predicted)


@pytest.mark.parametrize("size,new", [
    ((2, 8, 4, 4), (2, 128)), ((2, 8, 1, 1), (2, 8)), ((2, 8, 4, 4), (2, 8, 16)), ((2, 1, 4, 4), (2, 16)),
    ((2, 8, 4, 4), (16, 4, 4)), ((1, 8, 4, 4), (8, 16)), ((2, 8, 4, 1), (2, 8, 4)), ((2, 8, 4, 4), (2, 8, 4, 4, 1)),
])
def test_view_strides_match_torch_view(size, new):
    for fmt in (torch.contiguous_format, torch.channels_last):
        t = torch.empty(size).contiguous(memory_format=fmt)
        got = view_strides(size, t.stride(), new)
        try:
            want = t.view(new).stride()
        except RuntimeError:
            want = None
        assert got == want, (size, fmt, new)


def test_symbolic_maml_shape_no_guards():
    env, x = fake_input(torch.randn(5, 1, 28, 28), [True, False, False, False])
    n = len(env.guards)
    size, stride = tuple(x.shape), tuple(x.stride())
    assert isinstance(size[0], torch.SymInt)
    assert matching_labels(size, stride) == (CONTIGUOUS, CHANNELS_LAST)
    new, copy = require_order(FlexibleLayout(size, torch.bfloat16), CHANNELS_LAST)
    assert not copy and new.stride == (784, 784, 28, 1)
    assert eager_memory_format(size, stride) == CONTIGUOUS
    assert stride_order(size, stride) == (0, 1, 2, 3)
    assert len(env.guards) == n


def test_symbolic_spatial_dims_no_guards():
    env, x = fake_input(torch.randn(5, 3, 28, 30), [True, False, True, True])
    n = len(env.guards)
    size = tuple(x.shape)
    cl = channels_last_strides(size)
    assert is_in_order(size, x.stride(), CONTIGUOUS) and not is_in_order(size, x.stride(), CHANNELS_LAST)
    assert is_in_order(size, cl, CHANNELS_LAST) and not is_in_order(size, cl, CONTIGUOUS)
    assert stride_order(size, cl) == (0, 2, 3, 1)
    new, copy = require_order(FixedLayout(size, x.stride()), CHANNELS_LAST)
    assert copy and new == FixedLayout(size, cl)
    assert view_strides(size, x.stride(), (size[0], size[1] * size[2] * size[3])) is not None
    assert view_strides(size, cl, (size[0], size[1] * size[2] * size[3])) is None
    assert eager_memory_format(size, cl) == CHANNELS_LAST
    assert len(env.guards) == n
    # symbolic channel-1 input [s0, 1, s1, s2]: both orders, still no guards
    env, x = fake_input(torch.randn(5, 1, 28, 30), [True, False, True, True])
    n = len(env.guards)
    assert matching_labels(tuple(x.shape), tuple(x.stride())) == (CONTIGUOUS, CHANNELS_LAST)
    assert len(env.guards) == n


def test_sympy_sizes():
    import sympy
    n, h = sympy.symbols("n h", positive=True, integer=True)
    size = (n, 8, h, h)
    assert is_in_order(size, contiguous_strides(size), CONTIGUOUS)
    assert not is_in_order(size, contiguous_strides(size), CHANNELS_LAST)
    assert is_in_order(size, strides_for_order(size, CHANNELS_LAST), CHANNELS_LAST)
    assert matching_labels((n, 1, h, h), contiguous_strides((n, 1, h, h))) == (CONTIGUOUS, CHANNELS_LAST)


# ---- layout conversions on oneDNN's reorder (ops.copy_strided, ops.to_dense) ----------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [(1, 3, 224, 224), (2, 58, 28, 28), (3, 5, 1, 7), (2, 4, 3, 5, 6), (0, 3, 4, 4)])
def test_to_dense_converts_between_orders_exactly(size, dtype):
    from cpu_layout import ops

    x = torch.randn(size).to(dtype)
    y = ops.to_dense(x, True)
    assert torch.equal(y, x) and ops.is_channels_last_dense(y)
    z = ops.to_dense(y, False)
    assert torch.equal(z, x) and z.is_contiguous()
    assert ops.to_dense(z, False) is z and ops.to_dense(y, True) is y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_strided_matches_atens_copy_for_permutations_and_slices(dtype):
    from cpu_layout import ops

    base = torch.randn(2, 8, 6, 5).to(dtype)
    for src in (base.permute(0, 2, 3, 1), base[:, 2:7], base.transpose(2, 3), base[:, :, 1:4, 2:]):
        out = torch.empty_strided(src.shape, torch.empty(src.shape).stride(), dtype=dtype)
        assert torch.equal(ops.copy_strided(out, src), src.contiguous())


def test_copy_strided_rejects_what_it_cannot_copy():
    from cpu_layout import ops

    x = torch.randn(2, 3, 4, 4)
    with pytest.raises(ValueError):
        ops.copy_strided(torch.empty(2, 3, 4, 5), x)
    with pytest.raises(ValueError):
        ops.copy_strided(torch.empty(2, 3, 4, 4, dtype=torch.float16), x.half())
    with pytest.raises(ValueError):
        ops.copy_strided(torch.empty(2, 3, 4, 4, dtype=torch.float64), x)
    # Interleaved strides (a step-2 slice: each row spans more than the next dim's stride)
    # are outside what oneDNN's memory descriptors express: an error, not a crash.
    with pytest.raises(RuntimeError, match="strides"):
        ops.copy_strided(torch.empty(2, 3, 4, 3), torch.randn(2, 3, 4, 5)[..., ::2])
