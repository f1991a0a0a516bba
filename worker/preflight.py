"""Configuration checks that run before anything heavy: settings, TRIAGE_ variables, the task file,
the Redis URL and (optionally) Redis itself and the model's whereabouts.

Why up front: a typo used to cost a model load (18-24 s) and end in a raw traceback, or was
silently ignored (an unknown TRIAGE_ variable, a misspelt task-file key). Here every problem
is one line naming what to fix (the env var, ``file:line``), found in well under a second;
callers exit with ``EXIT_CONFIG`` (2). Imports neither torch nor transformers.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from worker.key_checks import key_name_problems
from worker.problem import Problem
from worker.redact import mask_secrets, mask_unparsed_url, register_url_secrets, unparsed_userinfo, url_userinfo

EXIT_CONFIG = 2

# TRIAGE_ names that are not settings of the worker or producer classes but are legitimately set.
OTHER_KNOWN_ENV = {
    "TRIAGE_DATA_DIR": "quality data sets directory (worker/quality/data.py)",
}
# Families owned by the test suite and the chaos harness.
ALLOWED_PREFIXES = ("TRIAGE_TEST_", "TRIAGE_CHAOS_")
# The variables Kubernetes gives every pod for each Service of its namespace (Docker-link style): a Service named
# triage-redis gives TRIAGE_REDIS_SERVICE_HOST, TRIAGE_REDIS_PORT=tcp://..., TRIAGE_REDIS_PORT_6379_TCP_ADDR, ...
_SERVICE_LINK = re.compile(
    r"^(?P<svc>[A-Z0-9_]+?)_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT(_\d+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?)?)$"
)
_DB_PATH = re.compile(r"^/?(\d+)?/?$")


# ----------------------------------------------------------------- env var names
def field_env_vars(settings_cls) -> dict[str, list[str]]:
    """Field name -> the TRIAGE_ env vars that set it (its validation aliases, deprecated names included,
    else prefix + name), for every field of a pydantic-settings class."""
    prefix = settings_cls.model_config.get("env_prefix", "")
    return {
        name: [a.upper() for a in (_alias_names(f.validation_alias) or _alias_names(f.alias) or [prefix + name])]
        for name, f in settings_cls.model_fields.items()
    }


def env_names(settings_cls) -> dict[str, str]:
    """TRIAGE_ env var -> field name, for every field of a pydantic-settings class (aliases included)."""
    return {var: name for name, env_vars in field_env_vars(settings_cls).items() for var in env_vars}


def _alias_names(alias: Any) -> list[str]:
    if alias is None:
        return []
    if isinstance(alias, str):
        return [alias]
    choices = getattr(alias, "choices", None)  # pydantic AliasChoices
    if choices is not None:
        return [c for c in choices if isinstance(c, str)]
    return []


def known_env_names() -> set[str]:
    from producer.settings import ProducerSettings
    from worker.settings import Settings

    return set(env_names(Settings)) | set(env_names(ProducerSettings)) | set(OTHER_KNOWN_ENV)  # deprecated names too


def service_link(var: str, env: Mapping[str, str]) -> str | None:
    """The Kubernetes Service whose link variable ``var`` is (``triage-redis``), else None: the name has their
    shape and the same Service's ``<NAME>_SERVICE_HOST`` is set too (a lone TRIAGE_REDIS_PORT=6380 is a mistake)."""
    m = _SERVICE_LINK.match(var)
    if m is None or f"{m['svc']}_SERVICE_HOST" not in env:
        return None
    return m["svc"].lower().replace("_", "-")


def unknown_env(environ: Mapping[str, str] | None = None, known: Iterable[str] | None = None) -> list[Problem]:
    """Every TRIAGE_ variable no part of triage reads, with the nearest known name. A Kubernetes Service named
    triage-* is not one: its link variables reach every pod of the namespace (a pod created after a Service
    named triage-redis exited 2 at every start); the manifests turn them off (``enableServiceLinks: false``)."""
    env = os.environ if environ is None else environ
    names = sorted(known if known is not None else known_env_names())
    problems = []
    for var in sorted(env):
        if not var.startswith("TRIAGE_") or var in names or var.startswith(ALLOWED_PREFIXES):
            continue
        if service_link(var, env):
            continue
        near = difflib.get_close_matches(var, names, n=1, cutoff=0.75)
        hint = f"did you mean {near[0]}?" if near else "see docs/worker.md (Settings) and docs/producer.md"
        problems.append(Problem(var, f"is not a triage setting ({hint})"))
    return problems


# ----------------------------------------------------------------- settings values
def settings_problems(exc, settings_cls, environ: Mapping[str, str] | None = None) -> list[Problem]:
    """A pydantic ValidationError as one line per field, named by the env var that set it."""
    env = os.environ if environ is None else environ
    by_field = field_env_vars(settings_cls)
    names = env_names(settings_cls)
    problems, seen = [], set()
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ())]
        field = loc[0] if loc else ""
        field = names.get(field.upper(), field)  # fields read through an alias report the alias as loc
        candidates = by_field.get(field) or [f"TRIAGE_{field.upper()}"]
        var = next((v for v in candidates if v in env), candidates[0])
        msg = err.get("msg", "invalid")
        if "input" in err and err.get("type") != "missing":
            msg += f" (got {err['input']!r:.120})"
        if service := service_link(var, env):  # a Service named triage-metrics sets TRIAGE_METRICS_PORT=tcp://...
            msg += f"; set by Kubernetes for the Service {service}? give the pod enableServiceLinks: false"
        if (var, msg) not in seen:  # one deprecated name feeding two fields is one mistake
            seen.add((var, msg))
            problems.append(Problem(var, msg))
    return problems


def redis_url_problem(url: str, var: str = "TRIAGE_REDIS_URL") -> Problem | None:
    """Parse the URL as redis-py will (no connection); one sentence if it cannot be used."""
    from urllib.parse import urlsplit

    import redis

    if not isinstance(url, str) or not url.strip():
        return Problem(var, "is empty; expected redis://host:port/db, rediss://host:port/db or unix:///path?db=0")
    try:
        pool = redis.ConnectionPool.from_url(url)
        try:  # builds, does not connect: a query option this kind of connection does not take fails here
            pool.connection_class(**pool.connection_kwargs)
        except TypeError as e:
            option = re.search(r"argument '(\w+)'", str(e))
            raise ValueError(
                f"its query option {option.group(1) if option else '?'!r} is not one a "
                f"{urlsplit(url).scheme}:// connection takes (TLS options need rediss://)"
            ) from None
        except redis.RedisError as e:  # a value it refuses: ssl_cert_reqs=bogus, protocol=5
            raise ValueError(f"a query option's value: {e}") from None
        parts = urlsplit(url)
        if parts.scheme in ("redis", "rediss"):
            if not parts.hostname:
                raise ValueError("no host name")
            if not _DB_PATH.match(parts.path or ""):
                raise ValueError(f"the path must be a database number like /0, not {parts.path!r}")
        if "#" in url:  # no Redis URL has a fragment: a "#" is a password's, and the host redis-py reads then is not
            raise ValueError("a '#' in it")
    except ValueError as e:
        userinfo = unparsed_userinfo(url) or url_userinfo(url) or ""  # the longer reading first: to the last "@"
        # redis-py's own message quotes pieces of what it misread: of the password, when it holds / # ?
        why = (
            "the password holds / # or ?, which end the host part of a URL: percent-encode it "
            "(python3 -c 'import urllib.parse,sys; print(urllib.parse.quote(sys.argv[1], safe=\"\"))' PASSWORD)"
            if any(c in userinfo for c in "/#?")
            else mask_secrets(str(e))
        )
        return Problem(
            var,
            f"is not a usable Redis URL: {why} (got {mask_unparsed_url(url)!r}; expected "
            "redis://host:port/db, rediss://host:port/db or unix:///path?db=0, a password as :PASSWORD@ "
            "before the host)",
        )
    return None


def redis_problem(url: str, timeout_s: float = 3.0, var: str = "TRIAGE_REDIS_URL") -> Problem | None:
    """PING within ``timeout_s``: unreachable, refused, wrong password -> one sentence."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    client = redis.Redis.from_url(
        url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
    )
    try:
        client.ping()
    except redis.AuthenticationError as e:
        return Problem(var, f"Redis at {mask_secrets(url)} refused the credentials: {e}")
    except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
        return Problem(var, f"cannot reach Redis at {mask_secrets(url)}: {e}")
    except redis.ResponseError as e:
        return Problem(var, f"Redis at {mask_secrets(url)} answered PING with an error: {e}")
    finally:
        client.close()
    return None


def task_problems(settings) -> list[Problem]:
    return _task(settings)[1]


def _task(settings):
    """(the task these settings describe, []) or (None, the problem)."""
    from worker.assemble import task_from_settings
    from worker.engine.task import TaskError

    try:
        return task_from_settings(settings), []
    except TaskError as e:
        where = "TRIAGE_TASK_FILE" if settings.task_file is not None else "TRIAGE_LABELS"
        return None, [Problem(where, str(e))]
    except KeyError as e:  # a label of TRIAGE_LABELS etc.; never a bare KeyError for the user
        return None, [Problem("TRIAGE_LABELS", f"unknown entry {e}")]


def file_problems(settings, *, task: bool = True, head: bool = True) -> list[Problem]:
    """TRIAGE_TASK_FILE (``task``) and TRIAGE_HEAD_PATH (``head``), when set, must be files (not directories); the
    head file a scorer head of this version, by its header."""
    out = []
    if task and settings.task_file is not None and not settings.task_file.is_file():
        out.append(Problem("TRIAGE_TASK_FILE", _not_a_file(settings.task_file)))
    head_path = getattr(settings, "head_path", None)
    if head and head_path is not None and not head_path.is_file():
        out.append(Problem("TRIAGE_HEAD_PATH", _not_a_file(head_path)))
    elif head and head_path is not None:  # its header, no torch: `check` passed a file the worker then refused
        from worker.quality.head_file import head_file_problem

        why = head_file_problem(head_path)
        if why is not None:
            out.append(Problem("TRIAGE_HEAD_PATH", why))
    return out


def _not_a_file(path) -> str:
    return f"is a directory, not a file: {path}" if path.is_dir() else f"no such file: {path}"


KIND_WORDS = {"decoder": "a causal LM", "encoder": "a BERT-family encoder"}


def model_problem(settings, *, probe_hub: bool = True, var: str = "TRIAGE_MODEL") -> Problem | None:
    """Can TRIAGE_MODEL be found without loading it (local path, bundled package, HF cache, reachable hub)?
    Beside TRIAGE_ENCODER it must be a causal LM (joined features put an encoder next to an LM)."""
    want = "decoder" if settings.encoder else None
    return backbone_problem(settings.model, var, want=want, probe_hub=probe_hub)


def encoder_problem(settings, *, probe_hub: bool = True, var: str = "TRIAGE_ENCODER") -> Problem | None:
    """TRIAGE_ENCODER, when set: found as TRIAGE_MODEL is, and an encoder by its config."""
    if not settings.encoder:
        return None
    return backbone_problem(settings.encoder, var, want="encoder", probe_hub=probe_hub)


def backbone_problem(name: str, var: str, *, want: str | None = None, probe_hub: bool = True) -> Problem | None:
    """``name`` (set by ``var``) can be found and, if ``want`` says, is that kind of model by its config.json."""
    from worker.engine.sources import ModelNotFound, check_model_available, declared_kind

    try:
        check_model_available(name, probe_hub=probe_hub, var=var)
        kind = declared_kind(name, var)
    except ModelNotFound as e:
        return Problem(var, str(e))
    if want is not None and kind is not None and kind != want:
        why = "TRIAGE_ENCODER joins an encoder's embedding to a causal LM's states"
        return Problem(var, f"{name} is {KIND_WORDS[kind]}, not {KIND_WORDS[want]} ({why})")
    return None


def scorer_problem(
    settings, task=None, *, model_var: str = "TRIAGE_MODEL", encoder_var: str = "TRIAGE_ENCODER"
) -> Problem | None:
    """Can the scorer TRIAGE_SCORER asks for work with this model and task? Found from the settings, the task
    (``task``: None skips what needs it) and the model's config.json, without loading anything: the rule
    ``scorer_plan.plan_scorer`` that ``assemble`` applies again once the model is loaded."""
    from worker.engine.sources import ModelNotFound, declared_kind
    from worker.scorer_plan import ScoringConfigError, plan_scorer

    if settings.encoder and settings.scorer == "prompt":  # joined features have no label tokens: blame the encoder
        return Problem(
            encoder_var,
            "joined features need a head, but TRIAGE_SCORER=prompt scores label tokens only "
            f"(set TRIAGE_SCORER=auto or head, or {'drop' if encoder_var.startswith('-') else 'unset'} {encoder_var})",
        )
    try:
        kind = declared_kind(settings.model, model_var)
    except ModelNotFound:
        kind = None  # model_problem says why; a hub model not cached yet has no config to read here
    if settings.scorer == "auto" and task is None:
        return None  # only ``auto`` reads the task, and there is none to read
    if kind == "encoder":
        what = f"{settings.model} ({model_var}), a BERT-family encoder,"
    else:
        what = f"joined features ({encoder_var}={settings.encoder})" if settings.encoder else settings.model
    name = settings.model + (f"+{settings.encoder}" if settings.encoder else "")  # assemble's backbone name
    try:
        plan_scorer(
            settings.scorer,
            settings.head_path,
            name,
            task,
            needs_head=kind == "encoder" or bool(settings.encoder),
            what=what,
        )
    except ScoringConfigError as e:
        return Problem(e.setting, e.text)
    return None


# ----------------------------------------------------------------- the whole check
def load_settings(settings_cls=None, environ: Mapping[str, str] | None = None, *, unknown: bool = True, **overrides):
    """(settings or None, problems): unknown TRIAGE_ variables (if ``unknown``), invalid values, the Redis URL."""
    from pydantic import ValidationError

    if settings_cls is None:
        from worker.settings import Settings as settings_cls  # noqa: N813
    problems = unknown_env(environ) if unknown else []
    try:
        settings = settings_cls(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as e:
        return None, problems + settings_problems(e, settings_cls, environ)
    register_url_secrets(settings.redis_url)  # from any source: a flag, an override, a variable in any case
    url_problem = redis_url_problem(settings.redis_url)
    if url_problem:
        problems.append(url_problem)
    return settings, problems


def settings_or_exit(prog: str, settings_cls=None, *, check_redis_url: bool = True, **overrides):
    """``load_settings`` for a command that checks nothing else up front (unknown TRIAGE_ names are not its
    business): the settings, or one ``prog: problem`` line per problem on stderr and ``SystemExit(EXIT_CONFIG)``.
    ``check_redis_url=False``: the command never talks to Redis, so a bad URL is not its problem."""
    settings, problems = load_settings(settings_cls, unknown=False, **overrides)
    if not check_redis_url:
        problems = [p for p in problems if p.where != "TRIAGE_REDIS_URL"]
    exit_on(prog, problems)
    return settings


def exit_on(prog: str, problems: list[Problem]) -> None:
    """One ``prog: problem`` line per problem on stderr and ``SystemExit(EXIT_CONFIG)``; nothing if there are none."""
    import sys

    for p in problems:
        print(f"{prog}: {p}", file=sys.stderr)
    if problems:
        raise SystemExit(EXIT_CONFIG)


def classifier_problems(
    settings, *, names: Mapping[str, str] | None = None, task: bool = True, scorer: bool = True
) -> list[Problem]:
    """What building the classifier these settings describe needs, checked without loading anything: (``task``)
    the task file and the task, the model and the encoder (found, the right kind) and (``scorer``) the head file and
    a scorer that can work with them. ``names``: the flag or variable that set ``model`` / ``encoder`` (default
    ``TRIAGE_MODEL`` / ``TRIAGE_ENCODER``). What the offline commands (``verify``; ``eval`` and ``fit`` without
    ``scorer``: they fit and measure heads) and ``triage-bench`` check before they load a model."""
    var = {"model": "TRIAGE_MODEL", "encoder": "TRIAGE_ENCODER"} | dict(names or {})
    problems = file_problems(settings, task=task, head=scorer)
    the_task = None
    if task and not any(p.where == "TRIAGE_TASK_FILE" for p in problems):  # a bad head file hides no bad task
        the_task, found = _task(settings)
        problems += found
    backbone = [
        p
        for p in (model_problem(settings, var=var["model"]), encoder_problem(settings, var=var["encoder"]))
        if p is not None
    ]
    problems += backbone
    if scorer and not backbone:
        found = scorer_problem(settings, the_task, model_var=var["model"], encoder_var=var["encoder"])
        problems += [found] if found is not None else []
    return problems


def worker_problems(settings) -> list[Problem]:
    """What the stream worker needs besides valid values: its files, its task, its models (not loaded), a scorer
    that can work with them, and keys that are not one another."""
    return classifier_problems(settings) + key_name_problems(settings)


def log_format_from_env(environ: Mapping[str, str] | None = None) -> str:
    """TRIAGE_LOG_FORMAT as given, for reporting problems when the settings themselves are invalid."""
    value = (os.environ if environ is None else environ).get("TRIAGE_LOG_FORMAT", "auto").strip().lower()
    return value if value in ("auto", "json", "console") else "auto"
