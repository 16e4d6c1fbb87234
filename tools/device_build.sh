#!/usr/bin/env bash
# Build sparse_attn in place on the lent GPU machine (torch 2.11 there): Hopper only, all cores.
# Usage (from the repo root): source tools/device_build.sh  -> log in $OUT/build.log, PYTHONPATH set
#
# The image's default C++ compiler (/opt/gcc/bin/g++, which torch's build helper picks up) links
# libstdc++ statically; a Python extension with its own libstdc++ crashes formatting the first
# C++ exception it throws (seen: every argument check segfaulted). The system g++ links it shared.
[ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}" MAX_JOBS="${MAX_JOBS:-16}" NVCC_THREADS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
start=$(date +%s)
if ! python3 setup.py build_ext --inplace > "${OUT:-/tmp}/build.log" 2>&1; then tail -50 "${OUT:-/tmp}/build.log"; return 1 2>/dev/null || exit 1; fi
echo "build: $(( $(date +%s) - start )) s; libstdc++: $(ldd sparse_attn/_C*.so | grep -c libstdc++) shared"
# ptxas resource lines of kernels that spill
grep -E "^ *[0-9]+ bytes stack frame, [1-9]" "${OUT:-/tmp}/build.log" | sort | uniq -c || true
# ptxas C7514/C7515: wgmma serialised (a non-wgmma instruction may touch an in-flight accumulator
# on some path); it cost the Hopper kernels 25 % once and 20-40 % another time (docs/PERF_LOG.md)
grep -q "instructions are serialized" "${OUT:-/tmp}/build.log" &&
  echo "WARNING: ptxas serialised wgmma in $(grep -c "instructions are serialized" "${OUT:-/tmp}/build.log") kernels"
true
