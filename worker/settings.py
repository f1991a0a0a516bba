"""The worker process's configuration: one pydantic-settings class, env prefix TRIAGE_.

Built once at start-up (``Settings()``), never at import, so tests and CLIs can
set env vars first.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

BUNDLED_MODEL = "bundled:smollm2"


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "triage"


def _default_consumer() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Settings(BaseSettings):
    """Every knob of the worker, engine and its Redis wiring (``TRIAGE_<NAME>``)."""

    model_config = SettingsConfigDict(env_prefix="TRIAGE_", extra="ignore", protected_namespaces=())

    # --- model / engine -------------------------------------------------
    model: str = Field(
        BUNDLED_MODEL,
        description="HF model id, local directory, .gguf file, or 'bundled:smollm2' (offline SmolLM2-135M-Instruct GGUF).",
    )
    device: Literal["auto", "cpu", "cuda", "mps"] = Field("auto", description="auto = CUDA, then MPS, then CPU.")
    dtype: Literal["auto", "fp16", "bf16", "fp32"] = Field("auto", description="auto = fp16 on GPU; on CPU bf16 if measured faster than fp32, else fp32.")
    torch_threads: int | Literal["auto"] = Field(
        "auto",
        description="Intra-op CPU threads: auto = 1 on hosts with <= 4 usable CPUs (measured 4-6x faster than torch's "
        "default on a busy 2-core box), else torch's default capped by a container CPU quota; 0 = torch's default; "
        "N = N. With several workers on one host, set cores / workers.",
    )
    cache_dir: Path = Field(default_factory=_default_cache_dir, description="Where converted GGUF weights are cached.")
    labels: str | None = Field(None, description="Comma-separated label names (overrides the default set).")
    task_file: Path | None = Field(None, description="YAML/JSON task: labels with descriptions, examples, instructions.")
    max_input_tokens: int = Field(512, ge=1, description="Ticket tokens beyond this are truncated (flagged).")
    truncate: bool = Field(True, description="Truncate long tickets (True) or reject them (False).")
    prefix_cache: bool = Field(True, description="Reuse the shared prompt prefix's KV cache across batches.")
    max_batch_items: int = Field(64, ge=1, description="Tickets drained per read and per forward pass at most.")
    max_batch_tokens: int = Field(8192, ge=1, description="Padded-token budget per forward pass (items x longest).")
    batch_overhead_tokens: int = Field(
        32, ge=0, description="Fixed cost of one forward call in token-equivalents; trades padding against more calls (raise on GPUs)."
    )
    scorer: Literal["auto", "prompt", "head"] = Field(
        "auto",
        description="'prompt' = label-token scoring; 'head' = the head in head_path; auto = head_path if set, else a centroid head fitted on the task's examples (one per label needed), else prompt.",
    )
    head_path: Path | None = Field(None, description="A scorer head fitted by `triage-worker fit`.")
    calibration: Literal["none", "contextual"] = Field("none", description="Prior correction of label scores.")
    confidence_threshold: float = Field(0.0, ge=0.0, le=1.0, description="Below this top probability the label becomes fallback_label.")
    fallback_label: str = Field("needs_review", description="Label written when the top probability is below confidence_threshold.")

    # --- redis wiring -----------------------------------------------------
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="redis:// or rediss:// (TLS); user:password@ supported, masked in logs.")
    input_stream: str = Field("triage:tickets", description="Stream tickets are read from.")
    results_stream: str = Field("triage:results", description="Stream results are appended to.")
    dead_letter_stream: str = Field("triage:dead", description="Stream rejected entries go to, with a reason.")
    result_key_prefix: str = Field("triage:result:", description="Latest result per ticket id is stored at prefix + id (JSON).")
    result_ttl_s: int = Field(86_400, ge=1, description="Expiry of the per-ticket result keys.")
    group: str = Field("triage", description="Consumer group; more workers in the same group share the stream.")
    consumer: str = Field(default_factory=_default_consumer, description="Consumer name, unique per process.")
    max_wait_ms: int = Field(50, ge=0, description="How long a drain waits to fill a batch.")
    claim_idle_ms: int = Field(60_000, ge=1, description="Reclaim entries idle this long from dead consumers.")
    max_deliveries: int = Field(5, ge=1, description="Entries delivered more often go to the dead-letter stream.")
    max_text_bytes: int = Field(65_536, ge=1, description="Hard cap on a ticket's raw text size.")
    results_maxlen: int = Field(1_000_000, ge=1, description="Approximate MAXLEN of the results stream.")
    dead_letter_maxlen: int = Field(100_000, ge=1, description="Approximate MAXLEN of the dead-letter stream.")
    heartbeat_key_prefix: str = Field("triage:heartbeat:", description="Heartbeat key = prefix + consumer (for healthcheck).")
    heartbeat_ttl_s: int = Field(30, ge=1, description="Heartbeat expiry; refreshed every third of it.")
    reconnect_max_s: float = Field(10.0, gt=0, description="Cap of the reconnect backoff after Redis errors.")

    # --- logs -------------------------------------------------------------
    log_format: Literal["auto", "json", "console"] = Field("auto", description="auto = console on a terminal, JSON otherwise.")
    log_level: str = Field("INFO", description="Log level for triage and libraries.")
    log_summary_s: float = Field(30.0, gt=0, description="Period of the summary log line.")

    @field_validator("torch_threads")
    @classmethod
    def _threads_not_negative(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 0:
            raise ValueError("must be 'auto', 0 (torch's default) or a positive number of threads")
        return v

    @field_validator("labels")
    @classmethod
    def _strip_labels(cls, v: str | None) -> str | None:
        if v is None or not v.strip():
            return None
        return v

    def label_list(self) -> list[str] | None:
        if self.labels is None:
            return None
        return [x.strip() for x in self.labels.split(",") if x.strip()]

    # --- stream worker (worker/stream) ------------------------------------
    prefetch: bool = Field(True, description="Read + tokenize the next window while the model runs the current one.")

    # --- RQ integration (worker.rqbatch) ----------------------------------
    rq_allowed_callbacks: str | None = Field(
        None,
        description="Comma-separated dotted paths of RQ on_success/on_failure/on_stopped callbacks the batch worker "
        "may run; a job naming any other callback fails without anything of it running.",
    )
