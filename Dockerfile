# hsq image for the CPU reference server and the worker/producer/exporter processes.
# GPU servers use Dockerfile.sglang (a pinned SGLang image with hsq's hook installed).
# It installs the wheel `make dist` builds (dist/, checked by tests/test_package.py), never
# the source tree: `make dist` first (.dockerignore lets only that wheel, constraints.txt and
# the image check into the context).
#   BASE: any Debian-like image with python3 >= 3.11 and its venv module. A base that already
#   has /opt/venv with torch (deploy/docker/python-base.Dockerfile, for hosts that cannot
#   reach a registry) is used as it is; otherwise the CPU build of torch is installed.
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1
RUN [ -x /opt/venv/bin/python ] || python3 -m venv /opt/venv
RUN python -c 'import torch' 2>/dev/null \
 || pip install --no-cache-dir --index-url "$TORCH_INDEX" "$TORCH_SPEC"
COPY constraints.txt /tmp/hsq/
COPY dist/hidden_state_queue-*.whl /tmp/hsq/
# The torch already there stays (no dependency may pull another, multi-GB build); the rest
# at the versions CI tested (constraints.txt).
RUN python -c 'import torch; print("torch==" + torch.__version__)' > /tmp/hsq/torch.txt \
 && pip install --no-cache-dir --disable-pip-version-check \
      -c /tmp/hsq/torch.txt -c /tmp/hsq/constraints.txt /tmp/hsq/hidden_state_queue-*.whl \
 && rm -rf /tmp/hsq
WORKDIR /opt/hsq
