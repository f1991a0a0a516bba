"""Which fast paths a model config allows (pure: configs as plain objects)."""

from __future__ import annotations

from types import SimpleNamespace as Config

from worker.engine.exactness import fast_paths
from worker.engine.verify import VerifyReport


def test_full_attention_everywhere_keeps_every_fast_path():
    assert fast_paths(Config(layer_types=["full_attention"] * 2, sliding_window=None), 10_000) == fast_paths(
        Config(), 10_000
    )
    assert fast_paths(Config(), 10_000).prefix_cache is None


def test_a_window_binds_only_when_a_row_outgrows_it():
    mistral = Config(sliding_window=4096)  # no per-layer kinds: the window applies to every layer
    assert fast_paths(mistral, 800).prefix_cache is None
    tight = fast_paths(mistral, 5000)
    assert "4096-token window" in tight.prefix_cache and tight.packed and tight.continuations_alone
    gemma3 = Config(layer_types=["sliding_attention", "full_attention"], sliding_window=512)
    assert fast_paths(gemma3, 770).prefix_cache and fast_paths(gemma3, 500).prefix_cache is None


def test_a_window_switched_off_is_no_window():
    qwen2 = Config(sliding_window=4096, use_sliding_window=False)
    assert fast_paths(qwen2, 10_000).prefix_cache is None


def test_an_unknown_layer_kind_turns_the_fast_paths_off():
    hybrid = Config(layer_types=["linear_attention", "full_attention"])
    assert "linear_attention" in fast_paths(hybrid, 10).prefix_cache


def test_soft_capped_logits_rule_out_packed_attention_only():
    gemma2 = Config(
        layer_types=["sliding_attention", "full_attention"], sliding_window=4096, attn_logit_softcapping=50.0
    )
    paths = fast_paths(gemma2, 800)
    assert paths.prefix_cache is None and "soft-caps" in paths.packed


def _report(dtype: str, delta: float) -> VerifyReport:
    return VerifyReport(
        n=10,
        dtype=dtype,
        device="cpu",
        prefix_cache=True,
        agreement_pct=100.0,
        max_abs_delta_prob=delta,
        padding_pct=0.0,
        passes=1,
        batched_items_per_s=1.0,
        reference_items_per_s=1.0,
        speedup=1.0,
    )


def test_fp32_verify_fails_on_a_moved_probability_even_without_a_flipped_label():
    assert _report("fp32", 2.4e-6).passed(0.05)
    assert not _report("fp32", 4e-3).passed(0.05)
    assert _report("bf16", 4e-3).passed(0.05)  # lower precision: only flips count
