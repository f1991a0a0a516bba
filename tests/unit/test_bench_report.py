"""The bench's header, settings record and table notes say what the classifier ran, not what the settings asked.

Stand-in classifiers (no model): on CUDA the engine plans with its own pass caps, a model's fast paths may refuse
the prefix cache, and mode 1 may run on a subsample; each of those once printed the settings' side instead.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from worker.bench import notes, report

HW = {
    "cpu_model": "x",
    "cpu_cores": 2,
    "torch_threads": 1,
    "device": "cuda",
    "device_name": "H200",
    "dtype": "fp16",
    "torch": "2",
    "transformers": "5",
}
MODEL = {
    "name": "m",
    "shape": {"layers": 2, "hidden": 8, "non_embedding_params": 1e6},
}
WORKLOAD = {"source": "s", "n": 4, "text_tokens": {"p50": 1, "p90": 2, "p99": 3, "max": 4}, "truncated": 0}


def _clf(settings, device: str = "cuda", use_prefix_cache: bool = True):
    """What ``report.run_settings`` reads of a classifier, with the options the builder gives it on ``device``."""
    import torch

    from worker.assemble import engine_options

    dev = torch.device(device)
    return SimpleNamespace(
        options=engine_options(settings, dev),
        device=dev,
        scorer=SimpleNamespace(kind="head"),
        attention="packed",
        attention_kernel="flash",
        use_prefix_cache=use_prefix_cache,
    )


def _header(settings, clf) -> tuple[dict, str]:
    rec = report.run_settings(settings, clf, fixed_batch=4)
    return rec, report.header(HW, MODEL, WORKLOAD, None, rec)


def test_on_cuda_the_passes_line_and_json_give_the_caps_the_engine_plans_with():
    """Settings() holds the CPU caps (64 / 8192); on CUDA the engine plans with 2048 / 32768 where they are unset."""
    from worker.assemble import GPU_PASS_DEFAULTS
    from worker.settings import Settings

    s = Settings()
    rec, text = _header(s, _clf(s))
    caps = (GPU_PASS_DEFAULTS["pass_max_items"], GPU_PASS_DEFAULTS["pass_max_tokens"])
    assert (rec["pass_max_items"], rec["pass_max_tokens"]) == caps != (s.pass_max_items, s.pass_max_tokens)
    assert f"pass_max_items {caps[0]}, pass_max_tokens {caps[1]}" in text
    # a cap set by hand is the engine's too
    s = Settings(pass_max_tokens=1000)
    rec, _ = _header(s, _clf(s))
    assert (rec["pass_max_items"], rec["pass_max_tokens"]) == (caps[0], 1000)


def test_the_prefix_cache_shown_is_the_classifiers():
    """A model whose fast paths refuse the cache runs without it (mode 5 says so): the header and JSON agree."""
    from worker.settings import Settings

    s = Settings()
    assert s.prefix_cache
    rec, text = _header(s, _clf(s, use_prefix_cache=False))
    assert rec["prefix_cache"] is False
    assert "prefix cache off (not for this model)" in text and "prefix cache on" not in text
    s = Settings(prefix_cache=False)
    rec, text = _header(s, _clf(s, use_prefix_cache=False))
    assert rec["prefix_cache"] is False and "prefix cache off (TRIAGE_PREFIX_CACHE=false)" in text
    rec, text = _header(Settings(), _clf(Settings()))
    assert rec["prefix_cache"] is True and "prefix cache on" in text


def test_mode6_records_the_classifiers_prefix_cache(monkeypatch):
    """redis.prefix_cache (what vs_mode5 is compared under) is the classifier's, not TRIAGE_PREFIX_CACHE."""
    from contextlib import nullcontext

    import worker.redis_server
    from worker.bench import redis_mode
    from worker.settings import Settings

    seen = {}

    def fake_run(settings, texts, dtype_name, refs, **kw):
        seen.update(kw)
        return {"prefix_cache": kw.get("prefix_cache", settings.prefix_cache), "items_per_s": None}

    monkeypatch.setattr(worker.redis_server, "redis_or_private", lambda url, **kw: nullcontext(url))
    monkeypatch.setattr(redis_mode, "run_redis", fake_run)
    red = redis_mode.mode6(Settings(), ["t"], "fp32", {}, [], prefix_cache=False)
    assert red["prefix_cache"] is False and seen["prefix_cache"] is False


def _runs(**subsamples):
    return {k: SimpleNamespace(subsample=v) for k, v in subsamples.items()}


@pytest.mark.parametrize(
    "runs, want",
    [
        (_runs(sequential=None, bucketed_cached=None), "ratios vs mode 1, same 20 tickets"),
        (
            _runs(sequential=5, bucketed_cached=None),
            "ratios vs mode 1 on the first 5 of 20 tickets (per-ticket rates)",
        ),
        (
            _runs(sequential=5, global_pad=12, arrival=12, bucketed=12, bucketed_cached=None),
            "ratios vs mode 1 on the first 5 of 20 tickets (per-ticket rates); modes 2,3,4 on the first 12",
        ),
        (_runs(bucketed_cached=None), "20 tickets (no mode 1: no ratios)"),
    ],
)
def test_the_ratio_line_says_when_mode_1_ran_a_subsample(runs, want):
    assert notes.ratio_note(runs, 20) == want
