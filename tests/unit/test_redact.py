"""Secret masking (worker.redact): every URL form, and the literal configured secret wherever it shows up."""

from __future__ import annotations

import json

import pytest

from worker import redact

PW = "Pa55:w/rd@x&y%"  # needs percent-encoding in a URL: ":", "/", "@", "&", "%"
PW_ENC = "Pa55%3Aw%2Frd%40x%26y%25"


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch):
    monkeypatch.setattr(redact, "_known", set())


@pytest.mark.parametrize(
    "url",
    [
        f"redis://default:{PW_ENC}@127.0.0.1:6379/0",
        f"redis://:{PW_ENC}@127.0.0.1:6379/0",
        f"redis://127.0.0.1:6379/0?password={PW_ENC}",
        f"redis://127.0.0.1:6379/0?username=default&password={PW_ENC}",
        f"rediss://:{PW_ENC}@10.0.0.1:6380/1?ssl_ca_certs=/etc/ca.pem",
        f"unix:///run/redis.sock?db=0&password={PW_ENC}",
    ],
)
def test_every_url_form_is_masked_by_shape_and_by_value(url):
    assert PW_ENC not in redact.mask_url(url) and "***" in redact.mask_url(url)
    redact.register_url_secrets(url)
    decoded = f"AUTH failed for {PW}; repr {PW!r}; json {json.dumps(PW)}; raw {PW_ENC}"
    masked = redact.mask_secrets(decoded)
    assert PW not in masked and PW_ENC not in masked and "Pa55" not in masked, masked


def test_unencoded_at_sign_in_password_is_masked_whole():
    assert redact.mask_url("redis://:a@b@host:1/0") == "redis://:***@host:1/0"
    assert redact.mask_url("redis://tok3n@host") == "redis://***@host"


@pytest.mark.parametrize("pw", ["Xk9/aB3+Zq7/pL2w", "Ab#cd9Ef", "Qq?zz7Ww", "a@b/c#d?e"])
def test_an_unencoded_slash_hash_or_question_mark_in_a_password_is_masked_whole(pw):
    """A generated password (openssl rand -base64) often holds "/": a URL parser then reads the host part as ending
    there, and neither the shape nor the registered value may miss it."""
    url = f"redis://:{pw}@127.0.0.1:6379/0"
    assert redact.mask_url(f"got '{url}'") == "got 'redis://:***@127.0.0.1:6379/0'"
    redact.register_url_secrets(url)
    assert pw not in redact.mask_secrets(f"AUTH {pw} failed")


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://h:6379/0?password=ab@cdefgh", "redis://h:6379/0?password=***"),
        ("unix:///run/r.sock?db=0&password=Zq@Secr3tTail", "unix:///run/r.sock?db=0&password=***"),
        ("redis://h:6379/0?ssl_ca_certs=/a@b.pem", "redis://h:6379/0?ssl_ca_certs=/a@b.pem"),
    ],
)
def test_an_at_sign_in_the_query_is_no_user_info(url, shown):
    """Read as user info, it would hide the host and port and print the password's tail after its "@"."""
    assert redact.mask_url(url) == shown


def test_ordinary_text_is_left_alone():
    text = "forward_passes=3 prefix_tokens_reused=10 url=redis://127.0.0.1:6379/0 bypass=1"
    assert redact.mask_secrets(text) == text
    redact.register_secret("ab")  # too short to mask without mangling ordinary text
    assert redact.mask_secrets("abc") == "abc"


def test_a_short_password_is_masked_as_a_word_never_inside_event_names_or_keys():
    """TRIAGE_REDIS_URL=redis://:redis@... turned "redis_unavailable" into "***_unavailable" and the key
    "redis_url" into "***_url" in every line: the events ops alert on. A short secret is masked where it stands
    alone; one of 8+ characters anywhere."""
    redact.register_url_secrets("redis://:redis@127.0.0.1:6390/0")
    line = json.dumps(
        {"event": "redis_unavailable", "redis_url": "redis://:redis@127.0.0.1:6390/0", "error": "WRONGPASS redis"}
    )
    masked = json.loads(redact.mask_secrets(line))
    assert masked == {
        "event": "redis_unavailable",
        "redis_url": "redis://:***@127.0.0.1:6390/0",
        "error": "WRONGPASS ***",
    }
    redact.register_secret("Xy7pQ2rLm")  # long: masked inside other text too
    assert redact.mask_secrets("tokenXy7pQ2rLmtail") == "token***tail"


@pytest.mark.parametrize(
    "url",
    [
        "tw:Us3rPWzz@127.0.0.1:6391",
        "redis:/tw:Us3rPWzz@127.0.0.1:6391/0",
        "redis//tw:Us3rPWzz@127.0.0.1:6391/0",
        "tw:Us3r:PWzz@127.0.0.1",  # a user and a password, no scheme: both parts after the user hidden
    ],
)
def test_a_url_with_a_typo_in_its_scheme_still_has_its_password_masked(url):
    """No URL shape matches these, and "not a usable Redis URL (got '...')" printed the password in clear."""
    redact.register_url_secrets(url)
    masked = redact.mask_secrets(f"not a usable Redis URL (got {url!r})")
    assert "PWzz" not in masked and "***" in masked, masked


def test_a_malformed_url_without_a_password_masks_no_ordinary_word():
    redact.register_url_secrets("redis:/user@h")
    assert redact.mask_secrets("the user logged in") == "the user logged in"


# ------------------------------------------------------------ found by an audit: outputs that showed a password
def test_a_password_holding_an_at_and_a_query_is_masked_whole(capsys):
    """redis://dave:Qx7@Rt9?v=Lm3Kp8Zs@host: the shape stops at "?v=", so 14 of its 18 characters were printed."""
    url = "redis://dave:Qx7@Rt9?v=Lm3Kp8Zs@127.0.0.1:6394/0"
    redact.register_url_secrets(url)
    assert "Lm3Kp8Zs" not in redact.mask_secrets(f"worker_starting redis_url={url}")
    # a piece a library prints alone (a port that did not parse, a host read from the password)
    redact.register_url_secrets("redis://carol:ab@cd:LongFragmentSecret/x?y=z@127.0.0.1:6394/0")
    assert "LongFragmentSecret" not in redact.mask_secrets("Port could not be cast to 'LongFragmentSecret'")


def test_a_lower_case_variable_is_a_secret_too():
    """pydantic-settings reads triage_redis_url; only TRIAGE_... was registered."""
    redact.register_env_secrets({"triage_redis_url": 'redis://frank:Fr4nk"Pa55@127.0.0.1:6394/0'})
    assert "Pa55" not in redact.mask_secrets('redis: redis://frank:Fr4nk"Pa55@127.0.0.1:6394/0 reachable')


@pytest.mark.parametrize(
    "flag", [["--redis-url", 'redis://frank:Fr4nk"Pa55@h:1/0'], ["--redis-url=redis://e:Erin Pa55 w@h/0"]]
)
def test_a_usage_error_masks_a_url_the_shapes_do_not_read(flag, capsys):
    """A quote or a space in the password ends every URL shape: argparse echoed it whole (unrecognized arguments)."""
    parser = redact.MaskingArgumentParser(prog="t")
    with pytest.raises(SystemExit):
        parser.parse_args(flag)
    err = capsys.readouterr().err
    assert "unrecognized arguments" in err and "Pa55" not in err, err


def test_a_pass_index_is_no_secret_but_a_pass_parameter_is():
    assert redact.mask_secrets("event=pass window=3 pass=0 items=64") == "event=pass window=3 pass=0 items=64"
    assert "hunter2" not in redact.mask_secrets("redis://h:6379/0?pass=hunter2")


def test_an_at_in_a_parsed_urls_query_makes_no_ordinary_word_a_secret():
    """?ssl_ca_certs=/a@b.pem: the URL parses, so no piece of the long reading is registered ("host" masked in every
    heartbeat's JSON would break it)."""
    redact.register_url_secrets("rediss://:pw123@host/0?ssl_ca_certs=/etc/a@b.pem")
    assert redact.mask_secrets('{"host": "vm", "pid": 1}') == '{"host": "vm", "pid": 1}'
    assert "pw123" not in redact.mask_secrets("rediss://:pw123@host/0")
