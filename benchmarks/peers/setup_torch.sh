#!/usr/bin/env bash
# Create (or reuse) .venv-torch at the repo root with torch==2.13.0 (CPU wheel), numpy and psutil.
#
# Usage: bash benchmarks/peers/setup_torch.sh        (PYTHON=/path/to/python3 to choose the base)
#
# Idempotent: an existing venv that already has torch 2.13.0, numpy and psutil is left as it is.
# torch is pinned to exactly 2.13.0: this machine keeps its CPU wheel on disk, and any other
# version would download a multi-GB CUDA build.
set -euo pipefail

TORCH_VERSION="2.13.0"
PYTHON="${PYTHON:-python3}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="$ROOT/.venv-torch"

fail() { echo "setup_torch.sh: ERROR: $*" >&2; exit 1; }

command -v "$PYTHON" >/dev/null 2>&1 || fail "base interpreter '$PYTHON' not found (set PYTHON=...)"

if [ -x "$VENV/bin/python" ]; then
    echo "setup_torch.sh: reusing $VENV"
else
    echo "setup_torch.sh: creating $VENV with $("$PYTHON" --version 2>&1) ($PYTHON)"
    "$PYTHON" -m venv "$VENV" || fail "'$PYTHON -m venv $VENV' failed (is the venv module installed?)"
fi

PY="$VENV/bin/python"
check() {
    "$PY" - "$TORCH_VERSION" <<'PYEOF' 2>/dev/null
import sys
import numpy, psutil, torch
sys.exit(0 if torch.__version__.split("+")[0] == sys.argv[1] else 1)
PYEOF
}

if check; then
    echo "setup_torch.sh: torch $TORCH_VERSION, numpy and psutil already installed; nothing to do"
else
    echo "setup_torch.sh: installing torch==$TORCH_VERSION numpy psutil into $VENV"
    "$PY" -m pip install --quiet "torch==$TORCH_VERSION" numpy psutil \
        || fail "pip install torch==$TORCH_VERSION numpy psutil failed"
    check || fail "installed packages do not import, or torch is not $TORCH_VERSION"
fi

"$PY" -c 'import sys, torch, numpy, psutil; print("setup_torch.sh: ok: torch", torch.__version__, "numpy", numpy.__version__, "psutil", psutil.__version__, "python", sys.version.split()[0])' \
    || fail "final import check failed"
touch "$VENV/.installed"  # benchmarks/suite.py runs the peer only when this exists
echo "setup_torch.sh: use $PY"
