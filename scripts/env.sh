# Sourced by scripts/bench.sh and scripts/test.sh: make a Python environment with torch and the
# sparse_attn extension built in place, and export $PY.
#  - SPARSE_ATTN_PYTHON=/path/to/python uses that interpreter (e.g. one whose torch has CUDA);
#  - otherwise ./.venv is created, and torch 2.13.0 (CPU) is installed if it has no torch.
# The build is incremental: ninja keeps its objects in ./build, so an unchanged tree rebuilds in
# seconds and an edit recompiles only what it touches; each compiled file is printed as it starts.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -n "${SPARSE_ATTN_PYTHON:-}" ]; then
  PY="$SPARSE_ATTN_PYTHON"
else
  [ -x "$ROOT/.venv/bin/python" ] || python3 -m venv "$ROOT/.venv"
  PY="$ROOT/.venv/bin/python"
fi
export PY
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q "torch==2.13.0"
# transformers: the tests of sparse_attn.integrations.transformers run a tiny model with it.
"$PY" -c "import pytest, numpy, ninja, setuptools, wheel, transformers" 2>/dev/null ||
  "$PY" -m pip install -q pytest numpy ninja setuptools wheel transformers
mkdir -p "$ROOT/build"
echo "building sparse_attn (incremental; full log: $ROOT/build/build.log)"
(cd "$ROOT" && set -o pipefail && "$PY" setup.py build_ext --inplace 2>&1 | tee "$ROOT/build/build.log" |
  sed -nE 's#^\[([0-9]+/[0-9]+)\] .* -c ([^ ]*/)?(csrc/[^ ]+\.(cu|cpp)) .*#  [\1] \3#p') ||
  { tail -40 "$ROOT/build/build.log"; exit 1; }
# The checkout on the interpreter's path (what `pip install -e .` would do, without its second
# build): examples and notebooks import it from anywhere.
"$PY" - "$ROOT" <<'EOF'
import pathlib, site, sys
root = sys.argv[1]
target = pathlib.Path(site.getsitepackages()[0]) / "sparse_attn_checkout.pth"
if not target.exists() or target.read_text().strip() != root:
    try:
        target.write_text(root + "\n")
    except OSError:
        print(f"note: cannot write {target}; run with PYTHONPATH={root} outside the checkout")
EOF
