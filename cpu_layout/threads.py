"""OpenMP threads on a shared machine: the wait policy, a warning when it hurts, pinned workers.

Generated kernels, oneDNN and ATen all run on torch's GNU OpenMP runtime
(libgomp). By default its idle threads spin 300k iterations at each barrier
before they sleep. On a core another process also uses, a spinning thread
takes the time slice the thread it waits for needs. Measured with
scripts/bench_load.py (Xeon, 2 cores, batch 8, 2 threads, one nice-0 process
spinning on one core; latency loaded / idle, and idle latency against the
default policy):

    policy               mobilenet_v3  efficientnet_b0  resnet50   idle cost
    default (spin 300k)      6.5x           7.4x          2.7x        -
    GOMP_SPINCOUNT=1000      1.8x           1.9x          2.2x      0-8%
    OMP_WAIT_POLICY=PASSIVE  1.6x           1.8x          2.0x      5-25%
    (OpenVINO, its own)      1.8x           1.9x          2.1x

Re-measured with the workers pinned (below) on a Sapphire Rapids-class Xeon
under KVM (2 cores, batch 8, 2 threads, compile_exported; ms idle, loaded /
idle), where waking a sleeping worker costs ~90 us (a tiny conv took 100 us
after a 10 us gap, 9 us with the worker still spinning):

    GOMP_SPINCOUNT   mobilenet_v3    shufflenet_v2   resnet50
    1000             25.4 / 1.26x    17.2 / 1.19x    210 / 1.15x
    10000            22.1 / 1.58x    13.6 / 1.26x    206 / 1.12x
    30000            23.1 / 1.17x    14.7 / 7.4x     (collapsed once)

(eager ATen 114 -> 72 ms idle for mobilenet_v3 at 10000.) 10000 is the
default: most of the idle gain, loaded latency within OpenVINO's (1.6-1.8x).

libgomp reads these variables once, when it starts, so they cannot be changed
from inside a process that has imported torch. The project's entry points
(scripts/omp_env.sh, sourced by env.sh and single_run.sh) set
GOMP_SPINCOUNT=10000 unless the user set a policy; the backend warns once per
process when it finds long spinning on more threads than there are idle cores.

Where the threads run matters as much: pin_workers() pins the OpenMP workers
to one CPU each (the calling thread left free), which took the loaded slowdown
from ~2x to 1.1-1.4x with no idle cost (docs/DESIGN.md, "Threads").
"""
from __future__ import annotations

import functools
import os
import threading
import time
import warnings
from typing import Optional, Tuple

import torch

# What libgomp takes as "threads sleep at once".
_PASSIVE = "passive"


# Spin counts up to this are short enough not to collapse on a shared core (table above).
SHORT_SPIN = 10000


def spinning() -> bool:
    """Whether libgomp's idle threads spin long (its default, or ACTIVE) rather
    than sleep at once (PASSIVE) or after a short spin (GOMP_SPINCOUNT <= SHORT_SPIN)."""
    if os.environ.get("OMP_WAIT_POLICY", "").strip().lower() == _PASSIVE:
        return False
    count = os.environ.get("GOMP_SPINCOUNT", "").strip().lower()
    if not count or count == "infinite" or count == "infinity":
        return True
    try:
        return float(count.rstrip("kmgt")) * {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}.get(
            count[-1], 1) > SHORT_SPIN
    except ValueError:
        return True


def _cpu_times() -> Optional[Tuple[float, float]]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [float(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _own_jiffies() -> Optional[float]:
    try:
        t = os.times()
    except OSError:
        return None
    return (t.user + t.system) * os.sysconf("SC_CLK_TCK")


def busy_cores_elsewhere(window: float = 0.05) -> Optional[float]:
    """Cores' worth of CPU time other processes used over `window` seconds
    (this process's own use subtracted); None where /proc/stat is missing."""
    a, own_a = _cpu_times(), _own_jiffies()
    time.sleep(window)
    b, own_b = _cpu_times(), _own_jiffies()
    if a is None or b is None or own_a is None or own_b is None or b[1] <= a[1]:
        return None
    ncpu = os.cpu_count() or 1
    busy = (b[0] - a[0]) - (own_b - own_a)
    return max(0.0, busy / (b[1] - a[1]) * ncpu)


@functools.lru_cache(maxsize=None)
def check_wait_policy() -> Optional[str]:
    """Once per process: warn when OpenMP threads spin and the machine has fewer
    idle cores (in this process's affinity set) than torch.get_num_threads().
    Returns the warning's text, or None."""
    threads = torch.get_num_threads()
    if threads <= 1 or not spinning():
        return None
    others = busy_cores_elsewhere()
    if others is None:
        return None
    try:
        ours = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        ours = os.cpu_count() or 1
    free = min(ours, (os.cpu_count() or 1) - others)
    if free >= threads - 0.5:
        return None
    msg = (f"cpu_layout: {threads} OpenMP threads with spinning barriers, but other processes keep "
           f"{others:.1f} of this machine's {os.cpu_count()} cores busy; spinning threads steal the "
           f"time slices the threads they wait for need (7x slower seen). Start the process with "
           f"GOMP_SPINCOUNT=10000 or OMP_WAIT_POLICY=PASSIVE (scripts/omp_env.sh sets the first), "
           f"or use fewer threads (torch.set_num_threads).")
    warnings.warn(msg, RuntimeWarning, stacklevel=2)
    return msg


_pinned = {}  # calling thread's id -> team size pinned


def pin_workers() -> int:
    """Pins the workers of the calling thread's OpenMP team (torch.get_num_threads()
    wide) to one CPU each of the process's affinity set, the calling thread left
    free; ATen's parallel ops in this thread run on the same workers. On a shared
    machine unpinned workers lose most of their time to barriers (csrc/threads.cpp
    has the numbers); idle, pinning changes nothing measurable. Once per calling
    thread and team size; CPU_LAYOUT_PIN_THREADS=0 turns it off. Returns the
    number of workers this call pinned."""
    from cpu_layout import config

    threads = torch.get_num_threads()
    key = threading.get_ident()
    if not config.pin_threads() or threads <= 1 or _pinned.get(key) == threads:
        return 0
    from cpu_layout import _native

    n = _native.lib.cl_pin_omp_workers(threads, 1)
    _pinned[key] = threads
    return max(n, 0)


def unpin_workers() -> int:
    """Gives the calling thread's OpenMP workers the process's whole affinity set
    back; returns how many it released."""
    from cpu_layout import _native

    _pinned.pop(threading.get_ident(), None)
    return max(_native.lib.cl_pin_omp_workers(torch.get_num_threads(), 0), 0)
