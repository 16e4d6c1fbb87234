#!/usr/bin/env bash
# The main job: set up (see env.sh), then time every op against SDPA, FlexAttention and naive
# PyTorch on this machine's device (CPU defaults take about a minute). Extra arguments go to
# `python -m sparse_attn.bench` (try --help).
set -euo pipefail
source "$(dirname "$0")/env.sh"
# The main job's progress bar and plots (optional: without them it prints lines and no plots).
"$PY" -c "import matplotlib, tqdm" 2>/dev/null || "$PY" -m pip install -q matplotlib tqdm ||
  echo "note: matplotlib/tqdm not installed: no plots or progress bar"
cd "$ROOT"
exec "$PY" -m sparse_attn.bench "$@"
