# Sourced by scripts/bench.sh and scripts/test.sh: make a Python environment with torch and the
# sparse_attn extension built in place, and export $PY.
#  - SPARSE_ATTN_PYTHON=/path/to/python uses that interpreter (e.g. one whose torch has CUDA);
#  - otherwise ./.venv is created, and torch 2.13.0 (CPU) is installed if it has no torch.
# The build is incremental (ninja), so a second call is quick.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -n "${SPARSE_ATTN_PYTHON:-}" ]; then
  PY="$SPARSE_ATTN_PYTHON"
else
  [ -x "$ROOT/.venv/bin/python" ] || python3 -m venv "$ROOT/.venv"
  PY="$ROOT/.venv/bin/python"
fi
export PY
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q pytest numpy ninja setuptools wheel
echo "building sparse_attn (log: $ROOT/build/pip-build.log)"
mkdir -p "$ROOT/build"
"$PY" -m pip install --no-build-isolation --no-deps -e "$ROOT" > "$ROOT/build/pip-build.log" 2>&1 \
  || { tail -40 "$ROOT/build/pip-build.log"; exit 1; }
