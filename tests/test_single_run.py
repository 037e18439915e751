"""scripts/single_run.sh (issue 6): arguments, bad arguments, skips, and maml_omniglot
(batch 2) end to end in both scenarios and both wrappers. Kept fast: few iterations,
and argument errors are caught by the launcher before torch is imported."""
import csv
import importlib.util
import io
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SH = os.path.join(ROOT, "scripts", "single_run.sh")
PY = os.path.join(ROOT, "scripts", "single_run.py")

ACC_HEADER = "dev,name,batch_size,accuracy,calls_captured,unique_graphs,graph_breaks"
PERF_HEADER = ("dev,name,batch_size,speedup,abs_latency,compilation_latency,compression_ratio,"
               "eager_peak_mem,dynamo_peak_mem")
FAST = ["--iters", "4", "--warmup", "1"]


def _load():
    spec = importlib.util.spec_from_file_location("single_run", PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


sr = _load()


def run(*args, timeout=240):
    return subprocess.run(["bash", SH, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def maml(scenario, wrapper="default", backend="cpu_layout", *extra):
    # THREAD MODE SCENARIO SUITE MODEL DT CHANNELS SHAPE WRAPPER BS BACKEND
    return run("multiple", "inference", scenario, "builtin", "maml_omniglot", "float32", "first",
               "static", wrapper, 2, backend, *FAST, *extra)


def rows(stdout):
    return list(csv.reader(io.StringIO(stdout)))


# ------------------------------------------------------------------ parsing
def test_defaults_match_inductor_single_run():
    a = sr.parse_args([])
    assert (a.thread, a.mode, a.scenario, a.suite, a.model, a.dt, a.channels, a.shape,
            a.wrapper, a.bs, a.backend) == ("multiple", "inference", "accuracy", "builtin", "all",
                                            "float32", "first", "static", "default", 0,
                                            "cpu_layout")
    assert a.output is None and a.plot is None


def test_eleven_positionals_in_order_and_options_anywhere():
    a = sr.parse_args(["--output", "o.csv", "single", "inference", "performance", "builtin",
                       "resnet18", "amp", "last", "dynamic", "--iters", "7", "cpp", "3",
                       "inductor_freezing", "--plot"])
    assert (a.thread, a.scenario, a.model, a.dt, a.channels, a.shape, a.wrapper, a.bs,
            a.backend) == ("single", "performance", "resnet18", "amp", "last", "dynamic", "cpp",
                           3, "inductor_freezing")
    assert a.output == "o.csv" and a.iters == 7 and a.plot == sr.DEFAULT_PLOT


def test_thread_plan():
    cores = sr.socket0_cores()
    assert cores and all(isinstance(c, int) for c in cores)
    assert sr.worker_plan("single") == [("single", cores[:1])]
    assert sr.worker_plan("multiple") == [("multiple", cores)]
    assert [m for m, _ in sr.worker_plan("all")] == ["multiple", "single"]
    pre = sr.pin_prefix([0])
    assert pre == [] or pre[0] in ("numactl", "taskset")
    assert sr.pin_prefix([0], no_pin=True) == []


BAD = [
    (["bogus"], "THREAD"),
    (["multiple", "predict"], "MODE"),
    (["multiple", "inference", "speed"], "SCENARIO"),
    (["multiple", "inference", "accuracy", "torchbench"], "SUITE"),
    (["multiple", "inference", "accuracy", "huggingface", "gpt5"], "MODEL"),
    (["multiple", "inference", "accuracy", "builtin", "alexnet"], "MODEL"),
    (["multiple", "inference", "accuracy", "builtin", "all", "float16"], "DT"),
    (["multiple", "inference", "accuracy", "builtin", "all", "float32", "middle"], "CHANNELS"),
    (["multiple", "inference", "accuracy", "builtin", "all", "float32", "first", "ragged"], "SHAPE"),
    (["multiple", "inference", "accuracy", "builtin", "all", "float32", "first", "static", "aot"],
     "WRAPPER"),
    (["multiple", "inference", "accuracy", "builtin", "all", "float32", "first", "static",
      "default", "-3"], "BS"),
    (["multiple", "inference", "accuracy", "builtin", "all", "float32", "first", "static",
      "default", "two"], "BS"),
    (["multiple", "inference", "accuracy", "builtin", "all", "float32", "first", "static",
      "default", "0", "tvm"], "BACKEND"),
    (["multiple", "inference", "accuracy", "builtin", "all", "float32", "first", "static",
      "default", "0", "eager", "extra"], "unrecognized arguments"),
    (["--iters", "0"], "--iters"),
    (["--bogus-flag"], "unrecognized arguments"),
]


@pytest.mark.parametrize("args,what", BAD, ids=[w + str(i) for i, (_, w) in enumerate(BAD)])
def test_bad_argument_prints_usage_and_exits_2(args, what):
    r = run(*args)
    assert r.returncode == 2, r.stderr
    assert "usage: single_run.sh" in r.stderr
    assert what in r.stderr
    assert r.stdout == ""
    assert "Traceback" not in r.stderr


def test_training_is_not_supported_yet():
    r = run("multiple", "training", "accuracy", "builtin", "maml_omniglot")
    assert r.returncode == 2
    assert "not supported yet" in r.stderr
    assert r.stdout == "" and "Traceback" not in r.stderr


@pytest.mark.parametrize("suite,pkg", [("torchvision", "torchvision"), ("timm_models", "timm"),
                                       ("huggingface", "transformers")])
def test_missing_suite_package_is_a_clear_skip(suite, pkg):
    if importlib.util.find_spec(pkg) is not None:
        pytest.skip(f"{pkg} is installed")
    r = run("multiple", "inference", "accuracy", suite, "all")
    assert r.returncode == 0
    assert "skip" in r.stderr and pkg in r.stderr and "not installed" in r.stderr
    assert r.stdout == ""


# ------------------------------------------------------------------ end to end
def test_accuracy_end_to_end():
    r = maml("accuracy")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0] == ACC_HEADER
    last = lines[-1].split(",")  # the reports' tooling reads the last line; field 4 = status
    assert last[:4] == ["cpu", "maml_omniglot", "2", "pass"]
    calls, graphs, breaks = map(int, last[4:])
    assert calls > 0 and graphs == 1 and breaks == 0
    assert "Traceback" not in r.stderr


def test_append_csv_writes_header_once(tmp_path):
    out = tmp_path / "a.csv"
    sr.append_csv(str(out), sr.PERFORMANCE_HEADER, [["cpu", "m", 1, 1.5, 2.0, 3.0, 1.0, 0.1, 0.1]])
    sr.append_csv(str(out), sr.PERFORMANCE_HEADER, [["cpu", "n", 1, 1.5, 2.0, 3.0, 1.0, 0.1, 0.1]])
    table = rows(out.read_text())
    assert table[0] == sr.PERFORMANCE_HEADER and [r[1] for r in table[1:]] == ["m", "n"]
    assert table[1][3] == "1.500000"


def test_performance_end_to_end_output_appends_and_plot(tmp_path):
    out, png = tmp_path / "perf.csv", tmp_path / "speedup.png"
    previous = "cpu,resnet18,4,1.000000,1.000000,1.000000,1.000000,0.000100,0.000100"
    out.write_text(PERF_HEADER + "\n" + previous + "\n")  # as a previous run left it
    r = maml("performance", "default", "cpu_layout", "--output", out, "--plot", png)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0] == PERF_HEADER
    last = lines[-1].split(",")
    assert last[:3] == ["cpu", "maml_omniglot", "2"]
    speedup, latency, comp, ratio, emem, dmem = map(float, last[3:])
    assert speedup > 0 and latency > 0 and comp >= 0 and ratio > 0 and emem > 0 and dmem > 0
    assert "[####################] 1/1" in r.stderr  # progress bar over models
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib is not installed" in r.stderr and not png.exists()
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --output appended the row under the existing header
    text = out.read_text().splitlines()
    assert text == [PERF_HEADER, previous, lines[-1]]


@pytest.fixture(scope="module")
def cpp_supported():
    """Whichever the backend supports: KNOWN_OPTIONS has "cpp_wrapper", a compile with it does
    not raise NotImplementedError, and (benchmark.cpp_wrapper_supported) it does not just
    generate the default Python wrapper."""
    from cpu_layout import backend
    from cpu_layout import benchmark

    ok, _ = benchmark.cpp_wrapper_supported()
    return ok and "cpp_wrapper" in backend.KNOWN_OPTIONS


@pytest.mark.parametrize("scenario", ["accuracy", "performance"])
def test_cpp_wrapper_end_to_end(scenario, cpp_supported):
    r = maml(scenario, "cpp")
    if cpp_supported:
        assert r.returncode == 0, r.stderr[-2000:]
        last = r.stdout.strip().splitlines()[-1].split(",")
        assert last[1] == "maml_omniglot"
        if scenario == "accuracy":
            assert last[3] == "pass"
        else:
            assert float(last[3]) > 0 and float(last[4]) > 0
            ratio, emem, dmem = map(float, last[6:9])
            # The compiled figure counts what the model holds between calls: its three
            # convs' packed weights at least (the call itself allocates only its output).
            packed = 4 * (64 * 1 * 9 + 64 * 64 * 9 * 2)
            assert dmem * 1e9 >= 0.9 * packed
            assert ratio == pytest.approx(emem / dmem, rel=0.01)
    else:
        assert r.returncode == 2
        assert "not supported yet" in r.stderr and "cpp wrapper" in r.stderr
        assert r.stdout == "" and "Traceback" not in r.stderr


def test_instances_through_torchs_launcher():
    if len(sr.socket0_cores()) < 2:
        pytest.skip("needs two cores")
    r = maml("accuracy", "default", "cpu_layout", "--ninstances", "2")
    assert r.returncode == 0, r.stderr
    assert "torch.backends.xeon.run_cpu" in r.stderr
    out = rows(r.stdout)
    assert out[0] == ACC_HEADER.split(",") and sum(row[0] == "dev" for row in out) == 1
    assert sorted(row[0] for row in out[1:]) == ["cpu:0", "cpu:1"]
    assert all(row[3] == "pass" for row in out[1:]), r.stdout


def test_more_instances_than_cores_is_refused():
    r = maml("accuracy", "default", "cpu_layout", "--ninstances", str(len(sr.socket0_cores()) + 1))
    assert r.returncode == 2 and "--ninstances" in r.stderr


# ------------------------------------------------------------------ int8 (PT2E)
def test_int8_with_dynamic_shapes_is_refused():
    r = run("multiple", "inference", "accuracy", "builtin", "all", "int8", "first", "dynamic")
    assert r.returncode == 2 and "not supported yet" in r.stderr and "int8" in r.stderr
    assert r.stdout == "" and "Traceback" not in r.stderr


def test_int8_accuracy_end_to_end():
    pytest.importorskip("torchao")
    r = run("multiple", "inference", "accuracy", "builtin", "maml_omniglot", "int8", "first",
            "static", "cpp", 2, "cpu_layout", *FAST)
    assert r.returncode == 0, r.stderr[-2000:]
    last = r.stdout.strip().splitlines()[-1].split(",")
    assert last[:4] == ["cpu", "maml_omniglot", "2", "pass"], r.stderr[-2000:]
    assert int(last[4]) > 0 and last[5:] == ["1", "0"]


def test_int8_of_the_huggingface_suite_is_refused():
    r = run("multiple", "inference", "accuracy", "huggingface", "bert", "int8")
    assert r.returncode == 2 and "not supported yet" in r.stderr and "huggingface" in r.stderr
    assert r.stdout == "" and "Traceback" not in r.stderr


def test_huggingface_accuracy_end_to_end():
    """DistilBERT from its config, token ids and a mask (batch 1, sequence 128), C++ wrapper."""
    pytest.importorskip("transformers")
    r = run("single", "inference", "accuracy", "huggingface", "distilbert", "float32", "first",
            "static", "cpp", 0, "cpu_layout", *FAST, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    last = r.stdout.strip().splitlines()[-1].split(",")
    assert last[:4] == ["cpu", "distilbert", "1", "pass"], r.stderr[-2000:]
    assert int(last[4]) > 0 and last[5:] == ["1", "0"]
