"""Print the worker's settings as a Markdown table (``python -m worker.settings_table``), for the README."""

from __future__ import annotations

from pydantic import AliasChoices

from worker.settings import ENV_PREFIX, Settings


def markdown_table() -> str:
    rows = ["| env var | default | meaning |", "| --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        default = field.default if field.default_factory is None else "(computed)"
        if name == "cache_dir":
            default = "$XDG_CACHE_HOME/triage, else ~/.cache/triage"
        elif name == "consumer":
            default = "hostname-pid"
        meaning = field.description or ""
        alias = field.validation_alias
        if isinstance(alias, AliasChoices) and len(alias.choices) > 1:
            meaning += " Deprecated alias: " + ", ".join(f"`{old}`" for old in alias.choices[1:]) + "."
        rows.append(f"| `{ENV_PREFIX}{name.upper()}` | `{default}` | {meaning} |")
    return "\n".join(rows)


if __name__ == "__main__":
    try:
        print(markdown_table())
    except BrokenPipeError:  # `python -m worker.settings_table | head`: the reader left, not an error
        import os
        import sys

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error as Python flushes at exit
