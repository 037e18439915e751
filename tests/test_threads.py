"""The OpenMP wait policy check (cpu_layout.threads)."""
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
