#!/usr/bin/env bash
# Set up .venv if needed, then run the main job: every built-in model through
# cpu_layout against eager (performance scenario), as scripts/single_run.sh
# prints it. Extra arguments go to single_run.sh (e.g. --output results.csv).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh" >&2
cd "$ROOT"
exec bash scripts/single_run.sh multiple inference performance builtin all float32 first static default 0 cpu_layout "$@"
