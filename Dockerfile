# hsq images, two targets (docs/install.md). GPU servers use Dockerfile.sglang (a pinned
# SGLang image with hsq's hook installed).
#   base       the worker, producer, exporter and one-off commands: hsq's base install, no
#              torch (a worker copies the server's dumps with numpy; docs/install.md has the
#              sizes). docker-compose.yml's `hsq:latest`.
#   reference  base plus hsq[reference]: the CPU reference server (torch, transformers).
#              docker-compose.yml's `hsq-reference:latest`; the last stage, so a plain
#              `docker build .` still gives an image that runs every command.
# It installs the wheel `make dist` builds (dist/, checked by tests/test_package.py), never
# the source tree: `make dist` first (.dockerignore lets only that wheel, constraints.txt and
# the image check into the context).
#   BASE: any Debian-like image with python3 >= 3.11 and its venv module. A base that already
#   has /opt/venv with torch (deploy/docker/python-base.Dockerfile, for hosts that cannot
#   reach a registry) is used as it is; otherwise the reference target installs the CPU
#   build of torch.
ARG BASE=python:3.11-slim
FROM ${BASE} AS base
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1
RUN [ -x /opt/venv/bin/python ] || python3 -m venv /opt/venv
COPY constraints.txt /tmp/hsq/
COPY dist/hidden_state_queue-*.whl /tmp/hsq/
# The base requirements at the versions CI tested (constraints.txt); no extra, so no torch.
RUN pip install --no-cache-dir --disable-pip-version-check \
      -c /tmp/hsq/constraints.txt /tmp/hsq/hidden_state_queue-*.whl \
 && rm -rf /tmp/hsq
WORKDIR /opt/hsq

FROM base AS reference
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN python -c 'import torch' 2>/dev/null \
 || pip install --no-cache-dir --index-url "$TORCH_INDEX" "$TORCH_SPEC"
COPY constraints.txt /tmp/hsq/
COPY dist/hidden_state_queue-*.whl /tmp/hsq/
# The torch already there stays (no dependency may pull another, multi-GB build); the rest
# at the versions CI tested (constraints.txt).
RUN python -c 'import torch; print("torch==" + torch.__version__)' > /tmp/hsq/torch.txt \
 && pip install --no-cache-dir --disable-pip-version-check \
      -c /tmp/hsq/torch.txt -c /tmp/hsq/constraints.txt \
      "$(ls /tmp/hsq/hidden_state_queue-*.whl)[reference]" \
 && rm -rf /tmp/hsq
