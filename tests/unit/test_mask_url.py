"""worker.logs.mask_url: passwords hidden, everything else kept. Pure."""

from __future__ import annotations

from worker.logs import mask_url


def test_mask_url_hides_passwords_only():
    assert mask_url("redis://:s3cret@host:6379/0") == "redis://:***@host:6379/0"
    assert mask_url("rediss://user:p%40ss@h/1 and redis://h2") == "rediss://user:***@h/1 and redis://h2"
    assert mask_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


# ---------------------------------------------- isolation, window, outcome
