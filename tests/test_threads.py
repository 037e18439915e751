"""The OpenMP wait policy check and worker pinning (cpu_layout.threads)."""
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from cpu_layout import threads


@pytest.fixture
def fresh_check():
    threads.check_wait_policy.cache_clear()
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)
    threads.check_wait_policy.cache_clear()


@pytest.mark.parametrize("env, spins", [
    ({}, True),
    ({"OMP_WAIT_POLICY": "passive"}, False),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, True),
    ({"GOMP_SPINCOUNT": "1000"}, False),
    ({"GOMP_SPINCOUNT": "10k"}, False),
    ({"GOMP_SPINCOUNT": "300000"}, True),
    ({"GOMP_SPINCOUNT": "infinite"}, True),
    ({"GOMP_SPINCOUNT": "0"}, False),
])
def test_which_settings_spin(env, spins, monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert threads.spinning() is spins


def test_warns_once_when_spinning_threads_outnumber_idle_cores(monkeypatch, fresh_check):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(threads, "busy_cores_elsewhere", lambda: 1.0)
    torch.set_num_threads(2)
    with pytest.warns(RuntimeWarning, match="OMP_WAIT_POLICY=PASSIVE"):
        assert threads.check_wait_policy() is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        threads.check_wait_policy()  # once per process


@pytest.mark.parametrize("case", ["idle", "one thread", "passive"])
def test_no_warning_when_nothing_spins_on_a_busy_core(case, monkeypatch, fresh_check):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(threads, "busy_cores_elsewhere", lambda: 0.1 if case == "idle" else 1.0)
    torch.set_num_threads(1 if case == "one thread" else 2)
    if case == "passive":
        monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert threads.check_wait_policy() is None


def test_busy_cores_elsewhere_sees_another_process_spinning():
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        busy = threads.busy_cores_elsewhere(window=0.5)
    finally:
        spinner.kill()
        spinner.wait()
    if busy is None:
        pytest.skip("no /proc/stat here")
    assert busy >= 0.5, busy


# In a fresh process with a 2-wide team: which of its threads are pinned, to what.
_AFFINITY_PROBE = r"""
import json, os, sys, threading, torch
torch.set_num_threads(2)
from cpu_layout import threads

def sets():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/status") as f:
            line = next(l for l in f if l.startswith("Cpus_allowed_list"))
        out[int(tid)] = line.split(":", 1)[1].strip()
    return out

mode = sys.argv[1]
torch.ones(1 << 22).sum()  # the team exists before anything is pinned
if mode == "compile":
    with torch.no_grad():
        m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()).eval()
        torch.compile(m, backend="cpu_layout")(torch.randn(1, 3, 16, 16))
    n = None
else:
    n = threads.pin_workers()
torch.ones(1 << 22).sum()
pinned = sets()
again = threads.pin_workers()
freed = threads.unpin_workers() if mode == "pin_unpin" else None
print(json.dumps({"n": n, "again": again, "freed": freed, "pinned": pinned, "after": sets(),
                  "main": threading.get_native_id(),
                  "allowed": sorted(os.sched_getaffinity(0))}))
"""


def _cpu_list(text):
    cpus = set()
    for part in text.split(","):
        a, _, b = part.partition("-")
        cpus.update(range(int(a), int(b or a) + 1))
    return cpus


def _probe(mode, **env):
    e = dict(os.environ, OMP_NUM_THREADS="2", **env)
    out = subprocess.run([sys.executable, "-c", _AFFINITY_PROBE, mode], env=e, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    singles = {int(t): _cpu_list(c) for t, c in r["pinned"].items() if len(_cpu_list(c)) == 1}
    return r, singles


needs_two_cpus = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="pinning needs two CPUs in the affinity set")


@needs_two_cpus
@pytest.mark.parametrize("mode", ["pin_unpin", "compile"])
def test_the_worker_is_pinned_and_the_calling_thread_is_not(mode):
    r, singles = _probe(mode, CPU_LAYOUT_PIN_THREADS="1")
    allowed = set(r["allowed"])
    if mode == "pin_unpin":
        assert r["n"] == 1
    assert r["again"] == 0  # once per thread and team size
    assert len(singles) == 1, r["pinned"]  # exactly the one worker of a 2-wide team
    (tid, cpu), = singles.items()
    assert tid != r["main"] and cpu <= allowed
    assert _cpu_list(r["pinned"][str(r["main"])]) == allowed  # the caller keeps its whole set
    if mode == "pin_unpin":
        assert r["freed"] == 1
        assert all(_cpu_list(c) == allowed for c in r["after"].values()), r["after"]


@needs_two_cpus
def test_pinning_can_be_switched_off():
    r, singles = _probe("compile", CPU_LAYOUT_PIN_THREADS="0")
    assert singles == {}, r["pinned"]


def test_no_pinning_with_one_thread(monkeypatch):
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        monkeypatch.setenv("CPU_LAYOUT_PIN_THREADS", "1")
        assert threads.pin_workers() == 0
    finally:
        torch.set_num_threads(old)
