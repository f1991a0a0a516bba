"""Turn a task into token ids: one shared prefix + a per-ticket suffix.

The prefix (instructions, label descriptions, few-shot turns) and each suffix
(ticket text + answer cue) are tokenized separately and concatenated, so the
prefix-cached path and the uncached reference see identical token ids.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from worker.engine.pieces import encode_continuation
from worker.engine.task import Task

_SLOT = "\u2063TRIAGE_TICKET_SLOT\u2063"


@dataclass(frozen=True)
class PromptTemplate:
    prefix_ids: tuple[int, ...]
    tail_ids: tuple[int, ...]  # answer cue appended after every ticket's text
    label_lead: str  # prepended to a label name to form its answer tokens ("" after a chat turn, " " after "Category:")
    uses_chat_template: bool
    lead_ids: tuple[int, ...] = ()  # put before every ticket's text ([CLS] for an encoder; nothing for a causal LM)
    answer_end: str = ""  # what follows an answer in this prompt's format (the end of an assistant turn; "\n")


def system_text(task: Task) -> str:
    lines = [task.instructions, "", "Categories:"]
    for lab in task.labels:
        desc = task.descriptions.get(lab)
        lines.append(f"- {lab}: {desc}" if desc else f"- {lab}")
    return "\n".join(lines)


def build_template(tokenizer: PreTrainedTokenizerBase, task: Task) -> PromptTemplate:
    if getattr(tokenizer, "chat_template", None):
        prefix, tail = _chat_parts(tokenizer, task)
        lead, chat, end = "", True, _chat_answer_end(tokenizer, task)
    else:
        prefix, tail = _plain_parts(task)
        lead, chat, end = " ", False, "\n"
    prefix_ids = tuple(tokenizer(prefix, add_special_tokens=False)["input_ids"])
    if not chat and tokenizer.bos_token_id is not None:
        prefix_ids = (tokenizer.bos_token_id,) + prefix_ids
    tail_ids = encode_continuation(tokenizer, tail)  # it follows the ticket's text: no word-start marker
    return PromptTemplate(
        prefix_ids=prefix_ids, tail_ids=tail_ids, label_lead=lead, uses_chat_template=chat, answer_end=end
    )


# Templates that write the day into the prompt (Llama 3.x: "Today Date: ..." from strftime_now unless given
# date_string) would change the prefix daily: a head fitted yesterday refused ("prompt changed"), replicas started on
# different days running different prompts. Every render gets this fixed day (Llama's own fallback).
FIXED_DATE = "26 Jul 2024"


def _render(tokenizer: PreTrainedTokenizerBase, system: str, turns: list[dict], **kwargs) -> str:
    """The chat template applied to a system turn and ``turns``. A template that refuses a system turn (Gemma 1/2,
    Mistral v0.1/v0.2 raise) gets the system text at the head of the first user turn, as Gemma 3's folds it."""
    from jinja2.exceptions import TemplateError

    kwargs = {"tokenize": False, "date_string": FIXED_DATE, **kwargs}
    try:
        return tokenizer.apply_chat_template([{"role": "system", "content": system}, *turns], **kwargs)
    except TemplateError:
        first, *rest = turns
        folded = {**first, "content": f"{system}\n\n{first['content']}"}
        return tokenizer.apply_chat_template([folded, *rest], **kwargs)


def _chat_parts(tokenizer: PreTrainedTokenizerBase, task: Task) -> tuple[str, str]:
    turns = []
    for ex in task.examples:
        turns.append({"role": "user", "content": ex.text})
        turns.append({"role": "assistant", "content": ex.label})
    turns.append({"role": "user", "content": _SLOT})
    rendered = _render(tokenizer, system_text(task), turns, add_generation_prompt=True)
    if rendered.count(_SLOT) != 1:
        raise ValueError("chat template did not render the ticket slot exactly once")
    prefix, tail = rendered.split(_SLOT)
    return prefix, tail


def _chat_answer_end(tokenizer: PreTrainedTokenizerBase, task: Task) -> str:
    """What the chat template writes after an assistant's answer (``<|im_end|>\\n``); the EOS token if nothing."""
    turns = [{"role": "user", "content": "ticket"}, {"role": "assistant", "content": _SLOT}]
    try:
        rendered = _render(tokenizer, system_text(task), turns)
    except Exception:  # noqa: BLE001 - a template that refuses a closing assistant turn: fall back to EOS
        rendered = ""
    after = rendered.split(_SLOT, 1)[1] if rendered.count(_SLOT) == 1 else ""
    return after if after.strip() else (tokenizer.eos_token or "")


def _plain_parts(task: Task) -> tuple[str, str]:
    parts = [system_text(task), ""]
    for ex in task.examples:
        parts.append(f"Ticket:\n{ex.text}\nCategory: {ex.label}\n")
    parts.append("Ticket:\n")
    return "\n".join(parts), "\nCategory:"


def encoder_template(tokenizer: PreTrainedTokenizerBase) -> PromptTemplate:
    """An encoder sees ``[CLS] ticket [SEP]`` and nothing else: no instructions, no prefix to cache."""
    cls = tokenizer.cls_token_id if tokenizer.cls_token_id is not None else tokenizer.bos_token_id
    sep = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.eos_token_id
    return PromptTemplate(
        prefix_ids=(),
        tail_ids=(sep,) if sep is not None else (),
        label_lead="",
        uses_chat_template=False,
        lead_ids=(cls,) if cls is not None else (),
    )
