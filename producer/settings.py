"""The producer process's configuration: one pydantic-settings class, env prefix TRIAGE_.

The Redis names default to the worker's (``worker.settings.Settings``) so a
producer and a worker started with the same environment meet on the same
streams. Built by callers (``ProducerSettings()``), never at import.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from worker.redact import masked_repr_args


class ProducerSettings(BaseSettings):
    """Where tickets go, where results come from, and how hard to push (``TRIAGE_<NAME>``)."""

    model_config = SettingsConfigDict(env_prefix="TRIAGE_", extra="ignore", allow_inf_nan=False)

    redis_url: str = "redis://127.0.0.1:6379/0"
    input_stream: str = "triage:tickets"
    results_stream: str = "triage:results"
    dead_letter_stream: str = "triage:dead"
    result_key_prefix: str = "triage:result:"
    group: str = Field("triage", description="The worker's consumer group; its lag + pending entries are the backlog.")

    # --- backpressure ----------------------------------------------------
    input_max_backlog: int = Field(
        100_000,
        ge=0,
        description="Most tickets allowed to wait (not yet classified) in the input stream; 0 = no limit.",
    )
    backpressure: Literal["block", "refuse"] = Field(
        "block",
        description="At the limit: 'block' waits for the worker to catch up, 'refuse' raises BacklogFull at once.",
    )
    backpressure_timeout_s: float = Field(60.0, gt=0, description="How long 'block' waits before raising BacklogFull.")
    submit_chunk_size: int = Field(500, ge=1, description="Tickets per pipelined round trip (and per backlog check).")

    # --- waiting for results -----------------------------------------------
    wait_poll_max_ms: int = Field(500, ge=1, description="Longest pause between result checks while waiting.")

    def __repr_args__(self):
        """``repr``/``str`` with the URL's password masked: an integrator's log line that formats the settings
        printed it in clear."""
        return masked_repr_args(super().__repr_args__())

    @field_validator("redis_url", "input_stream", "results_stream", "dead_letter_stream", "result_key_prefix", "group")
    @classmethod
    def _not_empty(cls, v: str) -> str:
        """As the worker's: empty is a mistake, not "unset" (an empty TRIAGE_RESULT_KEY_PREFIX would read a bare ticket
        id as its result key)."""
        if not v.strip():
            raise ValueError("must not be empty or blank (unset the variable for the default)")
        return v
