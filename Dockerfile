# hsq image for the CPU reference server and the worker/producer/exporter processes.
# GPU servers use Dockerfile.sglang (a pinned SGLang image with hsq's hook installed).
#   BASE: any Debian-like image with python3 >= 3.10 and its venv module. A base that already
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
WORKDIR /opt/hsq
COPY pyproject.toml README.md ./
COPY hsq hsq
COPY workers workers
COPY producer producer
COPY sglang_server sglang_server
# The torch already there stays (no dependency may pull another, multi-GB build).
RUN python -c 'import torch; print("torch==" + torch.__version__)' > /tmp/torch.txt \
 && pip install --no-cache-dir --disable-pip-version-check -c /tmp/torch.txt . \
 && rm /tmp/torch.txt
