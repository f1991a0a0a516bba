"""worker.logs.mask_url: passwords hidden, everything else kept. Pure."""

from __future__ import annotations

import pytest

from worker import redact
from worker.logs import mask_url

PW = "Pw-93kq7Z"  # long enough to be registered as a literal, and in no other part of any URL below


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch):
    monkeypatch.setattr(redact, "_known", set())


def test_mask_url_hides_passwords_only():
    assert mask_url("redis://:s3cret@host:6379/0") == "redis://:***@host:6379/0"
    assert mask_url("rediss://user:p%40ss@h/1 and redis://h2") == "rediss://user:***@h/1 and redis://h2"
    assert mask_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


# (url, what the mask shows, what must never show, what must stay readable in any text once the URL is registered)
CASES = [
    ("redis://alice:{pw}@cache.internal:6379/3", "redis://alice:***@cache.internal:6379/3", [PW], ["alice"]),
    ("redis://:{pw}@cache.internal:6379/0", "redis://:***@cache.internal:6379/0", [PW], []),
    # a lone user info may be a password that lost its ":" (redis://PASSWORD@host): masked, the host kept
    ("redis://alice@cache.internal:6379/0", "redis://***@cache.internal:6379/0", ["alice"], []),
    # ... but beside ?password= it is the user name (redis-py reads it so): shown, and not masked in other text
    (
        "rediss://alice@cache.internal:6380/1?password={pw}",
        "rediss://alice@cache.internal:6380/1?password=***",
        [PW],
        ["alice"],
    ),
    ("redis://cache.internal:6379/2?password={pw}", "redis://cache.internal:6379/2?password=***", [PW], []),
    (
        "rediss://cache.internal:6380/0?ssl_ca_certs=/etc/ca@2.pem&password={pw}",
        "rediss://cache.internal:6380/0?ssl_ca_certs=/etc/ca@2.pem&password=***",
        [PW],
        ["/etc/ca@2.pem"],
    ),
    # redis-py hands every query parameter to the connection: ssl_password unlocks the client's key
    (
        "rediss://cache.internal:6380/0?ssl_keyfile=/k.pem&ssl_password={pw}",
        "rediss://cache.internal:6380/0?ssl_keyfile=/k.pem&ssl_password=***",
        [PW],
        [],
    ),
    (
        "unix:///run/redis/redis.sock?db=4&password={pw}",
        "unix:///run/redis/redis.sock?db=4&password=***",
        [PW],
        ["/run/redis/redis.sock"],
    ),
    (  # redis-py's documented unix form: unix://[username@]/path?db=0&password=...
        "unix://alice@/run/redis.sock?db=0&password={pw}",
        "unix://alice@/run/redis.sock?db=0&password=***",
        [PW],
        ["alice"],
    ),
    # an "@" in a socket's path (a systemd instance) is no user info: the path was hidden and masked everywhere
    ("unix:///run/redis-server@main.sock?db=2", "unix:///run/redis-server@main.sock?db=2", [], ["/run/redis-server"]),
    ("redis://alice:{pw}@[2001:db8::7]:6379/5", "redis://alice:***@[2001:db8::7]:6379/5", [PW], ["alice"]),
    ("redis://:{pw}@[::1]:6379/0", "redis://:***@[::1]:6379/0", [PW], []),
    ("redis://[::1]:6380/0?password={pw}", "redis://[::1]:6380/0?password=***", [PW], []),
    # an unclosed IPv6 bracket: no URL parser reads it, the password is still found and registered
    ("redis://:{pw}@[::1:6379/0", "redis://:***@[::1:6379/0", [PW], []),
    ("redis://cache.internal:6379/0", "redis://cache.internal:6379/0", [], []),
]
IDS = [
    "user-pass",
    "pass-only",
    "user-alone",
    "user-and-query-password",
    "query-password",
    "query-password-and-at-in-ca-path",
    "ssl-password",
    "unix-socket",
    "unix-socket-with-user",
    "unix-socket-path-with-at",
    "ipv6-user-pass",
    "ipv6-pass-only",
    "ipv6-query-password",
    "ipv6-unclosed-bracket",
    "no-credentials",
]


@pytest.mark.parametrize(("url", "shown", "secrets", "kept"), CASES, ids=IDS)
def test_the_mask_hides_the_secret_and_shows_host_port_and_db(url, shown, secrets, kept):
    url = url.format(pw=PW)
    masked = mask_url(url)
    assert masked == shown
    assert not any(s in masked for s in secrets)
    assert mask_url(f"connecting to {url} failed") == f"connecting to {shown} failed"


@pytest.mark.parametrize(("url", "shown", "secrets", "kept"), CASES, ids=IDS)
def test_a_registered_url_masks_its_secrets_in_any_text_and_nothing_else(url, shown, secrets, kept):
    """What a library prints without the URL around it (an AUTH error, a repr) is masked by value; a user name or a
    socket path registered as a "secret" was masked in every line, key names and paths included."""
    redact.register_url_secrets(url.format(pw=PW))
    for s in secrets:
        assert s not in redact.mask_secrets(f"AUTH {s} failed; repr {s!r}")
    for k in kept:
        text = f"user {k} at cache.internal:6379 db 0"
        assert redact.mask_secrets(text) == text
