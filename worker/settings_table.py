"""Print the worker's settings as a Markdown table (``python -m worker.settings_table``), for the README."""

from __future__ import annotations

from worker.settings import Settings


def markdown_table() -> str:
    rows = ["| env var | default | meaning |", "| --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        default = field.default if field.default_factory is None else "(computed)"
        if name == "cache_dir":
            default = "~/.cache/triage"
        elif name == "consumer":
            default = "hostname-pid"
        rows.append(f"| `TRIAGE_{name.upper()}` | `{default}` | {field.description or ''} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
