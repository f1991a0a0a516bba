"""Run ``python -m worker <args>`` as a real subprocess in tests and read its JSON logs.

Usage (``triage_env`` is the conftest fixture: tiny model, test-owned stream names,
TRIAGE_LOG_FORMAT=json)::

    from tests.worker_proc import start_worker

    with start_worker(triage_env) as w:          # `run`; returns once "worker_ready" is logged
        ...push tickets, wait for results...
        assert w.stop() == 0                     # SIGTERM, wait for exit, return code
    w.events("window")                           # parsed JSON log lines with event == "window"

    w = start_worker(env, "run", "--drain")      # any subcommand/args; ready=False to not wait
    assert w.wait(timeout_s=60) == 0

The process is forked from a server that imported torch once (tests/zygote.py) when that is
indistinguishable from ``python -m worker`` for ``env``, else started with ``python -m worker``;
``spawn="exec"`` always starts it fresh (a test of what happens at interpreter start).

Leaving the ``with`` block SIGKILLs a worker that is still running, so a failing
test never leaks a process. Every stderr line is kept (``w.lines``); the ones that
are JSON objects are also parsed (``w.logs``). ``w.stderr_tail()`` is handy in
assertion messages.

Also here: ``run_cli(env, "healthcheck")`` (a short-lived command), ``env_with`` /
``make_env`` / ``delete_keys`` (environments, also for module-scoped workers), and
``outcomes`` / ``wait_settled`` (read back results and dead letters per input entry id,
failing on anything written twice).
"""

from __future__ import annotations

import signal as signals
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tests import zygote
from worker.bench.redis_mode import log_events

REPO = Path(__file__).resolve().parent.parent
READY_EVENT = "worker_ready"


class WorkerProc:
    def __init__(self, env: dict[str, str], *args: str, spawn: str = "auto"):
        self.env = dict(env)
        self.args = list(args) or ["run"]
        self.forked = spawn != "exec" and zygote.forkable(self.env)
        self.lines: list[str] = []  # raw stderr lines
        self.logs: list[dict] = []  # the stderr lines that parsed as JSON objects
        self.stdout_lines: list[str] = []
        self.proc: subprocess.Popen | None = None
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []

    # --------------------------------------------------------------- process
    def start(self) -> WorkerProc:
        if self.forked:
            self.proc = zygote.shared().spawn(self.env, self.args)  # type: ignore[assignment]
        else:
            entry = "tests.run_worker" if self.env.get("TRIAGE_TEST_PRELOAD") else "worker"  # its hook, imported first
            self.proc = subprocess.Popen(
                [sys.executable, "-m", entry, *self.args],
                cwd=REPO,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                encoding="utf-8",
                errors="replace",
            )
        for stream, sink, parse in ((self.proc.stderr, self.lines, True), (self.proc.stdout, self.stdout_lines, False)):
            t = threading.Thread(target=self._pump, args=(stream, sink, parse), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int = signals.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def freeze(self, timeout_s: float = 10) -> None:
        """SIGSTOP, returning once the kernel says every thread of the process is stopped (state T): it sends
        nothing from here on (the main thread's state alone left the reader and keeper threads a few microseconds)."""
        self.signal(signals.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while not all(state == "T" for state in _thread_states(self.pid)):
            assert time.monotonic() < deadline, f"worker {self.pid} did not stop"
            time.sleep(0.001)

    def kill(self) -> None:
        """SIGKILL (kill -9): no shutdown code runs in the worker."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def wait(self, timeout_s: float = 60) -> int:
        """Wait for exit; the return code (raises ``subprocess.TimeoutExpired``)."""
        assert self.proc is not None
        code = self.proc.wait(timeout_s)
        for t in self._threads:
            t.join(5)
        return code

    def stop(self, sig: int = signals.SIGTERM, timeout_s: float = 60) -> int:
        """Send ``sig`` (warm shutdown by default) and wait for the exit code."""
        if self.proc is not None and self.proc.poll() is None:
            self.signal(sig)
        return self.wait(timeout_s)

    # ------------------------------------------------------------------ logs
    def events(self, name: str | None = None) -> list[dict]:
        with self._cond:
            return [r for r in self.logs if name is None or r.get("event") == name]

    def wait_for(self, match: str | Callable[[dict], bool], timeout_s: float = 60) -> dict:
        """The first log record with event == ``match`` (or for which ``match(record)`` is true).

        Raises ``AssertionError`` with the stderr tail on timeout or if the worker exits first."""
        pred = (lambda r: r.get("event") == match) if isinstance(match, str) else match
        deadline = time.monotonic() + timeout_s
        seen = 0
        with self._cond:
            while True:
                for rec in self.logs[seen:]:
                    if pred(rec):
                        return rec
                seen = len(self.logs)
                if (
                    self.proc is not None
                    and self.proc.poll() is not None
                    and not any(t.is_alive() for t in self._threads)
                ):
                    raise AssertionError(
                        f"worker exited ({self.proc.returncode}) before {match!r}:\n{self.stderr_tail()}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {match!r} log line within {timeout_s}s:\n{self.stderr_tail()}")
                self._cond.wait(min(left, 0.2))

    def wait_ready(self, timeout_s: float = 90) -> dict:
        """Block until the worker logs "worker_ready" (model loaded, group exists, heartbeat set)."""
        return self.wait_for(READY_EVENT, timeout_s)

    @property
    def consumer(self) -> str | None:
        ready = self.events(READY_EVENT)
        return ready[0].get("consumer") if ready else self.env.get("TRIAGE_CONSUMER")

    def stderr_tail(self, n: int = 40) -> str:
        with self._cond:
            return "\n".join(self.lines[-n:])

    def _pump(self, stream, sink: list[str], parse: bool) -> None:
        for line in stream:
            line = line.rstrip("\n")
            records = log_events(line) if parse else []  # the bench's reader of JSON log lines: 0 or 1 here
            with self._cond:
                sink.append(line)
                self.logs += records
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    # --------------------------------------------------------------- context
    def __enter__(self) -> WorkerProc:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


def start_worker(
    env: dict[str, str], *args: str, ready: bool = True, timeout_s: float = 90, spawn: str = "auto"
) -> WorkerProc:
    """Start ``python -m worker <args>`` (default ``run``, forked when it can be: ``spawn``); wait for
    "worker_ready" unless ``ready=False``."""
    w = WorkerProc(env, *args, spawn=spawn).start()
    if ready:
        wait_ready_or_kill(w, timeout_s)
    return w


def wait_ready_or_kill(w, timeout_s: float):
    """Wait for a started worker's "worker_ready"; kill it if it never gets there (no stray processes)."""
    try:
        w.wait_ready(timeout_s)
    except BaseException:
        w.kill()
        raise
    return w


def run_cli(env: dict[str, str], *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """A short-lived ``python -m worker <args>`` (e.g. ``healthcheck``): its exit code and output."""
    return subprocess.run(
        [sys.executable, "-m", "worker", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s
    )


def run_clis(runs: dict, timeout_s: float = 60) -> dict[object, subprocess.CompletedProcess]:
    """Independent short-lived ``python -m <argv>`` runs, ``{key: (env, argv)}``, four at a time; results by key.

    Each is mostly interpreter and import start-up: one after another, a dozen of them made a slow test."""
    from concurrent.futures import ThreadPoolExecutor

    def one(env: dict[str, str], argv: list[str]) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", *argv]
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)

    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {key: pool.submit(one, env, argv) for key, (env, argv) in runs.items()}
    return {key: f.result() for key, f in futures.items()}


def make_env(model_dir, redis_url: str, key_prefix: str, cache_dir, **overrides: object) -> dict[str, str]:
    """The same environment as conftest's ``triage_env`` fixture, for module-scoped workers
    (one process shared by several tests); delete the keys with ``delete_keys(redis_url, key_prefix)``."""
    env = zygote.base_env()
    env.update(
        TRIAGE_MODEL=str(model_dir),
        TRIAGE_DEVICE="cpu",
        TRIAGE_DTYPE="fp32",
        TRIAGE_CACHE_DIR=str(cache_dir),
        TRIAGE_REDIS_URL=redis_url,
        TRIAGE_INPUT_STREAM=key_prefix + "tickets",
        TRIAGE_RESULTS_STREAM=key_prefix + "results",
        TRIAGE_DEAD_LETTER_STREAM=key_prefix + "dead",
        TRIAGE_RESULT_KEY_PREFIX=key_prefix + "result:",
        TRIAGE_HEARTBEAT_KEY_PREFIX=key_prefix + "heartbeat:",
        TRIAGE_LOG_FORMAT="json",
    )
    return env_with(env, **overrides)


def delete_keys(redis_url: str, key_prefix: str) -> None:
    """Delete every key under ``key_prefix`` (and nothing else)."""
    import redis

    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=key_prefix + "*", count=1000))
    if keys:
        client.delete(*keys)


def env_with(env: dict[str, str], **overrides: object) -> dict[str, str]:
    """A copy of ``env`` with TRIAGE_* overrides, e.g. ``env_with(triage_env, TRIAGE_MAX_BATCH_ITEMS=4)``."""
    return {**env, **{k: str(v) for k, v in overrides.items()}}


def outcomes(client, env: dict[str, str]) -> dict[str, list[tuple[str, dict]]]:
    """Input stream id -> every ("result" | "dead", record) written for it, read from the
    results and dead-letter streams named in ``env`` (``client`` with decode_responses=True).
    More than one record for an id means it was written twice."""
    out: dict[str, list[tuple[str, dict]]] = {}
    for kind, stream in (("result", env["TRIAGE_RESULTS_STREAM"]), ("dead", env["TRIAGE_DEAD_LETTER_STREAM"])):
        for _eid, rec in client.xrange(stream):
            out.setdefault(rec.get("stream_id"), []).append((kind, rec))
    return out


def wait_settled(client, env: dict[str, str], stream_ids, timeout_s: float = 60.0) -> dict[str, tuple[str, dict]]:
    """Wait until every input entry id in ``stream_ids`` has a result or a dead letter; id -> (kind, record).

    Fails if any of them was written more than once."""
    want = set(stream_ids)
    deadline = time.monotonic() + timeout_s
    while True:
        got = outcomes(client, env)
        twice = {i: recs for i, recs in got.items() if i in want and len(recs) > 1}
        assert not twice, f"written more than once: {twice}"
        if want <= got.keys():
            return {i: got[i][0] for i in want}
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{len(want - got.keys())} of {len(want)} entries got no result or dead letter within {timeout_s}s"
            )
        time.sleep(0.1)


def _thread_states(pid: int) -> list[str]:
    """The scheduler state of each thread of ``pid`` (a thread that ended meanwhile is left out)."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            states.append((task / "stat").read_text().rpartition(")")[2].split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue
    return states
