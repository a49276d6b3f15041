#!/usr/bin/env bash
# sglang_cutlass.sh [OUT]: nvidia-cutlass-dsl (CUDA 13) packed for a second transfer to the
# GPU machine, next to the bundle of scripts/sglang_wheelhouse.sh.
#
# Why: SGLang's DeepSeek model module (sglang.srt.models.deepseek_v2, also behind Kimi-K2.5)
# imports the DeepSeek-V3.2 DSA indexer at module level, which imports `cutlass`. A stand-in
# makes flashinfer pick its CuTe kernels and crash (seen live, 2026-12-01), so the real
# package is needed. Its wheel is 78.8 MB: bundle and cutlass do not fit one 64 MiB device
# call together. The first call installs the bundle into /tmp/hsq-site; the second, made
# within 30 s of the first one's end (the machine is still warm and keeps /tmp), carries
# OUT/cutlass-cu13.tar.xz, and scripts/sglang_live.sh --cutlass unpacks it there.
#
#   SGLANG_VERSION=0.5.15 (default): the cutlass-dsl release that SGLang version pins
#   (0.5.15: 4.5.2; 0.5.16 and 0.5.17: 4.6.0).
#
# nvidia-cutlass-dsl-libs-cu13 holds the whole nvidia_cutlass_dsl/ tree (-libs-base is the
# same tree for the generic build: not needed); nvidia-cutlass-dsl itself is 10 KB of
# metadata. Both are unzipped into one folder and packed with xz -9e (52.9 MB for 4.5.2,
# about 3 minutes on 2 cores). Installed as files, the package's .pth is not read from a
# PYTHONPATH folder: sglang_live.sh puts $SITE/nvidia_cutlass_dsl/python_packages on it.
set -euo pipefail
OUT=${1:-.wheelhouse}
PY=${PY:-python3}
SGLANG=${SGLANG_VERSION:-0.5.15}
case "$SGLANG" in
  0.5.15) CUTLASS=4.5.2 ;;
  0.5.16 | 0.5.17) CUTLASS=4.6.0 ;;
  *) echo "[cutlass] SGLANG_VERSION=$SGLANG: only 0.5.15-0.5.17 run on torch 2.11" >&2; exit 2 ;;
esac
mkdir -p "$OUT/dl-cutlass"
OUT=$(cd "$OUT" && pwd)
say() { printf '[cutlass] %s\n' "$*"; }

say "nvidia-cutlass-dsl $CUTLASS (cu13) for sglang $SGLANG"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_34_x86_64 -d "$OUT/dl-cutlass" \
  "nvidia-cutlass-dsl==$CUTLASS" "nvidia-cutlass-dsl-libs-cu13==$CUTLASS"
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
for w in "$OUT"/dl-cutlass/nvidia_cutlass_dsl-"$CUTLASS"-*.whl \
  "$OUT"/dl-cutlass/nvidia_cutlass_dsl_libs_cu13-"$CUTLASS"-*.whl; do
  [ -f "$w" ] || { say "missing wheel $w"; exit 2; }
  "$PY" -m zipfile -e "$w" "$tree"
done
# 4.5.x keeps the package in python_packages/, 4.6.x in dsl_packages/ (its .pth names it).
[ -d "$tree/nvidia_cutlass_dsl/python_packages/cutlass" ] ||
  [ -d "$tree/nvidia_cutlass_dsl/dsl_packages/cutlass" ] || {
  say "no nvidia_cutlass_dsl/{python,dsl}_packages/cutlass in the wheels: layout changed"
  exit 2
}
echo "$CUTLASS" >"$tree/.cutlass-version"
(cd "$tree" && tar -cf - . | xz -9e -T2) >"$OUT/cutlass-cu13.tar.xz.part"
mv "$OUT/cutlass-cu13.tar.xz.part" "$OUT/cutlass-cu13.tar.xz"
size=$(stat -c %s "$OUT/cutlass-cu13.tar.xz")
say "cutlass-cu13.tar.xz: $((size / 1048576)) MiB ($CUTLASS)"
if ((size > 60 * 1048576)); then
  say "warning: over 60 MiB; with the checkout it may not fit one 64 MiB device call"
fi
