#!/usr/bin/env bash
# On the lent GPU: build this tree and a baseline tree side by side, then time tools/ab_cases.py
# in alternating processes of the two builds. Usage (repo root, baseline sources in DIR):
#   bash tools/device_ab.sh DIR [ROUNDS]      -> $OUT/ab_base.jsonl, $OUT/ab_new.jsonl, a table
set -euo pipefail
base=$1
rounds=${2:-3}
out=${OUT:-/tmp}
here=$PWD
source tools/device_build.sh
(cd "$base" && OUT=$out/base_build && mkdir -p "$OUT" && source "$here/tools/device_build.sh") || exit 1
: > "$out/ab_base.jsonl"
: > "$out/ab_new.jsonl"
for i in $(seq "$rounds"); do
  PYTHONPATH="$base" python3 tools/ab_cases.py >> "$out/ab_base.jsonl"
  PYTHONPATH="$here" python3 tools/ab_cases.py >> "$out/ab_new.jsonl"
done
python3 tools/ab_cases.py --compare "$out/ab_base.jsonl" "$out/ab_new.jsonl"
