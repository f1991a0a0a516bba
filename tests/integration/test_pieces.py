"""A causal LM's row is the tokenization of its whole text, also for SentencePiece-style tokenizers.

Llama 2, Mistral and Phi-3 tokenizers mark the start of every text they are given as a word start. The ticket and
the answer cue are tokenized apart from the prompt (the prefix is shared and cached), so the model read
"Ticket:\\n refund me \\nCategory:": a space before the ticket and a lone "▁" token before the newline. Tiny
tokenizers of both kinds (a ``Metaspace`` pre-tokenizer, and the ``Prepend("▁")`` normalizer of converted Llama 2
files) with a tiny Llama; a byte-level tokenizer is left as it was.
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tests.tiny_model import _CORPUS, build_tokenizer, scaled_up
from worker.engine.classifier import Classifier
from worker.engine.loader import load_model
from worker.engine.pieces import continuation_backend
from worker.engine.prompt import _plain_parts
from worker.engine.task import default_task

TICKETS = ["refund me", "The app crashes. Error 500", "where is my package?", "  two leading spaces"]


def _sentencepiece_like(kind: str) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    if kind == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    else:  # Llama 2's converted tokenizer.json
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=520, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(_CORPUS * 4 + ["Ticket:\nCategory:\n"], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )


@pytest.mark.parametrize("kind", ["metaspace", "prepend"])
def test_ticket_and_answer_cue_are_tokenized_as_in_the_whole_text(tmp_path, kind):
    tok = _sentencepiece_like(kind)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )
    scaled_up(LlamaForCausalLM(cfg)).save_pretrained(tmp_path / "llama")
    tok.save_pretrained(tmp_path / "llama")
    lm = load_model(str(tmp_path / "llama"), torch.device("cpu"), torch.float32, tmp_path / "cache")
    clf = Classifier(lm, default_task(with_examples=False))
    assert not clf.template.uses_chat_template  # the plain prompt: "...Ticket:\n" + ticket + "\nCategory:"
    prefix, cue = _plain_parts(clf.task)  # the prompt's text around the ticket
    for ticket, item in zip(TICKETS, clf.prepare_valid(TICKETS)):
        whole = tok(prefix + ticket + cue, add_special_tokens=False)["input_ids"]
        assert list(clf.template.prefix_ids) + list(item.ids) == [tok.bos_token_id, *whole], ticket
    assert tok.convert_ids_to_tokens(list(clf.template.tail_ids))[0] == "\n"  # no lone "▁" before it
    items = clf.prepare_valid(TICKETS)
    batched, reference = clf.classify(items)[0], clf.reference(items)
    assert [p.label for p in batched] == [p.label for p in reference]


def test_a_byte_level_tokenizer_is_left_as_it_is():
    assert continuation_backend(build_tokenizer().backend_tokenizer) is None
