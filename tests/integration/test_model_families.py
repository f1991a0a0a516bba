"""Causal LMs of other families than the ones the project ships: the fast paths run only where they are the model's
own computation, and label probabilities are the model's own next-token probabilities (its full forward, no cache).

Each case was found by a bug hunt with tiny random models: packed attention on models its swap does not reach
(wrong answers or every pass failing), MPT's ALiBi after padded rows, the final logit step of Granite, Cohere and
Gemma 2 left out of label scores, and rows past a model's learned positions.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
import transformers as tf

from tests.tiny_model import build_tokenizer, scaled_up
from worker.engine.classifier import Classifier
from worker.engine.final_logits import final_logit_transform, final_step, head_problem
from worker.engine.loader import load_model
from worker.engine.task import Task
from worker.engine.types import ConfigError

TASK = Task(labels=("billing", "technical", "accounting"), instructions="Classify the ticket.")  # multi-token labels
TEXTS = ["I was charged twice", "x", "The app crashes when I open settings. " * 4, "Where is my parcel?"]
SMALL = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=2)


def _tiny(path, config_cls, model_cls, **fields):
    tok = build_tokenizer()
    torch.manual_seed(0)
    model = scaled_up(model_cls(config_cls(vocab_size=len(tok), pad_token_id=tok.pad_token_id, **fields)))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return load_model(str(path), torch.device("cpu"), torch.float32, path / "cache")


def _model_logp(clf: Classifier, items) -> np.ndarray:
    """Label log-probabilities from the model's own full forward of prompt + ticket + label, one at a time (log
    space: random tiny models saturate, and a probability of 0.99999 hides a wrong score)."""
    out = []
    for p in items:
        ctx = list(clf.template.prefix_ids + p.ids)
        row = []
        for seq in clf.scorer.labels.sequences:
            with torch.no_grad():
                logits = clf.model(input_ids=torch.tensor([ctx + list(seq[:-1])])).logits[0].double()
            logp = logits.log_softmax(-1)
            row.append(sum(logp[len(ctx) - 1 + k, t].item() for k, t in enumerate(seq)))
        out.append(np.array(row) - np.logaddexp.reduce(row))
    return np.array(out)


def _engine_logp(clf: Classifier, items) -> np.ndarray:
    got, _ = clf.classify(items)
    return np.log(np.array([[g.scores[k] for k in clf.labels] for g in got]))


@pytest.mark.parametrize(
    "name, config_cls, model_cls, fields",
    [
        # attention code outside transformers' registry: the packed stream would run as ONE sequence
        ("bloom", tf.BloomConfig, tf.BloomForCausalLM, dict(hidden_size=64, n_head=4, n_layer=2)),
        # decoder layers that drop the call's keyword arguments: every packed pass failed
        ("stablelm", tf.StableLmConfig, tf.StableLmForCausalLM, dict(SMALL, num_key_value_heads=2)),
    ],
)
def test_packed_attention_is_refused_where_the_swap_does_not_reach_the_models_attention(
    tmp_path, caplog, name, config_cls, model_cls, fields
):
    lm = _tiny(tmp_path / name, config_cls, model_cls, **fields)
    with caplog.at_level(logging.WARNING, logger="triage.engine"):
        clf = Classifier(lm, TASK, attention="packed")
    assert clf.attention == "padded" and clf.fast_paths.packed, clf.fast_paths
    assert "packed attention is off" in caplog.text
    items = clf.prepare_valid(TEXTS)
    assert np.abs(_engine_logp(clf, items) - _model_logp(clf, items)).max() < 1e-4


def test_packed_attention_stays_on_where_it_is_the_models_own(tmp_path):
    lm = _tiny(tmp_path / "qwen2", tf.Qwen2Config, tf.Qwen2ForCausalLM, **SMALL, num_key_value_heads=2)
    clf = Classifier(lm, TASK, attention="packed")
    assert clf.attention == "packed" and clf.fast_paths.packed is None
    items = clf.prepare_valid(TEXTS)
    assert np.abs(_engine_logp(clf, items) - _model_logp(clf, items)).max() < 1e-4


@pytest.mark.parametrize("attention", ["padded", "packed"])
def test_a_gemma3_checkpoint_loads_as_its_image_text_model_and_runs_on_its_text_config(tmp_path, attention):
    """``AutoModelForCausalLM`` loads a gemma3 checkpoint as ``Gemma3ForConditionalGeneration``, whose config keeps
    heads, windows and positions in ``text_config``: start-up refused it ("no attention heads (a state-space
    model?)"). Read from the text config, it runs the fast paths and gives the model's own probabilities."""
    tok = build_tokenizer()
    text = dict(SMALL, vocab_size=len(tok), pad_token_id=tok.pad_token_id, num_key_value_heads=2, head_dim=16)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28)
    cfg = tf.Gemma3Config(text_config=text, vision_config=dict(vision, patch_size=14), mm_tokens_per_image=4)
    torch.manual_seed(0)
    scaled_up(tf.Gemma3ForConditionalGeneration(cfg)).save_pretrained(tmp_path / "gemma3")
    tok.save_pretrained(tmp_path / "gemma3")
    lm = load_model(str(tmp_path / "gemma3"), torch.device("cpu"), torch.float32, tmp_path / "cache")
    assert type(lm.model).__name__ == "Gemma3ForConditionalGeneration"
    clf = Classifier(lm, TASK, attention=attention)
    assert clf.attention == attention and clf.use_prefix_cache  # the default 4,096-token window: rows fit in it
    items = clf.prepare_valid(TEXTS)
    assert np.abs(_engine_logp(clf, items) - _model_logp(clf, items)).max() < 1e-4


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_mpt_alibi_label_continuations_after_padded_rows_are_the_models(tmp_path, prefix_cache):
    """MPT's ALiBi counts key slots: a continuation after a shorter row's padding moved by up to 0.48 in log p."""
    lm = _tiny(tmp_path / "mpt", tf.MptConfig, tf.MptForCausalLM, d_model=64, n_heads=4, n_layers=2, max_seq_len=4096)
    clf = Classifier(lm, TASK, attention="padded", prefix_cache=prefix_cache)
    assert clf.scorer.needs_cache and "ALiBi" in clf.fast_paths.continuations_alone
    items = clf.prepare_valid(TEXTS)
    assert np.abs(_engine_logp(clf, items) - _model_logp(clf, items)).max() < 1e-4


@pytest.mark.parametrize(
    "name, config_cls, model_cls, fields",
    [
        ("granite", tf.GraniteConfig, tf.GraniteForCausalLM, dict(SMALL, num_key_value_heads=2, logits_scaling=4.0)),
        ("cohere", tf.CohereConfig, tf.CohereForCausalLM, dict(SMALL, num_key_value_heads=2, logit_scale=0.25)),
        (
            "gemma2",
            tf.Gemma2Config,
            tf.Gemma2ForCausalLM,
            dict(SMALL, num_key_value_heads=2, head_dim=16, attn_logit_softcapping=None, final_logit_softcapping=0.3),
        ),
    ],
)
def test_label_probabilities_include_the_models_final_logit_step(tmp_path, name, config_cls, model_cls, fields):
    """Scored on the raw LM head, Granite's label log p moved by up to 2.5, Cohere's 2.0, Gemma 2's 1.8."""
    lm = _tiny(tmp_path / name, config_cls, model_cls, **fields)
    assert head_problem(lm.model, None) is not None  # without its final step the head is not the model's logits
    assert head_problem(lm.model, final_logit_transform(lm.model.config)) is None
    clf = Classifier(lm, TASK, attention="padded")
    items = clf.prepare_valid(TEXTS)
    assert np.abs(_engine_logp(clf, items) - _model_logp(clf, items)).max() < 1e-4


@pytest.mark.parametrize("logit_scale", [0.5, "inv_sqrt_d_model"])
def test_a_final_step_the_config_names_but_the_model_never_applies_is_left_out(tmp_path, logit_scale):
    """MPT's config has a ``logit_scale`` its forward never uses: applied, label scores were not the model's; a
    value that is no number ("inv_sqrt_d_model", which MptConfig takes) failed the scorer with a traceback."""
    fields = dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=4096, logit_scale=logit_scale)
    lm = _tiny(tmp_path / "mpt", tf.MptConfig, tf.MptForCausalLM, **fields)
    assert final_step(lm.model) == (None, None)
    clf = Classifier(lm, TASK, attention="padded")
    items = clf.prepare_valid(TEXTS)
    assert np.abs(_engine_logp(clf, items) - _model_logp(clf, items)).max() < 1e-4


def test_rows_stay_within_a_models_learned_positions(tmp_path):
    """GPT-2 with 128 positions: a long ticket raised IndexError in its pass (a dead letter) instead of being cut."""
    lm = _tiny(tmp_path / "gpt2", tf.GPT2Config, tf.GPT2LMHeadModel, n_embd=64, n_head=4, n_layer=2, n_positions=128)
    clf = Classifier(lm, TASK)  # max_input_tokens 512 by default
    assert clf.prefix_length + clf.framing.max_row + clf.scorer.labels.max_continuation <= 128
    items = clf.prepare_valid(["short ticket", "Error 500 on login page " * 60])
    got, _ = clf.classify(items)
    assert [g.truncated for g in got] == [False, True]
    assert np.abs(_engine_logp(clf, items) - _model_logp(clf, items)).max() < 1e-4
    long_task = Task(labels=TASK.labels, instructions="Classify the ticket. " * 40)
    with pytest.raises(ConfigError, match="positions, leaving none for a ticket"):
        Classifier(lm, long_task)


def test_the_worker_names_the_task_when_its_prompt_leaves_no_room_for_a_ticket(tmp_path, triage_env):
    """Found while the model loads (after the preflight): the config_invalid line named TRIAGE_SCORER /
    TRIAGE_HEAD_PATH for every such error."""
    from tests.worker_proc import env_with, run_cli

    _tiny(tmp_path / "gpt2", tf.GPT2Config, tf.GPT2LMHeadModel, n_embd=64, n_head=4, n_layer=2, n_positions=64)
    env = env_with(triage_env, TRIAGE_MODEL=tmp_path / "gpt2", TRIAGE_SCORER="prompt", TRIAGE_LOG_FORMAT="json")
    r = run_cli(env, "run", "--drain", timeout_s=300)
    recs = [json.loads(x) for x in r.stderr.splitlines() if x.startswith("{")]
    (bad,) = [x for x in recs if x["event"] == "config_invalid"]
    assert r.returncode == 2 and bad["setting"] == "TRIAGE_TASK_FILE", recs
    assert "positions, leaving none for a ticket" in bad["error"] and "Traceback" not in r.stderr
