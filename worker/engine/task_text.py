"""Task text a causal LM's prompt cannot hold, and task examples an encoder cannot read.

Tickets are tokenized with ``split_special_tokens`` ("<|im_end|>" typed in one is text). The task's own text
(instructions, labels, descriptions, few-shot examples) is rendered into the chat template and tokenized with the
template's control tokens, so there the same string would be a real turn boundary, and a label named by one would be
scored as the end-of-turn token. Such text is refused when the classifier is built, naming the piece: tokenizing the
pieces apart would change the prompt's ids for ordinary text too. An encoder sees no prompt, only ``[CLS] example
[SEP]``, so its task text is not checked; an example it keeps nothing of is left out of the start-up head instead.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from worker.engine.task import Task
from worker.engine.types import ConfigError, InvalidTicket, Prepared, unicode_problem

log = logging.getLogger("triage.task")


class TaskTextError(ConfigError):
    """Task text the model cannot take; ``setting`` names where the task came from (TRIAGE_TASK_FILE, ...)."""

    def __init__(self, setting: str | None, text: str):
        super().__init__(f"{setting}: {text}" if setting else text, setting=setting)
        self.text = text


def control_strings(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    """The strings the tokenizer reads as one special token outside ``split_special_tokens``: its named special
    tokens and every added token marked special (ChatML's ``<|im_start|>`` is only the latter). Blank ones are left
    out: no text could avoid them."""
    found = set(getattr(tokenizer, "all_special_tokens", None) or ())
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            found.add(str(tok.content))
    return tuple(sorted((s for s in found if s.strip()), key=lambda s: (-len(s), s)))


def held(text: str, strings: Sequence[str]) -> str | None:
    """The one of ``strings`` that occurs first in ``text`` (the longest there), if any."""
    at = {s: i for s in strings if (i := text.find(s)) >= 0}
    return min(at, key=lambda s: (at[s], -len(s))) if at else None


def _quoted(text: str, most: int = 60) -> str:
    return repr(text if len(text) <= most else text[: most - 3] + "...")


def _example(i: int, ex) -> str:
    return f"example {i} (label {_quoted(ex.label, 40)}: {_quoted(ex.text)})"


def _pieces(task: Task) -> Iterator[tuple[str, str]]:
    yield "the instructions", task.instructions
    for i, lab in enumerate(task.labels, 1):
        yield f"label {i} ({_quoted(lab)})", lab
        if desc := task.descriptions.get(lab):
            yield f"the description of label {_quoted(lab)}", desc
    for i, ex in enumerate(task.examples, 1):
        yield _example(i, ex), ex.text


def task_text_problem(task: Task, strings: Sequence[str]) -> str | None:
    """Why ``task`` cannot be written into a prompt whose tokenizer reads ``strings`` as control tokens (None: it
    can), naming the first piece that holds one, or that is not valid Unicode (no tokenizer takes it)."""
    for what, text in _pieces(task):
        if (why := unicode_problem(text, what)) is not None:
            return why
        if (s := held(text, strings)) is not None:
            return (
                f"{what} holds {s!r}, a control token of the model's tokenizer: in the prompt it would be that token, "
                "not text (a ticket's is read as text); remove or reword it"
            )
    return None


def check_task_text(loaded, task: Task, setting: str | None, origin: str | None = None) -> None:
    """``TaskTextError`` when a causal LM's prompt cannot hold ``task``'s text (``task_text_problem``); ``origin``:
    the task file, named in the message."""
    if loaded.kind != "decoder":
        return
    why = task_text_problem(task, control_strings(loaded.tokenizer))
    if why is not None:
        raise TaskTextError(setting, f"{origin}: {why}" if origin else why)


def model_control_strings(name: str, cache_dir: Path) -> tuple[str, ...]:
    """``control_strings`` of model ``name``'s tokenizer, loaded alone (a GGUF file is converted once, as the worker
    would); none for an encoder, whose task text enters no prompt. What ``fit --examples-out`` keeps out of a task
    file, so the worker never refuses one it wrote."""
    from transformers import AutoTokenizer

    from worker.engine.loader import resolve_source
    from worker.engine.sources import declared_kind, go_offline_if_local

    if declared_kind(name) == "encoder":
        return ()
    go_offline_if_local(name)
    source = resolve_source(name, cache_dir)
    return control_strings(AutoTokenizer.from_pretrained(source, local_files_only=os.path.isdir(source)))


def usable_examples(task: Task, items: Sequence[Prepared | InvalidTicket], setting: str | None) -> list[int]:
    """Indices of the examples the model can read (``items``: ``prepare`` of their texts). One it cannot (an encoder
    keeps nothing of "\\u200b") is left out, logged; ``TaskTextError`` when it was its label's only example, as a
    head fitted on the examples needs one per label."""
    keep = [i for i, p in enumerate(items) if not isinstance(p, InvalidTicket)]
    shown = {task.examples[i].label for i in keep}
    for i, (ex, p) in enumerate(zip(task.examples, items), 1):
        if not isinstance(p, InvalidTicket):
            continue
        if ex.label not in shown:
            raise TaskTextError(
                setting,
                f"{_example(i, ex)} cannot be read by the model: {p}; it is the only usable example of its label, "
                "and a head fitted on the task's examples needs one per label (reword it, or add another)",
            )
        log.warning("task_example_skipped", extra={"example": i, "label": ex.label, "why": str(p)})
    return keep
