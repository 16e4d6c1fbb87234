#!/usr/bin/env bash
# The test suite: set up (see env.sh), then pytest. GPU tests run when a GPU and a CUDA build are
# present and are skipped otherwise. Extra arguments go to pytest (e.g. -k flash -x).
set -euo pipefail
source "$(dirname "$0")/env.sh"
cd "$ROOT"
exec "$PY" -m pytest -q -p no:cacheprovider "$@"
