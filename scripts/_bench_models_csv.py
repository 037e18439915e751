"""Run scripts/bench_models.py in a child process and read its latencies back
(the wrappers bench_load.py and bench_scaling.py share this; a child process
because libgomp reads its environment, and torch its thread count, once)."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
import tempfile
from typing import Dict, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))


def read_latencies(path: str) -> Dict[Tuple[str, str], float]:
    """(model, variant) -> median ms, from a bench_models.py --csv file."""
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return {(r["model"], r["variant"]): float(r["latency_ms"]) for r in rows if r["latency_ms"]}


def run_bench_models(argv: Sequence[str], env: Optional[dict] = None) -> Dict[Tuple[str, str], float]:
    """bench_models.py with `argv` (plus --csv), its table discarded, its latencies returned."""
    fd, path = tempfile.mkstemp(suffix=".csv")
    os.close(fd)
    try:
        subprocess.run([sys.executable, os.path.join(HERE, "bench_models.py"), *argv, "--csv", path],
                       env=env, check=True, stdout=subprocess.DEVNULL)
        return read_latencies(path)
    finally:
        os.unlink(path)
