#!/usr/bin/env bash
# Compile the kernels a GPU host would otherwise compile first, here (nvcc for sm_90a needs no GPU), into a
# fresh TileLang disk cache, and pack it as .gpu/tlcache.tar.xz for the host to load instead.
#
# xz packs a cache 16-33x (all 212 kernels at 588c820: 113 MB -> 7 MB; 47 QSA kernels: 27 MB -> 0.8 MB),
# so it travels beside the 51 MB bundle within a device call's 64 MiB, where the folder itself would not.
# TileLang keys the cache by each kernel's program, target and pass configs: a kernel whose source changed
# afterwards misses and compiles again, it is never loaded stale. scripts/gpu-suite.sh unpacks
# .gpu/tlcache.tar.xz when it is there.
#
# On the GPU host (what gpu-suite.sh does):
#   mkdir -p /tmp/tlc && tar xJf .gpu/tlcache.tar.xz -C /tmp/tlc && export TILELANG_CACHE_DIR=/tmp/tlc/tlcache
#
# Usage: bash scripts/gpu-cache.sh [JOBS] [mate-precompile arguments ...]
#   default: every config entry with its option variants (mate-precompile --options) and the stress
#   tests' kernels outside the config (python tests/test_stress_gpu.py): 29 minutes on 2 cores; unpacked,
#   scripts/gpu-suite.sh's precompile then loads all 191 + 21 from the cache (71 s on those 2 cores, 16 processes).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
jobs=${1:-$(nproc)}
shift || true
args=("$@")
[[ ${#args[@]} -gt 0 ]] || args=(--options)
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
export TILELANG_CACHE_DIR="$work/tlcache"
python -m mate.precompile --jobs "$jobs" "${args[@]}"
if [[ " ${args[*]} " == *" --options "* ]]; then
  python tests/test_stress_gpu.py "$jobs"
fi
mkdir -p .gpu
tar cf - -C "$work" tlcache | xz -T0 -6 > .gpu/tlcache.tar.xz.tmp && mv .gpu/tlcache.tar.xz.tmp .gpu/tlcache.tar.xz
echo "wrote .gpu/tlcache.tar.xz ($(du -h .gpu/tlcache.tar.xz | cut -f1), $(du -sh "$work/tlcache" | cut -f1) unpacked)"
