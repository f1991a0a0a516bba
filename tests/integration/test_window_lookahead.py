"""Lookahead across windows (CUDA's default, ``TRIAGE_PASS_LOOKAHEAD=on`` here on the CPU): a real worker drains
a real stream; a window's first pass is queued while the window before finishes, and nothing changes but when."""

from __future__ import annotations

import uuid

import redis

from tests.worker_proc import delete_keys, env_with, outcomes, start_worker

TEXTS = [
    "I was charged twice for invoice {}, please refund me",
    "the app crashes on start, build {}",
    "{}",
    "where is parcel {}? tracking has not moved for a week and the seller does not answer my messages",
    "cannot log in to account {}",
    "",  # no text: dead-lettered, its neighbours classified
]
N = 72


def _drain(env: dict, redis_url: str, lookahead: str, **more: object):
    """Push the same N tickets, drain them with ``run --drain``: stream id order -> outcome, and the window lines."""
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    texts = [TEXTS[i % len(TEXTS)].format(i) for i in range(N)]
    ids = [r.xadd(env["TRIAGE_INPUT_STREAM"], {"id": f"la-{i}", "text": text}) for i, text in enumerate(texts)]
    with start_worker(env_with(env, TRIAGE_PASS_LOOKAHEAD=lookahead, **more), "run", "--drain", ready=False) as w:
        assert w.wait(120) == 0, w.stderr_tail()
    got = outcomes(r, env)
    assert sorted(got) == sorted(ids) and all(len(v) == 1 for v in got.values()), "lost or written twice"
    return [(got[i][0][0], got[i][0][1].get("label"), got[i][0][1].get("scores")) for i in ids], w.events("window")


def test_first_passes_queued_early_change_nothing_but_when(triage_env, redis_url):
    env = env_with(triage_env, TRIAGE_WINDOW_MAX_ITEMS=12, TRIAGE_PASS_MAX_ITEMS=3, TRIAGE_MAX_WAIT_MS=5)
    # each pass held 0.1 s (tests.held_passes), as on a device slower than the reader: the next window is read and
    # tokenized before the window in hand finishes. Left to the tiny model's millisecond passes, whether the reader
    # was ahead was a race between three threads, lost by every window of a drain on a loaded CI box
    early, windows = _drain(env, redis_url, "on", TRIAGE_TEST_PRELOAD="tests.held_passes", TRIAGE_TEST_PASS_HOLD_S=0.1)
    assert not windows[0]["first_pass_early"]  # nothing was before it
    queued_early = sum(e["first_pass_early"] for e in windows)
    assert queued_early >= 1, [(e["window"], e["passes"]) for e in windows]  # the reader is ahead on a full stream
    assert sum(e["items"] + e["dead_lettered"] for e in windows) == N

    other = f"triage-test:{uuid.uuid4().hex[:10]}:"  # the same tickets, lookahead off, in streams of their own
    mine = env["TRIAGE_INPUT_STREAM"].removesuffix("tickets")
    off_env = env_with(env, **{k: env[k].replace(mine, other) for k in NAMES})
    try:
        plain, plain_windows = _drain(off_env, redis_url, "off")
    finally:
        delete_keys(redis_url, other)
    assert not any(e["first_pass_early"] for e in plain_windows)
    assert early == plain  # same outcome (result / dead letter), label and scores for every ticket
    assert sum(kind == "dead" for kind, _, _ in early) == N // len(TEXTS)


NAMES = (
    "TRIAGE_INPUT_STREAM",
    "TRIAGE_RESULTS_STREAM",
    "TRIAGE_DEAD_LETTER_STREAM",
    "TRIAGE_RESULT_KEY_PREFIX",
    "TRIAGE_HEARTBEAT_KEY_PREFIX",
)
