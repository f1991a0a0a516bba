"""Masking secrets in anything a process prints: URLs with credentials, ``password=`` pairs, known values.

Why three layers: a URL's password can sit in its user info (``redis://user:pw@``,
``redis://:pw@``) or its query (``?password=pw``, ``unix:///s.sock?password=pw``); a library
may print the value without the URL around it (an exception, a repr of a settings object);
and it may appear percent-encoded or JSON-escaped. So every output path masks URL shapes
AND the literal secret values this process was configured with (``register_url_secrets``).
Pure: no logging, no Redis.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from urllib.parse import parse_qsl, quote, unquote, urlsplit

MASK = "***"
_MIN_SECRET_CHARS = 3  # shorter literals would mask ordinary text
# A shorter registered secret is masked only where it stands as a word of its own: a password "redis" masked
# everywhere turned the event redis_unavailable into ***_unavailable and the key redis_url into ***_url (the lines
# ops alert on); a longer one everywhere.
_ANYWHERE_SECRET_CHARS = 8

# scheme://userinfo@ — greedy up to the LAST "@" of the token: a password may hold an unencoded "@", "/", "#" or
# "?" (a generated one often does), which a URL parser reads as the path or query. Never across a query parameter
# ("?key="): an "@" in the query (?password=a@b, ?ssl_ca_certs=/a@b.pem) is no user info. Never starting with "/":
# that is an empty authority and a path (unix:///run/redis-server@main.sock), whose "@" is part of the path.
_URL_USERINFO = re.compile(
    r"(?P<scheme>\b[a-z][a-z0-9+.-]*://)(?P<userinfo>(?!/)(?:(?![?&][\w.-]*=)[^\s'\"<>])*)@", re.I
)
# password=..., ?password=..., &token=..., password='...' (a repr), ssl_password=... (redis-py passes any query
# parameter on: rediss://...?ssl_password= unlocks the client key): the value up to a separator
_SECRET_PAIR = re.compile(
    r"(?P<key>(?<![a-z0-9_])(?:(?:[a-z0-9]+_)*(?:password|passwd|secret)|pwd|(?<=[?&])pass|token|access_token|api_key"
    r"|apikey|auth)\s*(?:=|%3D)\s*)(?P<quote>['\"]?)(?P<value>[^\s&;#'\",)}\]]+)",
    re.I,
)  # a bare "pass=" only as a URL's query parameter: the console log's pass=0 (a pass's index) is no secret
SECRET_QUERY_KEYS = frozenset(
    {"password", "passwd", "pwd", "pass", "secret", "token", "access_token", "api_key", "apikey", "auth"}
)
_SECRET_KEY_SUFFIXES = ("_password", "_passwd", "_secret")
# the rest of a URL's token after its user info: does it carry the password redis-py reads (?password=, &password=)?
_QUERY_PASSWORD = re.compile(r"[^\s'\"<>]*?[?&]password=[^\s&;#'\"<>]", re.I)

_known: set[str] = set()
_PIECE_CHARS = 4  # a piece of a password cut at / ? # @ = & masked on its own from this length


def is_secret_key(key: str) -> bool:
    """A query parameter (or ``key=`` pair) whose value is a secret: ``password``, ``token``, ``ssl_password``..."""
    k = key.lower()
    return k in SECRET_QUERY_KEYS or k.endswith(_SECRET_KEY_SUFFIXES)


def _mask_userinfo(m: re.Match) -> str:
    userinfo = m["userinfo"]
    if ":" in userinfo:
        return f"{m['scheme']}{userinfo.split(':', 1)[0]}:{MASK}@"
    if userinfo and _QUERY_PASSWORD.match(m.string, m.end()):
        return m[0]  # the password is in the query, so this is the user name (redis-py reads it so): kept
    # a lone user info may be a password that lost its ":" (redis://PASSWORD@host) or a token: not worth the risk
    return f"{m['scheme']}{MASK}@"


def mask_secrets(text: str) -> str:
    """``text`` with URL credentials, ``password=`` style pairs and every registered secret masked."""
    if not text:
        return text
    text = mask_values(text, _known)
    if "://" in text and "@" in text:
        text = _URL_USERINFO.sub(_mask_userinfo, text)
    if "=" in text or "%3" in text:
        text = _SECRET_PAIR.sub(lambda m: f"{m['key']}{m['quote']}{MASK}", text)
    return text


def mask_values(text: str, secrets) -> str:
    """``text`` with each of these literal values masked, longest first (a short one only as a word of its own)."""
    for secret in sorted(secrets, key=len, reverse=True):
        if len(secret) < _MIN_SECRET_CHARS or secret not in text:
            continue
        if len(secret) >= _ANYWHERE_SECRET_CHARS:
            text = text.replace(secret, MASK)
        else:
            text = re.sub(rf"(?<!\w){re.escape(secret)}(?!\w|://)", MASK, text)  # not a URL's scheme
    return text


def mask_url(url: str) -> str:
    """A URL (or any text) safe to print: ``redis://u:***@h:6379/0?password=***``."""
    return mask_secrets(url)


def mask_with_url_secrets(text: str, url: str) -> str:
    """``text`` (the URL itself, or a library's message about it) with the secrets ``url`` holds masked, registered
    or not: the URL shapes miss a password with a space or a quote in it (a settings repr printed it in clear). Its
    pieces too (cut at / ? # @ : = &): a library that misread the URL quotes one ("as 'my pass'")."""
    secrets = set(url_secrets(url))
    secrets |= {p for s in secrets for p in re.split(r"[@:/?#=&]", s) if len(p) >= _PIECE_CHARS}
    return mask_secrets(mask_values(text, secrets))


def register_secret(value: str | None) -> None:
    """Mask ``value`` wherever it appears in output from now on (also percent-encoded or JSON-escaped)."""
    if not value or len(value) < _MIN_SECRET_CHARS:
        return
    forms = {
        value,
        quote(value, safe=""),
        quote(value),
        json.dumps(value)[1:-1],
        json.dumps(value, ensure_ascii=False)[1:-1],
        repr(value)[1:-1],
    }
    _known.update(f for f in forms if len(f) >= _MIN_SECRET_CHARS)


def url_secrets(url: str | None) -> list[str]:
    """The secret values inside a URL: the user-info password (or lone user info) and secret query parameters."""
    if not url or not isinstance(url, str):
        return []
    out: list[str] = []
    try:
        parts = urlsplit(url.strip())
        netloc, query = parts.netloc, parts.query
    except ValueError:  # e.g. an unclosed IPv6 bracket: the mask's shape still finds the user info
        netloc, query = "", url.partition("?")[2]
    # the parser's user info, and the mask's: an unencoded / # ? in the password ends the parser's host part
    # early, so its user info is a piece of the password or nothing
    found = {netloc.rsplit("@", 1)[0] if "@" in netloc else None, url_userinfo(url)}
    if found == {None}:  # no user info a URL parser or the mask's shape finds: a scheme with a typo?
        out += loose_secrets(url)
    greedy = unparsed_userinfo(url)  # to the token's last "@", across "?x=" and "#": a password may hold both
    if greedy and ":" in greedy:  # (redis://:ab?c=d@host; redis://u:Qx7@Rt9?v=Lm3@host, whose query reading is short)
        password = greedy.split(":", 1)[1]
        out += [password, unquote(password)]
        if _unparsed(url) or "#" in url:  # pieces of it a library may print alone (a port that did not parse, a host
            # read from it); not for a URL that parses: an "@" in its query (?ssl_ca_certs=/a@b.pem) would make "host"
            # and the like secrets
            out += [p for p in re.split(r"[@:/?#=&]", password) if len(p) >= _PIECE_CHARS and p != password]
    has_query_password = any(k.lower() == "password" and v for k, v in _pairs(query))
    for userinfo in found - {None}:
        if ":" not in userinfo and has_query_password:
            continue  # the user name (the password is in the query): no secret, and masked it would mangle text
        out.append(unquote(userinfo.split(":", 1)[1]) if ":" in userinfo else unquote(userinfo))
        out.append(userinfo.split(":", 1)[1] if ":" in userinfo else userinfo)
    for k, v in parse_qsl(query, keep_blank_values=False):
        if is_secret_key(k):
            out.append(v)
    for k, v in _pairs(query):
        if is_secret_key(k) and v:
            out.append(v)  # the raw, still percent-encoded form
        key, eq, value = unquote(k).partition("=")  # an encoded "=" (password%3Dpw): no pair to redis-py, still pw
        if eq and is_secret_key(key) and value:
            out += [value, re.split("%3d", k, maxsplit=1, flags=re.I)[-1]]  # and as it was written
    return [s for s in out if s]


def _pairs(query: str) -> list[tuple[str, str]]:
    """A query's raw ``key=value`` pairs, nothing decoded."""
    return [(k, v) for k, _, v in (piece.partition("=") for piece in query.split("&"))]


def loose_secrets(url: str) -> list[str]:
    """What may be a password in a malformed URL (``tw:pw@host``, ``redis:/u:pw@host``, ``redis//u:pw@h``: a typo in
    the scheme), which no URL shape masks: whatever follows each ":" before the last "@" (the part before the first
    one may be a scheme or a user name, so each is taken), but not a ":/" (a scheme's: ``redis:/user@h`` has no
    password, and its user name masked everywhere would mangle ordinary text)."""
    head = re.split(r"[?&][\w.-]*=", url.strip(), maxsplit=1)[0]
    if "@" not in head:
        return []
    before = head.rsplit("@", 1)[0]
    return [before[i + 1 :] for i, c in enumerate(before) if c == ":" and before[i + 1 : i + 2] not in ("", "/")]


# scheme://...@ up to the LAST "@" of the token, across a "?": only for a URL that does not parse, whose password
# may hold an unencoded "?x=" (redis://:ab?c=d@host reads as host "", port "ab", query "c=d@host")
_UNPARSED_USERINFO = re.compile(r"\s*(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<userinfo>[^\s'\"<>]*)@", re.I)


def unparsed_userinfo(url: str) -> str | None:
    """The user info of a URL that does not parse, read to its last "@" (a "?" in it is taken as the password's)."""
    m = _UNPARSED_USERINFO.match(url)
    return m["userinfo"] if m else None


def mask_unparsed_url(url: str) -> str:
    """A URL that does not parse, safe to print: everything from its scheme to its last "@" masked, then as
    ``mask_secrets``. The parser's reading of where the password ends is what failed, so no shape is trusted."""
    m = _UNPARSED_USERINFO.match(url)
    if m:
        url = f"{m['scheme']}{MASK}@{url[m.end() :]}"
    return mask_secrets(url)


def _unparsed(url: str) -> bool:
    """Whether ``url``'s host part does not parse (a port that is no number, an unclosed IPv6 bracket)."""
    try:
        _ = urlsplit(url.strip()).port  # parsed only when asked for
    except ValueError:
        return True
    return False


def url_userinfo(url: str) -> str | None:
    """The user info of a URL as the mask reads it (up to the last "@" before any query parameter), or None."""
    m = _URL_USERINFO.match(url.strip())
    return m["userinfo"] if m else None


def register_url_secrets(url: str | None) -> None:
    for s in url_secrets(url):
        register_secret(s)


def register_env_secrets(environ: dict | None = None) -> None:
    """Secrets of every ``*_URL`` variable of the TRIAGE_ family (TRIAGE_REDIS_URL, ...), whatever parses them later;
    in any case (pydantic-settings reads ``triage_redis_url`` too)."""
    env = os.environ if environ is None else environ
    for name, value in env.items():
        if name.upper().startswith("TRIAGE_") and name.upper().endswith("_URL"):
            register_url_secrets(value)


def masked_repr_args(args):
    """A settings class's ``__repr_args__`` with every ``*_url`` value masked (``redis://u:***@h``): a log line that
    formats the settings printed the Redis password in clear. The attributes and ``model_dump()`` keep the real URL."""
    for name, value in args:
        yield (
            name,
            mask_with_url_secrets(value, value)
            if isinstance(name, str) and name.endswith("_url") and isinstance(value, str)
            else value,
        )


def install_excepthook() -> None:
    """Uncaught exceptions print a plain traceback (no locals) with secrets masked, as the last resort."""
    import sys
    import traceback

    def hook(exc_type, exc, tb) -> None:
        sys.stderr.write(mask_secrets("".join(traceback.format_exception(exc_type, exc, tb))))
        sys.stderr.flush()

    sys.excepthook = hook


class MaskingArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors mask secrets: argparse echoes what it could not parse
    (``unrecognized arguments: --redis-url redis://u:PASSWORD@h``), before any secret is registered.
    Subparsers are made of the same class."""

    def parse_known_args(self, args=None, namespace=None):
        """Every argument that may hold a URL's secrets is registered before argparse can echo it (a usage error)."""
        import sys

        for token in sys.argv[1:] if args is None else args:
            if isinstance(token, str) and ("://" in token or "@" in token):
                register_url_secrets(token.split("=", 1)[1] if token.startswith("-") and "=" in token else token)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        super().error(mask_secrets(message))
