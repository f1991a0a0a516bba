"""A throw-away ``redis-server`` owned by one test: own port, own directory, own config.

Why not the shared Redis on 6379: chaos tests kill and restart the server,
set passwords and TLS, and fill it with 100,000 entries; none of that may touch
the Redis other people's tests use. AOF with ``appendfsync always`` means a
write Redis acknowledged survives ``kill -9`` of the server, so "lost = 0" after
a server crash is a property of the worker, not luck of the last snapshot.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import redis

from worker.redis_server import PrivateRedis, find_server_binary

# PATH first, then the embedded-redis extra (worker.redis_server): chaos tests run on a machine without Redis too
_BINARY = find_server_binary()
REDIS_SERVER = _BINARY.path if _BINARY else None


def server_supports_tls() -> bool:
    """True if the installed redis-server was built with TLS (it then links libssl)."""
    if not REDIS_SERVER:
        return False
    try:
        out = subprocess.run(["ldd", REDIS_SERVER], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "libssl" in out


@dataclass
class TlsFiles:
    ca: Path
    cert: Path
    key: Path


def make_tls_files(directory: Path) -> TlsFiles:
    """A self-signed CA and a server certificate for 127.0.0.1/localhost, made with ``openssl``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, cert = d / "ca.key", d / "ca.pem", d / "server.key", d / "server.csr", d / "server.pem"
    ext = d / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def ossl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    ossl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(ca_key),
        "-out",
        str(ca),
        "-days",
        "2",
        "-subj",
        "/CN=triage-test-ca",
    )
    ossl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1")
    ossl(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca),
        "-CAkey",
        str(ca_key),
        "-CAcreateserial",
        "-out",
        str(cert),
        "-days",
        "2",
        "-extfile",
        str(ext),
    )
    return TlsFiles(ca=ca, cert=cert, key=key)


@dataclass
class RedisServer(PrivateRedis):
    """``worker.redis_server.PrivateRedis`` with what chaos tests add: every write fsynced before it is acknowledged
    (AOF ``always``), a password, ACL users, TLS, and URLs with those. ``restart`` keeps the port and the data."""

    appendonly: bool = True
    appendfsync: str = "always"
    password: str | None = None
    acl_users: dict[str, str] = field(default_factory=dict)  # name -> password
    acl_rules: dict[str, str] = field(default_factory=dict)  # name -> ACL rules (default: full access)
    tls: TlsFiles | None = None

    # ------------------------------------------------------------------ urls / clients
    @property
    def url(self) -> str:
        return self.url_as()

    def url_as(self, *, user: str | None = None, password: str | None = None, db: int = 0) -> str:
        """URL for the default user (its password if set) or for ``user``; TLS gives rediss:// with the CA."""
        password = password if password is not None else (self.acl_users.get(user) if user else self.password)
        auth = ""
        if user:
            auth = f"{quote(user, safe='')}:{quote(password or '', safe='')}@"
        elif password:
            auth = f":{quote(password, safe='')}@"
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/{db}?ssl_ca_certs={self.tls.ca}"
        return f"redis://{auth}127.0.0.1:{self.port}/{db}"

    def client(self, **kw) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=30, **kw)

    # ------------------------------------------------------------------ what PrivateRedis leaves open
    def listen_lines(self) -> list[str]:
        if not self.tls:
            return super().listen_lines()
        return [
            "port 0",
            f"tls-port {self.port}",
            f"tls-cert-file {self.tls.cert}",
            f"tls-key-file {self.tls.key}",
            f"tls-ca-cert-file {self.tls.ca}",
            "tls-auth-clients no",
        ]

    def config(self) -> str:
        lines = ["protected-mode no"]
        if self.password:
            lines.append(f"requirepass {self.password}")
        for name, pw in self.acl_users.items():
            lines.append(f"user {name} on >{pw} {self.acl_rules.get(name, '~* &* +@all')}")
        return super().config() + "\n".join(lines) + "\n"

    def ready(self) -> bool:
        """A PING through redis-py, which speaks TLS (the raw one does not); ``LOADING`` the AOF is not ready."""
        try:
            c = self.client(socket_connect_timeout=1)
            try:
                return bool(c.ping())
            finally:
                c.close()
        except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.BusyLoadingError):
            return False
        except redis.ResponseError as e:
            if str(e).startswith("LOADING"):
                return False
            raise

    def start(self, timeout_s: float = 20.0) -> RedisServer:
        if not REDIS_SERVER:
            raise RuntimeError("no redis-server: neither on PATH nor from the embedded-redis extra")
        super().start(timeout_s)
        return self

    def restart(self, *, down_s: float = 0.0, crash: bool = True) -> None:
        """Crash (or stop) and start again on the same port with the same data, after ``down_s`` seconds."""
        self.crash() if crash else self.stop()
        time.sleep(down_s)
        self.start()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def rss_kb(self) -> int | None:
        return read_rss_kb(self.pid) if self.pid else None


def read_rss_kb(pid: int) -> int | None:
    """VmRSS of a live process in kB from /proc (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None


def kill_quietly(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
