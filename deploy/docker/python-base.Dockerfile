# Python base for hosts that cannot pull python:3.11-slim: Debian's python3 in /opt/venv
# (the hsq Dockerfile uses that venv when it is there) with torch from a local CPU wheel.
# Context: the torch wheel and host-ca.crt, the CA bundle the host trusts (pip in this and
# later builds uses it). Built by scripts/docker_local_images.sh.
ARG BASE=hsq-local/debian:bookworm
FROM ${BASE}
ARG TORCH_SPEC
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      python3 python3-venv ca-certificates >/dev/null \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
COPY host-ca.crt /etc/ssl/certs/host-ca.crt
ENV PATH=/opt/venv/bin:$PATH PIP_CERT=/etc/ssl/certs/host-ca.crt
COPY *.whl /tmp/wheels/
RUN pip install -q --no-cache-dir --disable-pip-version-check \
      --find-links /tmp/wheels "${TORCH_SPEC:?pass TORCH_SPEC}" \
 && rm -rf /tmp/wheels
