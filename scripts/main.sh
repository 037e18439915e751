#!/usr/bin/env bash
# Set up .venv if needed, then run the main job. Extra arguments go to the demo.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh"
cd "$ROOT"
exec "$VENV/bin/python" scripts/demo.py "$@"
