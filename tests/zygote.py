"""A fork server for worker processes: import torch/transformers/worker once, then fork a
fresh ``python -m worker <args>`` (or ``rq <args>``: the RQ batch worker) equivalent per request.

Why: the integration tests start dozens of workers; each cold start spends ~7 of its ~9 s of
CPU (2-core box) importing torch and transformers, the largest single cost of the suite.
A forked child is still a real, separate OS process running the unchanged entry point
(``worker.cli.main(args)``, errors through the excepthook it installs) with its own
environment, stdout/stderr pipes, signals and exit code; only the imports are inherited (the
way rq's forking workers run jobs). ``tests.worker_proc.start_worker`` forks when it can
(``forkable``); ``TRIAGE_TEST_SPAWN=exec`` starts every worker with ``python -m worker`` instead.

Protocol (AF_UNIX SOCK_SEQPACKET, one JSON object per message):
  test -> server: {"spawn": n, "env": {...}, "args": [...], "cwd": "..."} + fds [stdout, stderr]
  server -> test: {"ready": true} | {"spawned": n, "pid": p} | {"exited": p, "code": c}
The server is single-threaded (forking a multi-threaded process is unsafe) and reaps its
children itself, so it reports their exit codes; EOF on the socket kills the children.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import select
import signal
import socket
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_MSG = 1 << 20
# fork (default): workers are forked from a server that imported torch once; exec: `python -m worker`
SPAWN = os.environ.get("TRIAGE_TEST_SPAWN", "fork").strip().lower()
# set per test or per xdist process: never read by the worker, so they may differ from the server's
_PER_TEST = ("TRIAGE_", "PYTEST_")
# set by the worker itself as it starts (worker/engine/device.py: tokenizer threads, read by tokenizers when it
# first tokenizes; worker/logs.py: no progress bars on JSON logs, switched off in the libraries already
# imported too): a test that ran worker code in-process leaves them in os.environ, which must not make every
# later worker a cold start
_SET_AT_RUN_TIME = {"RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM", "TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS"}


# ---------------------------------------------------------------------- server
def _preload() -> None:
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import worker.cli  # noqa: F401
    import worker.engine.classifier  # noqa: F401
    import worker.stream.loop  # noqa: F401
    from worker.cli import build_parser

    build_parser()  # imports every command module


def _child(env: dict, args: list[str], cwd: str, out_fd: int, err_fd: int, sock: socket.socket) -> None:
    code = 1
    try:
        sock.close()
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        os.close(out_fd)
        os.close(err_fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        if args[:1] == ["rq"]:  # RQ's own CLI (`rq worker --worker-class worker.rqbatch.BatchWorker ...`)
            from rq.cli import main as rq_main

            sys.argv = list(args)
            rq_main(args=args[1:], prog_name="rq")  # click: exits with the command's code
            code = 0
        else:
            sys.argv = ["worker", *args]
            if env.get("TRIAGE_TEST_PRELOAD"):  # a test's hook into the real worker (tests.held_passes)
                importlib.import_module(env["TRIAGE_TEST_PRELOAD"])
            from worker.cli import main

            code = int(main(args) or 0)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:  # noqa: BLE001 - what the interpreter does: the excepthook main installed, exit 1
        sys.excepthook(type(e), e, e.__traceback__)
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    _preload()
    sock.send(json.dumps({"ready": True}).encode())
    children: set[int] = set()
    try:
        while True:
            while children:  # reap
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                children.discard(pid)
                sock.send(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode())
            r, _, _ = select.select([sock], [], [], 0.02)
            if not r:
                continue
            data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MSG, 2)
            if not data:
                return
            req = json.loads(data)
            pid = os.fork()
            if pid == 0:
                _child(req["env"], req["args"], req["cwd"], fds[0], fds[1], sock)
            for f in fds:
                os.close(f)
            children.add(pid)
            sock.send(json.dumps({"spawned": req["spawn"], "pid": pid}).encode())
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# ---------------------------------------------------------------------- client
class ForkedProcess:
    """Enough of ``subprocess.Popen`` for tests.worker_proc.WorkerProc: pid, poll, wait, signals, pipes."""

    def __init__(self, server: Zygote, pid: int, stdout, stderr):
        self._server = server
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr

    @property
    def returncode(self) -> int | None:
        return self._server.codes.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        with self._server.cond:
            if not self._server.cond.wait_for(lambda: self.pid in self._server.codes, timeout):
                raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout)
            return self._server.codes[self.pid]

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Zygote:
    """Client side: starts the server process and hands out ForkedProcess objects."""

    def __init__(self, env: dict[str, str], ready_timeout_s: float = 300):
        import subprocess

        self.env = dict(env)
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.cond = threading.Condition()
        self.codes: dict[int, int] = {}
        self.spawned: dict[int, int] = {}
        self.ready = False
        self._n = 0
        self._send_lock = threading.Lock()
        threading.Thread(target=self._listen, name="zygote-listen", daemon=True).start()
        with self.cond:
            if (
                not self.cond.wait_for(lambda: self.ready or self.proc.poll() is not None, ready_timeout_s)
                or not self.ready
            ):
                raise RuntimeError(f"the worker fork server did not start (exit {self.proc.poll()})")

    def _listen(self) -> None:
        while True:
            try:
                data = self.sock.recv(MAX_MSG)
            except OSError:
                data = b""
            with self.cond:
                if not data:
                    self.ready = False
                    self.cond.notify_all()
                    return
                msg = json.loads(data)
                if "ready" in msg:
                    self.ready = True
                elif "spawned" in msg:
                    self.spawned[msg["spawned"]] = msg["pid"]
                    self.codes.pop(msg["pid"], None)  # an earlier child's, its pid reused: not this one's code
                elif "exited" in msg:
                    self.codes[msg["exited"]] = msg["code"]
                self.cond.notify_all()

    def spawn(self, env: dict[str, str], args: list[str], timeout_s: float = 60, output=None) -> ForkedProcess:
        """Fork ``python -m worker <args>`` (or ``rq <args[1:]>`` when args[0] is "rq"); its stdout and stderr are
        pipes, or both go to ``output`` (an open file) when given."""
        if output is not None:
            out_r = err_r = None
            out_w, err_w = os.dup(output.fileno()), os.dup(output.fileno())
        else:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
        with self._send_lock:
            self._n += 1
            n = self._n
            msg = json.dumps({"spawn": n, "env": env, "args": list(args), "cwd": str(REPO)}).encode()
            socket.send_fds(self.sock, [msg], [out_w, err_w])
        os.close(out_w)
        os.close(err_w)
        with self.cond:
            if not self.cond.wait_for(lambda: n in self.spawned, timeout_s):
                raise RuntimeError("the worker fork server did not answer")
            pid = self.spawned.pop(n)
        if out_r is None:
            return ForkedProcess(self, pid, None, None)
        stdout = os.fdopen(out_r, "r", encoding="utf-8", errors="replace")
        stderr = os.fdopen(err_r, "r", encoding="utf-8", errors="replace")
        return ForkedProcess(self, pid, stdout, stderr)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # EOF for the server even while our listener blocks in recv
            self.sock.close()
        finally:
            try:
                self.proc.wait(timeout=15)
            except Exception:  # noqa: BLE001
                self.proc.kill()
                self.proc.wait(timeout=10)


def base_env() -> dict[str, str]:
    """Every test worker's environment before its TRIAGE_* settings (the server's too): this process's without
    per-test variables, offline, and one OpenMP thread (workers beside pytest on 2 cores: no oversubscription)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_PER_TEST)}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    return env


def _import_time(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith(_PER_TEST) and k not in _SET_AT_RUN_TIME}


def forkable(env: dict[str, str]) -> bool:
    """Whether a child forked from the server behaves as ``python -m worker`` with ``env`` would.

    The worker reads TRIAGE_* when it runs, but the interpreter, torch, transformers and huggingface_hub
    read other variables (HF_HUB_OFFLINE, HF_HUB_CACHE, OMP_NUM_THREADS, PYTHONPATH...) when imported,
    which in a child happened in the server. So: fork only when every other variable is the server's."""
    if SPAWN == "exec":
        return False
    server_env = _shared[0].env if _shared else base_env()
    return _import_time(env) == _import_time(server_env)


_shared: list[Zygote] = []
_shared_lock = threading.Lock()


def shared() -> Zygote:
    """This test process's fork server, started on first use (its imports are paid once) and closed at exit."""
    with _shared_lock:
        if not _shared:
            _shared.append(Zygote(base_env()))
            atexit.register(_shared[0].close)
        return _shared[0]


if __name__ == "__main__":
    serve(int(sys.argv[1]))
