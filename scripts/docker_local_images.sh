#!/usr/bin/env bash
# Builds the images the compose stack needs from Debian packages, for hosts that reach apt
# and PyPI but no image registry (our CI and dev machines). Each image is built only when
# missing (FORCE=1 rebuilds all but the debootstrap base; drop that with `docker rmi`):
#   hsq-local/debian:bookworm  debootstrap --variant=minbase, then `docker import` (cached)
#   hsq-local/python:bookworm  python3 in /opt/venv with the host's CPU torch wheel
#   hsq-local/redis:bookworm, hsq-local/prometheus:bookworm   Debian's packages
# docker-compose.local.yml swaps them in. Builds use host networking (no bridge here).
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf '[local-images] %s\n' "$*"; }
have() { [ -z "${FORCE:-}" ] && docker image inspect "$1" >/dev/null 2>&1; }
build() {  # build TAG DOCKERFILE CONTEXT [ARGS...]
  local tag=$1 file=$2 ctx=$3; shift 3
  if have "$tag"; then say "$tag: cached"; return; fi
  say "building $tag"
  nice -n 10 docker build --network host -q -t "$tag" -f "$file" "$@" "$ctx" >/dev/null
}

base=hsq-local/debian:bookworm
if docker image inspect "$base" >/dev/null 2>&1; then
  say "$base: cached"
else
  mirror=${DEBIAN_MIRROR:-$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)}
  mirror=${mirror:-http://deb.debian.org/debian}
  rootfs=$(mktemp -d)
  trap 'rm -rf "$rootfs"' EXIT
  say "debootstrap bookworm from $mirror (a minute or two)"
  nice -n 10 debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >/dev/null
  tar -C "$rootfs" -c . | docker import - "$base" >/dev/null
  rm -rf "$rootfs"
  trap - EXIT
fi

# The torch of hsq's venv (CPU build) goes into the python base, fetched the way pip fetched
# it for the venv (TORCH_INDEX=<url> as for setup.sh): no CUDA build in the images.
PY=.venv/bin/python
[ -x "$PY" ] || PY=${PYTHON:-python3}
torch_spec=$("$PY" -c 'import torch; print("torch==" + torch.__version__)')
ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
if ! have hsq-local/python:bookworm; then
  say "fetching the $torch_spec wheel (pip's own configuration)"
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary :all: \
    ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} -d "$ctx" "$torch_spec"
  # The CAs this host trusts (a TLS-inspecting proxy's too), so pip in builds can reach PyPI.
  cp /etc/ssl/certs/ca-certificates.crt "$ctx/host-ca.crt"
fi
build hsq-local/python:bookworm deploy/docker/python-base.Dockerfile "$ctx" \
  --build-arg BASE="$base" --build-arg TORCH_SPEC="$torch_spec"
build hsq-local/redis:bookworm deploy/docker/debian-package.Dockerfile deploy/docker \
  --build-arg BASE="$base" --build-arg PACKAGES=redis-server
build hsq-local/prometheus:bookworm deploy/docker/debian-package.Dockerfile deploy/docker \
  --build-arg BASE="$base" --build-arg PACKAGES=prometheus
say "done"
