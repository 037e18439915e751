"""scripts/bench_ab.py: each variant compiles under its own settings, is checked
against eager, and is timed; malformed variants are refused with the reason."""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("bench_ab", os.path.join(ROOT, "scripts", "bench_ab.py"))
ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab)


def test_each_variant_compiles_under_its_own_settings(capsys, monkeypatch, compiled_graphs):
    monkeypatch.delenv("CPU_LAYOUT_CONV_IMPL", raising=False)
    ab.main(["--suite", "builtin", "--model", "mobilenet_v2", "--rounds", "2",
             "ours:CPU_LAYOUT_CONV_IMPL=onednn", "torchs:CPU_LAYOUT_CONV_IMPL=aten"])
    out = capsys.readouterr().out
    assert "ours" in out and "torchs" in out and "x1.000 vs ours" in out
    impls = [{c.impl for c in g.cpu_layout_graph.convs()} for g in compiled_graphs]
    assert len(impls) == 2 and impls[0] == {"onednn"} and "aten" in impls[1], impls
    assert "CPU_LAYOUT_CONV_IMPL" not in os.environ, "a variant's settings outlive its compile"


@pytest.mark.parametrize("spec", ["nolabel", ":X=1", "a:X", "a:=1"])
def test_a_malformed_variant_is_refused(spec):
    with pytest.raises(SystemExit, match="bench_ab"):
        ab.parse_variant(spec)


def test_variant_labels_must_differ():
    with pytest.raises(SystemExit, match="differ"):
        ab.main(["--suite", "builtin", "--model", "mobilenet_v2", "a:", "a:X=1"])
