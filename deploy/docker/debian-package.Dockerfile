# One Debian package as an image (redis-server, prometheus), for hosts with no registry.
# Built by scripts/docker_local_images.sh; commands come from docker-compose.yml.
ARG BASE=hsq-local/debian:bookworm
FROM ${BASE}
ARG PACKAGES
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      ${PACKAGES:?pass PACKAGES} >/dev/null \
 && rm -rf /var/lib/apt/lists/*
