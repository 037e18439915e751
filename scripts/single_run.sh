#!/usr/bin/env bash
# cpu_layout's drop-in for PyTorch CPU's inductor_single_run.sh (same positional order):
#   bash scripts/single_run.sh [THREAD] [MODE] [SCENARIO] [SUITE] [MODEL] [DT] [CHANNELS] \
#                              [SHAPE] [WRAPPER] [BS] [BACKEND] [--output CSV] [--plot [PNG]] \
#                              [--iters N] [--warmup N]
#   defaults: multiple inference accuracy builtin all float32 first static default 0 cpu_layout
# e.g. bash scripts/single_run.sh multiple inference performance builtin all float32 first static default 0 cpu_layout
# stdout is CSV (last line = last row); messages and progress go to stderr. See scripts/single_run.py.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
PY="$HERE/../.venv/bin/python"
if [ ! -x "$PY" ]; then
    # env.sh creates .venv and builds the extension; its messages go to stderr so that
    # stdout stays CSV.
    # shellcheck source=env.sh
    source "$HERE/env.sh" >&2
fi
# shellcheck source=omp_env.sh
source "$HERE/omp_env.sh"
exec "$PY" "$HERE/single_run.py" "$@"
