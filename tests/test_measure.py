"""Conv costs measured on the machine (plan/measure.py): measured once, cached
on disk, bounded, switchable off, and what the planner uses in a compile."""
import json
import os

import pytest
import torch
import torch.nn as nn

from cpu_layout.plan import graph as pg
from cpu_layout.plan import measure


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CPU_LAYOUT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CPU_LAYOUT_AUTOTUNE", raising=False)
    monkeypatch.delenv("CPU_LAYOUT_AUTOTUNE_BUDGET", raising=False)
    return tmp_path


def conv_graph(size=(1, 32, 16, 16), groups=1):
    g = pg.Graph()
    x = g.input("x", size)
    g.conv(x, 32, 3, padding=1, groups=groups, name="c")
    return g


def test_measures_once_then_reads_the_disk_cache(cache, monkeypatch):
    model = measure.MeasuredCostModel(None)
    c = model.conv_cost(conv_graph()["c"])
    assert c.source.startswith("measured: ours NCHW") and c.nchw_us > 0 and c.nhwc_us > 0
    model.save()
    files = list((cache / "autotune").iterdir())
    assert len(files) == 1 and f"{torch.get_num_threads()}t" in files[0].name
    assert len(json.loads(files[0].read_text())) == 1

    def boom(conv):
        raise AssertionError("measured again")

    monkeypatch.setattr(measure, "_measure", boom)
    again = measure.MeasuredCostModel(None).conv_cost(conv_graph()["c"])
    assert (again.nchw_us, again.nhwc_us) == (c.nchw_us, c.nhwc_us)
    assert not [p for p in (cache / "autotune").iterdir() if p.name.startswith(".")], "no temp files left"


def test_off_budget_and_unmeasurable_shapes_use_the_table(cache, monkeypatch):
    monkeypatch.setenv("CPU_LAYOUT_AUTOTUNE", "0")
    assert measure.MeasuredCostModel(None).conv_cost(conv_graph()["c"]).source.startswith("heuristic")
    monkeypatch.setenv("CPU_LAYOUT_AUTOTUNE", "1")
    monkeypatch.setenv("CPU_LAYOUT_AUTOTUNE_BUDGET", "0")
    assert measure.MeasuredCostModel(None).conv_cost(conv_graph()["c"]).source.startswith("heuristic")
    monkeypatch.setenv("CPU_LAYOUT_AUTOTUNE_BUDGET", "2")
    g = pg.Graph()
    x = g.input("x", (1, 8, 32))  # conv1d: measured only in 2-D
    g.conv(x, 8, 3, name="c1")
    assert measure.MeasuredCostModel(None).conv_cost(g["c1"]).source.startswith("heuristic")


def test_a_compile_plans_with_measured_costs(cache, monkeypatch):
    from cpu_layout import backend

    monkeypatch.setattr(measure, "_DEFAULT", None)  # a fresh model: this test's cache dir
    made = []
    real = backend.compile_graph
    monkeypatch.setattr(backend, "compile_graph",
                        lambda gm, inputs, options, *rest: made.append(real(gm, inputs, options, *rest)) or made[-1])
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1)).eval()
    x = torch.randn(1, 3, 24, 24)
    torch._dynamo.reset()
    with torch.no_grad():
        y = torch.compile(model, backend="cpu_layout")(x)
        torch.testing.assert_close(y, model(x), rtol=1e-4, atol=1e-4)
    plan = made[0].cpu_layout_graph.plan
    assert all(d.cost.source.startswith("measured: ") for d in plan.convs.values()), plan.explain()
    assert os.listdir(cache / "autotune")
    torch._dynamo.reset()


def test_post_ops_are_measured_with_the_conv_and_keyed_apart(cache, monkeypatch):
    from cpu_layout import ops

    g = pg.Graph()
    x = g.input("x", (1, 16, 12, 12))
    g.conv(x, 16, 3, padding=1, name="plain")
    g.add(pg.Conv("fused", (x,), (1, 16, 12, 12), torch.float32, in_size=(1, 16, 12, 12), out_channels=16,
                  kernel=(3, 3), stride=(1, 1), padding=(1, 1), dilation=(1, 1), post_ops=("add", "relu")))
    seen = []
    real = ops.conv2d

    def spy(x, w, b=None, **kw):
        seen.append((kw["out_layout"], x.is_contiguous(), [
            (p[0], p[1].is_contiguous(memory_format=torch.channels_last)) if isinstance(p, tuple) else p
            for p in kw.get("post_ops", ())]))
        return real(x, w, b, **kw)

    monkeypatch.setattr(ops, "conv2d", spy)
    model = measure.MeasuredCostModel(None)
    model.conv_cost(g["plain"])
    assert all(post == [] for _, _, post in seen)
    seen.clear()
    model.conv_cost(g["fused"])
    assert seen and {lay: post for lay, _, post in seen} == {
        "nchw": [("add", False), "relu"], "nhwc": [("add", True), "relu"]}, seen
    model.save()
    keys = json.loads(next((cache / "autotune").iterdir()).read_text())
    assert len(keys) == 2 and any("po['add', 'relu']" in k for k in keys), keys


def test_symbolic_sizes_are_measured_at_their_hints_without_guards(cache, monkeypatch):
    from cpu_layout import backend

    monkeypatch.setattr(measure, "_DEFAULT", None)
    made, timed = [], []
    real, real_measure = backend.compile_graph, measure._measure
    monkeypatch.setattr(backend, "compile_graph",
                        lambda gm, inputs, options, *rest: made.append(real(gm, inputs, options, *rest)) or made[-1])
    monkeypatch.setattr(measure, "_measure", lambda conv: timed.append(tuple(conv.in_size)) or real_measure(conv))
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1)).eval()
    torch._dynamo.reset()
    with torch.no_grad():
        fn = torch.compile(model, backend="cpu_layout", dynamic=True)
        for x in (torch.randn(2, 3, 24, 20), torch.randn(3, 3, 17, 31)):
            y = fn(x)
            torch.testing.assert_close(y, model(x), rtol=1e-4, atol=1e-4)
            assert y.stride() == model(x).stride()
    assert len(made) == 1, "measuring at the hints must not specialise the graph"
    assert timed == [(2, 3, 24, 20), (2, 16, 24, 20)], timed
    plan = made[0].cpu_layout_graph.plan
    assert all(d.cost.source.startswith("measured: ") for d in plan.convs.values()), plan.explain()
    torch._dynamo.reset()


def test_copies_are_priced_at_the_thread_count_they_run_on(cache, monkeypatch):
    """The shipped table's copy rate is one thread's: the planner measures its own for
    the thread count it plans for, once per count (cached on disk per count)."""
    calls = []

    def rate(dtype):
        calls.append(torch.get_num_threads())
        return 0.001 / torch.get_num_threads()

    monkeypatch.setattr(measure, "copy_us_per_byte", rate)
    table = {"entries": [], "copy_us_per_byte": {"float32": 1.0}}
    model = measure.MeasuredCostModel(table)
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert model.copy_cost(1000) == pytest.approx(1.0)
        torch.set_num_threads(2)
        assert model.copy_cost(1000) == pytest.approx(0.5)
        torch.set_num_threads(1)
        assert model.copy_cost(2000) == pytest.approx(2.0)
        assert calls == [1, 2], "measured once per thread count"
        model.save()
        files = sorted(p.name for p in (cache / "autotune").iterdir())
        assert files == ["conv10-%s-1t.json" % measure.cpu_isa(), "conv10-%s-2t.json" % measure.cpu_isa()]
        for name in files:
            assert list(json.loads((cache / "autotune" / name).read_text())) == ["copy float32"]
        monkeypatch.setenv("CPU_LAYOUT_AUTOTUNE", "0")
        assert model.copy_cost(1000) == pytest.approx(1000.0), "measuring off: the table's rate"
        torch.set_num_threads(2)
        assert model.copy_cost(1000) == pytest.approx(500.0), "over every thread, as its convs"
    finally:
        torch.set_num_threads(prev)


def test_table_priced_convs_run_on_every_thread():
    """A conv priced from the one-thread table takes 1/T of it on T threads; the
    memo keeps thread counts apart."""
    from cpu_layout.plan.cost import CostModel

    entry = dict(dtype="float32", cin=32, cout=32, kernel=3, stride=1, groups=1, spatial=16, batch=1,
                 nchw_us=100.0, nhwc_us=80.0)
    model = CostModel({"entries": [entry], "threads": 1})
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = model.conv_cost(conv_graph()["c"])
        torch.set_num_threads(2)
        two = model.conv_cost(conv_graph()["c"])
    finally:
        torch.set_num_threads(prev)
    assert one.source.startswith("table") and (one.nchw_us, one.nhwc_us) == pytest.approx((100.0, 80.0))
    assert (two.nchw_us, two.nhwc_us) == pytest.approx((50.0, 40.0))
