#!/usr/bin/env bash
# System packages for the deployment tests (make compose-test, make slurm-test) and for the
# compose stack on this host, from Debian 12: docker.io (20.10) and docker-compose (1.29),
# debootstrap (the local base image), slurm-wlm (22.05) and munge; redis-server and
# prometheus as setup.sh installs them. Starts nothing: the tests start and stop what they
# need (docs/deploy.md). Idempotent: installs only what is missing.
set -euo pipefail
say() { printf '[setup-deploy] %s\n' "$*"; }

need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v docker-compose >/dev/null || need+=(docker-compose)
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v slurmctld >/dev/null && command -v slurmd >/dev/null || need+=(slurm-wlm)
command -v munged >/dev/null || need+=(munge)
command -v redis-server >/dev/null || need+=(redis-server)
command -v prometheus >/dev/null || need+=(prometheus)
if ((${#need[@]} == 0)); then say "all present"; exit 0; fi
if [ "$(id -u)" = 0 ]; then SUDO=""; elif command -v sudo >/dev/null; then SUDO="sudo"; else
  say "missing ${need[*]} and no root: install them, then re-run"; exit 1; fi
say "installing ${need[*]} (Debian packages)"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
say "done"
