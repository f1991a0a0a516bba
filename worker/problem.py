"""One configuration problem: what to fix (an env var, ``file:line``) and why, secrets masked when shown."""

from __future__ import annotations

from dataclasses import dataclass

from worker.redact import mask_secrets


@dataclass(frozen=True)
class Problem:
    where: str  # the env var, or file:line
    message: str

    def __str__(self) -> str:
        return mask_secrets(f"{self.where}: {self.message}")
