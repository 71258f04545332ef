#!/usr/bin/env bash
# Build an offline Python bundle for a GPU host that has no package index.
#
# The GPU host has Python 3.12, PyTorch and Triton, but not TileLang. This script
# downloads TileLang, the packages it needs that such a host lacks and ruamel.yaml
# (mate-tune's config write-back), unpacks
# them into one folder and packs it as .gpu/site.tar.xz (about 34 MB, see below) in the
# current repository root. It also adds /.gpu/ to .git/info/exclude.
#
# On the GPU host:
#   mkdir -p /tmp/site && tar xJf .gpu/site.tar.xz -C /tmp/site
#   export PYTHONPATH=/tmp/site:$PWD
#
# Usage: bash scripts/gpu-bundle.sh [--force]
set -euo pipefail
root=$(git rev-parse --show-toplevel)
out="$root/.gpu/site.tar.xz"
if [[ -f "$out" && "${1:-}" != "--force" ]]; then
  echo "bundle exists: ${out#$root/} (use --force to rebuild)"; exit 0
fi
ex="$root/.git/info/exclude"
if ! grep -qxF '/.gpu/' "$ex" 2>/dev/null; then
  [[ -s "$ex" && -n "$(tail -c1 "$ex")" ]] && echo >> "$ex"
  echo '/.gpu/' >> "$ex"
fi
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
plat=(--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64)
# Versions that work together with the GPU host's torch 2.11 / Python 3.12.
pkgs=("tilelang==0.1.15" "apache-tvm-ffi==0.1.12" "torch-c-dlpack-ext==0.1.5" "z3-solver==4.15.4.0" "ruamel.yaml==0.19.1")
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" -d "$work/wheels" "${pkgs[@]}" 2> >(grep -v "is ignored: it is neither" >&2)
mkdir -p "$work/site"
for w in "$work"/wheels/*.whl; do python3 -m zipfile -e "$w" "$work/site"; done
# Left out, so that the bundle travels beside the 27 MB FlashAttention-3 wheel within a call's 64 MiB (53 -> 34 MB):
# what TileLang never reads on a CUDA host at run time: z3's executable and C headers (libtvm_compiler links
# libz3.so.4.15 alone; the wheel's zip holds the library twice, so one name becomes a link to the other), the
# C++ sources TVM and TileLang were built from (the JIT compiles against tilelang/src/tl_templates, CUTLASS's
# and TVM's include folders, which stay), CUTLASS's tools, tvm_ffi's vendored third-party sources.
# (tvm_ffi's core loads libtvm_ffi_testing.so at import: it stays.)
site="$work/site"
rm -rf "$site"/z3_solver-*.data "$site/z3/include" "$site/tilelang/3rdparty/tvm/src" "$site/tilelang/3rdparty/cutlass/tools" \
  "$site/tvm_ffi/3rdparty"
find "$site/tilelang/src" -name '*.cc' -delete
ln -sf libz3.so.4.15 "$site/z3/lib/libz3.so"
strip --strip-unneeded "$site/z3/lib/libz3.so.4.15"
mkdir -p "$root/.gpu"
tar cf - -C "$site" . | xz -T0 -9 > "$out.tmp" && mv "$out.tmp" "$out"
echo "wrote ${out#$root/} ($(du -h "$out" | cut -f1))"
