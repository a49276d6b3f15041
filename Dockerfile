# hsq image for the CPU reference server and the worker/producer/exporter processes.
# GPU servers run SGLang's own image with hsq installed on top (see docs/).
FROM python:3.11-slim
WORKDIR /opt/hsq
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY pyproject.toml README.md ./
COPY hsq hsq
COPY workers workers
COPY producer producer
COPY sglang_server sglang_server
RUN pip install --no-cache-dir .
ENV PYTHONUNBUFFERED=1
