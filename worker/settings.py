"""The worker process's configuration: one pydantic-settings class, env prefix TRIAGE_.

Built once at start-up (``Settings()``), never at import, so tests and CLIs can
set env vars first.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from worker.engine.constants import BUNDLED_MODEL
from worker.redact import masked_repr_args

ENV_PREFIX = "TRIAGE_"
# Old name -> what replaced it. Still read (the new names win); start-up logs a warning (worker.assemble).
DEPRECATED_ENV = {
    "TRIAGE_MAX_BATCH_ITEMS": "TRIAGE_WINDOW_MAX_ITEMS and TRIAGE_PASS_MAX_ITEMS",
    "TRIAGE_MAX_BATCH_TOKENS": "TRIAGE_PASS_MAX_TOKENS",
    "TRIAGE_BATCH_OVERHEAD_TOKENS": "TRIAGE_PASS_OVERHEAD_TOKENS",
}


def _env(name: str, deprecated: str) -> AliasChoices:
    """Read ``TRIAGE_<name>``, else the deprecated ``TRIAGE_<deprecated>`` (keyword arguments use the field name)."""
    return AliasChoices(ENV_PREFIX + name, ENV_PREFIX + deprecated)


def deprecated_env_in_use(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The deprecated variables set in ``environ`` (default: the process env), each with its replacement."""
    names = {k.upper() for k in (os.environ if environ is None else environ)}
    return {old: new for old, new in DEPRECATED_ENV.items() if old in names}


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "triage"


def _default_consumer() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def _auto_or_at_least(floor: int, expected: str):
    """A field validator for ``int | "auto"`` settings: numbers below ``floor`` are refused with what is expected."""

    def check(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < floor:
            raise ValueError(f"must be {expected}")
        return v

    return classmethod(check)


# Upper bounds Redis accepts (an expiry past them is "ERR invalid expire time" at every settle write, which then
# retried forever, each try adding its results again) and a bulk string's size; far above any sensible value.
MAX_SECONDS = 2**31 - 1  # ~68 years
MAX_MS = 2**31 - 1  # ~24.8 days
MAX_BYTES = 512 * 2**20  # Redis' largest string
MAX_COUNT = 2**63 - 1


class Settings(BaseSettings):
    """Every knob of the worker, engine and its Redis wiring (``TRIAGE_<NAME>``)."""

    model_config = SettingsConfigDict(
        # allow_inf_nan=False: every float setting is finite (TRIAGE_RECONNECT_MAX_S=inf would never retry)
        env_prefix=ENV_PREFIX,
        extra="ignore",
        protected_namespaces=(),
        validate_by_name=True,
        allow_inf_nan=False,
    )

    # --- model / engine -------------------------------------------------
    model: str = Field(
        BUNDLED_MODEL,
        description="HF model id, local directory, .gguf file, 'bundled:smollm2' (offline SmolLM2-135M-Instruct "
        "GGUF) or 'bundled:minilm' (offline all-MiniLM-L6-v2 encoder: needs a head). Causal LM or BERT-family "
        "encoder, read from its config.",
    )
    device: Literal["auto", "cpu", "cuda", "mps"] = Field("auto", description="auto = CUDA, then MPS, then CPU.")
    dtype: Literal["auto", "fp16", "bf16", "fp32"] = Field(
        "auto",
        description="auto = fp16 on GPU (bf16, else fp32, where the model's outputs over a probe sentence at load "
        "overflow fp16); on CPU bf16 if measured faster than fp32, else fp32.",
    )
    torch_threads: int | Literal["auto"] = Field(
        "auto",
        description="Intra-op CPU threads: auto = 1 on hosts with <= 4 usable CPUs (measured 4-6x faster than torch's "
        "default on a busy 2-core box), else torch's default capped by a container CPU quota; 0 = torch's default; "
        "N = N. With several workers on one host, set cores / workers.",
    )
    tokenize_threads: int | Literal["auto"] = Field(
        "auto",
        description="Threads that tokenize a window (the tokenizers library's pool, outside the interpreter lock): "
        "auto = the usable CPUs (affinity and container quota); 1 = no pool; N = N.",
    )
    cache_dir: Path = Field(default_factory=_default_cache_dir, description="Where converted GGUF weights are cached.")
    labels: str | None = Field(None, description="Comma-separated label names (overrides the default set).")
    task_file: Path | None = Field(
        None, description="YAML/JSON task: labels with descriptions, examples, instructions (empty: unset)."
    )
    max_input_tokens: int = Field(512, ge=1, description="Ticket tokens beyond this are truncated (flagged).")
    truncate: bool = Field(True, description="Truncate long tickets (True) or reject them (False).")
    prefix_cache: bool = Field(True, description="Reuse the shared prompt prefix's KV cache across passes.")
    # A window is one drain of the input stream; a pass is one forward call over a length bucket of it.
    window_max_items: int = Field(
        256,
        ge=1,
        validation_alias=_env("WINDOW_MAX_ITEMS", "MAX_BATCH_ITEMS"),
        description="Tickets drained from the stream per window at most (split into passes by length; CUDA default "
        "4096 when unset).",
    )
    window_target_s: float = Field(
        0.0,
        ge=0,
        description="Size each window to about this many seconds of the model's measured work, up to "
        "TRIAGE_WINDOW_MAX_ITEMS, so replicas share a backlog and a warm stop is short (deploy/k8s sets 5, "
        "docker-compose.yml 10); 0: always TRIAGE_WINDOW_MAX_ITEMS.",
    )
    window_ramp_items: int = Field(
        256,
        ge=0,
        description="A window takes at most twice the tickets of the one before, and this many after start-up or an "
        "empty read, so the model starts on a burst after a few hundred tickets are read and tokenized, not "
        "thousands; 0: no ramp.",
    )
    pass_max_items: int = Field(
        64,
        ge=1,
        validation_alias=_env("PASS_MAX_ITEMS", "MAX_BATCH_ITEMS"),
        description="Tickets per forward pass at most (CUDA default 2048 when unset).",
    )
    pass_max_tokens: int = Field(
        8192,
        ge=1,
        validation_alias=_env("PASS_MAX_TOKENS", "MAX_BATCH_TOKENS"),
        description="Token budget per forward pass: padded (items x longest) for padded passes, real tokens for "
        "packed ones. CUDA default 32768 when unset.",
    )
    pass_overhead_tokens: int | Literal["auto"] = Field(
        32,
        validation_alias=_env("PASS_OVERHEAD_TOKENS", "BATCH_OVERHEAD_TOKENS"),
        description="Fixed cost of one forward call in token-equivalents; trades padding against more calls "
        "(padded passes; CUDA default 2048 when unset). auto = measured at start-up off CUDA (the same row timed "
        "alone and 4 to a pass): pays for small, fast models such as bundled:minilm.",
    )
    attention: Literal["auto", "padded", "packed"] = Field(
        "auto",
        description="auto = packed on CUDA (one unpadded token stream per pass, shared prefix K/V merged by "
        "log-sum-exp), padded length buckets on CPU/MPS.",
    )
    cuda_graphs: bool = Field(
        True, description="Replay packed passes as CUDA graphs (a few fixed shapes; CUDA + packed only)."
    )
    pass_lookahead: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Queue the next pass, and at a window's end the next window's first, before reading the current "
        "one back, so the device never waits for the host's per-pass work. auto = on CUDA (elsewhere a pass has run "
        "when it is launched: nothing to overlap).",
    )
    cuda_graph_warm_up: bool = Field(
        True,
        description="Capture the CUDA graphs of full passes at start-up (about 10 shapes, before worker_ready), not "
        "in the first busy windows.",
    )
    scorer: Literal["auto", "prompt", "head"] = Field(
        "auto",
        description="'prompt' = label-token scoring (causal LM only); 'head' = the head in head_path; auto = "
        "head_path if set, else the head shipped for the built-in support task and this model (worker/heads), else "
        "a centroid head fitted on the task's examples (one per label needed), else prompt.",
    )
    head_path: Path | None = Field(None, description="A scorer head fitted by `triage-worker fit` (empty: unset).")
    head_prompt: Literal["labels", "task"] = Field(
        "labels",
        description="Prompt around each ticket when a head scores it: 'labels' = instructions + label names (short, "
        "measured as good or better), 'task' = the full task prompt (descriptions, examples). Recorded in head files.",
    )
    encoder: str | None = Field(
        None,
        description="Joined features: an encoder (e.g. 'bundled:minilm') run on the same passes as TRIAGE_MODEL; "
        "a head scores the LM's states and the encoder's embedding together.",
    )
    calibration: Literal["none", "contextual"] = Field("none", description="Prior correction of label scores.")
    confidence_threshold: float = Field(
        0.0, ge=0.0, le=1.0, description="Below this top probability the label becomes fallback_label."
    )
    fallback_label: str = Field(
        "needs_review", description="Label written when the top probability is below confidence_threshold."
    )

    # --- redis wiring -----------------------------------------------------
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0", description="redis:// or rediss:// (TLS); user:password@ supported, masked in logs."
    )
    input_stream: str = Field("triage:tickets", description="Stream tickets are read from.")
    results_stream: str = Field("triage:results", description="Stream results are appended to.")
    dead_letter_stream: str = Field("triage:dead", description="Stream rejected entries go to, with a reason.")
    result_key_prefix: str = Field(
        "triage:result:", description="Latest result per ticket id is stored at prefix + id (JSON)."
    )
    result_ttl_s: int = Field(86_400, ge=1, le=MAX_SECONDS, description="Expiry of the per-ticket result keys.")
    group: str = Field("triage", description="Consumer group; more workers in the same group share the stream.")
    consumer: str = Field(default_factory=_default_consumer, description="Consumer name, unique per process.")
    max_wait_ms: int = Field(50, ge=0, le=MAX_MS, description="How long a drain waits to fill a window.")
    claim_idle_ms: int = Field(
        60_000, ge=1, le=MAX_MS, description="Reclaim entries idle this long from dead consumers."
    )
    max_deliveries: int = Field(5, ge=1, description="Entries delivered more often go to the dead-letter stream.")
    max_text_bytes: int = Field(65_536, ge=1, le=MAX_BYTES, description="Hard cap on a ticket's raw text size.")
    results_maxlen: int = Field(1_000_000, ge=1, le=MAX_COUNT, description="Approximate MAXLEN of the results stream.")
    dead_letter_maxlen: int = Field(
        100_000, ge=1, le=MAX_COUNT, description="Approximate MAXLEN of the dead-letter stream."
    )
    heartbeat_key_prefix: str = Field(
        "triage:heartbeat:", description="Heartbeat key = prefix + consumer (for healthcheck)."
    )
    heartbeat_ttl_s: int = Field(30, ge=1, le=MAX_SECONDS, description="Heartbeat expiry; refreshed every third of it.")
    reconnect_max_s: float = Field(10.0, gt=0, description="Cap of the reconnect backoff after Redis errors.")

    # --- metrics (worker/observability/prometheus.py) ----------------------
    metrics_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Serve Prometheus metrics on this port at /metrics (0 = off; 9108 is the documented choice).",
    )
    metrics_host: str = Field("0.0.0.0", description="Address the metrics server binds (127.0.0.1 = this host only).")

    # --- logs -------------------------------------------------------------
    log_format: Literal["auto", "json", "console"] = Field(
        "auto", description="auto = console on a terminal, JSON otherwise."
    )
    log_level: str = Field(
        "INFO", description="Log level for triage and libraries: DEBUG, INFO, WARNING, ERROR or CRITICAL (any case)."
    )
    log_summary_s: float = Field(30.0, gt=0, description="Period of the summary log line.")

    _torch_threads_valid = field_validator("torch_threads")(
        _auto_or_at_least(0, "'auto', 0 (torch's default) or a positive number of threads")
    )
    _tokenize_threads_valid = field_validator("tokenize_threads")(
        _auto_or_at_least(1, "'auto' or a positive number of threads")
    )
    _pass_overhead_valid = field_validator("pass_overhead_tokens")(
        _auto_or_at_least(0, "'auto' or a number of tokens >= 0")
    )

    def __repr_args__(self):
        """``repr``/``str`` with the Redis URL's password masked: a log line that formats the settings printed it."""
        return masked_repr_args(super().__repr_args__())

    @field_validator("labels")
    @classmethod
    def _strip_labels(cls, v: str | None) -> str | None:
        if v is None or not v.strip():
            return None
        return v

    @field_validator("task_file", "head_path", mode="before")
    @classmethod
    def _empty_path_is_unset(cls, v):
        """``TRIAGE_HEAD_PATH=`` (a blank .env line) means unset, as for TRIAGE_LABELS and TRIAGE_ENCODER; it used
        to become ``Path('.')``, a directory."""
        if v is None or (isinstance(v, str) and not v.strip()):
            return None
        return v

    @field_validator(
        "model",
        "input_stream",
        "results_stream",
        "dead_letter_stream",
        "result_key_prefix",
        "group",
        "consumer",
        "heartbeat_key_prefix",
        "fallback_label",
    )
    @classmethod
    def _not_empty(cls, v: str) -> str:
        """Names with a default: empty is a mistake, not "unset" (an empty TRIAGE_RESULT_KEY_PREFIX would let a
        ticket id name any key; an empty TRIAGE_CONSUMER made the heartbeat key the bare prefix)."""
        if not v.strip():
            raise ValueError("must not be empty or blank (unset the variable for the default)")
        return v

    @field_validator("read_max_bytes")
    @classmethod
    def _read_holds_a_ticket(cls, v: int | None, info) -> int | None:
        """A budget below one ticket of the largest size is a unit slip (KiB for bytes), not a choice: every window
        would hold one ticket."""
        limit = info.data.get("max_text_bytes")
        if v is not None and v < (limit or 1):
            raise ValueError(f"must be a number of bytes of at least TRIAGE_MAX_TEXT_BYTES ({limit or 1})")
        return v

    @field_validator("log_level")
    @classmethod
    def _known_log_level(cls, v: str) -> str:
        level = v.strip().upper()
        if level == "WARN":
            level = "WARNING"
        if level not in LOG_LEVELS:
            raise ValueError(f"must be one of {', '.join(LOG_LEVELS)} (any case)")
        return level

    def label_list(self) -> list[str] | None:
        if self.labels is None:
            return None
        return [x.strip() for x in self.labels.split(",") if x.strip()]

    # --- stream worker (worker/stream) ------------------------------------
    prefetch: bool = Field(True, description="Read + tokenize the next window while the model runs the current one.")
    dead_letter_excerpt_bytes: int = Field(
        4096,
        ge=256,
        description="A dead letter keeps at most this many bytes of the entry's fields (plus their size "
        "and SHA-256), not the whole payload.",
    )
    read_max_bytes: int | None = Field(
        None,
        description="Bytes of entries (field names + values) one window reads from Redis at most, measured in Redis "
        "before anything is sent (at least one entry per read); an entry over 2 x TRIAGE_MAX_TEXT_BYTES + 4096 comes "
        "as its size and first bytes only and is dead-lettered, never read whole. Unset: the tickets a window asks "
        "for x TRIAGE_MAX_TEXT_BYTES, at most 64 MiB (a read holds Redis ~2 ms per MB).",
    )
    drain_redis_timeout_s: float = Field(
        30.0,
        gt=0,
        description="--drain only: give up with exit code 3 when Redis cannot be reached at start-up for this long "
        "(run mode waits for Redis as long as it takes).",
    )
    input_trim: bool = Field(
        True,
        description="Each write trims the input stream below the oldest entry any consumer group still needs "
        "(XTRIM MINID ~), so acknowledged tickets do not pile up; false: they stay until you trim.",
    )

    # --- RQ integration (worker.rqbatch) ----------------------------------
    rq_allowed_callbacks: str | None = Field(
        None,
        description="Comma-separated dotted paths of RQ on_success/on_failure/on_stopped callbacks the batch worker "
        "may run; a job naming any other callback fails without anything of it running.",
    )


def settings_to_env(settings: Settings) -> dict[str, str]:
    """Every field that was set, as the ``TRIAGE_*`` variable a child process reads back into equal settings.

    Fields left at their defaults stay unset in the child too, so defaults that depend on the device
    (``GPU_PASS_DEFAULTS``, ``GPU_WINDOW_MAX_ITEMS``) apply there as they do here; fields that are ``None``
    are left out. Secrets go into the returned mapping as plain text: hand it to the child's environment,
    never to a log.
    """
    env: dict[str, str] = {}
    for name, field in Settings.model_fields.items():
        value = getattr(settings, name)
        if value is None or name not in settings.model_fields_set:
            continue
        alias = field.validation_alias
        key = str(alias.choices[0]) if isinstance(alias, AliasChoices) else ENV_PREFIX + name.upper()
        env[key] = _env_value(value)
    return env


def _env_value(value: Any) -> str:
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return json.dumps(sorted(value) if isinstance(value, (set, frozenset)) else value)
    return str(value)
