# dflash-serve images. Two targets:
#   gpu (the default, last stage): the official SGLang 0.5.23 image (CUDA 13; needs an r580+ driver) + this
#       package, installed without dependencies so SGLang's own CUDA stack is kept exactly as shipped.
#   cpu: python:3.11-slim + the CPU install path (scripts/install-cpu.sh: torch 2.13.0 CPU build, sglang 0.5.23
#       without GPU wheels, pinned pure-Python dependencies) + the bundled tiny model pair.
#
#   docker build -t dflash-serve:gpu .                # or: docker compose build
#   docker build -t dflash-serve:cpu --target cpu .   # or: docker compose --profile cpu build
#
# Both run `dflash-serve serve --config <file>`; deploy/configs/*-docker.yaml are the container configs
# (host 0.0.0.0). Both answer the HEALTHCHECK from SGLang's /health on DFLASH_HEALTH_URL.

ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23-cu130
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS cpu

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    DFLASH_HEALTH_URL=http://127.0.0.1:30000/health
WORKDIR /app

# torch first, from PyTorch's CPU index: on PyPI a plain torch==2.13.0 for Linux is the CUDA build (~2.7 GB of
# GPU wheels). The install script's own `torch==2.13.0` is then already satisfied by 2.13.0+cpu.
RUN python3 -m pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

# The CPU install path itself (idempotent): sglang --no-deps, pinned requirements, this package (editable, so the
# sources stay in /app), and the tiny model pair when the checkout does not carry one (see .dockerignore).
COPY . /app
RUN scripts/install-cpu.sh \
    && useradd --create-home --uid 1000 --user-group dflash \
    && python3 -c "import sglang_ext, service, dflash_models"

USER 1000:1000
EXPOSE 30000
HEALTHCHECK --interval=15s --timeout=5s --start-period=5m --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['DFLASH_HEALTH_URL'], timeout=4)"]
ENTRYPOINT ["dflash-serve"]
CMD ["serve", "--config", "/app/deploy/configs/cpu-docker.yaml"]

# ---------------------------------------------------------------------------------------------------------------
FROM ${SGLANG_IMAGE} AS gpu

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore \
    HF_HOME=/root/.cache/huggingface \
    DFLASH_HEALTH_URL=http://127.0.0.1:30000/health
WORKDIR /app

# --no-deps: the base image already holds sglang==0.5.23 with its CUDA dependencies; our own runtime deps
# (numpy, pydantic, pyyaml, prometheus-client; sglang-router's aiohttp, fastapi, orjson, setproctitle, uvicorn)
# are SGLang's too. The check fails the build if SGLang is another
# version or the plugin entry point did not register.
COPY pyproject.toml README.md /app/
COPY sglang_ext /app/sglang_ext
COPY service /app/service
COPY dflash_models /app/dflash_models
RUN python3 -m pip install --no-deps --break-system-packages /app sglang-router==0.3.2 \
    && python3 -c "import importlib.metadata as md; v = md.version('sglang'); assert v == '0.5.23', v; \
eps = [e.value for e in md.entry_points(group='sglang.srt.plugins') if e.name == 'dflash_serve']; \
assert eps == ['sglang_ext.plugin:register'], eps"
COPY deploy /app/deploy

EXPOSE 30000
# Loading an 8B model and capturing CUDA graphs takes minutes: the long start period keeps the container
# "starting" (not "unhealthy") meanwhile.
HEALTHCHECK --interval=30s --timeout=10s --start-period=20m --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['DFLASH_HEALTH_URL'], timeout=8)"]
ENTRYPOINT ["dflash-serve"]
CMD ["serve", "--config", "/app/deploy/configs/gpu-qwen3-8b-docker.yaml"]
