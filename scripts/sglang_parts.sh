#!/usr/bin/env bash
# sglang_parts.sh [WHEELHOUSE] [LIMIT_MIB]: split a bundle of scripts/sglang_wheelhouse.sh
# that does not fit one device call (with the checkout: 64 MiB in all) into two parts,
# WHEELHOUSE/part1 and WHEELHOUSE/part2 (hard links: no disk used), each carried by its own
# device call:
#   part1  the sglang and flashinfer-python wheels (~32 MB for 0.5.17)
#   part2  everything else: sgl_kernel.tar.gz, redis/, the small wheels, if-missing/
# Both hold VERSION and PARTS (every file of the whole bundle, with its size), so
# scripts/sglang_live.sh --part knows when it has them all.
#
#   here:          bash scripts/sglang_parts.sh .wheelhouse        # once
#   device call 1: bash scripts/sglang_live.sh --part .wheelhouse/part1   carry [.wheelhouse/part1]
#   device call 2: bash scripts/sglang_live.sh --part .wheelhouse/part2 --job ...  (within
#                  30 s of call 1's end: the warm machine keeps /tmp, where call 1 left part1)
set -euo pipefail
cd "$(dirname "$0")/.."
WH=${1:-.wheelhouse}
LIMIT=${2:-56}
say() { printf '[sglang_parts.sh] %s\n' "$*"; }
die() { say "$*" >&2; exit 2; }
[ -d "$WH/wheels" ] && [ -f "$WH/VERSION" ] || die "$WH: no wheels/ or VERSION (scripts/sglang_wheelhouse.sh)"
rm -rf "$WH/part1" "$WH/part2"
mkdir -p "$WH/part1/wheels" "$WH/part2/wheels"
list=$(mktemp)
trap 'rm -f "$list"' EXIT
# The list of the whole bundle (relative paths and sizes), parts and downloads left out.
(cd "$WH" && find . -path ./dl -prune -o -path ./dl-cutlass -prune -o -path './part[12]' -prune \
  -o -type f ! -name PARTS ! -name '*.tar.xz' -printf '%P %s\n' | LC_ALL=C sort) >"$list"
while read -r rel _; do
  case "$rel" in
    wheels/sglang-*.whl | wheels/flashinfer_python-*.whl) part=part1 ;;
    *) part=part2 ;;
  esac
  mkdir -p "$WH/$part/$(dirname "$rel")"
  ln -f "$WH/$rel" "$WH/$part/$rel" 2>/dev/null || cp -p "$WH/$rel" "$WH/$part/$rel"
done <"$list"
for p in part1 part2; do
  cp "$list" "$WH/$p/PARTS"
  [ -f "$WH/$p/VERSION" ] || cp "$WH/VERSION" "$WH/$p/VERSION"
  size=$(du -sbL "$WH/$p" | cut -f1)
  say "$WH/$p: $((size / 1048576)) MiB ($(find "$WH/$p" -type f | wc -l) files)"
  ((size <= LIMIT * 1048576)) || die "$WH/$p is over $LIMIT MiB: split it further"
done
say "carry one part a call: part1 first, then part2 within 30 s (scripts/sglang_live.sh --part)"
