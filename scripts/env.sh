#!/usr/bin/env bash
# Create (or refresh) the project's environment in .venv and build the
# extension. Sourced by scripts/main.sh and scripts/test.sh; safe to re-run:
# it reinstalls only when setup files or csrc/ changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"

if [ ! -x "$PY" ]; then
    echo "[env] creating $VENV"
    python3 -m venv "$VENV"
fi
pip_q() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

# torch first and pinned: a bare `torch` requirement would fetch a CUDA build.
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
    echo "[env] installing torch==2.13.0 (CPU)"
    pip_q torch==2.13.0
fi

# Test and benchmark dependencies: real model suites (torchvision pinned to the
# release built for torch 2.13, so it cannot pull another torch; timm imports
# it), hypothesis for the property tests, matplotlib for the runner's --plot,
# openvino for the benchmarks' OpenVINO column, torchao for PyTorch's INT8 flow
# (PT2E: prepare_pt2e / convert_pt2e with X86InductorQuantizer; pinned, as it
# follows torch releases), nncf for the benchmarks' OpenVINO INT8 column
# (nncf.quantize; it does not depend on torch), transformers for the huggingface
# suite (models built from their configs; pinned: its model code decides the graphs).
EXTRAS=(pytest hypothesis matplotlib torchvision==0.28.0 timm openvino torchao==0.18.0 nncf transformers==5.25.0)
STAMP="$VENV/.cpu_layout-build-stamp"
HASH="$( (cat "$ROOT/setup.py" "$ROOT/pyproject.toml" "$ROOT"/csrc/*; echo "${EXTRAS[*]}") | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$HASH" ] || \
   ! "$PY" -c "import cpu_layout.ops" 2>/dev/null; then
    echo "[env] installing build and test dependencies"
    pip_q "setuptools>=64" wheel "cffi>=1.15" numpy "${EXTRAS[@]}" \
        onednn-cpu-gomp==2023.2.0 onednn-devel-cpu-gomp==2023.2.0
    "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" || {
        echo "[env] a dependency replaced torch 2.13.0 (CPU); refusing to go on" >&2; exit 1; }
    echo "[env] building cpu_layout"
    # The build requirements are installed above, so skip pip's isolated
    # build environment (saves a download and works offline once set up).
    (cd "$ROOT" && pip_q --no-build-isolation --no-deps -e .)
    # setuptools leaves metadata in the source tree; importlib.metadata would
    # read it (it comes first on sys.path from the repo root) and miss the
    # installed entry points, hiding backend="cpu_layout".
    rm -rf "$ROOT/cpu_layout.egg-info" "$ROOT/build"
    # The C++ wrapper's segment runtime and the module-state check, built once into the cache
    # (else the first compile builds them).
    "$PY" -c "from cpu_layout.codegen import program; from cpu_layout import state_key; program.runtime(); state_key.native()"
    echo "$HASH" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
# shellcheck source=omp_env.sh
source "$ROOT/scripts/omp_env.sh"
